"""A rank's side of durable snapshots, as the step transaction calls it:

resume()   before the first quorum: the newest snapshot of this job that verifies
           and loads on every rank of the group (each rank checks its own part,
           newest first; the first all ranks accept is taken, by all), whose
           identity the rank reports, or None
load()     once the quorum says this group holds the job's newest state: the
           snapshot's tensors into the registered state
ask()      rank 0, at its vote: whether the state this step commits is to be
           snapshotted (due, and this group's turn)
committed() the group's decision said so: the state is taken at the next step's
           start, after the optimizer applied the step, as healers would get it
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from phalanx.snapshots import resume as _resume
from phalanx.snapshots.catalog import DamagedSnapshotError, Manifest
from phalanx.snapshots.schedule import Every, writer
from phalanx.snapshots.seal import SnapshotKey
from phalanx.snapshots.storage import Storage
from phalanx.snapshots.writer import SHARDS_TIMEOUT_S, SnapshotWriter

log = logging.getLogger("phalanx.snapshots")

_RESUME_KEY = "resume"

#: Snapshots kept, newest first, unless told otherwise (every front's default).
DEFAULT_KEEP = 2


@dataclass(frozen=True)
class SnapshotSettings:
    """Where snapshots go, how often, and how many are kept.

    >>> SnapshotSettings.of("/tmp/snaps", "500").every
    Every(steps=500, seconds=None)
    >>> SnapshotSettings.of("/tmp/snaps", "10m", keep=0)
    Traceback (most recent call last):
    ...
    ValueError: snapshot_keep=0: keep at least 1 snapshot (default 2)
    """

    location: str
    every: Every
    keep: int = DEFAULT_KEEP

    @classmethod
    def given(
        cls, location: Any, every: Any, keep: Any, names: tuple[str, str]
    ) -> SnapshotSettings | None:
        """The settings of a folder and an interval that go together, as a front names
        them (`names`: the folder's, the interval's); None when neither is given.

        >>> SnapshotSettings.given(None, None, 2, ("--snapshot-dir", "--snapshot-every"))
        >>> SnapshotSettings.given("/x", None, 2, ("--snapshot-dir", "--snapshot-every"))
        Traceback (most recent call last):
        ...
        ValueError: --snapshot-dir '/x' without --snapshot-every: say how often, ...
        """
        folder, interval = names
        if location is None and every is None:
            return None
        if every is None:
            raise ValueError(
                f"{folder} {location!r} without {interval}: say how often, in committed "
                "steps (e.g. 500) or time (e.g. 10m)"
            )
        if location is None:
            raise ValueError(
                f"{interval} without {folder}: say where snapshots go (a directory or an "
                "fsspec URL)"
            )
        return cls.of(location, every, keep)

    @classmethod
    def of(cls, location: str, every: Any, keep: Any = DEFAULT_KEEP) -> SnapshotSettings:
        every = every if isinstance(every, Every) else Every.parse(every)
        try:
            keep = int(keep)
        except (TypeError, ValueError):
            keep = 0
        if keep < 1:
            raise ValueError(
                f"snapshot_keep={keep!r}: keep at least 1 snapshot (default {DEFAULT_KEEP})"
            )
        return cls(str(location), every, keep)


class RankSnapshots:
    def __init__(
        self,
        settings: SnapshotSettings,
        *,
        replica_id: str,
        group_rank: int,
        world_size: int,
        store: Callable[[], dist.Store],
        token: str | None = None,
        state: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """`token`: the job's (its snapshots are sealed under a key derived from it);
        `state`: this rank's registered state, which a snapshot must fit to be resumed
        from."""
        # Imported now, not on the training thread at the first snapshot (a second).
        import torch.distributed.checkpoint  # noqa: F401

        self.settings = settings
        try:
            self.storage = Storage.at(settings.location)
        except OSError as e:
            raise ValueError(
                f"snapshot_dir {settings.location!r} cannot be used: {e}; give a directory "
                "this process can create and write (or an fsspec URL)"
            ) from None
        self.group_rank = group_rank
        self.world_size = world_size
        self.replica_id = replica_id
        self._store = store
        self._state = state
        self.key = SnapshotKey.of(token)
        if not self.key.authenticated:
            log.warning(
                "this job has no token, so its snapshots in %s are sealed under a key "
                "anyone can derive: give the job a token (--token-file, PHALANX_TOKEN) to "
                "authenticate them",
                self.storage.location,
            )
        self.writer = SnapshotWriter(
            self.storage,
            replica_id=replica_id,
            group_rank=group_rank,
            world_size=world_size,
            keep=settings.keep,
            store=store if world_size > 1 else None,
            key=self.key,
        )
        every = settings.every
        #: The last slot rank 0 considered (by time: the current one, so the first
        #: snapshot comes an interval after the start, not at once).
        self._slot = None if every.seconds is None else every.slot(0, time.time())
        #: The slot of the step being voted on, if it is one to consider.
        self._asking: int | None = None
        #: The group decided to snapshot the state of the step it just committed.
        self.due = False

    # -- writing -------------------------------------------------------------------------

    def ask(self, step: int, groups: Callable[[], Sequence[str]]) -> bool:
        """Rank 0: whether the state of `step`, if it commits, is to be snapshotted, of
        a commit quorum of `groups()` (replica ids, in the quorum's order; read only when
        a slot is due, not at every vote). A slot counts as done once a step of it
        commits (a step that fails asks again)."""
        self._asking = None
        if self.group_rank != 0:
            return False
        slot = self.settings.every.slot(step, time.time())
        if slot is None or slot == self._slot:
            return False
        self._asking = slot
        members = groups()
        if not members or writer(slot, members) != self.replica_id:
            return False
        if self.writer.busy:
            log.warning(
                "the snapshot due at step %d is skipped: the last one is still being written to %s",
                step,
                self.storage.location,
            )
            return False
        return True

    def committed(self, commit: bool, snapshot: bool) -> None:
        """The group's decision on the step just voted on."""
        if commit and self._asking is not None:
            self._slot = self._asking
        self._asking = None
        self.due = commit and snapshot

    def take(self, state: dict[str, Any], step: int, state_quorum_id: int, lineage: int) -> float:
        """Takes the snapshot the group decided on; the seconds it held the step."""
        self.due = False
        return self.writer.take(state, step, state_quorum_id, lineage)

    def close(self, timeout: float) -> None:
        if not self.writer.wait(timeout):
            log.warning(
                "a snapshot was still being written after %.0f s at shutdown; it is left "
                "unpublished (the previous ones stay)",
                timeout,
            )

    # -- resuming ------------------------------------------------------------------------

    def resume(self) -> Manifest | None:
        """The snapshot the group resumes from, the same on every rank: rank 0 lists
        this job's snapshots, newest first, in the group's store; each rank checks its
        own part of each in turn and leaves its verdict there; the first every rank
        accepts is the one. A snapshot one rank cannot load is passed over by all."""
        state = None if self._state is None else self._state()
        if self.world_size == 1:
            return _resume.newest(self.storage, 1, self.key, 0, state)
        store = self._store()
        wait = timedelta(seconds=SHARDS_TIMEOUT_S)
        if self.group_rank == 0:
            names = [m.name for m in _resume.sealed(self.storage, self.key, self.world_size)]
            store.set(f"{_RESUME_KEY}/names", json.dumps(names))
        else:
            store.wait([f"{_RESUME_KEY}/names"], wait)
            names = json.loads(store.get(f"{_RESUME_KEY}/names"))
        for i, name in enumerate(names):
            verdict = self._check(name, state)
            store.set(f"{_RESUME_KEY}/{i}/{self.group_rank}", verdict)
            keys = [f"{_RESUME_KEY}/{i}/{r}" for r in range(self.world_size)]
            store.wait(keys, wait)
            verdicts = [store.get(k).decode() for k in keys]
            refused = [(r, v) for r, v in enumerate(verdicts) if v != "ok"]
            if not refused:
                return _resume.read(self.storage, name, self.key)
            rank, why = refused[0]
            log.warning(
                "snapshot %s is passed over by every rank of the group: rank %d cannot "
                "use it (%s); an older one is tried",
                name,
                rank,
                why,
            )
        return None

    def _check(self, name: str, state: dict[str, Any] | None) -> str:
        """ "ok" if this rank can load its part of snapshot `name`, else why not."""
        try:
            manifest = _resume.read(self.storage, name, self.key)
            if state is None:
                _resume.verify(self.storage, manifest, self.group_rank)
            else:
                _resume.check(self.storage, manifest, self.group_rank, state)
        except DamagedSnapshotError as e:
            return e.why
        except Exception as e:  # a verdict is always left: the other ranks wait for it
            return f"{type(e).__name__}: {e}"
        return "ok"

    def load(self, manifest: Manifest, state: dict[str, Any]) -> dict[str, Any]:
        return _resume.load(self.storage, manifest, self.group_rank, state)
