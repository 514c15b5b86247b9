"""What a SIGKILL costs a torchft training script: the same script (torchft's Manager,
DistributedDataParallel and Optimizer wrapper, written against torchft's public API)
on phalanx.torchft, through `phalanx run --as-torchft`, and, given a python that can
import a real torchft, on torchft with the same kill schedule.

    python benches/torchft_compat.py --duration 60
    python benches/torchft_compat.py --duration 60 --torchft-python /venvs/torchft/bin/python

Three groups of one rank train a small MLP step after step. From the first committed
step on, a random live group is SIGKILLed every 5-15 s (`--kill-every MIN MAX`,
drawn from `--seed`: both systems get the same times and the same draws) and
restarted 0.5 s after it exits, for `--duration` seconds. Each rank prints one line
per step; the numbers come from those lines and the kill events alone:

- kill → excluded: from the kill until every survivor holds a quorum without the
  victim (its first quorum after the kill with fewer participants than all the
  groups; kills that found a group already missing are not counted), p50 and max;
- survivors' stall: the longest gap between two commits of a surviving group from
  the kill until the victim commits again (`phalanx.demo.report`), p50 and max;
- steps committed by the job, and whether every step two or more groups committed
  carries one fingerprint of model + optimizer state (bit-identical replicas).

Goals: kill → excluded ≤ 0.1 s, survivors' stall ≤ 0.3 s, bit-identical. torchft is
never a dependency: without `--torchft-python` phalanx's side runs alone, and says so.
For torchft the bench plays what torchrun and a restarting supervisor would: a
TCPStore per group (new for each life), its lighthouse (`torchft.coordination`), and
a restart of each killed group as a new process (phalanx's launcher forks restarted
ranks from a warm fork server instead).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness import free_port, mlp_and_batches, percentile, report, stop

WORKER = Path(__file__).resolve()
STATE_DIGEST = WORKER.parent.parent / "tests" / "procs"
GROUPS = 3
RESTART_BACKOFF = 0.5
#: phalanx run's lighthouse defaults, given to torchft's lighthouse too.
JOIN_TIMEOUT_S, HEARTBEAT_TIMEOUT_S = 1.0, 2.0
STARTUP_TIMEOUT_S = 180.0
GOALS = {"kill_to_excluded_s": 0.1, "survivor_stall_s": 0.3}


# -- the training script (both systems run this) --------------------------------------


def run_worker(timeout: float, width: int) -> None:
    """A torchft DDP rank: one JSON line per step, until it is stopped."""
    from datetime import timedelta

    import torch
    import torchft
    from torch import nn

    sys.path.insert(0, str(STATE_DIGEST))
    from state_digest import digest, tensors_of

    group = int(os.environ["REPLICA_GROUP_ID"])
    torch.set_num_threads(1)
    module, batches = mlp_and_batches(width, seed=group)
    inner = torch.optim.AdamW(module.parameters(), lr=1e-3)

    def state_dict() -> dict:
        return {"model": module.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        module.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=timeout)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        replica_id=f"bench_{group}",
        timeout=timedelta(seconds=timeout),
    )
    model = torchft.DistributedDataParallel(manager, module)
    optimizer = torchft.Optimizer(manager, inner)
    n = 0
    while True:
        x, y = batches[n % len(batches)]
        n += 1
        started = time.time()
        optimizer.zero_grad()  # starts the quorum
        manager.wait_quorum()  # only to time it: DDP would wait for it in backward
        quorum_at = time.time()
        step, participants = manager.current_step(), manager.num_participants()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        committed = manager.current_step() > step
        record = {
            "event": "step",
            "replica": f"group{group}",
            "rank": 0,
            "pid": os.getpid(),
            "step": step,
            "committed": committed,
            "participants": participants,
            "loss": loss.item(),
            "fingerprint": digest(tensors_of(module.state_dict(), inner)) if committed else None,
            "t_start": started,
            "t_quorum": quorum_at,
            "t_end": time.time(),
        }
        print(json.dumps(record), flush=True)


# -- the kills ------------------------------------------------------------------------


def kill_schedule(seed: int, duration: float, low: float, high: float) -> list[tuple[float, float]]:
    """(seconds after the first commit, a draw in [0, 1) that picks the victim among
    the groups live then) for each kill before the last `low` seconds."""
    rng = random.Random(seed)
    kills, t = [], rng.uniform(low, high)
    while t < duration - low:
        kills.append((round(t, 3), rng.random()))
        t += rng.uniform(low, high)
    return kills


def victim_of(live: list, draw: float):
    return live[min(len(live) - 1, int(draw * len(live)))]


# -- phalanx: phalanx run --as-torchft, in this process ---------------------------------


def _watcher(verbose: bool):
    """A watcher of phalanx run's launcher (made here: the worker's import of this
    file needs no phalanx)."""
    from phalanx import launcher

    class Watch(launcher.LaunchObserver):
        """Keeps the ranks' step lines and the groups' events, as the demo does."""

        def __init__(self) -> None:
            self.steps: list[dict] = []
            self.events: list[dict] = []
            self.started_ever: set[str] = set()

        def say(self, text: str) -> None:
            if verbose:
                print(f"[phalanx run] {text}", file=sys.stderr)

        def status_page(self, url: str, token: str | None) -> None:
            pass

        def rank_line(self, group, rank: int, line: bytes) -> None:
            if line.startswith(b'{"event": "step"'):
                self.steps.append(json.loads(line))

        def group_event(self, kind: str, group) -> None:
            restart = kind == "start" and group.replica_id in self.started_ever
            self.started_ever.add(group.replica_id)
            self.events.append(event(kind, group.replica_id, [p.pid for p in group.procs], restart))

        def trains(self) -> bool:
            return any(r["committed"] for r in self.steps)

    return Watch()


def _phalanx_launcher(args: argparse.Namespace, kills: list[tuple[float, float]]):
    """phalanx run's launcher whose chaos is the bench's schedule, and its watcher."""
    from phalanx import launcher

    class Scheduled(launcher.Launcher):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.pending = list(kills)
            self.since: float | None = None

        def inject(self, now: float) -> None:
            self.since = now if self.since is None else self.since
            while self.pending and now - self.since >= self.pending[0][0]:
                _, draw = self.pending.pop(0)
                live = [g for g in self.groups if g.alive]
                if live:
                    victim = victim_of(live, draw)
                    self.say(f"bench: SIGKILL {victim.replica_id}")
                    victim.chaos_killed = True  # restarted as a kill, not a failure
                    self.signal_group(victim, signal.SIGKILL)
                    self.observer.group_event("kill", victim)

    config = launcher.LaunchConfig(
        command=(sys.executable, str(WORKER), "worker", *worker_args(args)),
        replicas=GROUPS,
        join_timeout=JOIN_TIMEOUT_S,
        heartbeat_timeout=HEARTBEAT_TIMEOUT_S,
        restart_backoff=RESTART_BACKOFF,
        as_torchft=True,
    )
    watch = _watcher(args.verbose)
    return Scheduled(config, launcher.job_token(None, None, {}), observer=watch), watch


def run_phalanx(args: argparse.Namespace, kills: list[tuple[float, float]]) -> dict:
    started = time.time()
    job, watch = _phalanx_launcher(args, kills)
    job.run(duration=args.duration, startup_timeout=STARTUP_TIMEOUT_S)
    return measure(watch.steps, watch.events, started)


def event(kind: str, replica: str, pids: list[int], restart: bool = False) -> dict:
    """A launcher event as `phalanx.demo.report` reads it."""
    return {"t": time.time(), "kind": kind, "replica": replica, "restart": restart, "pids": pids}


def worker_args(args: argparse.Namespace) -> list[str]:
    return ["--timeout", str(args.timeout), "--width", str(args.width)]


# -- torchft: its lighthouse, a store per group, restarts ----------------------------------

LIGHTHOUSE = """
import sys, time
from torchft.coordination import LighthouseServer
server = LighthouseServer(bind=sys.argv[1], min_replicas=1, join_timeout_ms=int(sys.argv[2]),
                          heartbeat_timeout_ms=int(sys.argv[3]))
print(server.address(), flush=True)
time.sleep(1e9)
"""


class TorchftGroup:
    """One replica group of one rank on torchft: its process, a TCPStore it meets at
    (torchrun's part), its step lines."""

    def __init__(self, index: int, python: str, lighthouse: str, args, logs: Path) -> None:
        self.index, self.python, self.lighthouse, self.args = index, python, lighthouse, args
        self.replica_id = f"group{index}"
        self.logs = logs
        self.proc: subprocess.Popen | None = None
        self.store = None
        self.restart_at: float | None = None
        self.lives = 0

    def start(self, sink: list[dict], lock: threading.Lock) -> None:
        import torch.distributed as dist

        port = free_port()
        self.store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")},
            "TORCHFT_LIGHTHOUSE": self.lighthouse,
            "REPLICA_GROUP_ID": str(self.index),
            "NUM_REPLICA_GROUPS": str(GROUPS),
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONUNBUFFERED": "1",
        }
        stderr = (self.logs / f"{self.replica_id}.{self.lives}.log").open("w")
        self.proc = subprocess.Popen(
            [self.python, str(WORKER), "worker", *worker_args(self.args)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
        )
        stderr.close()
        self.lives += 1
        threading.Thread(target=self._read, args=(self.proc, sink, lock), daemon=True).start()

    @staticmethod
    def _read(proc: subprocess.Popen, sink: list[dict], lock: threading.Lock) -> None:
        for line in proc.stdout:
            if line.startswith(b'{"event": "step"'):
                with lock:
                    sink.append(json.loads(line))

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def torchft_importable(python: str) -> str | None:
    """Why `python` cannot run the torchft side, or None."""
    try:
        done = subprocess.run(
            [python, "-c", "import torchft.coordination, torchft.manager"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except OSError as e:
        return f"{python}: {e}"
    if done.returncode != 0:
        return f"{python} cannot import torchft: {done.stderr.strip().splitlines()[-1:]}"
    return None


class TorchftJob:
    """torchft's side: its lighthouse, the groups, the kills of the schedule, and the
    restart of each group 0.5 s after its process ended."""

    def __init__(self, args: argparse.Namespace, kills: list[tuple[float, float]]) -> None:
        self.args = args
        self.pending = list(kills)
        self.steps: list[dict] = []
        self.events: list[dict] = []
        self.lock = threading.Lock()
        self.logs = Path(tempfile.mkdtemp(prefix="torchft-bench-"))
        self.groups: list[TorchftGroup] = []

    def run(self) -> dict:
        started = time.time()
        lighthouse = subprocess.Popen(
            [self.args.torchft_python, "-c", LIGHTHOUSE, f"127.0.0.1:{free_port()}"]
            + [str(int(JOIN_TIMEOUT_S * 1000)), str(int(HEARTBEAT_TIMEOUT_S * 1000))],
            stdout=subprocess.PIPE,
            stderr=(self.logs / "lighthouse.log").open("w"),
            text=True,
        )
        try:
            address = lighthouse.stdout.readline().strip()
            if not address:
                raise RuntimeError(f"torchft's lighthouse did not start: {self.logs}")
            self.groups = [
                TorchftGroup(i, self.args.torchft_python, address, self.args, self.logs)
                for i in range(GROUPS)
            ]
            for group in self.groups:
                self.start(group, restart=False)
            self.supervise()
        finally:
            for group in self.groups:
                if group.proc is not None:
                    stop(group.proc)
            stop(lighthouse)
        with self.lock:
            return measure(list(self.steps), self.events, started) | {"logs": str(self.logs)}

    def start(self, group: TorchftGroup, restart: bool) -> None:
        group.start(self.steps, self.lock)
        self.events.append(event("start", group.replica_id, [group.proc.pid], restart))

    def supervise(self) -> None:
        since = None
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while since is None:
            time.sleep(0.02)
            with self.lock:
                if any(r["committed"] for r in self.steps):
                    since = time.monotonic()
            if time.monotonic() > deadline:
                raise RuntimeError(f"torchft trained no step in {STARTUP_TIMEOUT_S:g} s")
        while (now := time.monotonic()) - since < self.args.duration:
            self.kill_due(now - since)
            self.restart_due(now)
            time.sleep(0.02)
        for group in self.groups:
            if group.alive:
                self.events.append(event("stop", group.replica_id, [group.proc.pid]))

    def kill_due(self, elapsed: float) -> None:
        while self.pending and elapsed >= self.pending[0][0]:
            _, draw = self.pending.pop(0)
            live = [g for g in self.groups if g.alive]
            if live:
                victim = victim_of(live, draw)
                os.kill(victim.proc.pid, signal.SIGKILL)
                self.events.append(event("kill", victim.replica_id, [victim.proc.pid]))

    def restart_due(self, now: float) -> None:
        for group in self.groups:
            if group.restart_at is None and not group.alive:
                group.restart_at = now + RESTART_BACKOFF
            elif group.restart_at is not None and now >= group.restart_at:
                group.restart_at = None
                self.start(group, restart=True)


# -- the numbers ------------------------------------------------------------------------


def exclusions(steps: list[dict], events: list[dict]) -> list[float]:
    """For each kill that found every group in the quorum: seconds until the last
    survivor held a quorum without the victim (see the module docstring)."""
    found = []
    for kill in (e for e in events if e["kind"] == "kill"):
        t, times = kill["t"], []
        for replica in {r["replica"] for r in steps} - {kill["replica"]}:
            mine = sorted(
                (r for r in steps if r["replica"] == replica), key=lambda r: r["t_quorum"]
            )
            before = [r for r in mine if r["t_quorum"] <= t]
            if not before or before[-1]["participants"] < GROUPS:
                break  # a group was missing already: this kill is not counted
            after = next(
                (r for r in mine if r["t_quorum"] > t and r["participants"] < GROUPS), None
            )
            if after is None:
                break
            times.append(after["t_quorum"] - t)
        else:
            if times:
                found.append(max(times))
    return found


def measure(steps: list[dict], events: list[dict], started: float) -> dict:
    from phalanx.demo.report import analyze

    stopped = min((e["t"] for e in events if e["kind"] == "stop"), default=time.time())
    report_ = analyze(steps, events, replicas=GROUPS, started=started, stopped=stopped)
    excluded = exclusions([r for r in steps if r["t_start"] < stopped], events)
    stalls = [f["survivor_stall_s"] for f in report_["failures"] if f["survivor_stall_s"]]
    kills = [f for f in report_["failures"] if f["kind"] == "kill"]
    compared = report_["consistency_checked_steps"]
    return {
        "kills": len(kills),
        "kills_measured": len(excluded),
        # More restarts than kills: groups that were not killed died too.
        "restarts": sum(e["kind"] == "start" and e["restart"] for e in events),
        "kill_to_excluded_p50_s": _rounded(statistics.median(excluded) if excluded else None),
        "kill_to_excluded_max_s": _rounded(max(excluded, default=None)),
        "survivor_stall_p50_s": _rounded(percentile(stalls, 50) if stalls else None),
        "survivor_stall_max_s": _rounded(max(stalls, default=None)),
        "steps_committed": report_["job_steps"],
        "group_steps_committed": report_["group_steps_committed"],
        "recovered": report_["failures_recovered"],
        "bit_identical": report_["replicas_consistent"] and compared > 0,
        "steps_compared": compared,
        "split_steps": report_["split_steps"][:10],
        "training_s": report_["training_s"],
    }


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def rows_of(name: str, result: dict) -> list[tuple[str, object]]:
    def seconds(key: str) -> str:
        return "-" if result[key] is None else f"{result[key]:.3f}"

    stall = f"{seconds('survivor_stall_p50_s')} / {seconds('survivor_stall_max_s')}"
    if result["kills"] and result["survivor_stall_max_s"] is None:
        stall = "none: no other group committed until the killed one was back"
    identical = "yes" if result["bit_identical"] else "NO"
    return [
        (
            f"{name}: kills (counted for exclusion)",
            f"{result['kills']} ({result['kills_measured']})",
        ),
        (f"{name}: groups restarted", result["restarts"]),
        (
            f"{name}: kill → excluded p50 / max (s)",
            f"{seconds('kill_to_excluded_p50_s')} / {seconds('kill_to_excluded_max_s')}",
        ),
        (f"{name}: survivors' stall p50 / max (s)", stall),
        (f"{name}: steps committed", result["steps_committed"]),
        (f"{name}: replicas bit-identical", f"{identical} ({result['steps_compared']} steps)"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", choices=["worker"], help=argparse.SUPPRESS)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of training")
    parser.add_argument("--kill-every", type=float, nargs=2, default=(5.0, 15.0))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torchft-python", help="a python that imports a real torchft")
    parser.add_argument("--timeout", type=float, default=10.0, help="the Managers' timeout")
    parser.add_argument("--width", type=int, default=32, help="the MLP's hidden width")
    parser.add_argument("--verbose", action="store_true", help="show phalanx run's lines")
    args = parser.parse_args()
    if args.mode == "worker":
        run_worker(args.timeout, args.width)
        return

    kills = kill_schedule(args.seed, args.duration, *args.kill_every)
    results = {"phalanx": run_phalanx(args, kills)}
    why_not = torchft_importable(args.torchft_python) if args.torchft_python else None
    if args.torchft_python and why_not is None:
        results["torchft"] = TorchftJob(args, kills).run()
    else:
        why_not = why_not or "no --torchft-python given"
    rows = [row for name, result in results.items() for row in rows_of(name, result)]
    rows += [
        ("goals", "kill → excluded ≤ 0.1 s, survivors' stall ≤ 0.3 s, bit-identical"),
        ("torchft", "compared" if "torchft" in results else f"not run: {why_not}"),
    ]
    result = {
        "bench": "torchft_compat",
        **results,
        "goals": GOALS,
        "torchft_skipped": None if "torchft" in results else why_not,
        "config": {
            "groups": GROUPS,
            "duration_s": args.duration,
            "kill_every_s": list(args.kill_every),
            "seed": args.seed,
            "kill_schedule": kills,
            "restart_backoff_s": RESTART_BACKOFF,
            "join_timeout_s": JOIN_TIMEOUT_S,
            "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
        },
    }
    title = f"a torchft DDP script, {GROUPS} groups, SIGKILL every {args.kill_every[0]:g}-"
    report(title + f"{args.kill_every[1]:g} s for {args.duration:g} s", rows, result)


if __name__ == "__main__":
    main()
