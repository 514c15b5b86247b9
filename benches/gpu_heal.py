"""The heal phase of benches/gpu_check.py: model-like state on the GPU healed into a
fresh process's GPU tensors, against the same heal of CPU tensors, interleaved and
checked bit for bit; and the ways a heal can hold a GPU tensor's bytes in host memory
(`STAGINGS`), each timed in a fresh process."""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_phase import (
    STARTUP_S,
    Deadline,
    Phase,
    PhaseFailed,
    end,
    read_json,
    shown,
    spawn,
    spread,
)

HEAL_STEP, HEAL_QUORUM = 100, 1


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
