"""torchft's `DistributedDataParallel(manager, module)`: the module's gradients are
averaged over the step's participating groups, bucketed and overlapped with the
backward pass (`phalanx.DistributedDataParallel` underneath).

As in torchft it registers no state: the Manager's `state_dict` callbacks name what
a healing group receives. torch DDP's keyword arguments that phalanx's bucketing
makes moot are accepted and logged once; `bucket_cap_mb` sets the bucket size.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from phalanx.buckets import BUCKET_BYTES
from phalanx.ddp import DistributedDataParallel as _PhalanxDDP
from phalanx.torchft.manager import phalanx_manager

__all__ = ["DistributedDataParallel"]

log = logging.getLogger("phalanx.torchft")

#: torch DDP's arguments that mean nothing here: every bucket is reduced each step
#: (unused parameters included), each gradient becomes a view of its bucket, and the
#: devices are the module's own.
MOOT = frozenset(
    {
        "device_ids",
        "output_device",
        "dim",
        "broadcast_buffers",
        "find_unused_parameters",
        "gradient_as_bucket_view",
        "static_graph",
        "check_reduction",
    }
)


class DistributedDataParallel(_PhalanxDDP):
    """Wraps `module`; its gradients are averaged over the quorum of `manager` (a
    phalanx.torchft Manager)."""

    def __init__(self, manager: Any, module: nn.Module, **kwargs: Any) -> None:
        unknown = set(kwargs) - MOOT - {"bucket_cap_mb"}
        if unknown:
            raise TypeError(
                f"DistributedDataParallel got {', '.join(sorted(unknown))}, which phalanx "
                f"cannot honour; it takes bucket_cap_mb, and accepts {', '.join(sorted(MOOT))}"
            )
        if moot := sorted(set(kwargs) & MOOT):
            log.info(
                "DistributedDataParallel: %s not needed on phalanx (every bucket is reduced "
                "each step, unused parameters included)",
                ", ".join(moot),
            )
        mb = kwargs.get("bucket_cap_mb")
        bucket_bytes = BUCKET_BYTES if mb is None else int(float(mb) * 1024 * 1024)
        if bucket_bytes < 1:
            raise ValueError(f"bucket_cap_mb={mb!r} must be positive")
        core = phalanx_manager(manager, "DistributedDataParallel")
        super().__init__(module, core, bucket_bytes=bucket_bytes, name=None)
