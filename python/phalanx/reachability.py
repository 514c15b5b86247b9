"""How long a rank has gone without reaching any lighthouse: past the lighthouse
timeout it gives up rather than run steps that can never commit. A request that
reached a lighthouse and timed out waiting for its peers is not a lost lighthouse.

>>> from phalanx.settings import Timeouts
>>> reach, timeouts = Reachability("a"), Timeouts.from_budget(30.0, lighthouse=60.0)
>>> reach.failed(ConnectionError("refused"), timeouts, now=100.0)   # counts from 70.0
>>> reach.failed(ConnectionError("refused"), timeouts, now=131.0)
Traceback (most recent call last):
...
phalanx.reachability.LighthouseUnreachableError: replica group 'a' reached no lighthouse ...
>>> reach.failed(TimeoutError("peers late"), timeouts, now=132.0)   # it was reached
"""

from __future__ import annotations

import time

from phalanx.settings import Timeouts


class LighthouseUnreachableError(ConnectionError):
    """No lighthouse answered for longer than the lighthouse timeout: the rank gives
    up rather than run steps that can never commit."""


class Reachability:
    def __init__(self, replica_id: str):
        self._replica_id = replica_id
        #: Since when no quorum request reached a lighthouse (None: the last one did).
        self._unreachable_since: float | None = None

    def reached(self) -> None:
        self._unreachable_since = None

    def failed(self, error: Exception, timeouts: Timeouts, now: float | None = None) -> None:
        """A quorum request failed with `error`; raises LighthouseUnreachableError once
        no lighthouse was reached for longer than the lighthouse timeout."""
        if not isinstance(error, ConnectionError):
            self._unreachable_since = None
            return
        now = time.monotonic() if now is None else now
        if self._unreachable_since is None:
            # The failed request itself waited up to the quorum timeout.
            self._unreachable_since = now - timeouts.quorum
        lost_for = now - self._unreachable_since
        if lost_for > timeouts.lighthouse:
            raise LighthouseUnreachableError(
                f"replica group {self._replica_id!r} reached no lighthouse for {lost_for:.0f} s "
                f"(last error: {error}). Start the lighthouse again on its address (the job "
                "resumes from where it was), or fix PHALANX_LIGHTHOUSE / --lighthouse; raise "
                "lighthouse_timeout= (PHALANX_LIGHTHOUSE_TIMEOUT) to wait longer"
            ) from error
