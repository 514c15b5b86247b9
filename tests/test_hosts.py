"""A job across hosts, simulated with network namespaces: the lighthouse and each
replica group get a namespace of their own with its own IP address, linked by a veth
pair to a bridge in a "switch" namespace, so that every byte between them (quorum,
heartbeats, the cross-group collectives, the heal) crosses those links. One `phalanx
run --replicas 1` per host, as a real multi-host job is started; then one host's
ranks are killed and its group heals from the survivor over the network."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import (
    PROCS,
    TESTS,
    Child,
    child_env,
    lighthouse_argv,
    wait_until,
    write_token_file,
)

#: Used only inside the namespaces made here, which nothing else can reach.
SUBNET = "10.77.0"
LIGHTHOUSE_PORT = 29510
TOKEN = "hosts-test-token"
NO_NAMESPACES = "network namespaces cannot be created here (needs root and iproute2)"
#: The demo's training script, small enough for a step of a few ms on 2 cores.
TRAIN = [sys.executable, "-m", "phalanx.demo.train", "--dim", "32", "--layers", "1"]
TRAIN += ["--seq-len", "32", "--batch-size", "4", "--timeout", "10"]


class NoNamespaces(Exception):
    """This machine cannot build the simulated network."""


def ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise NoNamespaces(f"'ip {' '.join(args)}' failed: {done.stderr.strip()}")


@dataclass(frozen=True)
class Host:
    """A network namespace whose one link, eth0, goes to the switch."""

    namespace: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv]


class Network:
    """A bridge in a namespace of its own (the switch), and hosts linked to it. Every
    name carries this process's id, so that concurrent runs never meet; nothing is
    left in the caller's namespace, and its firewall rules do not apply."""

    def __init__(self) -> None:
        self.tag = f"phx{os.getpid()}"
        self.switch = f"{self.tag}sw"
        self.namespaces: list[str] = []
        self.hosts: list[Host] = []

    def _add_namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self.namespaces.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def build(self) -> None:
        self._add_namespace(self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")

    def add_host(self, name: str) -> Host:
        host = Host(f"{self.tag}{name}", f"{SUBNET}.{10 + len(self.hosts)}")
        self._add_namespace(host.namespace)
        port = f"to-{name}"
        veth = ["link", "add", port, "type", "veth", "peer", "name", "eth0"]
        ip("-n", self.switch, *veth, "netns", host.namespace)
        ip("-n", self.switch, "link", "set", port, "master", "br0")
        ip("-n", self.switch, "link", "set", port, "up")
        ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
        ip("-n", host.namespace, "link", "set", "eth0", "up")
        self.hosts.append(host)
        return host

    def remove(self) -> None:
        """Deletes every namespace made here; the links inside go with them."""
        for name in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
        self.namespaces.clear()


def no_namespaces(why: str) -> None:
    """Skips a test that needs namespaces where they cannot be made; never in CI,
    which runs as root with iproute2."""
    assert not os.environ.get("PHALANX_CI"), f"CI must run the namespace tests: {why}"
    pytest.skip(why)


@contextlib.contextmanager
def on_one_switch(*names: str) -> Iterator[tuple[Network, dict[str, Host]]]:
    """Hosts of these names on one switch, removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        no_namespaces(NO_NAMESPACES)
    network = Network()
    try:
        try:
            network.build()
            made = {name: network.add_host(name) for name in names}
        except (NoNamespaces, OSError, subprocess.TimeoutExpired) as e:
            no_namespaces(f"{NO_NAMESPACES}: {e}")
        yield network, made
    finally:
        network.remove()


@pytest.fixture
def hosts() -> Iterator[dict[str, Host]]:
    """Three hosts on one switch: "lighthouse", "group-a" and "group-b"."""
    with on_one_switch("lh", "group-a", "group-b") as (_, made):
        yield made


def step_of(line: dict) -> dict | None:
    """The step record in a launcher output line "[group-a/0] {...}", if it is one."""
    _, _, rest = line.get("text", "").partition("] ")
    return json.loads(rest) if rest.startswith('{"event": "step"') else None


def started_pids(line: dict, replica_id: str) -> list[int] | None:
    """The rank pids of the launcher's line "started <id> (…, pids 1, 2)"."""
    text = line.get("text", "")
    if not text.startswith(f"[phalanx run] started {replica_id} ("):
        return None
    return [int(pid) for pid in text.rsplit("pids ", 1)[1].rstrip(")").split(",")]


def committed_steps(child: Child, pids: set[int] | None = None) -> list[dict]:
    records = [r for r in map(step_of, list(child.lines)) if r and r["committed"]]
    return [r for r in records if pids is None or r["pid"] in pids]


def assert_one_state_per_step(children: Iterable[Child]) -> None:
    """No step number was committed with two states, across all of `children` (I1)."""
    fingerprints: dict[int, set[str]] = {}
    commits: dict[int, list[dict]] = {}
    for child in children:
        for r in committed_steps(child):
            fingerprints.setdefault(r["step"], set()).add(r["fingerprint"])
            commits.setdefault(r["step"], []).append(r)
    split = {s: f for s, f in fingerprints.items() if len(f) > 1}
    fields = ("replica", "pid", "lineage", "quorum_id", "participants", "healed", "fingerprint")
    told = [[{k: r.get(k) for k in fields} for r in commits[s]] for s in sorted(split)[:3]]
    assert not split, f"steps committed with two states: {sorted(split)[:5]}: {told}"


def start_lighthouse_on(host: Host, spawn: Callable[..., Child], *flags: str) -> str:
    """`phalanx lighthouse` on `host`, at its address and `LIGHTHOUSE_PORT`; that
    address, once it listens."""
    address = f"{host.address}:{LIGHTHOUSE_PORT}"
    lighthouse = spawn("lighthouse", host.command(lighthouse_argv(address, *flags)))
    lighthouse.expect(lambda line: "listening on" in line.get("text", ""), 15, "listening")
    return address


def committed_with(participants: int, from_step: int = 0) -> Callable[[dict], bool]:
    def match(line: dict) -> bool:
        record = step_of(line)
        return bool(
            record
            and record["committed"]
            and record["participants"] == participants
            and record["step"] >= from_step
        )

    return match


@pytest.mark.slow
def test_a_group_on_another_host_is_killed_and_heals_over_the_network(
    hosts: dict[str, Host], spawn: Callable[..., Child]
):
    flags = ["--min-replicas", "1", "--join-timeout", "500ms", "--heartbeat-timeout", "2s"]
    lighthouse_address = start_lighthouse_on(hosts["lh"], spawn, *flags, "--token", TOKEN)

    groups: dict[str, Child] = {}
    for replica in ("group-a", "group-b"):
        host = hosts[replica]
        launcher = [sys.executable, "-m", "phalanx", "run", "--replicas", "1"]
        launcher += ["--replica-id", replica, "--lighthouse", lighthouse_address]
        launcher += ["--token", TOKEN]
        launcher += ["--master-addr", host.address]
        launcher += ["--restart-backoff", "0.1", "--", *TRAIN]
        # Peers reach this group's servers at its own address; gloo is told to use
        # eth0, since this machine's host name resolves to loopback in a namespace.
        env = {"PHALANX_ADVERTISE_HOST": host.address}
        groups[replica] = spawn(replica, host.command(launcher), env)
    a, b = groups["group-a"], groups["group-b"]

    # Both hosts train together, each over its own link.
    first_b = b.expect(lambda line: started_pids(line, "group-b"), 15, "group-b's ranks")
    victims = started_pids(first_b, "group-b")
    a.expect(committed_with(2), 40, "a step of group-a with group-b")
    b.expect(committed_with(2), 20, "a step of group-b with group-a")

    # Host b loses its ranks; its launcher restarts them; they heal from host a.
    killed_at = time.time()
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    restart = b.expect(lambda line: started_pids(line, "group-b"), 15, "group-b restarted")
    healers = set(started_pids(restart, "group-b"))
    first = step_of(b.expect(lambda line: (step_of(line) or {}).get("pid") in healers, 30, "heal"))
    assert first["healed"] and first["committed"], f"the restarted group did not heal: {first}"
    b.expect(committed_with(2, first["step"]), 15, "a step of group-b after its heal")
    a.expect(committed_with(2, first["step"]), 15, "a step of group-a with the healed group-b")

    # The survivor went on alone while b was down, and was never restarted itself.
    a_steps = committed_steps(a)
    assert [r["step"] for r in a_steps] == sorted({r["step"] for r in a_steps})
    assert any(r["participants"] == 1 and r["t_end"] > killed_at for r in a_steps), (
        "group-a committed no step on its own while group-b was down"
    )
    assert sum(started_pids(line, "group-a") is not None for line in a.lines) == 1

    # After the heal both hosts hold the same bits at every step they both committed.
    fingerprints = {r["step"]: r["fingerprint"] for r in a_steps}
    shared = [r for r in committed_steps(b, healers) if r["step"] in fingerprints]
    assert shared, "no step committed by both groups after the heal"
    for record in shared:
        assert record["fingerprint"] == fingerprints[record["step"]], record

    for child in (a, b):
        child.signal(signal.SIGTERM)
    for child in (a, b):
        assert child.wait(timeout=20) == 130, child.describe()


def listeners(host: Host) -> list[str]:
    """The local addresses of every TCP socket listening in `host`'s namespace."""
    done = subprocess.run(
        host.command(["ss", "-ltnH"]), capture_output=True, text=True, timeout=10, check=True
    )
    return [line.split()[3] for line in done.stdout.splitlines() if line.strip()]


def probe(host: Host, *argv: str) -> str:
    done = subprocess.run(
        host.command([sys.executable, str(PROCS / "netns_probe.py"), *argv]),
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        cwd=TESTS.parent,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
def test_another_host_without_the_token_is_refused_by_every_plane_and_counted(
    hosts: dict[str, Host], spawn: Callable[..., Child], tmp_path: Path
):
    token_file = write_token_file(tmp_path / "job.token", TOKEN)
    lh, home, stranger = hosts["lh"], hosts["group-a"], hosts["group-b"]
    lighthouse_address = start_lighthouse_on(lh, spawn, "--token-file", str(token_file))
    launcher = [sys.executable, "-m", "phalanx", "run", "--replicas", "1"]
    launcher += ["--nproc-per-replica", "2", "--replica-id", "group-a"]
    launcher += ["--lighthouse", lighthouse_address, "--token-file", str(token_file)]
    launcher += ["--master-addr", home.address, "--", sys.executable, str(PROCS / "ft_train.py")]
    launcher += ["--steps", "100000", "--timeout", "10"]
    job = spawn("group-a", home.command(launcher), {"PHALANX_ADVERTISE_HOST": home.address})

    readies: dict[int, dict] = {}

    def both_ready(line: dict) -> bool:
        prefix, _, record = line.get("text", "").partition("] ")
        if prefix in ("[group-a/0", "[group-a/1") and '"event": "ready"' in record:
            readies[int(prefix[-1])] = json.loads(record)
        return len(readies) == 2

    job.expect(both_ready, 60, "both ranks ready")
    job.expect(lambda line: '"committed": true' in line.get("text", ""), 60, "a committed step")

    # Nothing of the job listens on every interface.
    for host in (lh, home):
        bound = listeners(host)
        assert bound and all(a.startswith(f"{host.address}:") for a in bound), (host, bound)

    manager = readies[0]["manager_address"]
    states = [r["state_address"] for r in readies.values()]
    knocked = json.loads(probe(stranger, "knock", lighthouse_address, manager, *states))
    assert knocked and all(outcome == "refused" for outcome in knocked.values()), knocked

    def counted() -> bool:
        metrics = probe(stranger, "metrics", lighthouse_address, TOKEN)
        own = re.search(r'refused_requests_total\{reason="token"\} (\d+)', metrics)
        group = re.search(
            r'group_refused_requests_total\{replica_id="group-a",reason="token"\} (\d+)', metrics
        )
        # 2 lighthouse calls; quorum, vote and store write, and one fetch per rank.
        return bool(own and group and int(own[1]) >= 2 and int(group[1]) >= 3 + len(states))

    wait_until(counted, 30, "every refusal counted at the lighthouse")
