"""`phalanx.DistributedDataParallel` numerics: two groups (threads of this process,
each with its own Manager, over a real lighthouse and gloo) against one process that
averages the two groups' gradients by hand.

The model's one bucket holds a parameter of another dtype (bf16) and one that gets
no gradient, so the bucket is launched by the flush before the vote and cast back
per parameter. The second step zeroes the gradients in place, so it accumulates into
the first step's averaged bucket; the third takes that bucket's flat tensor again.
A flat tensor whose all-reduce did not complete is never taken again.
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

import phalanx

from conftest import free_port, in_groups, leave_together, manager_for

LR = 0.1
STEPS = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.scale = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        self.unused = nn.Linear(2, 2)
        with torch.no_grad():
            for p in self.body.parameters():
                p.copy_(torch.rand(p.shape, generator=g) - 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale.float()


INITIAL = Net()


def batch(replica: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 31 + ord(replica))
    x = torch.randn(16, 4, generator=g)
    return x, torch.stack([x.sum(1), x[:, 0] * x[:, 1]], dim=1)


def loss(model: nn.Module, replica: str, step: int) -> torch.Tensor:
    x, y = batch(replica, step)
    return nn.functional.mse_loss(model(x), y)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def test_two_groups_apply_the_average_of_their_gradients(lighthouse2):
    def group(name: str, barrier: threading.Barrier) -> list[torch.Tensor]:
        # Every group starts from the same weights, so none heals at step 0 and
        # both gradients count from the first step.
        manager = manager_for(lighthouse2, name, init_sync=False)
        try:
            model = copy.deepcopy(INITIAL)
            ddp = phalanx.DistributedDataParallel(model, manager)
            optimizer = phalanx.Optimizer(manager, torch.optim.SGD(model.parameters(), lr=LR))
            flats = []
            for step in range(STEPS):
                optimizer.zero_grad(set_to_none=step != 1)
                loss(ddp, name, step).backward()
                assert optimizer.step(), f"step {step} did not commit"
                # The fp32 gradients are views of the one averaged bucket, not copies.
                fp32 = [p.grad for p in model.parameters() if p.dtype == torch.float32]
                assert len({g.untyped_storage().data_ptr() for g in fp32}) == 1
                flats.append(fp32[0])  # keeps the step's flat tensor alive
            # Step 1 accumulated into step 0's bucket, so it was copied into another;
            # step 2's gradients are fresh, and a kept flat tensor takes them.
            first, second, third = (_storage(g) for g in flats)
            assert first != second and third in (first, second)
            return [p.detach().clone() for p in model.parameters()]
        finally:
            leave_together(manager, barrier)

    got_a, got_b = in_groups(group)

    reference = copy.deepcopy(INITIAL)
    for step in range(STEPS):
        grads = []
        for name in "ab":
            reference.zero_grad()
            loss(reference, name, step).backward()
            grads.append(
                [
                    torch.zeros_like(p, dtype=torch.float) if p.grad is None else p.grad.float()
                    for p in reference.parameters()
                ]
            )
        assert not torch.equal(grads[0][0], grads[1][0]), "the groups saw the same data"
        with torch.no_grad():
            for p, ga, gb in zip(reference.parameters(), *grads, strict=True):
                p -= (LR * (ga + gb) / 2).to(p.dtype)
    for a, b, want in zip(got_a, got_b, reference.parameters(), strict=True):
        assert torch.equal(a, b), "the groups' replicas differ"
        assert a.dtype == want.dtype
        tol = 1e-2 if a.dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(a, want.detach(), rtol=tol, atol=tol)
    assert torch.equal(got_a[-2], INITIAL.unused.weight), "an unused parameter moved"


def test_a_failed_steps_bucket_is_not_taken_again(lighthouse):
    """gloo cannot cancel an all-reduce: one abandoned by a failed step may still
    write into its flat tensor, which no later step may hold its gradients in."""
    with manager_for(lighthouse, "a") as manager:
        model = copy.deepcopy(INITIAL)
        ddp = phalanx.DistributedDataParallel(model, manager)
        optimizer = phalanx.Optimizer(manager, torch.optim.SGD(model.parameters(), lr=LR))
        grads = []
        for step, fails in enumerate([False, False, True, False]):
            optimizer.zero_grad()
            if fails:
                manager.report_error("a peer died (as the test says)")
            loss(ddp, "a", step).backward()
            assert optimizer.step() is not fails
            grads.append(model.body[0].weight.grad)  # keeps its tensor alive
        committed, again, failed, after = (_storage(g) for g in grads)
        assert again == committed, "a completed bucket was not taken again"
        assert failed not in (committed, after)
        assert after != committed, "the failed step's flat tensor was taken again"


def test_the_ranks_of_a_group_apply_the_average_of_their_gradients(lighthouse):
    """Inside a group of two ranks the bucket is summed first, then across the groups:
    each rank's share of the average covers both sums."""
    port = free_port()
    managers = [
        phalanx.Manager(
            replica_id="a",
            lighthouse=lighthouse.address,
            group_rank=rank,
            group_world_size=2,
            store_port=port,
            timeout=10.0,
        )
        for rank in (0, 1)
    ]

    def rank(index: int) -> list[torch.Tensor]:
        model = copy.deepcopy(INITIAL)
        ddp = phalanx.DistributedDataParallel(model, managers[index])
        optimizer = phalanx.Optimizer(managers[index], torch.optim.SGD(model.parameters(), lr=LR))
        optimizer.zero_grad()
        loss(ddp, "ab"[index], 0).backward()
        assert optimizer.step(), "the step did not commit"
        return [p.grad.float() for p in model.parameters() if p.dtype == torch.float32]

    try:
        with ThreadPoolExecutor(2) as pool:
            got = [f.result(timeout=60) for f in [pool.submit(rank, i) for i in (0, 1)]]
    finally:
        for manager in managers:
            manager.shutdown()
    grads = []
    for name in "ab":
        reference = copy.deepcopy(INITIAL)
        loss(reference, name, 0).backward()
        grads.append([p.grad for p in reference.parameters() if p.dtype == torch.float32])
    for a, b, ga, gb in zip(*got, *grads, strict=True):
        assert torch.equal(a, b), "the ranks' gradients differ"
        want = torch.zeros_like(a) if ga is None else (ga + gb) / 2
        torch.testing.assert_close(a, want, rtol=1e-6, atol=1e-6)


def train_step(loop: str, manager, ddp, x: torch.Tensor, y: torch.Tensor, guard) -> None:
    """One step's forward and backward passes, as loops of each shape write them."""
    if loop == "accumulate":  # two micro-batches, the first under no_sync()
        with ddp.no_sync():
            with guard:
                out = ddp(x[:8])
            nn.functional.cross_entropy(out, y[:8]).backward()
        x, y = x[8:], y[8:]
    with guard:
        if loop == "checkpoint":  # fc1's activations recomputed during backward
            m = ddp.module
            h = torch.relu(m.conv2(torch.relu(m.conv1(x)))).flatten(1)
            h = torch.utils.checkpoint.checkpoint(m.fc1, h, use_reentrant=False)
            out = m.fc3(torch.relu(m.fc2(torch.relu(h))))
        else:
            out = ddp(x)
    if loop == "asks_after_forward":  # the quorum (and the heal) between the passes
        manager.wait_quorum()
    nn.functional.cross_entropy(out, y).backward()


@pytest.mark.parametrize("loop", ["plain", "asks_after_forward", "checkpoint", "accumulate"])
def test_a_group_that_heals_inside_its_backward_commits_its_first_step(lighthouse, loop):
    """The README's loop around a model of several buckets, asking the manager nothing
    before its forward: a group that joins late takes its quorum, and heals, in the
    first bucket's all-reduce, while backward still needs the other layers' weights.
    The healed state loads once its backward is done (I13): nothing autograd saved
    changes, the group commits its very first step, and both hold the same bits. Also
    with the quorum asked between the forward and the backward, activation
    checkpointing, and two backward passes a step (the first under `no_sync()`)."""
    from state_digest import state_hash
    from user_model import ConvNet, SavedTensorGuard, batch

    a_trained, b_done = threading.Event(), threading.Event()

    def group(name: str, barrier: threading.Barrier) -> dict[int, str]:
        if name == "b":
            assert a_trained.wait(60), "a never committed alone"
        manager = manager_for(lighthouse, name)
        try:
            torch.manual_seed(ord(name))  # the groups start apart: b must heal
            model = ConvNet()
            ddp = phalanx.DistributedDataParallel(model, manager)
            optimizer = phalanx.Optimizer(manager, torch.optim.Adam(model.parameters()))
            assert len(ddp._buckets) > 1
            hashes, guard = {}, SavedTensorGuard()
            for _ in range(200):
                if b_done.is_set() if name == "a" else len(hashes) == 3:
                    break
                step = manager.current_step()
                optimizer.zero_grad()
                x, y = batch(step, salt=ord(name))
                train_step(loop, manager, ddp, x, y, guard)
                committed = optimizer.step()
                if name == "b":
                    assert committed, f"b's step {step} did not commit: {manager.failure}"
                if committed:
                    hashes[manager.current_step()] = state_hash(model, optimizer.optimizer)
                if manager.current_step() >= 3:
                    a_trained.set()
            assert guard.checked > 0
            return hashes
        finally:
            if name == "b":
                b_done.set()
            leave_together(manager, barrier)

    a, b = in_groups(group)
    assert min(b) > 3, "b did not heal to a's step"
    assert all(a[step] == digest for step, digest in b.items()), "b's state differs from a's"


def test_a_second_backward_without_no_sync_fails_the_step_naming_the_fix(lighthouse):
    """Gradients added to already averaged ones would differ between the groups: the
    step fails (nothing is applied) and says what to change."""
    from user_model import ConvNet, batch

    with manager_for(lighthouse, "a") as manager:
        model = ConvNet()
        ddp = phalanx.DistributedDataParallel(model, manager)
        optimizer = phalanx.Optimizer(manager, torch.optim.SGD(model.parameters(), lr=LR))
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        x, y = batch(0)
        for half in (slice(0, 8), slice(8, 16)):
            nn.functional.cross_entropy(ddp(x[half]), y[half]).backward()
        assert not optimizer.step()
        assert "wrap every backward of the step but its last in `with model.no_sync():`" in (
            manager.last_step.failure
        )
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        # The next step, written as asked, commits.
        optimizer.zero_grad()
        with ddp.no_sync():
            nn.functional.cross_entropy(ddp(x[:8]), y[:8]).backward()
        nn.functional.cross_entropy(ddp(x[8:]), y[8:]).backward()
        assert optimizer.step()
