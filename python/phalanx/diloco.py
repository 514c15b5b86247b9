"""`phalanx.DiLoCo` and `phalanx.LocalSGD`: replica groups train on their own and
meet only every `sync_every` inner steps, so a job sends a fraction of DDP's bytes.

- LocalSGD: every `sync_every` steps the live groups' parameters are averaged.
- DiLoCo: an inner optimizer (e.g. AdamW) takes the local steps; at a sync, each
  group's pseudo-gradient — the global parameters before the round minus its local
  parameters after it — is averaged over the live groups and handed to an outer
  optimizer (SGD with Nesterov momentum by default) that steps the global
  parameters. The local parameters then start the next round from them.
- Streaming DiLoCo (`fragments=F`, or the modules of the model that sync as one each):
  the parameters are cut into F fragments that sync
  in turn, one every `sync_every / F` steps, so the bytes of a sync are spread out;
  with `overlap_steps=k` a fragment's all-reduce runs during the next k inner steps,
  whose progress on that fragment is kept (replayed onto the new global values).
  `quantize="int8"` sends int8 codes with per-block scales (phalanx.quantize).
- FSDP2 models (torchtitan's): parameters that are DTensors sync shard by shard,
  each rank with the same-numbered rank of the other groups; the global parameters
  and the outer optimizer's state are DTensors of the same layout.

Every sync is a transaction of the Manager, whose step therefore counts syncs: the
first one, when the wrapper is made, agrees on the initial parameters (with the
Manager's `init_sync`, every group starts from the first group's), and each later
one is an outer step. A failure during a sync discards it for every group: the
global parameters stay as they were and each group keeps its local progress for the
next sync. A group that is behind (a restarted one) heals at its next sync from its
peers: it receives the global parameters, the outer optimizer's state and the
schedule (the job's inner step), and its local model restarts from them. Each
group's inner optimizer state and buffers (e.g. batch-norm statistics) stay its own.

>>> import torch, phalanx
>>> lighthouse = phalanx.LighthouseServer(bind="127.0.0.1:0", join_timeout=0.05)
>>> manager = phalanx.Manager(replica_id="solo", lighthouse=lighthouse.address, timeout=10.0)
>>> model = torch.nn.Linear(4, 1)
>>> inner = torch.optim.AdamW(model.parameters(), lr=0.01)
>>> diloco = phalanx.DiLoCo(manager, model, inner, sync_every=4)
>>> x, y = torch.randn(64, 4), torch.randn(64, 1)
>>> while diloco.inner_step < 8:
...     diloco.zero_grad()
...     torch.nn.functional.mse_loss(model(x), y).backward()
...     sync = diloco.step()  # an inner step; a sync every 4th
...     if sync is not None:
...         print(sync.inner_step, sync.committed, sync.step)
4 True 2
8 True 3
>>> manager.shutdown()
>>> lighthouse.shutdown()
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from phalanx.manager import Handle, Manager
from phalanx.optim import Optimizer
from phalanx.quantize import allreduce_int8

__all__ = ["DEFAULT_OUTER_OPTIMIZER", "DiLoCo", "LocalSGD", "SyncOutcome"]

log = logging.getLogger("phalanx.diloco")

#: The outer optimizer of the DiLoCo paper: SGD with Nesterov momentum.
DEFAULT_OUTER_OPTIMIZER = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)

QUANTIZERS = (None, "int8")


@dataclass(frozen=True)
class SyncOutcome:
    """What one sync did, as `DiLoCo.step()` returns it."""

    #: The job's inner step at which the sync started.
    inner_step: int
    #: The fragment that synced; None for the first sync (the initial parameters).
    fragment: int | None
    committed: bool
    #: The Manager's step after the sync: syncs committed by the job so far.
    step: int
    #: Groups whose pseudo-gradient counted (a healing group contributes none).
    participants: int
    #: Whether this group received the global state from its peers in this sync.
    healed: bool
    #: Why the sync was discarded, if it was.
    failure: str | None


def _shard(t: torch.Tensor) -> torch.Tensor:
    """The values of `t` this rank holds, as a plain tensor sharing its storage: a
    DTensor's (an FSDP2 parameter's) local shard, any other tensor itself. Read anew
    at each use: FSDP2 may give a parameter new local storage when it first runs."""
    return t.to_local() if isinstance(t, DTensor) else t


def _as_grad(view: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`view` (a shard's values) as the gradient of `like`: a DTensor of the same
    layout for a DTensor, else `view` itself."""
    if not isinstance(like, DTensor):
        return view
    return DTensor.from_local(
        view,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


class _Flat:
    """The parameters of one dtype within a fragment, with one buffer that carries
    their pseudo-gradient through the all-reduce. Each rank reduces the shards it
    holds (all of a parameter that is not a DTensor): the same-numbered rank of every
    group holds the same shard, so shard by shard is the whole average."""

    def __init__(self, local: list[torch.Tensor], global_: list[torch.Tensor]):
        self.local = local
        self.global_ = global_
        shards = [_shard(p) for p in local]
        total = sum(p.numel() for p in shards)
        self.buffer = torch.empty(total, dtype=shards[0].dtype, device=shards[0].device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in shards:
            self.views.append(self.buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        #: The local values when the sync started, while inner steps overlap it.
        self.started: torch.Tensor | None = None

    @torch.no_grad()
    def pseudo_gradient(self, keep_start: bool) -> None:
        for view, g, p in zip(self.views, self.global_, self.local, strict=True):
            torch.sub(_shard(g), _shard(p), out=view)
        if keep_start:
            self.started = torch.cat([_shard(p).reshape(-1) for p in self.local])

    @torch.no_grad()
    def adopt_global(self) -> None:
        """Local := new global, plus the local progress made since the sync started."""
        offset = 0
        for g_, p_ in zip(self.global_, self.local, strict=True):
            g, p = _shard(g_), _shard(p_)
            if self.started is None:
                p.copy_(g)
            else:
                start = self.started[offset : offset + p.numel()].view_as(p)
                p.sub_(start).add_(g)
            offset += p.numel()
        self.started = None


def _split(sizes: Sequence[int], count: int) -> list[list[int]]:
    """Consecutive runs of parameter indices, `count` of them, about equal in size."""
    total = sum(sizes)
    runs: list[list[int]] = []
    current: list[int] = []
    cumulative = 0
    for i, n in enumerate(sizes):
        current.append(i)
        cumulative += n
        runs_left = count - len(runs) - 1
        params_left = len(sizes) - i - 1
        if runs_left > 0 and (
            cumulative >= total * (len(runs) + 1) / count or params_left == runs_left
        ):
            runs.append(current)
            current = []
    runs.append(current)
    return runs


@dataclass
class _InFlight:
    fragment: int | None
    inner_step: int
    finish_at: int
    handles: list[Any]
    healed: bool


class DiLoCo:
    """Trains `model` with `inner_optimizer` on this group's data and syncs with the
    other live groups every `sync_every` inner steps (see the module docstring).

    The loop keeps its shape: `diloco.zero_grad()`, forward, `backward()`,
    `diloco.step()`. Making the wrapper runs the job's first sync (or, for a group
    joining a running job, waits for the others' next sync and heals in it), so it
    may block until the other groups reach a sync; `join_timeout` bounds that wait.

    `outer_optimizer` makes the optimizer of the global parameters from their list,
    e.g. `functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)`.
    The state is registered with the manager as `name`.
    """

    def __init__(
        self,
        manager: Manager,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        sync_every: int,
        outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] = (
            DEFAULT_OUTER_OPTIMIZER
        ),
        *,
        fragments: int | Sequence[nn.Module] = 1,
        overlap_steps: int = 0,
        quantize: str | None = None,
        name: str = "diloco",
        join_timeout: float = 600.0,
    ):
        if isinstance(inner_optimizer, Optimizer):
            raise TypeError(
                "pass the torch optimizer itself (phalanx.Optimizer's .optimizer): DiLoCo "
                "runs the transactions, only at syncs"
            )
        params = list(model.named_parameters())
        count = fragments if isinstance(fragments, int) else len(fragments)
        _check_settings(sync_every, count, overlap_steps, quantize, len(params))
        self.manager = manager
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.sync_every = sync_every
        self.overlap_steps = overlap_steps
        self.quantize = quantize
        self._names = [n for n, _ in params]
        local = [p for _, p in params]
        self._global = [p.detach().clone() for p in local]
        self.outer_optimizer = outer_optimizer(self._global)
        if isinstance(fragments, int):
            runs = _split([p.numel() for p in local], fragments)
        else:
            runs = _runs_of(local, fragments)
        self._fragments = [self._flats([local[i] for i in run], run) for run in runs]
        self._slot = sync_every // count
        self._inner_step = 0
        self._in_flight: _InFlight | None = None
        self._healed = False
        #: The outcome of the last sync that ended (the first one: when joining).
        self.last_sync: SyncOutcome | None = None
        manager.register_state(name, self._state_dict, self._load_state_dict)
        self._join(join_timeout)

    def _flats(self, local: list[torch.Tensor], run: list[int]) -> list[_Flat]:
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in run:
            by_dtype.setdefault(self._global[i].dtype, []).append(i)
        return [
            _Flat([p for p in local if p.dtype == dtype], [self._global[i] for i in indices])
            for dtype, indices in by_dtype.items()
        ]

    # -- the training loop's calls ------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> SyncOutcome | None:
        """Takes an inner step; at a sync point also syncs (or starts to, with
        `overlap_steps`). Returns the outcome of a sync that ended here, else None."""
        self.inner_optimizer.step(closure)
        return self.count_inner_step()

    def count_inner_step(self) -> SyncOutcome | None:
        """Counts an inner step the caller took itself (e.g. from a step hook of the
        inner optimizer) and syncs where `step()` would; returns what `step()` does."""
        self._inner_step += 1
        outcome = None
        if self._in_flight is not None and self._inner_step >= self._in_flight.finish_at:
            outcome = self._finish()
        if self._inner_step % self._slot == 0:
            self._start(self._fragment_at(self._inner_step))
            if self._in_flight is not None and self._in_flight.finish_at <= self._inner_step:
                outcome = self._finish()
        return outcome

    def finish(self) -> SyncOutcome | None:
        """Finishes the sync in flight now, without waiting for its overlap steps;
        call it after the last inner step so that its sync is not lost."""
        return self._finish() if self._in_flight is not None else None

    @property
    def inner_step(self) -> int:
        """The job's inner step: the same on every live group (a healed group takes
        its peers'), so a loop can run `while diloco.inner_step < total_steps`."""
        return self._inner_step

    @property
    def fragments(self) -> int:
        return len(self._fragments)

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters every group agrees on after the last committed sync (by
        name); evaluate or save these rather than the local model."""
        return dict(zip(self._names, self._global, strict=True))

    # -- the sync transaction -----------------------------------------------------------

    def _fragment_at(self, inner_step: int) -> int:
        return (inner_step // self._slot - 1) % len(self._fragments)

    def _schedule(self, fragment: int | None) -> torch.Tensor:
        """What every group must agree on at this sync, as averages that equal the own
        values exactly when all groups hold the same: f, f^2, t, t^2."""
        f = -1.0 if fragment is None else float(fragment)
        t = float(self._inner_step)
        device = self._global[0].device
        return torch.tensor([f, f * f, t, t * t], dtype=torch.float64, device=device)

    def _start(self, fragment: int | None) -> None:
        """Starts a sync: the quorum, the schedule check (in which a group that is
        behind heals), then the fragment's pseudo-gradient all-reduce."""
        manager = self.manager
        self._healed = False
        manager.start_quorum()
        schedule = self._schedule(fragment)
        expected = schedule.clone()
        ok = manager.allreduce(schedule).wait()
        if ok and not self._healed and not torch.equal(schedule, expected):
            manager.report_error("replica groups disagree on the DiLoCo schedule")
            manager.should_commit()
            raise ValueError(
                f"replica groups disagree on the DiLoCo schedule: this group syncs "
                f"fragment {int(expected[0])} at inner step {int(expected[2])}, the average "
                f"of the groups is fragment {schedule[0].item():g} at step "
                f"{schedule[2].item():g}; start every group with the same sync_every, "
                "fragments and overlap_steps"
            )
        # The job's first sync only agrees on the initial values; a group that healed
        # just now takes its fragment from the inner step it received.
        fragment = None if self._inner_step == 0 else self._fragment_at(self._inner_step)
        handles: list[Any] = []
        if ok and fragment is not None:
            for flat in self._fragments[fragment]:
                flat.pseudo_gradient(keep_start=self.overlap_steps > 0)
                handles.append(self._reduce(flat.buffer))
        finish_at = self._inner_step + (self.overlap_steps if ok else 0)
        self._in_flight = _InFlight(fragment, self._inner_step, finish_at, handles, self._healed)

    def _reduce(self, buffer: torch.Tensor) -> Handle | Any:
        if self.quantize == "int8":
            return allreduce_int8(self.manager, buffer)
        # The buffer lives across syncs: the collective gets a copy, so that one
        # abandoned by a failed sync cannot write into a later sync's buffer.
        return self.manager.allreduce(buffer.clone(), then=buffer.copy_)

    def _finish(self) -> SyncOutcome:
        """Ends the sync in flight: waits for its all-reduce, votes, and on commit
        steps the outer optimizer and restarts the fragment's local values from it."""
        sync, self._in_flight = self._in_flight, None
        assert sync is not None
        manager = self.manager
        ok = all([handle.wait() for handle in sync.handles])
        flats = self._fragments[sync.fragment] if sync.fragment is not None else []
        if ok and not all(torch.isfinite(flat.buffer).all() for flat in flats):
            manager.report_error(
                "the averaged pseudo-gradient holds inf or nan; lower the inner learning rate"
            )
        committed = manager.should_commit()
        if committed and flats:
            self._outer_step(flats)
        elif not committed:
            for flat in flats:
                flat.started = None
        outcome = SyncOutcome(
            inner_step=sync.inner_step,
            fragment=sync.fragment,
            committed=committed,
            step=manager.current_step(),
            participants=manager.num_participants(),
            healed=sync.healed,
            failure=None if committed else (manager.failure or "a rank voted no"),
        )
        log.debug("sync %s", outcome)
        self.last_sync = outcome
        return outcome

    def _outer_step(self, flats: list[_Flat]) -> None:
        for flat in flats:
            for g, view in zip(flat.global_, flat.views, strict=True):
                g.grad = _as_grad(view, g)
        self.outer_optimizer.step()
        for flat in flats:
            for g in flat.global_:
                g.grad = None
            flat.adopt_global()

    def _join(self, timeout: float) -> None:
        """The first sync, retried until it commits or is in flight (a group joining
        a running job waits in it for the others' next sync)."""
        deadline = time.monotonic() + timeout
        while True:
            self._start(None)
            if self._in_flight is not None and self._in_flight.finish_at > self._inner_step:
                return
            outcome = self._finish()
            if outcome.committed:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"could not join the job within {timeout:.0f} s (last attempt: "
                    f"{outcome.failure}); check that the lighthouse is reachable, or raise "
                    "join_timeout when the other groups sync rarely"
                )
            time.sleep(0.1)

    # -- the state a healing group receives --------------------------------------------

    def _settings(self) -> dict[str, Any]:
        return {
            "sync_every": self.sync_every,
            "fragments": len(self._fragments),
            "overlap_steps": self.overlap_steps,
            "quantize": self.quantize,
        }

    def _state_dict(self) -> dict[str, Any]:
        return {
            "global": self.global_parameters(),
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "schedule": {"inner_step": self._inner_step, **self._settings()},
        }

    @torch.no_grad()
    def _load_state_dict(self, state: dict[str, Any]) -> None:
        schedule = state["schedule"]
        theirs = {k: schedule.get(k) for k in self._settings()}
        if theirs != self._settings():
            raise ValueError(
                f"this group runs DiLoCo with {self._settings()}, its peers with {theirs};"
                " start every group with the same settings"
            )
        received = state["global"]
        if list(received) != self._names:
            raise ValueError(
                "the peers' model has other parameters than this group's "
                f"({len(received)} against {len(self._names)}); every group must train the "
                "same model"
            )
        for g, t in zip(self._global, received.values(), strict=True):
            if t is not g:
                _shard(g).copy_(_shard(t))
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self._inner_step = int(schedule["inner_step"])
        for flats in self._fragments:
            for flat in flats:
                flat.started = None
                flat.adopt_global()
        self._healed = True
        log.info("received the global state at inner step %d", self._inner_step)


class LocalSGD(DiLoCo):
    """Each group trains with `optimizer` on its own; every `sync_every` steps the
    live groups' parameters are averaged (DiLoCo whose outer step is plain SGD with
    learning rate 1: global - mean(global - local) = mean(local))."""

    def __init__(
        self,
        manager: Manager,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        sync_every: int,
        *,
        quantize: str | None = None,
        name: str = "local_sgd",
        join_timeout: float = 600.0,
    ):
        super().__init__(
            manager,
            model,
            optimizer,
            sync_every,
            functools.partial(torch.optim.SGD, lr=1.0),
            quantize=quantize,
            name=name,
            join_timeout=join_timeout,
        )


def _runs_of(params: list[torch.Tensor], fragments: Sequence[nn.Module]) -> list[list[int]]:
    """The indices of `params` that each module of `fragments` holds; every parameter
    must be in exactly one."""
    index = {id(p): i for i, p in enumerate(params)}
    runs: list[list[int]] = []
    owner: dict[int, int] = {}
    for f, module in enumerate(fragments):
        run = []
        for name, p in module.named_parameters():
            i = index.get(id(p))
            if i is None:
                raise ValueError(f"fragment {f}'s parameter {name!r} is not in the model")
            if i in owner:
                raise ValueError(f"parameter {name!r} is in fragments {owner[i]} and {f}")
            owner[i] = f
            run.append(i)
        if not run:
            raise ValueError(f"fragment {f} has no parameters")
        runs.append(run)
    if len(owner) != len(params):
        raise ValueError(
            f"{len(params) - len(owner)} of the model's parameter tensors are in no fragment; "
            "every parameter must sync with one fragment"
        )
    return runs


def _check_settings(
    sync_every: int, fragments: int, overlap_steps: int, quantize: str | None, params: int
) -> None:
    if not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(
            f"sync_every must be a positive number of inner steps between syncs, got "
            f"{sync_every!r}; sync_every=1 syncs after every step"
        )
    if params == 0:
        raise ValueError("the model has no parameters to train")
    if not isinstance(fragments, int) or not 1 <= fragments <= params:
        raise ValueError(
            f"fragments must be between 1 and the model's {params} parameter tensors, got "
            f"{fragments!r}"
        )
    if sync_every % fragments:
        raise ValueError(
            f"sync_every ({sync_every}) must be a multiple of fragments ({fragments}), so that "
            f"each fragment syncs every sync_every steps, one every sync_every/fragments; "
            f"use sync_every={sync_every + fragments - sync_every % fragments}"
        )
    slot = sync_every // fragments
    if not isinstance(overlap_steps, int) or not 0 <= overlap_steps <= slot:
        raise ValueError(
            f"overlap_steps must be between 0 and sync_every/fragments ({slot}), got "
            f"{overlap_steps!r}: a fragment's sync must end before the next one starts"
        )
    if quantize not in QUANTIZERS:
        raise ValueError(f"quantize must be one of {QUANTIZERS}, got {quantize!r}")
