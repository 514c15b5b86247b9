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
a lost peer or a failed heal only make this step's vote "no".

A state is named by its step *and* the quorum that committed that step: a group that
committed a step in a quorum its peers went on without holds another state under the
same number, and heals. A group commits only while the lighthouse still counts it in
the step's quorum (its lease, checked by the manager server), so a group that was
paused past the heartbeat timeout votes no when it wakes. A heal that fails part way
leaves the state torn: the group heals again before it trains, and its ranks agree on
that through their vote.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from phalanx import _core, watchdog
from phalanx.process_group import (
    Abort,
    CollectiveFailed,
    FaultTolerantProcessGroup,
    Membership,
    Pending,
    backend_for,
    gloo_group,
)
from phalanx.progress import Progress
from phalanx.store import Store
from phalanx.token import resolve_token

log = logging.getLogger("phalanx.manager")

#: How long a collective that failed on its own (a peer's connection broke) waits for
#: the lighthouse to say which group died, for the failure message: a crash is known
#: to the survivors in tens of milliseconds.
EXPLAIN_WAIT_S = 0.25

#: The least time a vote cast again gets: enough to fetch a decision already taken.
MIN_REVOTE_S = 0.5


def host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets.

    >>> host_port("10.0.0.1", 29500), host_port("::1", 0), host_port("[::1]", 0)
    ('10.0.0.1:29500', '[::1]:0', '[::1]:0')
    """
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


@dataclass(frozen=True)
class Timeouts:
    """Deadlines of one step's phases, derived from a single budget.

    A group can sit in a collective or a commit vote for up to their deadlines before
    it asks for the next quorum, so the quorum deadline must cover them; anything else
    would make groups give up on each other while both are alive.

    `lighthouse` is how long a rank goes on asking without reaching any lighthouse
    before it gives up (LighthouseUnreachableError): long enough for a lighthouse to
    be restarted, short enough that a job that lost it for good ends.

    `stall` is how long a member of the quorum may make no progress while its peers
    wait on it before the lighthouse evicts it (see `phalanx.progress`). It must be
    shorter than the collective timeout: a hung group outlasting its peers' collective
    is left out of their next quorum and never evicted.

    >>> Timeouts.from_budget(30.0)
    Timeouts(quorum=30.0, collective=15.0, commit=15.0, heal=30.0, lighthouse=300.0, stall=10.0)
    >>> Timeouts.from_budget(30.0, collective=60.0)
    Traceback (most recent call last):
    ...
    ValueError: the quorum timeout (30.0 s) is shorter than the collective timeout (60.0 s); ...
    """

    quorum: float
    collective: float
    commit: float
    heal: float
    lighthouse: float = 300.0
    stall: float = 10.0

    @classmethod
    def from_budget(
        cls,
        timeout: float,
        *,
        quorum: float | None = None,
        collective: float | None = None,
        commit: float | None = None,
        heal: float | None = None,
        lighthouse: float | None = None,
        stall: float | None = None,
    ) -> Timeouts:
        collective = collective if collective is not None else timeout / 2
        timeouts = cls(
            quorum=quorum if quorum is not None else timeout,
            collective=collective,
            commit=commit if commit is not None else timeout / 2,
            heal=heal if heal is not None else timeout,
            lighthouse=lighthouse if lighthouse is not None else max(300.0, 10 * timeout),
            stall=stall if stall is not None else min(timeout / 3, collective * 2 / 3),
        )
        timeouts.validate()
        return timeouts

    def validate(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"the {name} timeout must be a positive number of seconds")
        if self.lighthouse < self.quorum:
            raise ValueError(
                f"the lighthouse timeout ({self.lighthouse} s) is shorter than the quorum "
                f"timeout ({self.quorum} s): a rank would give up on its lighthouse before "
                "one quorum request could have run out. Raise the lighthouse timeout"
            )
        if self.stall >= self.collective:
            raise ValueError(
                f"the stall timeout ({self.stall} s) is not shorter than the collective "
                f"timeout ({self.collective} s): a hung group would be left out of its "
                "peers' next quorum before it could be evicted, and never restarted. Lower "
                "the stall timeout or raise the collective timeout"
            )
        for phase in ("collective", "commit"):
            if self.quorum < getattr(self, phase):
                raise ValueError(
                    f"the quorum timeout ({self.quorum} s) is shorter than the {phase} "
                    f"timeout ({getattr(self, phase)} s); a group still in its {phase} "
                    "would be given up on by its peers. Raise the quorum timeout or lower "
                    f"the {phase} timeout"
                )


class LighthouseUnreachableError(ConnectionError):
    """No lighthouse answered for longer than the lighthouse timeout: the rank gives
    up rather than run steps that can never commit."""


def _env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def _env_seconds(name: str, example: str) -> float | None:
    if (text := _env(name)) is None:
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(
            f"{name}={text!r} is not a number of seconds; set it to e.g. {example}"
        ) from None


@dataclass
class _Registered:
    state_dict: Callable[[], Any]
    load_state_dict: Callable[[Any], None]


@dataclass
class StepRecord:
    """What one step of this rank did, for the step log: its outcome and where the
    training thread waited (seconds)."""

    step: int
    quorum_id: int | None = None
    participants: int = 0
    committed: bool = False
    healed: bool = False
    quorum_s: float = 0.0
    allreduce_s: float = 0.0
    commit_s: float = 0.0
    heal_s: float = 0.0
    failure: str | None = None


class Handle:
    """A started all-reduce. `wait()` finishes it (average, then `then`), or leaves the
    tensor as it is when the step failed; it never raises."""

    def __init__(
        self,
        manager: Manager,
        pending: Pending | None,
        tensor: torch.Tensor,
        divisor: int,
        then: Callable[[torch.Tensor], None] | None,
    ):
        self._manager = manager
        self._pending = pending
        self._tensor = tensor
        self._divisor = divisor
        self._then = then
        self._done = False

    def wait(self) -> bool:
        """True when the tensor now holds the average over the participants."""
        if self._done:
            return self._manager.step_ok
        self._done = True
        if self._pending is None:
            return False
        started = time.monotonic()
        manager = self._manager
        try:
            with manager.progress.waiting(
                f"an all-reduce of step {manager._step} (quorum {manager.quorum_id})",
                manager.timeouts.collective,
            ):
                self._pending.wait()
        except CollectiveFailed as e:
            self._manager._fail(self._manager._explain(e))
            return False
        finally:
            self._manager.last_step.allreduce_s += time.monotonic() - started
        if self._divisor > 1:
            self._tensor.div_(self._divisor)
        if self._then is not None:
            self._then(self._tensor)
        return self._manager.step_ok


class Manager:
    """The step transaction of one rank of a replica group.

    Settings come from the arguments, else from the environment: `PHALANX_REPLICA_ID`,
    `PHALANX_LIGHTHOUSE`, `PHALANX_TOKEN`, `PHALANX_ADVERTISE_HOST`, and the usual
    `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` for the group's own ranks: rank
    0's manager server listens at MASTER_ADDR:MASTER_PORT and serves the group's
    rendezvous store there, behind the job token. Every listener of the rank binds the
    advertised host (`PHALANX_ADVERTISE_HOST`, else MASTER_ADDR), never all interfaces.
    """

    def __init__(
        self,
        *,
        replica_id: str | None = None,
        lighthouse: str | None = None,
        timeout: float = 30.0,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        store_addr: str | None = None,
        store_port: int | None = None,
        token: str | None = None,
        advertise_host: str | None = None,
        init_sync: bool = True,
        heartbeat_interval: float = 0.1,
        quorum_timeout: float | None = None,
        collective_timeout: float | None = None,
        commit_timeout: float | None = None,
        heal_timeout: float | None = None,
        lighthouse_timeout: float | None = None,
        stall_timeout: float | None = None,
    ):
        if lighthouse_timeout is None:
            lighthouse_timeout = _env_seconds("PHALANX_LIGHTHOUSE_TIMEOUT", "300")
        if stall_timeout is None:
            stall_timeout = _env_seconds("PHALANX_STALL_TIMEOUT", "10")
        self.timeouts = Timeouts.from_budget(
            timeout,
            quorum=quorum_timeout,
            collective=collective_timeout,
            commit=commit_timeout,
            heal=heal_timeout,
            lighthouse=lighthouse_timeout,
            stall=stall_timeout,
        )
        #: Since when no quorum request reached a lighthouse (None: the last one did).
        self._unreachable_since: float | None = None
        self.replica_id = replica_id or _env("PHALANX_REPLICA_ID")
        lighthouse = lighthouse or _env("PHALANX_LIGHTHOUSE")
        if not self.replica_id:
            raise ValueError(
                "no replica id: pass replica_id= or set PHALANX_REPLICA_ID (a name unique "
                "among the job's live replica groups)"
            )
        if not lighthouse:
            raise ValueError(
                "no lighthouse: pass lighthouse='host:port' or set PHALANX_LIGHTHOUSE "
                "(start one with 'phalanx lighthouse')"
            )
        self.group_rank = int(group_rank if group_rank is not None else _env("RANK", "0"))
        self.group_world_size = int(
            group_world_size if group_world_size is not None else _env("WORLD_SIZE", "1")
        )
        if not 0 <= self.group_rank < self.group_world_size:
            raise ValueError(
                f"group rank {self.group_rank} is outside a group of {self.group_world_size} "
                "ranks; check RANK and WORLD_SIZE"
            )
        self._token = resolve_token(token, None, os.environ)
        advertise_host = advertise_host or _env("PHALANX_ADVERTISE_HOST")
        store_addr = store_addr or _env("MASTER_ADDR", "127.0.0.1")
        port = store_port if store_port is not None else int(_env("MASTER_PORT", "0") or 0)
        if self.group_world_size > 1 and port == 0:
            raise ValueError(
                "a group of several ranks needs MASTER_PORT (or store_port=) for its store"
            )

        self._registered: dict[str, _Registered] = {}
        self._pre_commit: list[Callable[[], None]] = []
        self._group_pg: dist.ProcessGroup | None = None
        self._step = 0
        #: With `_step`, which state this rank holds: the quorum that committed it.
        self._state_quorum_id = 0
        #: A heal failed part way: the state is unusable until a heal succeeds.
        self._torn = False
        #: The identity before this step's heal, restored if the group's heal failed.
        self._before_heal: tuple[int, int] | None = None
        self._quorum: _core.QuorumResult | None = None
        self._quorum_future: Future[_core.QuorumResult] | None = None
        self._quorum_resolved = False
        self._failure: str | None = None
        self._abort = Abort()
        # The membership watcher and the training thread agree under this lock on
        # which quorum a loss of membership concerns: the step's own, once it is known
        # (`_step_quorum_id`), or any quorum at most `_broken_quorum_id`.
        self._membership_lock = threading.Lock()
        self._step_quorum_id: int | None = None
        self._broken_quorum_id = -1
        self._handles: list[Handle] = []
        self._heal_failed = False
        #: The step in flight, or the last one once `should_commit()` returned.
        self.last_step = StepRecord(step=0)
        self._serving = False
        self._closed = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="phalanx-quorum")

        host = advertise_host or store_addr
        self._server: _core.ManagerServer | None = None
        if self.group_rank == 0:
            # The manager server is the group's rendezvous store too (no TCPStore, which
            # would admit anyone on the network).
            self._server = _core.ManagerServer(
                self.replica_id,
                lighthouse,
                world_size=self.group_world_size,
                bind=host_port(store_addr, port),
                # The other groups reach it at the advertised host.
                also_bind=host if host != store_addr else None,
                advertise_host=host,
                heartbeat_interval=heartbeat_interval,
                init_sync=init_sync,
                token=self._token,
            )
            manager_address = self._server.address
        else:
            manager_address = host_port(store_addr, port)
        self._store = Store(manager_address, token=self._token, timeout=self.timeouts.quorum)
        if self.group_rank != 0:
            self._check_manager(manager_address)
        self._client = _core.ManagerClient(manager_address, token=self._token)
        self._client.subscribe_events()
        #: What the training thread does; the group's heartbeat carries it.
        self.progress = Progress(
            self._client.report_progress,
            group_rank=self.group_rank,
            stall_timeout=self.timeouts.stall,
            interval=heartbeat_interval,
        )
        watchdog.install_chaos(self.progress)
        watchdog.hosts(self)
        self.progress.start()

        from phalanx.recovery import StateHost

        try:
            self._host = StateHost(bind=host_port(host, 0), advertise_host=host, token=self._token)
        except ConnectionError as e:
            if advertise_host:
                raise
            raise ConnectionError(
                f"{e}. This rank listens on MASTER_ADDR ({store_addr}) unless told its own "
                "address: on another host than its group's rank 0, set "
                "PHALANX_ADVERTISE_HOST (advertise_host=) to this host's address"
            ) from e
        self._advertised_host = host
        self._pg = FaultTolerantProcessGroup(self.timeouts.collective, host=host, token=self._token)
        self._watcher = threading.Thread(
            target=self._watch_membership, name="phalanx-membership", daemon=True
        )
        self._watcher.start()

    # -- registration -------------------------------------------------------------

    def register_state(
        self,
        name: str,
        state_dict: Callable[[], Any],
        load_state_dict: Callable[[Any], None],
    ) -> None:
        """Registers state that a healing peer receives from this rank, e.g.
        `manager.register_state("model", model.state_dict, model.load_state_dict)`."""
        if name in self._registered:
            raise ValueError(f"state {name!r} is registered already; pick another name")
        self._registered[name] = _Registered(state_dict, load_state_dict)

    def register_pre_commit(self, fn: Callable[[], None]) -> None:
        """Runs `fn` at the start of every `should_commit()`, e.g. to start the
        all-reduces a wrapper still owes the step."""
        self._pre_commit.append(fn)

    # -- the transaction ------------------------------------------------------------

    def start_quorum(self, shrink_only: bool = False) -> None:
        """Starts this step's quorum in the background; call it before the forward pass."""
        self._wait_handles()
        with self._membership_lock:
            self._step_quorum_id = None
            self._failure = None
            self._abort.clear()
        self._quorum_resolved = False
        self._heal_failed = False
        self._before_heal = None
        step = self._step
        self.progress.bind()
        self.progress.step_began(step)
        self.last_step = StepRecord(step=step)
        self._quorum_future = self._executor.submit(
            self._client.quorum,
            self.group_rank,
            step,
            self.timeouts.quorum,
            self._host.address,
            shrink_only,
            self._state_quorum_id,
            self._torn,
            self._host.refused_requests,
        )

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
        quorum = self._resolve_quorum(tensor.device)
        if quorum is not None and self._abort.is_set():
            self._fail(self._abort.reason or "aborted")
        if quorum is None or self._abort.is_set():
            return self._remember(Handle(self, None, tensor, 1, then))
        if quorum.heal:
            # A healer's contribution is zeros; one whose heal failed still joins the
            # collective (and votes no), so that its peers are not left waiting for it.
            tensor.zero_()
        try:
            pending = self._pg.allreduce(tensor, self._abort)
        except CollectiveFailed as e:
            self._fail(self._explain(e))
            return self._remember(Handle(self, None, tensor, 1, then))
        self.progress.mark(
            f"launched an all-reduce of step {self._step} (quorum {quorum.quorum_id})"
        )
        divisor = self.num_participants() if average else 1
        return self._remember(Handle(self, pending, tensor, divisor, then))

    def should_commit(self) -> bool:
        """Votes this rank's "yes" (or "no" when the step failed) and returns the
        group's decision. On True the caller applies the step (optimizer.step())."""
        for fn in self._pre_commit:
            fn()
        self._wait_handles()
        quorum = self._resolve_quorum(None)
        if self._serving:
            # Every healing peer fetched before it joined the collectives that just
            # completed, so the state may change again from here on.
            self._host.close(self.timeouts.heal)
            self._serving = False
        vote = quorum is not None and self.step_ok
        record = self.last_step
        started = time.monotonic()
        try:
            commit, torn = self._vote(vote, quorum)
        except (TimeoutError, ConnectionError, ValueError) as e:
            log.warning("commit vote of step %d failed: %s", self._step, e)
            # Whether the other ranks' heals succeeded is unknown.
            commit, torn = False, self._before_heal is not None
        record.commit_s = time.monotonic() - started
        # Only a heal can tear a state: a group that did not heal this step keeps it.
        if torn and (self._before_heal is not None or self._torn):
            self._tear()
        record.committed = commit
        record.failure = (self._failure or "a rank voted no") if not commit else None
        record.participants = self.num_participants()
        if commit:
            assert quorum is not None
            self._step += 1
            self._state_quorum_id = quorum.quorum_id
        else:
            log.info("step %d not committed: %s", self._step, record.failure)
            self._pg.reset()
        return commit

    # -- what a training loop may ask -----------------------------------------------

    def wait_quorum(self, device: torch.device | None = None) -> bool:
        """Waits for this step's quorum (healing first if this group is behind) and
        tells whether the step can still commit. The collectives do this themselves;
        call it to learn `replica_rank()` before the forward pass, e.g. to pick data."""
        return self._resolve_quorum(device) is not None and self.step_ok

    def replica_rank(self) -> int:
        """This group's rank among the step's groups (call `wait_quorum()` first)."""
        return self._require_quorum().replica_rank

    def replica_world_size(self) -> int:
        """Groups in this step's quorum, healing ones included."""
        return self._require_quorum().replica_world_size

    def current_step(self) -> int:
        """Committed steps so far (after a heal: the peers' step)."""
        return self._step

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
        if self._group_pg is None:
            store = dist.PrefixStore("phalanx/group", self._store)
            self._group_pg = gloo_group(
                store,
                self.group_rank,
                self.group_world_size,
                timedelta(seconds=self.timeouts.collective),
                self._advertised_host,
            )
        return self._group_pg

    def group_store(self, prefix: str) -> dist.Store:
        """This replica group's own rendezvous store (hosted by group rank 0), with
        every key under `prefix`: for the process groups a strategy builds among the
        group's W ranks, e.g. torch.distributed's default group for FSDP2."""
        return dist.PrefixStore(prefix, self._store)

    @property
    def step_ok(self) -> bool:
        return self._failure is None

    @property
    def failure(self) -> str | None:
        """Why this step will not commit, if it will not."""
        return self._failure

    @property
    def manager_address(self) -> str:
        """host:port of the group's manager server and rendezvous store (its rank 0's)."""
        return self._store.address

    @property
    def state_address(self) -> str:
        """host:port of this rank's state server, which healing peers fetch from."""
        return self._host.address

    @property
    def quorum_id(self) -> int | None:
        return None if self._quorum is None else self._quorum.quorum_id

    @property
    def state_quorum_id(self) -> int:
        """The quorum that committed this rank's current step (0 before the first
        commit): with `current_step()`, which state this rank holds."""
        return self._state_quorum_id

    @property
    def torn(self) -> bool:
        """Whether a heal failed part way, leaving the state unusable until the next
        heal succeeds."""
        return self._torn

    def shutdown(self) -> None:
        """Stops this rank's servers and threads; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.progress.stop()
        watchdog.left(self)
        self._abort.set()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._host.shutdown()
        if self._server is not None:
            self._server.shutdown()

    def __enter__(self) -> Manager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- internals ------------------------------------------------------------------

    def _check_manager(self, address: str) -> None:
        """Waits (up to the quorum timeout) for the group's rank 0 to serve, and makes
        sure that it serves this group: a rank given another group's MASTER_PORT says
        so instead of joining that group."""
        try:
            owner = self._store.get(_core.STORE_REPLICA_ID_KEY).decode()
        except dist.DistError as e:
            raise TimeoutError(
                f"rank {self.group_rank} of replica group {self.replica_id!r} found no manager "
                f"of its group at {address} within {self.timeouts.quorum:g} s ({e}): start "
                "the group's rank 0, and give each group a MASTER_PORT of its own"
            ) from e
        if owner != self.replica_id:
            raise ValueError(
                f"rank {self.group_rank} of replica group {self.replica_id!r} reached the "
                f"manager of replica group {owner!r} at {address}: give each group a "
                "MASTER_PORT of its own"
            )

    @property
    def _joins_collectives(self) -> bool:
        """Whether this rank takes part in the step's collectives: while the step can
        commit, and (with zeros) after a failed heal, so its peers are not kept waiting."""
        return self.step_ok or self._heal_failed

    def _require_quorum(self) -> _core.QuorumResult:
        if not self._quorum_resolved or self._quorum is None:
            raise RuntimeError(
                "this step has no quorum yet; call wait_quorum() after start_quorum()"
            )
        return self._quorum

    def _fail(self, reason: str) -> None:
        with self._membership_lock:
            if self._failure is not None:
                return
            self._failure = reason
        log.warning("step %d failed: %s", self._step, reason)

    def _note_unreachable(self, error: Exception) -> None:
        """Counts how long no lighthouse was reached; past the lighthouse timeout the
        rank gives up. A request that reached one and timed out waiting for its peers
        is not a lost lighthouse."""
        if not isinstance(error, ConnectionError):
            self._unreachable_since = None
            return
        now = time.monotonic()
        if self._unreachable_since is None:
            self._unreachable_since = now - self.timeouts.quorum
        lost_for = now - self._unreachable_since
        if lost_for > self.timeouts.lighthouse:
            raise LighthouseUnreachableError(
                f"replica group {self.replica_id!r} reached no lighthouse for {lost_for:.0f} s "
                f"(last error: {error}). Start the lighthouse again on its address (the job "
                "resumes from where it was), or fix PHALANX_LIGHTHOUSE / --lighthouse; raise "
                "lighthouse_timeout= (PHALANX_LIGHTHOUSE_TIMEOUT) to wait longer"
            ) from error

    def _vote(self, vote: bool, quorum: _core.QuorumResult | None) -> tuple[bool, bool]:
        """Casts this rank's vote; returns the group's (commit, torn). A vote whose
        answer was lost is cast once more, within what is left of the commit timeout:
        the manager server answers a step it decided with that decision, so this rank
        cannot miss a commit its peers applied."""
        deadline = time.monotonic() + self.timeouts.commit

        def cast(timeout: float) -> tuple[bool, bool]:
            decision = self._client.should_commit(
                self.group_rank,
                self._step,
                vote,
                timeout,
                quorum_id=quorum.quorum_id if quorum is not None else 0,
                torn=self._torn,
            )
            return decision.commit, decision.torn

        with self.progress.waiting(f"the commit vote of step {self._step}", self.timeouts.commit):
            try:
                return cast(self.timeouts.commit)
            except (TimeoutError, ConnectionError) as e:
                log.warning("commit vote of step %d: %s; voting again", self._step, e)
                return cast(max(deadline - time.monotonic(), MIN_REVOTE_S))

    def _explain(self, failure: CollectiveFailed) -> str:
        """Why a collective failed, in phalanx's words. A peer's crash breaks its
        connections a moment before the lighthouse says who died: wait that moment for
        the lighthouse's word, else name the quorum and keep the backend's first line."""
        if not failure.from_backend:
            return str(failure)
        told = threading.Event()
        if self._abort.wake_on_abort(told) or told.wait(EXPLAIN_WAIT_S):
            return self._abort.reason or str(failure)
        detail = str(failure.__cause__ or failure).strip().splitlines()[0][:160]
        return (
            f"the all-reduce of quorum {self.quorum_id} failed: a replica group in it is "
            f"gone or unreachable ({detail})"
        )

    def _tear(self) -> None:
        """The group's heal failed on some rank: every rank treats its state as torn,
        back at the step it held before, so the ranks agree on what they hold."""
        if self._before_heal is not None:
            self._step, self._state_quorum_id = self._before_heal
            self._before_heal = None
        if not self._torn:
            log.warning("the state of step %d is torn; the group heals again", self._step)
        self._torn = True

    def _remember(self, handle: Handle) -> Handle:
        self._handles.append(handle)
        return handle

    def _wait_handles(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.wait()

    def _resolve_quorum(self, device: torch.device | None) -> _core.QuorumResult | None:
        """On the training thread, once per step: takes the quorum, rebuilds the
        process group if it changed, heals or opens this rank's state to healers."""
        if self._quorum_resolved:
            return self._quorum if self._joins_collectives else None
        self._quorum_resolved = True
        if self._quorum_future is None:
            raise RuntimeError("call start_quorum() before allreduce() or should_commit()")
        started = time.monotonic()
        try:
            with self.progress.waiting(f"the quorum of step {self._step}", self.timeouts.quorum):
                quorum = self._quorum_future.result()
        except ValueError as e:
            # Refused as asked (another live group has this replica id, a setting out
            # of range): asking again cannot help, so the training loop hears of it.
            self._quorum = None
            raise ValueError(f"replica group {self.replica_id!r} cannot join: {e}") from e
        except Exception as e:  # the quorum call's own deadline bounds this wait
            self._note_unreachable(e)
            self._fail(f"no quorum: {e}")
            self._quorum = None
            return None
        finally:
            self.last_step.quorum_s = time.monotonic() - started
        self._unreachable_since = None
        self._quorum = quorum
        self.last_step.quorum_id = quorum.quorum_id
        with self._membership_lock:
            self._step_quorum_id = quorum.quorum_id
            lost = quorum.quorum_id <= self._broken_quorum_id
        if lost:
            # A member died after this quorum was issued; the lighthouse told us first.
            self._fail(f"quorum {quorum.quorum_id} lost a member before the step began")
            return None
        try:
            self._pg.configure(
                Membership(
                    quorum.store_address,
                    quorum.store_prefix,
                    quorum.replica_rank,
                    quorum.replica_world_size,
                ),
                backend_for(device or torch.device("cpu")),
            )
        except (RuntimeError, ValueError, dist.DistError) as e:
            self._fail(f"cannot build the process group of quorum {quorum.quorum_id}: {e}")
            return None
        if quorum.heal:
            self._heal(quorum)
        elif quorum.serves_healers:
            self._open_state(quorum)
        return quorum if self._joins_collectives else None

    def _state(self) -> dict[str, Any]:
        return {name: r.state_dict() for name, r in self._registered.items()}

    def _open_state(self, q: _core.QuorumResult) -> None:
        self._host.open(self._step, q.quorum_id, self._state())
        self._serving = True
        self.progress.mark(f"serving the state of step {self._step} to healing peers")

    def _heal(self, q: _core.QuorumResult) -> None:
        from phalanx.recovery import IncompatibleStateError, heal

        sources = [s.state_address for s in q.recovery_sources]
        if not sources:
            self._fail(f"must heal to step {q.max_step} but no up-to-date peer serves it")
            self._heal_failed = True
            return
        started = time.monotonic()
        self._before_heal = (self._step, self._state_quorum_id)
        try:
            # The sources publish their state when they reach this step's collectives;
            # the fetch waits for that, within the heal deadline.
            with self.progress.waiting(
                f"healing to step {q.max_step} from {len(sources)} peer(s)", self.timeouts.heal
            ):
                state = heal(
                    sources,
                    q.max_step,
                    q.quorum_id,
                    self._state(),
                    token=self._token,
                    timeout=self.timeouts.heal,
                )
        except IncompatibleStateError:
            raise  # this group was built unlike its peers: no retry can help
        except (ConnectionError, PermissionError, ValueError, TimeoutError) as e:
            # Tensors are written in place: some may hold the peers' bytes already.
            self._fail(f"heal to step {q.max_step} failed: {e}")
            self._heal_failed = True
            self._tear()
            return
        for name, registered in self._registered.items():
            if name in state:
                try:
                    registered.load_state_dict(state[name])
                except Exception as e:
                    raise IncompatibleStateError(
                        f"the peers' {name!r} at step {q.max_step} does not load into this "
                        f"group's: {e}. Every replica group must build the same model, "
                        "optimizer and registered state"
                    ) from e
        self.last_step.heal_s = time.monotonic() - started
        self.last_step.healed = True
        self.last_step.step = q.max_step
        log.info(
            "healed to step %d from %d peer(s) in %.3f s",
            q.max_step,
            len(sources),
            time.monotonic() - started,
        )
        self._step = q.max_step
        self._state_quorum_id = q.max_state_quorum_id
        self._torn = False

    def _watch_membership(self) -> None:
        while not self._closed:
            try:
                event = self._client.next_event(timeout=0.5)
            except (ConnectionError, TimeoutError):
                time.sleep(0.1)
                continue
            if self._closed:
                return
            if event is None:
                continue
            if event.cause == "progress_stalled" and self.replica_id in event.lost:
                watchdog.evicted(
                    self.progress,
                    self.replica_id,
                    event.quorum_id,
                    relays=self.group_rank == 0 and self.group_world_size > 1,
                )
            with self._membership_lock:
                self._broken_quorum_id = max(self._broken_quorum_id, event.quorum_id)
                concerns_step = event.quorum_id == self._step_quorum_id
            if concerns_step:
                # Fails the collectives still in flight (their result would lack the
                # dead group's part); ones that completed before it stand.
                self._abort.set(f"replica group(s) {', '.join(event.lost)} died ({event.cause})")
