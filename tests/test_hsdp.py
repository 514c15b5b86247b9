"""HSDP with real processes: 2 replica groups of 2 ranks each (gloo), FSDP2 inside a
group and phalanx's fault-tolerant all-reduce across groups. Without failures the
result is plain single-process training on the combined batch; with a group killed
mid-run the survivor goes on, the restarted group heals shard by shard, and at every
committed step each shard is bit-identical to its peer's (I1). DTensor state heals
into its own local shards, or into new DTensors for a fresh optimizer."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx.recovery import IncompatibleStateError, StateHost, heal

from conftest import PROCS, TESTS, Child, child_env, commit_after, free_port

HSDP_PROCESS = PROCS / "hsdp_process.py"


def start_group(
    spawn: Callable[..., Child],
    lighthouse: str,
    replica_id: str,
    data_index: int,
    *flags: str,
    seeds: tuple[int, int] = (-1, -1),
) -> list[Child]:
    port = free_port()
    ranks = []
    for rank in (0, 1):
        env = {
            "PHALANX_REPLICA_ID": replica_id,
            "PHALANX_LIGHTHOUSE": lighthouse,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        argv = [
            sys.executable,
            str(HSDP_PROCESS),
            "--data-index",
            str(data_index),
            "--seed",
            str(seeds[rank]),
            *flags,
        ]
        ranks.append(spawn(f"{replica_id}/{rank}", argv, env))
    return ranks


def committed(child: Child) -> list[dict]:
    return [line for line in child.lines if line.get("event") == "step" and line["committed"]]


def assert_shards_bit_identical(children: list[Child]) -> int:
    """After every step that two or more groups committed in the same quorum, rank i
    of each holds the same bytes (model and optimizer shards). Returns how many
    (quorum, step, rank) were compared."""
    hashes: dict[tuple[int, int, int], set[str]] = defaultdict(set)
    reached: dict[tuple[int, int, int], int] = defaultdict(int)
    for child in children:
        for line in committed(child):
            key = (line["quorum_id"], line["after"], line["rank"])
            hashes[key].add(line["hash"])
            reached[key] += 1
    compared = [key for key, n in reached.items() if n >= 2]
    diverged = {key: hashes[key] for key in compared if len(hashes[key]) > 1}
    assert not diverged, f"shards diverged at (quorum, step, rank) {sorted(diverged)}"
    return len(compared)


# Slow: two groups of two ranks against one process, step by step (about 30 s).
@pytest.mark.slow
def test_hsdp_trains_like_one_process_on_the_combined_batch(spawn, tmp_path):
    from hsdp_process import batch, build_model, build_optimizer

    steps = 6
    with phalanx.LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2, join_timeout=0.3, heartbeat_timeout=5.0
    ) as lighthouse:
        groups = {
            # Only group a's rank 0 starts from seed 0: phalanx makes the others agree.
            name: start_group(
                spawn,
                lighthouse.address,
                name,
                index,
                "--steps",
                str(steps),
                "--optimizer",
                "sgd",
                "--save",
                str(tmp_path / f"{name}.pt"),
                seeds=(0, 7) if name == "a" else (8, 9),
            )
            for index, name in enumerate("ab")
        }
        for child in groups["a"] + groups["b"]:
            child.expect(lambda line: line.get("event") == "done", 90, "training finishes")

    lines = committed(groups["a"][0])
    assert [line["after"] for line in lines] == list(range(1, steps + 1))
    # Step 0 is group a's alone (group b heals to a's weights and adds zeros).
    assert [line["participants"] for line in lines] == [1] + [2] * (steps - 1)

    model = build_model(0)
    optimizer = build_optimizer("sgd", model.parameters())
    for line in lines:
        parts = [batch(line["step"], index, rank) for index in range(2) for rank in range(2)]
        parts = parts[: 2 * line["participants"]]
        x, y = torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    a, b = (torch.load(tmp_path / f"{name}.pt") for name in "ab")
    expected = model.state_dict()
    for key, value in expected.items():
        assert torch.equal(a[key], b[key]), f"groups differ in {key}"
        torch.testing.assert_close(a[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert assert_shards_bit_identical(groups["a"] + groups["b"]) == 2 * steps


@pytest.mark.slow
def test_a_killed_group_heals_shard_by_shard_while_the_survivor_trains(spawn):
    # Trains until the test has seen enough, whatever the speed of the machine.
    # A user's model of several layers, its loop asking nothing before the forward.
    flags = ("--steps", "100000", "--step-sleep", "0.05", "--optimizer", "adam", "--timeout", "8")
    flags += ("--model", "convnet")
    with phalanx.LighthouseServer(
        bind="127.0.0.1:0", join_timeout=0.3, heartbeat_timeout=2.0
    ) as lighthouse:
        a = start_group(spawn, lighthouse.address, "a", 0, *flags)
        b = start_group(spawn, lighthouse.address, "b", 1, *flags)
        for _ in range(4):  # steps with a, not alone before a has started
            joint = b[0].expect(
                lambda line: line.get("committed") and line["participants"] == 2,
                60,
                "b commits a step together with a",
            )

        b[1].signal(signal.SIGKILL)
        killed_at = time.time()
        commit_after(a, killed_at, "a commits alone")
        # A rank's death ends its replica group: the other rank's FSDP2 collective fails.
        assert b[0].wait(timeout=30) != 0
        b2 = start_group(spawn, lighthouse.address, "b", 1, *flags)
        for child in b2:
            child.expect(
                lambda line, child=child: len(committed(child)) >= 10,
                60,
                "the restarted group commits 10 steps",
            )
        last = max(line["after"] for child in b2 for line in committed(child))
        for child in a:
            child.expect(lambda line: line.get("after", 0) >= last, 30, "a reaches b's step")

    for child in b2:
        assert any("healed to step" in line for line in child.stderr), child.describe()
        first = committed(child)[0]["after"]
        assert first > joint["after"], f"{child.name} resumed at step {first}, not its peers'"
        ready = next(line for line in child.lines if line.get("event") == "ready")
        assert committed(child)[0]["t"] - ready["t"] < 2.0, "b took over 2 s to commit again"
    after_kill = {line["participants"] for line in committed(a[0]) if line["t"] > killed_at + 0.5}
    assert after_kill == {1, 2}, "a trained alone, then with the healed group"
    assert assert_shards_bit_identical(a + b + b2) >= 2 * (4 + 10)

    # Every step the healed group committed, the survivor committed with the same shards.
    def steps(children: list[Child]) -> set[tuple[int, int, int]]:
        return {(x["quorum_id"], x["after"], x["rank"]) for c in children for x in committed(c)}

    assert steps(b2) <= steps(a)
    pids = {line["pid"] for line in a[0].lines if line.get("event") == "ready"}
    assert len(pids) == 1, "the surviving group restarted"


# -- DTensor state through recovery (one process, a mesh of one rank) ------------------


@pytest.fixture
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    finally:
        dist.destroy_process_group()


def shard(t: torch.Tensor, mesh, placement=None):
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(t, mesh, [placement or Shard(0)])


def test_dtensor_state_heals_into_its_own_shards_and_into_a_fresh_optimizer(mesh):
    from torch.distributed.tensor import DTensor, Shard

    served = {
        "model": {"w": shard(torch.arange(6.0).reshape(3, 2), mesh)},
        "optim": {
            "state": {0: {"step": torch.tensor(4.0), "m": shard(torch.full((3, 2), 2.0), mesh)}}
        },
    }
    mine = {"model": {"w": shard(torch.zeros(3, 2), mesh)}, "optim": {"state": {}}}
    before = mine["model"]["w"].to_local().data_ptr()
    with StateHost(bind="127.0.0.1:0") as host:
        host.open(step=4, quorum_id=2, state=served)
        healed = heal([host.address], 4, 2, mine)
        host.close()

    w = healed["model"]["w"]
    assert w is mine["model"]["w"] and w.to_local().data_ptr() == before
    assert torch.equal(w.to_local(), torch.arange(6.0).reshape(3, 2))
    m = healed["optim"]["state"][0]["m"]
    assert isinstance(m, DTensor), "a fresh optimizer's state must come back as a DTensor"
    assert m.device_mesh is mesh and m.placements == (Shard(0),) and m.shape == (3, 2)
    assert torch.equal(m.to_local(), torch.full((3, 2), 2.0))


def test_dtensor_state_of_another_layout_is_refused_with_the_cause(mesh):
    from torch.distributed.tensor import Replicate

    served = {"model": {"w": shard(torch.ones(4, 2), mesh)}}
    cases = {
        "sharded differently": shard(torch.zeros(4, 2), mesh, Replicate()),
        "a DTensor on the sources but a plain tensor": torch.zeros(4, 2),
    }
    with StateHost(bind="127.0.0.1:0") as host:
        host.open(step=1, quorum_id=1, state=served)
        for cause, local in cases.items():
            with pytest.raises(IncompatibleStateError, match=cause):
                heal([host.address], 1, 1, {"model": {"w": local}})
        with pytest.raises(IncompatibleStateError, match="holds none of that layout"):
            heal([host.address], 1, 1, {"model": {}})
        host.close()


# -- the API around it -----------------------------------------------------------------


PRESHARDED = """
import torch, phalanx
from torch.distributed.fsdp import fully_shard
from phalanx.hsdp import shard_mesh
with phalanx.LighthouseServer(bind="127.0.0.1:0", join_timeout=0.05) as lighthouse:
    manager = phalanx.Manager(replica_id="solo", lighthouse=lighthouse.address)
    model = fully_shard(torch.nn.Linear(4, 2), mesh=shard_mesh(manager))
    try:
        phalanx.fully_shard_hsdp(model, manager, units=[model])
    except ValueError as e:
        print("refused:", e)
    model = phalanx.fully_shard_hsdp(model, manager)
    optimizer = phalanx.Optimizer(manager, torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer.zero_grad()
    model(torch.ones(1, 4)).sum().backward()
    print("committed:", optimizer.step())
    manager.shutdown()
"""


def run_python(code: str) -> str:
    """Runs `code` in a child: it makes torch.distributed's default group of its process."""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        cwd=TESTS.parent,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_the_docstring_example_runs():
    out = run_python("import doctest, phalanx.hsdp as m; print(*doctest.testmod(m))")
    failed, attempted = map(int, out.split()[-2:])
    assert attempted > 0 and failed == 0, out


@pytest.mark.slow
def test_a_model_sharded_by_the_caller_over_the_group_is_taken_as_it_is():
    out = run_python(PRESHARDED)
    assert "refused: the model is sharded already" in out
    assert "committed: True" in out


def test_a_model_it_cannot_shard_is_named_before_any_process_group_exists(lighthouse):
    with phalanx.Manager(replica_id="solo", lighthouse=lighthouse.address) as manager:
        model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        with pytest.raises(ValueError, match="not a submodule"):
            phalanx.fully_shard_hsdp(model, manager, units=[torch.nn.Linear(2, 2)])
        with pytest.raises(ValueError, match="meta device"):
            phalanx.fully_shard_hsdp(torch.nn.Linear(2, 2, device="meta"), manager)
    assert not dist.is_initialized()
