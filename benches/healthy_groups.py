"""Whether every group of a healthy job trains: `phalanx demo` with many groups and no
failure, and how many groups each step averaged.

    python benches/healthy_groups.py --replicas 30 --duration 30 --dim 256
    python benches/healthy_groups.py --against /path/to/an/older/checkout

A group that is left out of a step's quorum (it arrived after the join timeout) is
behind at the next one and heals in it: its step is recovery, not training. Paid-for
groups that heal in turn instead of contributing are the waste this measures: per job
step after the start-up (`STARTUP_STEPS`), the groups whose gradients were averaged,
the share of steps that averaged every group (the last step, where the groups leave
one by one, apart), the share of committed group-steps that contributed, the job's
steps per minute, and whether any step number was committed with two states. With
`--against`, the same job runs from that checkout's `python/` folder (its extension
built in place) first, and the table shows both side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import report

#: The job's first steps, where the groups still arrive one by one.
STARTUP_STEPS = 5


def run_demo(replicas: int, duration: float, dim: int, python_path: str | None) -> dict:
    """One healthy demo job; what it measured."""
    env = dict(os.environ)
    if python_path:
        env["PYTHONPATH"] = python_path
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "demo"
        done = subprocess.run(
            [sys.executable, "-m", "phalanx", "demo", "--out", str(out)]
            + ["--replicas", str(replicas), "--kill-every", "0", "--duration", str(duration)]
            # The model's width goes to the training script (older demos take no --dim).
            + ["--", "--dim", str(dim)],
            capture_output=True,
            text=True,
            env=env,
            timeout=duration + 300,
        )
        lines = (out / "steps.jsonl").read_text().splitlines()
        summary = json.loads((out / "report.json").read_text())
    steps = [json.loads(line) for line in lines]
    committed = [r for r in steps if r["committed"] and r["rank"] == 0]
    stopped = min(r["t_end"] for r in committed) + summary["training_s"]
    averaged: dict[tuple[int, int], int] = {}
    for r in committed:
        if r["t_start"] < stopped:
            key = (r.get("lineage", 0), r["step"])
            averaged[key] = max(averaged.get(key, 0), r["participants"])
    # The last step is the end's: groups leave one by one once the stop reaches them.
    first, last = min(step for _, step in averaged), max(step for _, step in averaged)
    counts = [
        n for (_, step), n in sorted(averaged.items()) if first + STARTUP_STEPS <= step < last
    ]
    in_time = [r for r in committed if r["t_start"] < stopped]
    return {
        "exit_status": done.returncode,
        "job_steps": summary["job_steps"],
        "steps_per_minute": round(60 * summary["job_steps"] / summary["training_s"], 1),
        "participants_min": min(counts),
        "participants_median": statistics.median_low(counts),
        "participants_max": max(counts),
        "steps_with_every_group": round(sum(n == replicas for n in counts) / len(counts), 4),
        "contributing_share": round(sum(not r.get("healed") for r in in_time) / len(in_time), 4),
        "split_steps": summary.get("split_steps", []),
        "rollbacks": len(summary.get("rollbacks", [])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=30)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument(
        "--dim",
        type=int,
        default=256,
        help="the model's width: 256 makes a heal outlast the join timeout's slack on 2 cores",
    )
    parser.add_argument(
        "--against", type=Path, help="another checkout (its python/ folder built) to compare"
    )
    args = parser.parse_args()

    runs = {}
    if args.against:
        against = str(args.against / "python")
        runs["against"] = run_demo(args.replicas, args.duration, args.dim, against)
    runs["this"] = run_demo(args.replicas, args.duration, args.dim, None)
    result = {"bench": "healthy_groups", "replicas": args.replicas, "dim": args.dim, **runs}
    rows = [
        (f"{name}: {key.replace('_', ' ')}", value)
        for name, measured in runs.items()
        for key, value in measured.items()
    ]
    title = f"a healthy job of {args.replicas} groups (model dim {args.dim}), {args.duration:.0f} s"
    report(title, rows, result)


if __name__ == "__main__":
    main()
