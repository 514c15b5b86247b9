"""The chaos phase of benches/gpu_check.py: `phalanx run`'s launcher trains the
demo's model on the GPU while a random group is killed every `--kill-every` seconds;
each rank times its cross-group process group (`instrument`), and the check pairs
those timings with the kills (`rebuilds`) beside the demo's report of the run."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_phase import (
    GROUPS,
    SCRIPT,
    STARTUP_S,
    Deadline,
    Phase,
    PhaseFailed,
    nccl_environ,
    reserve,
    shown,
    spread,
    tail,
)

#: The demo's model a size up on a GPU, where a step is mostly launch overhead
#: either way (a rehearsal on the CPU trains the demo's own size).
GPU_TRAIN_ARGS = ("--dim", "256", "--layers", "4", "--seq-len", "128", "--batch-size", "32")


def instrument(log_dir: Path) -> Callable[[], None]:
    """Times this rank's cross-group process group: every build (`configure` that
    built a new group), every abort of a retired NCCL group (on its own thread) and the first
    collective of each new group (NCCL sets its communicator up there), one JSON line
    each in a file of this process's. Only timers around phalanx's own methods; the
    function returned puts them back."""
    from phalanx import process_group
    from phalanx.process_group import FaultTolerantProcessGroup as Group

    path = log_dir / f"pg-{os.getpid()}.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    replica = os.environ.get("PHALANX_REPLICA_ID", "?")
    configure, retire, allreduce = Group.configure, process_group.retire, Group.allreduce

    def log(what: str, t: float, began: float, **extra: object) -> None:
        seconds = time.perf_counter() - began
        line = {"replica": replica, "pid": os.getpid(), "what": what, "t": t, "s": seconds}
        os.write(fd, (json.dumps({**line, **extra}) + "\n").encode())

    def timed_configure(self, membership, backend, *rest, **named):
        before, t, began = self.membership, time.time(), time.perf_counter()
        try:
            configure(self, membership, backend, *rest, **named)
        except BaseException as e:
            log("build-failed", t, began, backend=backend, error=str(e)[:300])
            raise
        if self.membership is not before:
            self.gpu_check_fresh, self.gpu_check_backend = True, backend
            log("build", t, began, backend=backend, world=membership.world_size)

    def timed_retire(held, abort):  # on the thread that ends a forgotten group
        t, began = time.time(), time.perf_counter()
        retire(held, abort)
        if abort:
            log("abort", t, began, backend="nccl")

    def timed_allreduce(self, tensor, abort):
        if not self.__dict__.pop("gpu_check_fresh", False):
            return allreduce(self, tensor, abort)
        t, began = time.time(), time.perf_counter()
        try:
            return allreduce(self, tensor, abort)
        finally:
            log("first-collective", t, began, device=str(tensor.device))

    def undo() -> None:
        Group.configure, process_group.retire, Group.allreduce = configure, retire, allreduce
        os.close(fd)

    Group.configure, Group.allreduce = timed_configure, timed_allreduce
    process_group.retire = timed_retire
    return undo


def run_rank(pg_log: str, train_args: list[str]) -> None:
    """One rank of the chaos phase: its group's NCCL host id, the timers, then the
    demo's training script as `phalanx run` would start it."""
    os.environ.update(nccl_environ(int(os.environ.get("REPLICA_GROUP_ID", "0"))))
    try:
        instrument(Path(pg_log))
    except (AttributeError, OSError) as e:  # the check goes on without the breakdown
        print(f"gpu_check: no process-group timers ({e})", flush=True)
    from phalanx.demo import train

    sys.argv = ["phalanx.demo.train", *train_args]
    train.main()


def chaos_command(pg_log: Path, device: str = "cuda") -> tuple[str, ...]:
    return (
        sys.executable,
        str(SCRIPT),
        "--worker",
        "rank",
        "--pg-log",
        str(pg_log),
        "--",
        "--device",
        device,
        *(GPU_TRAIN_ARGS if device == "cuda" else ()),
    )


def unplanned_exits(events: list[dict]) -> list[dict]:
    """The groups' exits that no injected failure explains (a survivor that died).

    >>> unplanned_exits([{"t": 1, "kind": "start", "replica": "a"},
    ...     {"t": 2, "kind": "kill", "replica": "a"}, {"t": 3, "kind": "exit", "replica": "a"},
    ...     {"t": 4, "kind": "start", "replica": "a"}, {"t": 5, "kind": "exit", "replica": "a"}])
    [{'t': 5, 'kind': 'exit', 'replica': 'a'}]
    """
    injected: dict[str, bool] = {}
    found = []
    for e in sorted(events, key=lambda e: e["t"]):
        if e["kind"] == "start":
            injected[e["replica"]] = False
        elif e["kind"] in ("kill", "hang", "hang-thread", "kill-all"):
            injected[e["replica"]] = True
        elif e["kind"] == "exit" and not injected.get(e["replica"], False):
            found.append(e)
    return found


def rebuilds(events: list[dict], pg: list[dict], steps: list[dict]) -> list[dict]:
    """For each kill and each survivor: its first abort after the kill, the build
    after that abort and that group's first collective, and the kill → the survivor's
    next committed step (seconds; None where not seen within 60 s).

    >>> events = [{"t": 10.0, "kind": "kill", "replica": "a"}]
    >>> pg = [{"t": 10.1, "what": "abort", "s": 0.01, "replica": "b"},
    ...       {"t": 10.2, "what": "build", "s": 0.02, "replica": "b"},
    ...       {"t": 10.3, "what": "first-collective", "s": 0.3, "replica": "b"}]
    >>> steps = [{"replica": "b", "rank": 0, "committed": True, "t_start": 10.2, "t_end": 10.8}]
    >>> [(r["survivor"], r["abort_s"], r["build_s"], r["first_collective_s"], r["back_s"])
    ...  for r in rebuilds(events, pg, steps)]
    [('b', 0.01, 0.02, 0.3, 0.8)]
    >>> nested = [{"t": 10.1, "what": "build", "s": 0.05, "replica": "b"},  # its reset inside
    ...           {"t": 10.12, "what": "abort", "s": 0.01, "replica": "b"}]
    >>> rebuilds(events, nested, steps)[0]["build_s"]
    0.05
    """
    window = 60.0
    found = []
    replicas = {r["replica"] for r in steps} | {p["replica"] for p in pg}
    for kill in (e for e in events if e["kind"] == "kill"):
        t0 = kill["t"]
        for survivor in sorted(replicas - {kill["replica"]}):
            mine = sorted((p for p in pg if p["replica"] == survivor), key=lambda p: p["t"])
            until = t0 + window
            abort = _first(mine, "abort", t0, until)
            # A build for a new quorum resets the group before it first: it may have
            # begun before its abort, and ends after it.
            build = _first(mine, "build", abort["t"], until, by_end=True) if abort else None
            init = _first(mine, "first-collective", build["t"], until) if build else None
            back = [
                r["t_end"]
                for r in steps
                if r["replica"] == survivor
                and r["rank"] == 0
                and r["committed"]
                and r["t_start"] > t0
                and r["t_end"] < t0 + window
            ]
            found.append(
                {
                    "killed": kill["replica"],
                    "survivor": survivor,
                    "abort_s": abort and round(abort["s"], 4),
                    "build_s": build and round(build["s"], 4),
                    "first_collective_s": init and round(init["s"], 4),
                    "back_s": round(min(back) - t0, 4) if back else None,
                }
            )
    return found


def _first(
    records: list[dict], what: str, after: float, until: float, by_end: bool = False
) -> dict | None:
    """The first record of `what` begun (`by_end`: ended) in [after, until)."""
    for p in records:
        at = p["t"] + p["s"] if by_end else p["t"]
        if p["what"] == what and after <= at < until:
            return p
    return None


def read_pg_logs(folder: Path) -> list[dict]:
    records = []
    for path in sorted(folder.glob("pg-*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a rank killed mid-line
    return records


def chaos_phase(args: argparse.Namespace, deadline: Deadline) -> Phase:
    from phalanx import launcher
    from phalanx.demo.display import Progress
    from phalanx.demo.job import DemoJob
    from phalanx.demo.report import analyze

    duration = min(args.duration, deadline.left() - STARTUP_S - reserve(args, "chaos"))
    if duration < 2 * args.kill_every:
        raise PhaseFailed(
            f"{deadline.left():.0f} s of --time-limit leave {max(duration, 0):.0f} s of training "
            f"for the chaos phase, under two --kill-every intervals ({args.kill_every:g} s)"
        )
    out = (args.out / "chaos").absolute()  # the ranks' timers write there too
    pg_log = out / "pg"
    pg_log.mkdir(parents=True, exist_ok=True)
    for old in pg_log.glob("pg-*.jsonl"):
        old.unlink()
    config = launcher.LaunchConfig(
        command=chaos_command(pg_log, args.accel),
        replicas=GROUPS,
        chaos=launcher.Chaos(kill_every=args.kill_every),
        chaos_seed=args.seed,
        max_restarts=3,  # failures not injected: a broken setup gives up soon
        fork_server=args.fork_server,
    )
    job = DemoJob(GROUPS, out, Progress())
    token = launcher.job_token(None, None, {})
    # The launcher takes SIGINT and SIGTERM while it runs; the later phases want them back.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = launcher.Launcher(config, token, observer=job).run(
            duration=duration,
            chaos_quiet=args.kill_every / 2,
            startup_timeout=min(STARTUP_S, deadline.left() - duration),
        )
    finally:
        job.close()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    exited = time.time()
    if code == 130:
        raise KeyboardInterrupt
    ranks_log = out / "ranks.log"
    if not any(r["committed"] for r in job.steps):
        raise PhaseFailed(f"no step committed; the end of {ranks_log}:{tail(ranks_log, 20)}")
    got = analyze(
        job.steps,
        job.events,
        replicas=GROUPS,
        started=job.started,
        stopped=exited if job.stopped is None else job.stopped,
        exited=exited,
    )
    pairs = rebuilds(job.events, read_pg_logs(pg_log), job.steps)
    phase = chaos_result(got, pairs, unplanned_exits(job.events), job.steps, duration)
    if phase.result["unplanned_exits"]:
        phase.reason = f"{phase.reason}; {ranks_log}: " + "; ".join(exit_lines(ranks_log)[:3])
    return phase


def exit_lines(ranks_log: Path) -> list[str]:
    """The launcher's lines on groups that failed, with their exit codes (75: evicted
    as stalled; -6: SIGABRT, e.g. torch's NCCL watchdog tearing the process down)."""
    try:
        lines = ranks_log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line.removeprefix("[phalanx run] ") for line in lines if "failed (exit codes" in line]


def chaos_result(
    got: dict[str, Any],
    pairs: list[dict],
    unplanned: list[dict],
    steps: list[dict],
    duration: float,
) -> Phase:
    """The chaos phase's rows and figures from the demo's report of it (`analyze`),
    the (kill, survivor) pairs of `rebuilds` and the unplanned exits."""
    heals = [r["heal_s"] for r in steps if r.get("healed") and r["committed"] and r["rank"] == 0]

    def of(key: str) -> dict[str, float | None]:
        return spread([p[key] for p in pairs if p[key] is not None], 4)

    result = {
        "training_s": round(duration, 1),
        "job_steps": got["job_steps"],
        "step_efficiency": got["step_efficiency"],
        "failures_injected": got["failures_injected"],
        "failures_recovered": got["failures_recovered"],
        "recovery_s": spread(got["recovery_seconds"], 3),
        "max_survivor_stall_s": got["max_survivor_stall_s"],
        "healthy_step_s": got["healthy_step_s"],
        "replicas_consistent": got["replicas_consistent"],
        "consistency_checked_steps": got["consistency_checked_steps"],
        "split_steps": got["split_steps"][:5],
        "unplanned_exits": [{"replica": e["replica"], "t": e["t"]} for e in unplanned],
        "cuda_heals": len(heals),
        "cuda_heal_s": spread(heals, 4),
        "abort_s": of("abort_s"),
        "build_s": of("build_s"),
        "first_collective_s": of("first_collective_s"),
        "kill_to_survivor_commit_s": of("back_s"),
        "rebuild_pairs": len(pairs),
    }
    why = []
    if not got["replicas_consistent"]:
        why.append(f"replicas diverged at steps {result['split_steps']}")
    if unplanned:
        who = ", ".join(sorted({e["replica"] for e in unplanned}))
        why.append(
            f"{len(unplanned)} exit(s) of a group not killed ({who}): a survivor died or "
            "was evicted (torch's NCCL watchdog tears a process down on a peer's loss "
            "unless TORCH_NCCL_ASYNC_ERROR_HANDLING is 0 or 2)"
        )
    if got["failures_injected"] and not got["failures_recovered"]:
        why.append("no killed group committed again")
    rows = [
        ("chaos: training (s) / job steps", f"{duration:.0f} / {got['job_steps']}"),
        ("chaos: group-steps committed / attempted", got["step_efficiency"]),
        (
            "chaos: kills / recovered",
            f"{got['failures_injected']} / {got['failures_recovered']}",
        ),
        ("chaos: restart → first commit (s)", shown(result["recovery_s"])),
        ("chaos: survivors' longest stall (s)", got["max_survivor_stall_s"]),
        ("chaos: healthy step (s)", got["healthy_step_s"]),
        (
            "chaos: replicas bit-identical",
            f"{got['replicas_consistent']} ({got['consistency_checked_steps']} steps compared)",
        ),
        ("chaos: unplanned exits", len(unplanned)),
        ("chaos: heals of a CUDA state, heal_s", f"{len(heals)}, {shown(result['cuda_heal_s'])}"),
        ("NCCL after a loss: abort (s)", shown(result["abort_s"])),
        ("NCCL after a loss: new group built (s)", shown(result["build_s"])),
        ("NCCL after a loss: first collective (s)", shown(result["first_collective_s"])),
        (
            "NCCL after a loss: kill → survivor commits (s)",
            shown(result["kill_to_survivor_commit_s"]),
        ),
    ]
    return Phase("chaos", not why, 0.0, rows, result, "; ".join(why) or None)
