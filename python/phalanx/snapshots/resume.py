"""A cold resume: the newest snapshot that verifies, loaded into this rank's state.

`newest` walks the snapshots newest first and takes the first whose manifest and
every file verify (sizes and CRC-32s); a damaged one is refused with its name and the
next older is tried. `load` rebuilds this rank's state on its structure (tensors in
place where they fit, as a heal does) and reads the tensors through
torch.distributed.checkpoint.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from phalanx.manifest import decode_state
from phalanx.snapshots.catalog import DamagedSnapshotError, Manifest, newest_first
from phalanx.snapshots.storage import Storage
from phalanx.snapshots.writer import quiet_dcp
from phalanx.staging import to_devices

log = logging.getLogger("phalanx.snapshots")


def verify(storage: Storage, manifest: Manifest) -> None:
    """DamagedSnapshotError, naming the file, unless every file of `manifest` is there
    with its size and CRC-32."""
    for entry in manifest.files:
        path = f"{manifest.data}/{entry.name}"
        try:
            crc, size = storage.crc32(path)
        except FileNotFoundError:
            raise DamagedSnapshotError(manifest.name, f"its file {path} is missing") from None
        if size != entry.size:
            raise DamagedSnapshotError(
                manifest.name, f"its file {path} holds {size} bytes, not {entry.size}"
            )
        if crc != entry.crc32:
            raise DamagedSnapshotError(manifest.name, f"its file {path} fails its checksum")


def newest(storage: Storage, world_size: int) -> Manifest | None:
    """The newest snapshot that verifies and loads into a group of `world_size` ranks,
    or None. Damaged and unloadable snapshots are logged and passed over."""
    try:
        names = newest_first(storage.names())
    except OSError as e:
        log.warning("cannot list the snapshots in %s (%s): no resume", storage.location, e)
        return None
    for name in names:
        try:
            manifest = Manifest.parse(storage.read(name), name)
            if manifest.world_size != world_size:
                log.warning(
                    "snapshot %s was written by a group of %d rank(s); this group has %d, so "
                    "it is not used (resume with groups of the size that wrote it)",
                    name,
                    manifest.world_size,
                    world_size,
                )
                continue
            started = time.monotonic()
            verify(storage, manifest)
        except DamagedSnapshotError as e:
            log.warning("%s", e)
            continue
        except OSError as e:
            log.warning("cannot read snapshot %s (%s); trying an older one", name, e)
            continue
        log.info(
            "snapshot %s verified: %.1f MB in %.3f s",
            name,
            manifest.nbytes / 1e6,
            time.monotonic() - started,
        )
        return manifest
    return None


def load(storage: Storage, manifest: Manifest, rank: int, state: dict[str, Any]) -> dict[str, Any]:
    """Rank `rank`'s state of `manifest`, built on `state` (its registered state now):
    {name: structure}, ready for the registry's load functions."""
    import torch.distributed.checkpoint as dcp

    loaded, rx = decode_state(manifest.structures[rank].encode(), state)
    rx.regions()  # every tensor of the structure has its destination
    tensors = {str(i): t for i, t in enumerate(rx.dest)}
    quiet_dcp()
    dcp.load(tensors, storage_reader=storage.reader(f"{manifest.data}/rank-{rank}"), no_dist=True)
    to_devices(rx.device_copies)
    return loaded
