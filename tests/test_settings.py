"""A rank's settings, read and checked before any socket opens; and the pure parts of
the step transaction (the membership loss book and watcher, the held state)."""

from __future__ import annotations

import queue
import threading
from collections import namedtuple
from concurrent.futures import Future

import pytest
import torch

import phalanx
from phalanx.data import QuorumSampler
from phalanx.identity import HeldState
from phalanx.membership import LEFT, LossBook, MembershipWatcher
from phalanx.process_group import FaultTolerantProcessGroup
from phalanx.settings import ManagerSettings
from phalanx.step import Step

Event = namedtuple("Event", "quorum_id lost cause")
JOB = {"PHALANX_REPLICA_ID": "a", "PHALANX_LIGHTHOUSE": "10.0.0.1:29510"}


def test_arguments_win_over_the_environment():
    env = {**JOB, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "7"}

    from_env = ManagerSettings.from_env(env)
    given = ManagerSettings.from_env(env, replica_id="b", group_rank=0, store_port=9)

    assert (from_env.replica_id, from_env.group_rank, from_env.store_port) == ("a", 1, 7)
    assert (given.replica_id, given.group_rank, given.store_port) == ("b", 0, 9)
    assert from_env.manager_address == "10.0.0.2:7"
    assert from_env.host == "10.0.0.2"
    assert ManagerSettings.from_env({**env, "PHALANX_ADVERTISE_HOST": "::1"}).host == "::1"


def test_the_device_chooses_the_backend_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ManagerSettings.from_env(JOB).backend == "gloo"
    # Left unsaid on a host with CUDA: the rank's GPU.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ManagerSettings.from_env({**JOB, "LOCAL_RANK": "3"}).device == torch.device("cuda", 3)
    with pytest.raises(ValueError, match="LOCAL_RANK='x' is not a rank"):
        ManagerSettings.from_env({**JOB, "LOCAL_RANK": "x"})
    assert ManagerSettings.from_env(JOB, device="cuda").backend == "nccl"
    assert ManagerSettings.from_env({**JOB, "PHALANX_DEVICE": "cuda:1"}).backend == "nccl"
    given_wins = ManagerSettings.from_env({**JOB, "PHALANX_DEVICE": "cuda"}, device="cpu")
    assert given_wins.backend == "gloo"


@pytest.mark.parametrize(
    ("env", "given", "message"),
    [
        ({}, {}, "no replica id: pass replica_id= or set PHALANX_REPLICA_ID"),
        ({"PHALANX_REPLICA_ID": "a"}, {}, "no lighthouse: pass lighthouse="),
        ({**JOB, "RANK": "2", "WORLD_SIZE": "2"}, {}, "group rank 2 is outside a group of 2"),
        ({**JOB, "WORLD_SIZE": "2", "RANK": "1"}, {}, "needs MASTER_PORT"),
        ({**JOB, "PHALANX_DEVICE": "gpu"}, {}, "'gpu' is not a torch device; write cpu, cuda"),
        (JOB, {"device": "meta"}, "device meta is not supported"),
        ({**JOB, "PHALANX_LIGHTHOUSE_TIMEOUT": "5m"}, {}, "PHALANX_LIGHTHOUSE_TIMEOUT='5m' is"),
        (JOB, {"timeout": 30.0, "collective_timeout": 60.0}, "shorter than the collective"),
        (JOB, {"lighthouse_timeout": 10.0}, "lighthouse timeout \\(10.0 s\\) is shorter"),
        # Rank 1 reads it too (its progress reporter beats at it): a negative one spun.
        (
            {**JOB, "RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "1"},
            {"heartbeat_interval": -1},
            "heartbeat_interval=-1: the seconds between",
        ),
        (JOB, {"heartbeat_interval": float("nan")}, "heartbeat_interval=nan"),
    ],
)
def test_a_setting_that_cannot_work_is_refused_naming_the_fix(env, given, message):
    with pytest.raises(ValueError, match=message):
        ManagerSettings.from_env(env, **given)


def test_an_empty_variable_is_an_unset_one():
    settings = ManagerSettings.from_env({**JOB, "MASTER_ADDR": "", "PHALANX_DEVICE": ""})
    assert (settings.store_addr, settings.device.type) == ("127.0.0.1", "cpu")


def test_the_lighthouse_timeout_comes_from_the_environment_or_the_budget():
    assert ManagerSettings.from_env(JOB, timeout=60.0).timeouts.lighthouse == 600.0
    env = {**JOB, "PHALANX_LIGHTHOUSE_TIMEOUT": "45"}
    assert ManagerSettings.from_env(env).timeouts.lighthouse == 45.0


def test_a_loss_heard_before_the_quorum_fails_the_step_that_gets_it():
    book = LossBook()
    first = Step(0, Future())
    book.follow(first)
    assert book.heard(quorum_id=3) is None  # the step has no quorum yet
    assert not book.admit(first, quorum_id=3)

    second = Step(0, Future())
    book.follow(second)
    assert book.admit(second, quorum_id=4)
    assert book.heard(quorum_id=3) is None  # an older quorum's loss
    assert book.heard(quorum_id=4) is second


def test_a_group_that_left_aborts_no_step_and_a_group_that_died_does():
    """A group that ended its run voted on its last step before it stopped: the peers'
    step in flight goes on (its collectives fail by themselves if it stopped mid-step)."""
    events: queue.Queue = queue.Queue()

    class Source:
        def next_event(self, timeout: float = 0.0):
            try:
                return events.get(timeout=timeout)
            except queue.Empty:
                return None

    heard: queue.Queue = queue.Queue()
    book = LossBook()
    watcher = MembershipWatcher(Source(), book, heard.put)
    try:
        step = Step(0, Future())
        book.follow(step)
        assert book.admit(step, quorum_id=4)
        aborted = threading.Event()
        step.abort.wake_on_abort(aborted)
        for event in (Event(quorum_id=4, lost=["b"], cause=LEFT), Event(4, ["c"], "stream_broken")):
            events.put(event)
            assert heard.get(timeout=10) is event
            if event.cause == LEFT:
                assert book.admit(step, quorum_id=4), "its quorum is not given up either"
        assert aborted.wait(10)
        assert step.abort.reason == "replica group(s) c died (stream_broken)"
    finally:
        watcher.stop()


def test_a_step_fails_once_whichever_threads_fail_it():
    step = Step(0, Future())
    wins = []
    threads = [
        threading.Thread(target=lambda i=i: wins.append(step.fail(f"reason {i}"))) for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wins.count(True) == 1
    assert step.failure is not None and step.failure.startswith("reason ")


def test_a_torn_heal_goes_back_to_the_state_held_before():
    held = HeldState()
    held.committed(quorum_id=2, lineage=0)
    held.begin_heal()
    held.healed(step=8, state_quorum_id=6, lineage=5)
    assert (held.step, held.state_quorum_id, held.lineage, held.healing) == (8, 6, 5, True)
    assert held.tear()  # another rank of the group failed its heal
    assert (held.step, held.state_quorum_id, held.lineage, held.torn) == (1, 2, 0, True)
    assert not held.tear()


def test_a_cuda_job_that_reads_its_data_first_still_gets_nccl(lighthouse, monkeypatch):
    """The backend is the Manager's (device=), not that of whichever call comes first:
    QuorumSampler.indices() asks wait_quorum() with no device. The process group's
    connection is faked (no CUDA here): it records the backend it was asked for."""
    backends: list[str] = []
    monkeypatch.setattr(
        FaultTolerantProcessGroup,
        "configure",
        lambda _, __, backend, *___: backends.append(backend),
    )
    with phalanx.Manager(replica_id="a", lighthouse=lighthouse.address, device="cuda") as manager:
        manager.start_quorum()
        QuorumSampler(num_samples=8, batch_size=2).indices(manager)
        with pytest.raises(ValueError, match="pass Manager\\(device='cpu'\\)"):
            manager.allreduce(torch.ones(2))

    assert backends == ["nccl"]


def test_shutdown_ends_the_membership_watcher(lighthouse):
    def watchers() -> int:
        return sum(t.name == "phalanx-membership" for t in threading.enumerate())

    before = watchers()
    manager = phalanx.Manager(replica_id="a", lighthouse=lighthouse.address)
    assert watchers() == before + 1
    manager.shutdown()
    assert watchers() == before
