"""How fast survivors abandon the step in flight when a peer group is SIGKILLed: the
lighthouse pushes the loss to their managers, which cut the collective short instead
of waiting for its timeout.

    python benches/abandon.py --trials 3

Three groups train a small MLP with phalanx DDP back to back (a step is always in
flight). For each survivor, the time from the kill to the end of the step that was
running then; reported as the worst survivor, median over trials.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import threading
import time
from pathlib import Path

from harness import lighthouse_process, report, start_worker, stop

WORKER = Path(__file__).resolve()


def run_worker(replica_id: str, lighthouse: str) -> None:
    import torch
    from torch import nn

    import phalanx

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    manager = phalanx.Manager(replica_id=replica_id, lighthouse=lighthouse, timeout=30.0)
    ddp = phalanx.DistributedDataParallel(model, manager)
    optimizer = phalanx.Optimizer(manager, torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    while True:
        started = time.time()
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        committed = optimizer.step()
        line = {"start": started, "end": time.time(), "committed": committed}
        print(json.dumps({**line, "failure": manager.failure}), flush=True)


class Worker:
    def __init__(self, replica_id: str, lighthouse: str):
        self.proc = start_worker(WORKER, worker=replica_id, lighthouse=lighthouse)
        self.steps: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.steps.append(json.loads(line))


def trial(lighthouse: str, n: int) -> float:
    workers = [Worker(f"t{n}-{i}", lighthouse) for i in range(3)]
    try:
        deadline = time.monotonic() + 60
        while sum(s["committed"] for s in workers[1].steps) < 20:
            if time.monotonic() > deadline:
                raise TimeoutError("the groups did not start training")
            time.sleep(0.05)
        killed = time.time()
        os.kill(workers[0].proc.pid, signal.SIGKILL)
        time.sleep(3.0)
        worst = 0.0
        for w in workers[1:]:
            running = [s for s in w.steps if s["start"] <= killed <= s["end"]]
            if running:
                worst = max(worst, running[0]["end"] - killed)
        return worst
    finally:
        for w in workers:
            stop(w.proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--worker")
    parser.add_argument("--lighthouse")
    args = parser.parse_args()
    if args.worker:
        run_worker(args.worker, args.lighthouse)
        return
    with lighthouse_process("--join-timeout", "1s") as (address, _):
        times = [trial(address, n) for n in range(args.trials)]
    result = {
        "bench": "abandon",
        "abandon_s": round(statistics.median(times), 4),
        "abandon_max_s": round(max(times), 4),
        "trials": args.trials,
    }
    report(
        "SIGKILL of a peer group → survivors' step in flight ends (3 groups)",
        [("median (s)", result["abandon_s"]), ("worst (s)", result["abandon_max_s"])],
        result,
    )


if __name__ == "__main__":
    main()
