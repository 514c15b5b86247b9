"""`phalanx.DistributedDataParallel`: data parallelism across replica groups, with the
gradients averaged over the current quorum.

Gradients are gathered into buckets as backward produces them; each full bucket's
all-reduce starts at once, overlapping the rest of the backward pass, and each
gradient becomes a view of its averaged bucket before the optimizer steps.

A bucket's flat tensor is used again by a later step only once its all-reduce has
completed: gloo cannot cancel a collective, so one abandoned by a failed step may
still write into its tensor, which is then left to it. Reusing the others saves a
fresh allocation per bucket and step, which measured dearer than the copy into it
(docs/benchmarks.md, step overhead).
"""

from __future__ import annotations

import contextlib
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


class _Flat:
    """A bucket's flat tensor, and its slice for each parameter in the parameter's
    shape (made once: a kept flat tensor serves many steps)."""

    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype, device: torch.device):
        self.tensor = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
        self.parts: list[torch.Tensor] = []
        offset = 0
        for p in params:
            n = p.numel()
            self.parts.append(self.tensor[offset : offset + n].view(p.shape))
            offset += n
        start = self.tensor.data_ptr()
        self._span = range(start, start + self.tensor.numel() * self.tensor.element_size())

    def holds_any(self, tensors: list[torch.Tensor]) -> bool:
        """Whether one of `tensors` lives in this flat tensor."""
        return any(t.data_ptr() in self._span for t in tensors)


class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.ready = 0
        self.launched = False
        #: Flat tensors whose all-reduce completed: nothing writes into them any more.
        self.done: list[_Flat] = []

    def launch(self, manager: Manager) -> None:
        self.launched = True
        self.ready = 0
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        ranks = manager.group_world_size
        # Each rank's share of the average is taken as the gradients are gathered: one
        # pass over them, not a division after the sum. Without a quorum (the step
        # failed) no collective follows, and the share is moot.
        manager.wait_quorum()
        flat = self._flat(grads, 1.0 / (ranks * max(1, manager.num_participants())))
        settled = True
        if ranks > 1:
            # Inside the group first, even when the step failed, so that its ranks stay
            # in step (a plain collective: a rank's death ends the group anyway), then
            # across the groups of the quorum.
            try:
                manager.group_process_group().allreduce([flat.tensor]).wait()
            except RuntimeError as e:
                settled = False  # it may still write into `flat`
                manager.report_error(f"all-reduce inside the group failed: {e}")
        then = lambda _: self._scatter(flat, settled)  # noqa: E731
        manager.allreduce(flat.tensor, then=then, average=False)

    def _flat(self, grads: list[torch.Tensor], share: float) -> _Flat:
        """The gradients times `share`, in one flat tensor that no later write of an
        abandoned collective can reach, and that none of them lives in."""
        dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads))
        device = grads[0].device
        flat = self._take_done(grads, dtype, device) or _Flat(self.params, dtype, device)
        for g, part in zip(grads, flat.parts, strict=True):
            if g.dtype == dtype:
                torch.mul(g, share, out=part)
            else:  # widened first, so that the share is taken at the bucket's precision
                part.copy_(g).mul_(share)
        return flat

    def _take_done(
        self, grads: list[torch.Tensor], dtype: torch.dtype, device: torch.device
    ) -> _Flat | None:
        """A kept flat tensor of `dtype` on `device` that none of `grads` lives in."""
        for i, kept in enumerate(self.done):
            t = kept.tensor
            if t.dtype == dtype and t.device == device and not kept.holds_any(grads):
                return self.done.pop(i)
        return None

    def _scatter(self, flat: _Flat, settled: bool) -> None:
        """Each gradient becomes its slice of the averaged bucket: no copy back. The
        bucket's all-reduce is done (`settled`: inside the group too), so nothing
        writes into it later but this bucket, at a later step, once the gradients
        are elsewhere; a parameter of another dtype than the bucket takes a copy."""
        if settled:
            self.done = [flat, *self.done][:KEPT_FLATS]
        for p, part in zip(self.params, flat.parts, strict=True):
            p.grad = part if part.dtype == p.dtype else part.to(p.dtype)


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
        self._sync = True
        manager.register_pre_commit(self._flush)
        # Its forward builds the graph a heal must not touch (I13).
        manager.watch_forward(module)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate their gradients locally and average
        nothing; the step's last backward, outside, averages the sum (gradient
        accumulation, as with torch's DDP)::

            with model.no_sync():
                loss_fn(model(x1), y1).backward()
            loss_fn(model(x2), y2).backward()
        """
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _hook(self, bucket: _Bucket):
        def ready(_: torch.Tensor) -> None:
            if not self._sync:
                return
            if bucket.launched:
                # Its gradients are averaged views already: this backward added
                # local ones to them, which no other group applies (I1).
                self._manager.report_error(
                    "a second backward pass in one step added to gradients already "
                    "averaged over the quorum; wrap every backward of the step but its "
                    "last in `with model.no_sync():`"
                )
                return
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                bucket.launch(self._manager)

        return ready

    def _flush(self) -> None:
        """Before the vote: a bucket some of whose parameters got no gradient this
        step (an unused branch) is reduced too, so every group applies the same."""
        for bucket in self._buckets:
            if not bucket.launched:
                bucket.launch(self._manager)
            bucket.launched = False
            bucket.ready = 0

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
