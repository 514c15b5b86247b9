"""torchft's `Manager`, with a phalanx transaction under every step.

The signature, the methods and their meaning are torchft's; what each argument
becomes in phalanx:

    pg                    the backend of the cross-group collectives (gloo: CPU, NCCL:
                          CUDA) and their timeout; phalanx builds the group itself
    load_state_dict,      the state a healing group receives (registered as
    state_dict            "default", as torchft does), streamed striped and checksummed
                          from every up-to-date peer
    min_replica_size      a step with fewer participating groups does not commit
    use_async_quorum      False waits for the quorum in start_quorum()
    timeout               collectives, the commit vote, a heal, wrap_future()
    quorum_timeout        the quorum request
    rank, world_size,     this rank in its replica group, and the group's store
    store_addr/port       (group rank 0 serves it; RANK, WORLD_SIZE, MASTER_ADDR/PORT)
    lighthouse_addr       the lighthouse (TORCHFT_LIGHTHOUSE, else PHALANX_LIGHTHOUSE)
    replica_id            the group's name; under `phalanx run` the launcher's name wins
    hostname              the host peers reach this rank's servers at
    world_size_mode       DYNAMIC, or FIXED_WITH_SPARES (min_replica_size groups
                          contribute, the others are spares that add zeros)
    max_retries           consecutive steps that may fail before should_commit() raises

Accepted but unneeded, logged once when given: `connect_timeout` and `quorum_retries`
(a rank goes on asking a lighthouse it cannot reach for its lighthouse timeout),
`port` (the manager server shares group rank 0's store port) and
`checkpoint_transport` (a healing group fetches from its peers' state servers).
torchft's environment overrides hold too: TORCHFT_TIMEOUT_SEC,
TORCHFT_QUORUM_TIMEOUT_SEC, TORCHFT_CONNECT_TIMEOUT_SEC, TORCHFT_QUORUM_RETRIES,
TORCHFT_MANAGER_PORT.

>>> from datetime import timedelta
>>> import phalanx, torch
>>> from phalanx.torchft import Manager, ProcessGroupGloo
>>> lighthouse = phalanx.LighthouseServer(join_timeout=0.01)
>>> box = {"w": torch.zeros(2)}
>>> manager = Manager(
...     pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
...     load_state_dict=box.update, state_dict=lambda: dict(box),
...     min_replica_size=1, replica_id="a", lighthouse_addr=lighthouse.address,
...     rank=0, world_size=1, store_addr="127.0.0.1", store_port=0,
... )
>>> manager.start_quorum()
>>> manager.allreduce(torch.ones(2)).wait()
True
>>> manager.should_commit(), manager.current_step(), manager.participating_rank()
(True, 1, 0)
>>> manager.state_dict()
{'step': 1, 'batches_committed': 1}
>>> manager.shutdown(); lighthouse.shutdown()
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from enum import Enum
from typing import Any, TypeVar

import torch
from torch.distributed import ReduceOp

import phalanx
from phalanx.quantize import allreduce_int8
from phalanx.settings import Timeouts
from phalanx.step import Handle

__all__ = ["ExceptionWithTraceback", "Manager", "WorldSizeMode"]

log = logging.getLogger("phalanx.torchft")

T = TypeVar("T")

# torchft's defaults, as objects of their own so that an argument given is told apart
# from one left out (only a given one is worth a log line).
_TIMEOUT = timedelta(seconds=60)
_QUORUM_TIMEOUT = timedelta(seconds=60)
_CONNECT_TIMEOUT = timedelta(seconds=60)
_HEARTBEAT = timedelta(milliseconds=100)

#: The registered name of the Manager's own state, which heals with the user's.
STATE_NAME = "torchft_manager"


class WorldSizeMode(Enum):
    """How many groups contribute to a step once more than `min_replica_size` live."""

    #: Every live group contributes; averages divide by their number.
    DYNAMIC = 0
    #: Exactly `min_replica_size` groups contribute; the others are spares.
    FIXED_WITH_SPARES = 1


class ExceptionWithTraceback(Exception):
    """An error reported for this step, with where it was raised."""

    def __init__(self, e: BaseException) -> None:
        self.original_exception = e
        self.stack_trace = "".join(traceback.format_exception(e))
        super().__init__(f"{e}\n{self.stack_trace}")


class _Unneeded:
    """Logs once per process what a torchft argument given becomes in phalanx."""

    _told: set[str] = set()
    _lock = threading.Lock()

    @classmethod
    def tell(cls, name: str, why: str) -> None:
        with cls._lock:
            if name in cls._told:
                return
            cls._told.add(name)
        log.info("torchft's %s is not needed on phalanx: %s", name, why)


class Work:
    """What `Manager.allreduce()` returns: `wait()` finishes the all-reduce (the
    tensor then holds the result) and never raises for a peer's failure; the step's
    vote becomes no instead. `get_future()` waits too and returns a completed future
    of the tensor."""

    def __init__(self, finish: Callable[[], bool], tensor: torch.Tensor):
        self._finish = finish
        self._tensor = tensor
        self._lock = threading.Lock()
        self._ok: bool | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        with self._lock:
            if self._ok is None:
                self._ok = self._finish()
        return True

    def get_future(self) -> torch.futures.Future[torch.Tensor]:
        self.wait()
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(self._tensor)
        return future


class Manager:
    """torchft's Manager on phalanx (see the module docstring). `phalanx` is the
    phalanx Manager underneath, for what torchft has no word for."""

    def __init__(
        self,
        pg: Any,
        load_state_dict: Callable[[T], None] | None,
        state_dict: Callable[[], T] | None,
        min_replica_size: int,
        use_async_quorum: bool = True,
        timeout: timedelta = _TIMEOUT,
        quorum_timeout: timedelta = _QUORUM_TIMEOUT,
        connect_timeout: timedelta = _CONNECT_TIMEOUT,
        rank: int | None = None,
        world_size: int | None = None,
        world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC,
        store_addr: str | None = None,
        store_port: int | None = None,
        lighthouse_addr: str | None = None,
        replica_id: str | None = None,
        port: int | None = None,
        hostname: str | None = None,
        heartbeat_interval: timedelta = _HEARTBEAT,
        checkpoint_transport: Any = None,
        init_sync: bool = True,
        max_retries: int | None = None,
        quorum_retries: int = 0,
    ) -> None:
        env = os.environ
        _check(min_replica_size, world_size_mode, max_retries, load_state_dict, state_dict)
        device = _device(pg)
        timeout = _seconds_env(env, "TORCHFT_TIMEOUT_SEC", timeout, "timeout")
        quorum = _seconds_env(env, "TORCHFT_QUORUM_TIMEOUT_SEC", quorum_timeout, "quorum_timeout")
        _tell_unneeded(
            env,
            connect_timeout=connect_timeout is not _CONNECT_TIMEOUT,
            quorum_retries=quorum_retries,
            port=port,
            checkpoint_transport=checkpoint_transport,
        )
        backend = getattr(pg, "collective_timeout", pg.timeout)
        collective = min(timeout, _positive(backend, "the process group's timeout"))
        self.phalanx = phalanx.Manager(
            replica_id=_replica_id(env, replica_id),
            lighthouse=_lighthouse(env, lighthouse_addr),
            timeout=timeout,
            quorum_timeout=quorum,
            collective_timeout=collective,
            commit_timeout=timeout,
            heal_timeout=timeout,
            lighthouse_timeout=max(300.0, 10 * timeout, quorum),
            group_rank=rank,
            group_world_size=world_size,
            store_addr=store_addr,
            store_port=store_port,
            advertise_host=hostname,
            device=device,
            init_sync=init_sync,
            heartbeat_interval=_positive(heartbeat_interval, "heartbeat_interval"),
        )
        self._min_replica_size = min_replica_size
        self._world_size_mode = world_size_mode
        self._use_async_quorum = use_async_quorum
        self._max_retries = max_retries
        self._commit_failures = 0
        self._batches_committed = 0
        self._errored: ExceptionWithTraceback | None = None
        self._timeouts = self.phalanx.timeouts
        self.phalanx.register_state(STATE_NAME, self._own_state, self._load_own_state)
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)

    # -- the state a healing group receives --------------------------------------------

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]
    ) -> None:
        """Registers state under `key`: `state_dict()` is what a healing peer receives,
        `load_state_dict(received)` loads it."""
        if key == STATE_NAME:
            raise ValueError(f"{key!r} is the Manager's own state; pick another key")
        self.phalanx.register_state(key, state_dict, load_state_dict)

    def set_state_dict_fns(
        self, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]
    ) -> None:
        """Registers the job's state under one key (torchft's older spelling of
        `register_state_dict_fn`)."""
        self.register_state_dict_fn("set_state_dict_fns", load_state_dict, state_dict)

    def allow_state_dict_read(self) -> None:
        """Accepted: phalanx serves the state to healing peers only between the
        quorum and the vote, never while the optimizer steps, so reads need no gate."""

    def disallow_state_dict_read(self) -> None:
        """Accepted (see `allow_state_dict_read`)."""

    def _own_state(self) -> dict[str, int]:
        return {"batches_committed": self._batches_committed}

    def _load_own_state(self, state: dict[str, int]) -> None:
        self._batches_committed = int(state["batches_committed"])

    # -- the step ----------------------------------------------------------------------

    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None
    ) -> None:
        """Starts the step's quorum (in the background unless `use_async_quorum` was
        False); a group that is behind heals in it before its first collective."""
        if not allow_heal:
            raise ValueError(
                "allow_heal=False cannot be honoured: phalanx heals a group that is behind "
                "in the quorum that finds it, before the group may contribute; drop the "
                "argument"
            )
        self._errored = None
        quorum = self._timeouts.quorum if timeout is None else _positive(timeout, "timeout")
        self._set_timeouts(replace(self._timeouts, quorum=quorum), "start_quorum(timeout=…)")
        self.phalanx.start_quorum(shrink_only=shrink_only)
        if not self._use_async_quorum:
            self.phalanx.wait_quorum()

    def wait_quorum(self) -> None:
        """Waits for the step's quorum, healing first if this group is behind."""
        self.phalanx.wait_quorum()

    def allreduce(
        self,
        tensor: torch.Tensor,
        should_quantize: bool = False,
        reduce_op: ReduceOp.RedOpType = ReduceOp.AVG,
    ) -> Work:
        """Starts reducing `tensor` in place over the participating groups (AVG by
        default, or SUM). A spare or healing group adds zeros. A failure never raises:
        the step's vote becomes no. `should_quantize` sends int8 codes with per-block
        scales (average only)."""
        if reduce_op not in (ReduceOp.AVG, ReduceOp.SUM):
            raise ValueError(
                f"reduce_op={reduce_op}: phalanx reduces across groups with AVG or SUM"
            )
        if should_quantize and reduce_op != ReduceOp.AVG:
            raise ValueError("should_quantize=True averages; pass reduce_op=ReduceOp.AVG")
        self.phalanx.wait_quorum()
        if self._is_spare():
            tensor.zero_()
        if should_quantize:
            quantized = allreduce_int8(self.phalanx, tensor)
            return Work(quantized.wait, tensor)
        handle: Handle = self.phalanx.allreduce(tensor, average=False)
        divisor = self.num_participants() if reduce_op == ReduceOp.AVG else 1

        def finish() -> bool:
            ok = handle.wait()
            if ok and divisor > 1:
                tensor.div_(divisor)
            return ok

        return Work(finish, tensor)

    def report_error(self, e: BaseException) -> None:
        """Fails this step: its vote will be no, and the next step goes on. The first
        error of a step is the one `errored()` returns."""
        if self._errored is None:
            self._errored = ExceptionWithTraceback(e)
        self.phalanx.report_error(f"reported by the training loop: {e}")

    def errored(self) -> ExceptionWithTraceback | None:
        """The error that failed this step, if one did."""
        if self._errored is None and (failure := self.phalanx.failure) is not None:
            self._errored = ExceptionWithTraceback(RuntimeError(failure))
        return self._errored

    def wrap_future(
        self,
        fut: torch.futures.Future[T],
        default: T,
        timeout: timedelta | None = None,
    ) -> torch.futures.Future[T]:
        """A future of `fut`'s value, or of `default` when `fut` fails or is not done
        within `timeout` (default: the Manager's); the failure fails this step."""
        # The Manager's `timeout` is its commit timeout (see __init__).
        seconds = self._timeouts.commit if timeout is None else _positive(timeout, "timeout")
        out: torch.futures.Future[T] = torch.futures.Future()
        lock = threading.Lock()

        def settle(value: T, error: BaseException | None) -> None:
            with lock:
                if out.done():
                    return
                if error is not None:
                    self.report_error(error)
                out.set_result(value)

        def done(f: torch.futures.Future[T]) -> None:
            try:
                settle(f.value(), None)
            except Exception as e:  # the future's own failure fails the step
                settle(default, e)

        timer = threading.Timer(
            seconds,
            lambda: settle(default, TimeoutError(f"future not done within {seconds:g} s")),
        )
        timer.daemon = True
        timer.start()
        fut.add_done_callback(done)
        out.add_done_callback(lambda _: timer.cancel())
        return out

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """Every rank of every group votes; True when this group commits the step (the
        caller then steps its optimizer). Raises once more than `max_retries` steps in
        a row failed."""
        commit = self._timeouts.commit if timeout is None else _positive(timeout, "timeout")
        self._set_timeouts(replace(self._timeouts, commit=commit), "should_commit(timeout=…)")
        if self.phalanx.wait_quorum() and self.num_participants() < self._min_replica_size:
            self.phalanx.report_error(
                f"{self.num_participants()} group(s) participate, fewer than "
                f"min_replica_size={self._min_replica_size}"
            )
        committed = self.phalanx.should_commit()
        self._set_timeouts(self._timeouts, "should_commit")
        if committed:
            self._commit_failures = 0
            self._batches_committed += self.num_participants()
            return True
        self._commit_failures += 1
        if self._max_retries is not None and self._commit_failures > self._max_retries:
            raise RuntimeError(
                f"{self._commit_failures} steps in a row did not commit (max_retries="
                f"{self._max_retries}); the last: {self.phalanx.failure}"
            )
        return False

    # -- what a training loop may ask -------------------------------------------------

    def participating_rank(self) -> int | None:
        """This group's rank among the groups that contribute to this step, or None
        while it heals or is a spare; waits for the quorum."""
        self.phalanx.wait_quorum()
        rank = self._quorum_participating_rank()
        if rank is None or self._is_spare(rank):
            return None
        return rank

    def num_participants(self) -> int:
        """Groups that contribute to this step; waits for the quorum."""
        self.phalanx.wait_quorum()
        count = self.phalanx.num_participants()
        if self._world_size_mode is WorldSizeMode.FIXED_WITH_SPARES:
            return min(count, self._min_replica_size)
        return count

    def is_participating(self) -> bool:
        """Whether this group's contribution counts this step (not healing, not a
        spare); waits for the quorum."""
        return self.participating_rank() is not None

    def current_step(self) -> int:
        """Steps the job has committed (after a heal: the peers' count)."""
        return self.phalanx.current_step()

    def batches_committed(self) -> int:
        """Batches the job has committed: each committed step adds its participants."""
        return self._batches_committed

    def state_dict(self) -> dict[str, int]:
        """The Manager's part of a checkpoint: the step and the batches committed."""
        return {"step": self.current_step(), "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Resumes from a checkpoint's `state_dict()`, before the first quorum; a live
        group whose state is newer than the checkpoint wins, and this one heals."""
        self.phalanx.resume_at(int(state_dict["step"]))
        self._batches_committed = int(state_dict["batches_committed"])

    def shutdown(self, wait: bool = True) -> None:
        """Stops this rank's servers and threads (waits for them either way)."""
        self.phalanx.shutdown()

    # -- inside -------------------------------------------------------------------------

    def _quorum_participating_rank(self) -> int | None:
        step = self.phalanx._step  # noqa: SLF001 - the quorum taken this step
        quorum = None if step is None else step.quorum
        return None if quorum is None else quorum.participating_rank

    def _is_spare(self, rank: int | None = None) -> bool:
        if self._world_size_mode is not WorldSizeMode.FIXED_WITH_SPARES:
            return False
        rank = self._quorum_participating_rank() if rank is None else rank
        return rank is not None and rank >= self._min_replica_size

    def _set_timeouts(self, timeouts: Timeouts, where: str) -> None:
        if timeouts == self.phalanx.timeouts:
            return  # the common step: no per-call deadline, nothing to check again
        try:
            self.phalanx.timeouts = timeouts
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"phalanx.torchft.Manager has no {name!r}; the phalanx Manager underneath is "
            f"manager.phalanx (see phalanx.Manager for what it offers)"
        )


def phalanx_manager(manager: Any, what: str) -> phalanx.Manager:
    """The phalanx Manager under `manager` (a phalanx.torchft one, or a phalanx one),
    for `what`, which averages over every participating group."""
    if isinstance(manager, Manager):
        if manager._world_size_mode is WorldSizeMode.FIXED_WITH_SPARES:
            raise ValueError(
                f"world_size_mode=FIXED_WITH_SPARES is honoured by Manager.allreduce; {what} "
                "average(s) over every participating group: use WorldSizeMode.DYNAMIC"
            )
        return manager.phalanx
    if isinstance(manager, phalanx.Manager):
        return manager
    raise TypeError(
        f"{what} needs a phalanx.torchft.Manager or a phalanx.Manager, got {type(manager).__name__}"
    )


def _check(
    min_replica_size: Any,
    world_size_mode: Any,
    max_retries: Any,
    load_state_dict: Any,
    state_dict: Any,
) -> None:
    """ValueError, naming the argument, for one that cannot work (before anything
    is opened)."""
    if not isinstance(min_replica_size, int) or min_replica_size < 1:
        raise ValueError(
            f"min_replica_size={min_replica_size!r}: it is the fewest groups a step may "
            "commit with, a positive integer"
        )
    if not isinstance(world_size_mode, WorldSizeMode):
        raise ValueError(f"world_size_mode={world_size_mode!r} is not a WorldSizeMode")
    if max_retries is not None and (not isinstance(max_retries, int) or max_retries < 0):
        raise ValueError(f"max_retries={max_retries!r}: None, or a number of failed steps")
    if (load_state_dict is None) != (state_dict is None):
        raise ValueError(
            "pass both load_state_dict and state_dict, or neither (and register them "
            "later with register_state_dict_fn)"
        )


def _tell_unneeded(
    env: Any,
    *,
    connect_timeout: bool,
    quorum_retries: int,
    port: int | None,
    checkpoint_transport: Any,
) -> None:
    """Logs (once) each torchft argument given that phalanx has no use for."""
    reconnects = (
        "a rank reconnects by itself and asks again until its lighthouse timeout "
        "(PHALANX_LIGHTHOUSE_TIMEOUT)"
    )
    if connect_timeout or "TORCHFT_CONNECT_TIMEOUT_SEC" in env:
        _Unneeded.tell("connect_timeout", reconnects)
    retries = env.get("TORCHFT_QUORUM_RETRIES") or str(quorum_retries)
    if retries.strip() not in ("", "0"):
        _Unneeded.tell("quorum_retries", reconnects)
    if port is not None or env.get("TORCHFT_MANAGER_PORT"):
        _Unneeded.tell(
            "port", "the manager server listens on group rank 0's store port (MASTER_PORT)"
        )
    if checkpoint_transport is not None:
        _Unneeded.tell(
            "checkpoint_transport",
            "a healing group streams the state from every up-to-date peer's state server, "
            "striped and checksummed, straight into its own tensors",
        )


def _device(pg: Any) -> str | None:
    """The device of the collectives that `pg` names (None: the rank's own GPU)."""
    kind = getattr(pg, "device_type", None)
    if kind not in ("cpu", "cuda") or not hasattr(pg, "timeout"):
        raise TypeError(
            f"pg={pg!r}: pass one of phalanx.torchft's process groups (ProcessGroupGloo "
            "for CPU tensors, ProcessGroupNCCL or ProcessGroupBabyNCCL for CUDA ones); "
            "phalanx builds the cross-group process group itself"
        )
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{type(pg).__name__} reduces CUDA tensors, and this process sees no GPU; "
            "use ProcessGroupGloo for CPU training"
        )
    # On CUDA, phalanx takes the rank's own GPU (LOCAL_RANK), as torchrun numbers them.
    return "cpu" if kind == "cpu" else None


def _seconds_env(env: os._Environ[str] | dict[str, str], name: str, given: Any, arg: str) -> float:
    """torchft's rule: the environment variable, when set, wins over the argument."""
    text = env.get(name)
    if text:
        try:
            return _positive(float(text), name)
        except ValueError:
            raise ValueError(f"{name}={text!r} is not a number of seconds") from None
    return _positive(given, arg)


def _positive(value: Any, name: str) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if not isinstance(seconds, int | float) or not 0 < seconds < float("inf"):
        raise ValueError(f"{name}={value!r}: pass a positive, finite timedelta")
    return float(seconds)


def _lighthouse(env: Any, given: str | None) -> str:
    address = given or env.get("TORCHFT_LIGHTHOUSE") or env.get("PHALANX_LIGHTHOUSE") or ""
    scheme, sep, rest = address.partition("://")
    if sep:
        if scheme != "http":
            raise ValueError(
                f"lighthouse address {address!r}: phalanx's lighthouse speaks its own "
                "protocol at host:port (write http://host:port or host:port)"
            )
        address = rest
    return address.rstrip("/")


def _replica_id(env: Any, given: str | None) -> str:
    """The group's name. `phalanx run` names each group and watches it by that name,
    so its name wins; torchft gives a group without a name a random one."""
    launched = env.get("PHALANX_REPLICA_ID")
    if launched:
        if given and given != launched:
            log.info("replica_id %r runs as phalanx run's group %r", given, launched)
        return launched
    return given or str(uuid.uuid4())
