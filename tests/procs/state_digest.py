"""The digest the test ranks print of their state: replicas whose digests agree hold
the same bits."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def tensors_of(model_state: dict, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """A model's state-dict values and its optimizer's state tensors; of a DTensor,
    this rank's shard."""
    tensors = list(model_state.values())
    for state in optimizer.state_dict()["state"].values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


def digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 of every byte of `tensors`, in order (16 hex digits)."""
    sha = hashlib.sha256()
    for t in tensors:
        sha.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())
    return sha.hexdigest()[:16]


def state_hash(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """Of every byte of the model's and the optimizer's tensors (this rank's shards,
    under HSDP)."""
    return digest(tensors_of(model.state_dict(), optimizer))
