"""How many times `phalanx run` restarts a failing group: --max-restarts failures in a
row, where a group seen committing a step since its last start begins again from a
full budget (`RestartCount`, `CommitWatch`). Pure: the launcher brings the facts (its
ranks' exit codes, looks at the lighthouse's status).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from phalanx import _core, watchdog


class Exit(enum.Enum):
    """Why a group's ranks ended, as far as --max-restarts cares."""

    #: A failure of the group's own: a crash, a kill from outside, a non-zero exit.
    FAILED = "failed"
    #: Evicted by the lighthouse as stalled (a rank exited `watchdog.EXIT_STALLED`),
    #: often because of another group that everybody waited on.
    STALLED = "evicted as stalled"
    #: Injected by --chaos: never counted.
    CHAOS = "by chaos"

    @classmethod
    def of(cls, codes: list[int | None], *, chaos_killed: bool, chaos_hung: bool) -> Exit:
        """The cause of a failed group's exit, from its ranks' exit codes so far.

        >>> Exit.of([1, None], chaos_killed=False, chaos_hung=False)
        <Exit.FAILED: 'failed'>
        >>> Exit.of([75], chaos_killed=False, chaos_hung=False)
        <Exit.STALLED: 'evicted as stalled'>
        >>> Exit.of([75], chaos_killed=False, chaos_hung=True)
        <Exit.CHAOS: 'by chaos'>
        """
        stalled = watchdog.EXIT_STALLED in codes
        if chaos_killed or (stalled and chaos_hung):
            return cls.CHAOS
        return cls.STALLED if stalled else cls.FAILED


#: The longest wait before a restart, however many failures came in a row.
MAX_BACKOFF = 10.0
#: How often the launcher looks at the lighthouse's status for a group that has not
#: committed in its life yet (`CommitWatch`); how long one look may take; how long it
#: waits after a look that got no answer.
SIGHTING_EVERY = 0.5
SIGHTING_TIMEOUT = 1.0
SIGHTING_AWAY = 5.0


@dataclass(frozen=True)
class RestartCount:
    """A group's failures since it last committed a step: what --max-restarts bounds.

    A group that trained since its last (re)start failed for a new reason, if any: it
    starts from a full budget, and from the first backoff, again. Evictions as stalled
    are counted apart, with a budget of their own: the group the lighthouse evicts is
    often not the one at fault (it waited on another), so an eviction does not use up
    the budget of the group's own failures, but a group evicted again and again
    without a commit in between is stuck all the same.

    >>> count = RestartCount().after(Exit.FAILED, committed=False)
    >>> count = count.after(Exit.STALLED, committed=False)
    >>> count, count.exceeds(max_restarts=1), count.backoff(first=0.5)
    (RestartCount(failed=1, stalled=1), False, 1.0)
    >>> count.after(Exit.FAILED, committed=False).exceeds(max_restarts=1)
    True
    >>> count.after(Exit.FAILED, committed=True)  # it trained in between
    RestartCount(failed=1, stalled=0)
    """

    failed: int = 0
    stalled: int = 0

    def after(self, cause: Exit, committed: bool) -> RestartCount:
        """The count once the group exited for `cause`; `committed`: it committed a
        step in the life that just ended."""
        count = RestartCount() if committed else self
        return RestartCount(
            failed=count.failed + (cause is Exit.FAILED),
            stalled=count.stalled + (cause is Exit.STALLED),
        )

    def exceeds(self, max_restarts: int) -> bool:
        """Whether the group is given up on: more failures, or more evictions as
        stalled, in a row than --max-restarts allows."""
        return max(self.failed, self.stalled) > max_restarts

    def backoff(self, first: float) -> float:
        """The wait before the next restart: `first`, doubled for each exit in a row
        after the first, up to `MAX_BACKOFF`."""
        in_a_row = self.failed + self.stalled
        return min(MAX_BACKOFF, first * 2 ** max(0, in_a_row - 1))

    def __str__(self) -> str:
        """
        >>> print(RestartCount(failed=1, stalled=2))
        1 failure and 2 evictions as stalled in a row
        """
        failures = "failure" if self.failed == 1 else "failures"
        evictions = "eviction" if self.stalled == 1 else "evictions"
        return f"{self.failed} {failures} and {self.stalled} {evictions} as stalled in a row"


@dataclass(frozen=True)
class Sighting:
    """A group as one look at the lighthouse's status shows it."""

    #: Where its heartbeat stream comes from (empty: unknown). Each life of a group
    #: opens its own, so a status that still shows the life before is told apart.
    stream: str
    in_quorum: bool
    #: The step it asked its last quorum with.
    step: int
    #: The highest step among the other live members of the current quorum (None:
    #: it has none).
    peers_step: int | None = None

    @classmethod
    def of(cls, status: _core.LighthouseStatus, replica_id: str) -> Sighting | None:
        """`replica_id` in `status`; None when the lighthouse knows no live group of
        that id."""
        steps = {r.replica_id: r.step for r in status.replicas}
        me = next((r for r in status.replicas if r.replica_id == replica_id), None)
        if me is None:
            return None
        peers = [steps[m] for m in status.quorum_members if m != replica_id and m in steps]
        return cls(me.peer, me.in_quorum, me.step, max(peers, default=None))

    @property
    def level(self) -> bool:
        """A member of the current quorum with no peer ahead of it: where a heal
        brings a group, and from where only its own commits move it on."""
        ahead = self.peers_step is not None and self.peers_step > self.step
        return bool(self.stream) and self.in_quorum and not ahead


@dataclass
class CommitWatch:
    """Whether a group committed a step in its current life, from the lighthouse's
    status taken now and then (`see`).

    Why the lighthouse, and not the step records ranks may print: a training script
    need print nothing, and what it prints is its own; but every group that trains
    with phalanx asks the lighthouse for its quorums, with its step, whatever the
    script prints. That step grows in two ways: by a commit, or by a heal, which
    jumps to the step of the peers the group fetched its state from. A heal brings a
    group level with its peers, never past them; so a group is seen committing when
    it stands level with its peers in two looks of the same life and its step grew
    in between. A look in which it is behind, or outside the quorum, or on another
    heartbeat stream (the life before; a new lighthouse), starts over.

    A group that commits and fails between two looks is not seen (its failure
    counts, as it would have anyway); one that falls behind its peers, heals, and is
    level again between two looks passes for one that committed: it has rejoined the
    job at its newest state, which is all a restart is for.

    >>> watch = CommitWatch()
    >>> watch.see(Sighting("10.0.0.3:5041", in_quorum=True, step=0, peers_step=120))
    False
    >>> watch.see(Sighting("10.0.0.3:5041", in_quorum=True, step=120, peers_step=120))
    False
    >>> watch.see(Sighting("10.0.0.3:5041", in_quorum=True, step=127, peers_step=127))
    True
    >>> watch.committed
    True
    """

    #: (stream, step) of the last look in which it stood level with its peers.
    level_at: tuple[str, int] | None = None
    committed: bool = False

    def see(self, sighting: Sighting | None) -> bool:
        """Takes one look; True when it is the first to show a commit."""
        if self.committed:
            return False
        if sighting is None or not sighting.level:
            self.level_at = None
            return False
        was, self.level_at = self.level_at, (sighting.stream, sighting.step)
        self.committed = was is not None and was[0] == sighting.stream and sighting.step > was[1]
        return self.committed
