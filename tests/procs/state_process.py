"""A rank's training state in a real process, for the recovery tests to heal from (and
kill) or to heal into. Prints one JSON line per event, flushed, on stdout:

    source:   {"event": "serving", "address": "127.0.0.1:PORT", "hash": "..."}
              (with --announce-served, {"event": "served", "bytes": N} once it sent its
              first chunk), then serves until killed.
    receiver: {"event": "healed", "hash": "...", "reused": N, "bytes": ..., ...}

Both build the same small model (a BatchNorm for integer buffers) and Adam. A source
trains a few deterministic steps first, so its optimizer has state; a receiver starts
fresh (another seed, no optimizer state yet), heals, and loads what it got through
the ordinary load_state_dict calls, as the Manager does.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from phalanx.recovery import StateHost, heal


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor (no numpy needed)."""
    t = t.detach().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


def state_hash(value: Any) -> str:
    """A digest of a nested state: every tensor's dtype, shape and raw bytes, every
    other value's repr, in order."""
    digest = hashlib.sha256()

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            digest.update(f"T{v.dtype}{tuple(v.shape)}".encode())
            digest.update(tensor_bytes(v))
        elif isinstance(v, Mapping):
            for k in v:
                digest.update(f"K{k!r}".encode())
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            digest.update(f"L{len(v)}".encode())
            for item in v:
                walk(item)
        else:
            digest.update(f"V{v!r}".encode())

    walk(value)
    return digest.hexdigest()


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def ballast(megabytes: float) -> torch.Tensor:
    """Bulk state, deterministic, so that a transfer lasts long enough to kill a source."""
    g = torch.Generator().manual_seed(99)
    return torch.randn(int(megabytes * 1e6) // 4, generator=g)


def registered(model: nn.Module, optimizer: torch.optim.Optimizer, extra: Any) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "extra": extra}


def source(args: argparse.Namespace) -> None:
    model, optimizer = build(seed=0)
    train(model, optimizer, steps=3)
    extra = {"step": args.step, "ballast": ballast(args.ballast_mb), "rng": torch.get_rng_state()}
    state = registered(model, optimizer, extra)
    host = StateHost(
        bind="127.0.0.1:0",
        token=args.token,
        max_bytes_per_s=args.max_bytes_per_s,
    )
    host.open(args.step, args.quorum_id, state)
    emit(event="serving", address=host.address, hash=state_hash(state))
    if args.announce_served:
        # The test's cue that a heal is under way: the first chunk went out.
        while host.served_bytes == 0:
            time.sleep(0.005)
        emit(event="served", bytes=host.served_bytes)
    while True:  # until the test kills this process
        time.sleep(3600)


def receiver(args: argparse.Namespace) -> None:
    model, optimizer = build(seed=1)
    extra = {"step": 0, "ballast": torch.zeros(int(args.ballast_mb * 1e6) // 4)}
    stats = []
    healed = heal(
        args.sources.split(","),
        args.step,
        args.quorum_id,
        registered(model, optimizer, extra),
        token=args.token,
        timeout=30.0,
        report=stats.append,
    )
    model.load_state_dict(healed["model"])
    optimizer.load_state_dict(healed["optim"])
    loaded = registered(model, optimizer, healed["extra"])
    emit(
        event="healed",
        hash=state_hash(loaded),
        ballast_in_place=healed["extra"]["ballast"] is extra["ballast"],
        bytes=stats[0].bytes,
        per_source_bytes=stats[0].per_source_bytes,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["source", "receiver"])
    parser.add_argument("--step", type=int, default=3)
    parser.add_argument("--quorum-id", type=int, default=5)
    parser.add_argument("--token", default=None)
    parser.add_argument("--ballast-mb", type=float, default=0.0)
    parser.add_argument("--max-bytes-per-s", type=float, default=None)
    parser.add_argument("--sources", default="")
    parser.add_argument("--announce-served", action="store_true")
    args = parser.parse_args()
    source(args) if args.role == "source" else receiver(args)


if __name__ == "__main__":
    main()
