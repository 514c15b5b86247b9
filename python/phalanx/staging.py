"""Host memory for the GPU tensors of a transfer: sockets read and write host memory,
so a GPU's tensors travel through a copy there.

The copies of one transfer share one block of pinned host memory, cut into a tensor
per GPU tensor, and are made with one wait for the device at the end. Pinning costs
per call more than per byte: on an H200, 1 GiB of a model's state in 385 tensors took
0.93-0.98 s to pin as a block per tensor, 0.43-0.61 s as one block. A pageable block
is cheaper to take (0.08-0.09 s with its first touch) but slower to copy through, and
a 1 GiB heal through it ran at 1.30 GB/s against 1.69 through one pinned block (1.05
through a pinned block per tensor); the source's `open()` took 0.88 s against 0.55.

>>> import torch
>>> views = host_views([(torch.float32, torch.Size([2, 3])), (torch.int64, torch.Size([]))])
>>> [tuple(v.shape) for v in views], [v.dtype for v in views]
([(2, 3), ()], [torch.float32, torch.int64])
>>> views[1].data_ptr() - views[0].data_ptr()  # each view starts on a 64-byte boundary
64
>>> to_host([torch.ones(2)])[0]
tensor([1., 1.])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: Where each tensor starts in the block: any dtype's alignment, and a cache line.
ALIGN = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def host_views(
    specs: Sequence[tuple[torch.dtype, torch.Size]], pin: bool | None = None
) -> list[torch.Tensor]:
    """A host tensor of each (dtype, shape), all cut from one block of memory, pinned
    (`pin`; default: where CUDA is available) for copies to and from a GPU."""
    if not specs:
        return []  # no block, and no CUDA context for a state without GPU tensors
    if pin is None:
        pin = torch.cuda.is_available()
    offsets, total = [], 0
    for dtype, shape in specs:
        offsets.append(total)
        total += _aligned(shape.numel() * dtype.itemsize)
    block = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    return [
        block[at : at + shape.numel() * dtype.itemsize].view(dtype).view(shape)
        for at, (dtype, shape) in zip(offsets, specs, strict=True)
    ]


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (GPU tensors, or CPU ones) in one block of host memory,
    complete when it returns."""
    views = host_views([(t.dtype, t.shape) for t in tensors])
    for view, tensor in zip(views, tensors, strict=True):
        view.copy_(tensor, non_blocking=tensor.is_cuda)
    _wait_for_devices(tensors)
    return views


def to_devices(copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copies each (host, device) pair's host tensor into its device tensor; complete
    when it returns (the host tensors may be freed then)."""
    for host, device in copies:
        device.copy_(host, non_blocking=True)
    _wait_for_devices([device for _, device in copies])


def _wait_for_devices(tensors: Sequence[torch.Tensor]) -> None:
    for index in sorted({t.device.index or 0 for t in tensors if t.is_cuda}):
        torch.cuda.synchronize(index)
