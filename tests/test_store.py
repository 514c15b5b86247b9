"""The job's rendezvous store, served by a manager server behind the job token (I8):
torch's store semantics, waits that end at their deadline, no access without the
token, and real gloo process groups built over it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx import _core
from phalanx.process_group import gloo_group
from phalanx.store import Store

from conftest import HEARTBEAT_INTERVAL

TOKEN = "s3cret-token"


@pytest.fixture
def server(lighthouse) -> Iterator[phalanx.ManagerServer]:
    with phalanx.ManagerServer(
        "g", lighthouse.address, token=TOKEN, heartbeat_interval=HEARTBEAT_INTERVAL
    ) as server:
        yield server


@pytest.fixture
def store(server) -> Store:
    return Store(server.address, token=TOKEN, timeout=5.0)


def test_set_get_add_and_delete_behave_as_torchs_stores(store):
    store.set("a", b"1")
    store.set("s", "text")
    assert (store.get("a"), store.get("s")) == (b"1", b"text")
    assert [store.add("n", 3), store.add("n", -1)] == [3, 2]
    assert store.get("n") == b"2"
    assert store.check(["a", "n"]) and not store.check(["a", "absent"])
    keys = store.num_keys()
    assert store.delete_key("a") and not store.delete_key("a")
    # torch's wrappers call a Python store's methods by their C++ names.
    prefixed = dist.PrefixStore("p", store)
    prefixed.set("b", b"1")
    assert prefixed.num_keys() >= 1
    assert prefixed.delete_key("b") and not prefixed.check(["b"])
    assert store.num_keys() == keys - 1


def test_compare_set_swaps_only_the_expected_value(store):
    assert store.compare_set("k", b"", b"first") == b"first"
    assert store.compare_set("k", b"other", b"second") == b"first"
    assert store.compare_set("k", b"first", b"second") == b"second"
    # An absent key and a non-empty expectation: nothing is set.
    assert store.compare_set("absent", b"x", b"y") == b"x"
    assert not store.check(["absent"])


def test_a_get_waits_for_the_key_and_is_woken_by_its_set(store):
    started, got = threading.Event(), []

    def reader() -> None:
        started.set()
        got.append(store.get("late"))

    thread = threading.Thread(target=reader)
    thread.start()
    started.wait(5)
    Store(store.address, token=TOKEN).set("late", b"here")
    thread.join(10)
    assert got == [b"here"]


def test_waits_end_at_their_deadline_with_torchs_store_error(store):
    store.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError, match='"absent" was not set in the rendezvous store'):
        store.get("absent")
    with pytest.raises(dist.DistStoreError, match=r'"here" \(one of 2 awaited\)'):
        store.wait(["here", "absent"], timedelta(seconds=0.2))


def test_a_store_that_is_not_there_yet_is_waited_for_then_named(lighthouse):
    from conftest import free_port

    address = f"127.0.0.1:{free_port()}"
    client = _core.StoreClient(address, timeout=0.5)
    with pytest.raises(ConnectionError, match=f"rendezvous store at {address}"):
        client.get("k")


@pytest.mark.parametrize("token", [None, "wrong"])
def test_without_the_token_nothing_is_read_or_written(server, store, token):
    store.set("rank0", b"10.0.0.1:4000")
    intruder = _core.StoreClient(server.address, token=token, timeout=2.0)
    with pytest.raises(PermissionError, match="missing or wrong job token"):
        intruder.set("rank0", b"evil:1")
    with pytest.raises(PermissionError, match="missing or wrong job token"):
        intruder.get("rank0")
    with pytest.raises(PermissionError):
        intruder.add("n", 1)
    with pytest.raises(PermissionError):
        intruder.wait(["rank0"])
    assert store.get("rank0") == b"10.0.0.1:4000"


def test_a_value_over_the_limit_is_refused_naming_it_and_the_store_goes_on(store):
    with pytest.raises(ValueError, match="larger than the limit of 4194304"):
        store.set("big", b"x" * (4 << 20 | 1))
    with pytest.raises(ValueError, match="not a counter"):
        store.set("addr", b"h:1") or store.add("addr", 1)
    store.set("after", b"ok")
    assert store.get("after") == b"ok"


def test_the_store_names_its_replica_group(store):
    assert store.get(_core.STORE_REPLICA_ID_KEY) == b"g"


@pytest.mark.parametrize("size", [2, 3])
def test_a_gloo_group_builds_over_the_store_and_reduces(server, size):
    results: dict[int, list[float]] = {}

    def rank(r: int) -> None:
        # torch holds the Python half of a store only while Python does.
        store = Store(server.address, token=TOKEN, timeout=10.0)
        prefixed = dist.PrefixStore("q1/r0", store)
        group = gloo_group(prefixed, r, size, timedelta(seconds=10), "127.0.0.1")
        tensor = torch.full((4,), float(r + 1))
        group.allreduce([tensor]).wait()
        results[r] = tensor.tolist()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    total = float(sum(range(1, size + 1)))
    assert results == {r: [total] * 4 for r in range(size)}


def test_a_quorums_keys_are_dropped_once_the_group_moved_on(lighthouse, server, store):
    a = phalanx.ManagerClient(server.address, token=TOKEN)
    first = a.quorum(phalanx.QuorumRequest(group_rank=0, step=0, timeout=5.0))
    store.set(f"{first.store_prefix}/0", b"gloo address")
    store.set("phalanx/group/0", b"the group's own")

    # b joins: a new quorum, and a is done with the process group of the first.
    with phalanx.ManagerServer(
        "h", lighthouse.address, token=TOKEN, heartbeat_interval=HEARTBEAT_INTERVAL
    ) as other:
        b = phalanx.ManagerClient(other.address, token=TOKEN)
        request = phalanx.QuorumRequest(group_rank=0, step=0, timeout=5.0)
        joined = threading.Thread(target=b.quorum, args=(request,))
        joined.start()
        # The lighthouse may answer a's next request before it counts b in; b is in
        # within a few.
        for step in range(1, 10):
            second = a.quorum(phalanx.QuorumRequest(group_rank=0, step=step, timeout=5.0))
            if second.quorum_id != first.quorum_id:
                break
        joined.join(10)

    assert second.quorum_id > first.quorum_id
    assert not store.check([f"{first.store_prefix}/0"])
    assert store.get("phalanx/group/0") == b"the group's own"


def test_a_get_right_after_a_wait_takes_the_value_the_wait_saw(store):
    other = Store(store.address, token=TOKEN, timeout=5.0)
    store.set("k", b"1")
    store.wait(["k"])
    other.set("k", b"2")
    # One round trip for both: the value as the wait returned.
    assert store.get("k") == b"1"
    # Anything else in between, and the get asks the store.
    store.wait(["k"])
    store.check(["k"])
    assert store.get("k") == b"2"
