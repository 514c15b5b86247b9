"""What a snapshot is on storage: its manifest, the names of its files, and which
snapshots to keep. Pure: `phalanx.snapshots.storage` reads and writes the bytes.

A snapshot of committed step S is a data folder, written first under a name of its
own (`step-<S>.l<lineage>.q<quorum>.k<tag>.<nonce>.data/`, one DCP checkpoint per
rank of the writing group in `rank-<r>/`, `<tag>` naming the job's key), and a
manifest, published last by one atomic rename (`step-<S>.l<lineage>.q<quorum>.json`):
a snapshot without its manifest does not exist. The manifest names the state's
identity (step, commit quorum, lineage), the group that wrote it, every file with its
size and SHA-256, each rank's structure (the state's nesting, scalars and tensor
layouts, `phalanx.manifest`), and is sealed with the job's key (`phalanx.snapshots.
seal`): a manifest this job did not write, or one damaged since, is refused, and so
is one whose body is not exactly the schema below, field by field.

>>> from phalanx.snapshots.seal import SnapshotKey
>>> key = SnapshotKey.of("t0k3n")
>>> m = Manifest(step=400, state_quorum_id=17, lineage=0, replica_id="g1",
...              world_size=1, data=f"step-0000000400.l0.q17.k{key.tag}.ab12.data",
...              files=[FileEntry("rank-0/.metadata", 1024, "0" * 64)], structures=["{}"])
>>> m.name
'step-0000000400.l0.q17.json'
>>> Manifest.parse(m.to_bytes(key), m.name, key) == m
True
>>> forged = m.to_bytes(key).replace(b"400", b"401", 1)
>>> Manifest.parse(forged, m.name, key)
Traceback (most recent call last):
...
phalanx.snapshots.catalog.DamagedSnapshotError: snapshot step-...q17.json is damaged: ...seal...
>>> Manifest.parse(m.to_bytes(SnapshotKey.of("another")), m.name, key).kind
Traceback (most recent call last):
...
phalanx.snapshots.catalog.DamagedSnapshotError: snapshot ... is another job's: ...
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from phalanx.snapshots.seal import SnapshotKey

FORMAT = "phalanx-snapshot/2"
MANIFEST_SUFFIX = ".json"
DATA_SUFFIX = ".data"
TEMPORARY_SUFFIX = ".tmp"
#: The most bytes a manifest may hold: a larger "manifest" is refused unread.
MANIFEST_LIMIT = 64 << 20

_NAME = re.compile(r"step-(\d+)\.l(\d+)\.q(\d+)")
_SHA256 = re.compile(r"[0-9a-f]{64}")

#: What a refusal says of a snapshot, as `phalanx snapshots` marks it.
DAMAGED = "damaged"  # a file is missing, of another size or fails its hash
MALFORMED = "malformed"  # not the manifest schema, field by field
FOREIGN = "another job's"  # sealed under another key: another job, or an old token
UNSEALED = "unsealed"  # names this job's key but its seal does not verify: forged
REFUSED = "refused"  # a symlink, FIFO, device or folder where a file belongs
UNLOADABLE = "unloadable"  # verifies, but does not load into this group's state


class DamagedSnapshotError(ValueError):
    """A snapshot's manifest or one of its files does not verify; `kind` says how."""

    def __init__(self, name: str, why: str, kind: str = DAMAGED) -> None:
        what = "another job's" if kind == FOREIGN else "damaged"
        super().__init__(f"snapshot {name} is {what}: {why}; it is not used (an older one is)")
        self.name = name
        self.why = why
        self.kind = kind


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


def owned(name: str, key: SnapshotKey) -> bool:
    """Whether `name` (a data folder or temporary file) carries this job's tag."""
    return f".k{key.tag}." in name


@dataclass(frozen=True)
class FileEntry:
    #: Path inside the snapshot's data folder.
    name: str
    size: int
    sha256: str


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

    def files_of(self, rank: int) -> list[FileEntry]:
        """The files rank `rank` reads."""
        return [f for f in self.files if f.name.startswith(f"rank-{rank}/")]

    def to_bytes(self, key: SnapshotKey) -> bytes:
        body = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        mac = key.seal(body.encode())
        return json.dumps({"body": body, "key": key.tag, "mac": mac}).encode()

    @classmethod
    def parse(cls, data: bytes, name: str, key: SnapshotKey) -> Manifest:
        """The manifest stored as `name`, if sealed with `key`; else
        DamagedSnapshotError, whose `kind` says why it is refused."""
        if len(data) > MANIFEST_LIMIT:
            raise DamagedSnapshotError(
                name, f"its manifest holds {len(data)} bytes, over {MANIFEST_LIMIT}", MALFORMED
            )
        try:
            outer = json.loads(data)
        except (ValueError, RecursionError):
            raise DamagedSnapshotError(
                name, "its manifest is not readable JSON", MALFORMED
            ) from None
        if not (
            isinstance(outer, dict)
            and set(outer) == {"body", "key", "mac"}
            and all(isinstance(v, str) for v in outer.values())
        ):
            raise DamagedSnapshotError(
                name, "its manifest is not a sealed phalanx manifest (body, key, mac)", MALFORMED
            )
        if outer["key"] != key.tag:
            raise DamagedSnapshotError(
                name,
                "it is sealed under another key (another job's snapshot, or this job's from "
                "before its token changed)",
                FOREIGN,
            )
        body = outer["body"].encode("utf-8", "surrogatepass")
        if not key.opens(body, outer["mac"]):
            raise DamagedSnapshotError(
                name, "its seal does not verify under this job's key (forged, or damaged)", UNSEALED
            )
        try:
            fields = json.loads(body)
        except (ValueError, RecursionError):
            raise DamagedSnapshotError(name, "its body is not readable JSON", MALFORMED) from None
        why = schema_error(fields)
        if why is not None:
            raise DamagedSnapshotError(name, why, MALFORMED)
        fields["files"] = [FileEntry(**f) for f in fields["files"]]
        manifest = cls(**fields)
        if manifest.name != name:
            raise DamagedSnapshotError(name, f"its manifest describes {manifest.name}", MALFORMED)
        if why := manifest._inconsistent():
            raise DamagedSnapshotError(name, why, MALFORMED)
        return manifest

    def _inconsistent(self) -> str | None:
        """What a well-typed manifest may still get wrong: a path outside its data
        folder (never read), a rank's file outside its rank, a rank without its DCP
        metadata, or not one structure per rank."""
        stem_ = self.name.removesuffix(MANIFEST_SUFFIX)
        if not (self.data.startswith(stem_ + ".") and self.data.endswith(DATA_SUFFIX)):
            return f"its data folder {self.data!r} is not one of its own"
        if "/" in self.data or any(_outside(f.name) for f in self.files):
            return "it names a file outside its data folder"
        if not 0 < self.world_size == len(self.structures):
            return f"{len(self.structures)} structure(s) for a group of {self.world_size}"
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            return "it names a file twice"
        ranks = {f"rank-{r}" for r in range(self.world_size)}
        if any(n.split("/", 1)[0] not in ranks for n in names):
            return "it names a file of no rank of its group"
        if missing := [r for r in sorted(ranks) if f"{r}/.metadata" not in names]:
            return f"it names no {missing[0]}/.metadata"
        return None


#: The body's fields and the types each must have (bool is not an int here).
_FIELDS: dict[str, tuple[type, ...]] = {
    "step": (int,),
    "state_quorum_id": (int,),
    "lineage": (int,),
    "replica_id": (str,),
    "world_size": (int,),
    "data": (str,),
    "files": (list,),
    "structures": (list,),
    "created": (int, float),
    "write_s": (int, float),
    "format": (str,),
}
_FILE_FIELDS: dict[str, tuple[type, ...]] = {"name": (str,), "size": (int,), "sha256": (str,)}


def schema_error(fields: Any) -> str | None:
    """Why `fields` is not a manifest's body, or None: every field there, of its type,
    no other.

    >>> schema_error([])
    'its body is a list, not an object'
    >>> schema_error({"step": "9000"})
    "its body's step is '9000', not of type int"
    """
    if not isinstance(fields, dict):
        return f"its body is a {type(fields).__name__}, not an object"
    if why := _typed(fields, _FIELDS, "its body"):
        return why
    if fields["format"] != FORMAT:
        return f"format {fields['format']!r}, this phalanx reads {FORMAT!r}"
    for number in ("step", "state_quorum_id", "lineage", "world_size"):
        if fields[number] < 0:
            return f"its {number} is negative"
    if not all(isinstance(s, str) for s in fields["structures"]):
        return "a structure is not a string"
    return _files_error(fields)


def _files_error(fields: dict[str, Any]) -> str | None:
    """Why the files or names of a well-typed body are not a manifest's, or None."""
    for i, entry in enumerate(fields["files"]):
        if not isinstance(entry, dict):
            return f"file {i} is a {type(entry).__name__}, not an object"
        if why := _typed(entry, _FILE_FIELDS, f"file {i}"):
            return why
        if entry["size"] < 0 or not _SHA256.fullmatch(entry["sha256"]):
            return f"file {i} has a negative size or a SHA-256 that is not 64 hex digits"
    for text in (fields["replica_id"], fields["data"], *(f["name"] for f in fields["files"])):
        if "\x00" in text or not text.isprintable():
            return f"it names {text!r}, with a character no file name of a snapshot holds"
    return None


def _typed(fields: dict, expected: Mapping[str, tuple[type, ...]], what: str) -> str | None:
    for name, types in expected.items():
        if name not in fields:
            return f"{what} lacks {name}"
        value = fields[name]
        if isinstance(value, bool) or not isinstance(value, types):
            kinds = " or ".join(t.__name__ for t in types)
            return f"{what}'s {name} is {value!r:.40}, not of type {kinds}"
    if extra := sorted(set(fields) - set(expected)):
        return f"{what} has a field {extra[0]!r} no manifest has"
    return None


def _outside(path: str) -> bool:
    parts = path.split("/")
    return path.startswith("/") or any(part in ("", ".", "..") for part in parts)


def newest_first(names: Iterable[str]) -> list[str]:
    """The manifests among `names`, newest state first (the lighthouse's order)."""
    found = [
        (identity, name)
        for name in names
        if name.endswith(MANIFEST_SUFFIX)
        and not name.startswith(".")
        and (identity := identity_of(name)) is not None
    ]
    return [name for _, name in sorted(found, reverse=True)]


def to_remove(
    names: Iterable[str], own: Mapping[str, Manifest], keep: int, key: SnapshotKey
) -> list[str]:
    """What a writer removes after publishing. `own`: the manifests among `names`
    sealed by this job (by name); nothing else is counted or removed. Of each group
    size, the manifests past the newest `keep` go, with their data folders; then this
    job's data folders and temporary files that no kept manifest names and that are no
    newer than its newest manifest (a newer one may be another writer's, still being
    written).

    >>> from phalanx.snapshots.seal import SnapshotKey
    >>> key = SnapshotKey.of("t")
    >>> def own(step):
    ...     s = stem(step, 0, 2)
    ...     return Manifest(step, 2, 0, "g", 1, f"{s}.k{key.tag}.x.data", [], ["{}"])
    >>> mine = {m.name: m for m in (own(3), own(2))}
    >>> names = [*mine, *(m.data for m in mine.values()), "step-0000000009.l0.q1.json",
    ...          f".step-0000000002.l0.q2.json.k{key.tag}.1f.tmp"]
    >>> for name in to_remove(names, mine, 1, key):
    ...     print(name.replace(key.tag, "TAG"))
    step-0000000002.l0.q2.json
    step-0000000002.l0.q2.kTAG.x.data
    .step-0000000002.l0.q2.json.kTAG.1f.tmp
    """
    names = list(names)
    if not own:
        return []
    doomed: list[str] = []
    kept: set[str] = set()
    sizes = {m.world_size for m in own.values()}
    for size in sorted(sizes):
        of_size = sorted(
            (m for m in own.values() if m.world_size == size), key=lambda m: m.identity
        )
        of_size.reverse()
        kept.update(m.data for m in of_size[:keep])
        for m in of_size[keep:]:
            doomed += [m.name, m.data]
    newest = max(m.identity for m in own.values())
    stale = [
        name
        for name in names
        if (name.endswith(DATA_SUFFIX) or name.endswith(TEMPORARY_SUFFIX))
        and owned(name, key)
        and name not in kept
        and name not in doomed
        and (identity := identity_of(name)) is not None
        and identity <= newest
    ]
    present = set(names)
    return [n for n in doomed if n in present] + sorted(stale)
