"""The fault-tolerant process group: real gloo process groups over a real store (a
manager server's, behind the job token)."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

import phalanx
from phalanx.process_group import (
    Abort,
    CollectiveFailed,
    FaultTolerantProcessGroup,
    Membership,
    Pending,
    backend_for,
)

from conftest import HEARTBEAT_INTERVAL

TOKEN = "pg-token"


@pytest.fixture
def store_address(lighthouse):
    """The address of a manager server's rendezvous store."""
    with phalanx.ManagerServer(
        "g", lighthouse.address, token=TOKEN, heartbeat_interval=HEARTBEAT_INTERVAL
    ) as server:
        yield server.address


def test_cpu_tensors_use_gloo_and_cuda_tensors_nccl():
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "nccl"


@pytest.mark.parametrize(
    ("address", "rank", "size", "message"),
    [
        ("no-port", 0, 1, "is not host:port"),
        ("h:1", 2, 2, "rank 2 is outside a world of 2"),
    ],
)
def test_a_bad_membership_is_refused_with_the_reason(address, rank, size, message):
    with pytest.raises(ValueError, match=message):
        Membership(address, "p", rank, size)


def two_ranks(store_address: str, timeout: float = 10.0):
    """Two fault-tolerant process groups of one world, as two replica groups' ranks."""
    groups = [FaultTolerantProcessGroup(timeout, host="127.0.0.1", token=TOKEN) for _ in range(2)]
    threads = [
        threading.Thread(
            target=g.configure,
            args=(Membership(store_address, "q1/r0", rank, 2), "gloo"),
        )
        for rank, g in enumerate(groups)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return groups


def test_an_allreduce_sums_over_the_members(store_address):
    groups = two_ranks(store_address)
    tensors = [torch.full((4,), float(rank + 1)) for rank in range(2)]
    pending = [g.allreduce(t, Abort()) for g, t in zip(groups, tensors, strict=True)]
    for p in pending:
        p.wait()
    assert all(torch.equal(t, torch.full((4,), 3.0)) for t in tensors)


def test_a_rank_without_the_token_cannot_join(store_address):
    intruder = FaultTolerantProcessGroup(2.0, host="127.0.0.1", token="wrong")
    with pytest.raises(PermissionError, match="missing or wrong job token"):
        intruder.configure(Membership(store_address, "q1/r0", 1, 2), "gloo")


def test_an_abort_ends_the_wait_at_once_instead_of_at_the_collective_timeout(store_address):
    groups = two_ranks(store_address, timeout=30.0)
    abort = Abort()
    # The peer never joins: without the abort this would wait 30 s.
    pending = groups[0].allreduce(torch.ones(4), abort)
    threading.Timer(0.2, abort.set).start()
    started = time.monotonic()
    with pytest.raises(CollectiveFailed, match="aborted"):
        pending.wait()
    assert time.monotonic() - started < 1.0


def test_a_build_that_outlasts_its_deadline_is_given_up_and_dropped_when_it_ends():
    """gloo waits for a peer's connection up to five times its timeout (a peer that
    published its address, then paused or gave up on the quorum, never connects):
    the rank stops waiting at its declared deadline, and what the build makes when it
    does end is dropped on the build's thread, not kept as the current group."""
    release, built = threading.Event(), threading.Event()

    class Built:
        def __del__(self) -> None:
            built.set()

    def connect(*_: object) -> tuple[object, object]:
        release.wait(30)
        return Built(), object()

    group = FaultTolerantProcessGroup(0.2, connect=connect)
    assert group.build_timeout == pytest.approx(0.6)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="not built within 0.6 s: a peer never connected"):
        group.configure(Membership("h:1", "q1/r0", 1, 2), "gloo")
    assert time.monotonic() - started < 5.0
    assert group.membership is None
    release.set()
    assert built.wait(10), "the late group was dropped"
    assert group.membership is None


def test_an_abort_ends_the_wait_for_a_build_at_once(store_address):
    group = FaultTolerantProcessGroup(30.0, host="127.0.0.1", token=TOKEN)
    abort = Abort()
    threading.Timer(0.2, abort.set, args=("replica group(s) b died (stream_broken)",)).start()
    started = time.monotonic()
    with pytest.raises(CollectiveFailed, match="b died"):
        group.configure(Membership(store_address, "q1/r0", 0, 2), "gloo", abort)  # b never comes
    assert time.monotonic() - started < 2.0
    assert group.membership is None


LEAVE_MID_COLLECTIVE = """
import json, sys
import torch
from phalanx.process_group import Abort, FaultTolerantProcessGroup, Membership
group = FaultTolerantProcessGroup(10.0, host="127.0.0.1", token=sys.argv[2])
group.configure(Membership(sys.argv[1], "q1/r0", 0, 2), "gloo")
group.allreduce(torch.ones(4), Abort())  # the peer never joins it
group.reset()  # as after a failed step: the group is destroyed beside this thread
print(json.dumps({"event": "leaving"}), flush=True)
sys.exit(0)
"""


def test_a_rank_that_exits_right_after_dropping_a_group_mid_collective_exits_cleanly(
    store_address, spawn
):
    """The retired group's destructor waits for its collective; when it returned while
    the interpreter was finalizing, the process died of SIGABRT instead of exiting 0."""
    child = spawn("rank0", [sys.executable, "-c", LEAVE_MID_COLLECTIVE, store_address, TOKEN])
    peer = FaultTolerantProcessGroup(10.0, host="127.0.0.1", token=TOKEN)
    peer.configure(Membership(store_address, "q1/r0", 1, 2), "gloo")
    child.expect(lambda line: line.get("event") == "leaving", 30, "rank 0 drops its group")
    peer.reset()  # the peer's sockets close: rank 0's collective fails, its destructor returns
    assert child.wait(timeout=30) == 0, child.describe()


class QueuedOnDevice:
    """A collective's work as NCCL hands it out: its future is done once queued."""

    def __init__(self, fails: bool = False) -> None:
        self.waited, self.fails = 0, fails
        self.future: torch.futures.Future = torch.futures.Future()
        self.future.set_result([torch.ones(1)])

    def get_future(self) -> torch.futures.Future:
        return self.future

    def wait(self) -> bool:
        self.waited += 1
        if self.fails:
            raise RuntimeError("NCCL communicator was aborted")
        return True


def test_a_device_collective_orders_the_callers_stream_after_it_and_a_host_one_does_not():
    on_device, on_host = QueuedOnDevice(), QueuedOnDevice()
    Pending(on_device, Abort(), 5.0, on_device=True).wait()
    Pending(on_host, Abort(), 5.0).wait()
    assert (on_device.waited, on_host.waited) == (1, 0)
    with pytest.raises(CollectiveFailed, match="communicator was aborted") as failed:
        Pending(QueuedOnDevice(fails=True), Abort(), 5.0, on_device=True).wait()
    assert failed.value.from_backend


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a CUDA device")
def test_an_nccl_process_group_builds_and_reduces_on_one_device(store_address):
    group = FaultTolerantProcessGroup(10.0, token=TOKEN)
    group.configure(Membership(store_address, "nccl", 0, 1), "nccl")
    tensor = torch.ones(4, device="cuda")
    group.allreduce(tensor, Abort()).wait()
    assert torch.equal(tensor.cpu(), torch.ones(4))
