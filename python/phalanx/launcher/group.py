"""One replica group as `phalanx run` sees it: its ranks, and its restart history."""

from __future__ import annotations

import subprocess
from collections import Counter
from dataclasses import dataclass, field

from phalanx.crashes import Crash, CrashLoop, CrashReader
from phalanx.launcher.restarts import CommitWatch, Exit, RestartCount
from phalanx.launcher.tree import signal_life


@dataclass
class Group:
    """One replica group: its id, its rank processes, and its restart history."""

    replica_id: str
    #: Its place among the launcher's groups: REPLICA_GROUP_ID of its ranks.
    index: int = 0
    procs: list[subprocess.Popen] = field(default_factory=list)
    #: The mark of this life's processes (`phalanx.launcher.tree`); "": none.
    life: str = ""
    #: Its failures since it last committed a step, which --max-restarts bounds.
    count: RestartCount = field(default_factory=RestartCount)
    #: Whether it committed a step in this life.
    watch: CommitWatch = field(default_factory=CommitWatch)
    #: Its exits so far, by cause, and the restarts that followed them.
    exits: Counter[Exit] = field(default_factory=Counter)
    restarts: int = 0
    restart_at: float | None = None
    done: bool = False
    given_up: bool = False
    stopped_until: float | None = None
    #: Killed by --chaos: its restart does not count against --max-restarts.
    chaos_killed: bool = False
    #: Until when a training thread of it is blocked by --chaos: its exit as stalled
    #: meanwhile does not count against --max-restarts either.
    chaos_thread_hung_until: float | None = None
    #: What each rank of this life printed of a crash.
    readers: list[CrashReader] = field(default_factory=list)
    #: What its failed lives since it last committed died of (None: unknown, or an
    #: eviction as stalled), oldest first; and the crash loop they end in, if any.
    crashes: list[Crash | None] = field(default_factory=list)
    crash_loop: CrashLoop | None = None

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def ended(self, cause: Exit, committed: bool) -> CrashLoop | None:
        """Adds what this life died of to its crashes (`committed`: it committed a
        step, which starts them afresh); returns a crash loop newly found."""
        if committed:
            self.crashes, self.crash_loop = [], None
        if cause is Exit.CHAOS:
            return None
        found = next((r.crash for r in self.readers if r.crash is not None), None)
        self.crashes.append(found if cause is Exit.FAILED else None)
        loop, was = CrashLoop.of(self.crashes), self.crash_loop
        self.crash_loop = loop
        if loop is None or (was is not None and was.crash.same(loop.crash)):
            return None
        return loop

    def signal(self, signum: int) -> None:
        """Sends `signum` to every process of this life: its ranks still running and
        whatever they started (torchrun's workers included), orphans too."""
        signal_life([p.pid for p in self.procs if p.poll() is None], self.life, signum)
