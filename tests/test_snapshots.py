"""Durable snapshots on real storage: what a snapshot holds and how it is published,
what a damaged, truncated or missing file does, a full disk, the newest K kept, a
group of two ranks writing one snapshot through its store, and a Manager resuming a
job whose every group was lost (with and without its lighthouse)."""

from __future__ import annotations

import errno
import logging
import threading
from pathlib import Path

import pytest
import torch

import phalanx
from phalanx import _core
from phalanx.settings import ManagerSettings
from phalanx.snapshots import (
    DamagedSnapshotError,
    Every,
    Manifest,
    SnapshotKey,
    SnapshotSettings,
    Storage,
    catalog,
    load,
    newest,
)
from phalanx.snapshots.catalog import newest_first
from phalanx.snapshots.writer import SnapshotWriter
from phalanx.store import Store

from conftest import small_tmpfs
from state_process import tensor_bytes

TOKEN = "t0k3n"
KEY = SnapshotKey.of(TOKEN)


def trained(seed: int = 0, steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 8)).square().sum().backward()
        opt.step()
    return model, opt


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "opt": opt.state_dict(), "cursor": {"epoch": 3}}


def fingerprint(state) -> list:
    """Every tensor's bytes and every scalar, in order."""
    out = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            out.append(tensor_bytes(v))
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                out.append(repr(k))
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        else:
            out.append(repr(v))

    walk(state)
    return out


def write(
    storage: Storage, state: dict, step: int, *, quorum: int = 1, keep: int = 2, lineage: int = 0
):
    writer = SnapshotWriter(
        storage, replica_id="g0", group_rank=0, world_size=1, keep=keep, store=None, key=KEY
    )
    writer.take(state, step, quorum, lineage)
    assert writer.wait(60)
    return writer.published


def fresh_state() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    model, opt = trained(seed=99, steps=0)
    return model, opt, state_of(model, opt)


def test_a_snapshot_loads_bit_identical_into_a_fresh_model_and_optimizer(tmp_path):
    model, opt = trained()
    storage = Storage.at(tmp_path)
    published = write(storage, state_of(model, opt), step=30, quorum=7)
    assert published is not None and published.name == "step-0000000030.l0.q7.json"
    # Published whole: the manifest and its data folder, no temporary left.
    assert storage.names() == sorted([published.data, published.name])

    found = newest(storage, 1, KEY)
    assert found == published
    model2, opt2, fresh = fresh_state()
    assert fresh["opt"]["state"] == {}  # a fresh Adam: its moments are allocated by the load
    loaded = load(storage, found, 0, fresh)
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["opt"])
    assert loaded["cursor"] == {"epoch": 3}
    assert fingerprint(state_of(model2, opt2)) == fingerprint(state_of(model, opt))


def test_the_write_runs_beside_training_on_a_copy(tmp_path):
    """What is written is the state when take() returned, whatever training does next."""
    storage = Storage.at(tmp_path)
    weight = torch.arange(1 << 20, dtype=torch.float32)
    expected = weight.clone()
    writer = SnapshotWriter(
        storage, replica_id="g0", group_rank=0, world_size=1, keep=2, store=None, key=KEY
    )
    writer.take({"w": {"weight": weight}}, 10, 1, 0)
    weight.add_(1.0)  # the next optimizer step, while the write may be running
    assert writer.wait(60)
    loaded = load(storage, newest(storage, 1, KEY), 0, {"w": {"weight": torch.zeros(1 << 20)}})
    assert torch.equal(loaded["w"]["weight"], expected)


def test_the_newest_k_are_kept_and_the_newest_state_is_chosen(tmp_path):
    storage = Storage.at(tmp_path)
    model, opt = trained()
    for step in (10, 20, 30):
        write(storage, state_of(model, opt), step, keep=2)
    manifests = newest_first(storage.names())
    assert manifests == ["step-0000000030.l0.q1.json", "step-0000000020.l0.q1.json"]
    assert len([n for n in storage.names() if n.endswith(".data")]) == 2
    # A later lineage is newer whatever its step (the lighthouse's order).
    write(storage, state_of(model, opt), 25, quorum=40)
    assert newest(storage, 1, KEY).name == "step-0000000030.l0.q1.json"
    write(storage, state_of(model, opt), 12, quorum=9, lineage=9, keep=3)
    assert newest(storage, 1, KEY).name == "step-0000000012.l9.q9.json"


def _corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "bit-flipped":
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    else:
        path.unlink()


@pytest.mark.parametrize("how", ["truncated", "bit-flipped", "missing"])
def test_a_damaged_shard_is_refused_by_name_and_the_next_older_is_used(tmp_path, how, caplog):
    storage = Storage.at(tmp_path)
    model, opt = trained()
    older = write(storage, state_of(model, opt), 10)
    newer = write(storage, state_of(model, opt), 20)
    shard = tmp_path / newer.data / "rank-0" / "__0_0.distcp"
    _corrupt(shard, how)
    with caplog.at_level(logging.WARNING, logger="phalanx.snapshots"):
        assert newest(storage, 1, KEY) == older
    warning = caplog.text
    assert f"snapshot {newer.name} is damaged" in warning
    assert "rank-0/__0_0.distcp" in warning


def test_a_damaged_manifest_is_refused(tmp_path, caplog):
    storage = Storage.at(tmp_path)
    model, opt = trained()
    older = write(storage, state_of(model, opt), 10)
    newer = write(storage, state_of(model, opt), 20)
    path = tmp_path / newer.name
    path.write_bytes(path.read_bytes().replace(b"g0", b"g1", 1))
    with caplog.at_level(logging.WARNING, logger="phalanx.snapshots"):
        assert newest(storage, 1, KEY) == older
    assert "its seal does not verify" in caplog.text
    with pytest.raises(DamagedSnapshotError, match="not readable"):
        Manifest.parse(b"{not json", newer.name, KEY)


def test_a_snapshot_of_a_group_of_another_size_is_passed_over(tmp_path, caplog):
    storage = Storage.at(tmp_path)
    model, opt = trained()
    write(storage, state_of(model, opt), 10)
    with caplog.at_level(logging.WARNING, logger="phalanx.snapshots"):
        assert newest(storage, 2, KEY) is None
    assert "group of 1 rank(s); this group has 2" in caplog.text


def test_a_failing_store_warns_once_keeps_the_previous_snapshot_and_never_raises(
    tmp_path, caplog, monkeypatch
):
    storage = Storage.at(tmp_path)
    model, opt = trained()
    previous = write(storage, state_of(model, opt), 10)
    writer = SnapshotWriter(
        storage, replica_id="g0", group_rank=0, world_size=1, keep=2, store=None, key=KEY
    )

    def full(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(storage, "publish", full)
    with caplog.at_level(logging.INFO, logger="phalanx.snapshots"):
        for step in (20, 30):
            writer.take(state_of(model, opt), step, 1, 0)
            assert writer.wait(60)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "Input/output error" in warnings[0].getMessage()
    assert "the previous snapshots stay" in warnings[0].getMessage()
    # What the failed writes left is gone; the previous snapshot is whole and newest.
    assert storage.names() == sorted([previous.data, previous.name])
    assert newest(storage, 1, KEY) == previous
    # A copy that cannot be made (a value DCP cannot take) is a warning too, not a raise.
    writer.take({"bad": {"x": object()}}, 40, 1, 0)


def test_a_full_disk_keeps_the_previous_snapshot_whole(tmp_path, caplog):
    with small_tmpfs(tmp_path / "disk", "3m") as root:
        storage = Storage.at(root)
        small = {"m": {"w": torch.ones(64 << 10)}}  # 256 KiB
        previous = write(storage, small, 10)
        big = {"m": {"w": torch.ones(4 << 20)}}  # 16 MiB: cannot fit
        writer = SnapshotWriter(
            storage, replica_id="g0", group_rank=0, world_size=1, keep=2, store=None, key=KEY
        )
        with caplog.at_level(logging.WARNING, logger="phalanx.snapshots"):
            writer.take(big, 20, 1, 0)
            assert writer.wait(60)
        assert "the storage is full" in caplog.text, caplog.text
        assert storage.names() == sorted([previous.data, previous.name])
        loaded = load(storage, newest(storage, 1, KEY), 0, {"m": {"w": torch.zeros(64 << 10)}})
        assert torch.equal(loaded["m"]["w"], small["m"]["w"])


def test_an_fsspec_url_holds_snapshots_too():
    storage = Storage.at("memory://phalanx-test-snapshots")
    model, opt = trained()
    try:
        published = write(storage, state_of(model, opt), 10)
        assert newest(storage, 1, KEY) == published
        _, _, fresh = fresh_state()
        loaded = load(storage, published, 0, fresh)
        assert fingerprint(loaded["model"]) == fingerprint(model.state_dict())
    finally:
        storage.fs.rm("/phalanx-test-snapshots", recursive=True)


@pytest.fixture
def two_ranks(tmp_path):
    """The storage and the writers of ranks 0 and 1 of one group, over its store."""
    storage = Storage.at(tmp_path)
    with (
        _core.LighthouseServer() as lighthouse,
        _core.ManagerServer("g0", lighthouse.address, token=TOKEN) as server,
    ):
        store = Store(server.address, token=TOKEN, timeout=10.0)
        writers = [
            SnapshotWriter(
                storage,
                replica_id="g0",
                group_rank=r,
                world_size=2,
                keep=2,
                store=lambda: store,
                key=KEY,
            )
            for r in (0, 1)
        ]
        yield storage, writers


def test_a_group_of_two_ranks_writes_one_snapshot_with_both_shards(two_ranks):
    storage, writers = two_ranks
    shards = [{"m": {"w": torch.full((1000,), float(r))}} for r in (0, 1)]
    # Rank 1 writes first, rank 0 a moment later: rank 0 publishes once both are in.
    writers[1].take(shards[1], 10, 3, 0)
    writers[0].take(shards[0], 10, 3, 0)
    assert all(w.wait(60) for w in writers)
    published = writers[0].published
    assert published is not None and published.world_size == 2
    assert {f.name.split("/")[0] for f in published.files} == {"rank-0", "rank-1"}
    for r in (0, 1):
        loaded = load(storage, published, r, {"m": {"w": torch.zeros(1000)}})
        assert torch.equal(loaded["m"]["w"], shards[r]["m"]["w"])


def test_a_rank_that_cannot_write_its_shard_keeps_the_group_from_publishing(two_ranks, caplog):
    storage, writers = two_ranks
    with caplog.at_level(logging.WARNING, logger="phalanx.snapshots"):
        writers[1].take({"m": {"w": object()}}, 10, 3, 0)  # cannot be snapshotted
        writers[0].take({"m": {"w": torch.ones(10)}}, 10, 3, 0)
        assert all(w.wait(60) for w in writers)
    assert writers[0].published is None
    assert "could not write its shard" in caplog.text
    assert storage.names() == []


def test_every_parses_steps_and_durations_and_refuses_the_rest():
    assert Every.parse(500) == Every(steps=500)
    assert Every.parse("2m") == Every(seconds=120.0)
    for bad in ("-1", "1.5", "10 minutes", "", True, 0):
        with pytest.raises(ValueError, match="snapshot_every="):
            Every.parse(bad)
    with pytest.raises(ValueError, match="without snapshot_every"):
        ManagerSettings.from_env(
            {"PHALANX_SNAPSHOT_DIR": "/tmp/x"}, replica_id="a", lighthouse="h:1"
        )
    assert SnapshotSettings.of("/x", "3", keep="4").keep == 4


# -- a Manager's job, lost and resumed ------------------------------------------------------


def train(lighthouse: str, root: Path, steps: int, replica_id: str = "a", on_step=None):
    """Trains to `steps` committed steps with snapshots every 5; returns the last step,
    its lineage, the state's fingerprint at each step started, and the last record."""
    model, opt = trained(seed=1, steps=0)
    seen = {}
    with phalanx.Manager(
        replica_id=replica_id,
        lighthouse=lighthouse,
        snapshot_dir=str(root),
        snapshot_every=5,
    ) as m:
        m.register_state("model", model.state_dict, model.load_state_dict)
        m.register_state("opt", opt.state_dict, opt.load_state_dict)
        while m.current_step() < steps:
            m.start_quorum()
            m.wait_quorum()  # healed or resumed, if it had to
            seen[m.current_step()] = fingerprint(model.state_dict())
            if on_step is not None:
                on_step(m.current_step())
            opt.zero_grad()
            model(torch.ones(3, 8)).square().sum().backward()
            for p in model.parameters():
                m.allreduce(p.grad)
            if m.should_commit():
                opt.step()
            # Steps of a few milliseconds outrun a write: a snapshot due while the last
            # is being written is skipped (by design), which the test must not depend on.
            m._rank.snapshots.writer.wait(30)
        seen[m.current_step()] = fingerprint(model.state_dict())
        return m.current_step(), m.lineage, seen, m.last_step


def test_a_job_whose_every_group_was_lost_resumes_from_its_last_snapshot(tmp_path):
    with phalanx.LighthouseServer(join_timeout=0.01) as lighthouse:
        step, lineage, before, _ = train(lighthouse.address, tmp_path, 13)
        assert (step, lineage) == (13, 0)
        # The lighthouse lived: the job goes back to step 10 as a new lineage.
        step, lineage, after, _ = train(lighthouse.address, tmp_path, 14)
    assert step == 14 and lineage > 0
    assert min(after) == 10, "resumed at the last snapshot, not at step 0"
    assert after[10] == before[10], "the state resumed is the state committed at step 10"
    # Redone deterministically, steps 11-13 come out as before (a new lineage though).
    assert after[13] == before[13]


def test_a_cold_start_with_a_new_lighthouse_resumes_too(tmp_path):
    with phalanx.LighthouseServer(join_timeout=0.01) as lighthouse:
        train(lighthouse.address, tmp_path, 7)
    with phalanx.LighthouseServer(join_timeout=0.01) as lighthouse:
        _, _, after, _ = train(lighthouse.address, tmp_path, 8)
    assert min(after) == 5


def test_a_live_group_wins_over_an_older_snapshot(tmp_path, caplog):
    """Group b holds a live state past step 12; group a starts with a snapshot of step
    10 on its disk: a heals from b (its snapshot is never loaded) and the two go on as
    one."""
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    with phalanx.LighthouseServer(join_timeout=0.01) as lighthouse:
        train(lighthouse.address, a_dir, 10)  # a's disk: a snapshot of step 10
        past_12 = threading.Event()
        results = {}

        def b():
            def step(at):
                if at > 12:
                    past_12.set()

            results["b"] = train(lighthouse.address, b_dir, 40, replica_id="b", on_step=step)

        thread = threading.Thread(target=b)
        thread.start()
        try:
            assert past_12.wait(60)
            with caplog.at_level(logging.INFO, logger="phalanx.manager"):
                results["a"] = train(lighthouse.address, a_dir, 40)
        finally:
            thread.join(120)
    assert not thread.is_alive()
    _, _, seen_a, _ = results["a"]
    _, _, seen_b, _ = results["b"]
    assert min(seen_a) > 12, "a healed to b's step"
    assert "not loaded: a live group holds a newer state" in caplog.text
    assert seen_a[40] == seen_b[40]


def test_the_slot_rotates_over_the_groups_and_a_failed_step_asks_again(tmp_path):
    from phalanx.snapshots import RankSnapshots

    settings = SnapshotSettings.of(tmp_path, 5)
    a = RankSnapshots(settings, replica_id="a", group_rank=0, world_size=1, store=lambda: None)

    def groups():
        return ["a", "b"]

    assert not a.ask(4, groups)
    assert not a.ask(5, groups), "slot 1 is b's"
    a.committed(True, False)
    assert a.ask(10, groups), "slot 2 is a's"
    a.committed(False, False)  # the step failed: its retry asks again
    assert a.ask(10, groups)
    a.committed(True, True)
    assert a.due and not a.ask(10, groups)
    other_rank = RankSnapshots(
        settings, replica_id="a", group_rank=1, world_size=2, store=lambda: None
    )
    assert not other_rank.ask(10, groups), "rank 0 asks for the group"


def test_phalanx_snapshots_lists_newest_first_and_names_the_one_a_resume_loads(tmp_path, capsys):
    from phalanx.snapshots import listing

    storage = Storage.at(tmp_path)
    model, opt = trained()
    write(storage, state_of(model, opt), 10)
    newer = write(storage, state_of(model, opt), 20)
    _corrupt(tmp_path / newer.data / "rank-0" / "__0_0.distcp", "bit-flipped")
    assert listing.main([str(tmp_path), "--token", TOKEN]) == 0
    out = capsys.readouterr().out
    assert out.index("step-0000000020") < out.index("step-0000000010")
    assert "DAMAGED" in out and "fails its checksum" in out
    assert "resumes from step 10" in out
    assert listing.main([str(tmp_path / "nowhere")]) == 1
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize(
    "change",
    [
        {"data": "../../etc"},
        {"files": [{"name": "../../../etc/passwd", "size": 1, "sha256": "0" * 64}]},
        {"structures": ["{}", "{}"]},
        {"world_size": 0},
    ],
)
def test_a_manifest_that_checks_out_but_points_elsewhere_is_refused(tmp_path, change):
    """Its own CRC holds (written by hand, or by a broken writer): still refused."""
    import dataclasses
    import json

    storage = Storage.at(tmp_path)
    model, opt = trained()
    good = write(storage, state_of(model, opt), 10)
    fields = json.loads(json.loads(good.to_bytes(KEY))["body"])
    fields.update(change)
    files = [catalog.FileEntry(**f) for f in fields.pop("files")]
    forged = dataclasses.replace(
        good, files=files, **{k: fields[k] for k in change if k != "files"}
    )
    with pytest.raises(DamagedSnapshotError):
        Manifest.parse(forged.to_bytes(KEY), good.name, KEY)
