"""torchft's `DistributedSampler`: a fixed shard of the dataset per rank of every
replica group, `num_replicas * num_replica_groups` shards in all.

As in torchft the split is static: while a group is down its shard is not read.
`phalanx.data.QuorumSampler` splits each committed step's samples over the groups
alive in it instead, so that no sample is skipped.

>>> sampler = DistributedSampler(range(8), replica_rank=1, num_replica_groups=2,
...                              group_rank=0, num_replicas=2, shuffle=False)
>>> sampler.global_rank, sampler.global_world_size, list(sampler)
(2, 4, [2, 6])
"""

from __future__ import annotations

import os
from typing import Any

from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler as _TorchSampler

__all__ = ["DistributedSampler"]


class DistributedSampler(_TorchSampler):
    """Shard `group_rank + num_replicas * replica_rank` of the dataset; `group_rank`
    and `num_replicas` (the group's rank and size) default to RANK and WORLD_SIZE."""

    def __init__(
        self,
        dataset: Dataset,
        replica_rank: int,
        num_replica_groups: int,
        group_rank: int | None = None,
        num_replicas: int | None = None,
        **kwargs: Any,
    ) -> None:
        if group_rank is None:
            group_rank = int(os.environ.get("RANK", "0"))
        if num_replicas is None:
            num_replicas = int(os.environ.get("WORLD_SIZE", "1"))
        if not 0 <= replica_rank < num_replica_groups:
            raise ValueError(
                f"replica_rank {replica_rank} is outside num_replica_groups="
                f"{num_replica_groups} (REPLICA_GROUP_ID and NUM_REPLICA_GROUPS under "
                "phalanx run)"
            )
        if not 0 <= group_rank < num_replicas:
            raise ValueError(f"group_rank {group_rank} is outside a group of {num_replicas}")
        self.global_rank = group_rank + num_replicas * replica_rank
        self.global_world_size = num_replicas * num_replica_groups
        super().__init__(
            dataset, num_replicas=self.global_world_size, rank=self.global_rank, **kwargs
        )
