"""What a rank does when its group is evicted as stalled, and the chaos that stalls it.

A group whose training made no progress while its peers waited on it is evicted by
the lighthouse, which tells the group too. Its training thread is stuck somewhere it
cannot be pulled out of (a kernel, a lock, a C call), so the rank's membership thread
does the rest: it logs what the training thread was doing (which phase, which step),
dumps every thread's Python stack, and ends the process with `EXIT_STALLED`, so that
`phalanx run` restarts the group and it heals like any restarted group. If a thread
holds the GIL forever, the membership thread never runs: then the Rust core, which
heard the eviction too, does the dump and the exit itself (`arm`).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import weakref
from typing import Any

from phalanx import _core, crashes
from phalanx.progress import Progress

log = logging.getLogger("phalanx.watchdog")

#: The exit status of a rank whose group was evicted as stalled (EX_TEMPFAIL: retry).
EXIT_STALLED = 75

#: How long rank 0 of a group of several ranks stays after its dump: it hosts the
#: manager server, which relays the eviction to the group's other ranks, so that
#: they too can log their stacks before the launcher stops them.
RELAY_GRACE_S = 1.0

#: `phalanx run --chaos hang-thread-every=…` sends this signal to one rank: its
#: default action is to do nothing, so a process that did not install the chaos
#: handler (yet) is left alone.
CHAOS_SIGNAL = signal.SIGURG

#: Set by `phalanx run` on every rank when its chaos blocks training threads: for how
#: many seconds the chaos signal blocks the training thread.
CHAOS_ENV = "PHALANX_CHAOS_HANG_THREAD_FOR"


#: If a rank still lives this long after its group's eviction, its interpreter is
#: frozen (a thread holds the GIL): the Rust core dumps the stacks and ends it.
FROZEN_GRACE_S = 5.0

#: The signal on which faulthandler dumps every thread's stack without the GIL, for
#: that last resort (a real-time signal, which nothing else here uses).
DUMP_SIGNAL = signal.SIGRTMIN + 6

#: The ranks (Managers) this process hosts: one, in a job.
_ranks: weakref.WeakSet = weakref.WeakSet()


#: The last rank this process hosted: (replica id, group rank, its step then).
_last: tuple[str, int, int] | None = None


def hosts(rank: Any) -> None:
    """This process hosts `rank` (a Manager) until it is shut down or gone; an
    exception that ends the process names the rank's step (`phalanx.crashes`)."""
    _ranks.add(rank)
    if getattr(sys.excepthook, "__name__", "") != _uncaught.__name__:
        _uncaught.previous = sys.excepthook  # type: ignore[attr-defined]
        sys.excepthook = _uncaught


def left(rank: Any) -> None:
    global _last
    _ranks.discard(rank)
    _last = (rank.replica_id, rank.group_rank, rank.current_step())


def _uncaught(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    """After the traceback, one line per rank (or the last one, if the exception
    shut it down on its way out) that `phalanx run` reads as what the life died of."""
    _uncaught.previous(kind, value, tb)  # type: ignore[attr-defined]
    if issubclass(kind, KeyboardInterrupt):
        return
    ranks = [(r.replica_id, r.group_rank, r.current_step()) for r in list(_ranks)]
    for replica_id, group_rank, step in ranks or ([_last] if _last else []):
        line = crashes.marker(replica_id, group_rank, step, kind.__name__, str(value))
        print(line, file=sys.stderr, flush=True)


def arm(client: _core.ManagerClient, replica_id: str) -> None:
    """Arms the last resort for a frozen interpreter: `evicted()` cannot run while
    another thread holds the GIL, so the core watches for the eviction too."""
    try:
        stderr = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by one without a descriptor
        stderr = 2
    faulthandler.register(DUMP_SIGNAL, file=stderr, all_threads=True)
    client.arm_eviction_exit(
        replica_id, grace=FROZEN_GRACE_S, status=EXIT_STALLED, dump_signal=DUMP_SIGNAL
    )


def evicted(progress: Progress, replica_id: str, quorum_id: int, *, relays: bool = False) -> None:
    """Logs the evidence and ends the process. A process that hosts the ranks of
    several groups (a test, a simulation) is not ended, since that would end the
    other groups too (I5): the rank goes on, and its group asks to join again."""
    log.error(
        "replica group %r was evicted from quorum %d: its training made no progress for "
        "its stall timeout (%g s) while its peers waited on it. The training thread of "
        "group rank %d was last at: %s. "
        "Stacks of every thread follow; exiting with status %d so that the group is "
        "restarted and heals",
        replica_id,
        quorum_id,
        progress.stall_timeout,
        progress.group_rank,
        progress.describe(),
        EXIT_STALLED,
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    if len(_ranks) > 1:
        log.error("this process hosts %d ranks: it is not ended", len(_ranks))
        return
    if relays:
        time.sleep(RELAY_GRACE_S)
    os._exit(EXIT_STALLED)


def install_chaos(progress: Progress) -> bool:
    """Blocks the training thread for `$PHALANX_CHAOS_HANG_THREAD_FOR` seconds on each
    `CHAOS_SIGNAL`, while the process and its other threads live on; only when the
    launcher asked for it, and only from the main thread (which signal handlers run
    on, and which is the training thread of `phalanx run`'s ranks)."""
    text = os.environ.get(CHAOS_ENV)
    if not text or threading.current_thread() is not threading.main_thread():
        return False
    seconds = float(text)

    def hang(_signum: int, _frame: object) -> None:
        log.warning("chaos: blocking the training thread for %g s", seconds)
        with progress.frozen(f"blocked by chaos for {seconds:g} s ({progress.doing})"):
            threading.Event().wait(seconds)
        log.warning("chaos: the training thread goes on")

    signal.signal(CHAOS_SIGNAL, hang)
    return True
