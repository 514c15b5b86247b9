"""Data for a job whose groups come and go: every committed step reads the next
samples of one stream, split among the groups of that step's quorum.

The job reads one endless stream of sample indices: the dataset in a seeded random
order, a fresh order each epoch. A step of a quorum of `n` groups of `W` ranks takes
the next `n * W * batch_size` indices; rank `r` of the group with replica rank `g`
reads the slice `(g * W + r) * batch_size` of them. The cursor moves only when the
step commits, and it is registered with the manager, so a healing group receives it
from its peers and continues from the same place.

What failures do to the samples:

- a step that does not commit (a group died in it, or any rank voted no) moves no
  cursor: the next step's groups, whoever they are, read those samples again;
- while a group is dead the stream is simply split among fewer groups: no sample is
  skipped because its group died;
- a healing group contributes zeros to its first step, so its share of that step is
  read but not learned from: one batch per recovery.

>>> sampler = QuorumSampler(num_samples=10, batch_size=2, seed=0)
>>> first = sampler.take(replica_rank=0, replica_world_size=2)
>>> second = sampler.take(replica_rank=1, replica_world_size=2)
>>> sampler.advance()                 # the step committed
>>> len(set(first + second)), sampler.cursor
(4, 4)
>>> sampler.take(replica_rank=0, replica_world_size=1) == sampler.stream(4, 2)
True
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx.manager import Manager

__all__ = ["QuorumSampler"]


class QuorumSampler:
    """Splits each step's global batch over the ranks of the groups in the quorum.

    The cursor (samples consumed by committed steps) is part of the recovered state:
    `manager.register_state("data", sampler.state_dict, sampler.load_state_dict)`.
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int = 0, shuffle: bool = True):
        if num_samples < 1:
            raise ValueError(f"the dataset has {num_samples} samples; it needs at least one")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        #: Samples consumed by committed steps.
        self.cursor = 0
        self._taken = 0
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        order = self._orders.get(epoch)
        if order is None:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                order = torch.randperm(self.num_samples, generator=g)
            else:
                order = torch.arange(self.num_samples)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = order
        return order

    def stream(self, start: int, count: int) -> list[int]:
        """Indices `start .. start + count` of the job's sample stream."""
        out: list[int] = []
        position = start
        while len(out) < count:
            epoch, offset = divmod(position, self.num_samples)
            chunk = self._order(epoch)[offset : offset + count - len(out)]
            out.extend(chunk.tolist())
            position += len(chunk)
        return out

    def take(
        self,
        replica_rank: int,
        replica_world_size: int,
        group_rank: int = 0,
        group_world_size: int = 1,
    ) -> list[int]:
        """This rank's samples for the step (one `batch_size`)."""
        if not 0 <= replica_rank < replica_world_size:
            raise ValueError(
                f"replica rank {replica_rank} outside a quorum of {replica_world_size} groups"
            )
        if not 0 <= group_rank < group_world_size:
            raise ValueError(f"group rank {group_rank} outside a group of {group_world_size}")
        self._taken = replica_world_size * group_world_size * self.batch_size
        slot = replica_rank * group_world_size + group_rank
        return self.stream(self.cursor + slot * self.batch_size, self.batch_size)

    def indices(self, manager: Manager) -> list[int]:
        """Waits for the step's quorum (healing first, which may move the cursor) and
        returns this rank's samples. If the step has failed already, any samples do:
        it will not commit."""
        if not manager.wait_quorum():
            return self.take(0, 1)
        return self.take(
            manager.replica_rank(),
            manager.replica_world_size(),
            manager.group_rank,
            manager.group_world_size,
        )

    def advance(self) -> None:
        """Call when the step committed: its samples are consumed."""
        self.cursor += self._taken
        self._taken = 0

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "num_samples": self.num_samples, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["num_samples"], state["seed"]) != (self.num_samples, self.seed):
            raise ValueError(
                f"the peers read a dataset of {state['num_samples']} samples with seed "
                f"{state['seed']}, this group one of {self.num_samples} with seed {self.seed}; "
                "every group must use the same data and seed"
            )
        self.cursor = int(state["cursor"])
        self._taken = 0
