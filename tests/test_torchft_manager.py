"""phalanx.torchft's Manager and wrappers in one process: torchft's arguments and
semantics, and a clear refusal of what phalanx cannot honour."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
from torch.distributed import ReduceOp

import phalanx
import phalanx.torchft as torchft
from phalanx.torchft.checkpointing import PGTransport
from phalanx.torchft.local_sgd import DiLoCo, LocalSGD
from phalanx.torchft.manager import WorldSizeMode

from conftest import JOIN_TIMEOUT


def make(lighthouse, replica_id: str = "a", **kwargs) -> torchft.Manager:
    box = {"w": torch.zeros(2)}
    options = {
        "pg": torchft.ProcessGroupGloo(timeout=timedelta(seconds=10)),
        "load_state_dict": box.update,
        "state_dict": lambda: dict(box),
        "min_replica_size": 1,
        "replica_id": replica_id,
        "lighthouse_addr": f"http://{lighthouse.address}",
        "rank": 0,
        "world_size": 1,
        "store_addr": "127.0.0.1",
        "store_port": 0,
        **kwargs,
    }
    return torchft.Manager(**options)


@contextlib.contextmanager
def running(lighthouse, replica_id: str = "a", **kwargs) -> Iterator[torchft.Manager]:
    """`make(...)`'s Manager, shut down at the end of the block."""
    manager = make(lighthouse, replica_id, **kwargs)
    try:
        yield manager
    finally:
        manager.shutdown()


def together(*calls: Callable[[], object]) -> list[object]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result(timeout=60) for f in [pool.submit(c) for c in calls]]


@pytest.fixture
def two(lighthouse2):
    managers = together(lambda: make(lighthouse2, "a"), lambda: make(lighthouse2, "b"))
    yield managers
    for manager in managers:
        manager.shutdown()


def step(manager: torchft.Manager, value: float, **allreduce) -> tuple[float, bool, object]:
    """One step contributing `value`: the reduced value, the commit, the rank."""
    manager.start_quorum()
    tensor = torch.tensor([value])
    manager.allreduce(tensor, **allreduce).wait()
    rank = manager.participating_rank()
    return tensor.item(), manager.should_commit(), rank


def test_two_groups_average_or_sum_and_count_the_batches_they_commit(two):
    a, b = two
    averaged = together(lambda: step(a, 1.0), lambda: step(b, 3.0))
    summed = together(
        lambda: step(a, 1.0, reduce_op=ReduceOp.SUM), lambda: step(b, 3.0, reduce_op=ReduceOp.SUM)
    )

    # Step 0 with init_sync: b heals from a and adds zeros; a counts alone.
    assert averaged == [(1.0, True, 0), (1.0, True, None)]
    assert summed == [(4.0, True, 0), (4.0, True, 1)]
    assert [m.num_participants() for m in two] == [2, 2]
    assert [m.state_dict() for m in two] == [{"step": 2, "batches_committed": 3}] * 2


def test_with_spares_only_min_replica_size_groups_contribute(lighthouse2):
    a, b = together(
        lambda: make(lighthouse2, "a", world_size_mode=WorldSizeMode.FIXED_WITH_SPARES),
        lambda: make(lighthouse2, "b", world_size_mode=WorldSizeMode.FIXED_WITH_SPARES),
    )
    try:
        together(lambda: step(a, 0.0), lambda: step(b, 0.0))  # the first sync
        results = together(lambda: step(a, 2.0), lambda: step(b, 6.0))

        assert {rank for _, _, rank in results} == {0, None}
        contributed = 2.0 if results[0][2] == 0 else 6.0
        assert [value for value, _, _ in results] == [contributed] * 2
        assert [m.num_participants() for m in (a, b)] == [1, 1]
        with pytest.raises(ValueError, match="FIXED_WITH_SPARES is honoured by Manager"):
            torchft.DistributedDataParallel(a, torch.nn.Linear(2, 2))
    finally:
        a.shutdown()
        b.shutdown()


def test_a_step_with_fewer_groups_than_min_replica_size_fails_until_max_retries(lighthouse):
    with running(lighthouse, min_replica_size=2, max_retries=1) as manager:
        assert step(manager, 1.0)[1] is False
        assert "fewer than min_replica_size=2" in str(manager.errored())
        with pytest.raises(RuntimeError, match=r"2 steps in a row did not commit \(max_retries=1"):
            step(manager, 1.0)


def test_wrap_future_gives_the_default_and_fails_the_step(lighthouse):
    with running(lighthouse) as manager:
        manager.start_quorum()
        broken: torch.futures.Future[int] = torch.futures.Future()
        wrapped = manager.wrap_future(broken, default=7)
        broken.set_exception(RuntimeError("peer gone"))
        assert wrapped.wait() == 7
        late = manager.wrap_future(torch.futures.Future(), 8, timeout=timedelta(seconds=0.05))
        assert late.wait() == 8
        assert isinstance(manager.errored().original_exception, RuntimeError)
        assert manager.should_commit() is False
        assert "peer gone" in manager.phalanx.failure

        manager.start_quorum()  # the next step starts clean
        assert manager.errored() is None and manager.should_commit() is True


def test_a_checkpoints_step_is_resumed_before_the_first_quorum(lighthouse):
    with running(lighthouse) as manager:
        manager.load_state_dict({"step": 5, "batches_committed": 9})
        assert step(manager, 1.0)[1] is True
        assert manager.state_dict() == {"step": 6, "batches_committed": 10}
        with pytest.raises(RuntimeError, match="before the training loop starts"):
            manager.load_state_dict({"step": 1, "batches_committed": 0})


def test_torchfts_environment_overrides_win_and_the_launchers_name_wins(lighthouse, monkeypatch):
    monkeypatch.setenv("TORCHFT_TIMEOUT_SEC", "12")
    monkeypatch.setenv("TORCHFT_QUORUM_TIMEOUT_SEC", "40")
    monkeypatch.setenv("PHALANX_REPLICA_ID", "group1")
    with running(lighthouse, replica_id="train_ddp_1") as manager:
        timeouts = manager.phalanx.timeouts
        assert (timeouts.collective, timeouts.commit, timeouts.quorum) == (10.0, 12.0, 40.0)
        assert manager.phalanx.replica_id == "group1"


def test_an_unneeded_argument_is_accepted_and_logged_once(lighthouse, caplog):
    caplog.set_level(logging.INFO, logger="phalanx.torchft")
    transport = PGTransport(None, timeout=timedelta(seconds=5), device="cpu")
    first = make(lighthouse, "a", checkpoint_transport=transport)
    second = make(lighthouse, "b", checkpoint_transport=transport)
    first.shutdown()
    second.shutdown()

    told = [r.message for r in caplog.records if "checkpoint_transport" in r.message]
    assert len(told) <= 1  # once per process: an earlier test may have been told already
    with pytest.raises(RuntimeError, match="heals through its own state servers"):
        transport.recv_checkpoint(0, "", 0, timedelta(seconds=1))


@pytest.mark.parametrize(
    ("change", "error", "named"),
    [
        ({"pg": object()}, TypeError, "pass one of phalanx.torchft's process groups"),
        ({"min_replica_size": 0}, ValueError, "min_replica_size=0"),
        ({"lighthouse_addr": "grpc://h:1"}, ValueError, "speaks its own protocol at host:port"),
        ({"max_retries": -1}, ValueError, "max_retries=-1"),
        ({"timeout": timedelta(0)}, ValueError, "timeout="),
        ({"quorum_timeout": float("inf")}, ValueError, "positive, finite timedelta"),
        ({"load_state_dict": None}, ValueError, "pass both load_state_dict and state_dict"),
    ],
)
def test_an_argument_phalanx_cannot_honour_raises_naming_it(lighthouse, change, error, named):
    with pytest.raises(error, match=named):
        make(lighthouse, **change)


def test_a_call_phalanx_cannot_honour_raises_naming_it(lighthouse):
    with running(lighthouse) as manager:
        with pytest.raises(ValueError, match="allow_heal=False cannot be honoured"):
            manager.start_quorum(allow_heal=False)
        manager.start_quorum()
        with pytest.raises(ValueError, match="reduce_op=.*AVG or SUM"):
            manager.allreduce(torch.ones(1), reduce_op=ReduceOp.MAX)
        with pytest.raises(AttributeError, match="manager.phalanx"):
            manager._pg  # noqa: B018
        assert manager.should_commit()


def test_a_torchft_name_phalanx_lacks_names_what_to_use():
    with pytest.raises(AttributeError, match="phalanx.LighthouseServer"):
        torchft.coordination  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'Nonsense'"):
        torchft.Nonsense  # noqa: B018


def test_ddp_refuses_a_torch_ddp_argument_it_cannot_honour(lighthouse):
    with running(lighthouse) as manager:
        with pytest.raises(TypeError, match="process_group, which phalanx cannot honour"):
            torchft.DistributedDataParallel(manager, torch.nn.Linear(2, 2), process_group=None)
        ddp = torchft.DistributedDataParallel(
            manager, torch.nn.Linear(2, 2), find_unused_parameters=True, bucket_cap_mb=1
        )
        assert isinstance(ddp.module, torch.nn.Linear)


def test_the_optimizer_wrapper_steps_only_a_committed_step(lighthouse):
    manager = make(lighthouse, min_replica_size=2)
    model = torch.nn.Linear(2, 1)
    optimizer = torchft.Optimizer(manager, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        before = model.weight.detach().clone()
        optimizer.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()  # one group of the two min_replica_size asks for: no commit
        assert torch.equal(model.weight, before)
        with pytest.raises(ValueError, match="closure"):
            optimizer.step(lambda: 0.0)
    finally:
        manager.shutdown()


def test_local_sgd_syncs_every_sync_every_steps_of_a_plain_optimizer(lighthouse):
    manager = make(lighthouse)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with LocalSGD(manager, model, optimizer, sync_every=2) as local_sgd:
            for _ in range(6):
                optimizer.zero_grad()
                model(torch.ones(4, 2)).pow(2).mean().backward()
                optimizer.step()
        assert local_sgd.inner_step == 6
        assert manager.current_step() == 4  # the first sync, then one every 2 steps
    finally:
        manager.shutdown()


def test_diloco_takes_the_modules_of_the_model_as_its_fragments(lighthouse):
    manager = make(lighthouse)
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Linear(4, 1))
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    try:
        with pytest.raises(ValueError, match="fragment_update_alpha=0.5"):
            DiLoCo(manager, [model[0], model[1]], inner, outer, 4, fragment_update_alpha=0.5)
        adam = torch.optim.Adam(model.parameters())
        with pytest.raises(ValueError, match="all of the same type and settings"):
            DiLoCo(manager, [model[0], model[1]], inner, [outer, adam], sync_every=4)
        with DiLoCo(manager, [model[0], model[1]], inner, outer, sync_every=4) as diloco:
            for _ in range(8):
                inner.zero_grad()
                model(torch.ones(4, 2)).pow(2).mean().backward()
                inner.step()
        assert diloco.inner_step == 8
        assert manager.current_step() == 1 + 4  # the first sync, then a fragment per 2 steps
    finally:
        manager.shutdown()


def test_process_group_specs_refuse_what_phalanx_cannot_run():
    with pytest.raises(NotImplementedError, match="not XCCL"):
        torchft.ProcessGroupXCCL()
    if not torch.cuda.is_available():
        lighthouse = phalanx.LighthouseServer(join_timeout=JOIN_TIMEOUT)
        try:
            with pytest.raises(ValueError, match="sees no GPU; use ProcessGroupGloo"):
                make(lighthouse, pg=torchft.ProcessGroupBabyNCCL())
        finally:
            lighthouse.shutdown()


def test_two_threads_waiting_on_one_work_finish_it_once(lighthouse):
    with running(lighthouse) as manager:
        manager.start_quorum()
        tensor = torch.tensor([4.0])
        work = manager.allreduce(tensor)
        threads = [threading.Thread(target=work.wait) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert work.get_future().wait().item() == 4.0
        assert manager.should_commit()
