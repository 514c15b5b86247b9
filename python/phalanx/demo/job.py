"""`phalanx demo`: the whole mission on one machine. Three replica groups train a small
Llama-style model through a SIGKILL of a random group every 15 seconds; at the end a
summary is printed, and `report.json`, `report.png`, the step log (`steps.jsonl`), the
launcher's events (`events.jsonl`) and the ranks' other output (`ranks.log`) are in
`--out`. Times count from the job's first committed step, as `--duration` does.

    phalanx demo [--duration 2m] [--replicas 3] [--kill-every 15s] [--out phalanx-demo]

Exit status: 0 when the job trained and its replicas agree; 1 when no step committed;
3 when a step was committed with two or more fingerprints (the replicas diverged:
the run printed the first such steps, and report.json lists them in `split_steps`);
130 when interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from phalanx import launcher
from phalanx.demo.display import Progress
from phalanx.demo.lighthouses import LighthouseSet
from phalanx.demo.report import (
    FAILURE_KINDS,
    analyze,
    chart,
    plot,
    split_verdict,
    summary_table,
)

#: Seconds the groups may take to commit their first step.
STARTUP_TIMEOUT = 180.0

#: The exit status of a run whose replicas committed one step with different states.
EXIT_DIVERGED = 3


class LogFile:
    """A file the demo logs to that can never take the job down: the first write
    that fails (a full disk, a removed folder) is reported once through `warn`, and
    the file is given up; training and the other files go on.

    >>> warnings = []
    >>> log = LogFile(Path("/dev/full"), warnings.append)
    >>> log.write("x" * 100_000)
    >>> len(warnings), "No space left on device" in warnings[0]
    (1, True)
    >>> log.write("more"); log.close(); len(warnings)
    1
    """

    def __init__(self, path: Path, warn: Callable[[str], None]):
        self.path = path
        self._warn = warn
        self._file: TextIO | None = None
        try:
            self._file = path.open("w")
        except OSError as e:
            self._give_up(e)

    def write(self, text: str) -> None:
        if self._file is not None:
            try:
                self._file.write(text)
            except OSError as e:
                self._give_up(e)

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as e:
                self._give_up(e)

    def _give_up(self, error: OSError) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()  # what is buffered is lost with the file
            self._file = None
        self._warn(f"cannot write {self.path} ({error.strerror or error}); going on without it")


def save(path: Path, write: Callable[[Path], object], warn: Callable[[str], None]) -> bool:
    """Writes one of the report's files; a failure is reported, never raised."""
    try:
        write(path)
        return True
    except OSError as e:
        warn(f"cannot write {path} ({e.strerror or e}); skipped")
        return False


class DemoJob(launcher.LaunchObserver):
    """Watches the launcher's groups: every step line of a rank goes to the step log
    and the live display, every other line to `ranks.log`."""

    def __init__(self, replicas: int, out: Path, progress: Progress):
        self.replicas = replicas
        self.out = out
        self.progress = progress
        self.steps: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.started = time.time()
        #: When the first step committed: training, and the display's clock, start there.
        self.trained_from: float | None = None
        #: When the launcher stopped the groups: the end of training.
        self.stopped: float | None = None
        self._step_log = LogFile(out / "steps.jsonl", self.warn)
        self._rank_log = LogFile(out / "ranks.log", self.warn)
        self._ever_started: set[str] = set()
        self._recovering: dict[str, float] = {}
        self._latest: dict[str, dict[str, Any]] = {}
        #: Group-steps (rank 0's records), as the report counts them.
        self._attempted = 0
        self._committed = 0
        self._failures = 0

    def warn(self, text: str) -> None:
        self.progress.event(f"warning: {text}")

    def say(self, text: str) -> None:
        self._rank_log.write(f"[phalanx run] {text}\n")

    def status_page(self, url: str, token: str | None) -> None:
        # ranks.log is a file others may read: the token goes to the terminal only.
        self.say(launcher.status_page_line(url, token or "", terminal=False))
        if self.progress.tty:
            self.progress.event(launcher.status_page_line(url, token or "", terminal=True))

    def rank_line(self, group: launcher.Group, rank: int, line: bytes) -> None:
        if line.startswith(b'{"event": "step"'):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if record is not None:
                self._step(record)
                return
        self._rank_log.write(f"[{group.replica_id}/{rank}] {line.decode(errors='replace')}\n")

    def group_event(self, kind: str, group: launcher.Group) -> None:
        now = time.time()
        restart = kind == "start" and group.replica_id in self._ever_started
        self.events.append(
            {
                "t": now,
                "kind": kind,
                "replica": group.replica_id,
                "restart": restart,
                "pids": [p.pid for p in group.procs],
            }
        )
        elapsed = self._clock(now)
        self._failures += kind in FAILURE_KINDS
        if kind == "stop" and self.stopped is None:
            self.stopped = now
        if kind == "start":
            self._ever_started.add(group.replica_id)
            if restart:
                self._recovering[group.replica_id] = now
                self.progress.event(f"{elapsed}  {group.replica_id} restarted, healing from peers")
        elif kind == "kill":
            self._latest.pop(group.replica_id, None)
            self.progress.event(f"{elapsed}  SIGKILL {group.replica_id}")
        elif kind == "hang":
            self.progress.event(f"{elapsed}  SIGSTOP {group.replica_id}")
        elif kind == "hang-thread":
            self.progress.event(f"{elapsed}  training thread of {group.replica_id} blocked")
        elif kind == "resume":
            self.progress.event(f"{elapsed}  SIGCONT {group.replica_id}")

    def _clock(self, t: float) -> str:
        """`t` as the display, report.png and `--duration` count: from the first
        committed step; before it, as start-up time since the launch."""
        if self.trained_from is None:
            return f"start-up {t - self.started:.1f}s"
        return f"{t - self.trained_from:6.1f}s"

    def trains(self) -> bool:
        # The demo's time and its failures count from the first committed step.
        return bool(self._latest)

    def _step(self, record: dict[str, Any]) -> None:
        self.steps.append(record)
        if record["rank"] == 0:
            self._attempted += 1
            self._committed += record["committed"]
        self._step_log.write(json.dumps(record) + "\n")
        replica = record["replica"]
        if record["committed"] and self.trained_from is None:
            self.trained_from = record["t_end"]
            self.progress.event(
                f"{self._clock(record['t_end'])}  first step committed, "
                f"{record['t_end'] - self.started:.1f} s after the launch; times count from here"
            )
        if record["committed"]:
            self._latest[replica] = record
            if replica in self._recovering:
                seconds = record["t_end"] - self._recovering.pop(replica)
                self.progress.event(
                    f"{self._clock(record['t_end'])}  {replica} back at step "
                    f"{record['step']}, {seconds:.2f} s after its restart"
                )
        self._show()

    def _show(self) -> None:
        live = list(self._latest.values())
        if not live:
            return
        committed, attempted, failures = self._committed, self._attempted, self._failures
        loss = sum(r["loss"] for r in live) / len(live)
        self.progress.status(
            f"{self._clock(time.time())}  step {max(r['step'] for r in live) + 1:5d}"
            f"  loss {loss:5.3f}  groups {len(live)}/{self.replicas}"
            f"  failures {failures}  group-steps committed {committed / max(attempted, 1):.1%}"
        )

    def close(self) -> None:
        self._step_log.close()
        self._rank_log.close()
        self.progress.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx demo",
        description="Train a small Llama-style model with replica groups that keep "
        "failing, on this machine, and report what the job achieved.",
        epilog="exit status: 0 trained, replicas agree; 1 no step committed; "
        f"{EXIT_DIVERGED} replicas diverged (a step committed with two or more "
        "fingerprints; report.json lists them in split_steps); 130 interrupted",
    )
    duration = launcher.parse_duration
    parser.add_argument(
        "--duration",
        type=duration,
        default=120.0,
        help="training time, from the first step: 2m, 90s",
    )
    parser.add_argument("--replicas", type=int, default=3, help="replica groups")
    parser.add_argument("--nproc-per-replica", type=int, default=1, help="ranks per group")
    parser.add_argument(
        "--kill-every", type=duration, default=15.0, help="SIGKILL a random group (0: never)"
    )
    parser.add_argument("--hang-every", type=duration, help="SIGSTOP a random group this often")
    parser.add_argument(
        "--hang-thread-every",
        type=duration,
        help="block the training thread of a random group's rank this often (for 60 s; "
        "the group is evicted as stalled and restarted)",
    )
    parser.add_argument(
        "--lighthouses",
        type=int,
        default=1,
        help="lighthouses: 1, or a set of 3 or 5 of which one serves at a time",
    )
    parser.add_argument(
        "--kill-lighthouse-every",
        type=duration,
        help="with --lighthouses 3: stop the serving lighthouse this often (it starts "
        "again 5 s later)",
    )
    parser.add_argument(
        "--strategy",
        choices=["ddp", "hsdp", "diloco"],
        default="ddp",
        help="ddp: every step a transaction; hsdp: FSDP2 inside a group (use "
        "--nproc-per-replica 2); diloco: local steps, a sync every --sync-every",
    )
    parser.add_argument("--sync-every", type=int, default=20, help="DiLoCo: inner steps a sync")
    parser.add_argument("--out", type=Path, default=Path("phalanx-demo"), help="report folder")
    parser.add_argument("--seed", type=int, default=0, help="of the data and the failures")
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help="the job token, in a file only you can read (default: PHALANX_TOKEN_FILE, "
        "else a new random token, shown in the status page link on a terminal)",
    )
    parser.add_argument(
        "train_args", nargs=argparse.REMAINDER, help="after --: more options of the training"
    )
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replicas < 1 or args.nproc_per_replica < 1:
        parser.error("--replicas and --nproc-per-replica must be at least 1")
    if args.duration <= 0:
        parser.error("--duration must be positive, e.g. --duration 2m")
    if args.lighthouses != 1 and args.lighthouses < 3:
        parser.error("--lighthouses is 1, or a set of 3 or more (3 or 5) so that one may fail")
    if args.kill_lighthouse_every and args.lighthouses < 3:
        parser.error("--kill-lighthouse-every needs a set of lighthouses: add --lighthouses 3")
    try:
        token = launcher.job_token(None, args.token_file, os.environ)
    except ValueError as e:
        parser.error(str(e))
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"cannot create the report folder {args.out}: {e}; pick another --out")
    progress = Progress()
    progress.event(
        f"phalanx demo: {args.replicas} replica group(s) x {args.nproc_per_replica} rank(s), "
        f"{args.duration:g} s"
        + (f", SIGKILL of a random group every {args.kill_every:g} s" if args.kill_every else "")
    )
    config = launch_config(args)
    lighthouses = None
    if args.lighthouses > 1:
        lighthouses = LighthouseSet(
            args.lighthouses, token, join_timeout=1.0, heartbeat_timeout=2.0
        )
        config = dataclasses.replace(config, lighthouse=lighthouses.addresses)
        progress.event(f"{args.lighthouses} lighthouses at {lighthouses.addresses}")
        if args.kill_lighthouse_every:
            lighthouses.kill_every(args.kill_lighthouse_every, progress.event)
    job = DemoJob(args.replicas, args.out, progress)
    try:
        code = launcher.Launcher(config, token, observer=job).run(
            duration=args.duration,
            chaos_quiet=min(5.0, (args.kill_every or 0) / 2),
            startup_timeout=STARTUP_TIMEOUT,
        )
    finally:
        job.close()
        if lighthouses is not None:
            lighthouses.close()
    report = write_report(args, job, exited=time.time())
    return exit_status(report, code, args.out)


def training_args(args: argparse.Namespace) -> list[str]:
    """What the user passed after -- for the training script."""
    return [a for a in args.train_args if a != "--"]


def launch_config(args: argparse.Namespace) -> launcher.LaunchConfig:
    """The launch of the demo's groups: its training script, its failures."""
    command = (
        sys.executable,
        "-m",
        "phalanx.demo.train",
        f"--seed={args.seed}",
        f"--strategy={args.strategy}",
        f"--sync-every={args.sync_every}",
        *training_args(args),
    )
    return launcher.LaunchConfig(
        command=command,
        replicas=args.replicas,
        nproc_per_replica=args.nproc_per_replica,
        chaos=launcher.Chaos(
            kill_every=args.kill_every or None,
            hang_every=args.hang_every or None,
            hang_for=3.0,
            hang_thread_every=args.hang_thread_every or None,
            hang_thread_for=60.0,
        ),
        chaos_seed=args.seed,
        max_restarts=3,  # failures not injected: a broken setup gives up soon
    )


def write_report(args: argparse.Namespace, job: DemoJob, exited: float) -> dict[str, Any]:
    """Prints the summary and writes the report's files; returns the report."""
    report = analyze(
        job.steps,
        job.events,
        replicas=args.replicas,
        started=job.started,
        stopped=exited if job.stopped is None else job.stopped,
        exited=exited,
    )
    report["config"] = {
        "replicas": args.replicas,
        "nproc_per_replica": args.nproc_per_replica,
        "duration_s": args.duration,
        "kill_every_s": args.kill_every,
        "hang_every_s": args.hang_every,
        "hang_thread_every_s": args.hang_thread_every,
        "lighthouses": args.lighthouses,
        "kill_lighthouse_every_s": args.kill_lighthouse_every,
        "seed": args.seed,
        "strategy": args.strategy,
        "sync_every": args.sync_every if args.strategy == "diloco" else None,
        "train_args": training_args(args),
    }
    # The summary reaches the terminal whatever the disk allows.
    print(summary_table(report))
    warn = job.warn
    save(
        args.out / "report.json", lambda p: p.write_text(json.dumps(report, indent=2) + "\n"), warn
    )
    events = "".join(json.dumps(e) + "\n" for e in job.events)
    save(args.out / "events.jsonl", lambda p: p.write_text(events), warn)
    save(args.out / "report.png", lambda p: plot(chart(job.steps, report), str(p)), warn)
    print(
        f"report in {args.out}/: report.json, report.png; step log steps.jsonl; launcher "
        "events events.jsonl; rank output ranks.log"
    )
    return report


def exit_status(report: dict[str, Any], launcher_code: int, out: Path) -> int:
    """The demo's exit status, from its report and its launcher's; prints why when it
    is not 0. Diverged replicas come first: they make every other number moot."""
    diverged = split_verdict(report)
    if diverged:
        print(diverged)
        return EXIT_DIVERGED
    if launcher_code == 130:
        return 130
    if not report["group_steps_committed"]:
        tail = (out / "ranks.log").read_text().splitlines()[-20:]
        print("no step committed; the end of ranks.log says why:", *tail, sep="\n  ")
        return 1
    return 0
