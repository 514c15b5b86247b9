"""`phalanx demo`: the whole mission on one machine. Three replica groups train a small
Llama-style model through a SIGKILL of a random group every 15 seconds; at the end a
summary is printed, and `report.json`, `report.png`, the step log (`steps.jsonl`), the
launcher's events (`events.jsonl`) and the ranks' other output (`ranks.log`) are in
`--out`. Times count from the job's first committed step, as `--duration` does.

    phalanx demo [--duration 2m] [--replicas 3] [--kill-every 15s] [--out phalanx-demo]
    phalanx demo --snapshot-every 50 --kill-all-every 60s   # lose the whole job, resume

With `--snapshot-every N` one group writes the job's committed state to
`--snapshot-dir` (default: `snapshots/` in `--out`) every N committed steps;
`--kill-all-every` SIGKILLs every rank of every group at once, and the job resumes
from its newest snapshot: the report counts, for each such loss, the steps lost
(at most N) and redone, and how long the job took to commit again.

Exit status: 0 when the job trained and its replicas agree; 1 when no step committed;
3 when a step was committed with two or more fingerprints within one lineage (the
replicas diverged: the run printed the first such steps, and report.json lists them
in `split_steps`; a step redone after a rollback is of a new lineage, a new state);
130 when interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phalanx import launcher
from phalanx.crashes import CrashLoop
from phalanx.demo import regime
from phalanx.demo.display import Progress
from phalanx.demo.lighthouses import LighthouseSet
from phalanx.demo.report import (
    FAILURE_KINDS,
    JOB_LOSS,
    analyze,
    chart,
    interval_verdict,
    plot,
    split_verdict,
    summary_table,
    thin_verdict,
)
from phalanx.snapshots.rank import DEFAULT_KEEP, SnapshotSettings

#: Seconds the groups may take to commit their first step.
STARTUP_TIMEOUT = 180.0

#: The exit status of a run whose replicas committed one step with different states.
EXIT_DIVERGED = 3
EXIT_THIN = 4


class LogFile:
    """A file the demo logs to, a line at a time, that can never take the job down:
    the first write that fails (a full disk, a removed folder) is reported once
    through `warn`, and the file is given up; training and the other files go on. A
    file given up ends on its last whole line, or is removed when it has none.

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
        self._fd: int | None = None
        #: Bytes of whole lines written: where the file is cut back to when it fails.
        self._whole = 0
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        except OSError as e:
            self._give_up(e)

    def write(self, text: str) -> None:
        """Writes `text` (whole lines) unbuffered: what is on disk is all that was
        written, and a short write is cut back off when the next part fails."""
        if self._fd is None:
            return
        encoded = text.encode()
        data = memoryview(encoded)
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError as e:
            self._give_up(e)
            return
        self._whole += len(encoded)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError as e:
                self._warn(f"cannot close {self.path} ({e.strerror or e})")

    def _give_up(self, error: OSError) -> None:
        kept = "nothing written"
        if self._fd is not None:
            fd, self._fd = self._fd, None
            kept = self._cut(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
        self._warn(
            f"cannot write {self.path} ({error.strerror or error}); going on without it ({kept})"
        )

    def _cut(self, fd: int) -> str:
        """Cuts a regular file back to its whole lines (removes it if it has none);
        says what is left. A device or a pipe is left as it is."""
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return "not a regular file"
            if self._whole:
                os.ftruncate(fd, self._whole)
                return f"it ends on its last whole line, at {self._whole} bytes"
        except OSError:
            pass  # cannot cut it: remove it rather than leave half a line
        with contextlib.suppress(OSError):
            self.path.unlink()
        return "removed: no whole line of it could be kept"


def save(path: Path, write: Callable[[Path], object], warn: Callable[[str], None]) -> bool:
    """Writes one of the report's files; a failure is reported, never raised, and
    leaves no file behind (an empty or half-written report misleads, as would an
    older run's under the same name)."""
    try:
        write(path)
        return True
    except OSError as e:
        with contextlib.suppress(OSError):
            if stat.S_ISREG(path.lstat().st_mode):
                path.unlink()
        warn(f"cannot write {path} ({e.strerror or e}); skipped")
        return False


class DemoJob(launcher.LaunchObserver):
    """Watches the launcher's groups: every step line of a rank goes to the step log
    and the live display, every other line to `ranks.log`."""

    def __init__(
        self,
        replicas: int,
        out: Path,
        progress: Progress,
        *,
        seed_regime: float | None = None,
        steps: int | None = None,
    ):
        self.replicas = replicas
        #: --seed-regime: a failure every that many healthy steps, once they are timed.
        self.seed_regime = seed_regime
        self.healthy_step_s: float | None = None
        #: Starts the failures, a SIGKILL every so many seconds (the launcher's chaos).
        self.pace: Callable[[float], None] | None = None
        #: When, and at which job step, the failures started (the training, without them).
        self.failures_from: float | None = None
        self.failures_from_step = 0
        #: --steps: the job steps to train (from the first failure, in the seed regime).
        self.steps_wanted = steps
        self._newest_step = -1
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
        #: The whole-job losses so far; when the last one fell, until the job commits again.
        self._losses = 0
        self._lost_at: float | None = None
        #: Its groups killed so far (the launcher tells of them one by one).
        self._lost_groups: set[str] = set()
        #: Groups whose lives died of one exception again and again (`phalanx.crashes`).
        self.crash_loops: list[dict[str, Any]] = []

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

    def crash_loop(self, group: launcher.Group, loop: CrashLoop) -> None:
        crash, now = loop.crash, time.time()
        self.crash_loops.append(
            {
                "at_s": round(now - (self.trained_from or self.started), 2),
                "replica": group.replica_id,
                "lives": loop.lives,
                "kind": crash.kind,
                "message": crash.message,
                "step": crash.step,
            }
        )
        self.progress.event(f"{self._clock(now)}  {group.replica_id} is in a {loop}")

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
                how = "healing from peers"
                if group.replica_id in self._lost_groups:
                    how = "resuming from the newest snapshot, or healing from a group that did"
                self.progress.event(f"{elapsed}  {group.replica_id} restarted, {how}")
        elif kind == JOB_LOSS:
            self._latest.pop(group.replica_id, None)
            if self._lost_at is None or group.replica_id in self._lost_groups:
                self._losses += 1
                self._lost_at, self._lost_groups = now, set()
                self.progress.event(f"{elapsed}  SIGKILL every group: the whole job is lost")
            self._lost_groups.add(group.replica_id)
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
        # The demo's time and its failures count from the first committed step; in the
        # seed regime, from the end of the healthy steps it is paced by.
        return bool(self._latest) and (self.seed_regime is None or self.failures_from is not None)

    def finished(self) -> bool:
        if self.steps_wanted is None or not self.trains():
            return False
        return self._newest_step >= self.failures_from_step + self.steps_wanted

    def _pace_failures(self, record: dict[str, Any]) -> None:
        """In the seed regime, once the healthy step time is known: the failures start,
        one every `seed_regime` of those steps."""
        if self.seed_regime is None or self.failures_from is not None:
            return
        if record.get("participants") != self.replicas:
            return
        step_s = regime.healthy_step_time(self.steps, self.replicas)
        if step_s is None:
            return
        self.healthy_step_s = step_s
        every = self.seed_regime * step_s
        if self.pace is not None:
            self.pace(every)
        self.failures_from, self.failures_from_step = record["t_end"], self._newest_step
        self.progress.event(
            f"{self._clock(record['t_end'])}  healthy step {step_s:.3f} s (median of "
            f"{regime.MEASURED_STEPS} steps of all {self.replicas} groups): a SIGKILL every "
            f"{self.seed_regime:g} steps, {every:.2f} s, from step {self._newest_step}"
        )

    def _step(self, record: dict[str, Any]) -> None:
        self.steps.append(record)
        if record["committed"]:
            self._newest_step = max(self._newest_step, record["step"])
        self._pace_failures(record)
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
        if record.get("resume_s"):
            self.progress.event(
                f"{self._clock(record['t_end'])}  {replica} loaded the snapshot of step "
                f"{record['step']} in {record['resume_s']:.2f} s"
            )
        lost_at = self._lost_at
        # A killed rank's last lines may still be read after the loss: they are older.
        if record["committed"] and lost_at is not None and record["t_start"] > lost_at:
            seconds, self._lost_at = record["t_end"] - lost_at, None
            self._lost_groups = set()  # a group restarted from here on heals from it
            self.progress.event(
                f"{self._clock(record['t_end'])}  the job is back: step {record['step']} "
                f"committed (lineage {record.get('lineage', 0)}), {seconds:.2f} s after "
                "the loss of every group"
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
        losses = f"  job losses {self._losses}" if self._losses else ""
        self.progress.status(
            f"{self._clock(time.time())}  step {max(r['step'] for r in live) + 1:5d}"
            f"  loss {loss:5.3f}  groups {len(live)}/{self.replicas}"
            f"  failures {failures}{losses}"
            f"  group-steps committed {committed / max(attempted, 1):.1%}"
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
        f"fingerprints in one lineage; report.json lists them in split_steps); {EXIT_THIN} "
        "most steps averaged fewer than half of the groups that took them (report.json's "
        "thin_steps); 130 interrupted",
    )
    duration = launcher.parse_duration
    parser.add_argument(
        "--duration",
        type=duration,
        default=120.0,
        help="training time, from the first step: 2m, 90s",
    )
    parser.add_argument(
        "--replicas", type=int, help="replica groups (default: 3; 30 with --seed-regime)"
    )
    parser.add_argument("--nproc-per-replica", type=int, default=1, help="ranks per group")
    parser.add_argument(
        "--kill-every",
        type=duration,
        help="SIGKILL a random group this often (default: 15s; 0: never)",
    )
    parser.add_argument(
        "--seed-regime",
        type=float,
        metavar="STEPS",
        help="the seed experiment's failure rate: a SIGKILL of a random group every STEPS "
        "healthy steps (1.4: its one failure every 15 s; 5.5: one a minute), timed on the "
        f"job's first {regime.MEASURED_STEPS} steps of every group; "
        f"{regime.GROUPS} groups unless --replicas says otherwise",
    )
    parser.add_argument(
        "--steps",
        type=int,
        help="stop once the job committed this many steps (from the first failure with "
        "--seed-regime), or at --duration, whichever comes first",
    )
    parser.add_argument("--hang-every", type=duration, help="SIGSTOP a random group this often")
    parser.add_argument(
        "--hang-thread-every",
        type=duration,
        help="block the training thread of a random group's rank this often (for 60 s; "
        "the group is evicted as stalled and restarted)",
    )
    parser.add_argument(
        "--kill-all-every",
        type=duration,
        help="SIGKILL every rank of every group at once this often (the loss of the whole "
        "job; it resumes from its newest snapshot: needs --snapshot-every)",
    )
    parser.add_argument(
        "--snapshot-every",
        metavar="N|DURATION",
        help="write the job's committed state every N committed steps (e.g. 50) or every "
        "DURATION (e.g. 30s); one group writes each, in turn",
    )
    parser.add_argument(
        "--snapshot-dir",
        type=Path,
        help="where the snapshots go (default: snapshots/ in --out)",
    )
    parser.add_argument(
        "--snapshot-keep",
        type=int,
        default=DEFAULT_KEEP,
        metavar="K",
        help=f"snapshots kept (default: {DEFAULT_KEEP})",
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
    parser.add_argument(
        "--model-dim",
        type=int,
        default=128,
        help="the model's width (128: 0.43M parameters, 1.6 MB in 2 gradient buckets; "
        "512: 6.4M, 24.5 MB)",
    )
    parser.add_argument(
        "--batch-from",
        choices=["quorum", "step"],
        default="quorum",
        help="quorum: each group's share of one sample stream, which waits for the step's "
        "quorum before the forward; step: windows drawn from the step number alone, a loop "
        "that asks the manager nothing before its forward (a restarted group then heals "
        "inside its backward)",
    )
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
    args, token = parse(argv)
    progress = Progress()
    progress.event(
        f"phalanx demo: {args.replicas} replica group(s) x {args.nproc_per_replica} rank(s), "
        f"{args.duration:g} s"
        + (f", SIGKILL of a random group every {args.kill_every:g} s" if args.kill_every else "")
        + (
            f", SIGKILL of a random group every {args.seed_regime:g} healthy steps"
            if args.seed_regime
            else ""
        )
        + (f", {args.steps} steps" if args.steps else "")
        + (
            f", SIGKILL of every group every {args.kill_all_every:g} s"
            if args.kill_all_every
            else ""
        )
        + (
            f"; a snapshot every {args.snapshots.every} in {args.snapshots.location}"
            if args.snapshots
            else ""
        )
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
    job = DemoJob(args.replicas, args.out, progress, seed_regime=args.seed_regime, steps=args.steps)
    run = launcher.Launcher(config, token, observer=job)
    job.pace = lambda every: run.set_chaos(dataclasses.replace(run.chaos, kill_every=every))
    try:
        code = run.run(
            duration=args.duration,
            chaos_quiet=chaos_quiet(args),
            startup_timeout=STARTUP_TIMEOUT,
        )
    finally:
        job.close()
        if lighthouses is not None:
            lighthouses.close()
    report = write_report(args, job, exited=time.time())
    return exit_status(report, code, args.out)


def snapshot_settings(args: argparse.Namespace) -> SnapshotSettings | None:
    """The snapshots of `--snapshot-every/--snapshot-dir/--snapshot-keep` (None: off);
    ValueError for a bad value. The folder is made here (after the values are checked),
    so that a bad one is refused before anything starts."""
    if not args.snapshot_every:
        return None
    location = args.snapshot_dir if args.snapshot_dir is not None else args.out / "snapshots"
    location = location.absolute()  # the ranks read it, from wherever they run
    settings = SnapshotSettings.of(str(location), args.snapshot_every, args.snapshot_keep)
    try:
        location.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"cannot create the snapshot folder {location}: {e.strerror or e}; pick another "
            "--snapshot-dir"
        ) from e
    return settings


def chaos_quiet(args: argparse.Namespace) -> float:
    """No failure in the last seconds of the run: half the shortest interval, at most 5 s,
    so that the job's end is not a failure's."""
    every = [e for e in (args.kill_every, args.kill_all_every) if e]
    return min(5.0, min(every, default=0.0) / 2)


def pace(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The groups and the failures of `--seed-regime`, `--kill-every`, `--replicas` and
    `--steps`, their defaults filled in (a bad one exits with a usage error)."""
    if args.seed_regime is not None:
        if args.seed_regime <= 0:
            parser.error("--seed-regime is the healthy steps between failures, e.g. 1.4")
        if args.kill_every is not None:
            parser.error(
                "--seed-regime paces the SIGKILLs by the job's step time: leave --kill-every out"
            )
        args.kill_every = 0.0  # until the healthy step time is known
    elif args.kill_every is None:
        args.kill_every = 15.0
    if args.replicas is None:
        args.replicas = regime.GROUPS if args.seed_regime is not None else 3
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be at least 1")


def parse(argv: list[str]) -> tuple[argparse.Namespace, str]:
    """The demo's options, checked (a bad one exits with a usage error before anything
    starts), and the job token; makes the report and snapshot folders."""
    parser = build_parser()
    args = parser.parse_args(argv)
    pace(parser, args)
    if args.replicas < 1 or args.nproc_per_replica < 1:
        parser.error("--replicas and --nproc-per-replica must be at least 1")
    if args.duration <= 0:
        parser.error("--duration must be positive, e.g. --duration 2m")
    if args.lighthouses != 1 and args.lighthouses < 3:
        parser.error("--lighthouses is 1, or a set of 3 or more (3 or 5) so that one may fail")
    if args.kill_lighthouse_every and args.lighthouses < 3:
        parser.error("--kill-lighthouse-every needs a set of lighthouses: add --lighthouses 3")
    if args.kill_all_every and not args.snapshot_every:
        parser.error(
            "--kill-all-every loses every group's state at once: add --snapshot-every N "
            "(e.g. 50) so that the job resumes from a snapshot"
        )
    if args.snapshot_dir is not None and not args.snapshot_every:
        parser.error("--snapshot-dir needs --snapshot-every N too (how often to write one)")
    try:
        token = launcher.job_token(None, args.token_file, os.environ)
    except ValueError as e:
        parser.error(str(e))
    try:
        args.snapshots = snapshot_settings(args)
    except ValueError as e:
        parser.error(str(e))
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"cannot create the report folder {args.out}: {e}; pick another --out")
    return args, token


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
        f"--dim={args.model_dim}",
        f"--batch-from={args.batch_from}",
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
            kill_all_every=args.kill_all_every or None,
        ),
        chaos_seed=args.seed,
        max_restarts=3,  # failures not injected: a broken setup gives up soon
        snapshots=args.snapshots,
    )


def write_report(args: argparse.Namespace, job: DemoJob, exited: float) -> dict[str, Any]:
    """Prints the summary and writes the report's files; returns the report."""
    steps = job.steps
    if job.failures_from is not None:  # the seed regime: the healthy steps it timed go
        steps = [r for r in steps if r["t_start"] >= job.failures_from]
    report = analyze(
        steps,
        job.events,
        replicas=args.replicas,
        started=job.started,
        stopped=exited if job.stopped is None else job.stopped,
        exited=exited,
        snapshot_every=args.snapshots.every.steps if args.snapshots else None,
    )
    report["crash_loops"] = job.crash_loops
    report["config"] = {
        "replicas": args.replicas,
        "nproc_per_replica": args.nproc_per_replica,
        "duration_s": args.duration,
        "kill_every_s": args.kill_every,
        "seed_regime": None
        if args.seed_regime is None
        else {
            "failure_every_steps": args.seed_regime,
            "healthy_step_s": job.healthy_step_s,
            "kill_every_s": None
            if job.healthy_step_s is None
            else args.seed_regime * job.healthy_step_s,
            "from_step": job.failures_from_step,
        },
        "steps": args.steps,
        "hang_every_s": args.hang_every,
        "hang_thread_every_s": args.hang_thread_every,
        "lighthouses": args.lighthouses,
        "kill_lighthouse_every_s": args.kill_lighthouse_every,
        "kill_all_every_s": args.kill_all_every,
        "snapshot_every": str(args.snapshots.every) if args.snapshots else None,
        "snapshot_dir": args.snapshots.location if args.snapshots else None,
        "seed": args.seed,
        "strategy": args.strategy,
        "sync_every": args.sync_every if args.strategy == "diloco" else None,
        "model_dim": args.model_dim,
        "batch_from": args.batch_from,
        "train_args": training_args(args),
    }
    # The summary reaches the terminal whatever the disk allows.
    print(summary_table(report))
    if (over := interval_verdict(report)) is not None:
        print(over)
    warn = job.warn
    save(
        args.out / "report.json", lambda p: p.write_text(json.dumps(report, indent=2) + "\n"), warn
    )
    events = "".join(json.dumps(e) + "\n" for e in job.events)
    save(args.out / "events.jsonl", lambda p: p.write_text(events), warn)
    save(args.out / "report.png", lambda p: plot(chart(steps, report), str(p)), warn)
    print(files_line(args.out))
    return report


#: The demo's files in --out, and what each is.
FILES = {
    "report.json": "the report",
    "report.png": "its chart",
    "steps.jsonl": "the step log",
    "events.jsonl": "the launcher's events",
    "ranks.log": "the ranks' other output",
}


def files_line(out: Path) -> str:
    """Where the report is: the files that were written (a full disk may have cost
    some; each was warned about)."""
    kept = [f"{name} ({what})" for name, what in FILES.items() if (out / name).exists()]
    missing = [name for name in FILES if not (out / name).exists()]
    line = f"report in {out}/: " + ("; ".join(kept) if kept else "no file")
    return line + (f"; not written: {', '.join(missing)}" if missing else "")


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
    thin = thin_verdict(report)
    if thin:
        print(thin)
        return EXIT_THIN
    return 0
