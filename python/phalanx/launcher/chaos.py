"""--chaos: the failures `phalanx run` injects on purpose, and when and where they
fall (`Injector`)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
from dataclasses import dataclass

from phalanx import _core, watchdog
from phalanx.launcher.group import Group
from phalanx.launcher.observer import LaunchObserver


@dataclass(frozen=True)
class Chaos:
    """Failures injected on purpose: SIGKILL a random live group every `kill_every`
    seconds; SIGSTOP one every `hang_every` seconds and SIGCONT it `hang_for` later;
    every `hang_thread_every` seconds, block the training thread of one rank of a
    random group for `hang_for` while its process lives on (see `phalanx.watchdog`);
    every `kill_all_every` seconds, SIGKILL every rank of every group at once (the loss
    of the whole job: with durable snapshots it resumes from the newest)."""

    kill_every: float | None = None
    hang_every: float | None = None
    hang_for: float = 5.0
    hang_thread_every: float | None = None
    #: How long a thread hang lasts, if not `hang_for` (which a SIGSTOP also uses).
    hang_thread_for: float | None = None
    kill_all_every: float | None = None

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
        >>> Chaos.parse(["kill-all-every=1m"]).kill_all_every
        60.0
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
                    "kill_all_every",
                ):
                    raise ValueError(
                        f"--chaos {item!r}: use kill-every=DURATION, hang-every=DURATION, "
                        "hang-thread-every=DURATION, hang-for=DURATION, "
                        "hang-thread-for=DURATION or kill-all-every=DURATION"
                    )
                given[name] = _core.parse_duration(value)
        return cls(**given)


def _next(due: float, every: float, now: float) -> float:
    """The time after `due` of a failure every `every` seconds, as clocked from the
    first: a loop a little late does not slow the rate down. One that fell more than
    a period behind (the launcher was busy stopping a group) starts the clock again
    rather than fire the failures it owes in a burst.

    >>> _next(10.0, 0.5, now=10.1), _next(10.0, 0.5, now=12.0)
    (10.5, 12.5)
    """
    following = due + every
    return following if following > now else now + every


class Injector:
    """Where and when the failures of `chaos` fall: on live groups drawn at random
    from `seed`, each kind on its own clock."""

    def __init__(self, chaos: Chaos, seed: int, observer: LaunchObserver):
        self.chaos = chaos
        self.rng = random.Random(seed)
        self.observer = observer
        self.next_kill: float | None = None
        self.next_hang: float | None = None
        self.next_thread_hang: float | None = None
        self.next_kill_all: float | None = None

    def inject(self, now: float, groups: list[Group]) -> None:
        """Injects into `groups` the failures that are due; the clocks start at the
        first call, which the launcher makes once the job trains."""
        if self.next_kill is None:
            self.next_kill = now + (self.chaos.kill_every or 0)
            self.next_hang = now + (self.chaos.hang_every or 0)
            self.next_thread_hang = now + (self.chaos.hang_thread_every or 0)
            self.next_kill_all = now + (self.chaos.kill_all_every or 0)
        live = [g for g in groups if g.alive and g.stopped_until is None]
        if any(g.done for g in groups):
            # The job is ending: a group that is still running may be the last one
            # holding its state, and killing it would start the job over.
            live = []
        if self.chaos.kill_all_every and now >= (self.next_kill_all or 0):
            self.next_kill_all = now + self.chaos.kill_all_every
            # Hung groups die too; none if the job is ending (see `live`).
            if any(g.alive for g in groups) and not any(g.done for g in groups):
                self.kill_all(groups)
                self.resume_due(now, groups)
                return
        if self.chaos.kill_every and now >= self.next_kill:
            self.next_kill = _next(self.next_kill, self.chaos.kill_every, now)
            if live:
                victim = self.rng.choice(live)
                self.observer.say(f"chaos: SIGKILL {victim.replica_id}")
                victim.chaos_killed = True
                victim.signal(signal.SIGKILL)
                self.observer.group_event("kill", victim)
        if self.chaos.hang_every and now >= self.next_hang:
            self.next_hang = _next(self.next_hang, self.chaos.hang_every, now)
            if live:
                victim = self.rng.choice(live)
                victim.stopped_until = now + self.chaos.hang_for
                self.observer.say(
                    f"chaos: SIGSTOP {victim.replica_id} for {self.chaos.hang_for:g} s"
                )
                victim.signal(signal.SIGSTOP)
                self.observer.group_event("hang", victim)
        # One blocked group at a time: groups that all hang wait on nobody, and none
        # is evicted (that is a stall of the whole job, not of a group).
        blocked = any(
            g.chaos_thread_hung_until is not None and now < g.chaos_thread_hung_until
            for g in groups
        )
        if self.chaos.hang_thread_every and now >= (self.next_thread_hang or 0):
            self.next_thread_hang = now + self.chaos.hang_thread_every
            if live and not blocked:
                victim = self.rng.choice(live)
                rank = self.rng.randrange(len(victim.procs))
                self.observer.say(
                    f"chaos: blocking the training thread of {victim.replica_id}/{rank} for "
                    f"{self.chaos.thread_hang_s:g} s"
                )
                victim.chaos_thread_hung_until = now + self.chaos.thread_hang_s
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim.procs[rank].pid, watchdog.CHAOS_SIGNAL)
                self.observer.group_event("hang-thread", victim)
        self.resume_due(now, groups)

    def next_due(self, groups: list[Group]) -> float | None:
        """When the next failure, or SIGCONT of one of `groups`, is due (None: none is
        scheduled, or the clocks have not started): the launcher's loop wakes for it,
        so that a failure every 20 ms comes every 20 ms."""
        times = [
            self.next_kill if self.chaos.kill_every else None,
            self.next_hang if self.chaos.hang_every else None,
            self.next_thread_hang if self.chaos.hang_thread_every else None,
            self.next_kill_all if self.chaos.kill_all_every else None,
            *(g.stopped_until for g in groups),
        ]
        return min((t for t in times if t is not None), default=None)

    def resume_due(self, now: float, groups: list[Group]) -> None:
        """SIGCONT to each group whose SIGSTOP has lasted its `hang_for`."""
        for group in groups:
            if group.stopped_until is not None and now >= group.stopped_until:
                group.stopped_until = None
                self.observer.say(f"chaos: SIGCONT {group.replica_id}")
                group.signal(signal.SIGCONT)
                self.observer.group_event("resume", group)

    def kill_all(self, groups: list[Group]) -> None:
        """SIGKILL to every rank of every running group, hung ones included, before
        any is reaped: no group outlives another to hold the job's state."""
        victims = [g for g in groups if g.alive]
        self.observer.say(
            "chaos: SIGKILL every group at once (" + ", ".join(g.replica_id for g in victims) + ")"
        )
        for victim in victims:
            victim.chaos_killed = True
            victim.stopped_until = None  # its SIGCONT is moot: the process is gone
            victim.chaos_thread_hung_until = None
            victim.signal(signal.SIGKILL)
        for victim in victims:
            self.observer.group_event("kill-all", victim)
