"""`phalanx run`: starts a job's replica groups, restarts a group that fails, and can
inject failures on purpose.

    phalanx run --replicas 3 --nproc-per-replica 2 -- train.py --lr 0.1

Each group gets W rank processes with the usual environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/MASTER_PORT for the group's own store), PHALANX_* for the
job, and torchft's REPLICA_GROUP_ID (the group's index, 0 to N-1) and
NUM_REPLICA_GROUPS (N, this launcher's groups). With --as-torchft, `import torchft`
in the ranks is `phalanx.torchft` (`torchft_alias_dir`) and TORCHFT_LIGHTHOUSE is the
lighthouse's address.
Without --lighthouse, the launcher serves one itself; with it, the groups join
that job, which is how a multi-host job is started (one `phalanx run --replicas 1
--replica-id … --token-file FILE` per host, FILE written once by `phalanx token`). A
job always has a token: without --token or --token-file (or PHALANX_TOKEN /
PHALANX_TOKEN_FILE) the launcher makes a random one, for its lighthouse and ranks.
A group is all or nothing: when one of its ranks dies, the rest are stopped and the
group restarts, with backoff, up to --max-restarts failures in a row: a group that
committed a step since its last start has its count, and its backoff, start again
(`RestartCount`, `CommitWatch`).
Python ranks are forked by a fork server that imported torch once (phalanx.forkserver),
so a restarted rank starts at once: `python -m module` or `python train.py`, where
PATH finds that `python` to be the launcher's own interpreter. The log's "ranks:" line
says which way ranks start, and why.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from phalanx import _core, watchdog
from phalanx._torchft_alias.torchft import ALIAS_DIR, real_torchft, refusal
from phalanx.forkserver import ForkServer, die_with_parent, runnable
from phalanx.restarts import (
    MAX_BACKOFF,
    SIGHTING_AWAY,
    SIGHTING_EVERY,
    SIGHTING_TIMEOUT,
    CommitWatch,
    Exit,
    RestartCount,
    Sighting,
)
from phalanx.token import new_token, resolve_token


def parse_duration(text: str) -> float:
    """Seconds from "15s", "500ms", "2m" or a plain number, read as the lighthouse's
    command line reads them.

    >>> parse_duration("15s"), parse_duration("500ms"), parse_duration("2m"), parse_duration("3")
    (15.0, 0.5, 120.0, 3.0)
    """
    return _core.parse_duration(text)


def resolve(command: list[str]) -> list[str]:
    """`command` with its program where PATH finds it, as the shell would, so that
    `python -m train` can be recognised as this interpreter's (see `rank_mode`).

    >>> resolve(["sh", "-c", "true"])[0] == shutil.which("sh")
    True
    >>> resolve(["no-such-program", "x"])
    ['no-such-program', 'x']
    """
    found = shutil.which(command[0])
    return [found, *command[1:]] if found else command


def rank_mode(command: list[str], fork_server: bool) -> tuple[bool, str]:
    """Whether ranks of `command` (resolved) are forked by the fork server, and why,
    for the log: only a module or a script of the launcher's own interpreter can be.

    >>> rank_mode([sys.executable, "-m", "train"], fork_server=True)[0]
    True
    >>> rank_mode([sys.executable, "-m", "train"], fork_server=False)
    (False, 'plain processes (--no-fork-server)')
    """
    if not fork_server:
        return False, "plain processes (--no-fork-server)"
    if runnable(command):
        return True, f"fork server ({command[0]} is this launcher's interpreter)"
    return False, (
        f"plain processes ({' '.join(command[:2])} is not `python -m MODULE` or "
        f"`python SCRIPT.py` run by this launcher's interpreter, {sys.executable})"
    )


def rank_sys_path(command: list[str], environ: Mapping[str, str]) -> list[str]:
    """The `sys.path` a rank running `command` (resolved) would start with: its
    script's folder (or the working directory) first, then PYTHONPATH, then what this
    interpreter's site adds, as the launcher's own `sys.path` shows it.

    >>> rank_sys_path([sys.executable, "/jobs/train.py"], {"PYTHONPATH": "/a:/b"})[:3]
    ['/jobs', '/a', '/b']
    """
    first = os.getcwd()
    if len(command) > 1 and command[1].endswith(".py"):
        first = os.path.dirname(os.path.abspath(command[1]))
    ours = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    # This process's own first entry is its script's folder, not a rank's.
    site = [p for p in sys.path[0 if sys.flags.safe_path else 1 :] if p not in ours]
    given = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [first, *given, *site]


def torchft_alias_dir(command: list[str], environ: Mapping[str, str]) -> str:
    """The folder whose `torchft` is `phalanx.torchft`, for --as-torchft; ValueError
    (what to do) if the ranks would find a real torchft as well, which the alias
    itself would refuse in every rank."""
    found = real_torchft(rank_sys_path(command, environ))
    if found is not None:
        raise ValueError(refusal(found))
    return ALIAS_DIR


def job_token(token: str | None, token_file: str | None, environ: Mapping[str, str]) -> str:
    """The job's token: the one given (--token, --token-file, PHALANX_TOKEN,
    PHALANX_TOKEN_FILE), else a new random one, so that no job runs open. ValueError
    (what to fix) for a token given wrong.

    >>> job_token(None, None, {"PHALANX_TOKEN": "given"})
    'given'
    >>> len(job_token(None, None, {})) >= 43
    True
    """
    return resolve_token(token, token_file, environ) or new_token()


def status_page_line(url: str, token: str, terminal: bool) -> str:
    """Where the status page is. The link carries the token where the output is a
    terminal; elsewhere output tends to land in logs that others can read.

    >>> status_page_line("http://127.0.0.1:4000/", "s3cret", terminal=True)
    'status page http://127.0.0.1:4000/?token=s3cret'
    >>> status_page_line("http://127.0.0.1:4000/", "s3cret", terminal=False)
    'status page http://127.0.0.1:4000/?token=JOB_TOKEN (the token is shown on a ...'
    """
    if terminal:
        return f"status page {url}?token={token}"
    return (
        f"status page {url}?token=JOB_TOKEN (the token is shown on a terminal only; "
        "give one with --token-file to know it)"
    )


@dataclass(frozen=True)
class Chaos:
    """Failures injected on purpose: SIGKILL a random live group every `kill_every`
    seconds; SIGSTOP one every `hang_every` seconds and SIGCONT it `hang_for` later;
    every `hang_thread_every` seconds, block the training thread of one rank of a
    random group for `hang_for` while its process lives on (see `phalanx.watchdog`)."""

    kill_every: float | None = None
    hang_every: float | None = None
    hang_for: float = 5.0
    hang_thread_every: float | None = None
    #: How long a thread hang lasts, if not `hang_for` (which a SIGSTOP also uses).
    hang_thread_for: float | None = None

    @property
    def thread_hang_s(self) -> float:
        return self.hang_thread_for if self.hang_thread_for is not None else self.hang_for

    @classmethod
    def parse(cls, specs: list[str]) -> Chaos:
        """
        >>> chaos = Chaos.parse(["kill-every=15s", "hang-every=1m,hang-for=3s"])
        >>> chaos.kill_every, chaos.hang_every, chaos.hang_for, chaos.hang_thread_every
        (15.0, 60.0, 3.0, None)
        >>> Chaos.parse(["hang-thread-every=30s,hang-for=60s"]).hang_thread_every
        30.0
        """
        given: dict[str, float] = {}
        for spec in specs:
            for item in spec.split(","):
                key, sep, value = item.partition("=")
                name = key.strip().replace("-", "_")
                if not sep or name not in (
                    "kill_every",
                    "hang_every",
                    "hang_for",
                    "hang_thread_every",
                    "hang_thread_for",
                ):
                    raise ValueError(
                        f"--chaos {item!r}: use kill-every=DURATION, hang-every=DURATION, "
                        "hang-thread-every=DURATION, hang-for=DURATION or "
                        "hang-thread-for=DURATION"
                    )
                given[name] = parse_duration(value)
        return cls(**given)


@dataclass(frozen=True)
class LaunchConfig:
    """What `phalanx run` is asked to do, checked: the command line's options, typed.

    >>> config = LaunchConfig(command=("python", "train.py"), replicas=2)
    >>> config.replica_ids(), config.chaos.kill_every
    (['group0', 'group1'], None)
    >>> LaunchConfig(command=("train.sh",), replicas=1, replica_id="host7").replica_ids()
    ['host7']
    >>> LaunchConfig(command=())
    Traceback (most recent call last):
    ...
    ValueError: give the training command after --, e.g. -- train.py --lr 0.1
    >>> LaunchConfig(command=("train.sh",), max_restarts=-1)
    Traceback (most recent call last):
    ...
    ValueError: --max-restarts -1: give 0 or more, the failures in a row (without a ...
    """

    #: The training command each rank runs.
    command: tuple[str, ...]
    replicas: int = 1
    nproc_per_replica: int = 1
    #: The lighthouse of a job that spans hosts; None: serve one here.
    lighthouse: str | None = None
    #: Where the lighthouse served here listens, and its options.
    lighthouse_bind: str = "127.0.0.1:0"
    min_replicas: int = 1
    join_timeout: float = 1.0
    heartbeat_timeout: float = 2.0
    rollback_after: float = _core.LIGHTHOUSE_DEFAULTS["rollback_after"]
    #: The group's id; with several replicas, the prefix of their ids.
    replica_id: str | None = None
    #: Failures in a row (without a committed step in between) a group is restarted
    #: after; evictions as stalled are counted apart, against as many (`RestartCount`).
    max_restarts: int = 10
    restart_backoff: float = 0.5
    #: MASTER_ADDR of the ranks: where each group's rank 0 listens.
    master_addr: str = "127.0.0.1"
    chaos: Chaos = field(default_factory=Chaos)
    chaos_seed: int = 0
    fork_server: bool = True
    #: `import torchft` in the ranks is `phalanx.torchft` (`torchft_alias_dir`).
    as_torchft: bool = False

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("give the training command after --, e.g. -- train.py --lr 0.1")
        if self.replicas < 1 or self.nproc_per_replica < 1:
            raise ValueError("--replicas and --nproc-per-replica must be at least 1")
        if self.max_restarts < 0:
            raise ValueError(
                f"--max-restarts {self.max_restarts}: give 0 or more, the failures in a row "
                "(without a committed step) after which a group is given up on; 0: never "
                "restart a failed group"
            )
        if self.restart_backoff < 0:
            raise ValueError(f"--restart-backoff {self.restart_backoff:g}: give 0 or more seconds")

    @classmethod
    def from_args(cls, args: argparse.Namespace, command: list[str]) -> LaunchConfig:
        """The config of parsed `phalanx run` options; ValueError for a bad one."""
        if command and command[0].endswith(".py"):
            command = [sys.executable, *command]
        return cls(
            command=tuple(command),
            replicas=args.replicas,
            nproc_per_replica=args.nproc_per_replica,
            lighthouse=args.lighthouse,
            lighthouse_bind=args.lighthouse_bind,
            min_replicas=args.min_replicas,
            join_timeout=args.join_timeout,
            heartbeat_timeout=args.heartbeat_timeout,
            rollback_after=args.rollback_after,
            replica_id=args.replica_id,
            max_restarts=args.max_restarts,
            restart_backoff=args.restart_backoff,
            master_addr=args.master_addr,
            chaos=Chaos.parse(args.chaos),
            chaos_seed=args.chaos_seed,
            fork_server=args.fork_server,
            as_torchft=args.as_torchft,
        )

    def replica_ids(self) -> list[str]:
        if self.replicas == 1 and self.replica_id:
            return [self.replica_id]
        prefix = self.replica_id or "group"
        return [f"{prefix}{i}" for i in range(self.replicas)]


class LaunchObserver:
    """What a launcher tells whoever watches it; this one prints to stdout, as
    `phalanx run` does. A watcher (the demo) overrides what it wants to see.

    >>> LaunchObserver().say("lighthouse at 127.0.0.1:29510")
    [phalanx run] lighthouse at 127.0.0.1:29510
    """

    def say(self, text: str) -> None:
        """A line of the launcher's own."""
        print(f"[phalanx run] {text}", flush=True)

    def status_page(self, url: str, token: str | None) -> None:
        """Where the embedded lighthouse's status page is."""
        self.say(status_page_line(url, token or "", terminal=sys.stdout.isatty()))

    def rank_line(self, group: Group, rank: int, line: bytes) -> None:
        """A line of a rank's output."""
        sys.stdout.write(f"[{group.replica_id}/{rank}] {line.decode(errors='replace')}\n")
        sys.stdout.flush()

    def group_event(self, kind: str, group: Group) -> None:
        """Called on "start", "kill", "hang", "resume" and "exit" of a group, and on
        "stop" of each group still running when the job ends (just before its ranks
        are told to stop)."""

    def trains(self) -> bool:
        """Whether the job trains yet: the clocks of --chaos and of `run(duration)`
        start then. A watcher that reads its ranks' steps (the demo) says when."""
        return True


@dataclass
class Group:
    """One replica group: its id, its rank processes, and its restart history."""

    replica_id: str
    #: Its place among the launcher's groups: REPLICA_GROUP_ID of its ranks.
    index: int = 0
    procs: list[subprocess.Popen] = field(default_factory=list)
    #: Its failures since it last committed a step, which --max-restarts bounds.
    count: RestartCount = field(default_factory=RestartCount)
    #: Whether it committed a step in this life.
    watch: CommitWatch = field(default_factory=CommitWatch)
    #: Its exits so far, by cause, and the restarts that followed them.
    exits: Counter[Exit] = field(default_factory=Counter)
    restarts: int = 0
    restart_at: float | None = None
    done: bool = False
    given_up: bool = False
    stopped_until: float | None = None
    #: Killed by --chaos: its restart does not count against --max-restarts.
    chaos_killed: bool = False
    #: Until when a training thread of it is blocked by --chaos: its exit as stalled
    #: meanwhile does not count against --max-restarts either.
    chaos_thread_hung_until: float | None = None

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)


@dataclass
class _Output:
    """A child's stdout: whose it is (the fork server's belongs to no group) and the
    part of a line read so far."""

    group: Group | None
    rank: int
    pending: bytearray = field(default_factory=bytearray)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launcher:
    """Runs a job's replica groups as `config` says, telling `observer` what happens."""

    def __init__(
        self, config: LaunchConfig, token: str | None, observer: LaunchObserver | None = None
    ):
        self.config = config
        self.command = list(config.command)
        #: The job token, given or made up (`job_token`): every rank and the embedded
        #: lighthouse get it. None only with --insecure and an outside lighthouse.
        self.token = token
        self.observer = observer or LaunchObserver()
        self.rng = random.Random(config.chaos_seed)
        self.chaos = config.chaos
        self.lighthouse_server: _core.LighthouseServer | None = None
        self.lighthouse = config.lighthouse
        self.groups = [Group(replica_id, i) for i, replica_id in enumerate(config.replica_ids())]
        self.selector = selectors.DefaultSelector()
        self.stopping = False
        self.fork_server: ForkServer | None = None
        self.next_kill: float | None = None
        self.next_hang: float | None = None
        self.next_thread_hang: float | None = None
        #: Asks the lighthouse's status for `look_for_commits`; made at its first look.
        self.status_client: _core.LighthouseClient | None = None
        self.next_sighting = 0.0
        #: What every rank's environment starts from (`_start` makes it).
        self.rank_environ: dict[str, str] = {}

    def say(self, text: str) -> None:
        self.observer.say(text)

    # -- processes ----------------------------------------------------------------

    def _listen(self, stdout, output: _Output) -> None:
        os.set_blocking(stdout.fileno(), False)
        self.selector.register(stdout, selectors.EVENT_READ, output)

    def _spawn(self, env: dict[str, str], output: _Output) -> subprocess.Popen:
        proc = subprocess.Popen(
            self.command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        self._listen(proc.stdout, output)
        return proc

    def _fork(self, env: dict[str, str], output: _Output):
        """A rank forked by the fork server, or None if there is none (any more)."""
        if self.fork_server is None:
            return None
        try:
            rank = self.fork_server.start(self.command, env)
        except ConnectionError as e:
            self.say(f"{e}; ranks start as new processes from now on")
            self.fork_server = None
            return None
        self._listen(rank.stdout, output)
        return rank

    def start_group(self, group: Group) -> None:
        port = _free_port()
        world = self.config.nproc_per_replica
        group.procs = []
        group.watch = CommitWatch()
        for rank in range(world):
            env = {
                **self.rank_environ,
                "REPLICA_GROUP_ID": str(group.index),
                "NUM_REPLICA_GROUPS": str(len(self.groups)),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": self.config.master_addr,
                "MASTER_PORT": str(port),
                "PHALANX_LIGHTHOUSE": self.lighthouse,
                "PHALANX_REPLICA_ID": group.replica_id,
                "PYTHONUNBUFFERED": "1",
            }
            if self.token is not None:
                env["PHALANX_TOKEN"] = self.token
            if self.chaos.hang_thread_every:
                env[watchdog.CHAOS_ENV] = str(self.chaos.thread_hang_s)
            output = _Output(group, rank)
            group.procs.append(self._fork(env, output) or self._spawn(env, output))
        how = "forked" if self.fork_server is not None else "new processes"
        self.say(
            f"started {group.replica_id} ({world} rank(s), {how}, pids "
            f"{', '.join(str(p.pid) for p in group.procs)})"
        )
        self.observer.group_event("start", group)

    def signal_group(self, group: Group, signum: int) -> None:
        for p in group.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)

    def stop_groups(self, groups: list[Group], grace: float = 5.0) -> None:
        """SIGTERM to every rank of `groups` at once (so that none of them is left
        waiting for another in a step), then SIGKILL to those still alive after
        `grace` seconds."""
        for group in groups:
            self.signal_group(group, signal.SIGCONT)
            self.signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in (p for group in groups for p in group.procs):
            while p.poll() is None and time.monotonic() < deadline:
                self.drain(0.05)
            if p.poll() is None:
                p.kill()
                p.wait()
        self.drain()

    # -- output -------------------------------------------------------------------

    def drain(self, timeout: float = 0.0) -> None:
        for key, _ in self.selector.select(timeout):
            output: _Output = key.data
            try:
                chunk = os.read(key.fileobj.fileno(), 65536)
            except BlockingIOError:
                continue
            if chunk:
                output.pending += chunk
                *lines, rest = output.pending.split(b"\n")
                output.pending[:] = rest
            else:  # the child closed its output: flush what is left
                lines = [bytes(output.pending)] if output.pending else []
                self.selector.unregister(key.fileobj)
                key.fileobj.close()
            for line in lines:
                if output.group is None:
                    self.say(f"fork server: {line.decode(errors='replace')}")
                else:
                    self.observer.rank_line(output.group, output.rank, line)

    # -- the loop -----------------------------------------------------------------

    def check_groups(self, now: float) -> None:
        for group in self.groups:
            if group.done or group.given_up:
                continue
            if group.restart_at is not None:
                if now >= group.restart_at:
                    group.restart_at = None
                    self.start_group(group)
                continue
            codes = [p.poll() for p in group.procs]
            if all(c == 0 for c in codes):
                group.done = True
                self.say(f"{group.replica_id} finished")
            elif any(c not in (None, 0) for c in codes):
                self.say(f"{group.replica_id} failed (exit codes {codes}); stopping its ranks")
                self.stop_groups([group])
                self.observer.group_event("exit", group)
                self.after_exit(group, codes, now)

    def after_exit(self, group: Group, codes: list[int | None], now: float) -> None:
        """Restarts a group whose ranks ended, or gives up on it (`RestartCount`)."""
        chaos_hung = group.chaos_thread_hung_until is not None
        cause = Exit.of(codes, chaos_killed=group.chaos_killed, chaos_hung=chaos_hung)
        group.chaos_killed, group.chaos_thread_hung_until = False, None
        group.exits[cause] += 1
        group.count = group.count.after(cause, committed=group.watch.committed)
        limit = self.config.max_restarts
        if cause is Exit.CHAOS:
            why = "killed" if not chaos_hung else "its training thread blocked"
            self.restart(group, self.config.restart_backoff, f"{why} by chaos", now)
        elif group.count.exceeds(limit):
            group.given_up = True
            self.say(
                f"{group.replica_id} gave up after {group.restarts} restart(s): "
                f"{group.count}, over --max-restarts {limit}"
            )
        elif not self.lighthouse_reachable():
            group.given_up = True
            self.say(
                f"not restarting {group.replica_id}: the lighthouse at "
                f"{self.lighthouse} cannot be reached; start it again, then this job"
            )
        else:
            backoff = group.count.backoff(self.config.restart_backoff)
            why = f"{cause.value}: {group.count}, of --max-restarts {limit} each"
            self.restart(group, backoff, why, now)

    def restart(self, group: Group, backoff: float, why: str, now: float) -> None:
        group.restarts += 1
        group.restart_at = now + backoff
        self.say(f"restarting {group.replica_id} in {backoff:.1f} s ({why})")

    def look_for_commits(self, now: float) -> None:
        """Asks the lighthouse how far the live groups that have not committed in
        this life yet have got (`CommitWatch`), every `SIGHTING_EVERY` seconds. Once
        each has, nobody asks: a job that trains costs its lighthouse nothing."""
        watched = [g for g in self.groups if g.alive and not g.watch.committed]
        if not watched or now < self.next_sighting:
            return
        self.next_sighting = now + SIGHTING_EVERY
        try:
            if self.status_client is None:
                self.status_client = _core.LighthouseClient(
                    self.lighthouse, token=self.token, connect_timeout=SIGHTING_TIMEOUT
                )
            status = self.status_client.status(timeout=SIGHTING_TIMEOUT)
        except (OSError, RuntimeError, ValueError):
            # Not now: a lighthouse that is away costs the loop one timeout per
            # SIGHTING_AWAY seconds, not per look. Its groups' failures count meanwhile.
            self.next_sighting = now + SIGHTING_AWAY
            return
        for group in watched:
            seen = group.watch.see(Sighting.of(status, group.replica_id))
            if seen and group.count != RestartCount():
                self.say(
                    f"{group.replica_id} committed a step in this life: --max-restarts counts "
                    f"its failures from 0 again (it had {group.count})"
                )

    def lighthouse_reachable(self) -> bool:
        """Whether the job's lighthouse answers (the embedded one always does): a
        group that failed because it lost its lighthouse is not restarted into the
        same void."""
        if self.lighthouse_server is not None:
            return True
        # A set of lighthouses ("a:p,b:p,c:p") is reachable while any of them answers.
        for address in self.lighthouse.split(","):
            client = _core.LighthouseClient(address, token=self.token, connect_timeout=2.0)
            try:
                client.status(timeout=2.0)
            except (ConnectionError, TimeoutError):
                continue
            except PermissionError:
                pass  # it answers; the token is the ranks' business
            return True
        return False

    def inject(self, now: float) -> None:
        """Injects the failures that are due; the clock starts once the job trains."""
        if self.next_kill is None:
            self.next_kill = now + (self.chaos.kill_every or 0)
            self.next_hang = now + (self.chaos.hang_every or 0)
            self.next_thread_hang = now + (self.chaos.hang_thread_every or 0)
        live = [g for g in self.groups if g.alive and g.stopped_until is None]
        if any(g.done for g in self.groups):
            # The job is ending: a group that is still running may be the last one
            # holding its state, and killing it would start the job over.
            live = []
        if self.chaos.kill_every and now >= self.next_kill:
            self.next_kill = now + self.chaos.kill_every
            if live:
                victim = self.rng.choice(live)
                self.say(f"chaos: SIGKILL {victim.replica_id}")
                victim.chaos_killed = True
                self.signal_group(victim, signal.SIGKILL)
                self.observer.group_event("kill", victim)
        if self.chaos.hang_every and now >= self.next_hang:
            self.next_hang = now + self.chaos.hang_every
            if live:
                victim = self.rng.choice(live)
                victim.stopped_until = now + self.chaos.hang_for
                self.say(f"chaos: SIGSTOP {victim.replica_id} for {self.chaos.hang_for:g} s")
                self.signal_group(victim, signal.SIGSTOP)
                self.observer.group_event("hang", victim)
        # One blocked group at a time: groups that all hang wait on nobody, and none
        # is evicted (that is a stall of the whole job, not of a group).
        blocked = any(
            g.chaos_thread_hung_until is not None and now < g.chaos_thread_hung_until
            for g in self.groups
        )
        if self.chaos.hang_thread_every and now >= (self.next_thread_hang or 0):
            self.next_thread_hang = now + self.chaos.hang_thread_every
            if live and not blocked:
                victim = self.rng.choice(live)
                rank = self.rng.randrange(len(victim.procs))
                self.say(
                    f"chaos: blocking the training thread of {victim.replica_id}/{rank} for "
                    f"{self.chaos.thread_hang_s:g} s"
                )
                victim.chaos_thread_hung_until = now + self.chaos.thread_hang_s
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim.procs[rank].pid, watchdog.CHAOS_SIGNAL)
                self.observer.group_event("hang-thread", victim)
        for group in self.groups:
            if group.stopped_until is not None and now >= group.stopped_until:
                group.stopped_until = None
                self.say(f"chaos: SIGCONT {group.replica_id}")
                self.signal_group(group, signal.SIGCONT)
                self.observer.group_event("resume", group)

    def run(
        self,
        duration: float | None = None,
        chaos_quiet: float = 0.0,
        startup_timeout: float = float("inf"),
    ) -> int:
        """Runs the job until every group finished or gave up, a signal arrives, or
        it trained for `duration` seconds (then every group is stopped; that counts
        as success). No failure is injected in the last `chaos_quiet` seconds. A job
        that does not train within `startup_timeout` seconds is stopped as failed."""
        self._start()
        try:
            timed_out = self._supervise(duration, chaos_quiet, startup_timeout)
        finally:
            self._shut_down()
            self._summarize()
        if self.stopping:
            return 130
        return 0 if timed_out or all(g.done for g in self.groups) else 1

    def _start(self) -> None:
        if not self.lighthouse:
            self.lighthouse_server = _core.LighthouseServer(
                bind=self.config.lighthouse_bind,
                min_replicas=self.config.min_replicas,
                join_timeout=self.config.join_timeout,
                heartbeat_timeout=self.config.heartbeat_timeout,
                rollback_after=self.config.rollback_after,
                token=self.token,
            )
            self.lighthouse = self.lighthouse_server.address
            self.say(f"lighthouse at {self.lighthouse}")
            self.observer.status_page(self.lighthouse_server.status_url, self.token)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        self.command = resolve(self.command)
        # The token reaches the ranks as text; a token file of the launcher's, too.
        self.rank_environ = {k: v for k, v in os.environ.items() if k != "PHALANX_TOKEN_FILE"}
        if self.config.as_torchft:
            alias = torchft_alias_dir(self.command, self.rank_environ)
            given = self.rank_environ.get("PYTHONPATH")
            self.rank_environ["PYTHONPATH"] = os.pathsep.join([alias, *([given] if given else [])])
            self.rank_environ["TORCHFT_LIGHTHOUSE"] = self.lighthouse
            self.say(f"--as-torchft: `import torchft` in the ranks is phalanx.torchft ({alias})")
        forked, why = rank_mode(self.command, self.config.fork_server)
        self.say(f"ranks: {why}")
        if forked:
            # The server's interpreter fixes the sys.path of every rank it forks when
            # it starts: it starts with the ranks' environment.
            self.fork_server = ForkServer(self.rank_environ)
            self._listen(self.fork_server.process.stdout, _Output(None, 0))
        for group in self.groups:
            self.start_group(group)

    def _supervise(
        self, duration: float | None, chaos_quiet: float, startup_timeout: float
    ) -> bool:
        """The launcher's loop; True when it ended because `duration` passed."""
        start = time.monotonic()
        trains_since: float | None = None
        while not self.stopping:
            self.drain(0.1)
            now = time.monotonic()
            if trains_since is None and self.observer.trains():
                trains_since = now
            if trains_since is None and now - start > startup_timeout:
                self.say(f"no group trained within {startup_timeout:g} s; stopping")
                return False
            end = float("inf")
            if duration is not None and trains_since is not None:
                end = trains_since + duration
            if now >= end:
                return True
            self.look_for_commits(now)
            self.check_groups(now)
            if all(g.done or g.given_up for g in self.groups):
                return False
            if trains_since is not None and now < end - chaos_quiet:
                self.inject(now)
        return False

    def _shut_down(self) -> None:
        for group in self.groups:
            if group.alive:
                self.observer.group_event("stop", group)
        self.stop_groups(self.groups)
        if self.fork_server is not None:
            self.fork_server.close()
        if self.lighthouse_server is not None:
            self.lighthouse_server.shutdown()

    def _summarize(self) -> None:
        """A line for each group that exited on the way: its restarts, and why."""
        for group in self.groups:
            if group.exits:
                causes = ", ".join(f"{group.exits[c]} {c.value}" for c in Exit if group.exits[c])
                end = "; given up" if group.given_up else ""
                self.say(f"{group.replica_id}: {group.restarts} restart(s); exits: {causes}{end}")

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.say(f"{signal.Signals(signum).name}: stopping every group")
        self.stopping = True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx run",
        description="Run a fault-tolerant training job: N replica groups of W ranks each.",
        usage="phalanx run [options] -- COMMAND [ARGS...]",
    )
    _add_group_options(parser)
    _add_lighthouse_options(parser)
    _add_access_options(parser)
    _add_rank_options(parser)
    return parser


def _add_group_options(parser: argparse.ArgumentParser) -> None:
    """The groups: how many, how big, their ids, their restarts."""
    parser.add_argument(
        "--replicas", type=int, default=1, metavar="N", help="replica groups to start (default: 1)"
    )
    parser.add_argument(
        "--nproc-per-replica",
        type=int,
        default=1,
        metavar="W",
        help="ranks per group, e.g. one per GPU of the host; each gets LOCAL_RANK (default: 1)",
    )
    parser.add_argument(
        "--lighthouse",
        metavar="HOST:PORT",
        help="join the lighthouse of a job that spans hosts, or a set of them as "
        "HOST:PORT,HOST:PORT,HOST:PORT (default: serve one here)",
    )
    parser.add_argument(
        "--lighthouse-bind",
        metavar="HOST:PORT",
        default="127.0.0.1:0",
        help="where the lighthouse served here listens (default: 127.0.0.1, any free port)",
    )
    parser.add_argument(
        "--replica-id",
        metavar="ID",
        help="the group's id, unique in the job; with --replicas N, the prefix of the "
        "N ids (default: group, giving group0, group1, …)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=10,
        metavar="K",
        help="failures of one group in a row (without a committed step in between) that "
        "it is restarted after; evictions as stalled are counted apart, against as many; "
        "then the launcher gives up on it (default: 10)",
    )
    parser.add_argument(
        "--restart-backoff",
        type=float,
        default=0.5,
        metavar="SECONDS",
        help="wait before a group's first restart, doubled on each next in a row, up to "
        f"{MAX_BACKOFF:g} s (default: 0.5)",
    )


def _add_lighthouse_options(parser: argparse.ArgumentParser) -> None:
    """The lighthouse served here when no --lighthouse is given."""
    defaults = _core.LIGHTHOUSE_DEFAULTS
    parser.add_argument(
        "--min-replicas",
        type=int,
        default=defaults["min_replicas"],
        metavar="N",
        help="fewest groups a step may run with (lighthouse served here; default: "
        f"{defaults['min_replicas']})",
    )
    parser.add_argument(
        "--join-timeout",
        type=parse_duration,
        default=defaults["join_timeout"],
        metavar="DURATION",
        help="how long a quorum waits for a late live group (lighthouse served here; default: "
        f"{defaults['join_timeout']:g}s)",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=parse_duration,
        default=defaults["heartbeat_timeout"],
        metavar="DURATION",
        help="silence after which a group is declared dead (lighthouse served here; default: "
        f"{defaults['heartbeat_timeout']:g}s)",
    )
    parser.add_argument(
        "--rollback-after",
        type=parse_duration,
        default=defaults["rollback_after"],
        metavar="DURATION",
        help="how long the job waits for a group holding its newest state to come back before "
        "it goes on from an older one, as a new lineage (lighthouse served here; default: "
        f"{defaults['rollback_after']:g}s)",
    )


def _add_access_options(parser: argparse.ArgumentParser) -> None:
    """Who may reach the job (its token) and where its groups listen."""
    parser.add_argument(
        "--token",
        help="the job token (default: PHALANX_TOKEN, else a new random one); other "
        "users of this host can see it in the process list: prefer --token-file",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help="read the job token from FILE, readable by its owner only (default: "
        "PHALANX_TOKEN_FILE); `phalanx token FILE` writes one",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="with --lighthouse and no token: run this launcher's groups without one, open "
        "to anyone who can reach them (default: off)",
    )
    parser.add_argument(
        "--master-addr",
        default="127.0.0.1",
        metavar="HOST",
        help="the address this host's groups' rank 0 listens on for its manager server and "
        "rendezvous store: MASTER_ADDR of the ranks (default: 127.0.0.1)",
    )


def _add_rank_options(parser: argparse.ArgumentParser) -> None:
    """How ranks start, and the failures injected on purpose."""
    parser.add_argument(
        "--chaos",
        action="append",
        default=[],
        metavar="SPEC",
        help="inject failures on purpose, e.g. kill-every=15s (SIGKILL a random group), "
        "hang-every=30s,hang-for=5s (SIGSTOP one), hang-thread-every=30s,hang-for=60s "
        "(block one rank's training thread while its process lives: its group is "
        "evicted as stalled and restarted); repeatable (default: none)",
    )
    parser.add_argument(
        "--chaos-seed",
        type=int,
        default=0,
        metavar="SEED",
        help="seed of the chaos' choices (default: 0)",
    )
    parser.add_argument(
        "--fork-server",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fork Python ranks from one interpreter that imported torch once, so a "
        "restarted rank starts at once (default: on, for python scripts and modules)",
    )
    parser.add_argument(
        "--as-torchft",
        action="store_true",
        help="run a script written for torchft unchanged: `import torchft` in the ranks is "
        "phalanx.torchft, and TORCHFT_LIGHTHOUSE is the lighthouse's address; refused if "
        "a real torchft is installed (default: off)",
    )


def main(argv: list[str]) -> int:
    if "--" in argv:
        split = argv.index("--")
        own, command = argv[:split], argv[split + 1 :]
    else:
        own, command = argv, []
    parser = build_parser()
    args = parser.parse_args(own)
    try:
        config = LaunchConfig.from_args(args, command)
        token = resolve_token(args.token, args.token_file, os.environ)
        if config.as_torchft:
            # Said once, here, rather than by every rank as it fails to import torchft.
            torchft_alias_dir(resolve(list(config.command)), os.environ)
    except ValueError as e:
        parser.error(str(e))
    if token is None and config.lighthouse:
        # A job joined through an outside lighthouse has one token, shared by all its
        # launchers: a token made up here would split the job.
        if not args.insecure:
            parser.error(
                f"joining the lighthouse at {config.lighthouse} takes the job's token, the "
                "same for every launcher of the job: --token-file FILE or PHALANX_TOKEN_FILE "
                "(write one with `phalanx token FILE`); --insecure runs this launcher's "
                "groups without one, open to anyone who can reach them"
            )
        print(
            "[phalanx run] --insecure: no job token; anyone who can reach these groups can "
            "read and replace the model",
            flush=True,
        )
    elif token is None:
        token = new_token()
    return Launcher(config, token).run()
