"""An int8 codec with one scale per block of values, and an all-reduce that averages
a tensor over the quorum with int8 codes on the wire: about a quarter of the bytes of
float32, for DiLoCo's pseudo-gradients, which tolerate the rounding.

The codes of several groups are summed on the wire, so they must share their scales
and their sum must fit in an int8. Each block's scale is therefore taken from the
*sum* over the groups of the block's largest magnitude (one small float32 all-reduce
first), divided by a code range that leaves room for every group's rounding. The
rounding error of the average is then at most half a scale per value.

>>> import torch
>>> from phalanx.quantize import block_absmax, decode, encode, round_trip_scales
>>> x = torch.tensor([0.5, -1.0, 0.25, 0.0, 3.0, 2.0])
>>> scales = round_trip_scales(block_absmax(x, block=3))
>>> codes = encode(x, scales, block=3)
>>> codes.tolist()
[64, -127, 32, 0, 127, 85]
>>> (decode(codes, scales, block=3) - x).abs().max().item() <= scales.max().item() / 2
True
"""

from __future__ import annotations

import torch

from phalanx.manager import Manager

__all__ = [
    "BLOCK",
    "Int8Allreduce",
    "allreduce_int8",
    "block_absmax",
    "decode",
    "encode",
    "round_trip_scales",
    "shared_scales",
    "sum_limit",
]

#: Values per scale: a float32 scale costs 4 / BLOCK bytes per value (1.6 %).
BLOCK = 256
INT8_MAX = 127


def _blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    """`x` flattened to float32 and zero-padded to whole blocks, one block per row."""
    if block < 1:
        raise ValueError(f"block must be a positive number of values, got {block}")
    flat = x.detach().reshape(-1).float()
    pad = -flat.numel() % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


def block_absmax(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The largest magnitude of each block of `x` (float32, one per block)."""
    return _blocked(x, block).abs().amax(dim=1)


def round_trip_scales(absmax: torch.Tensor) -> torch.Tensor:
    """Scales for one tensor on its own: its largest value maps to code 127."""
    return absmax / INT8_MAX


def sum_limit(contributors: int) -> int:
    """The largest code each of `contributors` groups may send so that their sum,
    rounding included, never leaves the int8 range (with half a code to spare)."""
    if not 1 <= contributors <= 100:
        raise ValueError(
            f"an int8 sum over {contributors} groups leaves too few codes per group; "
            "quantize only with 1 to 100 contributing groups"
        )
    return INT8_MAX - 1 - contributors // 2


def shared_scales(absmax_sum: torch.Tensor, contributors: int) -> torch.Tensor:
    """Scales every group uses when `absmax_sum` is the sum over the `contributors`
    groups of their `block_absmax`: |sum of codes| <= |sum of x| / scale + n / 2."""
    return absmax_sum / sum_limit(contributors)


def encode(x: torch.Tensor, scales: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """int8 codes of `x` (flattened, padded to whole blocks): round(x / scale),
    clamped to +-127; a block whose scale is 0 is all zeros."""
    rows = _blocked(x, block)
    if scales.numel() != rows.shape[0]:
        raise ValueError(f"{scales.numel()} scales for {rows.shape[0]} blocks of {block}")
    s = scales.float().view(-1, 1)
    codes = torch.where(s > 0, rows / torch.where(s > 0, s, 1.0), 0.0).round_()
    return codes.clamp_(-INT8_MAX, INT8_MAX).to(torch.int8).view(-1)


def decode(codes: torch.Tensor, scales: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """float32 values of `codes` (padding included; slice to the length you encoded)."""
    return (codes.view(-1, block).float() * scales.float().view(-1, 1)).view(-1)


class Int8Allreduce:
    """An average of `tensor` over the quorum in flight, with int8 codes on the wire.

    The block scales are agreed first (a float32 all-reduce of 1/BLOCK the size,
    waited for at once); the codes' sum then runs in the background until `wait()`.
    Like `Manager.allreduce`, nothing raises for a peer's failure: `wait()` returns
    False and the step's vote will be "no".
    """

    def __init__(self, manager: Manager, tensor: torch.Tensor, block: int = BLOCK):
        self._tensor = tensor
        self._block = block
        self._codes_handle = None
        absmax = block_absmax(tensor, block)
        if not manager.allreduce(absmax).wait():
            return
        contributors = manager.num_participants()
        if not torch.isfinite(absmax).all():
            manager.report_error("the tensor to reduce holds inf or nan; nothing to quantize")
            return
        # The average of the groups' largest magnitudes, times their number: the sum.
        self._scales = shared_scales(absmax * contributors, contributors)
        self._contributors = contributors
        self._codes = encode(tensor, self._scales, block)
        self._codes_handle = manager.allreduce(self._codes, average=False)

    @property
    def wire_bytes(self) -> int:
        """Bytes handed to the all-reduces: codes and scales."""
        blocks = -(-self._tensor.numel() // self._block)
        return self._tensor.numel() + 4 * blocks

    def wait(self) -> bool:
        """True when `tensor` now holds the average over the participants."""
        if self._codes_handle is None or not self._codes_handle.wait():
            return False
        average = decode(self._codes, self._scales, self._block)[: self._tensor.numel()]
        average.div_(self._contributors)
        self._tensor.copy_(average.view_as(self._tensor))
        return True


def allreduce_int8(manager: Manager, tensor: torch.Tensor, block: int = BLOCK) -> Int8Allreduce:
    """Starts averaging `tensor` in place over the quorum with int8 codes on the wire
    (see `Int8Allreduce`); call `.wait()` on the result."""
    return Int8Allreduce(manager, tensor, block)
