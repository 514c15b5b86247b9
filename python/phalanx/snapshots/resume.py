"""A cold resume: the newest snapshot of this job that verifies and loads, loaded
into this rank's state.

`sealed` walks the manifests newest first and yields those this job sealed (its key)
whose schema holds; one that does not is passed over with one warning naming it and
why. `verify` checks every file a snapshot names: a regular file inside its folder, of
its size (checked before a byte is read), of its SHA-256. `check` also reads the
rank's `.metadata` (verified bytes, unpickled by an allow list) and sees that the
snapshot fits this rank's state, so that one that verifies but cannot load is passed
over before the quorum, not after. `load` reads this rank's files once into memory,
hashing them as they are read, and hands DCP those bytes alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from phalanx.manifest import IncompatibleStateError, decode_state
from phalanx.snapshots.catalog import (
    DAMAGED,
    REFUSED,
    UNLOADABLE,
    DamagedSnapshotError,
    Manifest,
    newest_first,
)
from phalanx.snapshots.checkpoint import UnsafeMetadataError, VerifiedReader, metadata_of
from phalanx.snapshots.seal import SnapshotKey
from phalanx.snapshots.storage import HashMismatchError, Storage, UnsafeFileError
from phalanx.snapshots.writer import quiet_dcp
from phalanx.staging import to_devices

log = logging.getLogger("phalanx.snapshots")


def read(storage: Storage, name: str, key: SnapshotKey) -> Manifest:
    """Manifest `name`, if this job sealed it and its schema holds; else
    DamagedSnapshotError saying why (a manifest that is no regular file included)."""
    try:
        data = storage.read_manifest(name)
    except UnsafeFileError as e:
        raise DamagedSnapshotError(name, f"its manifest {e}", REFUSED) from None
    except OSError as e:
        raise DamagedSnapshotError(name, f"its manifest cannot be read ({e})") from None
    return Manifest.parse(data, name, key)


def sealed(storage: Storage, key: SnapshotKey, world_size: int | None = None) -> Iterator[Manifest]:
    """This job's manifests in `storage` (of groups of `world_size`, where given),
    newest first; every other is logged once, with why, and passed over."""
    try:
        names = newest_first(storage.names())
    except OSError as e:
        log.warning("cannot list the snapshots in %s (%s): no resume", storage.location, e)
        return
    for name in names:
        try:
            manifest = read(storage, name, key)
        except DamagedSnapshotError as e:
            log.warning("%s", e)
            continue
        if world_size is not None and manifest.world_size != world_size:
            log.warning(
                "snapshot %s was written by a group of %d rank(s); this group has %d, so "
                "it is not used (resume with groups of the size that wrote it)",
                name,
                manifest.world_size,
                world_size,
            )
            continue
        yield manifest


def verify(storage: Storage, manifest: Manifest, rank: int | None = None) -> None:
    """DamagedSnapshotError, naming the file, unless every file of `manifest` (of rank
    `rank`, where given) is a regular file inside its folder, of its size and SHA-256."""
    entries = manifest.files if rank is None else manifest.files_of(rank)
    for entry in entries:
        path = f"{manifest.data}/{entry.name}"
        try:
            digest, _ = storage.hash_file(path, entry.size)
        except FileNotFoundError:
            raise DamagedSnapshotError(manifest.name, f"its file {path} is missing") from None
        except UnsafeFileError as e:
            kind = DAMAGED if "bytes, not" in str(e) else REFUSED
            raise DamagedSnapshotError(manifest.name, f"its file {e}", kind) from None
        except OSError as e:
            raise DamagedSnapshotError(manifest.name, f"its file {path}: {e}") from None
        if digest != entry.sha256:
            raise DamagedSnapshotError(manifest.name, f"its file {path} fails its checksum")


def check(storage: Storage, manifest: Manifest, rank: int, state: dict[str, Any]) -> None:
    """DamagedSnapshotError unless rank `rank`'s part of `manifest` verifies and fits
    `state` (its structure, and the tensors its DCP metadata holds)."""
    verify(storage, manifest, rank)
    try:
        loaded, rx = decode_state(manifest.structures[rank].encode(), state)
        rx.regions()
        if why := misfit(loaded, state):
            raise ValueError(why)
        entry = next(f for f in manifest.files_of(rank) if f.name.endswith("/.metadata"))
        path = f"{manifest.data}/{entry.name}"
        metadata = metadata_of(storage.read_verified(path, entry.size, entry.sha256))
        for i, tensor in enumerate(rx.dest):
            held = metadata.state_dict_metadata.get(str(i))
            shape = getattr(held, "size", None)
            dtype = getattr(getattr(held, "properties", None), "dtype", None)
            if shape != tensor.shape or dtype != tensor.dtype:
                mine = f"{tensor.dtype} {tuple(tensor.shape)}"
                raise ValueError(f"its tensor {i} is {dtype} {shape}, this state's {mine}")
    except (IncompatibleStateError, UnsafeMetadataError, ValueError, OSError) as e:
        raise DamagedSnapshotError(
            manifest.name, f"it verifies but does not load into rank {rank}: {e}", UNLOADABLE
        ) from None


def misfit(loaded: Any, local: Any, path: str = "") -> str | None:
    """Where a snapshot's state (`loaded`) holds a tensor of another shape or dtype than
    this rank's state (`local`) holds at the same place (another model), or None.
    Places only one of them has (a fresh optimizer's moments) are no misfit.

    >>> import torch
    >>> misfit({"w": torch.zeros(3)}, {"w": torch.zeros(4), "v": 1})
    'w is torch.float32 (3,) in the snapshot, torch.float32 (4,) in this state'
    """
    if isinstance(loaded, torch.Tensor) and isinstance(local, torch.Tensor):
        if loaded.shape == local.shape and loaded.dtype == local.dtype:
            return None
        return (
            f"{path.lstrip('/') or 'the state'} is {loaded.dtype} {tuple(loaded.shape)} in the "
            f"snapshot, {local.dtype} {tuple(local.shape)} in this state"
        )
    if isinstance(loaded, dict) and isinstance(local, dict):
        pairs = [(k, loaded[k], local[k]) for k in loaded if k in local]
    elif isinstance(loaded, list | tuple) and isinstance(local, list | tuple):
        pairs = list(zip(range(len(loaded)), loaded, local, strict=False))
    else:
        return None
    for k, a, b in pairs:
        if why := misfit(a, b, f"{path}/{k}"):
            return why
    return None


def newest(
    storage: Storage,
    world_size: int,
    key: SnapshotKey,
    rank: int = 0,
    state: dict[str, Any] | None = None,
) -> Manifest | None:
    """The newest snapshot of this job that verifies (and fits `state`, rank `rank`'s,
    where given) for a group of `world_size` ranks, or None; the rest are logged and
    passed over."""
    for manifest in sealed(storage, key, world_size):
        started = time.monotonic()
        try:
            if state is None:
                verify(storage, manifest)
            else:
                check(storage, manifest, rank, state)
        except DamagedSnapshotError as e:
            log.warning("%s", e)
            continue
        log.info(
            "snapshot %s verified: %.1f MB in %.3f s",
            manifest.name,
            manifest.nbytes / 1e6,
            time.monotonic() - started,
        )
        return manifest
    return None


def load(storage: Storage, manifest: Manifest, rank: int, state: dict[str, Any]) -> dict[str, Any]:
    """Rank `rank`'s state of `manifest`, built on `state` (its registered state now):
    {name: structure}, ready for the registry's load functions. Every file is read
    once and hashed; DCP reads only those bytes (DamagedSnapshotError if one fails)."""
    import torch.distributed.checkpoint as dcp

    loaded, rx = decode_state(manifest.structures[rank].encode(), state)
    rx.regions()  # every tensor of the structure has its destination
    prefix = f"rank-{rank}/"
    files = {}
    for entry in manifest.files_of(rank):
        path = f"{manifest.data}/{entry.name}"
        try:
            files[entry.name.removeprefix(prefix)] = storage.read_verified(
                path, entry.size, entry.sha256
            )
        except (UnsafeFileError, HashMismatchError, OSError) as e:
            raise DamagedSnapshotError(manifest.name, f"its file {e}") from None
    tensors = {str(i): t for i, t in enumerate(rx.dest)}
    quiet_dcp()
    try:
        dcp.load(tensors, storage_reader=VerifiedReader(files), no_dist=True)
    except (Exception, CheckpointException) as e:  # DCP's is no Exception
        why = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
        raise DamagedSnapshotError(
            manifest.name, f"it verifies but does not load into rank {rank}: {why}", UNLOADABLE
        ) from None
    to_devices(rx.device_copies)
    return loaded
