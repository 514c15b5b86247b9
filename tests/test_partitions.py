"""Partitions and their heals (issue 26; I1, I10, I11, I12), as a Jepsen test would
try them: three hosts in network namespaces on one switch, each running one
lighthouse of a set of three and one replica group (`phalanx run --replicas 1`), the
way a multi-host job is started. The switch cuts the network without a word to
either side: a host cut off has its bridge port disabled (every frame in or out
dropped), a "bridge" cut isolates two ports from each other (both still reach the
third). Each host's neighbours are pinned, so that a cut is silence, never a fast
"no route to host". Only iproute2 is needed.

What must hold whatever the faults, checked on the step records of all groups:
- one state per step number (within a lineage), and the job's committed step never
  goes back (I1, I11): a step that starts after another committed commits a later one;
- no new lineage: in these faults a holder of the newest state always comes back;
- quorum ids per group never go down (I3), and never two lighthouses serving (I10);
- no group is evicted or restarted but the ones the test kills (I5, I12).

Set NEMESIS_SEED to replay a nemesis run; its seed is printed either way."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from phalanx.settings import Timeouts
from phalanx.watchdog import EXIT_STALLED
from test_hosts import (
    LIGHTHOUSE_PORT,
    TOKEN,
    TRAIN,
    Host,
    on_one_switch,
    started_pids,
    step_of,
)

from conftest import PROCS, Child, write_token_file

NAMES = ("h1", "h2", "h3")
#: The lighthouses' timeouts (their defaults, stated: the bounds below are made of them).
HEARTBEAT_TIMEOUT = 2.0
JOIN_TIMEOUT = 1.0
#: The trainer's own, from its --timeout budget (TRAIN passes 10 s).
TIMEOUTS = Timeouts.from_budget(float(TRAIN[TRAIN.index("--timeout") + 1]))
#: A machine of 2 cores shared by 3 lighthouses, 3 launchers, 3 ranks and the test.
MARGIN = 2.0
#: After a cut heals, the cut-off group commits beside the others within this: its
#: request is answered within a join timeout of the heal (issue 26, 3); the heal (a
#: 100 KB state) and one step take tens of milliseconds; the margin is for the machine.
HEAL_BOUND = JOIN_TIMEOUT + MARGIN
#: From a fault to the job's next commit (of a step begun after the fault), by kind.
#: Each is within the heartbeat + join + collective timeouts (+ margin) that bound
#: any single fault: a loss is known within the heartbeat timeout, the next quorum
#: waits at most a join timeout, an all-reduce with a lost peer ends at the latest
#: at its collective timeout; the issue asks for less where it says so.
COMMIT_BOUNDS = {
    # A crash breaks the group's streams: known in milliseconds (DESIGN 4), and the
    # others form a quorum within a join timeout.
    "kill_group": JOIN_TIMEOUT + MARGIN,
    # Another lighthouse serves within the heartbeat timeout + 0.5 s (I10, issue 26, 4;
    # tests/test_lighthouse_set.py measures the kill).
    "kill_lighthouse": HEARTBEAT_TIMEOUT + 0.5 + MARGIN,
    "pause_lighthouse": HEARTBEAT_TIMEOUT + 0.5 + MARGIN,
    # A silent host: its group is lost after the heartbeat timeout and the others form
    # a quorum within a join timeout (with the serving lighthouse on that host the
    # issue allows the heartbeat timeout + 0.5 s: less).
    "cut_off": HEARTBEAT_TIMEOUT + JOIN_TIMEOUT + MARGIN,
    # Two groups that cannot reach each other: their all-reduce fails at its collective
    # timeout, then a quorum of groups that all reach each other forms within a join
    # timeout (issue 26, 4), not when the cut ends.
    "split": TIMEOUTS.collective + JOIN_TIMEOUT + MARGIN,
}
#: From a fault's end to all three groups committing together again, by kind.
REJOIN_BOUNDS = {
    "cut_off": HEAL_BOUND,
    "split": HEAL_BOUND,
    # The launcher's first backoff (--restart-backoff 0.1; a group that committed since
    # its last restart starts from a full budget again, issue 26, 5), a forked rank,
    # its join and its heal.
    "kill_group": 0.1 + JOIN_TIMEOUT + 2 * MARGIN,
    # A group dropped while no lighthouse served is back within a heartbeat timeout
    # of a lighthouse serving again, and a join.
    "kill_lighthouse": HEARTBEAT_TIMEOUT + JOIN_TIMEOUT + MARGIN,
    "pause_lighthouse": HEARTBEAT_TIMEOUT + JOIN_TIMEOUT + MARGIN,
}
#: The nemesis fails on a fault after which the job is not committing, or not whole
#: again, within this long; the tighter bounds above are reported in its summary.
LIVENESS_CEILING = 25.0
#: Longer than any bound above: past it without the job whole, the nemesis stops
#: (what would follow is noise on a job that did not come back).
GIVE_UP_S = 30.0
#: How long the job must go on with all three after a heal for a wrong eviction (the
#: stall rule judging a waiter, issue 26, 1) to have shown: it fires a stall timeout
#: after the wait began, and a wait can last up to a collective timeout.
WATCH_AFTER_HEAL = TIMEOUTS.stall + TIMEOUTS.collective + MARGIN
START_BOUND = 120.0
#: The cut, about the issue's (~10 s): long enough for TCP's retransmissions to and
#: from the cut-off host to back off to seconds (a first one 0.2 s after the cut,
#: then 0.4, 0.8 ... 6.4 s apart), so that, healed a little after the 6.2 s one, the
#: next comes seconds after the heal: what a group must not wait for.
CUT_S = 9.0


def run_in(host: Host, *argv: str) -> str:
    done = subprocess.run(host.command(list(argv)), capture_output=True, text=True, timeout=10)
    assert done.returncode == 0, f"{' '.join(argv)} in {host.namespace}: {done.stderr}"
    return done.stdout


class Switch:
    """The bridge the hosts hang off, and the cuts it makes: a disabled port drops
    every frame in and out of it; two isolated ports forward nothing to each other,
    and everything to the ports that are not isolated."""

    def __init__(self, host: Host) -> None:
        self.host = host

    def cut_off(self, name: str, cut: bool = True) -> None:
        state = "0" if cut else "3"  # disabled / forwarding
        run_in(self.host, "bridge", "link", "set", "dev", f"to-{name}", "state", state)

    def split(self, a: str, b: str, cut: bool = True) -> None:
        for name in (a, b):
            flag = "on" if cut else "off"
            run_in(self.host, "bridge", "link", "set", "dev", f"to-{name}", "isolated", flag)


def pin_neighbours(hosts: dict[str, Host]) -> None:
    """Permanent ARP entries: a cut drops ARP too, and a neighbour entry that failed
    meanwhile would turn the silence into fast errors."""
    macs = {}
    for name, host in hosts.items():
        link = json.loads(run_in(host, "ip", "-j", "link", "show", "dev", "eth0"))
        macs[name] = link[0]["address"]
    for name, host in hosts.items():
        for other, peer in hosts.items():
            if other != name:
                pinned = ["lladdr", macs[other], "dev", "eth0", "nud", "permanent"]
                run_in(host, "ip", "neigh", "replace", peer.address, *pinned)


@pytest.fixture
def three_hosts() -> Iterator[tuple[dict[str, Host], Switch]]:
    with on_one_switch(*NAMES) as (network, made):
        pin_neighbours(made)
        yield made, Switch(Host(network.switch, ""))


def until(condition: Callable[[], object], timeout: float) -> bool:
    """Polls `condition` for up to `timeout` s; whether it came true (never fails:
    the checks after it say what went wrong, with the evidence)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def texts(child: Child) -> list[str]:
    return [line.get("text", "") for line in list(child.lines)] + list(child.stderr)


class Job:
    """A lighthouse, a watcher of it and a replica group "gN" on each host hN."""

    def __init__(self, hosts: dict[str, Host], spawn: Callable[..., Child], tmp: Path) -> None:
        self.hosts, self.spawn, self.tmp = hosts, spawn, tmp
        self.token_file = write_token_file(tmp / "job.token", TOKEN)
        self.addresses = {n: f"{hosts[n].address}:{LIGHTHOUSE_PORT}" for n in NAMES}
        self.peers = ",".join(self.addresses[n] for n in NAMES)
        self.lighthouses: dict[str, list[Child]] = {n: [] for n in NAMES}
        self.watchers: dict[str, Child] = {}
        self.groups: dict[str, Child] = {}
        #: Rank kills by the test, per host: each one restart that is no failure.
        self.kills = dict.fromkeys(NAMES, 0)
        self.exited: dict[str, int | None] | None = None
        #: Per host: how many of its launcher's lines were parsed, and their records.
        self._parsed: dict[str, list] = {}

    def start(self) -> None:
        for name in NAMES:
            self.start_lighthouse(name)
        for name in NAMES:
            argv = [sys.executable, str(PROCS / "lighthouse_watch.py"), self.addresses[name]]
            argv += [str(self.token_file), "0.1"]
            self.watchers[name] = self.spawn(f"watch-{name}", self.hosts[name].command(argv))
        for name in NAMES:
            host = self.hosts[name]
            launcher = [sys.executable, "-m", "phalanx", "run", "--replicas", "1"]
            launcher += ["--replica-id", group_of(name), "--lighthouse", self.peers]
            launcher += ["--token-file", str(self.token_file), "--master-addr", host.address]
            launcher += ["--restart-backoff", "0.1", "--", *TRAIN]
            env = {"PHALANX_ADVERTISE_HOST": host.address}
            self.groups[name] = self.spawn(group_of(name), host.command(launcher), env)

    def start_lighthouse(self, name: str) -> None:
        """Starts (or, after a kill, restarts) the lighthouse on `name` with its state file."""
        argv = [sys.executable, "-m", "phalanx", "lighthouse", "--bind", self.addresses[name]]
        argv += ["--peers", self.peers, "--id", str(NAMES.index(name) + 1)]
        argv += ["--state-file", str(self.tmp / f"{name}.raft")]
        argv += ["--token-file", str(self.token_file)]
        argv += ["--heartbeat-timeout", f"{HEARTBEAT_TIMEOUT:g}s"]
        argv += ["--join-timeout", f"{JOIN_TIMEOUT:g}s"]
        n = len(self.lighthouses[name])
        child = self.spawn(f"lighthouse-{name}.{n}", self.hosts[name].command(argv))
        child.expect(lambda line: "listening" in line.get("text", ""), 30, "listens")
        self.lighthouses[name].append(child)

    def lighthouse(self, name: str) -> Child:
        return self.lighthouses[name][-1]

    def serving(self, timeout: float = 15.0) -> str | None:
        """The host whose lighthouse said last, within the last second, that it
        serves; None if none did within `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, watcher in self.watchers.items():
                last = watcher.lines[-1] if watcher.lines else {}
                if last.get("serving") and last["t1"] > time.time() - 1.0:
                    return name
            time.sleep(0.05)
        return None

    def records(self, names: tuple[str, ...] = NAMES) -> list[dict]:
        """Every step record of the groups on `names`, each tagged with its host
        (parsed once: a group writes a hundred a second)."""
        out = []
        for name in names:
            lines, parsed = self.groups[name].lines, self._parsed.setdefault(name, [0, []])
            for line in lines[parsed[0] : len(lines)]:
                record = step_of(line)
                if record:
                    parsed[1].append({**record, "host": name})
                parsed[0] += 1
            out += parsed[1]
        return out

    def committed(self, names: tuple[str, ...] = NAMES) -> list[dict]:
        return [r for r in self.records(names) if r["committed"]]

    def all_together_since(self, t: float, from_step: int = 0) -> bool:
        """Every group committed a step with all three, begun after `t`."""
        done = {
            r["host"]
            for r in self.committed()
            if r["participants"] == 3 and r["t_start"] > t and r["step"] >= from_step
        }
        return done == set(NAMES)

    def gone(self) -> list[str]:
        """The groups whose launcher exited."""
        return [n for n, child in self.groups.items() if child.proc.poll() is not None]

    def rank_pids(self, name: str) -> list[int]:
        """The pids of the group's ranks, as its launcher last started them."""
        started = [started_pids(line, group_of(name)) for line in list(self.groups[name].lines)]
        return [pids for pids in started if pids][-1]

    def save(self, since: float) -> Path:
        """Every child's output, and the groups' timeline from `since`, in files for
        a post-mortem; returns their folder."""
        folder = self.tmp / "logs"
        folder.mkdir(exist_ok=True)
        children = [*self.groups.values(), *self.watchers.values()]
        children += [c for cs in self.lighthouses.values() for c in cs]
        for child in children:
            with open(folder / f"{child.name}.jsonl", "w") as f:
                f.writelines(json.dumps(line) + "\n" for line in list(child.lines))
                f.writelines(f"stderr: {line}\n" for line in list(child.stderr))
        (folder / "timeline.txt").write_text(timeline(self, since, rows=100_000))
        return folder

    def stop(self) -> None:
        """SIGTERM to every launcher still running (each stops its ranks), then waits.
        A launcher that had exited by itself before is kept in `exited`."""
        if self.exited is None:
            self.exited = {n: c.proc.poll() for n, c in self.groups.items()}
        for child in self.groups.values():
            if child.proc.poll() is None:
                child.signal(signal.SIGTERM)
        for child in self.groups.values():
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.close()


def group_of(name: str) -> str:
    return f"g{name[1:]}"


@pytest.fixture
def job(three_hosts, spawn: Callable[..., Child], tmp_path: Path) -> Iterator[Job]:
    hosts, _ = three_hosts
    started = Job(hosts, spawn, tmp_path)
    try:
        started.start()
        up = until(lambda: started.all_together_since(0.0) or started.gone(), START_BOUND)
        assert up and not started.gone(), (
            f"the three groups did not commit together within {START_BOUND} s\n"
            + "\n".join(g.describe() for g in started.groups.values())
        )
        yield started
    finally:
        started.stop()


# -- the invariants, each a list of what broke it (empty: it held) ---------------------


def lineage(record: dict) -> int:
    return record.get("lineage", 0)


def split_steps(committed: list[dict]) -> list[str]:
    """Step numbers committed with two states within one lineage (I1)."""
    states: dict[tuple[int, int], dict[str, list[str]]] = {}
    for r in committed:
        by = states.setdefault((lineage(r), r["step"]), {})
        by.setdefault(r["fingerprint"], []).append(f"{r['replica']} q{r['quorum_id']}")
    split = {key: fps for key, fps in sorted(states.items()) if len(fps) > 1}
    if not split:
        return []
    shown = "; ".join(f"lineage {ln} step {s}: {fps}" for (ln, s), fps in list(split.items())[:4])
    return [f"{len(split)} step numbers committed with two states, e.g. {shown}"]


def went_back(committed: list[dict]) -> list[str]:
    """Commits of a step number no later than one committed before that step began
    (I11): the job's newest step went back, whatever the fingerprints say."""
    problems = []
    for ln in sorted({lineage(r) for r in committed}):
        ended = sorted((r for r in committed if lineage(r) == ln), key=lambda r: r["t_end"])
        newest: dict | None = None
        i = 0
        for r in sorted(ended, key=lambda r: r["t_start"]):
            while i < len(ended) and ended[i]["t_end"] < r["t_start"]:
                if newest is None or ended[i]["step"] > newest["step"]:
                    newest = ended[i]
                i += 1
            if newest is not None and r["step"] <= newest["step"]:
                problems.append(
                    f"{r['replica']} committed step {r['step']} (q{r['quorum_id']}, "
                    f"{r['participants']} groups, fp {r['fingerprint']}) after "
                    f"{newest['replica']} had committed step {newest['step']} "
                    f"(q{newest['quorum_id']}, fp {newest['fingerprint']})"
                )
    if not problems:
        return []
    return [f"the job went back {len(problems)} time(s), first: {problems[0]}"]


def new_lineages(committed: list[dict], job: Job) -> list[str]:
    """In these faults a holder of the newest state always comes back: no rollback."""
    seen = sorted({lineage(r) for r in committed})
    if len(seen) <= 1:
        return []
    said = [t for ls in job.lighthouses.values() for c in ls for t in texts(c) if "lineage" in t]
    return [f"the job changed lineage ({seen}) though no holder was gone; lighthouses: {said[:3]}"]


def quorum_ids_down(records: list[dict]) -> list[str]:
    """Per group, in the order its steps began, the quorum ids never go down (I3)."""
    problems = []
    for replica in sorted({r["replica"] for r in records}):
        mine = sorted(
            (r for r in records if r["replica"] == replica and r["quorum_id"] is not None),
            key=lambda r: r["t_start"],
        )
        for before, after in zip(mine, mine[1:], strict=False):
            if after["quorum_id"] < before["quorum_id"]:
                problems.append(
                    f"{replica}: quorum {after['quorum_id']} at step {after['step']} after "
                    f"quorum {before['quorum_id']} at step {before['step']}"
                )
                break
    return problems


def two_serving(job: Job) -> list[str]:
    """Never two lighthouses serving (I10), from what each said of itself: one leader
    per term, and no lighthouse serving in a term older than one that served before
    it was asked (asks are stamped before sending and after the answer)."""
    said = [
        (line["t0"], line["t1"], line["term"], line["id"])
        for watcher in job.watchers.values()
        for line in list(watcher.lines)
        if line.get("serving")
    ]
    problems = []
    leaders: dict[int, set[int]] = {}
    for _, _, term, who in said:
        leaders.setdefault(term, set()).add(who)
    problems += [
        f"term {t} had two serving lighthouses: {w}" for t, w in leaders.items() if len(w) > 1
    ]
    by_end = sorted(said, key=lambda s: s[1])
    newest = None
    i = 0
    for t0, _, term, who in sorted(said, key=lambda s: s[0]):
        while i < len(by_end) and by_end[i][1] < t0:
            if newest is None or by_end[i][2] > newest[2]:
                newest = by_end[i]
            i += 1
        if newest is not None and term < newest[2]:
            problems.append(
                f"lighthouse {who} served in term {term} at {t0:.2f} after lighthouse "
                f"{newest[3]} had served in term {newest[2]} at {newest[1]:.2f}"
            )
            break
    return problems


def restarted(job: Job, names: tuple[str, ...] = NAMES) -> list[str]:
    """Groups started more often than the test killed them, or evicted (I5, I12)."""
    problems = []
    for name in names:
        lines = texts(job.groups[name])
        starts = [t for t in lines if t.startswith(f"[phalanx run] started {group_of(name)} (")]
        evicted = [t for t in lines if was_evicted(t, group_of(name))]
        if len(starts) != 1 + job.kills[name] or evicted:
            restarts = [t for t in lines if t.startswith("[phalanx run] restarting")]
            problems.append(
                f"{group_of(name)} started {len(starts)} time(s) for {job.kills[name]} kill(s); "
                f"evicted: {evicted[:2]}; launcher: {restarts[:2]}"
            )
        code = (job.exited or {}).get(name, job.groups[name].proc.poll())
        if code is not None:
            problems.append(f"the launcher of {group_of(name)} exited ({code}): {lines[-3:]}")
    return problems


def was_evicted(text: str, replica_id: str) -> bool:
    """Whether a line of the group's output says that it was evicted as stalled: its
    rank's own word, or its launcher's (the exit status, the cause of a restart); not
    a peer's eviction quoted in a step's failure, nor a count of none."""
    return (
        f"replica group '{replica_id}' was evicted" in text
        or f"exit codes [{EXIT_STALLED}]" in text
        or "(evicted as stalled:" in text
    )


def invariants(job: Job) -> list[str]:
    records, committed = job.records(), job.committed()
    return (
        split_steps(committed)
        + went_back(committed)
        + new_lineages(committed, job)
        + quorum_ids_down(records)
        + two_serving(job)
    )


# -- the exact sequence of issue 26 ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_group_cut_off_while_the_others_commit_100_steps_heals_and_evicts_nobody(
    three_hosts: tuple[dict[str, Host], Switch], job: Job
):
    """Issue 26's run, step by step: a group's host (not the serving lighthouse's) is
    cut off for about 10 s while the other two commit 100 steps and more; the cut
    heals. The stale group must heal to the others' step within a join timeout (and a
    margin), the two that waited for it must not be evicted or restarted, and the job
    must neither go back nor put two states under a step number."""
    _, switch = three_hosts
    assert until(lambda: job.all_together_since(0.0, 20), 60), "no 20 steps with all three"
    serving = job.serving()
    assert serving is not None, "no lighthouse serves"
    # A group's host, not the serving lighthouse's: a cut of a group.
    victim = NAMES[(NAMES.index(serving) + 1) % 3]
    others = tuple(n for n in NAMES if n != victim)

    switch.cut_off(victim)
    cut_at = time.time()

    def stale() -> int:
        """The victim's newest committed step (a step in flight at the cut may end)."""
        return max(r["step"] for r in job.committed((victim,)))

    def others_went_on() -> bool:
        return all(
            any(r["participants"] == 2 and r["step"] >= stale() + 100 for r in job.committed((n,)))
            for n in others
        )

    went_on = until(others_went_on, 60)
    time.sleep(max(0.0, cut_at + CUT_S - time.time()))
    switch.cut_off(victim, cut=False)
    healed_at = time.time()
    newest = max(r["step"] for r in job.committed(others))
    print(json.dumps({"serving": serving, "victim": victim, "stale_step": stale()}))
    print(json.dumps({"cut_s": round(healed_at - cut_at, 2), "others_at": newest}))

    def healed() -> dict | None:
        ok = [r for r in job.committed((victim,)) if r["healed"] and r["step"] >= newest]
        return ok[0] if ok else None

    back = until(healed, GIVE_UP_S)  # longer than its bound, for the evidence
    heal = healed()
    # The job goes on with all three for long enough that a wrong eviction would show.
    together = until(
        lambda: heal is not None and job.all_together_since(healed_at + WATCH_AFTER_HEAL, newest),
        WATCH_AFTER_HEAL + GIVE_UP_S,
    )
    job.stop()

    problems = [] if went_on else [f"the others did not commit 100 steps past {stale()}"]
    # Cut off, its own lighthouse (not serving, alone) can issue it no quorum: no step
    # of it whose quorum came before the heal commits. (A step waits for its quorum
    # right after its start; the forward pass it overlaps takes milliseconds here.)
    late = [
        r
        for r in job.committed((victim,))
        if r["t_start"] > cut_at and r["t_start"] + r["quorum_s"] < healed_at - 0.5
    ]
    if late:
        problems.append(f"{group_of(victim)} committed while cut off: {late[:2]}")
    if not back:
        problems.append(
            f"{group_of(victim)} did not heal to step {newest} within {GIVE_UP_S} s of the "
            f"heal; its steps since: {steps_since(job, victim, healed_at)}"
        )
    elif heal["t_end"] - healed_at > HEAL_BOUND:
        answered = heal["t_start"] + heal["quorum_s"] - healed_at
        problems.append(
            f"{group_of(victim)} committed its healed step {heal['step']} only "
            f"{heal['t_end'] - healed_at:.1f} s after the heal (bound {HEAL_BOUND} s): its "
            f"quorum came {answered:.1f} s after the heal; its steps from the cut on: "
            f"{steps_since(job, victim, cut_at)}"
        )
    if not together:
        problems.append("the three did not commit together after the heal")
    problems += restarted(job, others) + invariants(job)
    if heal:
        print(json.dumps({"healed_after_s": round(heal["t_end"] - healed_at, 2), **heal}))
    print(timeline(job, cut_at - 1.0))
    logs = job.save(cut_at - 1.0)
    assert not problems, "\n".join(problems) + f"\n(logs in {logs})\n" + evidence(job, healed_at)


def steps_since(job: Job, name: str, t: float) -> list[str]:
    """The outcomes of the group's first steps that ended after `t`."""
    return [
        f"step {r['step']} q{r['quorum_id']}: "
        + ("committed" if r["committed"] else (r["failure"] or "")[:200])
        for r in job.records((name,))
        if r["t_end"] > t
    ][:4]


def timeline(job: Job, since: float, rows: int = 300) -> str:
    """From `since` on: each group's changes of quorum, of size or of outcome (its
    first step in each), its heals and failures, and its launcher's lines, by time."""
    out = []
    for name, child in job.groups.items():
        last = None
        for line in list(child.lines):
            r, text = step_of(line), line.get("text", "")
            if r and r["t_start"] > since:
                what = "committed" if r["committed"] else (r["failure"] or "")[:200]
                key = (r["quorum_id"], r["participants"], r["committed"], r["pid"])
                if key != last or r["healed"] or not r["committed"]:
                    healed = "healed, " if r["healed"] else ""
                    row = f"{group_of(name)} step {r['step']} q{r['quorum_id']} "
                    row += f"p{r['participants']} fp {r['fingerprint']}: {healed}{what}"
                    out.append((r["t_start"], row))
                last = key
            elif text.startswith("[phalanx run]") and line["read_at"] > since:
                out.append((line["read_at"], text[:300]))
    return "\n".join(f"{t - since:8.2f} {text}" for t, text in sorted(out)[:rows])


def evidence(job: Job, since: float, lines: int = 60) -> str:
    """After `since`: the launchers' own lines, evictions and rollbacks, and failed
    steps (a failure repeated step after step is shown once, with its count)."""
    keys = ("[phalanx run]", "evicted", "lineage", "rolled back", "gave up")
    out: list[list] = []  # [text, times]
    for name, child in job.groups.items():
        for line in list(child.lines):
            text, r = line.get("text", ""), step_of(line)
            if line["read_at"] <= since:
                continue
            if r and not r["committed"]:
                text = f"[{group_of(name)}] step failed: {(r['failure'] or '')[:300]}"
            elif r or not any(k in text for k in keys):
                continue
            if out and out[-1][0] == text:
                out[-1][1] += 1
            else:
                out.append([text[:400], 1])
    return "\n".join(text + (f" (x{n})" if n > 1 else "") for text, n in out[:lines])


# -- the nemesis ---------------------------------------------------------------------------

NEMESIS_S = 180.0


@dataclass
class Fault:
    kind: str
    target: str
    at: float
    #: When the fault ended (the cut healed, the lighthouse back); None: not yet.
    ended: float | None = None
    #: When all three groups committed together again after it ended.
    whole: float | None = None
    #: The host whose lighthouse served when the fault began.
    serving: str | None = None

    def gap(self, committed: list[dict]) -> float | None:
        """From the fault to the first commit of any group in a step begun after it."""
        after = [r["t_end"] for r in committed if r["t_start"] > self.at]
        return min(after) - self.at if after else None


class NoneServing(Exception):
    """No lighthouse of the set serves."""


class Nemesis:
    """One fault at a time, each on a job that is whole: cut a host off, split two
    hosts, kill or stop the serving lighthouse, kill a group's ranks."""

    KINDS = ("cut_off", "split", "kill_lighthouse", "pause_lighthouse", "kill_group")

    def __init__(self, job: Job, switch: Switch, rng: random.Random) -> None:
        self.job, self.switch, self.rng = job, switch, rng
        self.faults: list[Fault] = []
        self.problems: list[str] = []

    def hold(self) -> None:
        time.sleep(self.rng.uniform(4.0, 10.0))

    def cut_off(self) -> Fault:
        name = self.rng.choice(NAMES)
        serving = self.job.serving(timeout=1.0)
        self.switch.cut_off(name)
        fault = Fault("cut_off", name, time.time(), serving=serving)
        self.hold()
        self.switch.cut_off(name, cut=False)
        return fault

    def split(self) -> Fault:
        a, b = self.rng.sample(NAMES, 2)
        serving = self.job.serving(timeout=1.0)
        self.switch.split(a, b)
        fault = Fault("split", f"{a}|{b}", time.time(), serving=serving)
        self.hold()
        self.switch.split(a, b, cut=False)
        return fault

    def kill_lighthouse(self) -> Fault:
        name = self.serving()
        self.job.lighthouse(name).signal(signal.SIGKILL)
        fault = Fault("kill_lighthouse", name, time.time(), serving=name)
        self.job.lighthouse(name).wait(timeout=10)
        time.sleep(self.rng.uniform(1.0, 4.0))
        self.job.start_lighthouse(name)
        return fault

    def pause_lighthouse(self) -> Fault:
        name = self.serving()
        self.job.lighthouse(name).signal(signal.SIGSTOP)
        fault = Fault("pause_lighthouse", name, time.time(), serving=name)
        self.hold()
        self.job.lighthouse(name).signal(signal.SIGCONT)
        return fault

    def kill_group(self) -> Fault:
        name = self.rng.choice(NAMES)
        pids = self.job.rank_pids(name)
        self.job.kills[name] += 1
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return Fault("kill_group", name, time.time())

    def serving(self) -> str:
        name = self.job.serving()
        if name is None:
            raise NoneServing("no lighthouse served for 15 s on a whole job")
        return name

    def run(self, seconds: float) -> None:
        """Faults until `seconds` have passed; stops early when the job does not come
        back whole after one (what follows would be noise)."""
        began = time.time()
        while time.time() - began < seconds:
            kind = self.rng.choice(self.KINDS)
            try:
                fault = getattr(self, kind)()
            except NoneServing as e:
                self.problems.append(str(e))
                return
            fault.ended = time.time()
            self.faults.append(fault)
            if until(lambda f=fault: self.job.all_together_since(f.ended), GIVE_UP_S):
                fault.whole = time.time()
            else:
                return
            time.sleep(max(0.0, fault.at + self.rng.uniform(6.0, 12.0) - time.time()))

    def report(self, ceiling: float | None = None) -> list[str]:
        """The faults after which the job did not commit, or was not whole again,
        within their bounds (or, given `ceiling`, within that many seconds)."""
        committed = self.job.committed()
        problems = list(self.problems)
        for fault in self.faults:
            gap = fault.gap(committed)
            row = {
                "kind": fault.kind,
                "target": fault.target,
                "serving": fault.serving,
                "lasted_s": round(fault.ended - fault.at, 2),
                "commit_gap_s": None if gap is None else round(gap, 2),
                "whole_after_s": None
                if fault.whole is None
                else round(fault.whole - fault.ended, 2),
            }
            if ceiling is None:
                print(json.dumps(row))
            bound, rejoin = COMMIT_BOUNDS[fault.kind], REJOIN_BOUNDS[fault.kind]
            if ceiling is not None:
                bound = rejoin = ceiling
            if gap is None or gap > bound:
                problems.append(f"no commit within {bound} s of the fault: {row}")
            if fault.whole is None or fault.whole - fault.ended > rejoin:
                problems.append(f"the job was not whole within {rejoin} s of its end: {row}")
        return problems


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_seeded_nemesis_of_cuts_splits_and_kills_loses_no_committed_step(
    three_hosts: tuple[dict[str, Host], Switch], job: Job
):
    """A fault every 6 to 12 s for 3 minutes, each on a whole job: a host cut off or
    two hosts split apart for 4 to 10 s, the serving lighthouse killed (restarted 1 to
    4 s later) or stopped for 4 to 10 s, a group's ranks killed. Throughout, the
    invariants of this file hold; after each fault the job commits, and is whole
    again, within LIVENESS_CEILING (and the summary line lists every fault that took
    longer than its own bound, and every eviction)."""
    seed = int(os.environ.get("NEMESIS_SEED") or random.SystemRandom().randrange(2**31))
    print(json.dumps({"nemesis_seed": seed}))
    _, switch = three_hosts
    nemesis = Nemesis(job, switch, random.Random(seed))
    began = time.time()
    nemesis.run(NEMESIS_S)
    job.stop()
    # What must never happen, whatever the timing: a step number with two states in
    # a lineage, the job going back, ids going down, two lighthouses serving.
    broken = invariants(job)
    # How fast the job is whole again after each fault, and who was evicted: held to
    # the per-fault bounds above in the summary, and to LIVENESS_CEILING here (a
    # loaded 2-core machine misses a bound of a few seconds now and then).
    late = nemesis.report() + restarted(job)
    stuck = nemesis.report(ceiling=LIVENESS_CEILING) + [p for p in late if "exited" in p]
    problems = broken + stuck
    print(
        json.dumps(
            {
                "seed": seed,
                "faults": len(nemesis.faults),
                "s": round(time.time() - began),
                "beyond_bounds": late,
            }
        )
    )
    logs = job.save(began)
    with open(logs / "faults.jsonl", "w") as f:
        for fault in nemesis.faults:
            times = {
                k: round(v - began, 2) for k in ("at", "ended", "whole") if (v := getattr(fault, k))
            }
            f.write(json.dumps({"kind": fault.kind, "target": fault.target, **times}) + "\n")
    assert not problems, (
        f"seed {seed}:\n" + "\n".join(problems) + f"\n(logs in {logs})\n" + evidence(job, began)
    )
