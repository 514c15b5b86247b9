"""`phalanx.torchft.process_group`: torchft.process_group's public names, on phalanx.

In torchft the training script builds a process group and the Manager reconfigures it
on every quorum change. In phalanx the Manager builds and rebuilds the cross-group
process group itself (gloo for CPU tensors, NCCL for CUDA ones), so two kinds of names
live here:

- `ProcessGroupGloo`, `ProcessGroupNCCL`, `ProcessGroupBabyGloo` and
  `ProcessGroupBabyNCCL` keep torchft's constructors and describe the backend the
  user picks: `timeout` and `device_type`, which `phalanx.torchft.Manager` reads.
  They run no collective: calling one raises, naming what to use instead.
- `ManagedProcessGroup(manager)` is a real `torch.distributed.ProcessGroup` over the
  replica groups of the step's quorum. `dist.all_reduce`, the functional collectives
  and FSDP2's all-reduce hook run on it; its collectives go through the Manager, and
  a failure makes the step's vote "no" instead of raising.

>>> import torch, torch.distributed as dist, phalanx
>>> with phalanx.LighthouseServer(bind="127.0.0.1:0", join_timeout=0.01) as lighthouse:
...     manager = phalanx.Manager(replica_id="solo", lighthouse=lighthouse.address)
...     manager.start_quorum()
...     pg = ManagedProcessGroup(manager)
...     t = torch.tensor([1.0, 3.0])
...     dist.all_reduce(t, op=dist.ReduceOp.AVG, group=pg)
...     t, pg.size(), pg.rank(), manager.should_commit()
...     pg.unregister()
...     manager.shutdown()
(tensor([1., 3.]), 1, 0, True)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _register_process_group, _unregister_process_group

from phalanx.manager import Handle
from phalanx.torchft.manager import phalanx_manager

__all__ = [
    "ManagedProcessGroup",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupBabyXCCL",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupXCCL",
]

#: torchft's default: a minute for a collective (and for building the group).
DEFAULT_TIMEOUT = timedelta(seconds=60)
#: torchft's ProcessGroupNCCL watchdog default.
DEFAULT_WATCHDOG_TIMEOUT = timedelta(seconds=5)

#: ProcessGroup methods phalanx does not run across replica groups, and the
#: torch.distributed function each serves (for the message).
UNSUPPORTED = {
    "allgather": "all_gather",
    "allgather_coalesced": "all_gather_coalesced",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "_allgather_base": "all_gather_into_tensor",
    "all_gather_single": "all_gather_into_tensor",
    "all_gather_single_coalesced": "all_gather_into_tensor_coalesced",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all_single",
    "all_to_all_single": "all_to_all_single",
    "gather": "gather",
    "gather_into_tensor": "gather_into_tensor",
    "gather_single": "gather_into_tensor",
    "scatter": "scatter",
    "barrier": "barrier",
    "monitored_barrier": "monitored_barrier",
    "send": "send",
    "recv": "recv",
    "recv_anysource": "recv",
    "recvAnysource": "recv",
}
SUPPORTED = (
    "all-reduce with ReduceOp.SUM or ReduceOp.AVG (dist.all_reduce, "
    "torch.distributed._functional_collectives.all_reduce, FSDP2's set_all_reduce_hook)"
)


def positive_timeout(value: object, name: str = "timeout") -> timedelta:
    """`value` (a timedelta or seconds) as a positive timedelta; ValueError or
    TypeError naming `name` otherwise.

    >>> positive_timeout(1.5)
    datetime.timedelta(seconds=1, microseconds=500000)
    >>> positive_timeout(timedelta(0))
    Traceback (most recent call last):
    ...
    ValueError: timeout must be positive and finite, got 0:00:00
    """
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(
            f"{name} must be a datetime.timedelta or a number of seconds, "
            f"got {type(value).__name__}"
        )
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{name} must be positive and finite, got {value}")
    return value if isinstance(value, timedelta) else timedelta(seconds=seconds)


# -- the backends a torchft script picks ---------------------------------------------


class _Backend:
    """What a torchft process group tells phalanx: the backend of the cross-group
    process group and its collective deadline. The Manager builds the group itself."""

    backend: ClassVar[str]
    device_type: ClassVar[str]

    def __init__(self, timeout: timedelta | float = DEFAULT_TIMEOUT) -> None:
        self.timeout = positive_timeout(timeout)

    @property
    def collective_timeout(self) -> timedelta:
        """The deadline of one cross-group collective under torchft's semantics."""
        return self.timeout

    def getBackendName(self) -> str:
        return self.backend

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(timeout={self.timeout.total_seconds()} s, "
            f"device_type={self.device_type!r})"
        )


def _runs_nothing(name: str) -> Callable[..., Any]:
    def method(self: _Backend, *args: object, **kwargs: object) -> Any:
        what = type(self).__name__
        if name == "configure":
            doing = "configures the cross-group process group itself on every quorum change"
        else:
            doing = "builds and rebuilds the cross-group process group itself"
        raise RuntimeError(
            f"{what}.{name}(): in phalanx the Manager {doing}; {what} only tells "
            f"phalanx.torchft.Manager to use {self.backend} with a {self.timeout} timeout. "
            "Average a tensor with manager.allreduce(tensor), or run torch.distributed "
            "collectives on ManagedProcessGroup(manager)"
        )

    method.__name__ = name
    return method


for _name in ("configure", "size", "rank", "allreduce", "allreduce_coalesced", *UNSUPPORTED):
    setattr(_Backend, _name, _runs_nothing(_name))


class ProcessGroupGloo(_Backend):
    """Reduce CPU tensors across replica groups over gloo (torchft's
    `ProcessGroupGloo(timeout=timedelta(seconds=60), pg=None)`).

    >>> ProcessGroupGloo(timeout=timedelta(seconds=5))
    ProcessGroupGloo(timeout=5.0 s, device_type='cpu')
    >>> ProcessGroupGloo().allreduce([torch.ones(1)], None)
    Traceback (most recent call last):
    ...
    RuntimeError: ProcessGroupGloo.allreduce(): in phalanx the Manager builds ...
    """

    backend = "gloo"
    device_type = "cpu"

    def __init__(
        self, timeout: timedelta | float = DEFAULT_TIMEOUT, pg: dist.ProcessGroup | None = None
    ) -> None:
        if pg is not None:
            raise ValueError(
                "ProcessGroupGloo(pg=...): phalanx builds the cross-group gloo group itself "
                "on every quorum change and cannot wrap a given one; leave pg out (run "
                "collectives of your own group on it directly)"
            )
        super().__init__(timeout)


class ProcessGroupNCCL(_Backend):
    """Reduce CUDA tensors across replica groups over NCCL (torchft's
    `ProcessGroupNCCL(timeout=timedelta(seconds=60), watchdog_timeout=timedelta(seconds=5))`).

    torchft's watchdog thread aborts a collective stuck past `watchdog_timeout`;
    phalanx aborts the NCCL communicator in process at the collective's deadline, and
    at once when the lighthouse reports a dead peer, so `collective_timeout` is the
    shorter of the two (`watchdog_timeout=None`: `timeout` alone).

    >>> ProcessGroupNCCL(timeout=30, watchdog_timeout=timedelta(seconds=5)).collective_timeout
    datetime.timedelta(seconds=5)
    """

    backend = "nccl"
    device_type = "cuda"

    def __init__(
        self,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
        watchdog_timeout: timedelta | float | None = DEFAULT_WATCHDOG_TIMEOUT,
    ) -> None:
        super().__init__(timeout)
        self.watchdog_timeout = (
            None
            if watchdog_timeout is None
            else positive_timeout(watchdog_timeout, "watchdog_timeout")
        )

    @property
    def collective_timeout(self) -> timedelta:
        if self.watchdog_timeout is None:
            return self.timeout
        return min(self.timeout, self.watchdog_timeout)


class ProcessGroupBabyGloo(_Backend):
    """gloo in torchft's "baby" form (`ProcessGroupBabyGloo(timeout=60.0)`, seconds or
    a timedelta). torchft runs the collectives in a subprocess so that a hung one can
    be killed with it; phalanx needs none: every gloo collective has a deadline and
    its wait is cut short as soon as the lighthouse reports a dead peer. Here it is
    `ProcessGroupGloo`.

    >>> ProcessGroupBabyGloo(timeout=10).timeout
    datetime.timedelta(seconds=10)
    """

    backend = "gloo"
    device_type = "cpu"


class ProcessGroupBabyNCCL(_Backend):
    """NCCL in torchft's "baby" form (`ProcessGroupBabyNCCL(timeout=60.0)`, seconds or
    a timedelta). torchft runs NCCL in a subprocess so that a hung communicator can be
    killed with the process (at the cost of a second CUDA context); phalanx aborts the
    NCCL communicator in process instead (at the collective's deadline, or when the
    lighthouse reports a dead peer) and builds a fresh one for the next quorum. Here
    it is `ProcessGroupNCCL` without a watchdog timeout.

    >>> ProcessGroupBabyNCCL(timeout=timedelta(seconds=30)).device_type
    'cuda'
    """

    backend = "nccl"
    device_type = "cuda"


_NO_XCCL = (
    "{name}: phalanx reduces across replica groups over gloo (CPU tensors) or NCCL "
    "(CUDA tensors) only, not XCCL (Intel XPU); use ProcessGroupGloo with the "
    "tensors on the CPU, or ProcessGroupNCCL on CUDA devices"
)


class ProcessGroupXCCL:
    """torchft's XCCL group for Intel XPUs: not available on phalanx (raises).

    >>> ProcessGroupXCCL()
    Traceback (most recent call last):
    ...
    NotImplementedError: ProcessGroupXCCL: phalanx reduces across replica groups over ...
    """

    def __init__(self, timeout: timedelta | float = DEFAULT_TIMEOUT) -> None:
        raise NotImplementedError(_NO_XCCL.format(name="ProcessGroupXCCL"))


class ProcessGroupBabyXCCL:
    """torchft's XCCL group in a subprocess: not available on phalanx (raises)."""

    def __init__(self, timeout: timedelta | float = 60.0) -> None:
        raise NotImplementedError(_NO_XCCL.format(name="ProcessGroupBabyXCCL"))


# -- a real ProcessGroup over the quorum -----------------------------------------------

#: Every ManagedProcessGroup registered by name, held from here: torch's registry
#: holds the C++ half only, and a Python subclass whose Python half is gone has lost
#: its methods.
_REGISTERED: dict[str, ManagedProcessGroup] = {}
_NUMBERS = itertools.count()


class _ManagedWork(dist.Work):
    """The all-reduces of one collective call. `wait()` finishes them (each within the
    Manager's collective deadline, whatever `timeout` says) and returns whether the
    tensors now hold the result; after a failure they keep this group's own values
    and the step's vote will be "no". It never raises for a peer's failure."""

    def __init__(self, handles: list[Handle], tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._handles = handles
        self._tensors = tensors
        self._ok: bool | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._ok is None:
            results = [handle.wait() for handle in self._handles]
            self._ok = all(results)
        return self._ok

    def get_future(self) -> torch.futures.Future:
        """A completed future of the tensors (waits for the collective first)."""
        self.wait()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._tensors)
        return future


class ManagedProcessGroup(dist.ProcessGroup):
    """A `torch.distributed.ProcessGroup` over the replica groups of the current
    quorum, whose collectives are the Manager's all-reduces: this rank meets the
    same-numbered rank of every other group, and a failed, aborted or timed-out
    collective leaves the tensor as it was and makes the step's vote "no" instead of
    raising. A group that heals this step contributes zeros.

    `manager` is a `phalanx.Manager` or a `phalanx.torchft.Manager`; collectives run
    between its `start_quorum()` and `should_commit()`. `size()` is the number of
    groups whose contribution counts this step (a healing group's does not; 1 once
    the step has failed), `rank()` this group's replica rank (0 once the step has
    failed); both wait for the step's quorum, as a collective does.

    Only all-reduce runs here, with `ReduceOp.SUM` or `ReduceOp.AVG`: phalanx has no
    other collective across replica groups. Any other raises NotImplementedError
    naming it.

    The group is registered with torch under `group_name`, so the functional
    collectives find it (by the object or by the name) and `wait_tensor` waits on
    its work. FSDP2 hosts fault tolerance the way torchtitan does: `fully_shard`
    over the replica group's own ranks, and an all-reduce hook that averages each
    reduce-scattered gradient shard across the groups::

        pg = ManagedProcessGroup(manager)
        model.set_all_reduce_hook(
            lambda grad: dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=pg)
        )
        manager.start_quorum()
        manager.wait_quorum()   # a heal writes the parameters before forward, not in backward
        loss_fn(model(x), y).backward()
        if manager.should_commit():
            optimizer.step()

    The hook's all-reduce takes the step's quorum if nothing took it before; take it
    with `wait_quorum()` before the forward pass, so that a group that heals
    receives its state before FSDP2 reads the parameters (see `phalanx.hsdp`).
    """

    def __init__(self, manager: Any) -> None:
        inner = phalanx_manager(manager, "ManagedProcessGroup")
        # torch's fallback rank and size; this group answers both itself (below).
        super().__init__(0, 1)
        self._manager = inner
        self._group_name = f"phalanx-managed:{inner.replica_id}:{next(_NUMBERS)}"
        #: The name `register` gave it in torch's world, if any.
        self._world_name: str | None = None
        _register_process_group(self._group_name, self)
        _REGISTERED[self._group_name] = self

    # -- what it runs ----------------------------------------------------------------

    def allreduce(
        self,
        tensors: torch.Tensor | Sequence[torch.Tensor],
        opts: dist.AllreduceOptions | dist.ReduceOp | None = None,
    ) -> dist.Work:
        """Sums or averages each tensor in place over the step's participants."""
        return self._allreduce(tensors, opts)

    def allreduce_coalesced(
        self,
        tensors: Sequence[torch.Tensor],
        opts: dist.AllreduceCoalescedOptions | dist.ReduceOp | None = None,
    ) -> dist.Work:
        return self._allreduce(tensors, opts)

    def _allreduce(self, tensors: torch.Tensor | Sequence[torch.Tensor], opts: object) -> dist.Work:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        average = _is_average(opts)
        for t in tensors:
            if average and not (t.is_floating_point() or t.is_complex()):
                raise TypeError(
                    f"ReduceOp.AVG of a {t.dtype} tensor: an integer average cannot be kept "
                    "in place; all-reduce with ReduceOp.SUM and divide by size()"
                )
        handles = []
        for t in tensors:
            # The Manager reduces a copy: gloo cannot cancel a collective in flight,
            # so a failed step's all-reduce may still write into its buffer later.
            bucket = t.detach().clone(memory_format=torch.contiguous_format)
            handles.append(self._manager.allreduce(bucket, then=t.copy_, average=average))
        return _ManagedWork(handles, tensors)

    # -- what torch asks of a process group ------------------------------------------

    def size(self) -> int:
        """Groups whose contribution counts this step (1 once the step has failed)."""
        if not self._manager.wait_quorum():
            return 1
        return self._manager.num_participants()

    def rank(self) -> int:
        """This group's rank among the step's replica groups (0 once it has failed)."""
        if not self._manager.wait_quorum():
            return 0
        return self._manager.replica_rank()

    # The names torch's C++ side asks for.
    def getSize(self) -> int:
        return self.size()

    def getRank(self) -> int:
        return self.rank()

    def getBackendName(self) -> str:
        return "phalanx-managed"

    @property
    def group_name(self) -> str:
        """The name torch's registry knows this group by (functional collectives):
        the one `register` gave it, else one of its own."""
        return self._world_name or self._group_name

    def register(self, name: str) -> ManagedProcessGroup:
        """Makes this group one of torch.distributed's named groups, as `new_group`
        makes one: `get_rank(group)`, `get_world_size(group)`, `get_backend(group)`,
        `get_process_group_ranks(group)` and `destroy_process_group()` know it, and
        the functional collectives find it by `name` too. Its rank and size stay
        the step's (`rank()`, `size()`), asked anew each time. Returns the group.

        `name` must be new to this process (ValueError naming the group that holds
        it); registering again under the same name does nothing.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"register() takes a group name (a non-empty str), got {name!r}")
        if self._world_name == name:
            return self
        if self._world_name is not None:
            raise ValueError(
                f"{self!r} is registered as {self._world_name!r} already; a group has one "
                "name in torch's world: call unregister() first"
            )
        holder = next((pg for pg, n in _world().pg_names.items() if n == name), None)
        if holder is not None or name in _REGISTERED:
            raise ValueError(
                f"torch.distributed has a group named {name!r} already "
                f"({holder or _REGISTERED[name]!r}); give each group its own name"
            )
        _register_process_group(name, self)
        _REGISTERED[name] = self
        world = _world()
        world.pg_map[self] = (self.getBackendName(), None)
        world.pg_names[self] = name
        world.pg_group_ranks[self] = _OwnRank(self)
        world.pg_backend_config[self] = self.getBackendName()
        tag = f"ptd:{name}"
        world.pg_to_tag[self] = tag
        world.tags_to_pg.setdefault(tag, []).append(self)
        self._world_name = name
        return self

    def unregister(self) -> None:
        """Drops the group from torch's registries (and this module's hold on it)."""
        for name in (self._group_name, self._world_name):
            if name is not None and _REGISTERED.get(name) is self:
                del _REGISTERED[name]
                _unregister_process_group(name)
        if self._world_name is not None:
            world = _world()
            for table in (world.pg_map, world.pg_names, world.pg_group_ranks):
                table.pop(self, None)
            world.pg_backend_config.pop(self, None)
            tag = world.pg_to_tag.pop(self, None)
            holders = world.tags_to_pg.get(tag, [])
            if self in holders:
                holders.remove(self)
            self._world_name = None

    def errored(self) -> Exception | None:
        """Why this step's collectives failed (the step's vote will be "no"), or None."""
        failure = self._manager.failure
        return RuntimeError(failure) if failure else None

    def __repr__(self) -> str:
        return f"ManagedProcessGroup({self._group_name!r})"


#: torchft's ProcessGroup methods that a phalanx ManagedProcessGroup leaves to others:
#: calling one raises NotImplementedError saying who does it.
_MANAGED_INSTEAD = {
    "configure": "the Manager builds and rebuilds the cross-group process group at "
    "every quorum change itself",
    "set_timeout": "the Manager's timeout (and the backend's, ProcessGroupGloo(timeout=...)) "
    "bounds each collective",
    "abort": "a failed collective fails the step's vote; the Manager rebuilds the group",
}


def _world() -> Any:
    """torch.distributed's table of the process's groups (`new_group` fills it)."""
    return dist.distributed_c10d._world


class _OwnRank(Mapping[int, int]):
    """A registered group's entry in torch's table of ranks, from this process's
    global rank (0 without a default process group) to its rank in the group, the
    step's replica rank, asked of the group at each look-up: the groups of a step
    change from one quorum to the next."""

    def __init__(self, group: ManagedProcessGroup) -> None:
        self._group = group

    @staticmethod
    def _global() -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def __getitem__(self, global_rank: int) -> int:
        if global_rank != self._global():
            raise KeyError(global_rank)
        return self._group.rank()

    def __iter__(self) -> Iterator[int]:
        return iter((self._global(),))

    def __len__(self) -> int:
        return 1


def _is_average(opts: object) -> bool:
    """True for AVG, False for SUM; NotImplementedError naming any other reduction."""
    op = getattr(opts, "reduceOp", opts)  # AllreduceOptions, or a ReduceOp given as is
    if op is None:
        return False
    kind = getattr(op, "op", op)  # a ReduceOp instance holds its RedOpType
    if kind == dist.ReduceOp.SUM:
        return False
    if kind == dist.ReduceOp.AVG:
        return True
    name = getattr(kind, "name", str(kind))
    raise NotImplementedError(
        f"ManagedProcessGroup cannot reduce with ReduceOp.{name}: phalanx sums across "
        f"replica groups; supported: {SUPPORTED}"
    )


def _unsupported(name: str, function: str) -> Callable[..., Any]:
    def method(self: ManagedProcessGroup, *args: object, **kwargs: object) -> Any:
        raise NotImplementedError(
            f"ManagedProcessGroup.{name} (torch.distributed.{function}) does not run across "
            f"replica groups: phalanx has only all-reduce there; supported: {SUPPORTED}"
        )

    method.__name__ = name
    return method


for _name, _function in UNSUPPORTED.items():
    setattr(ManagedProcessGroup, _name, _unsupported(_name, _function))


def _left_to_the_manager(name: str, instead: str) -> Callable[..., Any]:
    def method(self: ManagedProcessGroup, *args: object, **kwargs: object) -> Any:
        raise NotImplementedError(
            f"ManagedProcessGroup.{name} (torchft's ProcessGroup.{name}) is not phalanx's "
            f"to call: {instead}"
        )

    method.__name__ = name
    return method


for _name, _instead in _MANAGED_INSTEAD.items():
    setattr(ManagedProcessGroup, _name, _left_to_the_manager(_name, _instead))


#: torchft.process_group names phalanx does not provide, and what to use instead.
_INSTEAD = {
    "ProcessGroup": "torch.distributed.ProcessGroup, or ManagedProcessGroup(manager)",
    "ProcessGroupWrapper": "ManagedProcessGroup(manager)",
    "ErrorSwallowingProcessGroupWrapper": (
        "ManagedProcessGroup(manager), whose errors fail the step instead of raising"
    ),
    "FakeProcessGroupWrapper": "real faults: kill a replica group's process",
    "ProcessGroupDummy": "a solo Manager, whose all-reduce leaves the tensor as it is",
    "ProcessGroupBaby": "ProcessGroupBabyGloo or ProcessGroupBabyNCCL",
    "create_store_client": "phalanx.Manager.group_store(prefix)",
}


def __getattr__(name: str) -> Any:
    if name in _INSTEAD:
        raise AttributeError(
            f"phalanx.torchft.process_group has no {name!r} (torchft.process_group.{name}); "
            f"use {_INSTEAD[name]}"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
