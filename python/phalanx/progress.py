"""What a rank's training thread is doing, and whether it still moves.

A heartbeat proves that a process lives, not that it trains: a kernel that never
returns, a deadlocked data loader or a C call holding the GIL leave the heartbeat
beating. So liveness is progress. The Manager marks each phase of a step (quorum
asked, state served or fetched, collective launched and finished, vote cast), and a
reporter thread beside the training thread looks at the training thread's Python stack
a few times a second: a stack that moved is progress too, so a long forward pass or a
slow step never looks hung. A thread inside a wait on the other groups (a collective,
the quorum, the vote, a heal) is not hung either until that wait's own deadline has
passed.

The reporter sends the count of marks and moves to the group's manager server, which
sums up the group's ranks for its heartbeat; the lighthouse evicts a member of the
quorum that made no progress for its stall timeout while a peer waits on it (for at
least half that long). A rank
whose interpreter is frozen (the GIL held) stops reporting, which reads as no progress.

>>> reports = []
>>> progress = Progress(lambda *a: reports.append(a), group_rank=0, stall_timeout=10.0)
>>> progress.mark("asked for the quorum of step 3")
>>> with progress.waiting("all-reduce #1 of step 3", timeout=5.0):
...     progress.doing
'waiting: all-reduce #1 of step 3'
>>> progress.report_now()
>>> rank, marks, wait_left, stall_timeout, step_time = reports[-1]
>>> (rank, wait_left, stall_timeout)
(0, None, 10.0)
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger("phalanx.progress")

#: `report(group_rank, marks, wait_left, stall_timeout, step_time)`; see
#: `_core.ManagerClient.report_progress`.
Report = Callable[[int, int, "float | None", float, float], None]


class Progress:
    """The progress of one rank's training thread (the thread that last called
    `bind()`, else the one that made this object)."""

    def __init__(
        self,
        report: Report,
        *,
        group_rank: int,
        stall_timeout: float,
        interval: float = 0.1,
    ):
        self._report = report
        self.group_rank = group_rank
        self.stall_timeout = stall_timeout
        self.interval = interval
        self._thread = threading.get_ident()
        #: Phases reached, by the training thread; moves of its stack, by the reporter.
        self._marks = 0
        self._moves = 0
        self._last_frame: tuple[int, int] | None = None
        #: What the thread does now, and since when (monotonic seconds).
        self.doing = "starting"
        self.since = time.monotonic()
        #: The wait on the other groups it is in: its deadline (monotonic seconds).
        self._wait_deadline: float | None = None
        self._step_began: float | None = None
        self._waited = 0.0
        self.step_time = 0.0
        self._stop = threading.Event()
        self._reporter: threading.Thread | None = None

    # -- the training thread --------------------------------------------------------

    def bind(self) -> None:
        """The calling thread is the training thread from now on."""
        self._thread = threading.get_ident()

    def mark(self, doing: str) -> None:
        """The training thread reached a phase of the step."""
        self._marks += 1
        self.doing = doing
        self.since = time.monotonic()

    def step_began(self, step: int) -> None:
        """A new step starts: the last one's own work was its time less its waits."""
        now = time.monotonic()
        if self._step_began is not None:
            self.step_time = max(0.0, now - self._step_began - self._waited)
        self._step_began = now
        self._waited = 0.0
        self.mark(f"starting step {step}")

    @contextmanager
    def waiting(self, doing: str, timeout: float) -> Iterator[None]:
        """The training thread waits on the other groups, for at most `timeout`
        seconds: it counts as moving until then, for as long as this reporter
        reports (a frozen interpreter ages from its last report)."""
        outer = (self.doing, self._wait_deadline)
        self.mark(f"waiting: {doing}")
        started = time.monotonic()
        self._wait_deadline = started + timeout
        try:
            yield
        finally:
            self._wait_deadline = outer[1]
            if outer[1] is None:
                self._waited += time.monotonic() - started
            self.mark(f"working, after: {doing}" if outer[1] is None else outer[0])

    @contextmanager
    def frozen(self, doing: str) -> Iterator[None]:
        """The training thread is stuck on purpose (chaos): no wait excuses it."""
        outer = self._wait_deadline
        self._wait_deadline = None
        self.mark(doing)
        try:
            yield
        finally:
            self._wait_deadline = outer

    def describe(self) -> str:
        """What the training thread was doing, and for how long: for the log of a
        rank evicted as stalled."""
        return f"{self.doing} (for {time.monotonic() - self.since:.1f} s)"

    # -- the reporter ---------------------------------------------------------------

    def start(self) -> None:
        """Starts the reporter thread (idempotent)."""
        if self._reporter is None:
            self._reporter = threading.Thread(
                target=self._run, name="phalanx-progress", daemon=True
            )
            self._reporter.start()

    def stop(self) -> None:
        """Stops the reporter thread and waits for its report in flight."""
        self._stop.set()
        reporter = self._reporter
        if reporter is not None and reporter is not threading.current_thread():
            reporter.join(timeout=2 * self.interval + 1.0)

    def wait_left(self) -> float | None:
        """Seconds left of the wait on the other groups the training thread is in;
        None: it is in none."""
        if self._wait_deadline is None:
            return None
        return max(0.0, self._wait_deadline - time.monotonic())

    def report_now(self) -> None:
        """Looks at the training thread once and reports."""
        self._look()
        self._report(
            self.group_rank,
            self._marks + self._moves,
            self.wait_left(),
            self.stall_timeout,
            self.step_time,
        )

    def _look(self) -> None:
        """Counts a move when the training thread's innermost frame is elsewhere than
        at the last look: running Python code is progress, a thread blocked in one
        call is not."""
        frame = sys._current_frames().get(self._thread)
        if frame is None:
            return
        where = (id(frame), frame.f_lasti)
        if where != self._last_frame:
            self._last_frame = where
            self._moves += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.report_now()
            except (ConnectionError, TimeoutError, OSError, ValueError) as e:
                # The manager server is away (restarting group, shutting down): the
                # heartbeat says so on its own.
                log.debug("progress report failed: %s", e)
