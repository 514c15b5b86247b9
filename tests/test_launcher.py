"""`phalanx run`: real rank processes, real signals."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

import phalanx
from phalanx.launcher.chaos import Chaos
from phalanx.launcher.config import LaunchConfig, build_parser
from phalanx.launcher.observer import LaunchObserver
from phalanx.launcher.ranks import rank_mode, resolve
from phalanx.launcher.restarts import MAX_BACKOFF, CommitWatch, Exit, RestartCount, Sighting
from phalanx.launcher.supervisor import Launcher

from conftest import PROCS, TESTS, child_env, http_get, phalanx_run, write_token_file

RANK = str(PROCS / "launched_rank.py")


def launch(*args: str, timeout: float = 60.0, env: dict | None = None):
    return subprocess.run(
        [sys.executable, "-m", "phalanx", "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or child_env(),
        cwd=TESTS.parent,
    )


def path_with(folder, **programs: str) -> str:
    """A PATH whose first folder holds `programs` (name -> the file it links to)."""
    folder.mkdir()
    for name, target in programs.items():
        (folder / name).symlink_to(target)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


def reports(stdout: str) -> list[tuple[str, dict]]:
    """(prefix, json) of every line a rank printed."""
    out = []
    for line in stdout.splitlines():
        prefix, _, rest = line.partition(" ")
        if prefix.startswith("[") and rest.startswith("{"):
            out.append((prefix, json.loads(rest)))
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_every_rank_gets_its_environment_and_a_prefixed_output():
    done = launch("--replicas", "2", "--nproc-per-replica", "2", "--", RANK, "0.2", "0")

    assert done.returncode == 0, done.stdout + done.stderr
    seen = reports(done.stdout)
    assert sorted(prefix for prefix, _ in seen) == [
        "[group0/0]",
        "[group0/1]",
        "[group1/0]",
        "[group1/1]",
    ]
    for prefix, env in seen:
        group, rank = prefix.strip("[]").split("/")
        assert env["PHALANX_REPLICA_ID"] == group
        assert env["RANK"] == env["LOCAL_RANK"] == rank
        assert env["WORLD_SIZE"] == "2"
        assert env["PHALANX_LIGHTHOUSE"].startswith("127.0.0.1:")
    ports = {env["PHALANX_REPLICA_ID"]: env["MASTER_PORT"] for _, env in seen}
    assert ports["group0"] != ports["group1"], "each group has its own store"


@contextlib.contextmanager
def two_groups_running() -> Iterator[subprocess.Popen]:
    """`phalanx run --replicas 2` of ranks that report and sleep a minute; killed at
    the end of the block if it still runs."""
    with phalanx_run("--replicas", "2", "--", RANK, "60", "0") as launcher:
        yield launcher


def test_without_a_token_given_every_rank_gets_a_new_one_its_lighthouse_requires():
    with two_groups_running() as launcher:
        seen: list[dict] = []
        lines: list[str] = []
        deadline = time.monotonic() + 30
        while len(seen) < 2:
            assert time.monotonic() < deadline, "".join(lines)
            lines.append(launcher.stdout.readline())
            seen += [env for _, env in reports(lines[-1])]
        tokens = {env["PHALANX_TOKEN"] for env in seen}
        assert len(tokens) == 1 and len(token := tokens.pop()) >= 43, "one random job token"
        # Not a terminal: the launcher's status page line leaves the token out.
        own = [line for line in lines if line.startswith("[phalanx run]")]
        assert any("status page http://" in line for line in own), lines
        assert not any(token in line for line in own)
        lighthouse = seen[0]["PHALANX_LIGHTHOUSE"]
        with pytest.raises(PermissionError, match="missing or wrong job token"):
            phalanx.LighthouseClient(lighthouse).status(timeout=2.0)
        status = phalanx.LighthouseClient(lighthouse, token=token).status(timeout=2.0)
        assert status.heartbeat_timeout_ms > 0
        # The link a terminal is shown opens the status page.
        assert http_get(f"http://{lighthouse}/?token={token}")[0] == 200
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(15) == 130


@pytest.mark.slow
def test_a_token_file_reaches_the_ranks_as_the_token(tmp_path):
    path = write_token_file(tmp_path / "job.token", "from-a-file\n")
    env = {**child_env(), "PHALANX_TOKEN_FILE": str(path)}

    done = launch("--", RANK, "0", "0", env=env)

    assert done.returncode == 0, done.stdout + done.stderr
    [(_, rank)] = reports(done.stdout)
    assert rank["PHALANX_TOKEN"] == "from-a-file"
    assert rank["PHALANX_TOKEN_FILE"] is None, "the rank gets the token, not the file"


@pytest.mark.parametrize(
    ("text", "mode", "flags", "expected"),
    [
        ("s3cret", 0o644, [], "has mode 0644: users other than its owner"),
        ("\n", 0o600, [], "is empty"),
        ("s3cret", 0o600, ["--token", "t"], "both --token and --token-file are given"),
    ],
)
def test_a_token_file_that_should_not_be_trusted_stops_the_launcher(
    tmp_path, text, mode, flags, expected
):
    path = write_token_file(tmp_path / "job.token", text, mode)

    done = launch("--token-file", str(path), *flags, "--", RANK, "0", "0")

    assert done.returncode == 2
    assert expected in done.stderr
    if mode != 0o600:
        assert f"chmod 600 {path}" in done.stderr
    assert not reports(done.stdout), "no rank started"


def test_without_a_token_a_launcher_does_not_join_an_outside_lighthouse():
    # A token made up by one launcher would split a job of several launchers.
    with phalanx.LighthouseServer() as lighthouse:
        done = launch("--lighthouse", lighthouse.address, "--", RANK, "0", "0")

    assert done.returncode == 2
    assert f"joining the lighthouse at {lighthouse.address} takes the job's token" in done.stderr
    assert "--token-file FILE" in done.stderr
    assert not reports(done.stdout), "no rank started"


@pytest.mark.slow
def test_insecure_joins_an_open_lighthouse_without_a_token_and_says_so():
    with phalanx.LighthouseServer() as lighthouse:
        done = launch("--lighthouse", lighthouse.address, "--insecure", "--", RANK, "0", "0")

    assert done.returncode == 0, done.stdout + done.stderr
    assert "--insecure: no job token" in done.stdout
    [(_, rank)] = reports(done.stdout)
    assert rank["PHALANX_TOKEN"] is None


def test_a_failing_group_is_restarted_with_backoff_then_given_up():
    done = launch("--max-restarts", "2", "--restart-backoff", "0.05", "--", RANK, "0", "3")

    assert done.returncode == 1
    assert len(reports(done.stdout)) == 3, "the first run and two restarts"
    assert "restarting group0 in 0.1 s (failed: 2 failures and 0 evictions" in done.stdout
    assert "gave up after 2 restart(s): 3 failures and 0 evictions" in done.stdout
    assert "group0: 2 restart(s); exits: 3 failed; given up" in done.stdout, "the summary"


def test_a_group_that_crashes_the_same_way_in_every_life_is_named_a_crash_loop():
    script = str(PROCS / "crash_after_start.py")
    done = launch("--max-restarts", "3", "--restart-backoff", "0.05", "--", script, "--at", "0")

    assert done.returncode == 1
    crash = "RuntimeError: the loss is nan at step 0 (a bug in the script) (at step 0)"
    loop = f"crash loop: 3 lives in a row ended by {crash}"
    assert f"group0 is in a {loop}: fix the training script" in done.stdout, done.stdout
    assert done.stdout.count(f"is in a {loop}") == 1, "named once, not at every life"
    assert "crash loop: 4 lives in a row" in done.stdout, "the give-up line and the summary"
    assert "; given up; crash loop: 4 lives in a row ended by RuntimeError" in done.stdout


@pytest.mark.slow
def test_evictions_as_stalled_are_counted_apart_from_failures():
    # A rank that exits as the watchdog does when the lighthouse evicts its group.
    done = launch("--max-restarts", "1", "--restart-backoff", "0.05", "--", RANK, "0", "75")

    assert done.returncode == 1
    assert "restarting group0 in 0.1 s (evicted as stalled: 0 failures and 1 eviction" in (
        done.stdout
    )
    assert "gave up after 1 restart(s): 0 failures and 2 evictions as stalled" in done.stdout
    assert "group0: 1 restart(s); exits: 2 evicted as stalled; given up" in done.stdout


def test_a_negative_max_restarts_is_refused_saying_what_it_means():
    done = launch("--max-restarts", "-1", "--", RANK, "0", "0")

    assert done.returncode == 2
    assert "--max-restarts -1: give 0 or more, the failures in a row" in done.stderr
    assert not reports(done.stdout), "no rank started"


#: A training script that trains a tiny model with phalanx and prints nothing, as a
#: user's may: the launcher must learn from the lighthouse that its group commits.
QUIET_TRAIN = """
import time

import torch
from torch import nn

import phalanx

model = nn.Linear(4, 1)
manager = phalanx.Manager(timeout=10.0)
ddp = phalanx.DistributedDataParallel(model, manager)
optimizer = phalanx.Optimizer(manager, torch.optim.SGD(model.parameters(), lr=0.01))
while True:
    optimizer.zero_grad()
    ddp(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    time.sleep(0.02)
"""


@pytest.mark.slow
def test_a_group_that_commits_between_its_failures_gets_its_restarts_back(tmp_path):
    script = tmp_path / "quiet_train.py"
    script.write_text(QUIET_TRAIN)
    run = ["--replicas", "2", "--max-restarts", "1", "--restart-backoff", "0.2", "--", str(script)]
    with phalanx_run(*run) as launcher:
        lines: list[str] = []
        deadline = time.monotonic() + 90

        def wait_for(text: str) -> str:
            """The next line of the launcher's that holds `text`."""
            while True:
                assert time.monotonic() < deadline, "".join(lines)
                line = launcher.stdout.readline()
                assert line, "phalanx run ended first:\n" + "".join(lines)
                lines.append(line)
                if text in line:
                    return line

        def life_of_group0(commits: bool) -> None:
            """Waits for group0 to start (and, if `commits`, for the launcher to see it
            commit a step), then kills its rank."""
            pid = int(wait_for("started group0 (").rsplit("pids ", 1)[1].rstrip(")\n"))
            if commits:
                wait_for("group0 committed a step in this life")
            os.kill(pid, signal.SIGKILL)

        life_of_group0(commits=False)
        assert "(failed: 1 failure and 0 evictions" in wait_for("restarting group0")
        # Twice more than --max-restarts 1 allows in all: each life committed, so each
        # failure is the first in a row again, and its backoff the first.
        for _ in range(2):
            life_of_group0(commits=True)
            assert "in 0.2 s (failed: 1 failure and 0 evictions" in wait_for("restarting group0")
        life_of_group0(commits=False)
        gave_up = wait_for("group0 gave up")
        assert "after 3 restart(s): 2 failures and 0 evictions as stalled in a row" in gave_up
        launcher.send_signal(signal.SIGTERM)
        rest, _ = launcher.communicate(timeout=30)
    log = "".join(lines) + rest
    assert "group0: 3 restart(s); exits: 4 failed; given up" in log
    assert "gave up" not in "".join(lines[:-1]), "given up only at the end"
    assert '"committed"' not in log, "the ranks printed no step records"


def run_until(args: list[str], enough: Callable[[list[str]], bool], within: float) -> str:
    """`phalanx run ARGS` until its output so far is `enough`, then SIGTERM; its log."""
    with phalanx_run(*args) as launcher:
        lines: list[str] = []
        deadline = time.monotonic() + within
        while not enough(lines):
            assert time.monotonic() < deadline, "".join(lines[-50:])
            line = launcher.stdout.readline()
            assert line, "phalanx run ended first:\n" + "".join(lines[-50:])
            lines.append(line)
        launcher.send_signal(signal.SIGTERM)
        rest, _ = launcher.communicate(timeout=30)
        return "".join(lines) + rest


#: Injected failures must not use up --max-restarts: with none allowed, a group that
#: the launcher gave up on means it counted one.
NO_RESTARTS = ["--replicas", "2", "--max-restarts", "0", "--restart-backoff", "0.05"]


def test_chaos_kills_groups_and_the_launcher_brings_them_back():
    chaos = ["--chaos", "kill-every=0.5s", "--chaos-seed", "7"]
    log = run_until(
        [*NO_RESTARTS, *chaos, "--", RANK, "60", "0"],
        lambda lines: sum("chaos: SIGKILL" in line for line in lines) >= 3,
        within=30,
    )
    # Every killed group came back.
    assert "gave up" not in log
    assert log.count("started group") >= 2 + 3 - 1, log


@pytest.mark.slow
def test_chaos_blocks_a_training_thread_and_the_stalled_group_comes_back():
    chaos = ["--chaos", "hang-thread-every=2s,hang-thread-for=60s"]
    log = run_until(
        [*NO_RESTARTS, *chaos, "--", str(PROCS / "ft_train.py"), "--steps", "100000"],
        lambda lines: any("blocked by chaos)" in line for line in lines),
        within=90,
    )
    # The blocked rank's group was evicted, left its evidence and exited as stalled,
    # and came back without using up --max-restarts.
    assert "chaos: blocking the training thread of" in log
    assert "was evicted from quorum" in log and "most recent call first" in log, log[-5000:]
    assert "exit codes [75]" in log, log[-5000:]
    assert "gave up" not in log


def children(pid: int) -> set[int]:
    """The live processes whose parent is `pid`."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.add(int(entry))
    return found


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`."""
    found, frontier = set(), {pid}
    while frontier:
        frontier = set().union(*(children(p) for p in frontier)) - found
        found |= frontier
    return found


@pytest.mark.slow
def test_a_restarted_group_is_forked_with_its_own_environment():
    done = launch("--max-restarts", "1", "--restart-backoff", "0.05", "--", RANK, "0", "3")

    assert done.returncode == 1
    runs = reports(done.stdout)
    assert len(runs) == 2, done.stdout
    assert done.stdout.count("(1 rank(s), forked, pids") == 2, done.stdout
    (_, first), (_, second) = runs
    assert second["pid"] != first["pid"]
    for key in ("PHALANX_REPLICA_ID", "RANK", "WORLD_SIZE", "PHALANX_LIGHTHOUSE"):
        assert second[key] == first[key], key
    assert second["MASTER_PORT"] != first["MASTER_PORT"], "a restarted group gets a fresh store"


def test_without_the_fork_server_ranks_are_new_processes():
    done = launch("--no-fork-server", "--", RANK, "0", "0")

    assert done.returncode == 0, done.stdout
    assert "ranks: plain processes (--no-fork-server)" in done.stdout
    assert "(1 rank(s), new processes, pids" in done.stdout
    assert len(reports(done.stdout)) == 1


def test_python_on_the_path_is_recognised_as_the_launchers_interpreter(monkeypatch):
    # As in an activated venv: its bin folder first on PATH, where `python` is found.
    bin_folder, python = os.path.split(sys.executable)
    monkeypatch.setenv("PATH", f"{bin_folder}{os.pathsep}{os.environ['PATH']}")

    for command in ([python, "-m", "train", "--lr", "0.1"], [python, "train.py"]):
        resolved = resolve(command)
        assert resolved == [sys.executable, *command[1:]]
        forked, why = rank_mode(resolved, fork_server=True)
        assert forked, why
        assert why.startswith("fork server")


def test_a_link_to_the_interpreter_outside_its_environment_gets_plain_processes(tmp_path):
    # Python finds its environment from the path it was started by: this link starts
    # the interpreter outside the launcher's venv, so a fork would not be what it runs.
    link = tmp_path / "python"
    link.symlink_to(sys.executable)
    forked, why = rank_mode([str(link), "train.py"], fork_server=True)
    if sys.prefix == sys.base_prefix:
        assert forked, why  # no venv: the link starts in the same installation
    else:
        assert not forked and "starts in the environment" in why, why


def test_another_environments_python_runs_its_ranks_in_that_environment(tmp_path):
    other = tmp_path / "other"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(other)], check=True)
    script = tmp_path / "where.py"
    script.write_text("import sys\nprint('prefix', sys.prefix, flush=True)\n")

    done = launch("--replicas", "2", "--", str(other / "bin" / "python"), str(script))

    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(f"prefix {other}") == 2, done.stdout
    said = [line for line in done.stdout.splitlines() if "starts in the environment" in line]
    assert len(said) == 1 and str(other) in said[0], done.stdout


def test_another_program_called_python_gets_plain_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", path_with(tmp_path / "bin", python=shutil.which("sh")))

    forked, why = rank_mode(resolve(["python", "-m", "train"]), fork_server=True)
    assert not forked
    assert why.startswith("plain processes") and sys.executable in why


@pytest.mark.slow
def test_python_dash_m_on_the_path_is_forked():
    env = child_env()
    env["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = str(PROCS)  # where `-m launched_rank` is found

    done = launch("--", "python", "-m", "launched_rank", "0", "0", env=env)

    assert done.returncode == 0, done.stdout + done.stderr
    assert "ranks: fork server (" in done.stdout, done.stdout
    assert "(1 rank(s), forked, pids" in done.stdout, done.stdout
    assert len(reports(done.stdout)) == 1


def test_sigterm_stops_every_rank_and_leaves_no_orphan():
    with two_groups_running() as launcher:
        pids = []
        deadline = time.monotonic() + 30
        while len(pids) < 2 and time.monotonic() < deadline:
            line = launcher.stdout.readline()
            pids += [env["pid"] for _, env in reports(line)]
        assert len(pids) == 2
        below = descendants(launcher.pid)
        assert set(pids) <= below
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(15) == 130
        assert not any(alive(pid) for pid in below), "a process outlived the launcher"


def test_a_dead_fork_server_is_noticed_at_once_not_spun_on():
    from phalanx.forkserver import ForkServer

    server = ForkServer()
    rank = server.start([sys.executable, "-c", "pass"], child_env())
    server.process.kill()
    server.process.wait()
    started = time.monotonic()
    # Its closed socket stays readable: pumping must see the end, not loop on it.
    assert rank.wait(timeout=10.0) is not None
    server.pump(0.1)
    assert time.monotonic() - started < 5.0
    server.close()
    rank.stdout.close()
    server.process.stdout.close()


@pytest.mark.slow
def test_sigint_ends_the_launcher_and_every_rank():
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "run", "--replicas", "2", "--", RANK, "60", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
        cwd=TESTS.parent,
        start_new_session=True,
    )
    pids: list[int] = []
    for line in proc.stdout:
        if "(1 rank(s), forked, pids" in line:
            pids.append(int(line.rsplit("pids ", 1)[1].rstrip(")\n")))
        if len(pids) == 2:
            break
    # As a terminal's Ctrl-C does: the signal reaches the launcher's whole group.
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode is not None
    assert not any(alive(pid) for pid in pids)


def test_every_option_of_phalanx_run_says_what_it_does_and_its_default():
    for action in build_parser()._actions:
        if action.dest != "help":
            assert action.help and "default" in action.help, action.option_strings


class Recorder(LaunchObserver):
    """Keeps what the launcher tells its observer."""

    def __init__(self) -> None:
        self.said: list[str] = []
        self.lines: list[tuple[str, int, bytes]] = []
        self.events: list[tuple[str, str]] = []

    def say(self, text: str) -> None:
        self.said.append(text)

    def rank_line(self, group, rank: int, line: bytes) -> None:
        self.lines.append((group.replica_id, rank, line))

    def group_event(self, kind: str, group) -> None:
        self.events.append((kind, group.replica_id))


@pytest.fixture
def signal_handlers() -> Iterator[None]:
    """The launcher takes SIGINT and SIGTERM; the test process gets them back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_an_observer_hears_the_groups_and_every_line_of_their_ranks(signal_handlers):
    config = LaunchConfig(
        command=(sys.executable, "-c", "print('hello')"), replicas=2, fork_server=False
    )
    recorder = Recorder()

    assert Launcher(config, "t0k3n", observer=recorder).run() == 0

    assert sorted(recorder.lines) == [("group0", 0, b"hello"), ("group1", 0, b"hello")]
    assert [e for e in recorder.events if e[0] == "start"] == [
        ("start", "group0"),
        ("start", "group1"),
    ]
    assert any(text.startswith("lighthouse at 127.0.0.1:") for text in recorder.said)
    assert "group0 finished" in recorder.said


def test_the_launch_config_is_the_command_line_typed():
    args = build_parser().parse_args(["--replicas", "2", "--chaos", "kill-every=15s"])
    config = LaunchConfig.from_args(args, ["train.py", "--lr", "0.1"])

    assert config.command == (sys.executable, "train.py", "--lr", "0.1")
    assert config.chaos == Chaos(kill_every=15.0)
    assert config.replica_ids() == ["group0", "group1"]
    with pytest.raises(ValueError, match="--replicas and --nproc-per-replica"):
        LaunchConfig(command=("x",), replicas=0)


# -- the restart rule ---------------------------------------------------------------


def exits(count: RestartCount, *causes: Exit, committed: bool = False) -> RestartCount:
    for cause in causes:
        count = count.after(cause, committed=committed)
    return count


def test_failures_in_a_row_use_up_the_budget_and_a_commit_gives_it_back():
    count = exits(RestartCount(), Exit.FAILED, Exit.FAILED)
    assert not count.exceeds(max_restarts=2)
    assert exits(count, Exit.FAILED).exceeds(max_restarts=2)
    # The group trained in the life that ended with this failure: it is the first again.
    forgiven = count.after(Exit.FAILED, committed=True)
    assert forgiven == RestartCount(failed=1)
    assert not forgiven.exceeds(max_restarts=1)
    assert RestartCount(failed=1).exceeds(max_restarts=0), "0: never restart"


def test_evictions_as_stalled_have_a_budget_of_their_own():
    count = exits(RestartCount(), Exit.STALLED, Exit.FAILED, Exit.STALLED)
    assert count == RestartCount(failed=1, stalled=2)
    assert not count.exceeds(max_restarts=2), "two of each, not four of one"
    assert exits(count, Exit.STALLED).exceeds(max_restarts=2)
    assert exits(count, Exit.FAILED, Exit.FAILED).exceeds(max_restarts=2)


def test_chaos_counts_nothing_but_a_commit_before_it_still_forgives():
    count = RestartCount(failed=3, stalled=1)
    assert exits(count, Exit.CHAOS, Exit.CHAOS) == count
    assert count.after(Exit.CHAOS, committed=True) == RestartCount()


def test_the_backoff_doubles_in_a_row_and_starts_again_after_a_commit():
    count, waits = RestartCount(), []
    for _ in range(8):
        count = count.after(Exit.FAILED, committed=False)
        waits.append(count.backoff(first=0.5))
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, MAX_BACKOFF, MAX_BACKOFF, MAX_BACKOFF]
    assert count.after(Exit.STALLED, committed=True).backoff(first=0.5) == 0.5


@given(st.lists(st.tuples(st.sampled_from(Exit), st.booleans()), max_size=40))
def test_the_count_is_the_exits_since_the_last_life_that_committed(lives):
    """Each life ends with an exit, and may have committed a step before it."""
    count = RestartCount()
    for cause, committed in lives:
        count = count.after(cause, committed)
    since = 0
    for i, (_, committed) in enumerate(lives):
        if committed:
            since = i
    tail = [cause for cause, _ in lives[since:]]
    assert count.failed == tail.count(Exit.FAILED)
    assert count.stalled == tail.count(Exit.STALLED)
    if all(committed for _, committed in lives):
        assert not count.exceeds(max_restarts=1), "a group that trains in every life stays"


@pytest.mark.parametrize(
    ("codes", "killed", "hung", "cause"),
    [
        ([1], False, False, Exit.FAILED),
        ([-9, None], False, False, Exit.FAILED),
        ([None, 75], False, False, Exit.STALLED),
        ([-9], True, False, Exit.CHAOS),
        ([75], False, True, Exit.CHAOS),
        ([1], False, True, Exit.FAILED),  # a thread hang that did not end as stalled
    ],
)
def test_an_exit_is_a_failure_an_eviction_as_stalled_or_chaos(codes, killed, hung, cause):
    assert Exit.of(codes, chaos_killed=killed, chaos_hung=hung) is cause


STREAM, NEXT_LIFE = "10.0.0.3:40112", "10.0.0.3:40188"


def looks(*sightings: Sighting | None) -> list[bool]:
    watch = CommitWatch()
    return [watch.see(s) for s in sightings]


def level(step: int, stream: str = STREAM, peers: int | None = None) -> Sighting:
    return Sighting(stream, in_quorum=True, step=step, peers_step=step if peers is None else peers)


def test_a_heal_is_not_a_commit_but_steps_from_level_with_the_peers_are():
    healing = Sighting(STREAM, in_quorum=True, step=0, peers_step=296)
    # Restarted at step 0, healed to the peers' 296: no step of its own yet.
    assert looks(healing, level(296)) == [False, False]
    assert looks(healing, level(296), level(296), level(301)) == [False, False, False, True]


def test_a_lone_group_commits_from_its_own_first_step():
    alone = [Sighting(STREAM, in_quorum=True, step=n) for n in (0, 0, 4)]
    assert looks(*alone) == [False, False, True]


def test_a_look_at_the_life_before_is_not_compared_with_this_one():
    # The lighthouse still showed the previous life at 296; this life healed to 297.
    assert looks(level(296), level(297, stream=NEXT_LIFE)) == [False, False]
    assert looks(level(296), level(297, stream=NEXT_LIFE), level(298, stream=NEXT_LIFE))[-1]


@pytest.mark.parametrize(
    "between",
    [
        Sighting(STREAM, in_quorum=True, step=120, peers_step=121),  # behind: it will heal
        Sighting(STREAM, in_quorum=False, step=120, peers_step=None),  # outside the quorum
        Sighting("", in_quorum=True, step=120),  # no heartbeat stream to tell lives apart
        None,  # not live at the lighthouse
    ],
)
def test_a_look_that_is_not_level_starts_over(between):
    assert looks(level(120), between, level(125)) == [False, False, False]
    assert looks(level(120), between, level(125), level(126))[-1]


def test_once_seen_committing_a_life_stays_so():
    watch = CommitWatch()
    assert [watch.see(s) for s in (level(3), level(4), None, level(0))] == [
        False,
        True,
        False,
        False,
    ]
    assert watch.committed


def test_a_sighting_reads_the_group_and_its_quorum_peers_from_a_status():
    from types import SimpleNamespace as Row  # stands for LighthouseStatus (Rust-built)

    status = Row(
        quorum_members=["g0", "g1", "g2"],
        replicas=[
            Row(replica_id="g0", peer="h0:1", in_quorum=True, step=0),
            Row(replica_id="g1", peer="h1:1", in_quorum=True, step=41),
            Row(replica_id="g3", peer="h3:1", in_quorum=False, step=90),  # not a member
        ],
    )
    assert Sighting.of(status, "g0") == Sighting("h0:1", True, 0, peers_step=41)
    assert Sighting.of(status, "g1") == Sighting("h1:1", True, 41, peers_step=0)
    assert Sighting.of(status, "g2") is None, "a member the lighthouse lost"
    assert Sighting.of(status, "g3") == Sighting("h3:1", False, 90, peers_step=41)


def test_the_loop_wakes_when_chaos_is_due_and_keeps_its_rate():
    config = LaunchConfig(
        command=(sys.executable, "-c", "pass"), fork_server=False, chaos=Chaos(kill_every=0.02)
    )
    launcher = Launcher(config, "t0k3n", observer=Recorder())
    assert launcher._wait(0.0) == 0.1, "no clock before the job trains"
    launcher.inject(100.0)  # the clocks start; no group is live, so nobody dies
    assert launcher.injector.next_due(launcher.groups) == pytest.approx(100.02)
    assert launcher._wait(100.005) == pytest.approx(0.015)
    # A late look keeps the rate (100.04, not 100.045); one far behind starts again.
    launcher.inject(100.025)
    assert launcher.injector.next_kill == pytest.approx(100.04)
    launcher.inject(103.0)
    assert launcher.injector.next_kill == pytest.approx(103.02)
    assert launcher._wait(104.0) == 0.0


def test_chaos_kills_no_group_once_one_has_finished():
    # A job that is ending: the group still running may be the last one holding the
    # state, and killing it would start the job over at step 0 (a new lineage).
    config = LaunchConfig(
        command=(sys.executable, "-c", "pass"),
        replicas=2,
        fork_server=False,
        chaos=Chaos(kill_every=1.0),
    )
    launcher = Launcher(config, "t0k3n", observer=Recorder())
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        finished, running = launcher.groups
        running.procs = [sleeper]
        finished.done = True
        launcher.inject(0.0)
        launcher.inject(2.0)
        assert sleeper.poll() is None and not running.chaos_killed

        finished.done = False  # the same launcher, with both groups still training
        launcher.inject(4.0)
        assert sleeper.wait(10) == -signal.SIGKILL and running.chaos_killed
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_rollback_while_groups_crash_loop_is_told_to_be_their_doing():
    """Every restarted group died of the same exception before it could heal, so the
    last holder's death left none: the launcher says so beside the rank's ROLLBACK."""
    from phalanx.crashes import Crash, CrashReader

    recorder = Recorder()
    config = LaunchConfig(command=(sys.executable, "-c", "pass"), replicas=2, fork_server=False)
    launcher = Launcher(config, "t0k3n", observer=recorder)
    looping, holder = launcher.groups
    boom = Crash("RuntimeError", "modified by an inplace operation", 12)
    for _ in range(3):
        reader = CrashReader()
        reader.feed(
            f"phalanx: replica group 'group0' rank 0 crashed at step 12: {boom.kind}: "
            f"{boom.message}"
        )
        looping.readers = [reader]
        found = looping.ended(Exit.FAILED, committed=False)
    assert found is not None and found.crash == boom and found.lives == 3
    assert looping.ended(Exit.CHAOS, committed=False) is None, "chaos is no crash"
    assert looping.crash_loop == found

    launcher.explain_rollback()
    assert recorder.said[-1] == (
        "the rollback above: every restarted group that could have healed to the newest "
        "state crashed first (group0: crash loop: 3 lives in a row ended by RuntimeError: "
        "modified by an inplace operation (at step 12))"
    )
    # A commit ends the loop.
    looping.ended(Exit.FAILED, committed=True)
    assert looping.crash_loop is None and holder.crash_loop is None
