"""The pieces of benches/gpu_check.py that a machine without a GPU can check: the
NCCL path is the one a `cuda` device takes, a failed NCCL group is aborted before it
is dropped, the check's own timers, its exit where there is no CUDA, its options and
the shape of its table and JSON. The GPU itself is checked only where there is one."""

from __future__ import annotations

import doctest
import json
import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from phalanx import process_group
from phalanx.process_group import (
    CollectiveFailed,
    FaultTolerantProcessGroup,
    Membership,
    backend_for,
)
from phalanx.recovery import StateHost
from phalanx.services import RankServices
from phalanx.settings import ManagerSettings

from conftest import child_env

BENCHES = Path(__file__).resolve().parent.parent / "benches"
sys.path.insert(0, str(BENCHES))
# benches/gpu_check.py and its phases' modules, found beside their harness.
import gpu_chaos  # noqa: E402
import gpu_check  # noqa: E402
import gpu_heal  # noqa: E402
import gpu_phase  # noqa: E402
import gpu_step  # noqa: E402


class StandInNcclGroup:
    """Stands in for a ProcessGroupNCCL, which needs a GPU: its all-reduce fails as a
    dead peer's would, and it counts its aborts."""

    def __init__(self) -> None:
        self.aborts = 0
        self.aborted = threading.Event()

    def allreduce(self, tensors, options):
        raise RuntimeError("NCCL error: remote process exited or there was a network error")

    def abort(self) -> None:
        self.aborts += 1
        self.aborted.set()

    def wait_aborted(self) -> int:
        """Its aborts, once the first has happened (a retired group is aborted on a
        thread of its own)."""
        assert self.aborted.wait(10), "the group was never aborted"
        return self.aborts


def stand_in_connect(built: list[StandInNcclGroup]):
    def connect(membership, backend, timeout, host, token):
        assert isinstance(timeout, timedelta)
        built.append(StandInNcclGroup())
        return built[-1], object()

    return connect


def retired() -> None:
    """Waits for the process groups being retired to be gone."""
    for thread in threading.enumerate():
        if thread.name == "phalanx-retire-pg":
            thread.join(10)


MEMBERSHIP = Membership("127.0.0.1:1", "quorum/7", rank=0, world_size=3)


def test_cuda_takes_the_nccl_path():
    assert backend_for(torch.device("cuda", 0)) == "nccl"
    assert backend_for(torch.device("cpu")) == "gloo"
    for device in ("cuda", "cuda:0"):
        settings = ManagerSettings.from_env(
            {"PHALANX_DEVICE": device}, replica_id="a", lighthouse="127.0.0.1:1"
        )
        assert settings.backend == "nccl"
    # The check's ranks train the demo's model on the GPU.
    command = gpu_chaos.chaos_command(Path("/tmp/pg"))
    assert command[command.index("--device") + 1] == "cuda"
    assert command[command.index("--") + 1 :][:2] == ("--device", "cuda")


def test_a_failed_nccl_group_is_aborted_before_it_is_dropped():
    built: list[StandInNcclGroup] = []
    pg = FaultTolerantProcessGroup(timeout=1.0, connect=stand_in_connect(built))
    pg.configure(MEMBERSHIP, "nccl")
    with pytest.raises(CollectiveFailed) as failed:
        pg.allreduce(torch.ones(4), abort=_abort())
    assert failed.value.from_backend
    assert built[0].aborts == 0
    pg.reset()  # what a failed step does
    assert built[0].wait_aborted() == 1
    # A new quorum builds a new group; the one before it is aborted on the way.
    pg.configure(MEMBERSHIP, "nccl")
    pg.configure(Membership("127.0.0.1:1", "quorum/8", rank=0, world_size=2), "nccl")
    assert built[1].wait_aborted() == 1
    assert [g.aborts for g in built] == [1, 1, 0]
    pg.reset()  # what shutdown does: no group outlives the rank
    assert [g.wait_aborted() for g in built] == [1, 1, 1]


def test_the_cross_group_process_group_is_retired_at_shutdown():
    built: list[StandInNcclGroup] = []
    pg = FaultTolerantProcessGroup(timeout=1.0, connect=stand_in_connect(built))
    pg.configure(MEMBERSHIP, "nccl")
    host = StateHost(bind="127.0.0.1:0")
    RankServices(None, None, None, None, host, pg).shutdown()
    assert built[0].wait_aborted() == 1
    assert pg.membership is None


def test_nccl_groups_across_replica_groups_abort_rather_than_kill(monkeypatch):
    """torch's NCCL watchdog would tear a survivor down on a lost peer's failed
    collective (its default, 3); phalanx builds its groups with 2, unless the user
    chose a value, which is kept."""
    seen = []

    class StandInNccl:
        Options = type("Options", (), {})

        def __init__(self, store, rank, size, options):
            seen.append(os.environ.get(process_group.NCCL_ERROR_HANDLING))

    monkeypatch.setattr(process_group, "Store", lambda *_, **__: object())
    monkeypatch.setattr(process_group.dist, "PrefixStore", lambda _, store: store)
    monkeypatch.setattr(process_group.dist, "ProcessGroupNCCL", StandInNccl, raising=False)
    monkeypatch.delenv(process_group.NCCL_ERROR_HANDLING, raising=False)
    process_group._connect(MEMBERSHIP, "nccl", timedelta(seconds=1))
    assert process_group.NCCL_ERROR_HANDLING not in os.environ  # only while building
    monkeypatch.setenv(process_group.NCCL_ERROR_HANDLING, "3")
    process_group._connect(MEMBERSHIP, "nccl", timedelta(seconds=1))
    assert seen == ["2", "3"]
    assert os.environ[process_group.NCCL_ERROR_HANDLING] == "3"


def test_a_gloo_group_is_not_aborted():
    built: list[StandInNcclGroup] = []
    pg = FaultTolerantProcessGroup(timeout=1.0, connect=stand_in_connect(built))
    pg.configure(MEMBERSHIP, "gloo")
    pg.reset()
    retired()
    assert built[0].aborts == 0


def test_the_timers_log_builds_aborts_and_first_collectives(tmp_path):
    built: list[StandInNcclGroup] = []
    undo = gpu_chaos.instrument(tmp_path)
    try:
        pg = FaultTolerantProcessGroup(timeout=1.0, connect=stand_in_connect(built))
        pg.configure(MEMBERSHIP, "nccl")
        pg.configure(MEMBERSHIP, "nccl")  # the same quorum: nothing built
        with pytest.raises(CollectiveFailed):
            pg.allreduce(torch.ones(4), abort=_abort())
        pg.reset()
        pg.reset()  # nothing left to abort
        retired()
    finally:
        undo()
    records = gpu_chaos.read_pg_logs(tmp_path)
    assert [r["what"] for r in records] == ["build", "first-collective", "abort"]
    assert records[0]["backend"] == "nccl" and records[0]["world"] == 3
    assert records[2]["backend"] == "nccl"
    assert all(r["s"] >= 0 for r in records)
    assert built[0].aborts == 1
    assert process_group.retire.__name__ == "retire"  # put back


def test_each_group_gets_an_nccl_host_id_of_its_own():
    ids = {gpu_phase.nccl_environ(i, {})["NCCL_HOSTID"] for i in range(3)}
    assert len(ids) == 3
    given = {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_HOSTID": "mine"}
    chosen = gpu_phase.nccl_environ(1, given)
    assert chosen["NCCL_SOCKET_IFNAME"] == "eth0"  # the user's choice is kept
    assert chosen["NCCL_HOSTID"] == "phalanx-gpu-check-1"  # never shared by groups


def test_without_cuda_it_says_so_and_exits_0(tmp_path):
    done = subprocess.run(
        [sys.executable, str(BENCHES / "gpu_check.py"), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**child_env(), "CUDA_VISIBLE_DEVICES": ""},
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no CUDA device" in done.stdout
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["bench"] == "gpu_check" and result["cuda"] is False
    assert not (tmp_path / "out").exists()  # nothing started


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_a_rehearsal_on_the_cpu_runs_every_phase_end_to_end(tmp_path):
    """The check's machinery (launcher, fork server, kills, timers, heal and step
    workers, table) over gloo, as the next machine with a GPU will run it."""
    quick = ["--duration", "24", "--kill-every", "8", "--heal-mb", "16", "--heal-repeat", "1"]
    quick += ["--rounds", "1", "--steps", "10", "--warmup", "2", "--time-limit", "300"]
    done = subprocess.run(
        [sys.executable, str(BENCHES / "gpu_check.py"), "--rehearse-on-cpu", *quick],
        capture_output=True,
        text=True,
        timeout=350,
        env=child_env(),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    phases = result["phases"]
    assert result["ok"] and set(phases) == {"chaos", "heal", "step"}
    chaos = phases["chaos"]
    assert chaos["replicas_consistent"] and chaos["unplanned_exits"] == []
    assert chaos["failures_injected"] >= 1
    assert chaos["failures_recovered"] == chaos["failures_injected"]
    assert phases["heal"]["bit_identical"] and phases["heal"]["in_place"] == 385
    assert phases["step"]["ratio"]["median"] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--phases", "chaos,bogus"], "give phases among chaos, heal, step"),
        (["--phases", ""], "give phases among"),
        (["--time-limit", "0"], "give a positive number"),
        (["--kill-every", "-5"], "give a positive number"),
        (["--rounds", "0"], "must be at least 1"),
    ],
)
def test_bad_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        gpu_check.parse(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_options():
    args, rest = gpu_check.parse(["--phases", "step,chaos", "--duration", "60"])
    assert args.phases == ["chaos", "step"] and args.duration == 60.0 and rest == []
    assert args.fork_server  # as `phalanx run` starts ranks by default
    assert not gpu_check.parse(["--no-fork-server"])[0].fork_server
    args, rest = gpu_check.parse(["--worker", "rank", "--pg-log", "/x", "--", "--device", "cuda"])
    assert args.worker == "rank" and rest == ["--device", "cuda"]


def test_a_phase_short_of_time_says_why_without_starting_anything(tmp_path):
    args, _ = gpu_check.parse(["--out", str(tmp_path)])
    args.accel = "cuda"
    for name in gpu_check.PHASES:
        phase = gpu_check.run_phase(name, args, gpu_phase.Deadline(5.0))
        assert not phase.ok
        assert "--time-limit" in phase.reason, phase.reason
    assert not list(tmp_path.iterdir())


def test_the_table_and_the_json(capsys):
    phases = [chaos_phase(), heal_phase(), step_phase()]
    probe = {
        "device": "NVIDIA H200",
        "devices": 1,
        "torch": "2.x",
        "cuda_version": "12",
        "nccl": "2.2",
    }
    rows, result = gpu_check.summary(probe, phases)
    gpu_check.report("GPU check", rows, result)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "GPU check"
    assert json.loads(out[-1]) == result
    assert all(isinstance(name, str) for name, _ in rows)
    assert result["bench"] == "gpu_check" and result["cuda"] is True and result["ok"]
    assert set(result["phases"]) == {"chaos", "heal", "step"}
    chaos = result["phases"]["chaos"]
    assert chaos["replicas_consistent"] and chaos["consistency_checked_steps"] == 3
    assert chaos["abort_s"] == {"median": 0.01, "min": 0.01, "max": 0.01}
    assert chaos["kill_to_survivor_commit_s"]["median"] == 0.9
    assert result["phases"]["heal"]["cuda_to_cpu"]["median"] == 2.0
    assert result["phases"]["step"]["ratio"] == {"median": 1.1, "min": 1.0, "max": 1.2}
    assert gpu_check.exit_status(result) == 0
    # A failed phase is named with its reason; diverged replicas exit 3.
    failed = gpu_phase.Phase("heal", False, 1.0, reason="the cuda heal source exited with 1")
    rows, result = gpu_check.summary(probe, [phases[0], failed])
    assert ("heal (1 s)", "FAILED: the cuda heal source exited with 1") in rows
    assert gpu_check.exit_status(result) == 1
    result["phases"]["chaos"]["replicas_consistent"] = False
    assert gpu_check.exit_status(result) == 3


def test_an_unplanned_exit_fails_the_chaos_phase():
    events = [*_events(), {"t": 103.5, "kind": "exit", "replica": "b", "restart": False}]
    phase = _chaos(events)
    assert not phase.ok and "not killed (b)" in phase.reason
    assert phase.result["unplanned_exits"] == [{"replica": "b", "t": 103.5}]


def test_doctests():
    for module in (gpu_check, gpu_phase, gpu_chaos, gpu_heal, gpu_step):
        failed, _ = doctest.testmod(module)
        assert failed == 0, module.__name__


# -- a chaos run, a heal and a step phase, made up ------------------------------------


def _abort():
    from phalanx.process_group import Abort

    return Abort()


def _events() -> list[dict]:
    events = [{"t": 99.0, "kind": "start", "replica": r, "restart": False} for r in "abc"]
    return [
        *events,
        {"t": 100.9, "kind": "kill", "replica": "a", "restart": False},
        {"t": 101.0, "kind": "exit", "replica": "a", "restart": False},
        {"t": 101.6, "kind": "start", "replica": "a", "restart": True},
    ]


def _steps() -> list[dict]:
    steps = []
    for i in range(3):
        for r in "abc":
            if r == "a" and i == 1:
                continue  # killed
            steps.append(
                {
                    "event": "step",
                    "replica": r,
                    "rank": 0,
                    "pid": 2 if r == "a" and i == 2 else 1,  # a restarted
                    "step": i,
                    "quorum_id": 1 + i,
                    "lineage": 0,
                    "participants": 3,
                    "committed": True,
                    "healed": r == "a" and i == 2,
                    "t_start": 100.0 + i,
                    "t_end": 100.8 + i,
                    "quorum_s": 0.0,
                    "allreduce_s": 0.0,
                    "commit_s": 0.0,
                    "heal_s": 0.05 if r == "a" and i == 2 else 0.0,
                    "snapshot_s": 0.0,
                    "resume_s": 0.0,
                    "loss": 1.0,
                    "fingerprint": f"{i:08x}",
                    "failure": None,
                    "t_main": 99.0,
                    "t_ready": 99.5,
                    "samples": i,
                }
            )
    return steps


def _chaos(events: list[dict]) -> gpu_phase.Phase:
    from phalanx.demo.report import analyze

    steps = _steps()
    got = analyze(steps, events, replicas=3, started=99.0, stopped=103.0, exited=104.0)
    pg = [{"t": 100.95, "what": "abort", "s": 0.01, "replica": r} for r in "bc"] + [
        {"t": 101.0, "what": "build", "s": 0.02, "replica": r} for r in "bc"
    ]
    pairs = gpu_chaos.rebuilds(events, pg, steps)
    return gpu_chaos.chaos_result(
        got, pairs, gpu_chaos.unplanned_exits(events), steps, duration=4.0
    )


def chaos_phase() -> gpu_phase.Phase:
    return _chaos(_events())


def heal_phase() -> gpu_phase.Phase:
    run = {"bytes": 2 * 10**9, "tensors": 385, "in_place": 385}
    runs = {
        "gpu": [{**run, "seconds": 0.5}, {**run, "seconds": 1.0}],
        "cpu": [{**run, "seconds": 1.0}, {**run, "seconds": 2.0}],
    }
    staged = {"alloc_s": 0.3, "d2h_s": 0.1, "h2d_s": 0.05, "bytes": 2 * 10**9}
    return gpu_heal.heal_result(runs, 2048.0, 0.4, {"pinned-block": staged})


def step_phase() -> gpu_phase.Phase:
    rounds = [((10.0, 5.0), (10.0, 5.0)), ((10.0, 5.0), (12.0, 6.0)), ((10.0, 5.0), (11.0, 5.5))]
    return gpu_step.step_result(rounds, params=4_200_000, steps=100)
