"""Durable snapshots: the job's committed state on storage, so that losing every group
at once costs at most one snapshot interval (plus the steps a write in flight at the
loss overlapped).

Every `every` committed steps (or every interval of time) one group of the commit
quorum, in turn, writes the state it committed through torch.distributed.checkpoint,
each rank its own shard, beside training; the step waits only for the copy to host
memory. A snapshot is published whole or not at all (its manifest, renamed into place
last, names every file with its SHA-256 and is sealed with a key derived from the
job token); the newest `keep` of this job's are kept. When a group starts with no
state, it resumes from the newest snapshot of this job that verifies and loads: the
snapshot's identity (step, commit quorum, lineage) enters the quorum like any live
state, so a live group holding a newer state always wins over it.

    phalanx run --replicas 2 --snapshot-dir /ckpt --snapshot-every 500 -- python train.py

or `Manager(snapshot_dir=..., snapshot_every=...)`, or PHALANX_SNAPSHOT_DIR /
PHALANX_SNAPSHOT_EVERY / PHALANX_SNAPSHOT_KEEP. See docs/snapshots.md.
"""

from phalanx.snapshots.catalog import DamagedSnapshotError, Manifest
from phalanx.snapshots.rank import RankSnapshots, SnapshotSettings
from phalanx.snapshots.resume import load, newest, verify
from phalanx.snapshots.schedule import Every
from phalanx.snapshots.seal import SnapshotKey
from phalanx.snapshots.storage import Storage

__all__ = [
    "DamagedSnapshotError",
    "Every",
    "Manifest",
    "RankSnapshots",
    "SnapshotKey",
    "SnapshotSettings",
    "Storage",
    "load",
    "newest",
    "verify",
]
