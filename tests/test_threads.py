"""phalanx imported first in a thread that ends, then used from another thread: the
core's allocator keeps per-thread state that must outlive the thread it was made in
(mimalloc 3.3.2 read freed memory there: 20 of 23 such processes segfaulted)."""

from __future__ import annotations

import subprocess
import sys

from conftest import PROCS, child_env

RUNS = 50


def test_phalanx_first_imported_in_a_thread_that_ends_serves_the_next_thread():
    crashed = []
    for _ in range(RUNS):
        done = subprocess.run(
            [sys.executable, str(PROCS / "thread_import.py")],
            capture_output=True,
            text=True,
            timeout=60,
            env=child_env(),
        )
        if done.returncode != 0 or done.stdout.strip() != "ok":
            crashed.append((done.returncode, done.stderr[-500:]))
    assert not crashed, f"{len(crashed)} of {RUNS} processes failed: {crashed[:3]}"
