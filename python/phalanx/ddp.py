"""`phalanx.DistributedDataParallel`: data parallelism across replica groups, with the
gradients averaged over the current quorum.

Gradients are gathered into buckets as backward produces them; each full bucket's
all-reduce starts at once, overlapping the rest of the backward pass, and each
gradient becomes a view of its averaged bucket before the optimizer steps.

A bucket's flat tensor is used again by a later step only once its all-reduce has
completed: gloo cannot cancel a collective, so one abandoned by a failed step may
still write into its tensor, which is then left to it. Reusing the others saves a
fresh allocation (and its page faults) per bucket and step.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from phalanx.buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES, cut
from phalanx.manager import Manager

#: Flat tensors a bucket keeps for later steps: two, so that gradients accumulated in
#: place into the last averaged bucket (zero_grad(set_to_none=False)) can be copied
#: into the other.
KEPT_FLATS = 2


class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.ready = 0
        self.launched = False
        #: Flat tensors whose all-reduce completed: nothing writes into them any more.
        self.done: list[torch.Tensor] = []

    def launch(self, manager: Manager) -> None:
        self.launched = True
        self.ready = 0
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = self._flat(grads)
        ranks = manager.group_world_size
        settled = True
        if ranks > 1:
            # Inside the group first, even when the step failed, so that its ranks stay
            # in step (a plain collective: a rank's death ends the group anyway), then
            # across the groups of the quorum.
            try:
                manager.group_process_group().allreduce([flat]).wait()
            except RuntimeError as e:
                settled = False  # it may still write into `flat`
                manager.report_error(f"all-reduce inside the group failed: {e}")
        manager.allreduce(flat, then=lambda t: self._scatter(t, ranks, settled))

    def _flat(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The gradients in one flat tensor that no later write of an abandoned
        collective can reach, and that none of them lives in."""
        dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads))
        for i, flat in enumerate(self.done):
            fits = flat.dtype == dtype and flat.device == grads[0].device
            if fits and not any(_inside(g, flat) for g in grads):
                del self.done[i]
                return torch.cat([g.reshape(-1) for g in grads], out=flat)
        return torch.cat([g.reshape(-1) for g in grads])

    def _scatter(self, flat: torch.Tensor, ranks: int, settled: bool) -> None:
        """Each gradient becomes its slice of the averaged bucket: no copy back. The
        bucket's all-reduce is done (`settled`: inside the group too), so nothing
        writes into it later but this bucket, at a later step, once the gradients
        are elsewhere; a parameter of another dtype than the bucket takes a copy."""
        if settled:
            self.done = [flat, *self.done][:KEPT_FLATS]
        if ranks > 1:
            flat.div_(ranks)
        offset = 0
        for p in self.params:
            n = p.numel()
            # `to` returns the view itself when the dtypes match.
            p.grad = flat[offset : offset + n].view(p.shape).to(p.dtype)
            offset += n


def _inside(tensor: torch.Tensor, flat: torch.Tensor) -> bool:
    return tensor.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def _buckets(params: list[nn.Parameter], limit: int) -> Iterator[list[nn.Parameter]]:
    """Parameters in reverse order (the order backward produces their gradients),
    cut into a first bucket of about FIRST_BUCKET_BYTES, then buckets of `limit`."""
    first = min(limit, FIRST_BUCKET_BYTES)
    return cut(reversed(params), lambda p: p.numel() * p.element_size(), limit, first)


class DistributedDataParallel(nn.Module):
    """Wraps an unmodified module; its gradients are averaged over the quorum.

    The module's state is registered with the manager as `name` ("model"), so a
    healing group receives it from its peers; with `name=None` the caller registers it.
    """

    def __init__(
        self,
        module: nn.Module,
        manager: Manager,
        bucket_bytes: int = BUCKET_BYTES,
        name: str | None = "model",
    ):
        super().__init__()
        self.module = module
        self._manager = manager
        if manager.group_world_size > 1:
            # Every rank of the group starts from group rank 0's weights.
            group = manager.group_process_group()
            for tensor in module.state_dict().values():
                group.broadcast([tensor], dist.BroadcastOptions()).wait()
        if name is not None:
            manager.register_state(name, module.state_dict, module.load_state_dict)
        params = [p for p in module.parameters() if p.requires_grad]
        self._buckets = [_Bucket(b) for b in _buckets(params, bucket_bytes)]
        for bucket in self._buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(self._hook(bucket))
        manager.register_pre_commit(self._flush)

    def _hook(self, bucket: _Bucket):
        def ready(_: torch.Tensor) -> None:
            bucket.ready += 1
            if bucket.ready == len(bucket.params) and not bucket.launched:
                bucket.launch(self._manager)

        return ready

    def _flush(self) -> None:
        """Before the vote: a bucket some of whose parameters got no gradient this
        step (an unused branch) is reduced too, so every group applies the same."""
        for bucket in self._buckets:
            if not bucket.launched:
                bucket.launch(self._manager)
            bucket.launched = False

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
