"""Every process of a group's life is reached by the launcher's signals: torchrun's
workers (sessions of their own), a shell's program left behind as an orphan, and
whatever a rank leaves when the job ends."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.launcher.tree import LIFE_VARIABLE, members, signal_life

from conftest import TESTS, child_env

#: Starts a child in a session of its own (as torchrun starts its workers) and, with
#: --orphan, a process whose parent exits at once; prints their pids, then waits.
TREE = """
import os, subprocess, sys, time
sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
worker = subprocess.Popen(sleeper, start_new_session=True)
pids = [worker.pid]
if "--orphan" in sys.argv:
    middle = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys; p = subprocess.Popen(sys.argv[1:]); print(p.pid)", *sleeper],
        stdout=subprocess.PIPE, text=True,
    )
    pids.append(int(middle.stdout.readline()))
    middle.wait()
print(" ".join(map(str, pids)), flush=True)
time.sleep(120)
"""


def gone(pid: int) -> bool:
    """Exited (a zombie not yet reaped by its new parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(gone(p) for p in pids):
        time.sleep(0.02)
    return [p for p in pids if not gone(p)]


def test_members_are_the_roots_their_descendants_and_the_marked():
    parents = {2: 1, 3: 2, 4: 3, 5: 1, 6: 5, 7: 1}
    assert members([2], parents, marked=()) == {2, 3, 4}
    assert members([2], parents, marked=[5]) == {2, 3, 4, 5, 6}
    assert members([], parents, marked=[7]) == {7}
    assert members([9], {}, marked=()) == {9}, "a root the table no longer has is kept"


@pytest.fixture
def tree(tmp_path: Path):
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    started: list[subprocess.Popen] = []

    def start(*flags: str, mark: str = "life-1") -> tuple[subprocess.Popen, list[int]]:
        proc = subprocess.Popen(
            [sys.executable, str(script), *flags],
            stdout=subprocess.PIPE,
            text=True,
            env={**child_env(), LIFE_VARIABLE: mark},
        )
        started.append(proc)
        return proc, [int(p) for p in proc.stdout.readline().split()]

    yield start
    for proc in started:
        signal_life([proc.pid], "life-1", signal.SIGKILL)
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_sigkill_reaches_a_child_in_its_own_session_and_an_orphan(tree):
    rank, (worker, orphan) = tree("--orphan")
    other, (bystander,) = tree(mark="life-2")  # another life: untouched

    signalled = signal_life([rank.pid], "life-1", signal.SIGKILL)

    assert {rank.pid, worker, orphan} <= signalled
    assert rank.wait(timeout=10) == -signal.SIGKILL
    assert wait_gone([worker, orphan]) == []
    assert not gone(bystander) and other.poll() is None
    signal_life([other.pid], "life-2", signal.SIGKILL)
    assert wait_gone([bystander]) == []


def test_sigstop_and_sigcont_reach_the_whole_life(tree):
    rank, (worker,) = tree()

    signal_life([rank.pid], "life-1", signal.SIGSTOP)
    deadline = time.monotonic() + 10
    state = ""
    while time.monotonic() < deadline and state != "T":
        with open(f"/proc/{worker}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    assert state == "T", "the worker in its own session was not stopped"
    signal_life([rank.pid], "life-1", signal.SIGCONT)
    signal_life([rank.pid], "life-1", signal.SIGKILL)
    assert wait_gone([worker]) == []


# Slow: torchrun starts in about 5 s.
@pytest.mark.slow
def test_killing_torchrun_kills_its_workers(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(120)\n")
    torchrun = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            "0",
            str(worker),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**child_env(), LIFE_VARIABLE: "torchrun-life"},
    )
    try:
        workers = [int(torchrun.stdout.readline()) for _ in range(2)]
        signal_life([torchrun.pid], "torchrun-life", signal.SIGKILL)
        assert torchrun.wait(timeout=10) == -signal.SIGKILL
        assert wait_gone(workers) == []
    finally:
        torchrun.kill()
        torchrun.wait()
        torchrun.stdout.close()


def test_the_launcher_leaves_no_process_of_a_rank_behind(tmp_path):
    """A rank that ends (here at once) after starting a process in a session of its
    own: the job's end ends that process too."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],"
        " start_new_session=True)\n"
        "print('left', p.pid, flush=True)\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "phalanx",
            "run",
            "--replicas",
            "2",
            "--",
            sys.executable,
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=90,
        env=child_env(),
        cwd=TESTS.parent,
        stdin=subprocess.DEVNULL,
    )

    assert done.returncode == 0, done.stdout + done.stderr
    left = [int(line.split()[-1]) for line in done.stdout.splitlines() if " left " in line]
    assert len(left) == 2, done.stdout
    assert wait_gone(left, timeout=5) == [], f"left behind: {left}"
