"""Which state a rank holds: its lineage, its step *and* the quorum that committed
that step, and whether a heal left it torn. Pure: the Manager moves it through
commits and heals.

A state is named by its step and the quorum that committed it: a group that committed
a step in a quorum its peers went on without holds another state under the same
number, and heals. A job that had to go back to an older state (every group holding
its newest one was gone) goes on as a new lineage, so that a step number names one
state within a lineage; a state of an older lineage heals whatever its step. A heal
that fails part way leaves the state torn: the rank goes back to the identity it had
before the heal, marked torn, and heals again before it trains; the ranks of a group
agree on that through their vote.

>>> held = HeldState()
>>> held.committed(quorum_id=3, lineage=0); (held.step, held.state_quorum_id)
(1, 3)
>>> held.begin_heal(); held.tear()                 # the heal failed part way
True
>>> (held.step, held.state_quorum_id, held.torn)
(1, 3, True)
>>> held.begin_heal(); held.healed(step=9, state_quorum_id=5, lineage=4)
>>> (held.step, held.lineage, held.torn)
(9, 4, False)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HeldState:
    #: Committed steps so far (after a heal: the peers' step).
    step: int = 0
    #: The quorum that committed `step` (0 before the first commit).
    state_quorum_id: int = 0
    #: A heal failed part way: the state is unusable until a heal succeeds.
    torn: bool = False
    #: The lineage `step` belongs to (0: the job's first).
    lineage: int = 0
    #: The identity before this step's heal, restored if the group's heal failed.
    before_heal: tuple[int, int, int] | None = None
    #: The state was read from storage (a snapshot, a checkpoint), not kept live: steps
    #: after it may have been committed, so the quorum that goes on from it starts a
    #: new lineage. Cleared once a quorum takes it as the job's state.
    from_storage: bool = False

    def resumed(self, step: int) -> None:
        """A state loaded from a checkpoint of `step`: no quorum committed it in this
        job, so any live state of that step wins over it."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"a checkpoint's step is a count of steps, not {step!r}")
        self.step, self.state_quorum_id, self.torn = step, 0, False
        self.from_storage = True

    def restored(self, step: int, state_quorum_id: int, lineage: int) -> None:
        """The state of a snapshot: committed in this job as `step` of quorum
        `state_quorum_id`, lineage `lineage`, so it enters the quorum as that state
        (any live state newer than it wins)."""
        self.step, self.state_quorum_id, self.lineage, self.torn = (
            step,
            state_quorum_id,
            lineage,
            False,
        )
        self.from_storage = True

    def new_step(self) -> None:
        self.before_heal = None

    @property
    def healing(self) -> bool:
        """Whether this step began a heal (whatever came of it)."""
        return self.before_heal is not None

    def begin_heal(self) -> None:
        self.before_heal = (self.step, self.state_quorum_id, self.lineage)

    def healed(self, step: int, state_quorum_id: int, lineage: int) -> None:
        self.step, self.state_quorum_id, self.torn = step, state_quorum_id, False
        self.lineage, self.from_storage = lineage, False

    def tear(self) -> bool:
        """The group's heal failed on some rank: this rank's state is torn, back at
        the identity it held before. True when it was not torn before."""
        if self.before_heal is not None:
            self.step, self.state_quorum_id, self.lineage = self.before_heal
            self.before_heal = None
        newly = not self.torn
        self.torn = True
        return newly

    def committed(self, quorum_id: int, lineage: int) -> None:
        self.step += 1
        self.state_quorum_id, self.lineage, self.from_storage = quorum_id, lineage, False

    def goes_on_as(self, lineage: int) -> None:
        """This state is the job's in a quorum of `lineage`: the start of a new
        lineage, when the job went back to it (or resumed from storage)."""
        self.lineage, self.from_storage = lineage, False
