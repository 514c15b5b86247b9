"""`phalanx.Manager`: every training step is a transaction over the replica groups
alive now.

    start_quorum()      ask who takes part in this step (in the background, while the
                        forward pass runs)
    allreduce(tensor)   average a tensor over the participants; a group that heals
                        this step contributes zeros
    should_commit()     every rank of every group votes; the step commits only if
                        every rank of this group said yes (I2)

A group behind the others heals first: it streams the state of `max_step` from all
up-to-date peers at once, straight into its own tensors, before it may vote (I4).
Nothing here raises into the training loop because a peer died: a failed collective,
a lost peer or a failed heal only make this step's vote "no". A group commits only
while the lighthouse still counts it in the step's quorum (its lease, checked by the
manager server), so a group that was paused past the heartbeat timeout votes no when
it wakes. Which state a rank holds, and when it is torn: `phalanx.identity`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from phalanx import _core, transaction, watchdog
from phalanx.healing import in_backward, load_staged
from phalanx.process_group import CollectiveFailed
from phalanx.reachability import LighthouseUnreachableError
from phalanx.settings import ManagerSettings, Timeouts, host_port
from phalanx.step import Handle, Step, StepRecord

__all__ = ["Handle", "LighthouseUnreachableError", "Manager", "StepRecord", "Timeouts", "host_port"]


class Manager:
    """The step transaction of one rank of a replica group.

    Settings come from the arguments, else from the environment (`PHALANX_*`, `RANK`,
    `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`; see `ManagerSettings.from_env`, or
    pass `settings=` made by it), else from their defaults: `timeout`, the budget every
    deadline of a step follows from (`Timeouts`), 30 s; `heartbeat_interval` and
    `init_sync` as the manager server's (`_core.MANAGER_DEFAULTS`). Rank 0 serves the
    group's manager server and rendezvous store at MASTER_ADDR:MASTER_PORT
    (PHALANX_STORE_PORT instead where set, as `phalanx run` does, leaving MASTER_PORT to
    the program's own `init_process_group()`; under torchrun, whose own store is at
    MASTER_PORT: on a free port, met through torchrun's store),
    behind the job token. `device` (default: the rank's GPU, `cuda:LOCAL_RANK`, where
    CUDA is available, else cpu) is where the collectives' tensors live: NCCL for CUDA,
    gloo for CPU.

    `snapshot_dir` (a directory or an fsspec URL) and `snapshot_every` (committed steps,
    e.g. 500, or a duration, e.g. "10m") turn on durable snapshots, the newest
    `snapshot_keep` (default 2) kept: a job whose every group was lost resumes from the
    newest (see `phalanx.snapshots`).

    `job` (or PHALANX_JOB) names the job on a lighthouse that serves many, each with
    its own quorums, rules and token (`phalanx token --job`); `job_rules` (or
    PHALANX_JOB_RULES), e.g. "min_replicas=2,join_timeout_ms=500", the quorum rules
    its groups declare (see `_core.ManagerServer`). Without them: the lighthouse's one
    default job, as its flags set it.

    >>> import phalanx
    >>> with phalanx.LighthouseServer(join_timeout=0.01) as lighthouse, Manager(
    ...     replica_id="a", lighthouse=lighthouse.address
    ... ) as manager:
    ...     manager.start_quorum()
    ...     manager.allreduce(torch.ones(2)).wait(), manager.should_commit()
    (True, True)
    """

    def __init__(
        self,
        *,
        replica_id: str | None = None,
        lighthouse: str | None = None,
        timeout: float | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        store_addr: str | None = None,
        store_port: int | None = None,
        token: str | None = None,
        advertise_host: str | None = None,
        device: torch.device | str | None = None,
        init_sync: bool | None = None,
        heartbeat_interval: float | None = None,
        quorum_timeout: float | None = None,
        collective_timeout: float | None = None,
        commit_timeout: float | None = None,
        heal_timeout: float | None = None,
        lighthouse_timeout: float | None = None,
        stall_timeout: float | None = None,
        snapshot_dir: str | None = None,
        snapshot_every: int | str | None = None,
        snapshot_keep: int | None = None,
        job: str | None = None,
        job_rules: str | None = None,
        settings: ManagerSettings | None = None,
    ):
        if settings is None:
            # Arguments left None take the settings' defaults (the core's, for those
            # the manager server applies too; see ManagerSettings.from_env).
            given = {k: v for k, v in locals().items() if k not in ("self", "settings")}
            settings = ManagerSettings.from_env(**given)
        self.settings = settings
        self.replica_id = settings.replica_id
        self.group_rank = settings.group_rank
        self.group_world_size = settings.group_world_size
        self._rank = transaction.Rank.open(settings)
        watchdog.hosts(self)
        # An attribute of its own so that tests can wrap it (to stop a rank at its vote).
        self._client = self._rank.services.client
        self._pre_commit: list[Callable[[], None]] = []
        #: A forward of a watched module built a graph since the last vote (I13).
        self._forward_ran = False
        #: The step in flight, or the last one once `should_commit()` returned.
        self._step: Step | None = None
        self._closed = False

    def register_state(
        self, name: str, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]
    ) -> None:
        """Registers state that a healing peer receives from this rank, e.g.
        `manager.register_state("model", model.state_dict, model.load_state_dict)`."""
        self._rank.registry.register(name, state_dict, load_state_dict)

    def resume_at(self, step: int) -> None:
        """Takes `step` as this rank's committed step, for a state the training loop
        loaded from a checkpoint of that step; call it before the first quorum. A live
        group that holds the step as committed in a quorum, or a later one, holds the
        job's state, and this group heals from it."""
        if self._step is not None:
            raise RuntimeError(
                "resume_at() after the first start_quorum(): load the checkpoint before "
                "the training loop starts"
            )
        self._rank.held.resumed(step)

    def watch_forward(self, module: torch.nn.Module) -> None:
        """Tells the manager when `module`'s forward builds an autograd graph, so that a
        state this group heals after it, while the graph may hold the registered
        tensors, is loaded only at the vote, after the step's last backward (I13).
        phalanx's DDP watches the module it wraps (HSDP takes the quorum after the
        backward); a loop of its own that calls `wait_quorum()` after its forward
        watches its model here."""

        def began(*_: object) -> None:
            if torch.is_grad_enabled():
                self._forward_ran = True

        module.register_forward_pre_hook(began)

    def register_pre_commit(self, fn: Callable[[], None]) -> None:
        """Runs `fn` at the start of every `should_commit()`, e.g. to start the
        all-reduces a wrapper still owes the step."""
        self._pre_commit.append(fn)

    # -- the transaction ------------------------------------------------------------

    def start_quorum(self, shrink_only: bool = False) -> None:
        """Starts this step's quorum in the background; call it before the forward pass."""
        if self._step is not None:
            self._step.finish_collectives()
        self._step = transaction.begin(self._rank, shrink_only, self._step)

    def allreduce(
        self,
        tensor: torch.Tensor,
        then: Callable[[torch.Tensor], None] | None = None,
        *,
        average: bool = True,
    ) -> Handle:
        """Starts averaging `tensor` in place over the participants; `then(tensor)`
        runs once the average is in. Never raises for a peer's failure.

        Pass a tensor that belongs to this step alone (a fresh bucket, or a copy):
        gloo cannot cancel a collective in flight, so after a failed step an
        abandoned all-reduce may still write into `tensor` later. `then` never runs
        for a failed step.

        `average=False` leaves the sum instead, for integer codes that cannot be
        divided in place (phalanx.quantize)."""
        self.settings.check_device(tensor.device)
        step, quorum = self._current(), self._resolve()
        if quorum is not None and step.abort.is_set():
            self._fail(step.abort.reason or "aborted")
        if quorum is None or step.abort.is_set():
            return Handle(step, None, tensor, 1, then, self._fail)
        if quorum.heal:
            # A healer's contribution is zeros; one whose heal failed still joins the
            # collective (and votes no), so that its peers are not left waiting for it.
            tensor.zero_()
        try:
            pending = self._rank.services.process_group.allreduce(tensor, step.abort)
        except CollectiveFailed as e:
            step.peers_unreached = True
            self._fail(step.explain(e))
            return Handle(step, None, tensor, 1, then, self._fail)
        doing = f"an all-reduce of step {step.number} (quorum {quorum.quorum_id})"
        progress, timeout = self._rank.progress, self.settings.timeouts.collective
        progress.mark(f"launched {doing}")
        divisor = quorum.contributors if average else 1
        waiting = lambda: progress.waiting(doing, timeout)  # noqa: E731
        return Handle(step, pending, tensor, divisor, then, self._fail, waiting)

    def should_commit(self) -> bool:
        """Votes this rank's "yes" (or "no" when the step failed) and returns the
        group's decision. On True the caller applies the step (optimizer.step())."""
        for fn in self._pre_commit:
            fn()
        step = self._current()
        step.finish_collectives()
        quorum = self._resolve()
        # The step's last backward is done: a state staged by a heal during it loads now.
        load_staged(step, self._rank.registry, self._rank.held)
        self._forward_ran = False
        transaction.stop_serving(self._rank)
        started = time.monotonic()
        decision = transaction.vote(self._rank, self._client, step, quorum)
        return transaction.conclude(self._rank, step, decision, time.monotonic() - started)

    # -- what a training loop may ask -----------------------------------------------

    def wait_quorum(self, device: torch.device | None = None) -> bool:
        """Waits for this step's quorum (healing first if this group is behind) and
        tells whether the step can still commit. The collectives do this themselves;
        call it to learn `replica_rank()` before the forward pass, e.g. to pick data.
        A `device` given must be the Manager's (its backend is chosen by `device=`)."""
        if device is not None:
            self.settings.check_device(torch.device(device))
        return self._resolve() is not None and self.step_ok

    def replica_rank(self) -> int:
        """This group's rank among the step's groups (call `wait_quorum()` first)."""
        return self._require_quorum().replica_rank

    def replica_world_size(self) -> int:
        """Groups in this step's quorum, healing ones included."""
        return self._require_quorum().replica_world_size

    def current_step(self) -> int:
        """Committed steps so far (after a heal: the peers' step)."""
        return self._rank.held.step

    def num_participants(self) -> int:
        """Groups whose contribution counts this step (healing groups add zeros)."""
        q = self._quorum
        return 0 if q is None else q.contributors

    def is_participating(self) -> bool:
        """Whether this group's contribution counts this step (it is not healing)."""
        q = self._quorum
        return q is not None and not q.heal

    def report_error(self, reason: str) -> None:
        """Marks this step failed (its vote will be "no"), e.g. after a collective of
        the caller's own failed."""
        self._fail(reason)

    def group_process_group(self) -> dist.ProcessGroup:
        """A plain process group of this replica group's own W ranks (over the group's
        store), for what stays inside the group. A rank's death ends the group anyway."""
        return self._rank.services.group_process_group()

    def group_store(self, prefix: str) -> dist.Store:
        """This replica group's own rendezvous store (hosted by group rank 0), with
        every key under `prefix`: for the process groups a strategy builds among the
        group's W ranks, e.g. torch.distributed's default group for FSDP2."""
        return dist.PrefixStore(prefix, self._rank.services.store)

    @property
    def timeouts(self) -> Timeouts:
        """The deadlines of a step's phases; one set here holds from the next phase on."""
        return self.settings.timeouts

    @timeouts.setter
    def timeouts(self, timeouts: Timeouts) -> None:
        timeouts.validate()
        self.settings = self._rank.settings = replace(self.settings, timeouts=timeouts)

    @property
    def last_step(self) -> StepRecord:
        """The step in flight, or the last one once `should_commit()` returned."""
        return StepRecord(step=0) if self._step is None else self._step.record

    @property
    def step_ok(self) -> bool:
        """Whether this step can still commit."""
        return self._step is None or self._step.ok

    @property
    def failure(self) -> str | None:
        """Why this step will not commit, if it will not."""
        return None if self._step is None else self._step.failure

    @property
    def manager_address(self) -> str:
        """host:port of the group's manager server and rendezvous store (its rank 0's)."""
        return self._rank.services.store.address

    @property
    def state_address(self) -> str:
        """host:port of this rank's state server, which healing peers fetch from."""
        return self._rank.services.host.address

    @property
    def quorum_id(self) -> int | None:
        q = self._quorum
        return None if q is None else q.quorum_id

    @property
    def state_quorum_id(self) -> int:
        """The quorum that committed this rank's current step (0 before the first
        commit): with `current_step()`, which state this rank holds."""
        return self._rank.held.state_quorum_id

    @property
    def lineage(self) -> int:
        """The lineage of this rank's state (0: the job's first; a new one each time
        the job had to go back to an older state, see `phalanx.identity`)."""
        return self._rank.held.lineage

    @property
    def torn(self) -> bool:
        """Whether a heal failed part way, leaving the state unusable until the next
        heal succeeds."""
        return self._rank.held.torn

    def shutdown(self, *, snapshot: bool = True) -> None:
        """Stops this rank's servers and threads (and waits for them); idempotent.

        With snapshots on, a snapshot the group decided on at the last commit is taken
        first, of the state as the training loop left it (after `optimizer.step()`),
        and a write in flight is waited for (up to the heal timeout). `snapshot=False`
        skips the new one: leaving a `with Manager(...)` block on an exception does, as
        the step may not have been applied."""
        if self._closed:
            return
        self._closed = True
        watchdog.left(self)
        if self._step is not None:
            self._step.abort.set()
        self._rank.close(snapshot)

    def __enter__(self) -> Manager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.shutdown(snapshot=exc_type is None)

    @property
    def _quorum(self) -> _core.QuorumResult | None:
        return None if self._step is None else self._step.known_quorum

    def _current(self) -> Step:
        if self._step is None:
            raise RuntimeError("call start_quorum() before allreduce() or should_commit()")
        return self._step

    def _require_quorum(self) -> _core.QuorumResult:
        if self._step is None or (quorum := self._step.quorum) is None:  # once taken
            raise RuntimeError("no quorum yet this step; call wait_quorum() after start_quorum()")
        return quorum

    def _resolve(self) -> _core.QuorumResult | None:
        """The step's quorum (taken once), if this rank joins its collectives."""
        step = self._current()
        transaction.take_quorum(self._rank, step, stage=self._graph_may_hold_state())
        return step.quorum if step.joins_collectives else None

    def _graph_may_hold_state(self) -> bool:
        """Whether an autograd graph may hold the registered tensors now: autograd is
        running a backward (a gradient hook's all-reduce), or a watched module's
        forward built a graph since the last vote."""
        return self._forward_ran or in_backward()

    def _fail(self, reason: str) -> None:
        if self._step is not None:
            self._rank.fail(self._step, reason)
