"""Durable snapshots, proven by faults: real rank processes (tests/procs/snapshot_train.py,
under `phalanx run`, which restarts them) write snapshots as they train, every rank of
every group is SIGKILLed at once, and the groups that come back resume from the newest
complete snapshot.

What each test checks:
- the state a restarted rank loads is bit-identical to the state the groups logged
  for that step before the kill (fingerprints of model and optimizer, of this rank's
  shards under HSDP, of the global parameters and outer optimizer under DiLoCo), and
  the first step trained from it is the step the killed groups had trained;
- a kill that lands while a snapshot is being written (its data folder there, its
  manifest not) leaves that snapshot unused: the previous one is loaded, nothing is
  torn, and the orphaned data is removed once a newer snapshot is published;
- with the lighthouse alive, the job goes on as a new lineage from the snapshot's
  step, and every committed step has one fingerprint across groups within a lineage,
  also when the groups were lost right after a commit the lighthouse never heard of.

The kill lands where the test chose: every rank holds its training thread after
committing a given step (`--hold-at`), or a snapshot write hangs (`--hold-write`).
Every wait is on an event (a line, a file) with a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from phalanx.snapshots import catalog
from phalanx.snapshots.catalog import Manifest
from phalanx.snapshots.seal import SnapshotKey

from conftest import PROCS, Child, wait_until

TRAIN = PROCS / "snapshot_train.py"
EVERY = 4
#: The job's token: its snapshots are sealed under a key derived from it.
TOKEN = "snapshot-faults-token"
KEY = SnapshotKey.of(TOKEN)
#: Long enough for imports and a quorum on 2 busy cores.
WAIT = 90.0


class Start:
    """One start of one rank: the JSON lines it printed (the first is "ready")."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lines: list[dict] = []

    @property
    def pid(self) -> int:
        return self.lines[0]["pid"]


class Job:
    """`phalanx run --replicas 2` of snapshot_train.py with snapshots every EVERY
    steps into `folder`; the launcher restarts a rank that dies."""

    def __init__(
        self,
        spawn: Callable[..., Child],
        folder: Path,
        *rank_args: str,
        nproc: int = 1,
        backoff: float = 0.5,
    ) -> None:
        self.folder = folder
        argv = [
            sys.executable, "-m", "phalanx", "run", "--replicas", "2", "--min-replicas", "2",
            "--nproc-per-replica", str(nproc), "--restart-backoff", str(backoff),
            "--snapshot-dir", str(folder), "--snapshot-every", str(EVERY),
            "--token", TOKEN, "--", str(TRAIN), *rank_args,
        ]  # fmt: skip
        self.launcher = spawn("phalanx run", argv)

    def starts(self) -> dict[str, list[Start]]:
        """Every start of every rank ("group0/1"), in order, from the launcher's output."""
        found: dict[str, list[Start]] = defaultdict(list)
        for line in self.launcher.lines:
            prefix, _, rest = line.get("text", "").partition(" ")
            if not (prefix.startswith("[group") and rest.startswith("{")):
                continue
            rank, reported = prefix.strip("[]"), json.loads(rest)
            if reported["event"] == "ready":
                found[rank].append(Start(f"{rank}#{len(found[rank])}"))
            found[rank][-1].lines.append(reported)
        return found

    def run(self, n: int) -> list[Start]:
        """The `n`-th start of every rank (empty until every rank has one)."""
        starts = self.starts()
        if not starts or any(len(runs) <= n for runs in starts.values()):
            return []
        return [starts[rank][n] for rank in sorted(starts)]

    def wait_for(self, event: str, ranks: int) -> list[Start]:
        """The first starts of all `ranks` ranks, once each printed an `event` line."""

        def printed() -> list[Start] | None:
            first = self.run(0)
            done = [s for s in first if any(line["event"] == event for line in s.lines)]
            return first if len(first) == ranks and len(done) == ranks else None

        try:
            return wait_until(printed, WAIT, f"every rank's {event!r} line")
        except pytest.fail.Exception as e:
            pytest.fail(f"{e}\n{self.launcher.describe(40)}")

    def kill(self, ranks: Iterable[Start]) -> None:
        """SIGKILL to every rank at once; waits until all are dead."""
        pids = [start.pid for start in ranks]
        assert all(not dead(pid) for pid in pids), "a rank died before the kill"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: all(dead(pid) for pid in pids), 10, "the killed ranks dead")

    def finish(self) -> tuple[list[Start], list[Start]]:
        """Waits for the job to end well; returns the ranks' first and second starts."""
        assert self.launcher.proc.wait(timeout=2 * WAIT) == 0, self.launcher.describe(40)
        self.launcher.wait(10)
        starts = self.starts()
        assert all(len(runs) == 2 for runs in starts.values()), {
            rank: len(runs) for rank, runs in starts.items()
        }
        return self.run(0), self.run(1)


def dead(pid: int) -> bool:
    """Gone, or a zombie its parent has not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # reaped, or as it was read
        return True


def manifests(folder: Path) -> list[Manifest]:
    """The published snapshots, newest first (none while the folder is not made yet;
    one removed as it is listed, by a writer keeping the newest, is left out)."""
    found = []
    for name in catalog.newest_first(os.listdir(folder) if folder.exists() else []):
        try:
            found.append(Manifest.parse((folder / name).read_bytes(), name, KEY))
        except FileNotFoundError:
            continue
    return found


def newest_step(folder: Path) -> int:
    found = manifests(folder)
    return found[0].step if found else -1


def hold_then_kill(job: Job, ranks: int, snapshot_step: int) -> tuple[Manifest, list[Start]]:
    """Waits until every rank holds (`--hold-at snapshot_step + 2`) and the snapshot
    of `snapshot_step` is published, then SIGKILLs every rank at once; returns the
    newest snapshot and the ranks killed. The lighthouse learns of a commit from the
    next quorum's request: it knows of step `snapshot_step + 1`, newer than the
    snapshot, so the resume is a rollback, a new lineage."""
    killed = job.wait_for("holding", ranks)
    wait_until(lambda: newest_step(job.folder) == snapshot_step, WAIT, "the snapshot published")
    job.kill(killed)
    # The newest of lineage 0: the restarted job may have published one of its own.
    return next(m for m in manifests(job.folder) if m.lineage == 0), killed


def committed(start: Start | Child) -> list[dict]:
    return [line for line in start.lines if line.get("event") == "step" and line["committed"]]


def hash_at(starts: list, step: int, lineage: int = 0, rank: int = 0) -> str:
    """The one fingerprint the ranks logged for committed `step` of `lineage`."""
    seen = {
        line["hash"]
        for start in starts
        for line in committed(start)
        if (line["after"], line["lineage"], line["rank"]) == (step, lineage, rank)
    }
    assert len(seen) == 1, f"step {step} of lineage {lineage} (rank {rank}): {seen}"
    return seen.pop()


def assert_one_state_per_step(starts: list) -> int:
    """Every committed (lineage, step, rank) logged by two or more ranks has one
    fingerprint, and no state is torn; returns how many were compared."""
    hashes: dict[tuple[int, int, int], set[str]] = defaultdict(set)
    reached: dict[tuple[int, int, int], int] = defaultdict(int)
    for start in starts:
        for line in committed(start):
            key = (line["lineage"], line["after"], line["rank"])
            hashes[key].add(line["hash"])
            reached[key] += 1
            assert not line["torn"], f"{start.name}: {line}"
    compared = [key for key, n in reached.items() if n >= 2]
    diverged = {key: hashes[key] for key in compared if len(hashes[key]) > 1}
    assert not diverged, f"states diverged at (lineage, step, rank) {sorted(diverged)}"
    return len(compared)


def assert_resumed_where_it_left(before: list[Start], after: list[Start], snapshot: Manifest):
    """Every restarted rank loaded `snapshot` into exactly the state its rank committed
    at the snapshot's step before the kill, trained on from that step, untorn, and
    the job went on as one new lineage; returns that lineage."""
    lineages = set()
    for start in after:
        line = next((line for line in start.lines if line["event"] == "resumed"), None)
        assert line is not None and line["failure"] is None, (start.name, start.lines[:3])
        first = next(line for line in start.lines if line["event"] == "step")
        want = hash_at(before, snapshot.step, rank=first["rank"])
        assert (line["name"], line["hash"]) == (snapshot.name, want), (start.name, line, want)
        assert first["step"] == snapshot.step and not first["torn"], first
        lineages |= {line["lineage"] for line in committed(start)}
    assert len(lineages) == 1 and lineages != {0}, f"one new lineage: {lineages}"
    return lineages.pop()


def assert_same_next_step(before: list[Start], after: list[Start], step: int, lineage: int):
    """Trained from the snapshot on the same data with the same groups, the first
    step comes out bit-identical to the one the killed groups committed: the whole
    state (optimizer counters included) came back."""

    def both(starts: list[Start], lineage: int) -> bool:
        return all(
            line["participants"] == 2
            for start in starts
            for line in committed(start)
            if (line["after"], line["lineage"]) == (step + 1, lineage)
        )

    if both(before, 0) and both(after, lineage):
        for rank in {line["rank"] for start in after for line in committed(start)}:
            assert hash_at(before, step + 1, rank=rank) == hash_at(after, step + 1, lineage, rank)


# -- DDP: every group killed at once ------------------------------------------------------


def test_every_group_killed_at_once_resumes_from_the_last_complete_snapshot(spawn, tmp_path):
    steps = 3 * EVERY + 2
    job = Job(spawn, tmp_path, "--steps", str(steps), "--hold-at", str(2 * EVERY + 2))
    snapshot, _ = hold_then_kill(job, 2, 2 * EVERY)

    before, after = job.finish()
    lineage = assert_resumed_where_it_left(before, after, snapshot)
    assert_same_next_step(before, after, snapshot.step, lineage)
    assert assert_one_state_per_step(before + after) >= steps
    assert all(committed(start)[-1]["after"] == steps for start in after), "trained to the end"
    # The new lineage wrote snapshots of its own; the newest is one of them.
    assert manifests(tmp_path)[0].lineage == lineage


# The kill before the manifest's rename is the quick check's; inside DCP's write, CI's.
@pytest.mark.parametrize(
    "at", [pytest.param(at, marks=pytest.mark.slow) for at in ("data", "rename")] + ["publish"]
)
def test_a_kill_while_a_snapshot_is_written_leaves_the_previous_one_in_use(spawn, tmp_path, at):
    """Every group's writes from step 3 * EVERY on hang (in DCP's write, after the
    tensors; with the data complete and synced, before the manifest is written; or
    with the manifest in its temporary file, before its rename), and the kill lands
    while one hangs."""
    steps = 5 * EVERY
    hold = ("--hold-write", at, "--hold-from", str(3 * EVERY))
    # Restarted 2 s after the kill, long after the folder is looked at.
    job = Job(spawn, tmp_path, "--steps", str(steps), *hold, backoff=2.0)

    def holding() -> dict | None:
        """The first write that hangs (the next slot's writer may hang too by now)."""
        held = [line for s in job.run(0) for line in s.lines if line["event"] == "holding_write"]
        return min(held, key=lambda line: line["step"]) if held else None

    held = wait_until(holding, WAIT, "a snapshot write in flight")
    job.kill(job.run(0))

    # Mid-write: the data folder of the snapshot is there, its manifest is not.
    torn = [entry for entry in os.listdir(tmp_path) if held["stem"] in entry]
    data = [entry for entry in torn if entry.endswith(catalog.DATA_SUFFIX)]
    assert len(data) == 1 and not any(e.endswith(catalog.MANIFEST_SUFFIX) for e in torn), torn
    assert any((tmp_path / data[0] / "rank-0").iterdir()), "its shard was being written"
    if at == "rename":
        assert any(e.endswith(catalog.TEMPORARY_SUFFIX) for e in torn), "a temporary manifest"
    snapshot = manifests(tmp_path)[0]
    assert snapshot.step == 2 * EVERY and held["step"] == 3 * EVERY, (snapshot, held)

    before, after = job.finish()
    lineage = assert_resumed_where_it_left(before, after, snapshot)
    assert_same_next_step(before, after, snapshot.step, lineage)
    assert_one_state_per_step(before + after)
    # The new lineage published snapshots of its own, and the half-written one is gone.
    assert manifests(tmp_path)[0].lineage == lineage
    assert not any((tmp_path / entry).exists() for entry in torn), os.listdir(tmp_path)


# -- HSDP and DiLoCo ----------------------------------------------------------------------


# Slow: four rank processes on 2 cores, FSDP2 inside each group.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hsdp_groups_of_two_ranks_each_write_and_resume_their_own_shards(spawn, tmp_path):
    steps = 2 * EVERY + 2
    args = ("--strategy", "hsdp", "--steps", str(steps), "--hold-at", str(EVERY + 2))
    job = Job(spawn, tmp_path, *args, nproc=2)
    snapshot, _ = hold_then_kill(job, 4, EVERY)
    # Each rank wrote its own shard: both are in the data folder and the manifest.
    assert snapshot.world_size == 2 and len(snapshot.structures) == 2
    data = tmp_path / snapshot.data
    assert sorted(p.name for p in data.iterdir()) == ["rank-0", "rank-1"]
    assert {f.name.split("/")[0] for f in snapshot.files} == {"rank-0", "rank-1"}

    before, after = job.finish()
    lineage = assert_resumed_where_it_left(before, after, snapshot)
    assert_same_next_step(before, after, snapshot.step, lineage)
    assert assert_one_state_per_step(before + after) >= 2 * steps


@pytest.mark.slow
def test_diloco_resumes_its_global_parameters_and_outer_optimizer(spawn, tmp_path):
    """A DiLoCo step is a sync: its snapshots hold the global parameters, the outer
    optimizer's momentum and the schedule."""
    steps = 2 * EVERY + 2
    args = ("--strategy", "diloco", "--steps", str(steps), "--hold-at", str(EVERY + 2))
    job = Job(spawn, tmp_path, *args)
    snapshot, _ = hold_then_kill(job, 2, EVERY)
    assert "momentum_buffer" in snapshot.structures[0], "the outer optimizer's state is in it"

    before, after = job.finish()
    assert_resumed_where_it_left(before, after, snapshot)
    assert assert_one_state_per_step(before + after) >= steps


@pytest.mark.slow
def test_a_kill_right_after_a_commit_never_puts_two_states_under_one_step(spawn, tmp_path):
    """Both groups commit step 2 * EVERY + 1 and hold before asking for the next
    quorum, so the lighthouse knows of step 2 * EVERY alone, the snapshot's; all are
    killed, come back and train step 2 * EVERY + 1 again from the snapshot on other
    data (--fresh-data): that must be a new lineage, or one step number would hold
    two states (I11)."""
    args = ("--steps", str(3 * EVERY), "--hold-at", str(2 * EVERY + 1), "--fresh-data")
    job = Job(spawn, tmp_path, *args)
    killed = job.wait_for("holding", 2)
    wait_until(lambda: newest_step(tmp_path) == 2 * EVERY, WAIT, "the snapshot published")
    job.kill(killed)
    snapshot = next(m for m in manifests(tmp_path) if m.lineage == 0)

    before, after = job.finish()
    assert_resumed_where_it_left(before, after, snapshot)
    assert assert_one_state_per_step(before + after) >= 3 * EVERY
