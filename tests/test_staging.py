"""Host memory for the GPU tensors of a transfer (`phalanx.staging`): one block cut
into a tensor per (dtype, shape), each aligned, none overlapping; copies through it
keep every byte. A GPU's copies are checked by benches/gpu_check.py."""

from __future__ import annotations

from itertools import pairwise

import torch

from phalanx.staging import ALIGN, host_views, to_devices, to_host

SPECS = [
    (torch.float32, torch.Size([3, 5])),
    (torch.bool, torch.Size([7])),
    (torch.float16, torch.Size([0])),
    (torch.int64, torch.Size([])),
    (torch.bfloat16, torch.Size([2, 2, 3])),
    (torch.complex64, torch.Size([4])),
]


def test_one_block_cut_into_aligned_views_that_do_not_overlap():
    views = host_views(SPECS, pin=False)
    assert [(v.dtype, v.shape) for v in views] == SPECS
    assert all(v.is_contiguous() for v in views)
    base = views[0].untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == base for v in views)  # one block
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views)
    assert all(start % ALIGN == 0 for start, _ in spans)
    assert all(end <= after for (_, end), (after, _) in pairwise(spans))


def test_copies_through_the_block_keep_every_byte():
    generator = torch.Generator().manual_seed(3)
    tensors = [
        torch.randint(0, 2, shape, generator=generator).to(dtype)
        if dtype == torch.bool
        else torch.randn(shape, generator=generator).to(dtype)
        for dtype, shape in SPECS
    ]
    host = to_host(tensors)
    assert all(torch.equal(h, t) for h, t in zip(host, tensors, strict=True))
    host[0].add_(1)  # copies, not the tensors themselves
    assert not torch.equal(host[0], tensors[0])
    targets = [torch.empty_like(t) for t in tensors]
    to_devices(list(zip(host, targets, strict=True)))
    assert all(torch.equal(a, h) for a, h in zip(targets, host, strict=True))


def test_a_state_without_gpu_tensors_takes_no_block(monkeypatch):
    # Pinning would start a CUDA context on a machine with a GPU: a CPU state's
    # transfer must not take one.
    def no_block(*args, **kwargs):
        raise AssertionError("a block was taken")

    monkeypatch.setattr(torch, "empty", no_block)
    assert host_views([], pin=True) == []
    assert to_host([]) == []
