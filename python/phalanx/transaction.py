"""The phases of one rank's step transaction, over what outlives a step (`Rank`) and
the step in flight (`phalanx.step.Step`); `phalanx.Manager` calls them in order:

    begin       ask for the quorum in the background
    take_quorum once, on the training thread: rebuild the process group if the quorum
                changed, then heal, or open this rank's state to healers
    vote        this rank's yes or no; the group's decision
    conclude    apply the group's decision to the held state

With snapshots on (`phalanx.snapshots`), `begin` also takes the snapshot the group
decided on at its last vote, and before the first quorum picks the snapshot to resume
from; `join` loads it when the quorum says this group holds the job's newest state.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from phalanx import _core, watchdog
from phalanx.healing import Received, StateRegistry, blank_like, heal_step, tear
from phalanx.identity import HeldState
from phalanx.manifest import IncompatibleStateError
from phalanx.membership import LossBook, MembershipWatcher
from phalanx.peers import LEFT_OUT, PeerReach, store_answers
from phalanx.process_group import CollectiveFailed, Membership
from phalanx.progress import Progress
from phalanx.reachability import Reachability
from phalanx.services import RankServices
from phalanx.settings import ManagerSettings
from phalanx.snapshots import Manifest, RankSnapshots
from phalanx.step import Decision, Step, cast_vote

log = logging.getLogger("phalanx.manager")


@dataclass
class Rank:
    """What a rank keeps from step to step."""

    settings: ManagerSettings
    services: RankServices
    losses: LossBook
    #: What the training thread does; the group's heartbeat carries it.
    progress: Progress
    registry: StateRegistry = field(default_factory=StateRegistry)
    held: HeldState = field(default_factory=HeldState)
    #: This rank's state is open to healing peers until the step's vote.
    serving: bool = False
    #: Tensor bytes fetched in heals so far, for the lighthouse's metrics.
    healed_bytes: int = 0
    #: Durable snapshots, if they are on.
    snapshots: RankSnapshots | None = None
    #: The snapshot this rank resumes from once a quorum says it holds the newest state.
    resuming: Manifest | None = None

    def __post_init__(self) -> None:
        self.reach = Reachability(self.settings.replica_id)
        token = self.settings.token
        self.peers = PeerReach(lambda address: store_answers(address, token))
        self.watcher: MembershipWatcher | None = None

    @classmethod
    def open(cls, settings: ManagerSettings) -> Rank:
        """Opens the rank's servers and connections and starts its membership watcher."""
        services = RankServices.open(settings)
        progress = Progress(
            services.client.report_progress,
            group_rank=settings.group_rank,
            stall_timeout=settings.timeouts.stall,
            interval=settings.heartbeat_interval,
        )
        watchdog.install_chaos(progress)
        rank = cls(settings, services, LossBook(), progress)
        if settings.snapshots is not None:
            rank.snapshots = RankSnapshots(
                settings.snapshots,
                replica_id=settings.replica_id,
                group_rank=settings.group_rank,
                world_size=settings.group_world_size,
                store=lambda: dist.PrefixStore("phalanx/snapshot", services.store),
                token=settings.token,
                state=rank.registry.state,
            )
        watchdog.arm(services.client, settings.replica_id)
        rank.watcher = MembershipWatcher(services.client, rank.losses, rank.heard_loss)
        progress.start()
        return rank

    def heard_loss(self, event: _core.MembershipLost) -> None:
        """The lighthouse evicted this very group as stalled: evidence, then exit."""
        s = self.settings
        if event.cause == "progress_stalled" and s.replica_id in event.lost:
            relays = s.group_rank == 0 and s.group_world_size > 1
            watchdog.evicted(self.progress, s.replica_id, event.quorum_id, relays=relays)
            # Still here: this process hosts other groups' ranks too, and lives on.
            self.services.client.disarm_eviction_exit()

    def close(self, snapshot: bool = True) -> None:
        """Stops the servers and threads and waits for the watcher to end; takes the
        snapshot the group decided on (`snapshot`), and waits for a snapshot being
        written, up to the heal timeout."""
        if self.snapshots is not None:
            if snapshot:
                snapshot_or_resume(self, first=False)
            self.snapshots.close(self.settings.timeouts.heal)
        self.progress.stop()
        self.peers.close()
        self.services.shutdown()
        if self.watcher is not None:
            self.watcher.stop()

    def fail(self, step: Step, reason: str) -> None:
        if step.fail(reason):
            log.warning("step %d failed: %s", self.held.step, reason)


def begin(rank: Rank, shrink_only: bool, previous: Step | None) -> Step:
    """A new step, its quorum asked for in the background."""
    held, host = rank.held, rank.services.host
    held.new_step()
    rank.progress.bind()
    rank.progress.step_began(held.step)
    snapshot_s = snapshot_or_resume(rank, first=previous is None)
    request = _core.QuorumRequest(
        group_rank=rank.settings.group_rank,
        step=held.step,
        timeout=rank.settings.timeouts.quorum,
        state_address=host.address,
        shrink_only=shrink_only,
        state_quorum_id=held.state_quorum_id,
        torn=held.torn,
        state_refused=host.refused_requests,
        healed_bytes=rank.healed_bytes,
        lineage=held.lineage,
        unreachable=rank.peers.unreachable(),
        resumed=held.from_storage,
    )
    asked = rank.services.client.start_quorum(request)
    step = Step(held.step, asked, None if previous is None else previous.known_quorum)
    step.record.snapshot_s = snapshot_s
    rank.losses.follow(step)
    return step


def snapshot_or_resume(rank: Rank, first: bool) -> float:
    """Takes the snapshot the group decided on (the state the last step committed, as
    the optimizer left it) and returns the seconds it held the step; before the first
    quorum of a rank that holds no state, picks the snapshot to resume from, whose
    identity the quorum request carries."""
    snapshots, held = rank.snapshots, rank.held
    if snapshots is None:
        return 0.0
    if first and held.step == 0 and held.state_quorum_id == 0:
        rank.resuming = manifest = snapshots.resume()
        if manifest is not None:
            held.restored(manifest.step, manifest.state_quorum_id, manifest.lineage)
            log.info(
                "replica group %r holds snapshot %s: step %d, lineage %d (loaded if no live "
                "group holds a newer state)",
                rank.settings.replica_id,
                manifest.name,
                manifest.step,
                manifest.lineage,
            )
        return 0.0
    if not snapshots.due:
        return 0.0
    doing = f"copying the snapshot of step {held.step}"
    with rank.progress.waiting(doing, rank.settings.timeouts.heal):
        return snapshots.take(rank.registry.state(), held.step, held.state_quorum_id, held.lineage)


def take_quorum(rank: Rank, step: Step, stage: bool) -> None:
    """Waits for the step's quorum, then joins it: failures mark the step failed; a
    refusal that asking again cannot cure raises. `stage`: an autograd graph may hold
    the registered tensors, so a state received now is loaded at the vote (I13)."""
    if step.resolved:
        return
    step.resolved = True
    started = time.monotonic()
    try:
        timeout = rank.settings.timeouts.quorum
        with rank.progress.waiting(f"the quorum of step {step.number}", timeout):
            quorum = step.quorum_future.result()
    except ValueError as e:
        # Refused as asked (another live group has this replica id, a setting out
        # of range): asking again cannot help, so the training loop hears of it.
        raise ValueError(f"replica group {rank.settings.replica_id!r} cannot join: {e}") from e
    except Exception as e:  # the quorum call's own deadline bounds this wait
        rank.reach.failed(e, rank.settings.timeouts)
        if LEFT_OUT in str(e):
            rank.peers.left_out()
        return rank.fail(step, f"no quorum: {e}")
    finally:
        step.record.quorum_s = time.monotonic() - started
    rank.reach.reached()
    step.quorum, step.record.quorum_id = quorum, quorum.quorum_id
    if not rank.losses.admit(step, quorum.quorum_id):
        # A member died after this quorum was issued; the lighthouse told us first.
        return rank.fail(step, f"quorum {quorum.quorum_id} lost a member before the step began")
    step.record.lineage = quorum.lineage
    if quorum.rolled_back_from is not None:
        announce_rollback(rank, quorum)
    join(rank, step, quorum, stage)


def announce_rollback(rank: Rank, quorum: _core.QuorumResult) -> None:
    """The job goes back: no group holding its newest state could come back; or it goes
    on from a state read from storage, which steps may have followed."""
    lost = quorum.rolled_back_from
    assert lost is not None
    step = quorum.max_step
    if (lost.step, lost.state_quorum_id) == (step, quorum.max_state_quorum_id):
        # What is given up is the very state read from storage: no newer one is known.
        log.warning(
            "RESUMED: replica group %r goes on from step %d, a state read from storage, "
            "as lineage %d (quorum %d); steps the job committed after it before every "
            "group was lost, if any, are redone as new states",
            rank.settings.replica_id,
            step,
            quorum.lineage,
            quorum.quorum_id,
        )
        return
    log.error(
        "ROLLBACK: replica group %r goes on from step %d as lineage %d (quorum %d); the "
        "job's newest state, step %d of lineage %d, is held by no group that can come "
        "back: %d committed step(s) lost",
        rank.settings.replica_id,
        step,
        quorum.lineage,
        quorum.quorum_id,
        lost.step,
        lost.lineage,
        max(0, lost.step - step),
    )


def join(rank: Rank, step: Step, quorum: _core.QuorumResult, stage: bool) -> None:
    """Builds the quorum's process group, then heals or serves the healers (`stage`:
    as `take_quorum`)."""
    q = quorum
    try:
        membership = Membership(
            q.store_address, q.store_prefix, q.replica_rank, q.replica_world_size
        )
        # Building the group meets every peer in the rendezvous store: a wait on the
        # other groups, never this rank's own stall, and a bounded one (the nemesis
        # saw builds past their deadline evicted as stalled).
        pg = rank.services.process_group
        with rank.progress.waiting(f"the process group of quorum {q.quorum_id}", pg.build_timeout):
            pg.configure(membership, rank.settings.backend, step.abort)
    except (RuntimeError, ValueError, TimeoutError, CollectiveFailed, dist.DistError) as e:
        step.peers_unreached = True
        return rank.fail(step, f"cannot build the process group of quorum {quorum.quorum_id}: {e}")
    if rank.resuming is not None:
        manifest, rank.resuming = rank.resuming, None
        if quorum.heal:
            log.info("snapshot %s not loaded: a live group holds a newer state", manifest.name)
        elif (failure := resume(rank, step, manifest, stage)) is not None:
            return rank.fail(step, failure)
    if quorum.heal:
        s = rank.settings
        failure = heal_step(
            step,
            quorum,
            rank.registry,
            rank.held,
            rank.progress,
            token=s.token,
            timeout=s.timeouts.heal,
            stage=stage,
        )
        rank.healed_bytes += step.record.heal_bytes
        if failure is not None:
            rank.fail(step, failure)
        return
    # This group's state is the job's: a new lineage's start takes its number.
    rank.held.goes_on_as(quorum.lineage)
    if quorum.serves_healers:
        rank.services.host.open(rank.held.step, quorum.quorum_id, rank.registry.state())
        rank.serving = True
        rank.progress.mark(f"serving the state of step {rank.held.step} to healing peers")


def resume(rank: Rank, step: Step, manifest: Manifest, stage: bool) -> str | None:
    """Loads the snapshot this rank reported holding (`stage`: reads it into buffers
    of its own, loaded at the vote, as `heal_step`); returns why it failed, or None.
    A load that failed part way leaves the state torn (the group heals again)."""
    assert rank.snapshots is not None
    started = time.monotonic()
    held, timeout = rank.held, rank.settings.timeouts.heal
    held.begin_heal()
    try:
        # Reading storage is no wait on the other groups, but it may be long.
        with rank.progress.waiting(f"loading snapshot {manifest.name}", timeout):
            mine = rank.registry.state()
            state = rank.snapshots.load(manifest, blank_like(mine) if stage else mine)
        received = Received(state, manifest.step, identity=None)
        if stage:
            step.staged = received
        else:
            received.load(step, rank.registry, held)
    except IncompatibleStateError:
        raise  # built unlike the group that wrote it: no retry can help
    except Exception as e:
        tear(held)
        return f"cannot load snapshot {manifest.name} of {rank.snapshots.storage.location}: {e}"
    step.record.resume_s = time.monotonic() - started
    log.info(
        "resumed from snapshot %s: step %d in %.3f s%s",
        manifest.name,
        manifest.step,
        step.record.resume_s,
        " (loaded after the backward)" if stage else "",
    )
    return None


def stop_serving(rank: Rank) -> None:
    """Every healing peer fetched before it joined the collectives that just
    completed, so the state may change again from here on."""
    if rank.serving:
        timeout = rank.settings.timeouts.heal
        with rank.progress.waiting("healing peers finishing their fetches", timeout):
            rank.services.host.close(timeout)
        rank.serving = False


def vote(
    rank: Rank, client: _core.ManagerClient, step: Step, quorum: _core.QuorumResult | None
) -> Decision:
    """Votes yes if the step can commit (`quorum`: the one this rank joined, if it
    did), rank 0 asking for a snapshot when one is due; returns the group's decision.
    A vote that cannot be cast is a no."""
    held = rank.held
    commit_timeout = rank.settings.timeouts.commit
    yes = quorum is not None and step.ok
    snapshot = (
        yes
        and rank.snapshots is not None
        and rank.snapshots.ask(held.step + 1, lambda: [m.replica_id for m in quorum.participants])
    )
    try:
        with rank.progress.waiting(f"the commit vote of step {held.step}", commit_timeout):
            return cast_vote(
                client,
                rank.settings.group_rank,
                held.step,
                yes,
                quorum_id=quorum.quorum_id if quorum is not None else 0,
                torn=held.torn,
                timeout=commit_timeout,
                snapshot=snapshot,
            )
    except (TimeoutError, ConnectionError, ValueError) as e:
        log.warning("commit vote of step %d failed: %s", held.step, e)
        # Whether the other ranks' heals succeeded is unknown.
        return Decision(commit=False, torn=held.healing)


def conclude(rank: Rank, step: Step, decision: Decision, took: float) -> bool:
    """Applies the group's decision to the held state and the step's record; returns
    whether the step commits."""
    commit, torn = decision.commit, decision.torn
    record, quorum = step.record, step.quorum
    record.commit_s = took
    # Only a heal can tear a state: a group that did not heal this step keeps it.
    if torn and (rank.held.healing or rank.held.torn):
        tear(rank.held)
    record.committed = commit
    record.failure = (step.failure or "a rank voted no") if not commit else None
    record.participants = 0 if quorum is None else quorum.contributors
    if rank.snapshots is not None:
        rank.snapshots.committed(commit, decision.snapshot)
    if commit:
        assert quorum is not None
        rank.held.committed(quorum.quorum_id, quorum.lineage)
    else:
        log.info("step %d not committed: %s", rank.held.step, record.failure)
        rank.services.process_group.reset()
        if quorum is not None and step.peers_unreached and not step.abort.is_set():
            # No group was named dead, yet the others could not be met: a cut?
            me = rank.settings.replica_id
            peers = {m.replica_id: m.store_address for m in quorum.participants}
            peers.pop(me, None)
            rank.peers.step_failed(peers)
            if unreached := rank.peers.unreachable():
                log.warning("cannot reach replica group(s) %s: telling the lighthouse", unreached)
    return commit
