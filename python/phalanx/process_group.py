"""The fault-tolerant process group: torch.distributed collectives over the replica
groups of the current quorum, rebuilt on every quorum change.

A collective here never hangs and never raises into the training loop: it runs on a
torch.distributed process group (gloo on CPU, NCCL on CUDA) with a deadline, and the
wait for it can be cut short by an abort (a peer's crash pushed by the lighthouse).
Either way the caller gets a failed result and discards the step.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from phalanx.store import Store


def backend_for(device: torch.device) -> str:
    """gloo for CPU tensors, NCCL for CUDA ones."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(frozen=True)
class Membership:
    """Where and how this rank meets its peers in the other replica groups."""

    store_address: str
    prefix: str
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        host, sep, port = self.store_address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(
                f"store address {self.store_address!r} is not host:port; every group's "
                "rank 0 serves a rendezvous store with its manager (MASTER_ADDR:MASTER_PORT)"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")


def gloo_group(
    store: dist.Store, rank: int, size: int, timeout: timedelta, host: str | None
) -> dist.ProcessGroupGloo:
    """A gloo group whose connections use the address of `host` (the one this rank
    advertises), not whatever the machine's host name resolves to: in a container or
    a network namespace that is often loopback, and peers on other hosts could not
    connect. The device options are torch's underscore-named ones; tests cover them."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    if host:
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host.strip("[]"))]
    else:
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, size, options)


#: torch's ProcessGroupNCCL reads this when it is built: what its watchdog does when a
#: collective fails or times out.
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


@contextmanager
def nccl_errors_abort_only() -> Iterator[None]:
    """Builds the NCCL groups in it with error handling 2 (abort the communicator, keep
    the process) unless the user chose another. torch's default, 3, tears the whole
    process down when a collective fails, and across replica groups a peer's loss is
    no reason to die: the step is discarded and the group rebuilt. Groups built
    outside (HSDP's shards within a replica group) keep torch's default.

    >>> import os
    >>> with nccl_errors_abort_only():
    ...     os.environ[NCCL_ERROR_HANDLING]
    '2'
    >>> NCCL_ERROR_HANDLING in os.environ
    False
    """
    if NCCL_ERROR_HANDLING in os.environ:
        yield
        return
    os.environ[NCCL_ERROR_HANDLING] = "2"
    try:
        yield
    finally:
        os.environ.pop(NCCL_ERROR_HANDLING, None)


def _connect(
    membership: Membership,
    backend: str,
    timeout: timedelta,
    host: str | None = None,
    token: str | None = None,
) -> tuple[dist.ProcessGroup, Store]:
    """The process group of `membership`, met in the first participant's rendezvous
    store, which admits only holders of the job's token; and that store, which the
    caller keeps as long as the group (torch holds a store written in Python without
    its Python half: dropped, its methods are gone)."""
    store = Store(membership.store_address, token=token, timeout=timeout.total_seconds())
    prefixed = dist.PrefixStore(membership.prefix, store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        with nccl_errors_abort_only():
            group = dist.ProcessGroupNCCL(prefixed, membership.rank, membership.world_size, options)
        return group, store
    return gloo_group(prefixed, membership.rank, membership.world_size, timeout, host), store


class CollectiveFailed(Exception):
    """A collective did not complete: a peer died, timed out, or the step was aborted.
    `from_backend` is true when the backend (gloo, NCCL) itself reported the failure."""

    def __init__(self, message: str, from_backend: bool = False):
        super().__init__(message)
        self.from_backend = from_backend


class FaultTolerantProcessGroup:
    """Collectives among the same-numbered ranks of the replica groups in a quorum.

    `configure()` builds a fresh torch.distributed process group for a membership;
    `allreduce()` starts a sum and returns a `Pending` whose `wait()` raises
    `CollectiveFailed` rather than hanging or crashing.
    """

    def __init__(
        self,
        timeout: float,
        connect: Callable[..., tuple[dist.ProcessGroup, dist.Store]] = _connect,
        host: str | None = None,
        token: str | None = None,
    ):
        self._timeout = timedelta(seconds=timeout)
        self._connect = connect
        self._host = host
        self._token = token
        self._membership: Membership | None = None
        self._group: dist.ProcessGroup | None = None
        self._store: dist.Store | None = None
        self._backend: str | None = None

    @property
    def membership(self) -> Membership | None:
        return self._membership

    @property
    def build_timeout(self) -> float:
        """How long `configure()` waits for a process group: each of its three stages
        (reaching the store, the peers' addresses in it, connecting to them) may take
        the collective timeout."""
        return 3 * self._timeout.total_seconds()

    def configure(self, membership: Membership, backend: str, abort: Abort | None = None) -> None:
        """Joins `membership`, dropping the previous process group (a dead peer may
        still hold it; its own timeout ends it). Raises `TimeoutError` past
        `build_timeout`, and `CollectiveFailed` as soon as `abort` is set."""
        if membership == self._membership and backend == self._backend:
            return
        self.reset()
        build = _Build(self._connect, (membership, backend, self._timeout, self._host, self._token))
        self._group, self._store = build.result(self.build_timeout, abort or Abort())
        self._membership = membership
        self._backend = backend

    def reset(self) -> None:
        """Forgets the current process group, e.g. after a failed collective or at
        shutdown; `retire` ends it on a thread of its own."""
        group, self._group, self._membership = self._group, None, None
        store, self._store = self._store, None
        if group is not None:
            held = [group, store]
            del group, store
            threading.Thread(
                target=retire, args=(held, self._backend == "nccl"), name="phalanx-retire-pg"
            ).start()

    def allreduce(self, tensor: torch.Tensor, abort: Abort) -> Pending:
        if self._group is None or self._membership is None:
            raise CollectiveFailed("no process group: the quorum is not configured")
        if self._membership.world_size == 1:
            return Pending(None, abort, self._timeout.total_seconds())
        try:
            options = dist.AllreduceOptions()
            options.reduceOp = dist.ReduceOp.SUM
            work = self._group.allreduce([tensor], options)
        except RuntimeError as e:
            raise CollectiveFailed(f"all-reduce could not start: {e}", from_backend=True) from e
        return Pending(work, abort, self._timeout.total_seconds(), on_device=tensor.is_cuda)


def retire(held: list, abort: bool) -> None:
    """Ends a forgotten process group (`held`: it and its store, the last references
    to them): NCCL's is aborted first (`abort`), which cancels its collectives in
    flight; gloo cannot cancel them (callers keep the tensors of a failed step away
    from later steps instead).

    It runs off the training thread, which builds the next group meanwhile: gloo's
    destructor waits for the group's collectives in flight, with a dead peer until
    their timeout, and NCCL's abort took half a second on an H200. The thread is not a
    daemon, so the interpreter waits for it at exit, and every group is gone before
    the interpreter finalizes: a destructor that returns then aborts the process
    ("terminate called without an active exception"), and NCCL's watchdog, calling
    into a store written in Python, crashes it."""
    if abort:
        held[0].abort()
    held.clear()


class _Build:
    """A process group built on a thread of its own, so that the wait for it keeps a
    deadline of ours: gloo waits for a peer's connection up to five times its timeout,
    and a peer that gave up on the build (refused by a third one that died, say) never
    connects. A build given up on runs to its end on its thread, which then drops
    what it built; the thread is not a daemon, for the reason `reset()` gives. It
    builds on the caller's current CUDA device, if any (NCCL binds to it)."""

    def __init__(self, connect: Callable[..., tuple[dist.ProcessGroup, Store]], args: tuple):
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._built: tuple[dist.ProcessGroup, Store] | None = None
        self._error: BaseException | None = None
        self._given_up = False
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        threading.Thread(
            target=self._run, args=(connect, args, device), name="phalanx-build-pg"
        ).start()

    def _run(
        self,
        connect: Callable[..., tuple[dist.ProcessGroup, Store]],
        args: tuple,
        device: int | None,
    ) -> None:
        built, error = None, None
        try:
            if device is not None:
                torch.cuda.set_device(device)
            built = connect(*args)
        except BaseException as e:  # handed to the waiting thread
            error = e
        with self._lock:
            if not self._given_up:
                self._built, self._error = built, error
                built = None
        self._done.set()
        del built  # a group given up on is destroyed here, off the training thread

    def result(self, timeout: float, abort: Abort) -> tuple[dist.ProcessGroup, Store]:
        if not abort.wake_on_abort(self._done):
            self._done.wait(timeout)
        with self._lock:
            if self._built is None and self._error is None:
                self._given_up = True
                if abort.is_set():
                    raise CollectiveFailed(abort.reason or "aborted while building the group")
                raise TimeoutError(
                    f"not built within {timeout:.1f} s: a peer never connected (it gave "
                    "up on this quorum, or it is cut off)"
                )
        if self._error is not None:
            raise self._error
        assert self._built is not None
        return self._built


class Abort:
    """A step's abort flag and its reason. Setting it wakes every wait registered on it
    at once, so a wait for a collective needs no polling to notice that a peer died.

    >>> abort, woken = Abort(), threading.Event()
    >>> abort.wake_on_abort(woken)
    False
    >>> abort.set("group b died")
    >>> woken.is_set(), abort.is_set(), abort.reason
    (True, True, 'group b died')
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._reason: str | None = None
        self._waits: list[threading.Event] = []

    def set(self, reason: str | None = None) -> None:
        with self._lock:
            if not self._set:
                self._reason = reason
            self._set = True
            waits, self._waits = self._waits, []
        for event in waits:
            event.set()

    def clear(self) -> None:
        with self._lock:
            self._set = False
            self._reason = None
            self._waits = []

    def is_set(self) -> bool:
        return self._set

    @property
    def reason(self) -> str | None:
        """Why the step was aborted, if it was."""
        return self._reason

    def wake_on_abort(self, event: threading.Event) -> bool:
        """Sets `event` when the flag is set; True (and nothing registered) if it is
        set already."""
        with self._lock:
            if not self._set:
                self._waits.append(event)
            return self._set


class Pending:
    """A started collective. `wait()` returns when it completes, or raises
    `CollectiveFailed` at its deadline or as soon as `abort` is set.

    `on_device`: the collective runs on a CUDA stream of its own (NCCL). Its future is
    done once the work is queued there, not once it ran, so `wait()` then also makes
    the caller's current stream wait for it: what the caller queues next (the average's
    division, the optimizer) reads the result, not the buffer before it."""

    def __init__(
        self, work: dist.Work | None, abort: Abort, timeout: float, on_device: bool = False
    ):
        self._work = work
        self._on_device = on_device
        self._abort = abort
        self._timeout = timeout
        self._done = threading.Event()
        self._completed = False
        self._error: BaseException | None = None
        if work is None:
            self._completed = True
            self._done.set()
            return
        if abort.wake_on_abort(self._done):
            self._done.set()
        future = work.get_future()
        future.add_done_callback(self._finished)

    def _finished(self, future: torch.futures.Future) -> None:
        try:
            future.value()
        except Exception as e:  # the collective's own failure, reported on wait()
            self._error = e
        self._completed = True
        self._done.set()

    def wait(self) -> None:
        if not self._done.wait(self._timeout):
            raise CollectiveFailed(f"all-reduce did not complete within {self._timeout:.1f} s")
        if not self._completed:
            reason = self._abort.reason or "aborted: a replica group of the quorum died"
            raise CollectiveFailed(reason)
        if self._error is not None:
            raise CollectiveFailed(
                f"all-reduce failed: {self._error}", from_backend=True
            ) from self._error
        if self._on_device and self._work is not None:
            try:
                self._work.wait()  # orders the current stream after NCCL's; no host wait
            except RuntimeError as e:
                raise CollectiveFailed(f"all-reduce failed: {e}", from_backend=True) from e
