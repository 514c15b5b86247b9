//! What the lighthouse knows: which replica groups are alive, who waits for the next
//! quorum, and the last quorum issued. Soft state only — a restarted lighthouse
//! rebuilds all of it from the groups that reconnect.
//!
//! Every method takes `now`, so the transitions are tested without sockets or sleeps.
//! The server (`service.rs`) holds this behind one mutex and never awaits inside it.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use prost::Message;
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use super::history::{
    stepping, Eviction, History, Lost, LostGroups, Rollback, Rollbacks, StepSamples, LOST_KEPT,
    LOST_KEPT_FOR,
};
use super::newest::NewestState;
use super::pulse::Pulse;
use super::snapshot::{mark_stragglers, ms_since, LostSnapshot, ReplicaSnapshot, Snapshot};
use super::stall::{self, Groups, Stalls, Watched};
use crate::delta::{self, Answer};
use crate::gate::RefusalCounts;
use crate::proto;
use crate::quorum::{
    self, Decision, Identity, Joiner, LiveSet, Quorum, QuorumConfig, QuorumId, ReplicaId,
    WaitReason,
};

/// The answer a waiting quorum request gets: the quorum, encoded once for everyone.
pub type QuorumReply = Result<Answer, Status>;

/// The lighthouse end of a group's heartbeat stream.
struct HeartbeatStream {
    id: u64,
    events: mpsc::Sender<Result<proto::LighthouseEvent, Status>>,
    peer: String,
    /// The group's manager server, as its first beat named it (empty: not named).
    manager_address: String,
    opened_at: Instant,
}

struct Replica {
    pulse: Arc<Pulse>,
    stream: Option<HeartbeatStream>,
    history: History,
    steps: StepSamples,
    /// When it last committed a step, or when it appeared.
    last_commit: Instant,
    /// It was a member of a quorum since it appeared: it takes part in training even
    /// before it reports a step (a group that heals joins at step 0).
    joined: bool,
}

struct PendingJoin {
    ticket: u64,
    reply: oneshot::Sender<QuorumReply>,
    /// The issue of the quorum the group holds whole (0: none; see `Answer`).
    known_issue: u64,
}

/// A quorum just issued, for the server to record in its metrics.
pub struct Issued {
    pub quorum_id: QuorumId,
    pub changed: bool,
    pub waited: Duration,
    /// It started a new lineage, losing this many committed steps.
    pub rolled_back: Option<u64>,
}

pub struct LighthouseState {
    config: QuorumConfig,
    heartbeat_timeout: Duration,
    /// The job's newest committed state and its holders (invariant I11).
    newest: NewestState,
    /// The job's rollbacks.
    rollbacks: Rollbacks,
    replicas: HashMap<ReplicaId, Replica>,
    joiners: BTreeMap<ReplicaId, Joiner>,
    pending: HashMap<ReplicaId, PendingJoin>,
    previous: Option<Quorum>,
    /// When `previous` was issued.
    previous_at: Option<Instant>,
    /// The highest quorum id heard from anyone; heartbeat streams raise it directly.
    heard: Arc<AtomicU64>,
    epoch: Instant,
    quorums_issued: u64,
    /// Where this lighthouse's numbering of the quorums it issues starts (see
    /// `proto::Quorum.issue`): its own, so that a group's issue from another
    /// lighthouse (of a set, or before a restart) is never taken for one of its own.
    issue_base: u64,
    /// The last quorum issued, as it was sent.
    sent: Option<proto::Quorum>,
    next_ticket: u64,
    waiting: (WaitReason, Option<Instant>),
    /// A join that left the wait standing skipped the engine (see `wait_stands`): the
    /// reason's list of missing groups is out of date and is worked out when read.
    waiting_stale: bool,
    /// Where `wait_stands` looks for a late member of the current quorum: the members
    /// before it were found asking (or dead) since the engine last looked, and stay
    /// so until it looks again, so each join moves it on instead of starting over.
    late_cursor: usize,
    /// Something other than a join changed who asks or who lives since the engine
    /// last looked (a request left, a group was evicted or opened a stream): the next
    /// join runs the engine.
    engine_due: bool,
    /// Stall detection (see `stall.rs`).
    stalls: Stalls,
    /// Groups declared dead recently.
    lost: LostGroups,
    /// When some group last committed a step, or when the lighthouse started.
    last_commit: Instant,
    /// When the background task is set to wake; lets handlers wake it only when an
    /// earlier deadline appears.
    pub(crate) ticker_deadline: Option<Instant>,
}

/// Liveness as the engine sees it: a fresh heartbeat (a quorum request counts as one).
struct Fresh<'a> {
    replicas: &'a HashMap<ReplicaId, Replica>,
    horizon: Option<Instant>,
}

impl LiveSet for Fresh<'_> {
    fn is_live(&self, replica_id: &str) -> bool {
        self.replicas
            .get(replica_id)
            .is_some_and(|r| self.horizon.is_none_or(|h| r.pulse.last_beat() > h))
    }
    fn live_ids(&self) -> Box<dyn Iterator<Item = &str> + '_> {
        Box::new(
            self.replicas
                .iter()
                .filter(|(_, r)| self.horizon.is_none_or(|h| r.pulse.last_beat() > h))
                .map(|(id, _)| id.as_str()),
        )
    }
    fn progressed_at(&self, replica_id: &str) -> Option<Instant> {
        let replica = self.replicas.get(replica_id)?;
        Some(replica.pulse.training()?.stalled_since)
    }
}

/// The groups as stall detection sees them.
struct Watch<'a> {
    replicas: &'a HashMap<ReplicaId, Replica>,
    joiners: &'a BTreeMap<ReplicaId, Joiner>,
    quorum: Option<&'a Quorum>,
}

impl Groups for Watch<'_> {
    fn quorum(&self) -> Option<&Quorum> {
        self.quorum
    }
    fn watched(&self, replica_id: &str) -> Watched {
        let asked_at = self.joiners.get(replica_id).map(|j| j.joined_at);
        as_watched(self.replicas.get(replica_id), asked_at)
    }

    /// The quorum's members and the joiners are both in replica-id order: one merged
    /// walk finds which members ask, where a search of the joiners per member would
    /// compare a dozen ids or more.
    fn members(&self) -> Box<dyn Iterator<Item = (&str, Watched)> + '_> {
        let mut joiners = self.joiners.iter().peekable();
        let ids = self.quorum.into_iter().flat_map(Quorum::replica_ids);
        Box::new(ids.map(move |id| {
            while joiners.next_if(|(j, _)| j.as_str() < id).is_some() {}
            let asked_at = joiners
                .next_if(|(j, _)| j.as_str() == id)
                .map(|(_, j)| j.joined_at);
            (id, as_watched(self.replicas.get(id), asked_at))
        }))
    }

    /// Each group's own record first (one that reports no training or never trained
    /// is never due), then a search of the quorum's sorted members, and only for the
    /// groups outside it, of the joiners.
    fn dropped(&self) -> Box<dyn Iterator<Item = (&str, Instant)> + '_> {
        Box::new(self.replicas.iter().filter_map(|(id, replica)| {
            let at = stall::dropped_at(&as_watched(Some(replica), None))?;
            let inside = self.quorum.is_some_and(|q| q.contains(id));
            (!inside && !self.joiners.contains_key(id)).then_some((id.as_str(), at))
        }))
    }
}

/// A group as stall detection sees it: what its record says (none: it is not live),
/// and when it asked for the next quorum.
fn as_watched(replica: Option<&Replica>, asked_at: Option<Instant>) -> Watched {
    Watched {
        training: replica.and_then(|r| r.pulse.training()),
        asked_at,
        step: replica.map_or(0, |r| r.pulse.step()),
        joined: replica.is_some_and(|r| r.joined),
        stream_opened_at: replica.and_then(|r| r.stream.as_ref().map(|s| s.opened_at)),
    }
}

/// A start for a lighthouse's issue numbers, random and never 0 (0: none held).
fn issue_base() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(std::process::id().into());
    hasher.finish() | 1 << 63
}

impl LighthouseState {
    pub fn new(
        config: QuorumConfig,
        heartbeat_timeout: Duration,
        rollback_after: Duration,
    ) -> Self {
        let epoch = Instant::now();
        LighthouseState {
            config,
            heartbeat_timeout,
            newest: NewestState::new(rollback_after),
            rollbacks: Rollbacks::default(),
            replicas: HashMap::new(),
            joiners: BTreeMap::new(),
            pending: HashMap::new(),
            previous: None,
            previous_at: None,
            heard: Arc::new(AtomicU64::new(0)),
            epoch,
            quorums_issued: 0,
            issue_base: issue_base(),
            sent: None,
            next_ticket: 0,
            waiting: (WaitReason::NoJoiners, None),
            waiting_stale: false,
            late_cursor: 0,
            engine_due: false,
            stalls: Stalls::default(),
            lost: LostGroups::default(),
            last_commit: epoch,
            ticker_deadline: None,
        }
    }

    /// Records a request to join the next quorum; the answer arrives on `reply`.
    /// Returns a ticket that identifies this request when it leaves.
    pub fn join(
        &mut self,
        member: quorum::Member,
        last_quorum_id: QuorumId,
        now: Instant,
        reply: oneshot::Sender<QuorumReply>,
    ) -> Result<u64, Status> {
        self.join_knowing(member, last_quorum_id, 0, now, reply)
    }

    /// `join`, for a group that holds issue `known_issue` of a quorum whole: it gets
    /// the next one as a change to it, when that is the last issued.
    pub fn join_knowing(
        &mut self,
        member: quorum::Member,
        last_quorum_id: QuorumId,
        known_issue: u64,
        now: Instant,
        reply: oneshot::Sender<QuorumReply>,
    ) -> Result<u64, Status> {
        let id = member.replica_id.clone();
        // Checked before anything is recorded: an impostor's request must not count
        // as a sign of life of the group whose id it took.
        if let Some((peer, manager)) = self.live_stream(&id, now).and_then(|s| {
            let named = !s.manager_address.is_empty() && !member.manager_address.is_empty();
            (named && s.manager_address != member.manager_address)
                .then(|| (s.peer.clone(), s.manager_address.clone()))
        }) {
            return Err(Status::already_exists(format!(
                "replica id {id:?} is already live: its manager server at {manager} \
                 heartbeats from {peer}, and this request comes from manager {}; give this \
                 group another --replica-id, or stop the other process",
                member.manager_address
            )));
        }
        if let Some(other) = self.joiners.get(&id) {
            if other.member.manager_address != member.manager_address {
                return Err(Status::already_exists(format!(
                    "replica id {id:?} is already asking for a quorum from manager {}; \
                     give this group another --replica-id, or stop the other process",
                    other.member.manager_address
                )));
            }
        }
        self.beat(&id, member.step, last_quorum_id, now);
        if member.torn {
            self.newest.gone(&id);
        } else {
            self.newest.observe(&id, member.identity(), now);
        }
        if let Some(old) = self.pending.remove(&id) {
            let _ = old.reply.send(Err(Status::aborted(
                "superseded by a newer quorum request from the same replica group",
            )));
        }
        self.next_ticket += 1;
        let ticket = self.next_ticket;
        self.pending.insert(
            id.clone(),
            PendingJoin {
                ticket,
                reply,
                known_issue,
            },
        );
        self.joiners.insert(
            id,
            Joiner {
                member,
                last_quorum_id,
                joined_at: now,
            },
        );
        Ok(ticket)
    }

    /// Withdraws a request that timed out or whose caller went away.
    pub fn leave(&mut self, replica_id: &str, ticket: u64) {
        if self
            .pending
            .get(replica_id)
            .is_some_and(|p| p.ticket == ticket)
        {
            self.pending.remove(replica_id);
            self.joiners.remove(replica_id);
            self.engine_due = true;
        }
    }

    fn beat(&mut self, replica_id: &str, step: i64, last_quorum_id: QuorumId, now: Instant) {
        match self.replicas.get(replica_id) {
            // A pulse in the map is never retired: eviction removes it first.
            Some(r) => {
                r.pulse.beat(now, step, last_quorum_id);
            }
            None => {
                let pulse = self.new_pulse(now, step);
                pulse.beat(now, step, last_quorum_id);
                let history = self.lost.returned(replica_id);
                self.replicas.insert(
                    replica_id.to_string(),
                    Replica {
                        pulse,
                        stream: None,
                        history,
                        steps: StepSamples::default(),
                        last_commit: now,
                        joined: false,
                    },
                );
            }
        }
    }

    /// A live group reported what it did: its totals (steps, heals) and its refusals
    /// so far, each when they changed.
    pub fn report(
        &mut self,
        replica_id: &str,
        totals: Option<proto::GroupTally>,
        refused: Option<RefusalCounts>,
        now: Instant,
    ) {
        let Some(r) = self.replicas.get_mut(replica_id) else {
            return;
        };
        if let Some(refused) = refused {
            r.history.tally.report_refused(refused);
        }
        if totals.is_some_and(|t| r.history.tally.report(t)) {
            r.last_commit = now;
            self.last_commit = now;
        }
    }

    /// The heartbeat stream of `replica_id`, if it beat within the heartbeat timeout.
    fn live_stream(&self, replica_id: &str, now: Instant) -> Option<&HeartbeatStream> {
        self.replicas
            .get(replica_id)
            .filter(|r| now.saturating_duration_since(r.pulse.last_beat()) < self.heartbeat_timeout)
            .and_then(|r| r.stream.as_ref())
    }

    fn new_pulse(&self, now: Instant, step: i64) -> Arc<Pulse> {
        Arc::new(Pulse::new(self.epoch, now, step, self.heard.clone()))
    }

    fn highest_seen_id(&self) -> QuorumId {
        self.heard.load(Relaxed)
    }

    /// Opens a group's heartbeat stream; its beats go to the returned pulse. A second
    /// live stream for the same replica id is refused, naming the one already connected.
    pub fn open_stream(
        &mut self,
        beat: &proto::Beat,
        peer: String,
        events: mpsc::Sender<Result<proto::LighthouseEvent, Status>>,
        now: Instant,
    ) -> Result<(u64, Arc<Pulse>), Status> {
        let id = &beat.replica_id;
        // The same manager server opening a new stream gave up its old one (it went
        // silent to it: a cut): that is the group coming back, not a second one.
        let same_group = |s: &&HeartbeatStream| {
            !beat.manager_address.is_empty() && s.manager_address == beat.manager_address
        };
        if let Some(HeartbeatStream { peer: other, .. }) =
            self.live_stream(id, now).filter(|s| !same_group(s))
        {
            return Err(Status::already_exists(format!(
                "replica id {id:?} is already live, heartbeating from {other}; give this group \
                 another --replica-id, or stop the other process (a dead one is forgotten \
                 within the heartbeat timeout, {:.1} s)",
                self.heartbeat_timeout.as_secs_f64()
            )));
        }
        // A group whose old stream went silent is dead: its peers learn it now, and
        // the new stream starts without a lease.
        if self.replicas.get(id).is_some_and(|r| r.stream.is_some()) {
            self.evict(id, Eviction::HeartbeatTimeout, now);
        }
        // A fresh pulse: a stale stream of the same group, should it wake up, beats
        // into its own retired one and ends. A group known so far only from its quorum
        // requests keeps the quorum it is a member of. A member of the current quorum
        // found dead since the engine looked may live again: `wait_stands` looks for
        // late members from the start.
        self.late_cursor = 0;
        let pulse = self.new_pulse(now, beat.step);
        pulse.beat(now, beat.step, beat.last_quorum_id);
        let (history, steps, last_commit, joined) = match self.replicas.remove(id) {
            Some(known) => {
                pulse.set_lease_quorum(known.pulse.lease_quorum());
                known.pulse.retire();
                (known.history, known.steps, known.last_commit, known.joined)
            }
            None => (self.lost.returned(id), StepSamples::default(), now, false),
        };
        self.next_ticket += 1;
        let stream_id = self.next_ticket;
        self.replicas.insert(
            id.clone(),
            Replica {
                pulse: pulse.clone(),
                stream: Some(HeartbeatStream {
                    id: stream_id,
                    events,
                    peer,
                    manager_address: beat.manager_address.clone(),
                    opened_at: now,
                }),
                history,
                steps,
                last_commit,
                joined,
            },
        );
        Ok((stream_id, pulse))
    }

    /// The stream dropped (`StreamBroken`: the group is dead now, not after a timeout)
    /// or said it is leaving (`Left`). Nothing when the stream is not the group's own.
    pub fn close_stream(
        &mut self,
        replica_id: &str,
        stream_id: u64,
        cause: Eviction,
        now: Instant,
    ) -> Option<Eviction> {
        if !self.streams(replica_id, stream_id) {
            return None;
        }
        self.evict(replica_id, cause, now);
        Some(cause)
    }

    /// The group of stream `stream_id` ends its run holding `held` (its leaving beat
    /// says so): the job's newest state is at least that, held by nobody once it is
    /// gone, so a quorum of groups behind it starts a new lineage, announced, rather
    /// than commit its step numbers again (invariant I11).
    pub fn leaves_holding(
        &mut self,
        replica_id: &str,
        stream_id: u64,
        held: Identity,
        now: Instant,
    ) {
        if self.streams(replica_id, stream_id) {
            self.newest.observe(replica_id, held, now);
        }
    }

    /// Whether `stream_id` is the heartbeat stream `replica_id` has open.
    fn streams(&self, replica_id: &str, stream_id: u64) -> bool {
        self.replicas
            .get(replica_id)
            .and_then(|r| r.stream.as_ref())
            .is_some_and(|s| s.id == stream_id)
    }

    /// Declares dead every group silent for longer than the heartbeat timeout.
    pub fn expire(&mut self, now: Instant) -> Vec<(ReplicaId, Eviction)> {
        let Some(horizon) = now.checked_sub(self.heartbeat_timeout) else {
            return Vec::new();
        };
        // Retiring in the same atomic step as the check means a beat that arrives
        // meanwhile either lands before it (and the group lives on) or is refused (and
        // never acknowledged), so no lease outlives its group's eviction.
        let stale: Vec<ReplicaId> = self
            .replicas
            .iter()
            .filter(|(_, r)| r.pulse.retire_if_silent_since(horizon))
            .map(|(id, _)| id.clone())
            .collect();
        for id in &stale {
            self.evict(id, Eviction::HeartbeatTimeout, now);
        }
        stale
            .into_iter()
            .map(|id| (id, Eviction::HeartbeatTimeout))
            .collect()
    }

    /// Forgets a dead group (only what the status page shows of it stays, for a
    /// while), answers its pending request, and tells the other members of the current
    /// quorum at once.
    fn evict(&mut self, replica_id: &str, cause: Eviction, now: Instant) {
        // A group evicted as stalled still reads its stream: it is told, so that its
        // ranks dump what they were doing and exit to be restarted.
        self.engine_due = true;
        // A process that died or exits took its state with it; one that went silent
        // may come back with it.
        if cause != Eviction::HeartbeatTimeout {
            self.newest.gone(replica_id);
        }
        let mut own = None;
        if let Some(r) = self.replicas.remove(replica_id) {
            r.pulse.retire();
            if cause == Eviction::ProgressStalled {
                own = r.stream.as_ref().map(|s| s.events.clone());
            }
            self.remember_lost(replica_id, r, cause, now);
        }
        self.joiners.remove(replica_id);
        if let Some(p) = self.pending.remove(replica_id) {
            let _ = p.reply.send(Err(Status::unavailable(format!(
                "replica group {replica_id:?} was declared dead ({}) while waiting for a quorum",
                cause.as_str()
            ))));
        }
        let event = proto::LighthouseEvent {
            event: Some(proto::lighthouse_event::Event::MembershipLost(
                proto::MembershipLost {
                    quorum_id: self.previous.as_ref().map_or(0, |q| q.id),
                    lost: vec![replica_id.to_string()],
                    cause: cause.as_str().to_string(),
                },
            )),
        };
        if let Some(own) = own {
            let _ = own.try_send(Ok(event.clone()));
        }
        let Some(current) = &self.previous else {
            return;
        };
        if !current.contains(replica_id) {
            return;
        }
        for peer in current.replica_ids() {
            if let Some(stream) = self.replicas.get(peer).and_then(|r| r.stream.as_ref()) {
                // A full queue means the peer is not reading; it will learn from its next quorum.
                let _ = stream.events.try_send(Ok(event.clone()));
            }
        }
    }

    /// Evicts every group stall detection finds hung (see `Stalls::judge`); returns
    /// them, and whether a member is due but waited on by nobody yet.
    pub fn evict_stalled(&mut self, now: Instant) -> (Vec<ReplicaId>, bool) {
        let watch = Watch {
            replicas: &self.replicas,
            joiners: &self.joiners,
            quorum: self.previous.as_ref(),
        };
        let (stalled, overdue) = self.stalls.judge(&watch, now);
        for id in &stalled {
            tracing::warn!(
                replica_id = id,
                "replica group made no progress for its stall timeout while its peers wait \
                 on it: evicted"
            );
            self.evict(id, Eviction::ProgressStalled, now);
        }
        (stalled, overdue)
    }

    /// The groups as stall detection reads them.
    fn watch(&self) -> Watch<'_> {
        Watch {
            replicas: &self.replicas,
            joiners: &self.joiners,
            quorum: self.previous.as_ref(),
        }
    }

    fn remember_lost(&mut self, replica_id: &str, r: Replica, cause: Eviction, now: Instant) {
        let lost = Lost {
            replica_id: replica_id.to_string(),
            cause,
            at: now,
            step: r.pulse.step(),
            was_member: self
                .previous
                .as_ref()
                .is_some_and(|q| q.contains(replica_id)),
            peer: r.stream.map(|s| s.peer).unwrap_or_default(),
            history: r.history,
        };
        self.lost.remember(lost, now);
    }

    /// Records every group's step for its step rate, and forgets lost groups that are
    /// old news. Called by the deadline task, about once per heartbeat timeout.
    pub fn sample_steps(&mut self, now: Instant) {
        let max_step = self.max_step();
        let quorum = self.previous.as_ref();
        for (id, r) in self.replicas.iter_mut() {
            let step = r.pulse.step();
            if stepping(quorum, id, step, max_step) {
                r.steps.record(r.pulse.last_beat(), step, now);
            } else {
                r.steps = StepSamples::default();
            }
        }
        self.lost.forget(now);
    }

    /// The lighthouse is stopping: fails every waiting request and ends every heartbeat
    /// stream now, so that groups re-connect (to a successor) instead of staying
    /// attached to a server that is gone.
    pub fn shut_down(&mut self) {
        self.engine_due = true;
        let gone = || Status::unavailable("the lighthouse is shutting down");
        for (_, p) in self.pending.drain() {
            let _ = p.reply.send(Err(gone()));
        }
        self.joiners.clear();
        for (_, r) in self.replicas.drain() {
            r.pulse.retire();
            if let Some(stream) = r.stream {
                let _ = stream.events.try_send(Err(gone()));
            }
        }
    }

    /// This lighthouse of a set starts or stops serving: everyone waiting or
    /// heartbeating is told `why` (and goes to the serving one), and what it knew of
    /// the job's quorums goes, as if it had restarted: a leader learns the job afresh
    /// from the groups that come to it, never from an old term's leftovers.
    pub fn reset(&mut self, why: Status, now: Instant) {
        for (_, p) in self.pending.drain() {
            let _ = p.reply.send(Err(why.clone()));
        }
        self.joiners.clear();
        for (_, r) in self.replicas.drain() {
            r.pulse.retire();
            if let Some(stream) = r.stream {
                let _ = stream.events.try_send(Err(why.clone()));
            }
        }
        self.previous = None;
        self.previous_at = None;
        self.sent = None;
        // Its holders are to be heard from again, as after a restart.
        self.newest.restart(now);
        self.set_waiting(WaitReason::NoJoiners, None);
    }

    /// The next quorum id is above `floor` (a new leader's term, see
    /// `leadership::quorum_id_floor`).
    pub fn raise_quorum_floor(&mut self, floor: QuorumId) {
        self.heard.fetch_max(floor, Relaxed);
    }

    fn decide(&self, now: Instant) -> Decision {
        let live = Fresh {
            replicas: &self.replicas,
            horizon: now.checked_sub(self.heartbeat_timeout),
        };
        quorum::decide(&quorum::Round {
            joiners: &self.joiners,
            live: &live,
            previous: self.previous.as_ref(),
            previous_at: self.previous_at,
            highest_seen_id: self.highest_seen_id(),
            newest: self.newest.newest(),
            config: &self.config,
            now,
        })
    }

    /// The groups that hold the newest state and beat are seen alive now.
    fn see_live_holders(&mut self, now: Instant) {
        let live = Fresh {
            replicas: &self.replicas,
            horizon: now.checked_sub(self.heartbeat_timeout),
        };
        self.newest.see_live(|id| live.is_live(id), now);
    }

    /// The job's newest committed state, as far as this lighthouse knows.
    pub fn newest_state(&self) -> Option<Identity> {
        self.newest.state()
    }

    /// Another lighthouse of the set knows of `identity` (see `NewestState::learn`).
    pub fn learn_newest(&mut self, identity: Identity, now: Instant) {
        self.newest.learn(identity, now);
    }

    pub fn rollbacks(&self) -> impl Iterator<Item = &Rollback> {
        self.rollbacks.iter()
    }

    /// Records a quorum that starts a new lineage, and says so loudly.
    /// Returns the steps lost.
    fn rolled_back(&mut self, quorum: &Quorum, from: Identity, now: Instant, unix_ms: i64) -> u64 {
        let start: Vec<&quorum::Member> = quorum
            .members
            .iter()
            .filter(|m| m.lineage == quorum.lineage && !m.torn)
            .collect();
        let to = start.first().map_or(
            Identity {
                lineage: quorum.lineage,
                ..Identity::default()
            },
            |m| m.identity(),
        );
        let steps_lost = from.step.saturating_sub(to.step).max(0) as u64;
        let holders: Vec<String> = self.newest.holders().map(str::to_string).collect();
        tracing::error!(
            quorum_id = quorum.id,
            steps_lost,
            "ROLLBACK: the job's newest state, {from}, is held by no group that can come \
             back (last holders: {}); quorum {} starts lineage {} from {to}, held by {}: \
             the steps committed after step {} are lost",
            if holders.is_empty() {
                "gone".to_string()
            } else {
                holders.join(", ")
            },
            quorum.id,
            quorum.lineage,
            start
                .iter()
                .map(|m| m.replica_id.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            to.step,
        );
        self.newest
            .rolled_back(to, start.iter().map(|m| m.replica_id.as_str()), now);
        self.rollbacks.push(Rollback {
            quorum_id: quorum.id,
            from,
            to,
            steps_lost,
            unix_ms,
        });
        steps_lost
    }

    /// Runs the engine; on a quorum, answers every member's pending request.
    pub fn evaluate(&mut self, now: Instant, unix_ms: i64) -> Option<Issued> {
        self.see_live_holders(now);
        let quorum = match self.decide(now) {
            Decision::Wait { until, reason } => {
                self.set_waiting(reason, until);
                return None;
            }
            Decision::Issue(q) => q,
        };
        let waited = self
            .joiners
            .values()
            .map(|j| j.joined_at)
            .min()
            .map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
        let changed = self.previous.as_ref().is_none_or(|p| p.id != quorum.id);
        let rolled_back = quorum
            .rolled_back_from
            .map(|from| self.rolled_back(&quorum, from, now, unix_ms));
        let sent = proto::Quorum {
            quorum_id: quorum.id,
            participants: quorum.members.iter().cloned().map(Into::into).collect(),
            issued_at_unix_ms: unix_ms,
            lineage: quorum.lineage,
            rolled_back_from: quorum.rolled_back_from.map(Into::into),
            issue: self.issue_base.wrapping_add(self.quorums_issued),
        };
        let whole = Bytes::from(sent.encode_to_vec());
        // Each encoded once, whoever gets it.
        let update = self.sent.as_ref().and_then(|known| {
            let update = delta::between(known, &sent)?;
            Some((known.issue, Bytes::from(update.encode_to_vec())))
        });
        let mut members = quorum.in_order();
        self.joiners.retain(|id, _| !members.contains(id));
        for id in quorum.replica_ids() {
            if let Some(p) = self.pending.remove(id) {
                let answer = match &update {
                    Some((base, update)) if p.known_issue == *base => {
                        Answer::Update(update.clone())
                    }
                    _ => Answer::Whole(whole.clone()),
                };
                let _ = p.reply.send(Ok(answer));
            }
        }
        self.sent = Some(sent);
        // Told at once, so that they look again whether they can reach the others,
        // rather than wait out their request: as a quorum that did not come in time
        // (the lighthouse was reached; this round has no place for them).
        for (id, by) in &quorum.left_out {
            self.joiners.remove(id);
            if let Some(p) = self.pending.remove(id) {
                let _ = p.reply.send(Err(Status::deadline_exceeded(format!(
                    "left out of quorum {}: replica group {by:?} could not reach this group \
                     (a cut between their hosts); asking again once they reach each other",
                    quorum.id
                ))));
            }
        }
        // Leases name the new quorum from now on; a member of the old one left out
        // of it holds none.
        if let Some(old) = &self.previous {
            let mut members = quorum.in_order();
            for id in old.replica_ids().filter(|id| !members.contains(id)) {
                if let Some(r) = self.replicas.get(id) {
                    r.pulse.set_lease_quorum(0);
                }
            }
        }
        for id in quorum.replica_ids() {
            if let Some(r) = self.replicas.get_mut(id) {
                r.pulse.set_lease_quorum(quorum.id);
                r.joined = true;
            }
        }
        self.heard.fetch_max(quorum.id, Relaxed);
        self.quorums_issued += 1;
        let issued = Issued {
            quorum_id: quorum.id,
            changed,
            waited,
            rolled_back,
        };
        self.previous = Some(quorum);
        self.previous_at = Some(now);
        // Whoever is left (kept out by shrink_only) starts the next round now.
        for j in self.joiners.values_mut() {
            j.joined_at = now;
        }
        let (reason, until) = match self.decide(now) {
            Decision::Wait { until, reason } => (reason, until),
            Decision::Issue(_) => (WaitReason::NoJoiners, Some(now)),
        };
        self.set_waiting(reason, until);
        Some(issued)
    }

    fn set_waiting(&mut self, reason: WaitReason, until: Option<Instant>) {
        self.waiting = (reason, until);
        self.waiting_stale = false;
        self.late_cursor = 0;
        self.engine_due = false;
    }

    /// Whether the engine's last decision, to wait until its deadline for live
    /// members of the current quorum that have not asked again, still stands after a
    /// join: then the join need not run the engine (nor the stall check), which would
    /// cost every round time proportional to the square of its groups.
    ///
    /// It stands while some member is still late (live, not asking), the wait's
    /// deadline is ahead, and nothing that time changes (a heartbeat expiry, a stall,
    /// the engine's deadline) is due before the deadline task has acted on it, which
    /// `ticker_deadline` tells: a join adds a live joiner, never a late member or an
    /// earlier first request, so the engine would wait too, until the same deadline
    /// or a later one (a re-request moves the round's first request later; the
    /// deadline task then finds the wait longer). Nor can a join make a stalled
    /// member due for eviction at once: its wait starts now, and a stall is evicted
    /// only once a peer waited half the stall timeout; but a member due already and
    /// waited on by nobody yet gets its eviction time from this join, so then the
    /// stall check runs (and the deadline task is set for that time).
    pub fn wait_stands(&mut self, now: Instant) -> bool {
        let (reason, Some(until)) = &self.waiting else {
            return false;
        };
        if self.engine_due
            || self.stalls.overdue()
            || now >= *until
            || self.ticker_deadline.is_none_or(|at| now >= at)
        {
            return false;
        }
        let stands = match reason {
            WaitReason::LateMembers { .. } | WaitReason::MembersOnTheirWay { .. } => {
                self.a_member_is_late(now)
            }
            // The first round waits for every live group, and every group is live
            // while no heartbeat expiry is due (`ticker_deadline`); a join's group is
            // one of them, so some group has not asked while there are fewer joiners.
            WaitReason::GatheringFirstQuorum { .. } => self.joiners.len() < self.replicas.len(),
            // A restarted lighthouse's first round waits out its deadline whoever asks.
            WaitReason::RejoiningAfterRestart { .. } => true,
            _ => false,
        };
        self.waiting_stale |= stands;
        stands
    }

    /// Whether some live member of the current quorum has not asked again, looked for
    /// from where the last look stopped (see `late_cursor`).
    fn a_member_is_late(&mut self, now: Instant) -> bool {
        let Some(quorum) = &self.previous else {
            return false;
        };
        let horizon = now.checked_sub(self.heartbeat_timeout);
        let live = Fresh {
            replicas: &self.replicas,
            horizon,
        };
        let late = quorum.members[self.late_cursor.min(quorum.members.len())..]
            .iter()
            .position(|m| !self.joiners.contains_key(&m.replica_id) && live.is_live(&m.replica_id));
        match late {
            Some(at) => {
                self.late_cursor += at;
                true
            }
            None => false,
        }
    }

    /// Whether the engine's last decision stands after a heartbeat stream opened: it
    /// adds a live group and no request, and a round waits for a live group or
    /// leaves it out, so it ends no wait; nor does a round start while nobody asks.
    /// Then the open need not run the engine (nor the stall check, see `stall_of`),
    /// which on every open would cost a job's start time proportional to the square
    /// of its groups.
    pub fn decision_stands(&mut self, now: Instant) -> bool {
        let nobody_asks = self.joiners.is_empty()
            && matches!(self.waiting.0, WaitReason::NoJoiners)
            && !self.engine_due
            && !self.stalls.overdue();
        nobody_asks || self.wait_stands(now)
    }

    /// When stall detection next has group `replica_id` to judge as dropped out of
    /// the quorum (see `stall::dropped_due`): all that a stream's opening changes of
    /// it (a fresh pulse reports no progress and no wait yet, so no member becomes
    /// due or waited on sooner).
    pub fn stall_of(&self, replica_id: &str, now: Instant) -> Option<Instant> {
        stall::dropped_due(&self.watch(), replica_id).filter(|at| *at > now)
    }

    /// When the background task must look again: the engine's deadline, the next
    /// heartbeat expiry or the next stall, whichever is first.
    pub fn next_wakeup(&self, now: Instant) -> Option<Instant> {
        let expiry = self
            .replicas
            .values()
            .map(|r| r.pulse.last_beat() + self.heartbeat_timeout)
            .min();
        [self.waiting.1, expiry, self.next_stall(now)]
            .into_iter()
            .flatten()
            .min()
    }

    /// When stall detection next has a group to judge (see `Stalls::next`).
    pub fn next_stall(&self, now: Instant) -> Option<Instant> {
        self.stalls.next(&self.watch(), now)
    }

    pub fn waiting_until(&self) -> Option<Instant> {
        self.waiting.1
    }

    pub fn heartbeat_timeout(&self) -> Duration {
        self.heartbeat_timeout
    }

    /// Why no quorum is issued yet, as of `now`.
    pub fn waiting_reason(&self, now: Instant) -> WaitReason {
        if !self.waiting_stale {
            return self.waiting.0.clone();
        }
        match self.decide(now) {
            Decision::Wait { reason, .. } => reason,
            Decision::Issue(_) => self.waiting.0.clone(),
        }
    }

    pub fn live_replicas(&self) -> usize {
        self.replicas.len()
    }

    pub fn current_quorum(&self) -> Option<&Quorum> {
        self.previous.as_ref()
    }

    /// The highest step among the members of the current quorum: where they all start
    /// from once it is issued.
    fn max_step(&self) -> i64 {
        self.previous
            .as_ref()
            .and_then(|q| q.members.iter().map(|m| m.step).max())
            .unwrap_or(0)
    }

    pub fn snapshot(&self, now: Instant) -> Snapshot {
        let max_step = self.max_step();
        let mut replicas: Vec<ReplicaSnapshot> = self
            .replicas
            .iter()
            .map(|(id, r)| self.replica_snapshot(id, r, max_step, now))
            .collect();
        replicas.sort_by(|a, b| a.replica_id.cmp(&b.replica_id));
        mark_stragglers(&mut replicas);
        let lost = self
            .lost
            .recent(now)
            .map(|l| LostSnapshot::of(l, now))
            .collect();
        Snapshot {
            quorum_id: self.previous.as_ref().map_or(0, |q| q.id),
            quorum_members: self
                .previous
                .as_ref()
                .map(|q| q.replica_ids().map(str::to_string).collect())
                .unwrap_or_default(),
            max_step,
            replicas,
            lost,
            waiting_for: if self.joiners.is_empty() {
                String::new()
            } else {
                self.waiting_reason(now).to_string()
            },
            quorums_issued: self.quorums_issued,
            min_replicas: self.config.min_replicas as u32,
            join_timeout_ms: self.config.join_timeout.as_millis() as u64,
            heartbeat_timeout_ms: self.heartbeat_timeout.as_millis() as u64,
            lost_kept_for_ms: LOST_KEPT_FOR.as_millis() as u64,
            lost_kept: LOST_KEPT as u32,
            last_commit_age_ms: ms_since(self.last_commit, now),
            newest: self.newest.state(),
            rollbacks: self.rollbacks.iter().rev().cloned().collect(),
        }
    }

    fn replica_snapshot(
        &self,
        id: &str,
        r: &Replica,
        max_step: i64,
        now: Instant,
    ) -> ReplicaSnapshot {
        let in_quorum = self.previous.as_ref().is_some_and(|q| q.contains(id));
        let (last_beat, step) = (r.pulse.last_beat(), r.pulse.step());
        let training = r.pulse.training();
        ReplicaSnapshot {
            replica_id: id.to_string(),
            connected: r.stream.is_some(),
            joined: self.joiners.contains_key(id),
            in_quorum,
            step,
            // The lighthouse does not see a heal, only the steps groups report. Every
            // member of a quorum starts from its max step; one that still reports a
            // lower step is fetching the state it lacks from a peer (until its next
            // quorum request reports the step it caught up to).
            healing: in_quorum && step < max_step,
            step_rate: stepping(self.previous.as_ref(), id, step, max_step)
                .then(|| r.steps.rate((last_beat, step), now))
                .flatten(),
            heartbeat_age_ms: ms_since(last_beat, now),
            last_commit_age_ms: ms_since(r.last_commit, now),
            progress_age_ms: training.map(|t| ms_since(t.stalled_since, now)),
            step_time_ms: training
                .and_then(|t| t.step_time)
                .map(|d| d.as_millis() as u64),
            straggler: false,
            peer: r
                .stream
                .as_ref()
                .map(|s| s.peer.clone())
                .unwrap_or_default(),
            history: r.history.clone(),
        }
    }
}

#[cfg(test)]
mod tests;
