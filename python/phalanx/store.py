"""The job's rendezvous store as a `torch.distributed.Store`.

Every replica group's manager server also serves a key-value store, on its own port
and behind the job token: the group's own process groups and the cross-group ones
of the quorums the group comes first in find each other there (gloo's addresses,
NCCL's unique id). Without the token nobody can read or write a key, so nobody can
join a process group of the job or steer its members elsewhere (invariant I8).

`Store` hands that store to torch.distributed: gloo, NCCL and
`init_process_group(store=...)` take it like any other store.

>>> from phalanx import _core
>>> with _core.LighthouseServer() as lighthouse, _core.ManagerServer(
...     "a", lighthouse.address, token="s3cret"
... ) as server:
...     store = Store(server.address, token="s3cret", timeout=5.0)
...     store.set("rank0", b"10.0.0.1:4000")
...     store.get("rank0"), store.add("joined", 1), store.add("joined", 1)
(b'10.0.0.1:4000', 1, 2)
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

from phalanx import _core


@contextlib.contextmanager
def _as_store_errors() -> Iterator[None]:
    """torch's own words for a store that times out or cannot be reached, which its
    callers (and phalanx's) already handle; a refused token or a bad request stay
    `PermissionError` and `ValueError`."""
    try:
        yield
    except TimeoutError as e:
        raise dist.DistStoreError(str(e)) from e
    except ConnectionError as e:
        raise dist.DistNetworkError(str(e)) from e


@functools.lru_cache(maxsize=16)
def _client(address: str, token: str | None, timeout: float) -> _core.StoreClient:
    """One connection per store, kept across process groups: every quorum change
    rebuilds the cross-group group, mostly over the same store, and a new HTTP/2
    connection would cost it a handshake. A connection that broke is made again by
    its next call."""
    return _core.StoreClient(address, token=token, timeout=timeout)


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class Store(dist.Store):
    """The rendezvous store of the replica group whose manager server listens at
    `address`. `timeout` (seconds) is how long `get` and `wait` wait for keys (and for
    a store still starting) and the deadline of every other call; torch's
    `set_timeout` changes the former.

    A wait answers with the values of its keys, and a `get` of one of them that comes
    right after it on the same thread (nothing else in between) returns that value
    without asking again: rendezvous reads each key this way, and its keys are
    written once, so a quorum change costs half the round trips."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        client: _core.StoreClient | None = None,
    ):
        super().__init__()
        self._client = client or _client(address, token, timeout)
        self.set_timeout(timedelta(seconds=timeout))
        self._waited = threading.local()

    @property
    def address(self) -> str:
        return self._client.address

    def _just_waited(self) -> dict[str, bytes]:
        """The values the last call on this thread waited for (if it was a wait),
        forgotten as this call takes them."""
        seen = getattr(self._waited, "values", None)
        self._waited.values = None
        return seen or {}

    def _wait_s(self, timeout: timedelta | None = None) -> float:
        return (timeout if timeout is not None else self.timeout).total_seconds()

    def set(self, key: str, value: bytes | str) -> None:
        self._just_waited()
        with _as_store_errors():
            self._client.set(key, _bytes(value))

    def get(self, key: str) -> bytes:
        seen = self._just_waited()
        if key in seen:
            value = seen.pop(key)
            self._waited.values = seen  # the wait's other keys, for the gets to come
            return value
        with _as_store_errors():
            return self._client.get(key, self._wait_s())

    def add(self, key: str, value: int) -> int:
        self._just_waited()
        with _as_store_errors():
            return self._client.add(key, value)

    def compare_set(
        self, key: str, expected_value: bytes | str, desired_value: bytes | str
    ) -> bytes:
        self._just_waited()
        with _as_store_errors():
            return self._client.compare_set(key, _bytes(expected_value), _bytes(desired_value))

    def check(self, keys: list[str]) -> bool:
        self._just_waited()
        with _as_store_errors():
            return self._client.check(list(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._just_waited()
        keys = list(keys)
        with _as_store_errors():
            values = self._client.wait(keys, self._wait_s(timeout))
        if values:
            self._waited.values = dict(zip(keys, values, strict=True))

    def delete_key(self, key: str) -> bool:
        self._just_waited()
        with _as_store_errors():
            return self._client.delete_key(key)

    def num_keys(self) -> int:
        self._just_waited()
        with _as_store_errors():
            return self._client.num_keys()

    # torch's wrappers of a store written in Python (PrefixStore among them) call these
    # two by their C++ names.
    deleteKey = delete_key  # noqa: N815
    getNumKeys = num_keys  # noqa: N815

    def clone(self) -> Store:
        """Another handle on the same store (torch asks for one per thread that
        talks to it); it shares this one's connection."""
        return Store(self.address, client=self._client, timeout=self._wait_s())
