"""The step in flight: one object per step of a rank's transaction, made by
`Manager.start_quorum()` and replaced by the next one, so that nothing of a step (its
failure, its abort, its quorum, its collectives) is carried into the next.

>>> from concurrent.futures import Future
>>> step = Step(7, Future())
>>> step.fail("group b died"), step.fail("a later reason")
(True, False)
>>> step.ok, step.failure, step.record.step
(False, 'group b died', 7)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from phalanx import _core
from phalanx.process_group import Abort, CollectiveFailed, Pending

if TYPE_CHECKING:
    from phalanx.healing import Received

log = logging.getLogger("phalanx.manager")

#: How long a collective that failed on its own (a peer's connection broke) waits for
#: the lighthouse to say which group died, for the failure message: a crash is known
#: to the survivors in tens of milliseconds.
EXPLAIN_WAIT_S = 0.25


class Asked(Protocol):
    """A quorum asked for in the background (`_core.PendingQuorum`, or any future)."""

    def result(self) -> _core.QuorumResult: ...


@dataclass
class StepRecord:
    """What one step of this rank did, for the step log: its outcome and where the
    training thread waited (seconds)."""

    step: int
    quorum_id: int | None = None
    #: The lineage the step ran in (see `phalanx.identity`).
    lineage: int = 0
    participants: int = 0
    committed: bool = False
    healed: bool = False
    quorum_s: float = 0.0
    allreduce_s: float = 0.0
    commit_s: float = 0.0
    heal_s: float = 0.0
    #: Tensor bytes this step's heal fetched.
    heal_bytes: int = 0
    #: The time the step's start spent copying a snapshot to host memory.
    snapshot_s: float = 0.0
    #: The time this step spent loading a snapshot (a cold resume).
    resume_s: float = 0.0
    failure: str | None = None


class Step:
    """One step of this rank, from `start_quorum()` to `should_commit()`.

    `failure` may be set from several threads (the training thread, autograd hooks,
    collective callbacks): the first reason wins, under the step's lock. The
    membership watcher reads `quorum_id` under its own lock (see
    `phalanx.membership`).
    """

    def __init__(
        self,
        number: int,
        quorum: Asked,
        previous: _core.QuorumResult | None = None,
    ):
        self.number = number
        self.record = StepRecord(step=number)
        self.abort = Abort()
        #: A collective or the rendezvous with the other groups failed (see
        #: `phalanx.peers`: unless the lighthouse named a dead group, a cut?).
        self.peers_unreached = False
        self.quorum_future = quorum
        #: The quorum, once the training thread took it (None: none, or not yet).
        self.quorum: _core.QuorumResult | None = None
        self.resolved = False
        #: The last step's quorum, which the Manager reports until this one is taken.
        self.previous_quorum = previous
        #: The step's quorum id as the membership watcher matches losses against it.
        self.quorum_id: int | None = None
        #: This rank's heal failed: it still joins the collectives (with zeros).
        self.heal_failed = False
        #: A heal's state fetched while an autograd graph may hold the registered
        #: tensors, loaded at the vote (`phalanx.healing.load_staged`).
        self.staged: Received | None = None
        self.handles: list[Handle] = []
        self._failure: str | None = None
        self._lock = threading.Lock()

    @property
    def known_quorum(self) -> _core.QuorumResult | None:
        """This step's quorum once taken (None if it failed); before that, the last
        step's: what a training loop reads between `start_quorum()` and its first
        collective."""
        return self.quorum if self.resolved else self.previous_quorum

    def fail(self, reason: str) -> bool:
        """Marks the step failed; False when it had failed already."""
        with self._lock:
            if self._failure is not None:
                return False
            self._failure = reason
            return True

    @property
    def failure(self) -> str | None:
        return self._failure

    @property
    def ok(self) -> bool:
        return self._failure is None

    @property
    def joins_collectives(self) -> bool:
        """Whether this rank takes part in the step's collectives: while the step can
        commit, and (with zeros) after a failed heal, so its peers are not kept waiting."""
        return self.ok or self.heal_failed

    def explain(self, failure: CollectiveFailed) -> str:
        """Why a collective failed, in phalanx's words. A peer's crash breaks its
        connections a moment before the lighthouse says who died: wait that moment for
        the lighthouse's word, else name the quorum and keep the backend's first line."""
        if not failure.from_backend:
            return str(failure)
        told = threading.Event()
        if self.abort.wake_on_abort(told) or told.wait(EXPLAIN_WAIT_S):
            return self.abort.reason or str(failure)
        detail = str(failure.__cause__ or failure).strip().splitlines()[0][:160]
        return (
            f"the all-reduce of quorum {self.quorum_id} failed: a replica group in it is "
            f"gone or unreachable ({detail})"
        )

    def finish_collectives(self) -> None:
        """Waits for every all-reduce the step started (each has its deadline)."""
        handles, self.handles = self.handles, []
        for handle in handles:
            handle.wait()


class Handle:
    """A started all-reduce. `wait()` finishes it (average, then `then`), or leaves the
    tensor as it is when the step failed; it never raises."""

    def __init__(
        self,
        step: Step,
        pending: Pending | None,
        tensor: torch.Tensor,
        divisor: int,
        then: Callable[[torch.Tensor], None] | None,
        on_failure: Callable[[str], None],
        waiting: Callable[[], AbstractContextManager[object]] = nullcontext,
    ):
        self._step = step
        self._waiting = waiting
        self._pending = pending
        self._tensor = tensor
        self._divisor = divisor
        self._then = then
        self._on_failure = on_failure
        self._done = False
        step.handles.append(self)

    def wait(self) -> bool:
        """True when the tensor now holds the average over the participants."""
        if self._done:
            return self._step.ok
        self._done = True
        if self._pending is None:
            return False
        started = time.monotonic()
        try:
            with self._waiting():
                self._pending.wait()
        except CollectiveFailed as e:
            self._step.peers_unreached = True
            self._on_failure(self._step.explain(e))
            return False
        finally:
            self._step.record.allreduce_s += time.monotonic() - started
        if self._divisor > 1:
            self._tensor.div_(self._divisor)
        if self._then is not None:
            self._then(self._tensor)
        return self._step.ok


#: The least time a vote cast again gets: enough to fetch a decision already taken.
MIN_REVOTE_S = 0.5


@dataclass(frozen=True)
class Decision:
    """The group's decision on a step: it commits; some rank is torn; the group
    snapshots the state it commits."""

    commit: bool
    torn: bool
    snapshot: bool = False


def cast_vote(
    client: _core.ManagerClient,
    group_rank: int,
    step: int,
    vote: bool,
    *,
    quorum_id: int,
    torn: bool,
    timeout: float,
    snapshot: bool = False,
) -> Decision:
    """Casts this rank's vote (`snapshot`: asking for a snapshot of the step); returns
    the group's decision. A vote whose answer was lost is cast once more, within what
    is left of `timeout`: the manager server answers a step it decided with that
    decision, so this rank cannot miss a commit its peers applied."""
    deadline = time.monotonic() + timeout

    def cast(seconds: float) -> Decision:
        d = client.should_commit(
            group_rank, step, vote, seconds, quorum_id=quorum_id, torn=torn, snapshot=snapshot
        )
        return Decision(d.commit, d.torn, d.snapshot)

    try:
        return cast(timeout)
    except (TimeoutError, ConnectionError) as e:
        log.warning("commit vote of step %d: %s; voting again", step, e)
        return cast(max(deadline - time.monotonic(), MIN_REVOTE_S))
