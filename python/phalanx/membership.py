"""The membership watcher: hears from the lighthouse (through the group's manager
server) that members of a quorum died, or from the manager server itself that the
heartbeat stream that held the quorum's lease ended (a lighthouse killed, restarted or
cut off: no step of that quorum can commit any more), and aborts the step in flight
when the loss concerns that step's quorum, so its collectives end at once instead of
at their deadline.

The watcher and the training thread agree under one lock on which step a loss
concerns: the step in flight once its quorum is known, or, for a loss heard before
that, any quorum up to the highest one reported broken. The lock guards exactly that:
the step in flight, its quorum id, and the highest broken quorum id.

>>> from concurrent.futures import Future
>>> from phalanx.step import Step
>>> book = LossBook()
>>> book.heard(quorum_id=4)
>>> step = Step(0, Future())
>>> book.admit(step, quorum_id=4), book.admit(step, quorum_id=5)
(False, True)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from phalanx import _core
from phalanx.step import Step

#: How long one wait for an event lasts: the longest `stop()` waits for the thread.
POLL_S = 0.2
#: The cause of the event a group's manager sends its own ranks when its heartbeat
#: stream ends (`rust/src/manager/heartbeat.rs`): the leases of the quorums that
#: stream carried end with it, so their steps can never commit.
LIGHTHOUSE_LOST = "lighthouse_lost"
#: The cause of a group that ended its run (its manager server stopped in order): it
#: voted on its last step before it stopped, so its part of that step's collectives was
#: sent; neither the step in flight nor its quorum is given up for it (had it stopped
#: mid-step, its closed connections fail the step's collectives by themselves).
LEFT = "left"


class EventSource(Protocol):
    def next_event(self, timeout: float = 0.0) -> _core.MembershipLost | None: ...


class LossBook:
    """What the watcher knows, without the thread: the step in flight and the highest
    quorum id a loss was heard for. Every method takes the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._step: Step | None = None
        self._broken_quorum_id = -1

    def follow(self, step: Step) -> None:
        """`step` is now the step in flight; its quorum is not known yet."""
        with self._lock:
            self._step = step

    def admit(self, step: Step, quorum_id: int) -> bool:
        """Records that `step` runs in quorum `quorum_id`; False when a member of that
        quorum was reported dead already (the lighthouse told before the answer came)."""
        with self._lock:
            step.quorum_id = quorum_id
            return quorum_id > self._broken_quorum_id

    def heard(self, quorum_id: int) -> Step | None:
        """Records a loss in quorum `quorum_id`; the step in flight if it concerns it."""
        with self._lock:
            self._broken_quorum_id = max(self._broken_quorum_id, quorum_id)
            step = self._step
            return step if step is not None and step.quorum_id == quorum_id else None


class MembershipWatcher:
    """A thread that reads membership-loss events and aborts the step they concern.
    `stop()` ends and joins it."""

    def __init__(
        self,
        events: EventSource,
        book: LossBook,
        heard: Callable[[_core.MembershipLost], None] | None = None,
    ):
        self._events = events
        self._book = book
        #: Told of every loss first (the group's own eviction included).
        self._heard = heard
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phalanx-membership", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2 * POLL_S) -> None:
        self._stopping.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                event = self._events.next_event(timeout=POLL_S)
            except (ConnectionError, TimeoutError):
                self._stopping.wait(0.1)
                continue
            if event is None or self._stopping.is_set():
                continue
            if self._heard is not None:
                self._heard(event)
            if event.cause == LEFT:
                continue
            step = self._book.heard(event.quorum_id)
            if step is not None:
                # Fails the collectives still in flight (their result would lack the
                # dead group's part, or wait on a group cut off with the lighthouse);
                # ones that completed before it stand.
                step.abort.set(why_aborted(event))


def why_aborted(event: _core.MembershipLost) -> str:
    """The reason a step of the event's quorum fails.

    >>> from types import SimpleNamespace as Event
    >>> why_aborted(Event(quorum_id=4, lost=["b"], cause="stream_broken"))
    'replica group(s) b died (stream_broken)'
    >>> why_aborted(Event(quorum_id=4, lost=[], cause=LIGHTHOUSE_LOST))
    'quorum 4 can no longer commit: the heartbeat stream that held its lease ended (...)'
    """
    if event.cause == LIGHTHOUSE_LOST:
        return (
            f"quorum {event.quorum_id} can no longer commit: the heartbeat stream that "
            f"held its lease ended ({event.cause})"
        )
    return f"replica group(s) {', '.join(event.lost)} died ({event.cause})"
