"""What `phalanx run` tells whoever watches it: printed lines by default, or a
watcher's own (the demo's)."""

from __future__ import annotations

import sys

from phalanx.crashes import CrashLoop
from phalanx.launcher.group import Group


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
        """Called on "start", "kill", "kill-all" (every group at once, one call each),
        "hang", "resume" and "exit" of a group, and on
        "stop" of each group still running when the job ends (just before its ranks
        are told to stop)."""

    def crash_loop(self, group: Group, loop: CrashLoop) -> None:
        """`group`'s last lives all died of one exception (`phalanx.crashes`)."""

    def finished(self) -> bool:
        """Whether the watcher has seen what it wanted (the demo's --steps): the
        launcher then stops every group, as at the end of `run(duration)`."""
        return False

    def trains(self) -> bool:
        """Whether the job trains yet: the clocks of --chaos and of `run(duration)`
        start then. A watcher that reads its ranks' steps (the demo) says when."""
        return True
