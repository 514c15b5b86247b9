"""What durable snapshots cost training: one replica group (a real Manager, an
in-process lighthouse) training a model whose registered state (parameters + Adam's
two moments, CPU) is S MB, with snapshots every K steps and without, side by side.

    python benches/snapshot_cost.py --sizes-mb 100,1024 --rounds 3

Per size, each round runs the loop without snapshots and with them (a fresh snapshot
folder each time; which goes first alternates), then times the yardsticks on the same
tensors:

- stall: the time a snapshot step's start spent on the snapshot (StepRecord.snapshot_s,
  the copy to host memory), and that step's excess over the run's clean steps (no
  snapshot taken, no write in flight), against copying the same tensors the plain
  way. A rank's first snapshot allocates its host buffers, compared with
  `torch.empty_like(t).copy_(t)` (fresh memory); every later one copies into them,
  compared with a copy into buffers held from the last copy. Goal: a later stall <=
  that copy + 10 ms.
- overhead: the excess over the run's clean pace of every snapshot step and of every
  step run while a write was in flight, summed, per snapshot taken: the extra time
  one snapshot costs the loop, its background write included (the loop runs on until
  the last write is published). Measured within the run with snapshots, because the
  pace drifts between runs on a shared machine by more than that; (run with - run
  without) / snapshots is shown beside it as a cross-check. At one snapshot a minute
  the loop pays that extra once per 60 s of training (60 s / step time steps):
  overhead = extra / 60 s. That figure is DERIVED from the measured per-snapshot
  extra, not measured over minutes. Goal: <= 2%.
- write hold (the largest size): how much of the time a pure-Python loop on the
  training thread is kept from running during a snapshot's write, against a plain
  thread writing and fsyncing the same bytes, and against nothing.
- resume (the largest size): `phalanx.snapshots.newest` (which verifies every file's
  SHA-256) + `load` into a fresh model and optimizer, against plain reads of the same
  files, both with the page cache warm (the files were just written or read); and
  both again cold for these files alone (their pages evicted with
  posix_fadvise(DONTNEED), which touches no one else's cache).

The training thread runs torch with one thread, leaving the other core of a 2-core
machine to the snapshot's write; every ratio is taken within a round, and the
medians over rounds are reported (the machine is shared: single rounds swing).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

import phalanx
from phalanx import snapshots
from phalanx.snapshots.resume import sealed

from harness import report

# The bench's job has no token: its snapshots are sealed under the key anyone can derive.
KEY = snapshots.SnapshotKey.of(None)

LAYERS = 16
#: A bound on the steps run after the measured ones while the last write finishes.
TAIL_STEPS_MAX = 100_000
#: Bytes of registered state per parameter: the parameter and Adam's two moments.
STATE_BYTES_PER_PARAM = 12
median = statistics.median


def build(size_mb: float, trained: bool = True) -> tuple[nn.Module, torch.optim.Adam, torch.Tensor]:
    """A stack of LAYERS square linear layers whose parameters and Adam state come to
    about `size_mb`, its optimizer, and an input batch. `trained`: one step taken, so
    that Adam's moments exist; else the zeroed model and empty optimizer that a
    restarted process makes."""
    params = size_mb * 2**20 / STATE_BYTES_PER_PARAM
    width = max(32, int((params / LAYERS) ** 0.5) // 32 * 32)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(LAYERS)])
    adam = torch.optim.Adam(model.parameters(), lr=1e-5)
    batch = torch.randn(8, width, generator=torch.Generator().manual_seed(1))
    if trained:
        model(batch).square().mean().backward()
        adam.step()
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    return model, adam, batch


def state_tensors(model: nn.Module, adam: torch.optim.Adam) -> list[torch.Tensor]:
    """The registered state's tensors, as the snapshot sees them."""
    tensors = list(model.state_dict().values())
    for per_param in adam.state_dict()["state"].values():
        tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    return tensors


def fingerprint(model: nn.Module) -> float:
    """A cheap mark of the model's values (a row of the first and last layers)."""
    first, last = model[0].weight, model[-1].weight
    with torch.no_grad():
        return float(first[0].double().sum() + last[-1].double().sum())


def fresh_copy_s(tensors: list[torch.Tensor]) -> float:
    started = time.perf_counter()
    copies = [torch.empty_like(t).copy_(t) for t in tensors]
    seconds = time.perf_counter() - started
    del copies
    return seconds


def held_copy_s(tensors: list[torch.Tensor], buffers: list[torch.Tensor]) -> float:
    started = time.perf_counter()
    for t, b in zip(tensors, buffers, strict=True):
        b.copy_(t)
    return time.perf_counter() - started


@dataclass
class Run:
    step_s: list[float] = field(default_factory=list)
    snapshot_s: list[float] = field(default_factory=list)
    #: Steps that ran while a snapshot's write was in flight (after its copy).
    writing: list[bool] = field(default_factory=list)
    #: The model's fingerprint by committed step, taken as the step began.
    fingerprints: dict[int, float] = field(default_factory=dict)
    #: Seconds from the loop's start until its last step, or its last write, ended.
    seconds: float = 0.0
    write_s: list[float] = field(default_factory=list)
    skipped: int = 0

    @property
    def snapshots(self) -> int:
        return sum(s > 0 for s in self.snapshot_s)


def published_count(folder: Path) -> int:
    return sum(name.endswith(".json") for name in os.listdir(folder))


def published(folder: Path) -> list[snapshots.Manifest]:
    return list(sealed(snapshots.Storage.at(folder), KEY))


def train(
    size_mb: float, steps: int, every: int | None, folder: Path | None, tail_s: float = 0.0
) -> Run:
    """`steps` steps of one group (snapshots every `every` into `folder`, kept all),
    then more, for up to `tail_s`, while the last write is still in flight."""
    model, adam, batch = build(size_mb)
    run = Run()
    snapshot = {}
    if folder is not None:
        snapshot = dict(snapshot_dir=str(folder), snapshot_every=every, snapshot_keep=10_000)
    with (
        phalanx.LighthouseServer(join_timeout=0.01) as lighthouse,
        phalanx.Manager(
            replica_id=f"bench-{os.getpid()}-{time.monotonic_ns()}",
            lighthouse=lighthouse.address,
            **snapshot,
        ) as manager,
    ):
        optimizer = phalanx.Optimizer(manager, adam)
        manager.register_state("model", model.state_dict, model.load_state_dict)
        taken = done = 0
        started = time.perf_counter()
        tail_until = None
        for i in range(steps + TAIL_STEPS_MAX):
            done = published_count(folder) if folder is not None else 0
            if i >= steps:
                tail_until = tail_until or time.perf_counter() + tail_s
                if done == taken or time.perf_counter() > tail_until:
                    break
            in_flight = taken > done
            run.fingerprints[manager.current_step()] = fingerprint(model)
            begun = time.perf_counter()
            optimizer.zero_grad()
            model(batch).square().mean().backward()
            if not optimizer.step():
                raise SystemExit(f"step {i} did not commit: {manager.failure}")
            run.step_s.append(time.perf_counter() - begun)
            run.snapshot_s.append(manager.last_step.snapshot_s)
            taken += run.snapshot_s[-1] > 0
            run.writing.append(in_flight)
        run.seconds = time.perf_counter() - started
        # The Manager's shutdown takes a snapshot the group decided on at the last vote.
        run.fingerprints[manager.current_step()] = fingerprint(model)
        if published_count(folder) < taken if folder is not None else False:
            print(f"note: the last write was not published within {tail_s:g} s after the run")
    if folder is not None:  # the Manager's shutdown waited for a write in flight
        manifests = published(folder)
        run.write_s = [m.write_s for m in manifests]
        # Committed step k * every is due a snapshot, taken as step k * every + 1 begins.
        run.skipped = (steps - 1) // every - sum(s > 0 for s in run.snapshot_s[:steps])
    return run


def drop_from_cache(paths: list[Path]) -> None:
    """Evicts these files' clean pages (no one else's) from the page cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read_s(paths: list[Path], digest: bool = False) -> float:
    """Plain reads of `paths` into one reused 8 MiB buffer (`digest`: and their
    SHA-256, which is what verifying a snapshot adds to reading it)."""
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    started = time.perf_counter()
    for path in paths:
        sha = hashlib.sha256()
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                if digest:
                    sha.update(view[:n])
    return time.perf_counter() - started


def resume_once(folder: Path, size_mb: float, expected: dict[int, float]) -> tuple[float, float]:
    """(seconds in newest(), which verifies; seconds in load()) into a fresh state;
    checks the loaded model is the one snapshotted."""
    model, adam, _ = build(size_mb, trained=False)
    storage = snapshots.Storage.at(folder)
    started = time.perf_counter()
    manifest = snapshots.newest(storage, 1, KEY)
    verified = time.perf_counter()
    if manifest is None:
        raise SystemExit(f"no snapshot in {folder} verifies")
    state = {"optimizer": adam.state_dict(), "model": model.state_dict()}
    loaded = snapshots.load(storage, manifest, 0, state)
    model.load_state_dict(loaded["model"])
    adam.load_state_dict(loaded["optimizer"])
    done = time.perf_counter()
    if fingerprint(model) != expected[manifest.step]:
        raise SystemExit(
            f"snapshot {manifest.name} loaded another state than step {manifest.step}'s"
        )
    return verified - started, done - verified


def kept_from_running(busy: Callable[[], bool]) -> tuple[float, float, float]:
    """Spins a pure-Python loop on this thread (as a training thread's Python runs)
    while `busy()`: (seconds, the longest it was kept from running, the share of the
    time it was kept from running more than 5 ms at a stretch)."""
    started = last = time.perf_counter()
    longest = held = 0.0
    while busy():
        now = time.perf_counter()
        gap, last = now - last, now
        longest = max(longest, gap)
        held += gap if gap > 0.005 else 0.0
    seconds = last - started
    return seconds, longest, held / max(seconds, 1e-9)


def write_hold(model: nn.Module, adam: torch.optim.Adam, folder: Path) -> dict:
    """How much a snapshot's background write keeps the training thread's Python from
    running (the GIL, and the CPU on a small machine), against a plain thread writing
    and fsyncing the same bytes, and against nothing at all for as long."""
    from phalanx.snapshots.writer import SnapshotWriter

    folder.mkdir(parents=True, exist_ok=True)
    storage = snapshots.Storage.at(folder)
    writer = SnapshotWriter(
        storage, replica_id="probe", group_rank=0, world_size=1, keep=1, store=None, key=KEY
    )
    writer.take({"model": model.state_dict(), "optimizer": adam.state_dict()}, 1, 1, 0)
    snapshot = kept_from_running(lambda: writer.busy)
    tensors = state_tensors(model, adam)

    def plain_write() -> None:
        with open(folder / "plain.bin", "wb") as f:
            for t in tensors:
                f.write(t.contiguous().numpy().data)
            f.flush()
            os.fsync(f.fileno())

    thread = threading.Thread(target=plain_write)
    thread.start()
    plain = kept_from_running(thread.is_alive)
    until = time.perf_counter() + plain[0]
    idle = kept_from_running(lambda: time.perf_counter() < until)
    shutil.rmtree(folder)
    return {"snapshot": snapshot, "plain": plain, "idle": idle}


@dataclass
class Round:
    off: Run
    on: Run
    fresh_copy_s: float
    held_copy_s: float
    hold: dict | None


def measure_size(size_mb: float, args: argparse.Namespace, root: Path) -> dict:
    model, adam, _ = build(size_mb)
    tensors = state_tensors(model, adam)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    buffers = [torch.empty_like(t).copy_(t) for t in tensors]
    rounds = []
    for r in range(args.rounds):
        folder = root / f"{size_mb:g}mb-{r}"
        # In turn first, so that what came before a round (the last one's writes and
        # probes) weighs on both sides alike.
        if r % 2 == 0:
            off = train(size_mb, args.steps, None, None)
            on = train(size_mb, args.steps, args.every, folder, tail_s=120.0)
        else:
            on = train(size_mb, args.steps, args.every, folder, tail_s=120.0)
            off = train(size_mb, args.steps, None, None)
        # The yardsticks, a few times each between the runs: the best is the copy's cost.
        fresh = min(fresh_copy_s(tensors) for _ in range(3))
        held = min(held_copy_s(tensors, buffers) for _ in range(3))
        hold = write_hold(model, adam, root / "probe") if args.resume else None
        rounds.append(Round(off, on, fresh, held, hold))
        if r < args.rounds - 1:
            shutil.rmtree(folder)
    del buffers
    resumed = measure_resume(size_mb, args, folder, rounds[-1].on) if args.resume else None
    return summarize(size_mb, nbytes, tensors, rounds, args, resumed)


def measure_resume(size_mb: float, args: argparse.Namespace, folder: Path, run: Run) -> dict:
    manifest = max(published(folder), key=lambda m: m.step)
    paths = [folder / manifest.data / f.name for f in manifest.files]
    # Keep only the newest snapshot, so newest() verifies and load() reads it alone.
    storage = snapshots.Storage.at(folder)
    for old in published(folder):
        if old.name != manifest.name:
            storage.remove(old.name)
            storage.remove(old.data)
    warm, cold, crc = [], [], []
    for _ in range(args.rounds):
        raw = raw_read_s(paths)
        crc.append(raw_read_s(paths, digest=True))
        verify_s, load_s = resume_once(folder, size_mb, run.fingerprints)
        warm.append((raw, verify_s, load_s))
        drop_from_cache(paths)
        raw = raw_read_s(paths)
        drop_from_cache(paths)
        verify_s, load_s = resume_once(folder, size_mb, run.fingerprints)
        cold.append((raw, verify_s, load_s))

    def side(samples: list[tuple[float, float, float]]) -> dict:
        return {
            "raw_read_s": round(median(s[0] for s in samples), 4),
            "verify_s": round(median(s[1] for s in samples), 4),
            "load_s": round(median(s[2] for s in samples), 4),
            "resume_s": round(median(s[1] + s[2] for s in samples), 4),
            "ratio_to_raw": round(median((s[1] + s[2]) / s[0] for s in samples), 3),
            "ratio_min": round(min((s[1] + s[2]) / s[0] for s in samples), 3),
            "ratio_max": round(max((s[1] + s[2]) / s[0] for s in samples), 3),
        }

    return {
        "bytes": manifest.nbytes,
        "warm": side(warm),
        "cold": side(cold),
        "raw_read_sha256_warm_s": round(median(crc), 4),
    }


def summarize(
    size_mb: float,
    nbytes: int,
    tensors: list[torch.Tensor],
    rounds: list[Round],
    args: argparse.Namespace,
    resumed: dict | None,
) -> dict:
    stalls, excesses, over_fresh, over_held, step_off, step_on = [], [], [], [], [], []
    firsts, laters = [], []
    per_snapshot, per_snapshot_runs, overhead, writing_ratio = [], [], [], []
    for r in rounds:
        on, off = r.on, r.off
        steps = list(zip(on.step_s, on.snapshot_s, on.writing, strict=True))
        snap = [s for s in on.snapshot_s if s > 0]
        # The run's own pace: steps with no snapshot taken and no write in flight.
        clean = median(t for t, s, w in steps if s == 0 and not w)
        stalls += snap
        excesses += [t - clean for t, s, _ in steps if s]
        # Each run is a new Manager: its first snapshot allocates the host buffers.
        firsts += snap[:1]
        laters += snap[1:]
        over_fresh += [first - r.fresh_copy_s for first in snap[:1]]
        over_held += [later - r.held_copy_s for later in snap[1:]]
        # What snapshots cost the loop, within the run: every snapshot step's and every
        # step's during a write excess over the run's clean pace.
        extra = sum(t - clean for t, s, w in steps if s or w)
        per_snapshot.append(extra / max(1, on.snapshots))
        overhead.append(extra / (clean * len(steps)))
        # Across runs (equal work: `steps` steps; on may run more to finish its last
        # write, counted at off's median step): drift between runs swamps it on a
        # shared machine, so it is a cross-check only.
        more = len(on.step_s) - len(off.step_s)
        across = on.seconds - off.seconds - more * median(off.step_s)
        per_snapshot_runs.append(across / max(1, on.snapshots))
        step_off.append(median(off.step_s))
        step_on.append(clean)
        during = [t for t, s, w in steps if w and s == 0]
        if during:
            writing_ratio.append(median(during) / clean)
    extra_s = median(per_snapshot)
    step_s = median(step_off)
    result = {
        "size_mb": size_mb,
        "state_mb": round(nbytes / 2**20, 1),
        "tensors": len(tensors),
        "snapshot_every": args.every,
        "steps": args.steps,
        "rounds": len(rounds),
        "snapshots": sum(r.on.snapshots for r in rounds),
        "skipped": sum(r.on.skipped for r in rounds),
        "step_ms": round(step_s * 1e3, 2),
        "step_ms_clean_with_snapshots_on": round(median(step_on) * 1e3, 2),
        "stall_ms": round(median(stalls) * 1e3, 2),
        "stall_ms_max": round(max(stalls) * 1e3, 2),
        "stalls_ms": [round(x * 1e3, 1) for x in stalls],
        "step_excess_ms": round(median(excesses) * 1e3, 2),
        "fresh_copy_ms": round(median(r.fresh_copy_s for r in rounds) * 1e3, 2),
        "held_copy_ms": round(median(r.held_copy_s for r in rounds) * 1e3, 2),
        "stall_first_ms": round(median(firsts) * 1e3, 2),
        "stall_later_ms": round(median(laters) * 1e3, 2) if laters else None,
        "stall_first_over_fresh_copy_ms": round(median(over_fresh) * 1e3, 2),
        "stall_later_over_held_copy_ms": round(median(over_held) * 1e3, 2) if over_held else None,
        "stall_goal_met": bool(over_held) and median(over_held) <= 0.010,
        "write_s": round(median(w for r in rounds for w in r.on.write_s), 3),
        "step_ratio_while_writing": round(median(writing_ratio), 3) if writing_ratio else None,
        "extra_s_per_snapshot": round(extra_s, 4),
        "extra_s_per_snapshot_min": round(min(per_snapshot), 4),
        "extra_s_per_snapshot_max": round(max(per_snapshot), 4),
        "overhead_at_interval": round(median(overhead), 4),
        "extra_s_per_snapshot_across_runs": round(median(per_snapshot_runs), 4),
        "extra_s_per_snapshot_across_runs_min": round(min(per_snapshot_runs), 4),
        "extra_s_per_snapshot_across_runs_max": round(max(per_snapshot_runs), 4),
        # Derived: one snapshot per 60 s of training costs the loop its extra once.
        "derived_overhead_per_minute": round(extra_s / 60.0, 5),
    }
    result["overhead_goal_met"] = result["derived_overhead_per_minute"] <= 0.02
    if rounds[0].hold is not None:
        result["write_hold"] = {
            side: {
                "seconds": round(median(r.hold[side][0] for r in rounds), 2),
                "longest_ms": round(median(r.hold[side][1] for r in rounds) * 1e3, 1),
                "held_share": round(median(r.hold[side][2] for r in rounds), 3),
            }
            for side in ("snapshot", "plain", "idle")
        }
    if resumed is not None:
        result["resume"] = resumed
    return result


def rows_of(r: dict) -> list[tuple[str, object]]:
    mb = r["size_mb"]
    rows = [
        (
            f"[{mb:g} MB] state",
            f"{r['state_mb']:g} MiB in {r['tensors']} tensors (params + Adam moments)",
        ),
        (
            f"[{mb:g} MB] snapshots taken / skipped (busy)",
            f"{r['snapshots']} / {r['skipped']}, every {r['snapshot_every']} steps, "
            f"{r['steps']} steps x {r['rounds']} rounds",
        ),
        (f"[{mb:g} MB] step without snapshots (ms)", r["step_ms"]),
        (
            f"[{mb:g} MB] stall: snapshot_s median / max (ms)",
            f"{r['stall_ms']} / {r['stall_ms_max']}",
        ),
        (f"[{mb:g} MB] snapshot step's excess over the median step (ms)", r["step_excess_ms"]),
        (
            f"[{mb:g} MB] stall, first snapshot / later ones, median (ms)",
            f"{r['stall_first_ms']} / {r['stall_later_ms']}",
        ),
        (f"[{mb:g} MB] copy to fresh memory, empty_like().copy_() (ms)", r["fresh_copy_ms"]),
        (f"[{mb:g} MB] copy into held buffers (ms)", r["held_copy_ms"]),
        (
            f"[{mb:g} MB] first stall - fresh copy (ms)",
            r["stall_first_over_fresh_copy_ms"],
        ),
        (
            f"[{mb:g} MB] later stall - held-buffer copy (ms; goal <= 10)",
            f"{r['stall_later_over_held_copy_ms']} ({'met' if r['stall_goal_met'] else 'NOT met'})",
        ),
        (f"[{mb:g} MB] background write, publish included (s)", r["write_s"]),
        (
            f"[{mb:g} MB] step while a write is in flight / clean step, same run",
            r["step_ratio_while_writing"],
        ),
        (
            f"[{mb:g} MB] extra loop time per snapshot, within the run (s; min-max)",
            f"{r['extra_s_per_snapshot']} ({r['extra_s_per_snapshot_min']}-"
            f"{r['extra_s_per_snapshot_max']})",
        ),
        (
            f"[{mb:g} MB]   cross-check, run with - run without (s; min-max, noisy)",
            f"{r['extra_s_per_snapshot_across_runs']} "
            f"({r['extra_s_per_snapshot_across_runs_min']}-"
            f"{r['extra_s_per_snapshot_across_runs_max']})",
        ),
        (
            f"[{mb:g} MB] measured overhead, every {r['snapshot_every']} steps",
            f"{r['overhead_at_interval']:.1%}",
        ),
        (
            f"[{mb:g} MB] DERIVED overhead at 1 snapshot/min (= extra / 60 s; goal <= 2%)",
            f"{r['derived_overhead_per_minute'] * 100:.3f}% "
            f"({'met' if r['overhead_goal_met'] else 'NOT met'})",
        ),
    ]
    if "write_hold" in r:
        for side, what in (
            ("snapshot", "a snapshot's write"),
            ("plain", "plain write+fsync"),
            ("idle", "nothing (baseline)"),
        ):
            h = r["write_hold"][side]
            rows.append(
                (
                    f"[{mb:g} MB] Python thread held up, {what}: longest ms / share",
                    f"{h['longest_ms']} / {h['held_share']:.0%} over {h['seconds']} s",
                )
            )
    if "resume" in r:
        for cache in ("warm", "cold"):
            s = r["resume"][cache]
            rows += [
                (
                    f"[{mb:g} MB] resume, {cache} cache: newest+verify / load (s)",
                    f"{s['verify_s']} / {s['load_s']}",
                ),
                (f"[{mb:g} MB] raw read of the same files, {cache} cache (s)", s["raw_read_s"]),
                *(
                    [
                        (
                            f"[{mb:g} MB] raw read + SHA-256, warm (s)",
                            r["resume"]["raw_read_sha256_warm_s"],
                        )
                    ]
                    if cache == "warm"
                    else []
                ),
                (
                    f"[{mb:g} MB] resume / raw read, {cache} (min-max)",
                    f"{s['ratio_to_raw']} ({s['ratio_min']}-{s['ratio_max']})",
                ),
            ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", default="100,1024")
    parser.add_argument("--steps", type=int, default=60, help="steps per run")
    parser.add_argument("--every", type=int, default=20, help="snapshot every N steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-resume", dest="resume", action="store_false")
    parser.add_argument("--dir", default=None, help="where the snapshots go (a temp dir)")
    parser.add_argument("--quick", action="store_true", help="small states, few steps (CI)")
    args = parser.parse_args()
    if args.quick:
        args.sizes_mb, args.steps, args.every, args.rounds = "4,16", 12, 4, 2
    sizes = [float(s) for s in args.sizes_mb.split(",")]
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory(prefix="phalanx-snapshot-cost-", dir=args.dir) as root:
        for size in sizes:
            resume = args.resume and size == max(sizes)
            results.append(
                measure_size(
                    size, argparse.Namespace(**{**vars(args), "resume": resume}), Path(root)
                )
            )
    report(
        "snapshot cost: one group, a real Manager, snapshots vs none in the same rounds; "
        f"medians of {args.rounds} rounds",
        [row for r in results for row in rows_of(r)],
        {"bench": "snapshot_cost", "sizes": results},
    )


if __name__ == "__main__":
    main()
