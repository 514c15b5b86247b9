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
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from gpu_chaos import chaos_phase, run_rank
from gpu_heal import STAGINGS, heal_phase, run_heal_receiver, run_heal_source, run_staging
from gpu_phase import GROUPS, Deadline, Phase, PhaseFailed
from gpu_step import run_step_worker, step_phase

from harness import report

PHASES = ("chaos", "heal", "step")

EXIT_FAILED, EXIT_DIVERGED = 1, 3

REHEARSAL = "CPU (a rehearsal over gloo)"


class TimeUp(BaseException):
    """The check ran past `--time-limit` and its margin: every phase bounds its own
    waits, so this is the last resort against one that does not."""


#: Seconds past --time-limit before the check gives up on itself (`TimeUp`).
MARGIN_S = 45


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
