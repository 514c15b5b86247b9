"""The step line every torchft_* training script prints, and the settings they read
from the environment as torchft scripts do.

One JSON object a line: `step` is `manager.current_step()` after the step (the
state's number), `committed` whether this step (or sync) committed, `quorum_id`,
`lineage` and `healed` from the phalanx Manager underneath when there is one (None
on a real torchft), `loss`, and `fingerprint`, the digest of the state the step
committed (None when it did not), `t_life` when this process imported it (its
script's start, to time a restarted life's first commit). Records with equal
(lineage, step, rank) and a fingerprint must carry the same one (I1).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from state_digest import digest

#: When this life of the script began (near enough: its imports are done here).
LIFE_STARTED = time.time()


@dataclass(frozen=True)
class Environment:
    """What torchft scripts read from their environment (`phalanx run --as-torchft`
    sets all of it; torchrun and a torchft job's own launcher set the same names)."""

    replica_group: int
    replica_groups: int
    rank: int
    world_size: int

    @classmethod
    def read(cls) -> Environment:
        env = os.environ
        return cls(
            replica_group=int(env.get("REPLICA_GROUP_ID", "0")),
            replica_groups=int(env.get("NUM_REPLICA_GROUPS", "1")),
            rank=int(env.get("RANK", "0")),
            world_size=int(env.get("WORLD_SIZE", "1")),
        )


class StepLog:
    """Prints one line per step; tells which transaction of the Manager ended."""

    def __init__(self, manager, env: Environment):
        self.manager = manager
        self.env = env
        #: The phalanx Manager under a phalanx.torchft one; None on a real torchft.
        self.core = getattr(manager, "phalanx", None)
        self._seen = self._latest()

    def _latest(self) -> object:
        # phalanx makes a new record for every transaction; torchft only counts them.
        return self.manager.current_step() if self.core is None else self.core.last_step

    def transaction_ended(self) -> bool:
        """Whether a step or sync of the Manager ended since the last call (on a
        real torchft: whether its step count moved, i.e. one committed)."""
        latest, seen = self._latest(), self._seen
        self._seen = latest
        return latest != seen if self.core is None else latest is not seen

    def committed(self, before: int) -> bool:
        """Whether the transaction that just ended committed (on a real torchft:
        whether the step count moved past `before`, read before the step)."""
        if self.core is None:
            return self.manager.current_step() > before
        return self.core.last_step.committed

    def write(self, started: float, loss: float, committed: bool, state, **extra) -> None:
        """`state()` gives the tensors the step committed (digested only then), or
        None where the script cannot name them."""
        record = self.core.last_step if self.core is not None else None
        line = {
            "event": "step",
            "replica": f"group{self.env.replica_group}",
            "rank": self.env.rank,
            "pid": os.getpid(),
            "step": self.manager.current_step(),
            "committed": committed,
            "quorum_id": record.quorum_id if record else None,
            "lineage": record.lineage if record else 0,
            "participants": record.participants if record else self.manager.num_participants(),
            "healed": record.healed if record else None,
            "loss": loss,
            "fingerprint": _digest(state) if committed else None,
            "failure": record.failure if record else None,
            "t_start": started,
            "t_end": time.time(),
            "t_life": LIFE_STARTED,
            **extra,
        }
        print(json.dumps(line), flush=True)


def _digest(state) -> str | None:
    tensors = state()
    return None if tensors is None else digest(tensors)
