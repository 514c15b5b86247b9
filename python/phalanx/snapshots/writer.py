"""One rank's writes of its group's snapshots, beside training.

`take()` runs on the training thread: it describes the state and copies its tensors
into host buffers kept from one snapshot to the next (pinned for a GPU's), and
returns; the training step waits for that copy alone. The write runs in a thread of
its own, through torch.distributed.checkpoint: each rank writes its own shard
(`rank-<r>/` of the data folder), hashes what it wrote (SHA-256, in that thread: the
training thread never waits for it) and leaves the list in the group's store; rank 0
waits for every rank's list, makes the folder durable, publishes the manifest sealed
with the job's key (one atomic rename), and removes what is past the snapshots kept:
of this job's own, by what their manifests say, never by a name alone.

A write never fails a step: a failing store logs one warning (and again only after a
write succeeded), removes what it wrote and leaves the previous snapshots as they
were. A write that fails for space removes this job's oldest snapshot (never its
last) and tries once more; if that fails too, every interval warns that the newest
snapshot is not advancing (`not_advancing` counts them). One write is in flight per
rank: a snapshot due while the last is still being written is skipped.
"""

from __future__ import annotations

import errno
import json
import logging
import threading
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from phalanx.manifest import describe_state
from phalanx.snapshots.catalog import (
    DamagedSnapshotError,
    FileEntry,
    Manifest,
    newest_first,
    stem,
    to_remove,
)
from phalanx.snapshots.seal import SnapshotKey
from phalanx.snapshots.storage import Storage

log = logging.getLogger("phalanx.snapshots")

#: How long rank 0 waits for the other ranks of its group to finish their shards.
SHARDS_TIMEOUT_S = 900.0


def quiet_dcp() -> None:
    """DCP warns whenever it saves or loads without a process group, and when a store
    cannot fsync; a rank's shard is its own checkpoint on purpose. Placed first among
    the filters at each call (a filter made once would come after any later "error")."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
    warnings.filterwarnings("ignore", message="fsync not supported for this stream")


class Staging:
    """Host memory a snapshot's tensors are copied into, kept for the next snapshot (a
    write in flight owns it: one is in flight at a time): copying into memory already
    mapped costs a fraction of allocating it anew each time."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    def copy(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of `tensors` in host memory, made now."""
        held = self.buffers
        self.buffers = [
            held[i] if i < len(held) and _fits(held[i], t) else _host_buffer(t)
            for i, t in enumerate(tensors)
        ]
        for buffer, tensor in zip(self.buffers, tensors, strict=True):
            buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        if any(t.is_cuda for t in tensors):
            torch.cuda.synchronize()
        return self.buffers


def _fits(buffer: torch.Tensor, tensor: torch.Tensor) -> bool:
    return buffer.shape == tensor.shape and buffer.dtype == tensor.dtype


def _host_buffer(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)


@dataclass(eq=False)
class SnapshotWriter:
    """Rank `group_rank` of a group of `world_size` writing snapshots to `storage`,
    keeping the newest `keep`; `store` is the group's store (for W > 1)."""

    storage: Storage
    _: KW_ONLY
    replica_id: str
    group_rank: int
    world_size: int
    keep: int
    store: Callable[[], dist.Store] | None
    #: The job's key: manifests are sealed with it, and only those it opens are this
    #: job's to count and remove.
    key: SnapshotKey
    #: The last snapshot this rank saw published (rank 0), for tests and logs.
    published: Manifest | None = field(default=None, init=False)
    #: Writes in a row that found no room even after removing this job's oldest.
    not_advancing: int = field(default=0, init=False)
    #: The manifests left alone (not this job's, or not readable), as last warned of.
    _left_alone: frozenset[str] = field(default=frozenset(), init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)
    _staging: Staging = field(default_factory=Staging, init=False, repr=False)
    #: A failure was warned of, and no write succeeded since.
    _warned: bool = field(default=False, init=False, repr=False)

    @property
    def busy(self) -> bool:
        """A write of this rank is still in flight."""
        return self._thread is not None and self._thread.is_alive()

    def take(self, state: dict[str, Any], step: int, state_quorum_id: int, lineage: int) -> float:
        """Starts the snapshot of committed `step`; returns the seconds the training
        thread spent on it (the copy to host memory). Never raises."""
        started = time.monotonic()
        name = stem(step, lineage, state_quorum_id)
        data = f"{name}.k{self.key.tag}.{zlib.crc32(self.replica_id.encode()):08x}.data"
        if self.busy:
            log.warning(
                "the snapshot of step %d is skipped: this rank's last one is still being "
                "written (is the storage at %s slow?)",
                step,
                self.storage.location,
            )
            self._report(name, {"failed": "skipped: the last snapshot was still being written"})
            return time.monotonic() - started
        try:
            structure, tensors = describe_state(state)
            staged = self._staging.copy(tensors)
        except (Exception, CheckpointException) as e:  # a snapshot never fails a step
            why = self._reason(e, 0)
            self._failed(step, f"its copy to host memory failed: {why}")
            self._report(name, {"failed": why})
            return time.monotonic() - started
        copied = time.monotonic() - started

        def write() -> None:
            self._write(staged, name, data, structure, step, state_quorum_id, lineage, started)

        self._thread = threading.Thread(target=write, name=f"phalanx-snapshot-{step}", daemon=True)
        self._thread.start()
        return copied

    def wait(self, timeout: float) -> bool:
        """Waits up to `timeout` for the write in flight; True when none is left."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.busy

    # -- the write, in its thread -------------------------------------------------------

    def _write(
        self,
        staged: list[torch.Tensor],
        name: str,
        data: str,
        structure: bytes,
        step: int,
        state_quorum_id: int,
        lineage: int,
        started: float,
    ) -> None:
        folder = f"{data}/rank-{self.group_rank}"
        try:
            try:
                files = self._save(staged, folder)
            except (Exception, CheckpointException) as e:
                if not self._for_space(e, folder) or not self._make_room():
                    raise
                self.storage.remove(folder)
                log.warning(
                    "snapshot of step %d found no room in %s: this job's oldest snapshot "
                    "was removed to make some, and it is written again",
                    step,
                    self.storage.location,
                )
                files = self._save(staged, folder)
        except (Exception, CheckpointException) as e:
            why = self._reason(e, sum(size for _, size in self._files_or_none(folder)))
            self._report(name, {"failed": why})
            if self.group_rank == 0:
                self.storage.remove(data)
                self._failed(step, why, space=self._for_space(e, data))
            return
        shard = {"files": files, "structure": structure.decode()}
        if self.group_rank != 0:
            self._report(name, shard)
            return
        try:
            shards = [shard, *self._gather(name)]
            failed = [s["failed"] for s in shards if "failed" in s]
            if failed:
                raise RuntimeError(f"a rank of the group could not write its shard: {failed[0]}")
            manifest = Manifest(
                step=step,
                state_quorum_id=state_quorum_id,
                lineage=lineage,
                replica_id=self.replica_id,
                world_size=self.world_size,
                data=data,
                files=[FileEntry(n, size, sha) for s in shards for n, sha, size in s["files"]],
                structures=[s["structure"] for s in shards],
                created=time.time(),
                write_s=time.monotonic() - started,
            )
            self.storage.sync(data)
            self.storage.publish(
                manifest.name, manifest.to_bytes(self.key), owner=f"k{self.key.tag}"
            )
        except (Exception, CheckpointException) as e:
            self.storage.remove(data)
            self._failed(step, self._reason(e, 0), space=self._for_space(e, data))
            return
        self.published = manifest
        self.not_advancing = 0
        if self._warned:
            log.warning("snapshots are written again: step %d in %s", step, self.storage.location)
        self._warned = False
        log.info(
            "snapshot of step %d written: %.1f MB in %.2f s (%s)",
            step,
            manifest.nbytes / 1e6,
            manifest.write_s,
            self.storage.url(manifest.name),
        )
        self._prune()

    def _save(self, staged: list[torch.Tensor], folder: str) -> list[tuple[str, str, int]]:
        """Writes this rank's shard into `folder`: (path, SHA-256, size) of its files."""
        import torch.distributed.checkpoint as dcp

        quiet_dcp()
        tensors = {str(i): t for i, t in enumerate(staged)}
        dcp.save(tensors, storage_writer=self.storage.writer(folder), no_dist=True)
        return [
            (f"rank-{self.group_rank}/{path}", *self.storage.hash_file(f"{folder}/{path}", size))
            for path, size in self.storage.files(folder)
        ]

    def own(self, names: list[str] | None = None) -> tuple[dict[str, Manifest], list[str]]:
        """This job's manifests in the storage, by name, and the names of the others
        (another job's, or any this job's key does not open)."""
        from phalanx.snapshots.resume import read

        names = self.storage.names() if names is None else names
        own: dict[str, Manifest] = {}
        others = []
        for name in newest_first(names):
            try:
                own[name] = read(self.storage, name, self.key)
            except DamagedSnapshotError:
                others.append(name)
        return own, others

    def _for_space(self, error: BaseException, folder: str) -> bool:
        """Whether `error` is for want of space: a full disk or quota, told by the error
        (DCP's per-rank failures included) or by what is left free (a full disk may
        reach DCP as a torn file, not as ENOSPC)."""
        if _tells_of_space(error):
            return True
        free = self.storage.free_bytes()
        written = sum(size for _, size in self._files_or_none(folder))
        return free is not None and free < max(written, 1 << 20)

    def _make_room(self) -> bool:
        """Removes this job's oldest snapshot, if it holds more than one; whether it did."""
        try:
            own, _ = self.own()
        except OSError:
            return False
        if len(own) < 2:
            return False
        oldest = min(own.values(), key=lambda m: m.identity)
        self.storage.remove(oldest.name)
        self.storage.remove(oldest.data)
        return True

    def _files_or_none(self, folder: str) -> list[tuple[str, int]]:
        try:
            return self.storage.files(folder)
        except OSError:
            return []

    def _reason(self, error: BaseException, written: int) -> str:
        """What went wrong, in a line: DCP wraps the error of each rank it failed on."""
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict) and failures:
            error = next(iter(failures.values()))
        why = str(error).strip().splitlines()[-1] if str(error).strip() else repr(error)
        free = self.storage.free_bytes()
        if free is not None and free < max(written, 1 << 20):
            why += f" (the storage is full: {free / 1e6:.1f} MB free at {self.storage.location})"
        return why

    def _report(self, name: str, shard: dict[str, Any]) -> None:
        """Leaves this rank's outcome for rank 0 (a group of one has no one to tell)."""
        if self.group_rank == 0 or self.store is None:
            return
        try:
            self.store().set(f"{name}/{self.group_rank}", json.dumps(shard))
        except Exception as e:
            log.warning("cannot tell rank 0 of the snapshot %s: %s", name, e)

    def _gather(self, name: str) -> list[dict[str, Any]]:
        """The other ranks' shards of snapshot `name`, in rank order."""
        if self.world_size == 1:
            return []
        assert self.store is not None
        store = self.store()
        keys = [f"{name}/{r}" for r in range(1, self.world_size)]
        store.wait(keys, timedelta(seconds=SHARDS_TIMEOUT_S))
        shards = [json.loads(store.get(key)) for key in keys]
        for key in keys:
            try:
                store.delete_key(key)
            except (RuntimeError, dist.DistError) as e:  # a key left behind harms nothing
                log.debug("cannot remove key %s of the group's store: %s", key, e)
        return shards

    def _prune(self) -> None:
        try:
            names = self.storage.names()
            own, others = self.own(names)
            for name in to_remove(names, own, self.keep, self.key):
                self.storage.remove(name)
        except Exception as e:
            log.warning("cannot remove old snapshots in %s: %s", self.storage.location, e)
            return
        if others and frozenset(others) != self._left_alone:
            log.warning(
                "%d manifest(s) in %s are not this job's (or not readable) and are left "
                "alone, neither counted towards the %d kept nor removed: %s",
                len(others),
                self.storage.location,
                self.keep,
                ", ".join(others),
            )
        self._left_alone = frozenset(others)

    def _failed(self, step: int, why: str, space: bool = False) -> None:
        """One warning per run of failures, but one every interval while the disk holds
        no room for a newer snapshot; the previous snapshots stay."""
        if space:
            self.not_advancing += 1
            try:
                held = len(self.own()[0])
            except OSError:
                held = 0
            newest = "none" if self.published is None else f"step {self.published.step}"
            log.warning(
                "snapshot of step %d not written: the storage at %s holds only %d snapshot(s) "
                "of this job and has no room for another, so the newest (%s) is not "
                "advancing (%d interval(s) in a row): %s; free space there or lower "
                "--snapshot-keep (the previous snapshots stay)",
                step,
                self.storage.location,
                held,
                newest,
                self.not_advancing,
                why,
            )
            self._warned = True
            return
        message = "snapshot of step %d not written (%s): %s; the previous snapshots stay"
        if self._warned:
            log.info(message, step, self.storage.location, why)
            return
        self._warned = True
        log.warning(message + "; training goes on", step, self.storage.location, why)


def _tells_of_space(error: BaseException) -> bool:
    """Whether `error` (or one it wraps, DCP's per-rank failures included) is a full
    disk or quota."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f for f in failures.values() if isinstance(f, BaseException)]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return False
