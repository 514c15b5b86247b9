"""A set of three lighthouses (I10): one serves at a time; killing it costs the job
about a heartbeat timeout of stall, never a group restart, never a step with two
states, and quorum ids keep rising across the leaders."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import phalanx
from phalanx import _core
from test_hosts import (
    LIGHTHOUSE_PORT,
    TOKEN,
    TRAIN,
    Host,
    assert_one_state_per_step,
    committed_steps,
    committed_with,
    ip,
    on_one_switch,
    step_of,
)
from test_partitions import until
from test_transaction import TRAIN as FT_TRAIN
from test_transaction import assert_bit_identical, committed, start_rank

from conftest import Child, commit_after, free_port, http_get, lighthouse_argv

HEARTBEAT_TIMEOUT = 2.0
JOIN_TIMEOUT = 0.3
#: The stall the issue allows, plus room for a machine shared with other test runs.
STALL_ALLOWED = HEARTBEAT_TIMEOUT + 0.5
SLACK_ON_A_BUSY_MACHINE = 1.5


def set_argv(addresses: list[str], i: int, tmp_path, *flags: str) -> list[str]:
    """The command line of member `i` (from 1) of the set on `addresses`."""
    argv = lighthouse_argv(addresses[i - 1], "--peers", ",".join(addresses), "--id", str(i))
    argv += ["--state-file", str(tmp_path / f"lighthouse-{i}.raft")]
    argv += ["--heartbeat-timeout", f"{HEARTBEAT_TIMEOUT}s"]
    argv += ["--join-timeout", f"{JOIN_TIMEOUT}s"]
    return argv + list(flags)


def start_set(
    spawn: Callable[..., Child],
    tmp_path,
    *flags: str,
    addresses: list[str] | None = None,
) -> tuple[list[Child], list[str]]:
    """Three `phalanx lighthouse --peers` processes on loopback, with `flags`."""
    addresses = addresses or [f"127.0.0.1:{free_port()}" for _ in range(3)]
    children = []
    for i in range(1, 4):
        child = spawn(f"lighthouse-{i}", set_argv(addresses, i, tmp_path, *flags))
        child.expect(lambda line: "listening" in line.get("text", ""), 30, "listens")
        children.append(child)
    return children, addresses


def set_view(address: str, token: str | None = None) -> dict | None:
    try:
        code, body = http_get(f"http://{address}/status", token, timeout=1.0)
    except OSError:
        return None
    return json.loads(body)["lighthouses"] if code == 200 else None


def serving(addresses: list[str], timeout: float, token: str | None = None) -> int:
    """The index of the lighthouse that serves, once one does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i, address in enumerate(addresses):
            view = set_view(address, token)
            if view and view["serving"]:
                return i
        time.sleep(0.05)
    pytest.fail(f"no lighthouse of {addresses} serves within {timeout} s")


def test_a_single_lighthouse_refuses_a_set_of_fewer_than_three():
    with pytest.raises(ValueError, match="at least 3"):
        phalanx.LighthouseServer(peers=["127.0.0.1:1", "127.0.0.1:2"], id=1)


def test_a_lighthouse_that_does_not_serve_names_the_one_that_does(spawn, tmp_path):
    _, addresses = start_set(spawn, tmp_path)
    leader = serving(addresses, 30)
    other = addresses[(leader + 1) % 3]
    view = set_view(other)
    assert view["leader"] == leader + 1 and not view["serving"], view
    assert view["members"][leader]["address"] == addresses[leader]
    # A client given only a non-serving lighthouse is told which one serves.
    client = phalanx.LighthouseClient(other)
    with pytest.raises(Exception, match=f"lighthouse {leader + 1} at {addresses[leader]} does"):
        client.quorum(replica_id="probe", timeout=1.0)


@pytest.mark.slow
def test_killing_the_serving_lighthouse_costs_a_heartbeat_timeout(spawn, tmp_path):
    lighthouses, addresses = start_set(spawn, tmp_path)
    leader = serving(addresses, 30)
    ranks = [start_rank(spawn, ",".join(addresses), name, steps=100000) for name in ("a", "b")]
    for rank in ranks:
        rank.expect(
            lambda line: line.get("committed") and line["participants"] == 2,
            90,
            "training with both groups",
        )
    for rank in ranks:
        rank.expect(lambda line: line.get("committed"), 30, "one more step")
    lighthouses[leader].signal(signal.SIGKILL)
    killed_at = time.time()
    new_leader = serving([a for i, a in enumerate(addresses) if i != leader], 30)
    commit_after(
        ranks,
        killed_at,
        "training with both groups after the failover",
        60,
        margin=0,
        participants=2,
    )
    for rank in ranks:
        rank.expect(lambda line: line.get("committed"), 30, "another step")

    stalls = []
    for rank in ranks:
        assert rank.proc.poll() is None, f"{rank.name} restarted or died"
        times = [line["t"] for line in committed(rank)]
        before = max(t for t in times if t <= killed_at)
        after = min(t for t in times if t > killed_at)
        stalls.append(after - before)
        ids = [line["quorum_id"] for line in committed(rank)]
        assert ids == sorted(ids), f"{rank.name}: quorum ids went back: {ids}"
    stall = max(stalls)
    print(json.dumps({"failover_stall_s": round(stall, 3), "new_leader": new_leader}))
    assert stall < STALL_ALLOWED + SLACK_ON_A_BUSY_MACHINE, stalls
    assert assert_bit_identical(ranks) > 0


@pytest.fixture
def three_hosts() -> Iterator[dict[str, Host]]:
    """Three hosts on one switch, h1 to h3, each for a lighthouse and a group."""
    with on_one_switch("h1", "h2", "h3") as (network, made):
        yield {**made, "switch": Host(network.switch, "")}


def cut(hosts: dict[str, Host], name: str, up: bool) -> None:
    """Takes `name`'s link to the switch down (a partition: no resets, only silence)
    or back up."""
    ip("-n", hosts["switch"].namespace, "link", "set", f"to-{name}", "up" if up else "down")


NAMES = ("h1", "h2", "h3")


def start_hosts_set(hosts: dict[str, Host], spawn: Callable[..., Child], tmp_path) -> str:
    """A lighthouse on each host; returns the list the groups take."""
    addresses = [f"{hosts[n].address}:{LIGHTHOUSE_PORT}" for n in NAMES]
    peers = ",".join(addresses)
    for i, name in enumerate(NAMES, start=1):
        argv = lighthouse_argv(addresses[i - 1], "--peers", peers, "--id", str(i))
        argv += ["--token", TOKEN]
        argv += ["--state-file", str(tmp_path / f"{name}.raft")]
        argv += ["--join-timeout", "500ms", "--heartbeat-timeout", "2s"]
        child = spawn(f"lighthouse-{name}", hosts[name].command(argv))
        child.expect(lambda line: "listening" in line.get("text", ""), 30, "listens")
    return peers


def view_on(hosts: dict[str, Host], name: str) -> dict | None:
    """What the lighthouse on host `name` says of the set, asked from that host."""
    url = f"http://{hosts[name].address}:{LIGHTHOUSE_PORT}/status"
    probe = hosts[name].command([sys.executable, "-c", PROBE, url])
    done = subprocess.run(probe, capture_output=True, text=True, timeout=10)
    return json.loads(done.stdout)["lighthouses"] if done.returncode == 0 else None


def serving_host(hosts: dict[str, Host], among: tuple[str, ...], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in among:
            view = view_on(hosts, name)
            if view and view["serving"]:
                return name
        time.sleep(0.2)
    pytest.fail(f"no lighthouse among {among} serves within {timeout} s")


def start_host_group(hosts: dict[str, Host], spawn: Callable[..., Child], name: str, peers: str):
    host = hosts[name]
    launcher = [sys.executable, "-m", "phalanx", "run", "--replicas", "1"]
    launcher += ["--replica-id", f"group-{name}", "--lighthouse", peers]
    launcher += ["--token", TOKEN, "--master-addr", host.address]
    launcher += ["--restart-backoff", "0.1", "--", *TRAIN]
    return spawn(f"group-{name}", host.command(launcher), {"PHALANX_ADVERTISE_HOST": host.address})


def committed_after(participants: int, t: float) -> Callable[[dict], bool]:
    def match(line: dict) -> bool:
        return committed_with(participants)(line) and step_of(line)["t_end"] > t

    return match


@pytest.mark.slow
def test_a_partition_hands_service_to_the_majority_side_and_heals(
    three_hosts: dict[str, Host], spawn: Callable[..., Child], tmp_path
):
    peers = start_hosts_set(three_hosts, spawn, tmp_path)
    groups = {name: start_host_group(three_hosts, spawn, name, peers) for name in NAMES}
    for child in groups.values():
        child.expect(committed_with(3), 90, "a step with all three groups")

    alone = serving_host(three_hosts, NAMES, 30)
    majority = tuple(n for n in NAMES if n != alone)
    cut(three_hosts, alone, up=False)
    cut_at = time.time()
    serving_host(three_hosts, majority, 30)
    for name in majority:
        groups[name].expect(committed_after(2, cut_at + 1), 60, f"{name} goes on")
    # The cut-off lighthouse stops serving within its lease; its group commits
    # nothing from shortly after the cut (a step in flight may still end). Checked
    # once the majority has committed a step that ended past that point.
    within = max(cut_at + 3.0 + SLACK_ON_A_BUSY_MACHINE - time.time(), 1.0)
    stepped_down = until(lambda: (v := view_on(three_hosts, alone)) and not v["serving"], within)
    assert stepped_down, view_on(three_hosts, alone)
    for name in majority:
        groups[name].expect(committed_after(2, cut_at + 3), 60, f"{name} goes on past the lease")
    late = [r for r in committed_steps(groups[alone]) if r["t_end"] > cut_at + 2.5]
    assert not late, f"the cut-off group committed while cut off: {late[:3]}"

    cut(three_hosts, alone, up=True)
    healed_at = time.time()
    groups[alone].expect(committed_after(3, healed_at), 90, "the cut-off group is back")
    # One state per step across the three groups, whatever the partition did.
    assert_one_state_per_step(groups.values())
    for child in groups.values():
        child.signal(signal.SIGTERM)
    for child in groups.values():
        child.wait(timeout=30)


#: Fetches a URL with the test token, prints the body (run inside a namespace).
PROBE = (
    "import sys, urllib.request\n"
    "r = urllib.request.Request(sys.argv[1], headers={'Authorization': 'Bearer " + TOKEN + "'})\n"
    "print(urllib.request.urlopen(r, timeout=2).read().decode())\n"
)


#: The term of the issue's hostile heartbeat: 2^21 + 7. With quorum ids numbered
#: `term << 32`, it moved a set to ids above the 2^53 groups accept, for good.
HOSTILE_TERM = (1 << 21) + 7
#: Far above any term the numbering gives ids of their own (2^33): a state written
#: by a set that went where it should not.
BAD_TERM = 1 << 40
MAX_QUORUM_ID = 1 << 53


def start_token_rank(spawn: Callable[..., Child], lighthouse: str, replica_id: str) -> Child:
    """tests/procs/ft_train.py as the one rank of group `replica_id`, with the job token."""
    env = {
        "PHALANX_REPLICA_ID": replica_id,
        "PHALANX_LIGHTHOUSE": lighthouse,
        "PHALANX_TOKEN": TOKEN,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "0",
    }
    argv = [sys.executable, str(FT_TRAIN), "--steps", "100000", "--timeout", "10"]
    return spawn(f"{replica_id}/0", argv, env)


def saved_term(path: Path) -> int:
    """The term in a lighthouse's --state-file ("term vote log-terms...")."""
    return int(path.read_text().split()[0])


def raft_refused(address: str, reason: str) -> float:
    """The lighthouse's count of Raft messages refused for `reason`."""
    code, body = http_get(f"http://{address}/metrics", TOKEN, timeout=2.0)
    assert code == 200, body
    prefix = f'phalanx_lighthouse_raft_refused_total{{reason="{reason}"}} '
    return next(float(line[len(prefix) :]) for line in body.splitlines() if line.startswith(prefix))


def logged(child: Child, *words: str, timeout: float = 10.0) -> str:
    """The first stderr line of `child` with every one of `words`, once there is one."""

    def found() -> str | None:
        return next((line for line in child.stderr if all(w in line for w in words)), None)

    until(found, timeout)
    line = found()
    assert line, f"{child.name} logged no line with {words}\n{child.describe(30)}"
    return line


def commits_after(rank: Child, since: float, count: int, timeout: float) -> list[dict]:
    """Waits for `count` steps committed by `rank` after `since`; returns them."""
    for _ in range(count):
        rank.expect(lambda line: line.get("committed") and line["t"] > since, timeout, "a commit")
    return [line for line in committed(rank) if line["t"] > since]


def test_one_raft_message_at_an_absurd_term_is_refused_and_the_job_goes_on(spawn, tmp_path):
    lighthouses, addresses = start_set(spawn, tmp_path, "--token", TOKEN)
    serving(addresses, 30, TOKEN)
    peers = ",".join(addresses)
    ranks = [start_token_rank(spawn, peers, name) for name in ("a", "b")]
    for rank in ranks:
        rank.expect(
            lambda line: line.get("committed") and line["participants"] == 2,
            90,
            "training with both groups",
        )
    terms = [set_view(a, TOKEN)["term"] for a in addresses]

    # As a token holder would: a heartbeat from "the leader" at term 2^21 + 7, to each
    # member of the set.
    sent_at = time.time()
    for i, address in enumerate(addresses, start=1):
        sender = i % 3 + 1
        with pytest.raises(Exception, match=f"lighthouse {i} .*refused a MsgHeartbeat"):
            _core._testing.send_raft_heartbeat(
                address, sender, i, HOSTILE_TERM, commit=10**9, token=TOKEN
            )
    # Refused, counted, and logged naming the sender (its claimed id, its address).
    for i, (child, address) in enumerate(zip(lighthouses, addresses, strict=True), start=1):
        assert raft_refused(address, "term") == 1
        line = logged(child, "refused", f"from lighthouse {i % 3 + 1}", "sent from 127.0.0.1:")
        assert str(HOSTILE_TERM) in line, line
    # The terms stayed where they were, on disk too.
    for i, address in enumerate(addresses, start=1):
        view = set_view(address, TOKEN)
        assert view["term"] < 1000 and view["term"] <= max(terms) + 5, view
        assert saved_term(tmp_path / f"lighthouse-{i}.raft") < 1000
    # The job goes on: 20 more commits of each group (the set made 3 in 15 s),
    # every quorum id one the groups accept, and rising.
    for rank in ranks:
        after = commits_after(rank, sent_at, 20, 30)
        assert all(line["participants"] == 2 for line in after[-5:]), after[-5:]
        ids = [line["quorum_id"] for line in committed(rank)]
        assert ids == sorted(ids) and max(ids) <= MAX_QUORUM_ID, ids
        assert rank.proc.poll() is None, f"{rank.name} restarted or died"
    assert assert_bit_identical(ranks) > 0


def test_a_set_at_a_bad_term_is_brought_back_by_resetting_its_state(spawn, tmp_path):
    # Every member's state file at a term past the last with ids of its own.
    for i in range(1, 4):
        (tmp_path / f"lighthouse-{i}.raft").write_text(f"{BAD_TERM} 0 {BAD_TERM}\n")
    lighthouses, addresses = start_set(spawn, tmp_path)
    leader = serving(addresses, 30)
    assert set_view(addresses[leader])["term"] > BAD_TERM
    line = logged(lighthouses[0], str(BAD_TERM), "--reset-state")
    assert "docs/lighthouse-set.md" in line, line

    # Refused while a member runs: it would keep its term and vote.
    reset = set_argv(addresses, 1, tmp_path, "--reset-state")
    refused = subprocess.run(reset, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1, refused
    assert "is up: stop every lighthouse of the set" in refused.stderr, refused.stderr
    assert saved_term(tmp_path / "lighthouse-1.raft") > BAD_TERM

    for child in lighthouses:
        child.signal(signal.SIGTERM)
    for child in lighthouses:
        assert child.wait(timeout=30) == 0, child.describe()
    for i in range(1, 4):
        done = subprocess.run(
            set_argv(addresses, i, tmp_path, "--reset-state"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done
        held = re.search(r"held term (\d+)", done.stdout)
        assert held and int(held[1]) > BAD_TERM, done.stdout
        assert (tmp_path / f"lighthouse-{i}.raft").read_text().split() == ["0", "0"]

    # Started again as they were: one serves at a small term, and a group commits.
    _, addresses = start_set(spawn, tmp_path, addresses=addresses)
    leader = serving(addresses, 30)
    assert set_view(addresses[leader])["term"] < 1000
    rank = start_rank(spawn, ",".join(addresses), "a", steps=100000)
    rank.expect(lambda line: line.get("committed"), 90, "a committed step after the reset")


def test_a_member_whose_state_file_was_deleted_rejoins_a_set_at_any_term(spawn, tmp_path):
    # Members 2 and 3 have run for a long time (term 5000); member 1's state says
    # term 0: reset on its own while the others ran, as it must not be.
    far = 5000
    for i in (2, 3):
        (tmp_path / f"lighthouse-{i}.raft").write_text(f"{far} 0 {far}\n")
    (tmp_path / "lighthouse-1.raft").write_text("0 0\n")
    lighthouses, addresses = start_set(spawn, tmp_path)
    leader = serving(addresses, 30)
    assert leader != 0 and set_view(addresses[leader])["term"] > far
    # It refuses the set's term (counted, logged), and stays out of the set.
    assert until(lambda: raft_refused(addresses[0], "term") > 0, 10), set_view(addresses[0])
    logged(lighthouses[0], "refused", f"said to be from lighthouse {leader + 1}")
    assert set_view(addresses[0])["term"] == 0
    # The sender hears why, and says so too.
    logged(lighthouses[leader], "a Raft message of this lighthouse was refused", "lighthouse 1")

    # Its state file deleted while the others run (which Raft allows), it takes the
    # leader it hears at its word, and follows it.
    lighthouses[0].signal(signal.SIGTERM)
    assert lighthouses[0].wait(timeout=30) == 0
    (tmp_path / "lighthouse-1.raft").unlink()
    again = spawn("lighthouse-1-again", set_argv(addresses, 1, tmp_path))
    again.expect(lambda line: "listening" in line.get("text", ""), 30, "listens")

    def follows() -> bool:
        view = set_view(addresses[0])
        return bool(view) and view["leader"] == leader + 1 and view["term"] > far

    assert until(follows, 10), set_view(addresses[0])
    assert raft_refused(addresses[0], "term") == 0
    assert saved_term(tmp_path / "lighthouse-1.raft") > far
