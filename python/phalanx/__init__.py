"""phalanx: fault-tolerant distributed training for PyTorch.

Every training step is a transaction over the replica groups alive right now: a
failed group drops out, the rest commit the step, and a recovered group heals by
streaming live state from its peers.

The Rust core is exposed here: a lighthouse (one per job), a manager server (one
per replica group) and their clients.

>>> import phalanx
>>> with phalanx.LighthouseServer(bind="127.0.0.1:0", join_timeout=0.05) as lighthouse:
...     client = phalanx.LighthouseClient(lighthouse.address)
...     quorum = client.quorum("group-a", timeout=5.0)
...     [m.replica_id for m in quorum.participants]
['group-a']

The training side — `Manager`, `Optimizer`, `DistributedDataParallel` — imports torch
and is loaded on first use, so that `phalanx lighthouse` starts without it.
"""

from typing import TYPE_CHECKING, Any

from phalanx._core import (
    PROTOCOL_VERSION,
    LighthouseClient,
    LighthouseServer,
    LighthouseStatus,
    ManagerClient,
    ManagerServer,
    Member,
    MembershipLost,
    Quorum,
    QuorumRequest,
    QuorumResult,
    RecoverySource,
    ReplicaStatus,
    __version__,
)

if TYPE_CHECKING:
    from phalanx.ddp import DistributedDataParallel
    from phalanx.diloco import DiLoCo, LocalSGD
    from phalanx.hsdp import fully_shard_hsdp
    from phalanx.manager import LighthouseUnreachableError, Manager
    from phalanx.optim import Optimizer

_LAZY = {
    "Manager": "phalanx.manager",
    "Optimizer": "phalanx.optim",
    "DistributedDataParallel": "phalanx.ddp",
    "DiLoCo": "phalanx.diloco",
    "LocalSGD": "phalanx.diloco",
    "fully_shard_hsdp": "phalanx.hsdp",
    "LighthouseUnreachableError": "phalanx.manager",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'phalanx' has no attribute {name!r}")


__all__ = [
    "PROTOCOL_VERSION",
    "DiLoCo",
    "DistributedDataParallel",
    "LocalSGD",
    "Manager",
    "Optimizer",
    "LighthouseClient",
    "LighthouseServer",
    "LighthouseStatus",
    "LighthouseUnreachableError",
    "ManagerClient",
    "ManagerServer",
    "Member",
    "MembershipLost",
    "Quorum",
    "QuorumRequest",
    "QuorumResult",
    "RecoverySource",
    "ReplicaStatus",
    "__version__",
    "fully_shard_hsdp",
]
