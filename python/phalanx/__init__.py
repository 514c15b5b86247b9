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
"""

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
    QuorumResult,
    RecoverySource,
    ReplicaStatus,
    __version__,
)

__all__ = [
    "PROTOCOL_VERSION",
    "LighthouseClient",
    "LighthouseServer",
    "LighthouseStatus",
    "ManagerClient",
    "ManagerServer",
    "Member",
    "MembershipLost",
    "Quorum",
    "QuorumResult",
    "RecoverySource",
    "ReplicaStatus",
    "__version__",
]
