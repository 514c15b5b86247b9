"""After a cut heals, the cut group is answered (issue 26, part 3): a lighthouse and two
groups on hosts of their own, one group's host cut off for 8 s (its switch port drops
every frame both ways: silence, no reset), then healed. The quorum request the cut
group sent while cut off must be answered within a join timeout of the heal, not left
behind TCP's retransmission backoff on the connection that went silent."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from test_hosts import (
    TOKEN,
    TRAIN,
    Host,
    assert_one_state_per_step,
    committed_with,
    on_one_switch,
    start_lighthouse_on,
    step_of,
)

from conftest import Child

JOIN_TIMEOUT = 1.0
#: Past the join timeout: the group's own step up to its quorum, the lighthouse's turn,
#: and a machine shared with other test runs.
MARGIN = 0.5
CUT_S = 8.0


@contextlib.contextmanager
def pinned_switch(*names: str) -> Iterator[dict[str, Host]]:
    """Hosts `names` on one switch, plus the switch, with every neighbour pinned: a cut
    drops ARP too, and a neighbour entry that failed meanwhile would turn the silence
    into fast "no route to host" errors."""
    with on_one_switch(*names) as (network, made):
        macs = {name: mac(host) for name, host in made.items()}
        for name, host in made.items():
            for other, peer in made.items():
                if other != name:
                    lladdr = ["lladdr", macs[other], "dev", "eth0", "nud", "permanent"]
                    run(host, "ip", "neigh", "replace", peer.address, *lladdr)
        yield {**made, "switch": Host(network.switch, "")}


@pytest.fixture
def cut_hosts() -> Iterator[dict[str, Host]]:
    """Hosts "lh", "g1" and "g2", plus the switch (see `pinned_switch`)."""
    with pinned_switch("lh", "g1", "g2") as hosts:
        yield hosts


def run(host: Host, *argv: str) -> str:
    done = subprocess.run(host.command(list(argv)), capture_output=True, text=True, timeout=10)
    assert done.returncode == 0, f"{' '.join(argv)} in {host.namespace}: {done.stderr}"
    return done.stdout


def mac(host: Host) -> str:
    return json.loads(run(host, "ip", "-j", "link", "show", "dev", "eth0"))[0]["address"]


def port_state(hosts: dict[str, Host], name: str, forwarding: bool) -> None:
    """A bridge port disabled drops every frame that comes in or would go out on it,
    without a word to either side; the host's own link stays up."""
    state = "3" if forwarding else "0"
    run(hosts["switch"], "bridge", "link", "set", "dev", f"to-{name}", "state", state)


def start_group(hosts: dict[str, Host], spawn: Callable[..., Child], name: str, lh: str) -> Child:
    host = hosts[name]
    launcher = [sys.executable, "-m", "phalanx", "run", "--replicas", "1"]
    launcher += ["--replica-id", name, "--lighthouse", lh, "--token", TOKEN]
    launcher += ["--master-addr", host.address, "--restart-backoff", "0.1", "--", *TRAIN]
    return spawn(name, host.command(launcher), {"PHALANX_ADVERTISE_HOST": host.address})


def answered_at(record: dict) -> float:
    """When the step's quorum came (or was refused): the step asks at its start, and
    its first use of the quorum (the sampler's windows) waits for it right after."""
    return record["t_start"] + record["quorum_s"]


@pytest.mark.slow
def test_a_group_cut_off_is_answered_within_a_join_timeout_of_the_heal(
    cut_hosts: dict[str, Host], spawn: Callable[..., Child]
):
    flags = ["--min-replicas", "1", "--join-timeout", f"{JOIN_TIMEOUT}s"]
    flags += ["--heartbeat-timeout", "2s"]
    lh = start_lighthouse_on(cut_hosts["lh"], spawn, "--token", TOKEN, *flags)
    g1, g2 = (start_group(cut_hosts, spawn, name, lh) for name in ("g1", "g2"))
    for child in (g1, g2):
        child.expect(committed_with(2), 60, "a step of both groups")

    port_state(cut_hosts, "g2", forwarding=False)
    cut_at = time.time()
    g1.expect(
        lambda line: committed_with(1)(line) and step_of(line)["t_end"] > cut_at, 30, "g1 alone"
    )
    time.sleep(max(0.0, cut_at + CUT_S - time.time()))
    port_state(cut_hosts, "g2", forwarding=True)
    healed_at = time.time()

    back = g2.expect(
        lambda line: committed_with(2)(line) and step_of(line)["t_end"] > healed_at,
        60,
        "g2 commits with g1 after the heal",
    )
    records = [r for r in map(step_of, list(g2.lines)) if r]
    after = [r for r in records if r["quorum_s"] > 0 and answered_at(r) > healed_at]
    first = min(after, key=answered_at)
    waited = answered_at(first) - healed_at
    print(json.dumps({"heal_to_answer_s": round(waited, 3), "first": first}))
    assert waited <= JOIN_TIMEOUT + MARGIN, (
        f"g2's quorum came {waited:.2f} s after the heal: {first.get('failure')}"
    )
    assert not (first["failure"] or "").startswith("no quorum"), first
    healed = [r for r in records if r["healed"] and r["t_end"] > healed_at]
    assert healed and healed[0]["committed"], f"g2 did not heal: {healed[:1]}"
    assert step_of(back)["t_end"] - healed_at < 15, step_of(back)

    # One state per step number, across both groups and the cut.
    assert_one_state_per_step((g1, g2))
    for child in (g1, g2):
        child.signal(signal.SIGTERM)
    for child in (g1, g2):
        assert child.wait(timeout=30) == 130, child.describe()
