"""What sealing and hashing cost a snapshot: the write (DCP save, hashing, publish) and
the verify a resume does, of a state of 100 MB and 1 GB, on a local folder.

    python benches/snapshot_seal.py                   # this tree
    python benches/snapshot_seal.py --against OLD/python      # and an older tree's, side by side

Prints a table with the ratios, then one JSON line of every (tree, size). The older tree is
run in a child process with its `python/` first on sys.path (copy `_core*.so` into
its `phalanx/` first); its API (no key) is detected.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time

SIZES = {"4MB": 4 * 10**6, "100MB": 100 * 10**6, "1GB": 10**9}


def measure(size: int, trials: int) -> dict[str, float]:
    """Seconds to write and to verify a snapshot of `size` bytes (best of `trials`)."""
    import torch

    from phalanx.snapshots import Storage, newest
    from phalanx.snapshots.writer import SnapshotWriter

    keyed = "key" in inspect.signature(SnapshotWriter).parameters
    extra = {}
    if keyed:
        from phalanx.snapshots import SnapshotKey

        extra = {"key": SnapshotKey.of("bench-token")}
    state = {"m": {"w": torch.rand(size // 4)}}
    best = {"write_s": float("inf"), "verify_s": float("inf"), "training_thread_s": float("inf")}
    for trial in range(trials):
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
            storage = Storage.at(root)
            writer = SnapshotWriter(
                storage, replica_id="g0", group_rank=0, world_size=1, keep=2, store=None, **extra
            )
            started = time.perf_counter()
            held = writer.take(state, 10 + trial, 1, 0)
            assert writer.wait(600)
            wrote = time.perf_counter() - started
            started = time.perf_counter()
            found = newest(storage, 1, *extra.values())
            verified = time.perf_counter() - started
            assert found is not None
        best["write_s"] = min(best["write_s"], wrote)
        best["verify_s"] = min(best["verify_s"], verified)
        best["training_thread_s"] = min(best["training_thread_s"], held)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--against", help="an older tree's python/ folder, to compare")
    parser.add_argument("--sizes", default="100MB,1GB")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="4 MB, one trial (a smoke run)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child's single measurement
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(SIZES[args.one], args.trials)))
        return
    if args.quick:
        args.sizes, args.trials = "4MB", 1
    trees = {"this": None} | ({"older": args.against} if args.against else {})
    rows = {}
    for size in args.sizes.split(","):
        for tree, path in trees.items():
            env = dict(os.environ)
            if path:
                env["PYTHONPATH"] = path
            out = subprocess.run(
                [sys.executable, __file__, "--one", size, "--trials", str(args.trials)],
                env=env, capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            result = json.loads(out.strip().splitlines()[-1])
            rows[(tree, size)] = result
    print(f"{'size':<6} {'tree':<6} {'write s':>8} {'verify s':>9} {'train s':>8}  ratio w/v")
    for (tree, size), r in rows.items():
        base = rows.get(("older", size))
        ratio = ""
        if base and tree == "this":
            w, v = r["write_s"] / base["write_s"], r["verify_s"] / base["verify_s"]
            ratio = f"{w:.2f}x / {v:.2f}x"
        print(
            f"{size:<6} {tree:<6} {r['write_s']:>8.3f} {r['verify_s']:>9.3f} "
            f"{r['training_thread_s']:>8.3f}  {ratio}"
        )
    report = [{"tree": tree, "size": size, **r} for (tree, size), r in rows.items()]
    print(json.dumps({"bench": "snapshot_seal", "rows": report}))


if __name__ == "__main__":
    main()
