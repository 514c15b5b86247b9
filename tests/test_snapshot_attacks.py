"""A snapshot folder someone else can write to (a shared file system or bucket), or
that holds odd files: nothing in it runs code, changes the state, is read from
outside it, blocks or crashes a resume or a listing, or wipes the job's snapshots.
Each case on a local folder, and on fsspec's memory:// where the store has it."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import pickle
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from phalanx import _core
from phalanx.snapshots import SnapshotKey, SnapshotSettings, Storage, catalog, load, newest
from phalanx.snapshots.catalog import FileEntry, Manifest
from phalanx.snapshots.rank import RankSnapshots
from phalanx.snapshots.writer import SnapshotWriter
from phalanx.store import Store

from conftest import small_tmpfs

TOKEN = "attack-test-token"
KEY = SnapshotKey.of(TOKEN)
#: The key of someone without the job's token: an attacker, or another job.
OTHER = SnapshotKey.of("another job's token")


def state(value: float = 1.0, n: int = 1000) -> dict:
    return {"m": {"w": torch.full((n,), value)}}


def write(storage: Storage, st: dict, step: int, keep: int = 5, key: SnapshotKey = KEY):
    writer = SnapshotWriter(
        storage, replica_id="g0", group_rank=0, world_size=1, keep=keep, store=None, key=key
    )
    writer.take(st, step, 1, 0)
    assert writer.wait(60)
    assert writer.published is not None
    return writer.published


@pytest.fixture(params=["local", "memory"])
def storage(request, tmp_path) -> Iterator[Storage]:
    if request.param == "local":
        yield Storage.at(tmp_path)
        return
    root = f"phalanx-attack-{uuid.uuid4().hex[:8]}"
    found = Storage.at(f"memory://{root}")
    try:
        yield found
    finally:
        found.fs.rm(f"/{root}", recursive=True)


def put(storage: Storage, name: str, data: bytes) -> None:
    """Writes `data` as `name`, as anyone with write access would."""
    if hasattr(storage, "root") and isinstance(storage.root, Path):
        (storage.root / name).parent.mkdir(parents=True, exist_ok=True)
        (storage.root / name).write_bytes(data)
    else:
        storage.fs.pipe_file(f"{storage.root}/{name}", data)


def get(storage: Storage, name: str) -> bytes:
    if isinstance(getattr(storage, "root", None), Path):
        return (storage.root / name).read_bytes()
    return storage.fs.cat_file(f"{storage.root}/{name}")


def forge_newer(storage: Storage, good: Manifest, step: int, key: SnapshotKey, **change) -> str:
    """A copy of `good` under step `step` (its data folder copied too), sealed with
    `key`; `change` replaces fields of the body. Returns the manifest's name."""
    name = catalog.stem(step, good.lineage, good.state_quorum_id)
    data = f"{name}.k{key.tag}.f0rged.data"
    for entry in good.files:
        put(storage, f"{data}/{entry.name}", get(storage, f"{good.data}/{entry.name}"))
    forged = dataclasses.replace(good, step=step, data=data, **change)
    put(storage, forged.name, forged.to_bytes(key))
    return forged.name


def reseal(storage: Storage, name: str, body: object, raw: bytes | None = None) -> None:
    """Manifest `name` with `body`, sealed with the job's own key (a writer's bug, or a
    leaked token): what the schema check alone must refuse."""
    text = raw.decode() if raw is not None else json.dumps(body)
    sealed = {"body": text, "key": KEY.tag, "mac": KEY.seal(text.encode())}
    put(storage, name, json.dumps(sealed).encode())


def test_a_forged_newer_manifest_is_never_resumed_from(storage, caplog):
    older = write(storage, state(1.0), 10)
    name = forge_newer(storage, older, 9000, OTHER)
    # The attack of the issue: the old format, every CRC recomputed.
    body = json.dumps({**dataclasses.asdict(older), "step": 9001})
    put(
        storage,
        "step-0000009001.l0.q1.json",
        json.dumps({"body": body, "crc32": zlib.crc32(body.encode())}).encode(),
    )
    with caplog.at_level(logging.WARNING, logger="phalanx.snapshots"):
        assert newest(storage, 1, KEY) == older
    assert f"snapshot {name} is another job's" in caplog.text
    assert "step-0000009001.l0.q1.json is damaged: its manifest is not a sealed" in caplog.text


def test_a_manifest_naming_the_jobs_key_with_a_wrong_seal_is_refused(storage, caplog):
    older = write(storage, state(1.0), 10)
    name = forge_newer(storage, older, 9000, KEY)
    outer = json.loads(get(storage, name))
    outer["mac"] = hashlib.sha256(outer["body"].encode()).hexdigest()  # no key to seal it
    put(storage, name, json.dumps(outer).encode())
    with caplog.at_level(logging.WARNING, logger="phalanx.snapshots"):
        assert newest(storage, 1, KEY) == older
    assert "its seal does not verify under this job's key" in caplog.text


class Payload:
    """A pickle that writes a marker file when unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path(self.marker).write_text, ("ran",))


@pytest.mark.parametrize("sealer", ["attacker", "job"])
def test_a_pickle_payload_in_metadata_never_runs(storage, tmp_path, sealer, caplog):
    """Sealed by an attacker, it is refused at its seal; sealed with the job's own key
    (a leaked token), its hash holds but the allow list builds nothing it names."""
    older = write(storage, state(1.0), 10)
    marker = tmp_path / "marker"
    payload = pickle.dumps(Payload(str(marker)))
    key = OTHER if sealer == "attacker" else KEY
    files = [
        FileEntry(f.name, len(payload), hashlib.sha256(payload).hexdigest())
        if f.name.endswith(".metadata")
        else f
        for f in older.files
    ]
    name = forge_newer(storage, older, 20, key, files=files)
    forged = Manifest.parse(get(storage, name), name, key)
    put(storage, f"{forged.data}/rank-0/.metadata", payload)
    rank = RankSnapshots(
        SnapshotSettings.of(storage.location, "5"),
        replica_id="g0",
        group_rank=0,
        world_size=1,
        store=lambda: None,
        token=TOKEN,
        state=lambda: state(0.0),
    )
    rank.storage = storage
    with caplog.at_level(logging.WARNING, logger="phalanx.snapshots"):
        assert rank.resume() == older
    assert not marker.exists(), "the payload ran"
    if sealer == "job":
        assert "which no DCP metadata holds: refused unread" in caplog.text
        with pytest.raises(Exception, match="no DCP metadata holds"):
            load(storage, forged, 0, state(0.0))
        assert not marker.exists()


@pytest.fixture
def local(tmp_path) -> Storage:
    return Storage.at(tmp_path / "snaps")


@pytest.mark.parametrize("what", ["data folder", "rank folder", "shard", "metadata", "inside"])
def test_a_symlink_anywhere_is_refused_by_name_and_never_followed(local, tmp_path, what, caplog):
    older = write(local, state(1.0), 10)
    newer = write(local, state(2.0), 20)
    root = local.root
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = {
        "data folder": root / newer.data,
        "rank folder": root / newer.data / "rank-0",
        "shard": root / newer.data / "rank-0" / "__0_0.distcp",
        "metadata": root / newer.data / "rank-0" / ".metadata",
        "inside": root / newer.data / "rank-0" / "__0_0.distcp",
    }[what]
    moved = outside / victim.name
    victim.rename(moved)
    if what == "inside":  # a link to a file of its own snapshot folder
        moved.rename(victim.parent / "real")
        victim.symlink_to("real")
    else:
        victim.symlink_to(moved)
    with caplog.at_level(logging.WARNING, logger="phalanx.snapshots"):
        assert newest(local, 1, KEY) == older
    assert f"snapshot {newer.name} is damaged" in caplog.text
    assert "is a symbolic link, never followed" in caplog.text


def test_metadata_linked_to_etc_passwd_is_refused(local, caplog):
    older = write(local, state(1.0), 10)
    newer = write(local, state(2.0), 20)
    meta = local.root / newer.data / "rank-0" / ".metadata"
    meta.unlink()
    meta.symlink_to("/etc/passwd")
    with caplog.at_level(logging.WARNING, logger="phalanx.snapshots"):
        assert newest(local, 1, KEY) == older
        with pytest.raises(Exception, match="symbolic link"):
            load(local, newer, 0, state(0.0))
    assert "rank-0/.metadata is a symbolic link" in caplog.text


def bounded(call, seconds: float = 30.0):
    """`call()` in a thread; fails the test if it is not done within `seconds`."""
    done = threading.Event()
    result: list = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as e:  # handed to the test
            result.append(e)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(seconds), f"still running after {seconds} s: it blocks"
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


@pytest.mark.parametrize("what", ["symlink to /dev/zero", "fifo", "directory", "device"])
def test_a_manifest_that_is_no_regular_file_blocks_nothing(local, what, caplog, capsys):
    from phalanx.snapshots import listing

    older = write(local, state(1.0), 10)
    planted = local.root / "step-0000009000.l0.q1.json"
    if what == "symlink to /dev/zero":
        planted.symlink_to("/dev/zero")
    elif what == "fifo":
        os.mkfifo(planted)
    elif what == "directory":
        planted.mkdir()
    else:
        if os.geteuid() != 0:
            pytest.skip("making a device node needs root (CI runs as root)")
        os.mknod(planted, 0o600 | 0o020000, os.makedev(1, 5))  # /dev/zero's
    with caplog.at_level(logging.WARNING, logger="phalanx.snapshots"):
        assert bounded(lambda: newest(local, 1, KEY)) == older
        assert bounded(lambda: listing.main([str(local.root), "--token", TOKEN])) == 0
        bounded(lambda: write(local, state(3.0), 30, keep=1))
    out = capsys.readouterr().out
    assert "REFUSED" in out and "step-0000009000.l0.q1.json" in out
    assert "not a regular file" in caplog.text or "symbolic link" in caplog.text
    assert planted.exists() or planted.is_symlink(), "a planted entry is not the job's to remove"


@pytest.mark.parametrize("what", ["fifo", "directory", "symlink to /dev/zero", "sparse 10**12"])
def test_a_shard_that_is_no_regular_file_of_its_size_is_refused_quickly(local, what, caplog):
    older = write(local, state(1.0), 10)
    newer = write(local, state(2.0), 20)
    shard = local.root / newer.data / "rank-0" / "__0_0.distcp"
    if what == "sparse 10**12":
        os.truncate(shard, 10**12)
    else:
        shard.unlink()
        if what == "fifo":
            os.mkfifo(shard)
        elif what == "directory":
            shard.mkdir()
        else:
            shard.symlink_to("/dev/zero")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="phalanx.snapshots"):
        assert bounded(lambda: newest(local, 1, KEY)) == older
        with pytest.raises(Exception, match="__0_0.distcp"):
            bounded(lambda: load(local, newer, 0, state(0.0)))
    assert time.monotonic() - started < 10
    assert "rank-0/__0_0.distcp" in caplog.text


def test_a_sparse_huge_shard_on_an_fsspec_store_is_refused_by_its_listed_size(caplog):
    """memory:// has no sparse files: a shard the listing says is of another size is
    refused before it is read, as a local one is."""
    storage = Storage.at(f"memory://phalanx-attack-{uuid.uuid4().hex[:8]}")
    try:
        older = write(storage, state(1.0), 10)
        newer = write(storage, state(2.0), 20)
        put(storage, f"{newer.data}/rank-0/__0_0.distcp", b"\0" * (1 << 20))
        with caplog.at_level(logging.WARNING, logger="phalanx.snapshots"):
            assert newest(storage, 1, KEY) == older
        assert "bytes, not" in caplog.text
    finally:
        storage.fs.rm(storage.root, recursive=True)


MALFORMED = {
    "a list": ([], "its body is a list, not an object"),
    "no files": ("drop files", "its body lacks files"),
    "bad json": (b"{not json", "its body is not readable JSON"),
    "a step that is a string": ({"step": "9000"}, "its body's step is '9000'"),
    "a NUL in a name": ("nul", "with a character no file name of a snapshot holds"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_each_malformed_manifest_is_skipped_with_one_warning(storage, case, caplog, capsys):
    from phalanx.snapshots import listing

    older = write(storage, state(1.0), 10)
    newer = write(storage, state(2.0), 20)
    change, reason = MALFORMED[case]
    body = json.loads(json.loads(get(storage, newer.name))["body"])
    if change == "drop files":
        del body["files"]
    elif change == "nul":
        body["files"][0]["name"] = "rank-0/\x00x"
    elif isinstance(change, dict):
        body.update(change)
    if isinstance(change, bytes):
        reseal(storage, newer.name, None, raw=change)
    else:
        reseal(storage, newer.name, change if isinstance(change, list) else body)
    with caplog.at_level(logging.WARNING, logger="phalanx.snapshots"):
        assert newest(storage, 1, KEY) == older
    named = [r for r in caplog.records if newer.name in r.getMessage()]
    assert len(named) == 1 and reason in named[0].getMessage(), caplog.text
    assert listing.main([storage.location, "--token", TOKEN]) == 0
    out = capsys.readouterr().out
    assert "MALFORMED" in out and "resumes from step 10" in out


def test_a_foreign_or_old_token_snapshot_is_listed_as_such_and_never_loaded(storage, capsys):
    from phalanx.snapshots import listing

    mine = write(storage, state(1.0), 10)
    theirs = write(storage, state(2.0), 20, key=OTHER)
    assert newest(storage, 1, KEY) == mine
    assert listing.main([storage.location, "--token", TOKEN]) == 0
    out = capsys.readouterr().out
    assert f"{theirs.name}" in out and "ANOTHER JOB'S" in out
    assert "resumes from step 10" in out


def resumer(storage: Storage, rank: int, world: int, store, st: dict) -> RankSnapshots:
    r = RankSnapshots(
        SnapshotSettings.of(storage.location, "5"),
        replica_id="g0",
        group_rank=rank,
        world_size=world,
        store=store,
        token=TOKEN,
        state=lambda: st,
    )
    r.storage = storage
    return r


@pytest.mark.parametrize("how", ["garbage metadata", "another model's shapes"])
def test_a_snapshot_that_verifies_but_does_not_load_falls_back(storage, how, caplog):
    older = write(storage, state(1.0), 10)
    if how == "another model's shapes":
        newer = write(storage, state(2.0, n=7), 20)
    else:
        newer = write(storage, state(2.0), 20)
        junk = b"\x80\x05not a pickle at all"
        files = [
            FileEntry(f.name, len(junk), hashlib.sha256(junk).hexdigest())
            if f.name.endswith(".metadata")
            else f
            for f in newer.files
        ]
        put(storage, f"{newer.data}/rank-0/.metadata", junk)
        put(storage, newer.name, dataclasses.replace(newer, files=files).to_bytes(KEY))
    with caplog.at_level(logging.WARNING, logger="phalanx.snapshots"):
        assert resumer(storage, 0, 1, lambda: None, state(0.0)).resume() == older
    assert f"snapshot {newer.name} is damaged: it verifies but does not load" in caplog.text
    loaded = load(storage, older, 0, state(0.0))
    assert torch.equal(loaded["m"]["w"], state(1.0)["m"]["w"])


def test_every_rank_of_a_group_falls_back_alike(tmp_path, caplog):
    """Rank 1's part of the newest does not load: both ranks take the older one."""
    storage = Storage.at(tmp_path)
    with (
        _core.LighthouseServer() as lighthouse,
        _core.ManagerServer("g0", lighthouse.address, token=TOKEN) as server,
    ):
        store = Store(server.address, token=TOKEN, timeout=10.0)
        writers = [
            SnapshotWriter(storage, replica_id="g0", group_rank=r, world_size=2, keep=5,
                           store=lambda: store, key=KEY)
            for r in (0, 1)
        ]  # fmt: skip
        for step, n1 in ((10, 1000), (20, 7)):  # step 20: rank 1 of another model
            writers[1].take(state(float(step), n1), step, 1, 0)
            writers[0].take(state(float(step)), step, 1, 0)
            assert all(w.wait(60) for w in writers)
        older = Manifest.parse(
            (tmp_path / "step-0000000010.l0.q1.json").read_bytes(),
            "step-0000000010.l0.q1.json",
            KEY,
        )
        picked: list = [None, None]

        def resume(r: int) -> None:
            picked[r] = resumer(storage, r, 2, lambda: store, state(0.0)).resume()

        with caplog.at_level(logging.WARNING, logger="phalanx.snapshots"):
            threads = [threading.Thread(target=resume, args=(r,)) for r in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        assert picked == [older, older]
        assert "rank 1 cannot use it" in caplog.text


def test_planted_names_neither_count_towards_keep_nor_are_removed(storage, caplog):
    planted = "step-9999999999.l0.q1.json"
    put(storage, planted, b"any content")
    theirs = write(storage, state(9.0), 500, keep=5, key=OTHER)
    with caplog.at_level(logging.WARNING, logger="phalanx.snapshots"):
        for step in (10, 20, 30, 40):
            last = write(storage, state(float(step)), step, keep=1)
    names = storage.names()
    assert planted in names and theirs.name in names and theirs.data in names
    assert last.name in names and last.data in names
    assert [n for n in catalog.newest_first(names) if n.startswith("step-00000000")] == [last.name]
    assert newest(storage, 1, KEY) == last
    assert "left alone, neither counted" in caplog.text and planted in caplog.text


def test_keep_k_leaves_k_loadable_snapshots_beside_a_newer_foreign_two_rank_one(storage):
    foreign = dataclasses.replace(write(storage, state(5.0), 900, key=OTHER))
    put(storage, "step-0000000950.l0.q1.json", dataclasses.replace(
        foreign, step=950, world_size=2, structures=["{}", "{}"]).to_bytes(OTHER))  # fmt: skip
    for step in (10, 20, 30):
        write(storage, state(float(step)), step, keep=2)
    own = [n for n in catalog.newest_first(storage.names()) if n.startswith("step-00000000")]
    assert own == ["step-0000000030.l0.q1.json", "step-0000000020.l0.q1.json"]
    for name in own:
        m = Manifest.parse(get(storage, name), name, KEY)
        assert torch.equal(
            load(storage, m, 0, state(0.0))["m"]["w"], state(float(m.step))["m"]["w"]
        )


N_FLOATS = 100_000  # 400 kB a snapshot: two fit in 1 MiB, three do not


def full_disk(tmp_path: Path, monkeypatch) -> Iterator[Storage]:
    """A storage that holds two snapshots of N_FLOATS and no third: a real 1 MiB tmpfs
    when run as root (as CI is), else a writer that fails for space while two are held."""
    if os.geteuid() == 0:
        with small_tmpfs(tmp_path / "disk", "1m") as root:
            yield Storage.at(root)
        return
    storage = Storage.at(tmp_path / "disk")
    writer = storage.writer

    def fills(folder: str):
        held = [n for n in storage.names() if n.endswith(".data") and not folder.startswith(n)]
        if len(held) >= 2:
            raise OSError(errno.ENOSPC, "No space left on device (injected: not root)")
        return writer(folder)

    monkeypatch.setattr(storage, "writer", fills)
    yield storage


def test_a_full_disk_at_exactly_keep_makes_room_and_advances(tmp_path, monkeypatch, caplog):
    for storage in full_disk(tmp_path, monkeypatch):
        write(storage, state(1.0, N_FLOATS), 10, keep=2)
        write(storage, state(2.0, N_FLOATS), 20, keep=2)
        with caplog.at_level(logging.WARNING, logger="phalanx.snapshots"):
            third = write(storage, state(3.0, N_FLOATS), 30, keep=2)
        assert "oldest snapshot was removed to make some" in caplog.text
        own = catalog.newest_first(storage.names())
        assert own == ["step-0000000030.l0.q1.json", "step-0000000020.l0.q1.json"]
        assert newest(storage, 1, KEY) == third


def test_a_full_disk_holding_one_says_plainly_the_newest_is_not_advancing(
    tmp_path, monkeypatch, caplog
):
    for storage in full_disk(tmp_path, monkeypatch):
        first = write(storage, state(1.0, N_FLOATS), 10, keep=2)
        write(storage, state(2.0, N_FLOATS), 20, keep=2)
        storage.remove(first.name)
        storage.remove(first.data)  # one left; the disk is still too small for two more
        put(storage, "ballast", b"\0" * 450_000) if os.geteuid() == 0 else None
        writer = SnapshotWriter(
            storage, replica_id="g0", group_rank=0, world_size=1, keep=2, store=None, key=KEY
        )
        if os.geteuid() != 0:
            monkeypatch.setattr(
                storage, "writer",
                lambda folder: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left")),
            )  # fmt: skip
        with caplog.at_level(logging.WARNING, logger="phalanx.snapshots"):
            for step in (30, 40):
                writer.take(state(float(step), N_FLOATS), step, 1, 0)
                assert writer.wait(60)
        plain = [r for r in caplog.records if "is not advancing" in r.getMessage()]
        assert len(plain) == 2, caplog.text  # one every interval
        assert "holds only 1 snapshot(s) of this job" in plain[0].getMessage()
        assert writer.not_advancing == 2
        assert catalog.newest_first(storage.names()) == ["step-0000000020.l0.q1.json"]
