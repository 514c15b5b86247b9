"""`phalanx.torchft.process_group`: torchft's backend names as descriptions the compat
Manager reads, and `ManagedProcessGroup`, a real torch.distributed ProcessGroup over
the quorum, with real processes and a real lighthouse: two single-rank groups
all-reducing through it (dist.all_reduce SUM and AVG, functional collectives), a
group killed with SIGKILL mid-step (the survivor's step fails, nothing raises), and
FSDP2 inside two groups of 2 ranks with its all-reduce hook over it (against one
process training on the combined batch)."""

from __future__ import annotations

import doctest
import signal
import sys
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

import phalanx
import phalanx.torchft
from phalanx.torchft import process_group as tpg
from phalanx.torchft.process_group import ManagedProcessGroup

from conftest import PROCS, Child, free_port

PROCESS = PROCS / "torchft_pg_group.py"


def start(spawn: Callable[..., Child], name: str, *argv: str, env: dict | None = None) -> Child:
    return spawn(name, [sys.executable, str(PROCESS), *argv], env)


def steps(child: Child) -> list[dict]:
    return [line for line in child.lines if line.get("event") == "step"]


# -- the backend descriptions ------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "device_type", "backend"),
    [
        (tpg.ProcessGroupGloo, "cpu", "gloo"),
        (tpg.ProcessGroupNCCL, "cuda", "nccl"),
        (tpg.ProcessGroupBabyGloo, "cpu", "gloo"),
        (tpg.ProcessGroupBabyNCCL, "cuda", "nccl"),
    ],
)
def test_a_backend_keeps_torchfts_constructor_and_says_what_the_manager_builds(
    cls, device_type, backend
):
    assert cls().timeout == timedelta(seconds=60)
    pg = cls(timeout=timedelta(seconds=7))
    assert (pg.timeout, pg.device_type, pg.getBackendName()) == (
        timedelta(seconds=7),
        device_type,
        backend,
    )
    assert cls(timeout=2.5).timeout == timedelta(seconds=2.5)
    assert cls(timedelta(seconds=3)).timeout == timedelta(seconds=3)  # positional, as in torchft
    for bad in (0, -1, timedelta(0), float("nan"), float("inf")):
        with pytest.raises(ValueError, match="timeout must be positive"):
            cls(timeout=bad)
    for bad in ("60", True, None):
        with pytest.raises(TypeError, match="timeout must be a datetime.timedelta"):
            cls(timeout=bad)


def test_a_backend_runs_no_collective_and_names_what_to_use():
    pg = tpg.ProcessGroupNCCL()
    calls = {
        "configure": lambda: pg.configure("localhost:1234/prefix", 0, 2),
        "allreduce": lambda: pg.allreduce([torch.ones(1)], dist.AllreduceOptions()),
        "broadcast": lambda: pg.broadcast([torch.ones(1)], dist.BroadcastOptions()),
        "size": pg.size,
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"ProcessGroupNCCL\.{name}\(\)") as raised:
            call()
        assert "manager.allreduce(tensor)" in str(raised.value)
        assert "ManagedProcessGroup(manager)" in str(raised.value)
    with pytest.raises(RuntimeError, match="configures the cross-group process group itself"):
        tpg.ProcessGroupGloo().configure("localhost:1234/prefix", 0, 2)
    # Passed to torch.distributed by mistake, it says the same.
    with pytest.raises(RuntimeError, match=r"ProcessGroupGloo\.allreduce\(\)"):
        dist.all_reduce(torch.ones(1), group=tpg.ProcessGroupGloo())


def test_an_argument_phalanx_cannot_honour_raises_with_its_name():
    with pytest.raises(ValueError, match=r"ProcessGroupGloo\(pg=\.\.\.\)"):
        tpg.ProcessGroupGloo(pg=dist.ProcessGroup(0, 1))
    for cls in (tpg.ProcessGroupXCCL, tpg.ProcessGroupBabyXCCL):
        with pytest.raises(NotImplementedError, match=f"{cls.__name__}: .*not XCCL") as raised:
            cls(timeout=timedelta(seconds=5))
        assert "ProcessGroupGloo" in str(raised.value) and "ProcessGroupNCCL" in str(raised.value)
    with pytest.raises(AttributeError, match="ManagedProcessGroup"):
        tpg.ErrorSwallowingProcessGroupWrapper  # noqa: B018


def test_the_nccl_watchdog_timeout_bounds_a_collective():
    pg = tpg.ProcessGroupNCCL(timeout=timedelta(seconds=60))
    assert pg.collective_timeout == timedelta(seconds=5)  # torchft's watchdog default
    assert tpg.ProcessGroupNCCL(timeout=3, watchdog_timeout=10).collective_timeout == timedelta(
        seconds=3
    )
    assert tpg.ProcessGroupNCCL(timeout=30, watchdog_timeout=None).collective_timeout == timedelta(
        seconds=30
    )
    with pytest.raises(ValueError, match="watchdog_timeout must be positive"):
        tpg.ProcessGroupNCCL(watchdog_timeout=0)
    assert tpg.ProcessGroupBabyNCCL(timeout=4).collective_timeout == timedelta(seconds=4)


def test_the_package_hands_out_these_names():
    assert phalanx.torchft.ProcessGroupBabyNCCL is tpg.ProcessGroupBabyNCCL
    assert phalanx.torchft.process_group is tpg


def test_the_docstring_examples_run():
    result = doctest.testmod(tpg, optionflags=doctest.ELLIPSIS, report=True)
    assert result.attempted > 0 and result.failed == 0


# -- ManagedProcessGroup in this process (a solo group) -----------------------------


@pytest.fixture
def solo(lighthouse):
    manager = phalanx.Manager(replica_id="solo", lighthouse=lighthouse.address, timeout=5.0)
    pg = ManagedProcessGroup(manager)
    try:
        yield manager, pg
    finally:
        pg.unregister()
        manager.shutdown()


def test_it_is_a_real_process_group_registered_by_name(solo):
    manager, pg = solo
    manager.start_quorum()
    assert isinstance(pg, dist.ProcessGroup)
    assert pg.getBackendName() == "phalanx-managed" and pg.name() == "phalanx-managed"
    assert pg.group_name.startswith("phalanx-managed:solo:")
    assert dist.get_world_size(pg) == 1 and pg.rank() == 0
    out = funcol.all_reduce(torch.tensor([2.0, 4.0]), "avg", pg.group_name)
    assert funcol.wait_tensor(out).tolist() == [2.0, 4.0]
    assert manager.should_commit()


@pytest.mark.parametrize("world", ["default group", "no default group"])
def test_register_makes_it_one_of_torchs_named_groups(solo, world):
    """torchtitan's `ManagedProcessGroup(manager).register("dp_replicate")`: then
    every torch.distributed function that takes a group knows it."""
    manager, pg = solo
    if world == "default group":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert pg.register("dp_replicate") is pg
        assert pg.register("dp_replicate") is pg, "registering again is harmless"
        manager.start_quorum()
        assert dist.get_world_size(pg) == 1
        assert str(dist.get_backend(pg)) == "phalanx-managed"
        assert dist.get_process_group_ranks(pg) == [0]
        if world == "default group":
            assert dist.get_rank(pg) == 0
        out = funcol.all_reduce(torch.tensor([2.0, 4.0]), "sum", "dp_replicate")
        assert funcol.wait_tensor(out).tolist() == [2.0, 4.0]
        assert pg.group_name == "dp_replicate"
        other = ManagedProcessGroup(manager)
        with pytest.raises(ValueError, match="a group named 'dp_replicate' already"):
            other.register("dp_replicate")
        with pytest.raises(ValueError, match="registered as 'dp_replicate' already"):
            pg.register("another")
        with pytest.raises(ValueError, match="takes a group name"):
            other.register("")
        other.unregister()
        assert manager.should_commit(), manager.failure
        pg.unregister()
        with pytest.raises(ValueError, match="not initialized in the world group map"):
            dist.get_backend(pg)
        assert pg.register("dp_replicate") is pg, "the name is free again"
    finally:
        if world == "default group":
            dist.destroy_process_group()  # forgets every group, this one included
    pg.unregister()


def test_torchfts_other_process_group_methods_are_refused_by_name(solo):
    manager, pg = solo
    for name in ("configure", "set_timeout", "abort"):
        with pytest.raises(NotImplementedError, match=rf"{name} \(torchft's .* not phalanx's"):
            getattr(pg, name)()
    manager.start_quorum()
    assert pg.errored() is None
    manager.report_error("a peer died")
    assert "a peer died" in str(pg.errored())
    assert not manager.should_commit()


def test_an_unsupported_op_raises_with_its_name_and_the_step_goes_on(solo):
    manager, pg = solo
    manager.start_quorum()
    for op in ("MAX", "MIN", "PRODUCT"):
        with pytest.raises(NotImplementedError, match=rf"ReduceOp\.{op}: .*SUM or ReduceOp\.AVG"):
            dist.all_reduce(torch.ones(2), op=getattr(dist.ReduceOp, op), group=pg)
    with pytest.raises(NotImplementedError, match=r"ReduceOp\.MAX"):
        funcol.wait_tensor(funcol.all_reduce(torch.ones(2), "max", pg))
    with pytest.raises(NotImplementedError, match=r"ManagedProcessGroup\.broadcast .*all-reduce"):
        dist.broadcast(torch.ones(2), group_src=0, group=pg)
    with pytest.raises(NotImplementedError, match=r"ManagedProcessGroup\.barrier"):
        dist.barrier(group=pg)
    # From torch's C++ side (the functional all-gather) it is the same error.
    with pytest.raises(NotImplementedError, match=r"\(torch\.distributed\.all_gather_into_tensor"):
        funcol.wait_tensor(funcol.all_gather_single(torch.ones(2), 0, pg))
    with pytest.raises(TypeError, match="ReduceOp.AVG of a torch.int64 tensor"):
        dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.AVG, group=pg)
    t = torch.ones(2, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=pg)
    assert t.tolist() == [1, 1]
    assert manager.should_commit(), manager.failure


def test_it_takes_a_manager_only(lighthouse):
    with pytest.raises(TypeError, match="needs a phalanx.torchft.Manager or a phalanx.Manager"):
        ManagedProcessGroup(object())

    with phalanx.Manager(replica_id="c", lighthouse=lighthouse.address) as manager:
        pg = ManagedProcessGroup(manager)
        manager.start_quorum()
        t = torch.tensor([3.0])
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=pg)
        assert t.tolist() == [3.0] and manager.should_commit()
        pg.unregister()


# -- real groups -------------------------------------------------------------------


@pytest.mark.slow
def test_two_groups_sum_and_average_through_it(spawn):
    with phalanx.LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2, join_timeout=0.3, heartbeat_timeout=5.0
    ) as lighthouse:
        common = ("reduce", "--lighthouse", lighthouse.address, "--steps", "2")
        groups = [
            start(spawn, name, *common, "--replica-id", name, "--value", str(value))
            for name, value in (("a", 1.0), ("b", 10.0))
        ]
        for child in groups:
            child.expect(lambda line: line.get("step") == 1, 90, "two steps")
            assert child.wait(timeout=30) == 0, child.describe()

    for child in groups:
        for line in steps(child):
            assert line["committed"], child.describe()
            assert line["sum"] == [11.0] * 3
            assert line["avg"] == [5.5] * 3 and line["future_is_tensor"]
            assert line["functional_avg"] == [5.5] * 2
            assert line["functional_sum"] == [11.0] * 2
            assert line["size"] == line["world_size"] == 2
    ranks = {line["rank"] for child in groups for line in steps(child) if line["step"] == 0}
    assert ranks == {0, 1}


def test_a_group_killed_mid_step_fails_the_survivors_step_instead_of_raising(spawn):
    with phalanx.LighthouseServer(
        bind="127.0.0.1:0", join_timeout=0.3, heartbeat_timeout=1.0
    ) as lighthouse:
        common = ("kill", "--lighthouse", lighthouse.address, "--timeout", "10")
        a = start(spawn, "a", *common, "--replica-id", "a", "--exit-after-failure", "3")
        b = start(spawn, "b", *common, "--replica-id", "b", "--value", "3", "--stall-after", "2")
        stalled = b.expect(lambda line: line.get("event") == "stalled", 90, "b stops mid-step")
        assert stalled["participants"] == 2
        # a is in (or about to start) the step's all-reduce, which waits for b.
        b.signal(signal.SIGKILL)
        failed = a.expect(lambda line: line.get("committed") is False, 30, "a's step fails")
        a.expect(lambda line: line.get("event") == "done", 60, "a goes on alone")
        assert a.wait(timeout=30) == 0, a.describe()

    assert failed["step"] == stalled["step"], a.describe()
    assert failed["reduced"] is False and failed["failure"], failed
    assert failed["value"] == [1.0] * 4, "a failed all-reduce leaves the tensor as it was"
    # The lighthouse's word, or (on a slow machine) the collective's own failure.
    assert any(why in failed["failure"] for why in ("b died", "gone or unreachable")), failed
    after = steps(a)[steps(a).index(failed) + 1 :]
    assert len(after) == 3 and all(line["committed"] for line in after), a.describe()
    assert after[0]["step"] == failed["step"], "the failed step is run again, alone"
    assert {line["participants"] for line in after} == {1}
    assert [line["value"] for line in after] == [[1.0] * 4] * 3
    together = [line for line in steps(a) if line["participants"] == 2 and line["committed"]]
    assert together and all(line["value"] == [2.0] * 4 for line in together)
    assert not any("Traceback" in line for line in a.stderr), "\n".join(a.stderr)


# Slow: four ranks with FSDP2 under the hook (about 25 s).
@pytest.mark.slow
def test_fsdp2_inside_groups_with_the_all_reduce_hook_over_it(spawn, tmp_path):
    """Two groups of 2 ranks: FSDP2 shards over a group's ranks, the hook averages
    each shard's gradient across the groups. Every rank ends with the parameters of
    one process training on the four ranks' batches."""
    from torchft_pg_group import LR, batch, build_model

    n_steps = 4
    ranks: list[Child] = []
    with phalanx.LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2, join_timeout=0.3, heartbeat_timeout=5.0
    ) as lighthouse:
        for index, name in enumerate("ab"):
            port = free_port()
            for rank in (0, 1):
                env = {
                    "PHALANX_REPLICA_ID": name,
                    "PHALANX_LIGHTHOUSE": lighthouse.address,
                    "RANK": str(rank),
                    "WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "OMP_NUM_THREADS": "1",
                }
                save = str(tmp_path / f"{name}{rank}.pt")
                argv = ("fsdp", "--steps", str(n_steps), "--data-index", str(index), "--save", save)
                ranks.append(start(spawn, f"{name}/{rank}", *argv, env=env))
        for child in ranks:
            child.expect(lambda line: line.get("event") == "done", 120, "training finishes")
            assert child.wait(timeout=30) == 0, child.describe()

    for child in ranks:
        lines = steps(child)
        assert [line["committed"] for line in lines] == [True] * n_steps, child.describe()
        assert [line["participants"] for line in lines] == [2] * n_steps
        losses = [line["loss"] for line in lines]
        assert losses[-1] < losses[0], f"{child.name}: the loss did not fall: {losses}"
        assert {line["world"][1] for line in lines} == {2}
        assert {line["world"][2] for line in lines} == {"phalanx-managed"}
    for rank in (0, 1):
        for step in range(n_steps):
            at = [steps(c)[step] for c in ranks if c.name.endswith(f"/{rank}")]
            assert {line["world"][0] for line in at} == {0, 1}, "each group its replica rank"
            assert len({line["loss_sum"] for line in at}) == 1
            assert at[0]["loss_sum"] == pytest.approx(sum(line["loss"] for line in at))

    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    parts = [batch(index, rank) for index in range(2) for rank in range(2)]
    x, y = torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
    for _ in range(n_steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    saved = {name: torch.load(tmp_path / f"{name}.pt") for name in ("a0", "a1", "b0", "b1")}
    for key, want in model.state_dict().items():
        first = saved["a0"][key]
        for name, state in saved.items():
            assert torch.equal(state[key], first), f"{name} differs from a0 in {key}"
        torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-6, msg=key)
