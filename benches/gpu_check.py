"""The GPU check: phalanx on one CUDA device with NCCL, in one command, in under 10
minutes. Its figures on an H200 are in docs/benchmarks.md.

    python benches/gpu_check.py                      # every phase, about 5 minutes
    python benches/gpu_check.py --phases chaos --duration 60

Three replica groups share the one device, each rank with an NCCL host id of its own
(`NCCL_HOSTID`): NCCL refuses two ranks of one communicator on one GPU of one host
("Duplicate GPU detected"), and ranks of different hosts meet over its socket
transport, here on loopback. The phases, each bounded by `--time-limit` and each
reporting why when it fails:

- chaos: `phalanx run`'s launcher trains the demo's model on the GPU (`python -m
  phalanx.demo.train --device cuda`) with a SIGKILL of a random group every
  `--kill-every` seconds, the killed group restarted; the demo's report of it (steps
  committed, recoveries, survivors' stalls, CUDA heals) and whether every committed
  step's fingerprint agrees across the groups. Each rank times its cross-group process
  group's aborts, builds and first collective (the NCCL communicator's set-up), and the
  check pairs them with the kills: a loss → the group aborted → rebuilt → survivors
  commit again.
- heal: `--heal-mb` of model-like state on the GPU healed into a fresh process's GPU
  tensors (host-staged through one block of host memory), against the same heal of CPU tensors,
  interleaved; bit-identity checked.
- step: torch DDP over NCCL against phalanx DDP, 3 ranks / 3 groups of an MLP on the
  device, interleaved rounds (as benches/step_overhead.py does over gloo).

A table, then one JSON object as the last line. On a machine without CUDA it says so
and exits 0; 1 when a phase failed, 3 when the replicas diverged.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import selectors
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import (
    free_port,
    lighthouse_process,
    mlp_and_batches,
    report,
    start_worker,
    timed_steps,
    worker_results,
)

SCRIPT = Path(__file__).resolve()
PHASES = ("chaos", "heal", "step")
GROUPS = 3
#: The demo's model a size up on a GPU, where a step is mostly launch overhead
#: either way (a rehearsal on the CPU trains the demo's own size).
GPU_TRAIN_ARGS = ("--dim", "256", "--layers", "4", "--seq-len", "128", "--batch-size", "32")
#: Seconds a phase may take besides its own work: processes starting (torch, a CUDA
#: context, NCCL) and stopping.
STARTUP_S = 90.0
HEAL_STEP, HEAL_QUORUM = 100, 1
EXIT_FAILED, EXIT_DIVERGED = 1, 3
REHEARSAL = "CPU (a rehearsal over gloo)"


def nccl_environ(index: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """What rank `index` of a job sharing one GPU sets before NCCL starts: a host id of
    its own, and NCCL's socket transport on loopback (the ranks are one host's; another
    network would be a detour, InfiniBand loopback one more thing to fail). A value
    already in `environ` (default: this process's) is kept, but not NCCL_HOSTID.

    >>> nccl_environ(2, {})["NCCL_HOSTID"], nccl_environ(2, {"NCCL_NET": "IB"})["NCCL_NET"]
    ('phalanx-gpu-check-2', 'IB')
    """
    environ = os.environ if environ is None else environ
    chosen = {
        "NCCL_NET": "Socket",
        "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_IB_DISABLE": "1",
        "NCCL_DEBUG": "WARN",
    }
    chosen = {k: environ.get(k, v) for k, v in chosen.items()}
    return {**chosen, "NCCL_HOSTID": f"phalanx-gpu-check-{index}"}


class PhaseFailed(Exception):
    """A phase could not finish; its message says why, for the table."""


class TimeUp(BaseException):
    """The check ran past `--time-limit` and its margin: every phase bounds its own
    waits, so this is the last resort against one that does not."""


#: Seconds past --time-limit before the check gives up on itself (`TimeUp`).
MARGIN_S = 45


@dataclass
class Phase:
    name: str
    ok: bool
    seconds: float
    rows: list[tuple[str, object]] = field(default_factory=list)
    result: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None


# -- the driver's helpers ----------------------------------------------------------


class Deadline:
    """The check's `--time-limit`: each phase takes what it needs of what is left."""

    def __init__(self, seconds: float):
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def need(self, seconds: float, what: str) -> float:
        """`seconds`, or PhaseFailed when fewer are left."""
        if self.left() < seconds:
            raise PhaseFailed(
                f"{what} needs about {seconds:.0f} s and {self.left():.0f} s of --time-limit "
                "are left; give a larger --time-limit or fewer --phases"
            )
        return seconds


def tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return f"({path} could not be read)"
    return "\n    ".join(["", *text]) if text else "(nothing written)"


def spawn(role: str, log: Path, *flags: str) -> subprocess.Popen:
    """This script as one of its own workers; stderr to `log`, for a failure's reason."""
    with open(log, "ab") as err:
        return subprocess.Popen(
            [sys.executable, str(SCRIPT), "--worker", role, *flags],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )


def read_json(proc: subprocess.Popen, timeout: float, what: str, log: Path) -> dict:
    """The next JSON line `proc` prints, within `timeout` seconds."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        if not ready:
            raise PhaseFailed(f"{what} said nothing within {timeout:.0f} s; its log:{tail(log)}")
        proc.wait(5)
        raise PhaseFailed(f"{what} exited with {proc.returncode}; its log:{tail(log)}")
    return json.loads(line)


def end(procs: Sequence[subprocess.Popen]) -> None:
    """Ends worker processes this check started: their stdin closed, then killed."""
    for p in procs:
        if p.stdin and not p.stdin.closed:
            p.stdin.close()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def spread(values: Sequence[float], digits: int = 3) -> dict[str, float | None]:
    """Median, min and max (None for none)."""
    if not values:
        return {"median": None, "min": None, "max": None}
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


def shown(s: dict[str, float | None], unit: str = "") -> str:
    if s["median"] is None:
        return "—"
    return f"{s['median']}{unit} ({s['min']}–{s['max']})"


# -- the chaos phase ---------------------------------------------------------------


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


# -- the heal phase ----------------------------------------------------------------


def digest(state: dict) -> str:
    """SHA-256 of the state's bytes, a GPU's copied to the host first."""
    import torch

    h = hashlib.sha256()
    for t in state.values():
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
    return h.hexdigest()


def heal_state(size_mb: float, device: str, fill: bool) -> dict:
    from recovery import build_state, model_like_shapes

    state = {k: v.to(device) for k, v in build_state(model_like_shapes(size_mb), fill).items()}
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
    return state


def run_heal_source(args: argparse.Namespace) -> None:
    from phalanx.recovery import StateHost

    state = heal_state(args.size_mb, args.device, fill=True)
    host = StateHost(bind="127.0.0.1:0")
    began = time.perf_counter()
    host.open(HEAL_STEP, HEAL_QUORUM, {"model": state})  # a survivor's pause to serve
    open_s = time.perf_counter() - began
    print(json.dumps({"address": host.address, "digest": digest(state), "open_s": open_s}))
    sys.stdout.flush()
    sys.stdin.read()  # serves until the driver closes stdin
    host.shutdown()


def run_heal_receiver(args: argparse.Namespace) -> None:
    import torch

    from phalanx.recovery import heal

    state = heal_state(args.size_mb, args.device, fill=False)
    stats: list = []
    started = time.perf_counter()
    healed = heal(
        [args.address], HEAL_STEP, HEAL_QUORUM, {"model": state}, timeout=120.0, report=stats.append
    )
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    in_place = sum(healed["model"][k] is state[k] for k in state)
    print(
        json.dumps(
            {
                "seconds": seconds,
                "bytes": stats[0].bytes,
                "tensors": len(state),
                "in_place": in_place,
                "device": str(next(iter(healed["model"].values())).device),
                "digest": digest(healed["model"]),
            }
        ),
        flush=True,
    )


#: The ways a GPU tensor's bytes can be held in host memory on their way: a pinned
#: block per tensor, one pinned block for all (phalanx's), one pageable block.
STAGINGS = ("pinned-per-tensor", "pinned-block", "pageable-block")


def run_staging(args: argparse.Namespace) -> None:
    """In a fresh process, as a heal's first use of host memory: the state's host
    copies taken the way `--staging` says, then device → host and host → device."""
    import torch

    from phalanx.staging import host_views, to_devices

    state = list(heal_state(args.size_mb, "cuda", fill=True).values())
    began = time.perf_counter()
    if args.staging == "pinned-per-tensor":
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in state]
    else:
        pin = args.staging == "pinned-block"
        host = host_views([(t.dtype, t.shape) for t in state], pin=pin)
        if not pin:
            for h in host:  # first touch, as a transfer into it would
                h.view(-1).view(torch.uint8).fill_(0)
    allocated = time.perf_counter()
    for h, t in zip(host, state, strict=True):
        h.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    copied_out = time.perf_counter()
    to_devices(list(zip(host, state, strict=True)))
    done = time.perf_counter()
    times = {"alloc_s": allocated - began, "d2h_s": copied_out - allocated}
    print(json.dumps({**times, "h2d_s": done - copied_out, "bytes": sum(map(_bytes, state))}))


def _bytes(t: Any) -> int:
    return t.numel() * t.element_size()


def staging_runs(args: argparse.Namespace, out: Path, deadline: Deadline) -> dict[str, dict]:
    """Each of `STAGINGS` once, in a process of its own."""
    found = {}
    for staging in STAGINGS:
        log = out / f"staging-{staging}.log"
        p = spawn("staging", log, "--staging", staging, "--size-mb", str(args.heal_mb))
        try:
            found[staging] = read_json(p, min(120, deadline.left()), f"staging {staging}", log)
        finally:
            end([p])
    return found


def heal_phase(args: argparse.Namespace, deadline: Deadline) -> Phase:
    deadline.need(STARTUP_S / 3 + 20 * args.heal_repeat, "the heal phase")
    out = args.out / "heal"
    out.mkdir(parents=True, exist_ok=True)
    size = ["--size-mb", str(args.heal_mb)]
    procs: list[subprocess.Popen] = []
    # The GPU's heal, and the same heal of CPU tensors as its yardstick.
    sides = {"gpu": args.accel, "cpu": "cpu"}
    runs: dict[str, list[dict]] = {"gpu": [], "cpu": []}
    try:
        sources = {}
        for side, device in sides.items():
            log = out / f"source-{side}.log"
            procs.append(spawn("heal-source", log, "--device", device, *size))
            sources[side] = (procs[-1], log)
        served = {
            side: read_json(p, min(120, deadline.left()), f"the {side} heal source", log)
            for side, (p, log) in sources.items()
        }
        # Interleaved: a machine busy for a while weighs on both alike.
        for i in range(args.heal_repeat):
            for side, source in served.items():
                device, log = sides[side], out / f"receiver-{side}-{i}.log"
                address = ["--address", source["address"]]
                p = spawn("heal-receiver", log, "--device", device, *address, *size)
                procs.append(p)
                run = read_json(p, min(120, deadline.left()), f"the {side} heal receiver", log)
                end([p])
                if run["digest"] != source["digest"]:
                    raise PhaseFailed(f"the {side} heal's state differs from its source's")
                if not run["device"].startswith(device):
                    raise PhaseFailed(f"the {side} heal returned tensors on {run['device']}")
                runs[side].append(run)
    finally:
        end(procs)
    stagings = staging_runs(args, out, deadline) if args.accel == "cuda" else {}
    return heal_result(runs, args.heal_mb, served["gpu"]["open_s"], stagings)


def heal_result(
    runs: dict[str, list[dict]], size_mb: float, open_s: float, stagings: dict[str, dict]
) -> Phase:
    """The heal phase's rows and figures from its runs (`run_heal_receiver`'s lines),
    the GPU source's time to open its state, and `run_staging`'s lines."""

    def gbps(run: dict) -> float:
        return run["bytes"] / run["seconds"] / 1e9

    cuda = [gbps(r) for r in runs["gpu"]]
    cpu = [gbps(r) for r in runs["cpu"]]
    ratios = [a / b for a, b in zip(cuda, cpu, strict=True)]
    first = runs["gpu"][0]
    result = {
        "state_mb": size_mb,
        "tensors": first["tensors"],
        "runs": len(cuda),
        "path": "host-staged (one pinned block)",
        "cuda_gb_per_s": spread(cuda),
        "cpu_gb_per_s": spread(cpu),
        "cuda_to_cpu": spread(ratios),
        "in_place": min(r["in_place"] for r in runs["gpu"]),
        "bit_identical": True,
        "source_open_s": round(open_s, 4),
        "staging": {
            name: {k: round(v, 4) if k.endswith("_s") else v for k, v in run.items()}
            for name, run in stagings.items()
        },
    }
    rows = [
        ("heal: state", f"{first['bytes'] / 2**20:.0f} MiB in {first['tensors']} tensors"),
        ("heal: CUDA → CUDA GB/s (through host memory)", shown(result["cuda_gb_per_s"])),
        ("heal: CPU → CPU GB/s, same run", shown(result["cpu_gb_per_s"])),
        ("heal: CUDA / CPU", shown(result["cuda_to_cpu"])),
        ("heal: CUDA tensors filled in place", f"{result['in_place']} of {first['tensors']}"),
        ("heal: the CUDA source's open() (s)", result["source_open_s"]),
    ]
    for name, run in result["staging"].items():
        rows.append(
            (
                f"staging {name}: alloc / d2h / h2d (s)",
                f"{run['alloc_s']} / {run['d2h_s']} / {run['h2d_s']}",
            )
        )
    return Phase("heal", True, 0.0, rows, result)


# -- the step phase ----------------------------------------------------------------


def run_step_worker(args: argparse.Namespace) -> None:
    """One rank of the step phase on cuda:0: torch DDP over NCCL, or phalanx DDP (on
    the CPU, over gloo, in a rehearsal)."""
    os.environ.update(nccl_environ(args.rank))
    # NCCL writes its warnings to stdout, where the driver reads this worker's result.
    os.environ.setdefault("NCCL_DEBUG_FILE", str(Path(args.out).absolute() / "nccl.%p.log"))
    import torch
    import torch.distributed as dist
    from torch import nn

    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model, batches = mlp_and_batches(args.width, args.rank)
    model = model.to(device)
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    if args.worker == "torch":
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"tcp://127.0.0.1:{args.port}",
            rank=args.rank,
            world_size=GROUPS,
        )
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=[0] if cuda else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        import phalanx

        manager = phalanx.Manager(
            replica_id=f"g{args.rank}", lighthouse=args.lighthouse, device=device, timeout=30.0
        )
        wrapped = phalanx.DistributedDataParallel(model, manager)
        optimizer = phalanx.Optimizer(manager, torch.optim.SGD(model.parameters(), lr=0.01))

    def step(x, y):
        optimizer.zero_grad()
        nn.functional.mse_loss(wrapped(x), y).backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()

    times = timed_steps(step, batches, args.warmup, args.steps)
    from phalanx.demo.train import fingerprint

    committed = manager.current_step() if args.worker == "phalanx" else args.warmup + args.steps
    line = {
        "median_ms": times.median_ms,
        "cpu_ms": times.cpu_ms,
        # Every rank applied the same averaged gradients: the same parameters, bit for bit.
        "fingerprint": fingerprint(list(model.state_dict().values())),
        "committed": committed,
    }
    print(json.dumps(line), flush=True)
    if args.worker == "torch":
        dist.destroy_process_group()
    else:
        manager.shutdown()


def step_phase(args: argparse.Namespace, deadline: Deadline) -> Phase:
    per_run = 40.0
    deadline.need(2 * per_run * args.rounds, "the step phase")
    out = args.out / "step"
    out.mkdir(parents=True, exist_ok=True)
    rounds = []
    for _ in range(args.rounds):
        # Interleaved, so that a machine busy for a while weighs on both sides alike;
        # each phalanx run with a lighthouse of its own, as a new job.
        rounds.append(tuple(step_run(mode, args, out, deadline) for mode in ("torch", "phalanx")))
    params = sum(p.numel() for p in mlp_and_batches(args.width, 0)[0].parameters())
    return step_result(rounds, params, args.steps)


def step_run(
    mode: str, args: argparse.Namespace, out: Path, deadline: Deadline
) -> tuple[float, float]:
    """One run of `mode`'s 3 ranks: the job's step time (its slowest rank's median)
    and the mean CPU per step of a rank, in ms."""
    side = "torch DDP over NCCL" if mode == "torch" else "phalanx DDP"
    with lighthouse_process("--min-replicas", str(GROUPS)) as (address, _):
        port = free_port()
        procs = [
            start_worker(
                SCRIPT,
                worker=mode,
                rank=rank,
                port=port,
                lighthouse=address,
                steps=args.steps,
                warmup=args.warmup,
                width=args.width,
                out=out,
                device=args.accel,
            )
            for rank in range(GROUPS)
        ]
        try:
            got = worker_results(procs, side, timeout=min(180.0, deadline.left()))
        except subprocess.TimeoutExpired:
            raise PhaseFailed(f"{side}: its ranks did not finish in time") from None
        except (RuntimeError, ValueError, IndexError) as e:
            raise PhaseFailed(f"{side}: {e} (its traceback is above)") from None
    if len({r["fingerprint"] for r in got}) > 1:
        raise PhaseFailed(
            f"{side}: the ranks' parameters differ after {args.warmup + args.steps} steps "
            f"(fingerprints {sorted(r['fingerprint'] for r in got)}, steps committed "
            f"{[r['committed'] for r in got]}): the averaged gradients were not the same"
        )
    if min(r["committed"] for r in got) < args.steps:  # the warm-up's may fail
        raise PhaseFailed(
            f"{side}: steps committed {[r['committed'] for r in got]} of "
            f"{args.warmup + args.steps}, with no failure injected"
        )
    return max(r["median_ms"] for r in got), statistics.mean(r["cpu_ms"] for r in got)


def step_result(rounds: list[tuple], params: int, steps: int) -> Phase:
    """The step phase's rows and figures from its rounds: ((torch ms, torch CPU ms),
    (phalanx ms, phalanx CPU ms)) each."""
    torch_ms = [t[0] for t, _ in rounds]
    ours_ms = [p[0] for _, p in rounds]
    result = {
        "params": params,
        "steps": steps,
        "rounds": len(rounds),
        "torch_ddp_nccl_ms": spread(torch_ms),
        "phalanx_ms": spread(ours_ms),
        "ratio": spread([p[0] / t[0] for t, p in rounds]),
        "cpu_ratio": spread([p[1] / t[1] for t, p in rounds]),
    }
    rows = [
        ("step: model", f"MLP of {params / 1e6:.1f}M parameters, {GROUPS} ranks on one GPU"),
        ("step: torch DDP over NCCL (ms)", shown(result["torch_ddp_nccl_ms"])),
        ("step: phalanx DDP (ms)", shown(result["phalanx_ms"])),
        ("step: phalanx / torch", shown(result["ratio"])),
        ("step: CPU per step, phalanx / torch", shown(result["cpu_ratio"])),
    ]
    return Phase("step", True, 0.0, rows, result)


# -- the check ---------------------------------------------------------------------


def reserve(args: argparse.Namespace, before: str) -> float:
    """Seconds kept for the phases after `before`."""
    later = args.phases[args.phases.index(before) + 1 :]
    need = {"heal": STARTUP_S / 3 + 20 * args.heal_repeat, "step": 80.0 * args.rounds}
    return sum(need.get(p, 0.0) for p in later)


def cuda_probe(rehearse: bool = False) -> dict[str, Any] | str:
    """The device and its NCCL, or why there is none to check; PhaseFailed for a GPU
    that cannot be checked."""
    import torch
    import torch.distributed as dist

    if rehearse:
        return {"device": REHEARSAL, "torch": torch.__version__, "nccl": "-"}

    if not torch.cuda.is_available():
        return (
            f"no CUDA device here (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'}): nothing to check; run this on a machine with a GPU"
        )
    if not dist.is_nccl_available():
        raise PhaseFailed(f"torch {torch.__version__} sees a GPU but was built without NCCL")
    try:
        name, count = torch.cuda.get_device_name(0), torch.cuda.device_count()
        nccl = torch.cuda.nccl.version()
    except (RuntimeError, AssertionError) as e:
        raise PhaseFailed(f"torch sees a GPU but cannot use it: {e}") from None
    return {
        "device": name,
        "devices": count,
        "torch": torch.__version__,
        "cuda_version": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
    }


def run_phase(name: str, args: argparse.Namespace, deadline: Deadline) -> Phase:
    """A phase, its failure a reason rather than a traceback."""
    began = time.monotonic()
    run = {"chaos": chaos_phase, "heal": heal_phase, "step": step_phase}[name]
    print(f"gpu_check: {name} phase ({deadline.left():.0f} s of --time-limit left)", flush=True)
    try:
        phase = run(args, deadline)
    except PhaseFailed as e:
        phase = Phase(name, False, 0.0, reason=str(e))
    except Exception as e:  # anything else: named, with where, not a traceback
        where = e.__traceback__
        while where is not None and where.tb_next is not None:
            where = where.tb_next
        at = (
            f" at {Path(where.tb_frame.f_code.co_filename).name}:{where.tb_lineno}" if where else ""
        )
        phase = Phase(name, False, 0.0, reason=f"{type(e).__name__}{at}: {e}")
    phase.seconds = time.monotonic() - began
    if phase.reason:
        print(f"gpu_check: {name}: {phase.reason}", flush=True)
    return phase


def summary(probe: dict[str, Any], phases: list[Phase]) -> tuple[list, dict[str, Any]]:
    """The table's rows and the JSON object of a check's phases."""
    rows: list[tuple[str, object]] = [
        ("device", f"{probe['device']} (torch {probe['torch']}, NCCL {probe['nccl']})")
    ]
    for phase in phases:
        status = "ok" if phase.ok else f"FAILED: {phase.reason}"
        rows.append((f"{phase.name} ({phase.seconds:.0f} s)", status))
        rows += phase.rows
    result = {
        "bench": "gpu_check",
        **probe,
        "cuda": probe["device"] != REHEARSAL,
        "ok": all(p.ok for p in phases),
        "phases": {
            p.name: {"ok": p.ok, "seconds": round(p.seconds, 1), "reason": p.reason, **p.result}
            for p in phases
        },
    }
    return rows, result


def exit_status(result: dict[str, Any]) -> int:
    chaos = result["phases"].get("chaos", {})
    if chaos.get("replicas_consistent") is False:
        return EXIT_DIVERGED
    return 0 if result["ok"] else EXIT_FAILED


def phase_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PHASES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give phases among {', '.join(PHASES)}, comma-separated"
        )
    return sorted(set(names), key=PHASES.index)


def positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: give a positive number")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", type=phase_list, default=list(PHASES), help="chaos,heal,step")
    parser.add_argument(
        "--time-limit", type=positive, default=540.0, help="seconds for the whole check"
    )
    parser.add_argument("--duration", type=positive, default=120.0, help="chaos: training (s)")
    parser.add_argument("--kill-every", type=positive, default=15.0, help="chaos: SIGKILL every")
    parser.add_argument("--seed", type=int, default=0, help="chaos: of the kills")
    parser.add_argument(
        "--fork-server",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="chaos: ranks forked by phalanx run's fork server, its default (or new processes)",
    )
    parser.add_argument("--heal-mb", type=positive, default=1024.0, help="heal: state size")
    parser.add_argument("--heal-repeat", type=int, default=3, help="heal: runs of each")
    parser.add_argument("--rounds", type=int, default=2, help="step: interleaved rounds")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--width", type=int, default=2048, help="step: the MLP's width")
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="logs of the check")
    parser.add_argument(
        "--rehearse-on-cpu",
        action="store_true",
        help="every phase on the CPU over gloo: the check's own machinery, not a GPU check",
    )
    # One of the check's own workers.
    parser.add_argument(
        "--worker",
        choices=["rank", "torch", "phalanx", "heal-source", "heal-receiver", "staging"],
    )
    parser.add_argument("--staging", choices=STAGINGS, default=STAGINGS[1])
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--lighthouse", default="")
    parser.add_argument("--pg-log", default="")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--address", default="")
    parser.add_argument("--size-mb", type=float, default=1024.0)
    return parser


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The options, and what follows `--` (a chaos rank's training options)."""
    own, rest = argv, []
    if "--" in argv:
        split = argv.index("--")
        own, rest = argv[:split], argv[split + 1 :]
    parser = build_parser()
    args = parser.parse_args(own)
    if min(args.heal_repeat, args.rounds, args.steps) < 1 or args.warmup < 0:
        parser.error("--heal-repeat, --rounds and --steps must be at least 1, --warmup 0 or more")
    return args, rest


def main(argv: list[str]) -> int:
    args, rest = parse(argv)
    if args.worker == "rank":
        run_rank(args.pg_log, rest)
        return 0
    if args.worker is not None:
        workers = {
            "heal-source": run_heal_source,
            "heal-receiver": run_heal_receiver,
            "staging": run_staging,
        }
        workers.get(args.worker, run_step_worker)(args)
        return 0
    deadline = Deadline(args.time_limit)
    try:
        probe = cuda_probe(args.rehearse_on_cpu)
    except PhaseFailed as e:
        print(f"gpu_check: {e}")
        print(json.dumps({"bench": "gpu_check", "cuda": True, "ok": False, "reason": str(e)}))
        return EXIT_FAILED
    args.accel = "cpu" if args.rehearse_on_cpu else "cuda"
    if isinstance(probe, str):
        print(f"gpu_check: {probe}")
        print(json.dumps({"bench": "gpu_check", "cuda": False, "reason": probe}), flush=True)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)

    def time_up(*_: object) -> None:
        raise TimeUp

    signal.signal(signal.SIGALRM, time_up)
    signal.alarm(int(args.time_limit) + MARGIN_S)
    try:
        phases = [run_phase(name, args, deadline) for name in args.phases]
    except KeyboardInterrupt:
        print("gpu_check: interrupted; the logs so far are in", args.out, flush=True)
        return 130
    except TimeUp:
        reason = f"still running {MARGIN_S} s past --time-limit; the logs so far are in {args.out}"
        print(f"gpu_check: {reason}")
        print(json.dumps({"bench": "gpu_check", "cuda": True, "ok": False, "reason": reason}))
        return EXIT_FAILED
    finally:
        signal.alarm(0)
    rows, result = summary(probe, phases)
    report(f"GPU check: {GROUPS} replica groups on one {probe['device']}, NCCL", rows, result)
    return exit_status(result)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
