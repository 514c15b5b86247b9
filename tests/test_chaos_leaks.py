"""A thousand kills leave nothing behind: `phalanx run` of 30 groups whose ranks take
real phalanx steps (a manager server, a heartbeat stream to the embedded lighthouse, a
state server each), one group SIGKILLed every 20 ms, every life forked by the fork
server. After 1,000 kills the launcher (which hosts the lighthouse) and the fork
server hold the open files and threads they held after the first 100, give or take
the lives in flight; once the launcher stops, no process of any life is left."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from test_launcher import alive

from conftest import PROCS, phalanx_run

GROUPS = 30
KILLS = 1000
#: The kills after which the counts are taken first: every group has died and been
#: forked again a few times, so whatever a life or a kill costs once is paid.
WARM = 100
#: What the lives in flight may hold besides: a group's stdout pipe and its streams to
#: the lighthouse, for a few groups more or less than at the first count. A leak of
#: one file per kill would be 900.
SLACK_FILES = 40
SLACK_THREADS = 8
STARTED = re.compile(r"\[phalanx run\] started (\S+) \(\d+ rank\(s\), (\S+), pids ([\d, ]+)\)")


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def fork_server_of(launcher: int) -> int:
    children = subprocess.run(
        ["ps", "-o", "pid=,args=", "--ppid", str(launcher)], capture_output=True, text=True
    ).stdout.splitlines()
    (pid,) = [int(c.split()[0]) for c in children if "forkserver" in c]
    return pid


def counts(launcher: int, fork_server: int) -> dict[str, int]:
    return {
        "launcher files": open_files(launcher),
        "launcher threads": threads(launcher),
        "fork server files": open_files(fork_server),
        "fork server threads": threads(fork_server),
    }


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_a_thousand_kills_leave_no_process_file_or_thread_behind():
    argv = ["--replicas", str(GROUPS), "--restart-backoff", "0", "--chaos", "kill-every=20ms"]
    argv += ["--", sys.executable, str(PROCS / "step_loop.py")]
    kills, pids, ways, taken = 0, set(), set(), {}
    with phalanx_run(*argv) as launcher:
        fork_server = None
        deadline = time.monotonic() + 600
        for line in launcher.stdout:
            assert time.monotonic() < deadline, f"{kills} kills in 600 s"
            if started := STARTED.match(line):
                ways.add(started[2])
                pids |= {int(p) for p in started[3].split(",")}
                fork_server = fork_server or fork_server_of(launcher.pid)
            elif line.startswith("[phalanx run] chaos: SIGKILL"):
                kills += 1
                if kills == WARM:
                    taken["warm"] = counts(launcher.pid, fork_server)
                elif kills == KILLS:
                    taken["end"] = counts(launcher.pid, fork_server)
                    break
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=60)
        assert launcher.returncode == 130, out[-2000:]
    print(taken)

    assert ways == {"forked"}, f"lives started as {ways}"
    # Each kill's group is started again (but for those in the middle of it at the
    # end, and a kill that found its group already dying).
    restarts = len(pids) - GROUPS
    assert restarts >= 0.9 * KILLS, f"{restarts} restarts after {KILLS} kills"
    left = sorted(pid for pid in pids if alive(pid))
    assert not left, f"{len(left)} rank(s) of {len(pids)} outlived the launcher: {left[:10]}"
    warm, end = taken["warm"], taken["end"]
    for what in warm:
        slack = SLACK_FILES if "files" in what else SLACK_THREADS
        assert end[what] <= warm[what] + slack, (
            f"{what}: {warm[what]} after {WARM} kills, {end[what]} after {KILLS}"
        )
