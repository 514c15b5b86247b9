"""What a snapshot is on storage: its manifest, the names of its files, and which
snapshots to keep. Pure: `phalanx.snapshots.storage` reads and writes the bytes.

A snapshot of committed step S is a data folder, written first under a name of its
own (`step-<S>.l<lineage>.q<quorum>.<nonce>.data/`, one DCP checkpoint per rank of the
writing group in `rank-<r>/`), and a manifest, published last by one atomic rename
(`step-<S>.l<lineage>.q<quorum>.json`): a snapshot without its manifest does not
exist. The manifest names the state's identity (step, commit quorum, lineage), the
group that wrote it, every file with its size and CRC-32, each rank's structure (the
state's nesting, scalars and tensor layouts, `phalanx.manifest`), and carries a CRC-32
of its own body, so a damaged manifest is refused like a damaged file.

>>> m = Manifest(step=400, state_quorum_id=17, lineage=0, replica_id="g1",
...              world_size=1, data="step-0000000400.l0.q17.ab12.data",
...              files=[FileEntry("rank-0/__0_0.distcp", 1024, 123)], structures=["{}"])
>>> m.name
'step-0000000400.l0.q17.json'
>>> Manifest.parse(m.to_bytes(), m.name) == m
True
>>> damaged = m.to_bytes().replace(b"400", b"401", 1)
>>> Manifest.parse(damaged, m.name)
Traceback (most recent call last):
...
phalanx.snapshots.catalog.DamagedSnapshotError: snapshot step-...q17.json is damaged: ...checksum...
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

FORMAT = "phalanx-snapshot/1"
MANIFEST_SUFFIX = ".json"
DATA_SUFFIX = ".data"
TEMPORARY_SUFFIX = ".tmp"

_NAME = re.compile(r"step-(\d+)\.l(\d+)\.q(\d+)")


class DamagedSnapshotError(ValueError):
    """A snapshot's manifest or one of its files does not verify."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"snapshot {name} is damaged: {why}; it is not used (an older one is)")
        self.name = name


def stem(step: int, lineage: int, state_quorum_id: int) -> str:
    """The name every file of a snapshot of this identity starts with."""
    return f"step-{step:010d}.l{lineage}.q{state_quorum_id}"


def identity_of(name: str) -> tuple[int, int, int] | None:
    """(lineage, step, commit quorum) from a snapshot's file name, ordered as the
    lighthouse orders states; None for a name that is not a snapshot's."""
    match = _NAME.match(name.lstrip("."))  # a temporary manifest's name starts with "."
    if match is None:
        return None
    step, lineage, quorum = (int(g) for g in match.groups())
    return lineage, step, quorum


@dataclass(frozen=True)
class FileEntry:
    #: Path inside the snapshot's data folder.
    name: str
    size: int
    crc32: int


@dataclass
class Manifest:
    step: int
    state_quorum_id: int
    lineage: int
    #: The replica group that wrote it, and its size (a snapshot loads into a group of
    #: that size: rank r reads `rank-<r>/`).
    replica_id: str
    world_size: int
    #: The data folder's name, next to the manifest.
    data: str
    files: list[FileEntry]
    #: Each rank's structure of the state (`phalanx.manifest.describe_state`).
    structures: list[str]
    #: When it was taken (seconds since the epoch) and how long it took to write.
    created: float = 0.0
    write_s: float = 0.0
    format: str = field(default=FORMAT)

    @property
    def name(self) -> str:
        return stem(self.step, self.lineage, self.state_quorum_id) + MANIFEST_SUFFIX

    @property
    def identity(self) -> tuple[int, int, int]:
        return self.lineage, self.step, self.state_quorum_id

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_bytes(self) -> bytes:
        body = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return json.dumps({"body": body, "crc32": zlib.crc32(body.encode())}).encode()

    @classmethod
    def parse(cls, data: bytes, name: str) -> Manifest:
        """The manifest stored as `name`; DamagedSnapshotError if it does not verify."""
        try:
            outer = json.loads(data)
            body = outer["body"]
            crc_ok = zlib.crc32(body.encode()) == outer["crc32"]
        except (ValueError, KeyError, TypeError, AttributeError):
            raise DamagedSnapshotError(name, "its manifest is not readable") from None
        if not crc_ok:
            raise DamagedSnapshotError(name, "its manifest does not match its checksum")
        fields = json.loads(body)
        if fields.get("format") != FORMAT:
            raise DamagedSnapshotError(
                name, f"format {fields.get('format')!r}, this phalanx reads {FORMAT!r}"
            )
        try:
            files = [FileEntry(**f) for f in fields.pop("files")]
            manifest = cls(files=files, **fields)
        except TypeError as e:
            raise DamagedSnapshotError(name, f"its manifest lacks a field ({e})") from None
        if manifest.name != name:
            raise DamagedSnapshotError(name, f"its manifest describes {manifest.name}")
        if why := manifest._inconsistent():
            raise DamagedSnapshotError(name, why)
        return manifest

    def _inconsistent(self) -> str | None:
        """What a manifest whose checksum holds may still get wrong: a path outside its
        data folder (never read), or not one structure per rank."""
        stem_ = self.name.removesuffix(MANIFEST_SUFFIX)
        if not (self.data.startswith(stem_ + ".") and self.data.endswith(DATA_SUFFIX)):
            return f"its data folder {self.data!r} is not one of its own"
        if "/" in self.data or any(_outside(f.name) for f in self.files):
            return "it names a file outside its data folder"
        if not isinstance(self.world_size, int) or not 0 < self.world_size == len(self.structures):
            return f"{len(self.structures)} structure(s) for a group of {self.world_size}"
        return None


def _outside(path: str) -> bool:
    parts = path.split("/")
    return path.startswith("/") or any(part in ("", ".", "..") for part in parts)


def newest_first(names: Iterable[str]) -> list[str]:
    """The manifests among `names`, newest state first (the lighthouse's order)."""
    found = [
        (identity, name)
        for name in names
        if name.endswith(MANIFEST_SUFFIX) and (identity := identity_of(name)) is not None
    ]
    return [name for _, name in sorted(found, reverse=True)]


def to_remove(names: Iterable[str], keep: int, referenced: Iterable[str]) -> list[str]:
    """What a writer removes after publishing: the manifests past the newest `keep`,
    then data folders no kept manifest names (`referenced`) that are no newer than the
    newest manifest (a newer one may be another writer's, still being written), and
    temporary files of such steps.

    >>> names = ["step-0000000003.l0.q2.json", "step-0000000003.l0.q2.x.data",
    ...          "step-0000000002.l0.q2.json", "step-0000000002.l0.q2.y.data",
    ...          ".step-0000000002.l0.q2.json.1f.tmp", "step-0000000004.l0.q2.w.data"]
    >>> for name in to_remove(names, 1, ["step-0000000003.l0.q2.x.data"]):
    ...     print(name)
    step-0000000002.l0.q2.json
    .step-0000000002.l0.q2.json.1f.tmp
    step-0000000002.l0.q2.y.data
    """
    names = list(names)
    manifests = newest_first(names)
    if not manifests:
        return []
    newest = identity_of(manifests[0])
    kept = set(referenced)
    stale = [
        name
        for name in names
        if (name.endswith(DATA_SUFFIX) or name.endswith(TEMPORARY_SUFFIX))
        and name not in kept
        and (identity := identity_of(name)) is not None
        and newest is not None
        and identity <= newest
    ]
    return manifests[keep:] + sorted(stale)
