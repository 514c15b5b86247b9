"""The launcher's loop: it starts each replica group's ranks, relays their output,
restarts a group that fails (or gives up on it), and stops them all at the end."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

from phalanx import _core, watchdog
from phalanx.crashes import CrashReader
from phalanx.forkserver import ForkServer, die_with_parent
from phalanx.launcher.chaos import Chaos, Injector
from phalanx.launcher.config import LaunchConfig
from phalanx.launcher.group import Group
from phalanx.launcher.observer import LaunchObserver
from phalanx.launcher.ranks import rank_mode, resolve, torchft_alias_dir
from phalanx.launcher.restarts import (
    SIGHTING_AWAY,
    SIGHTING_EVERY,
    SIGHTING_TIMEOUT,
    CommitWatch,
    Exit,
    RestartCount,
    Sighting,
)
from phalanx.launcher.tree import LIFE_VARIABLE


@dataclass
class _Output:
    """A child's stdout: whose it is (the fork server's belongs to no group) and the
    part of a line read so far."""

    group: Group | None
    rank: int
    pending: bytearray = field(default_factory=bytearray)
    reader: CrashReader | None = None


def _free_ports(n: int) -> list[int]:
    """`n` distinct ports free now (held open together while they are picked)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


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
        self.chaos = config.chaos
        self.injector = Injector(config.chaos, config.chaos_seed, self.observer)
        self.lighthouse_server: _core.LighthouseServer | None = None
        self.lighthouse = config.lighthouse
        self.groups = [Group(replica_id, i) for i, replica_id in enumerate(config.replica_ids())]
        self.selector = selectors.DefaultSelector()
        self.stopping = False
        self.fork_server: ForkServer | None = None
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
        # Nothing of the last life outlives it: a rank that died may leave its own
        # children (torchrun's workers, a shell's program) behind.
        group.signal(signal.SIGKILL)
        # MASTER_PORT is left to the program's own torch (init_process_group() hosts
        # its store there, as under torchrun); phalanx's manager has a port of its own.
        port, manager_port = _free_ports(2)
        world = self.config.nproc_per_replica
        group.life = f"{os.getpid()}:{group.replica_id}:{port}"
        group.procs = []
        group.readers = []
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
                "PHALANX_STORE_PORT": str(manager_port),
                "PHALANX_LIGHTHOUSE": self.lighthouse,
                "PHALANX_REPLICA_ID": group.replica_id,
                "PYTHONUNBUFFERED": "1",
                LIFE_VARIABLE: group.life,
            }
            if self.token is not None:
                env["PHALANX_TOKEN"] = self.token
            if self.chaos.hang_thread_every:
                env[watchdog.CHAOS_ENV] = str(self.chaos.thread_hang_s)
            output = _Output(group, rank, reader=CrashReader())
            group.readers.append(output.reader)
            group.procs.append(self._fork(env, output) or self._spawn(env, output))
        how = "forked" if self.fork_server is not None else "new processes"
        self.say(
            f"started {group.replica_id} ({world} rank(s), {how}, pids "
            f"{', '.join(str(p.pid) for p in group.procs)})"
        )
        self.observer.group_event("start", group)

    def signal_group(self, group: Group, signum: int) -> None:
        group.signal(signum)

    def stop_groups(self, groups: list[Group], grace: float = 5.0) -> None:
        """SIGTERM to every process of `groups` at once (so that none of them is
        left waiting for another in a step), then SIGKILL to whatever of each life
        is left after `grace` seconds (`phalanx.launcher.tree`)."""
        for group in groups:
            self.signal_group(group, signal.SIGCONT)
            self.signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in (p for group in groups for p in group.procs):
            while p.poll() is None and time.monotonic() < deadline:
                self.drain(0.05)
        for group in groups:
            self.signal_group(group, signal.SIGKILL)  # what is left of each life
        for p in (p for group in groups for p in group.procs):
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
                    continue
                if output.reader is not None:
                    output.reader.feed(line.decode(errors="replace"))
                self.observer.rank_line(output.group, output.rank, line)
                if b"ROLLBACK: " in line:
                    self.explain_rollback()

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
        if (loop := group.ended(cause, committed=group.watch.committed)) is not None:
            self.say(f"{group.replica_id} is in a {loop}: fix the training script")
            self.observer.crash_loop(group, loop)
        group.count = group.count.after(cause, committed=group.watch.committed)
        limit = self.config.max_restarts
        if cause is Exit.CHAOS:
            why = "killed" if not chaos_hung else "its training thread blocked"
            self.restart(group, self.config.restart_backoff, f"{why} by chaos", now)
        elif group.count.exceeds(limit):
            group.given_up = True
            loop = f"; {group.crash_loop}" if group.crash_loop is not None else ""
            self.say(
                f"{group.replica_id} gave up after {group.restarts} restart(s): "
                f"{group.count}, over --max-restarts {limit}{loop}"
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

    def explain_rollback(self) -> None:
        """A rank announced a rollback: the groups in a crash loop are why no holder of
        the newest state could come back, if any are."""
        looping = [g for g in self.groups if g.crash_loop is not None]
        if looping:
            named = "; ".join(f"{g.replica_id}: {g.crash_loop}" for g in looping)
            self.say(
                "the rollback above: every restarted group that could have healed to the "
                f"newest state crashed first ({named})"
            )

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
                    self.lighthouse,
                    token=self.token,
                    connect_timeout=SIGHTING_TIMEOUT,
                    job=self.config.job,
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
            client = _core.LighthouseClient(
                address, token=self.token, connect_timeout=2.0, job=self.config.job
            )
            try:
                client.status(timeout=2.0)
            except (ConnectionError, TimeoutError):
                continue
            except (PermissionError, ValueError):
                pass  # it answers; the token, or a job it has forgotten, is the ranks' business
            return True
        return False

    def set_chaos(self, chaos: Chaos) -> None:
        """Injects `chaos` from now on (a watcher that paces its failures by the job's
        own step time sets them once it knows it); its clocks start at the next look."""
        self.chaos = self.injector.chaos = chaos

    def inject(self, now: float) -> None:
        """Injects the failures that are due; the clock starts once the job trains."""
        self.injector.inject(now, self.groups)

    def run(
        self,
        duration: float | None = None,
        chaos_quiet: float = 0.0,
        startup_timeout: float = float("inf"),
    ) -> int:
        """Runs the job until every group finished or gave up, a signal arrives, or
        it trained for `duration` seconds or its watcher has seen enough (then every
        group is stopped; that counts as success). No failure is injected in the last
        `chaos_quiet` seconds. A job that does not train within `startup_timeout`
        seconds is stopped as failed."""
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
        self.rank_environ.update(self.config.rank_environ())
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
            self.drain(self._wait(time.monotonic()))
            now = time.monotonic()
            if trains_since is None and self.observer.trains():
                trains_since = now
            if trains_since is None and now - start > startup_timeout:
                self.say(f"no group trained within {startup_timeout:g} s; stopping")
                return False
            end = float("inf")
            if duration is not None and trains_since is not None:
                end = trains_since + duration
            if now >= end or self.observer.finished():
                return True
            self.look_for_commits(now)
            self.check_groups(now)
            if all(g.done or g.given_up for g in self.groups):
                return False
            if trains_since is not None and now < end - chaos_quiet:
                self.inject(now)
        return False

    def _wait(self, now: float) -> float:
        """How long the loop may wait for output: a tenth of a second, less when a
        failure of the chaos is due sooner."""
        due = self.injector.next_due(self.groups)
        return 0.1 if due is None else min(0.1, max(0.0, due - now))

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
                if group.crash_loop is not None:
                    end += f"; {group.crash_loop}"
                self.say(f"{group.replica_id}: {group.restarts} restart(s); exits: {causes}{end}")

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.say(f"{signal.Signals(signum).name}: stopping every group")
        self.stopping = True
