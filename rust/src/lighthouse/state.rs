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
    fn ids(&self) -> Box<dyn Iterator<Item = &str> + '_> {
        Box::new(self.replicas.keys().map(String::as_str))
    }
    fn watched(&self, replica_id: &str) -> Watched {
        let replica = self.replicas.get(replica_id);
        Watched {
            training: replica.and_then(|r| r.pulse.training()),
            asked_at: self.joiners.get(replica_id).map(|j| j.joined_at),
            step: replica.map_or(0, |r| r.pulse.step()),
            stream_opened_at: replica.and_then(|r| r.stream.as_ref().map(|s| s.opened_at)),
        }
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
        let (history, steps, last_commit) = match self.replicas.remove(id) {
            Some(known) => {
                pulse.set_lease_quorum(known.pulse.lease_quorum());
                known.pulse.retire();
                (known.history, known.steps, known.last_commit)
            }
            None => (self.lost.returned(id), StepSamples::default(), now),
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
        let ours = self
            .replicas
            .get(replica_id)
            .and_then(|r| r.stream.as_ref())
            .is_some_and(|s| s.id == stream_id);
        if !ours {
            return None;
        }
        self.evict(replica_id, cause, now);
        Some(cause)
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
        let horizon = now.checked_sub(self.heartbeat_timeout);
        let live: Vec<ReplicaId> = self
            .newest
            .holders()
            .filter(|id| {
                self.replicas
                    .get(*id)
                    .is_some_and(|r| horizon.is_none_or(|h| r.pulse.last_beat() > h))
            })
            .map(str::to_string)
            .collect();
        for id in live {
            self.newest.seen(&id, now);
        }
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
        for id in quorum.replica_ids() {
            self.joiners.remove(id);
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
            for id in old.replica_ids().filter(|id| !quorum.contains(id)) {
                if let Some(r) = self.replicas.get(id) {
                    r.pulse.set_lease_quorum(0);
                }
            }
        }
        for id in quorum.replica_ids() {
            if let Some(r) = self.replicas.get(id) {
                r.pulse.set_lease_quorum(quorum.id);
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
            WaitReason::LateMembers { .. } => self.a_member_is_late(now),
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

    /// When stall detection next has a group to judge (see `stall::next_stall`).
    pub fn next_stall(&self, now: Instant) -> Option<Instant> {
        stall::next_stall(&self.watch(), now)
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
mod tests {
    use super::*;
    use crate::lighthouse::history::Losses;

    fn state() -> LighthouseState {
        LighthouseState::new(
            QuorumConfig {
                min_replicas: 1,
                join_timeout: Duration::from_secs(1),
            },
            Duration::from_secs(2),
            ROLLBACK_AFTER,
        )
    }

    const ROLLBACK_AFTER: Duration = Duration::from_secs(30);

    fn member(id: &str) -> quorum::Member {
        quorum::Member {
            replica_id: id.into(),
            world_size: 1,
            ..Default::default()
        }
    }

    fn beat(id: &str) -> proto::Beat {
        proto::Beat {
            protocol_version: proto::PROTOCOL_VERSION,
            replica_id: id.into(),
            ..Default::default()
        }
    }

    type Events = mpsc::Receiver<Result<proto::LighthouseEvent, Status>>;

    fn open(s: &mut LighthouseState, id: &str, now: Instant) -> ((u64, Arc<Pulse>), Events) {
        let (tx, rx) = mpsc::channel(4);
        let stream = s.open_stream(&beat(id), "test".into(), tx, now).unwrap();
        (stream, rx)
    }

    fn decoded(reply: QuorumReply) -> proto::Quorum {
        match reply.unwrap() {
            Answer::Whole(bytes) => proto::Quorum::decode(bytes).unwrap(),
            Answer::Update(_) => panic!("an update for a group that holds no quorum"),
        }
    }

    fn form_quorum(s: &mut LighthouseState, ids: &[&str], now: Instant) -> proto::Quorum {
        let mut replies = Vec::new();
        for id in ids {
            let (tx, rx) = oneshot::channel();
            s.join(member(id), 0, now, tx).unwrap();
            replies.push(rx);
        }
        s.evaluate(now, 0).expect("quorum");
        let mut got = replies
            .into_iter()
            .map(|mut r| decoded(r.try_recv().unwrap()));
        got.next().unwrap()
    }

    /// A beat of a group that reports its training: no progress for `age_ms`,
    /// waiting on the others for `waiting_ms` (0: not), with a 5 s stall timeout.
    fn trained(pulse: &Pulse, now: Instant, age_ms: u64, waiting_ms: u64) {
        let beat = proto::Beat {
            progress_age_ms: age_ms,
            waiting_ms,
            stall_timeout_ms: 5000,
            step_time_ms: 200,
            ..beat("any")
        };
        assert!(pulse.beat(now, pulse.step(), 0));
        pulse.trained(now, &beat);
    }

    fn lost(events: &mut Events) -> proto::MembershipLost {
        match events.try_recv().unwrap().unwrap().event {
            Some(proto::lighthouse_event::Event::MembershipLost(lost)) => lost,
            other => panic!("expected a membership loss, got {other:?}"),
        }
    }

    #[test]
    fn a_member_stalled_while_a_peer_waits_on_it_is_evicted_and_told() {
        let t = Instant::now();
        let ms = |n: u64| t + Duration::from_millis(n);
        let mut s = state();
        let ((_, a), mut a_events) = open(&mut s, "a", t);
        let ((_, b), mut b_events) = open(&mut s, "b", t);
        form_quorum(&mut s, &["a", "b"], t);
        // b's training thread stops at 1 s; a trains on, then waits on b from 1.5 s.
        for n in (0..=6000).step_by(100) {
            trained(&a, ms(n), 0, n.saturating_sub(1500));
            trained(&b, ms(n), n.saturating_sub(1000), 0);
            let now = ms(n);
            if n < 6000 {
                assert_eq!(s.evict_stalled(now), (vec![], false), "at {n} ms");
                if n == 4500 {
                    assert_eq!(s.next_wakeup(now), Some(ms(6000)), "wakes when b is due");
                }
            }
        }
        assert_eq!(s.evict_stalled(ms(6000)), (vec!["b".to_string()], false));
        let told = lost(&mut a_events);
        assert_eq!(
            (told.lost.as_slice(), told.cause.as_str()),
            (&["b".to_string()][..], "progress_stalled")
        );
        let own = lost(&mut b_events);
        assert_eq!(
            own.lost,
            vec!["b".to_string()],
            "the stalled group is told too"
        );
        assert!(b.is_retired());
        let snap = s.snapshot(ms(6000));
        assert_eq!(snap.lost[0].cause, Eviction::ProgressStalled);
        assert_eq!(snap.lost[0].history.losses.progress_stalled, 1);
    }

    #[test]
    fn a_stalled_member_nobody_waits_on_stays_until_a_peer_waits() {
        let t = Instant::now();
        let ms = |n: u64| t + Duration::from_millis(n);
        let mut s = state();
        let ((_, a), _a_events) = open(&mut s, "a", t);
        let ((_, b), _b_events) = open(&mut s, "b", t);
        form_quorum(&mut s, &["a", "b"], t);
        // Both quiet for 8 s (a long step with no marks in it): neither is evicted.
        trained(&a, ms(8000), 8000, 0);
        trained(&b, ms(8000), 8000, 0);
        assert_eq!(
            s.evict_stalled(ms(8000)),
            (vec![], true),
            "overdue, not evicted"
        );
        // a moves on and waits: a wait that short is no sign that b hangs (b may be
        // done with its steps, a's vote waiting for its lease)...
        trained(&a, ms(8100), 0, 100);
        trained(&b, ms(8100), 8100, 0);
        assert_eq!(s.evict_stalled(ms(8100)), (vec![], false));
        // (The deadline task wakes at the heartbeat expiry before that, and then at it.)
        // ...but half the stall timeout of it is: b, still stalled, goes.
        trained(&a, ms(10500), 0, 2500);
        trained(&b, ms(10500), 10500, 0);
        assert_eq!(s.evict_stalled(ms(10500)).0, vec!["b".to_string()]);
    }

    #[test]
    fn a_group_that_waits_or_asks_for_a_quorum_or_reports_nothing_is_not_stalled() {
        let t = Instant::now();
        let ms = |n: u64| t + Duration::from_millis(n);
        let mut s = state();
        let ((_, a), _a_events) = open(&mut s, "a", t);
        let ((_, b), _b_events) = open(&mut s, "b", t);
        let ((_, c), _c_events) = open(&mut s, "c", t);
        form_quorum(&mut s, &["a", "b", "c"], t);
        // a waits (in its deadline: age 0); c reports nothing (an older client).
        trained(&a, ms(9000), 0, 9000);
        trained(&b, ms(9000), 0, 9000);
        assert!(c.beat(ms(9000), 0, 0));
        assert_eq!(s.evict_stalled(ms(9000)), (vec![], false));
        // b stalls but asks for the next quorum: all its ranks got that far.
        trained(&b, ms(20000), 10000, 0);
        trained(&a, ms(20000), 0, 20000);
        assert!(c.beat(ms(20000), 0, 0));
        let (tx, _rx) = oneshot::channel();
        s.join(member("b"), 1, ms(20000), tx).unwrap();
        assert_eq!(s.evict_stalled(ms(20000)), (vec![], false));
    }

    #[test]
    fn a_group_that_trained_and_dropped_out_of_the_quorum_stalled_is_evicted_and_told() {
        let t = Instant::now();
        let ms = |n: u64| t + Duration::from_millis(n);
        let mut s = state();
        let ((_, a), _a_events) = open(&mut s, "a", t);
        let ((_, b), mut b_events) = open(&mut s, "b", t);
        let ((_, c), _c_events) = open(&mut s, "c", t);
        form_quorum(&mut s, &["a", "b", "c"], t);
        // b hung after its vote: the next quorum went on without it.
        let mut replies = Vec::new();
        for id in ["a", "c"] {
            let (tx, rx) = oneshot::channel();
            s.join(member(id), 1, ms(1000), tx).unwrap();
            replies.push(rx);
        }
        assert!(b.beat(ms(1500), 5, 1) && c.beat(ms(1500), 5, 1));
        let issued = s.evaluate(ms(2500), 0);
        assert!(
            issued.is_some(),
            "a quorum of a and c: {}",
            s.waiting_reason(ms(2500))
        );
        assert!(c.beat(ms(3000), 5, 1));
        trained(&c, ms(3000), 0, 0);
        assert!(b.beat(ms(3000), 5, 1));
        trained(&b, ms(3000), 3000, 0);
        trained(&a, ms(3000), 0, 0);
        assert_eq!(
            s.evict_stalled(ms(4000)),
            (vec![], false),
            "not stalled 5 s yet"
        );
        assert_eq!(
            s.next_wakeup(ms(4000)),
            Some(ms(5000)).min(s.next_wakeup(ms(4000)))
        );
        assert!(b.beat(ms(5000), 5, 1));
        trained(&b, ms(5000), 5000, 0);
        assert_eq!(s.evict_stalled(ms(5000)).0, vec!["b".to_string()]);
        let own = lost(&mut b_events);
        assert_eq!(
            (own.lost, own.cause.as_str()),
            (vec!["b".to_string()], "progress_stalled")
        );
    }

    #[test]
    fn a_group_back_from_a_pause_or_not_trained_yet_is_not_taken_for_dropped() {
        let t = Instant::now();
        let ms = |n: u64| t + Duration::from_millis(n);
        let mut s = state();
        // Never trained (step 0): starting up, however still.
        let ((_, a), _a_events) = open(&mut s, "a", t);
        trained(&a, ms(9000), 9000, 0);
        assert_eq!(s.evict_stalled(ms(9000)), (vec![], false));
        // Trained, and its stream just re-opened (resumed from SIGSTOP): its old
        // progress age is not held against it until a stall timeout after.
        let ((_, b), _b_events) = open(&mut s, "b", ms(9000));
        assert!(b.beat(ms(9000), 7, 1));
        trained(&b, ms(9000), 9000, 0);
        assert_eq!(s.evict_stalled(ms(9000)), (vec![], false));
        assert!(b.beat(ms(9100), 7, 1));
        trained(&b, ms(9100), 0, 0);
        assert_eq!(s.evict_stalled(ms(14000)), (vec![], false), "it moved");
    }

    /// A small deterministic generator: the scenarios below vary without a seed to chase.
    struct Lcg(u64);

    impl Lcg {
        fn below(&mut self, n: u64) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 33) % n
        }
    }

    /// The engine's own answer at `now`, for comparison with what the state kept.
    fn engine_waits(s: &LighthouseState, now: Instant) -> (WaitReason, Option<Instant>) {
        match s.decide(now) {
            Decision::Wait { reason, until } => (reason, until),
            Decision::Issue(q) => panic!("the engine would issue quorum {} now", q.id),
        }
    }

    #[test]
    fn a_join_skips_the_engine_only_while_its_wait_for_a_late_member_stands() {
        let t = Instant::now();
        let ms = |n: u64| t + Duration::from_millis(n);
        let mut rng = Lcg(7);
        for round in 0..20 {
            let mut s = state();
            let n = 2 + rng.below(12) as usize;
            let ids: Vec<String> = (0..n).map(|i| format!("g{i:02}")).collect();
            let names: Vec<&str> = ids.iter().map(String::as_str).collect();
            form_quorum(&mut s, &names, t);
            // The deadline task sleeps until the heartbeat expiry.
            s.ticker_deadline = Some(ms(2000));
            let mut order = ids.clone();
            for i in (1..n).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
            let mut replies = Vec::new();
            for (k, id) in order.iter().enumerate() {
                let now = ms(100 + 10 * k as u64);
                let (tx, rx) = oneshot::channel();
                s.join(member(id), 1, now, tx).unwrap();
                replies.push(rx);
                let last = k + 1 == n;
                if s.wait_stands(now) {
                    assert!(!last, "round {round}: nobody is late once all asked");
                    // The engine would wait as well, for the same members, no sooner.
                    let (reason, until) = engine_waits(&s, now);
                    assert!(matches!(reason, WaitReason::LateMembers { .. }));
                    assert!(until >= s.waiting_until(), "round {round}");
                    assert_eq!(s.waiting_reason(now), reason, "round {round}");
                    let WaitReason::LateMembers { missing } = reason else {
                        unreachable!()
                    };
                    assert_eq!(missing.count, n - k - 1, "round {round}");
                } else {
                    assert!(
                        k == 0 || last,
                        "round {round}: join {k} of {n} ran the engine"
                    );
                    let issued = s.evaluate(now, 0);
                    assert_eq!(issued.is_some(), last, "round {round}, join {k}");
                }
            }
            for mut reply in replies {
                assert_eq!(decoded(reply.try_recv().unwrap()).participants.len(), n);
            }
        }
    }

    #[test]
    fn a_member_that_holds_the_last_quorum_gets_the_next_as_its_change() {
        let t = Instant::now();
        let ms = |n: u64| t + Duration::from_millis(n);
        let mut s = state();
        let first = form_quorum(&mut s, &["a", "b", "c"], t);
        assert_ne!(first.issue, 0);
        // a holds the first quorum, b holds none, c holds one of another lighthouse.
        let mut replies = Vec::new();
        for (id, known) in [("a", first.issue), ("b", 0), ("c", first.issue ^ 1)] {
            let (tx, rx) = oneshot::channel();
            let step = quorum::Member {
                step: 1,
                ..member(id)
            };
            s.join_knowing(step, first.quorum_id, known, ms(10), tx)
                .unwrap();
            replies.push(rx);
        }
        s.evaluate(ms(10), 0).expect("the next round");
        let answers: Vec<Answer> = replies
            .into_iter()
            .map(|mut r| r.try_recv().unwrap().unwrap())
            .collect();
        let whole = match &answers[1] {
            Answer::Whole(bytes) => proto::Quorum::decode(bytes.clone()).unwrap(),
            Answer::Update(_) => panic!("b holds no quorum"),
        };
        assert!(matches!(answers[2], Answer::Whole(_)), "c holds another");
        let Answer::Update(update) = &answers[0] else {
            panic!("a holds the last quorum issued")
        };
        assert!(
            update.len() < 40,
            "a steady round's change is small: {}",
            update.len()
        );
        assert_eq!(answers[0].decode(Some(&first)).unwrap(), whole);
        assert_eq!(whole.quorum_id, first.quorum_id);
        assert_ne!(whole.issue, first.issue);
        assert!(whole.participants.iter().all(|m| m.step == 1));
    }

    #[test]
    fn the_first_rounds_joins_and_every_open_skip_the_engine_while_its_decision_stands() {
        let t = Instant::now();
        let ms = |n: u64| t + Duration::from_millis(n);
        let mut rng = Lcg(11);
        for round in 0..20 {
            let mut s = state();
            let n = 2 + rng.below(12) as usize;
            let ids: Vec<String> = (0..n).map(|i| format!("g{i:02}")).collect();
            // The deadline task sleeps until the heartbeat expiry.
            s.ticker_deadline = Some(ms(2000));
            let mut streams = Vec::new();
            for id in &ids {
                streams.push(open(&mut s, id, t));
                assert!(s.decision_stands(t), "round {round}: nobody asks yet");
            }
            let mut replies = Vec::new();
            for (k, id) in ids.iter().enumerate() {
                let now = ms(100 + 10 * k as u64);
                let (tx, rx) = oneshot::channel();
                s.join(member(id), 0, now, tx).unwrap();
                replies.push(rx);
                let last = k + 1 == n;
                if s.wait_stands(now) {
                    assert!(!last, "round {round}: nobody is missing once all asked");
                    let (reason, until) = engine_waits(&s, now);
                    assert_eq!(s.waiting_reason(now), reason, "round {round}");
                    let WaitReason::GatheringFirstQuorum { missing } = reason else {
                        panic!("round {round}: the engine waits for {reason}");
                    };
                    assert_eq!(missing.count, n - k - 1, "round {round}");
                    assert!(until >= s.waiting_until(), "round {round}");
                    // A group that opens its stream now is one more to wait for.
                    if replies.len() == k + 1 {
                        streams.push(open(&mut s, "late", now));
                        assert!(s.decision_stands(now), "round {round}");
                        let (tx, rx) = oneshot::channel();
                        s.join(member("late"), 0, now, tx).unwrap();
                        replies.push(rx);
                        assert!(s.wait_stands(now), "round {round}");
                    }
                } else {
                    assert!(
                        k == 0 || last,
                        "round {round}: join {k} of {n} ran the engine"
                    );
                    let issued = s.evaluate(now, 0);
                    assert_eq!(issued.is_some(), last, "round {round}, join {k}");
                }
            }
            let everyone = replies.len();
            assert!(
                everyone == n + 1 || n == 2,
                "round {round}: late joined a standing wait"
            );
            for mut reply in replies {
                let quorum = decoded(reply.try_recv().unwrap());
                assert_eq!(quorum.participants.len(), everyone, "round {round}");
            }
            // A stream opened while a quorum stands and nobody asks changes nothing.
            assert!(s.decision_stands(ms(500)), "round {round}");
            // But past a heartbeat expiry the deadline task has not acted on, a join
            // runs the engine: a group may be dead that the count takes for live.
            let mut s = state();
            s.ticker_deadline = Some(ms(50));
            let _a = open(&mut s, "a", t);
            let _b = open(&mut s, "b", t);
            join_at_step(&mut s, "a", 0, ms(10));
            assert!(
                s.evaluate(ms(10), 0).is_none(),
                "round {round}: b has not asked"
            );
            join_at_step(&mut s, "b", 0, ms(60));
            assert!(!s.wait_stands(ms(60)), "round {round}");
        }
    }

    #[test]
    fn a_join_runs_the_engine_when_a_deadline_is_due_or_a_member_left() {
        let t = Instant::now();
        let ms = |n: u64| t + Duration::from_millis(n);
        let mut s = state();
        form_quorum(&mut s, &["a", "b", "c"], t);
        s.ticker_deadline = Some(ms(2000));
        join_at_step(&mut s, "a", 0, ms(100));
        assert!(!s.wait_stands(ms(100)), "the engine has not looked yet");
        assert!(s.evaluate(ms(100), 0).is_none());
        // A heartbeat expiry is due and the deadline task has not acted on it yet.
        s.ticker_deadline = Some(ms(150));
        join_at_step(&mut s, "b", 0, ms(200));
        assert!(!s.wait_stands(ms(200)));
        s.ticker_deadline = Some(ms(2000));
        assert!(s.wait_stands(ms(200)));
        // Past the engine's deadline, the engine decides (to issue without c).
        assert!(!s.wait_stands(ms(1100)));
        // A late member that leaves its request ends what the skipped joins relied on.
        let (tx, _rx) = oneshot::channel();
        let ticket = s.join(member("c"), 1, ms(300), tx).unwrap();
        s.leave("c", ticket);
        assert!(!s.wait_stands(ms(300)), "c left: the engine must look");
        let (reason, _) = engine_waits(&s, ms(300));
        assert_eq!(
            s.evaluate(ms(300), 0).map(|q| q.quorum_id),
            None,
            "{reason}"
        );
        assert!(s.wait_stands(ms(300)), "c is late again");
    }

    #[test]
    fn a_join_runs_the_stall_check_while_a_stalled_member_waits_for_a_waiting_peer() {
        let t = Instant::now();
        let ms = |n: u64| t + Duration::from_millis(n);
        let mut s = state();
        let ((_, a), _ea) = open(&mut s, "a", t);
        let ((_, b), _eb) = open(&mut s, "b", t);
        let ((_, c), _ec) = open(&mut s, "c", t);
        form_quorum(&mut s, &["a", "b", "c"], t);
        s.ticker_deadline = Some(ms(7000));
        trained(&a, ms(6000), 6000, 0);
        trained(&b, ms(6000), 0, 0);
        assert!(c.beat(ms(6000), 0, 0));
        assert_eq!(s.evict_stalled(ms(6000)), (vec![], true), "a is due");
        join_at_step(&mut s, "b", 0, ms(6000));
        assert!(s.evaluate(ms(6000), 0).is_none(), "a and c are late");
        join_at_step(&mut s, "c", 0, ms(6100));
        assert!(!s.wait_stands(ms(6100)), "b began to wait on a, who is due");
        assert_eq!(s.evict_stalled(ms(6100)), (vec![], false));
        assert!(s.wait_stands(ms(6100)), "a is late, and no longer overdue");
        assert_eq!(
            s.next_stall(ms(6100)),
            Some(ms(8500)),
            "the deadline task's time"
        );
        // a goes once b waited half of a's stall timeout.
        trained(&a, ms(8499), 8499, 0);
        assert_eq!(s.evict_stalled(ms(8499)), (vec![], false));
        assert_eq!(s.evict_stalled(ms(8500)).0, ["a".to_string()]);
    }

    /// Member `k`'s stall times as the lighthouse computed them before `EarliestWaits`:
    /// every peer's wait looked up again for each member.
    fn stall_due_by_every_peer(
        s: &LighthouseState,
        k: usize,
    ) -> (Option<Instant>, Option<Instant>) {
        let quorum = s.previous.as_ref().unwrap();
        let id = &quorum.members[k].replica_id;
        let watch = s.watch();
        if s.joiners.contains_key(id) {
            return (None, None);
        }
        let Some(training) = watch.watched(id).training else {
            return (None, None);
        };
        let evict_at = quorum
            .replica_ids()
            .filter(|peer| *peer != id.as_str())
            .filter_map(|peer| watch.watched(peer).waiting_since())
            .min()
            .map(|since| (since + training.stall_timeout / 2).max(training.due()));
        (Some(training.due()), evict_at)
    }

    #[test]
    fn a_stall_is_judged_by_the_earliest_wait_of_the_other_members() {
        let t = Instant::now();
        let mut rng = Lcg(11);
        for round in 0..50 {
            let mut s = state();
            let n = 1 + rng.below(6) as usize;
            let ids: Vec<String> = (0..n).map(|i| format!("g{i}")).collect();
            let mut pulses = Vec::new();
            let mut events = Vec::new();
            for id in &ids {
                let ((_, pulse), rx) = open(&mut s, id, t);
                pulses.push(pulse);
                events.push(rx);
            }
            let names: Vec<&str> = ids.iter().map(String::as_str).collect();
            form_quorum(&mut s, &names, t);
            let now = t + Duration::from_millis(10_000);
            for (pulse, id) in pulses.iter().zip(&ids) {
                match rng.below(4) {
                    0 => {} // reports no training
                    1 => join_at_step(&mut s, id, 0, now - Duration::from_millis(rng.below(3000))),
                    // Waits since the same instant as another, sometimes.
                    _ => trained(pulse, now, rng.below(9000), 1000 * rng.below(4)),
                }
            }
            let quorum = s.previous.clone().unwrap();
            let watch = s.watch();
            let waits = stall::EarliestWaits::of(&watch, &quorum);
            for (k, id) in quorum.replica_ids().enumerate() {
                assert_eq!(
                    stall::member_due(k, &watch.watched(id), &waits),
                    stall_due_by_every_peer(&s, k),
                    "round {round}, member {id}"
                );
            }
        }
    }

    #[test]
    fn a_broken_stream_evicts_at_once_and_tells_the_other_members() {
        let t = Instant::now();
        let mut s = state();
        let ((a_stream, _), mut a_events) = open(&mut s, "a", t);
        let ((b_stream, b_pulse), _b_events) = open(&mut s, "b", t);
        form_quorum(&mut s, &["a", "b"], t);
        assert_eq!(
            s.close_stream("b", b_stream, Eviction::StreamBroken, t),
            Some(Eviction::StreamBroken)
        );
        assert!(b_pulse.is_retired(), "its stream task must end");
        let event = a_events.try_recv().unwrap().unwrap();
        let Some(proto::lighthouse_event::Event::MembershipLost(lost)) = event.event else {
            panic!("expected a membership loss");
        };
        assert_eq!(lost.lost, ["b"]);
        assert_eq!(lost.cause, "stream_broken");
        assert_eq!(s.live_replicas(), 1);
        // A stale stream id (an old connection closing late) changes nothing.
        assert_eq!(
            s.close_stream("a", a_stream + 100, Eviction::StreamBroken, t),
            None
        );
    }

    #[test]
    fn a_silent_group_expires_after_the_heartbeat_timeout_and_is_forgotten() {
        let t = Instant::now();
        let mut s = state();
        let ((_, a), _ea) = open(&mut s, "a", t);
        let (_b, _eb) = open(&mut s, "b", t);
        assert!(s.expire(t + Duration::from_millis(1900)).is_empty());
        a.beat(t + Duration::from_millis(1900), 1, 0);
        let expired = s.expire(t + Duration::from_millis(2000));
        assert_eq!(expired, [("b".to_string(), Eviction::HeartbeatTimeout)]);
        assert_eq!(s.live_replicas(), 1);
        assert_eq!(s.next_wakeup(t), Some(t + Duration::from_millis(3900)));
    }

    #[test]
    fn a_quorum_request_under_a_live_groups_id_from_another_manager_is_refused_unrecorded() {
        let t = Instant::now();
        let mut s = state();
        let (tx, _rx) = mpsc::channel(4);
        let first = proto::Beat {
            manager_address: "10.0.0.1:7000".into(),
            ..beat("dup")
        };
        let (_, pulse) = s
            .open_stream(&first, "10.0.0.1:5000".into(), tx, t)
            .unwrap();
        let impostor = quorum::Member {
            manager_address: "10.0.0.2:7000".into(),
            ..member("dup")
        };
        let later = t + Duration::from_millis(1500);
        let (reply, _answer) = oneshot::channel();
        let err = s.join(impostor, 0, later, reply).unwrap_err();
        assert_eq!(err.code(), tonic::Code::AlreadyExists);
        assert!(err.message().contains("10.0.0.1:7000"), "{}", err.message());
        assert!(err.message().contains("--replica-id"), "{}", err.message());
        // Not a sign of life of the real group, nor a request to join.
        assert_eq!(pulse.last_beat(), t);
        assert!(s.joiners.is_empty());
        // The real group's own request goes through.
        let real = quorum::Member {
            manager_address: "10.0.0.1:7000".into(),
            ..member("dup")
        };
        let (reply, _answer) = oneshot::channel();
        assert!(s.join(real, 0, later, reply).is_ok());
    }

    #[test]
    fn a_second_live_stream_for_the_same_replica_is_refused_with_the_conflict_named() {
        let t = Instant::now();
        let mut s = state();
        let _a = open(&mut s, "a", t);
        let (tx, _rx) = mpsc::channel(1);
        let err = s
            .open_stream(&beat("a"), "other".into(), tx, t)
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::AlreadyExists);
        assert!(
            err.message().contains("heartbeating from test"),
            "{}",
            err.message()
        );
        // Once the first one is silent past the timeout, a restarted group may take over.
        let (tx, _rx) = mpsc::channel(1);
        assert!(s
            .open_stream(&beat("a"), "new".into(), tx, t + Duration::from_secs(3))
            .is_ok());
    }

    #[test]
    fn a_restarted_lighthouse_continues_above_the_ids_it_hears() {
        let t = Instant::now();
        let mut s = state();
        let mut b = beat("a");
        b.last_quorum_id = 17;
        let (tx, _rx) = mpsc::channel(1);
        s.open_stream(&b, "p".into(), tx, t).unwrap();
        let (reply, mut answer) = oneshot::channel();
        s.join(member("a"), 0, t, reply).unwrap();
        // Having heard of quorum 17, it gives re-connecting groups the join timeout.
        assert!(s.evaluate(t, 0).is_none());
        assert!(s.evaluate(t + Duration::from_secs(1), 0).is_some());
        assert_eq!(decoded(answer.try_recv().unwrap()).quorum_id, 18);
    }

    #[test]
    fn a_request_that_leaves_no_longer_joins() {
        let t = Instant::now();
        let mut s = state();
        let _a = open(&mut s, "a", t);
        let _b = open(&mut s, "b", t);
        let (tx, _rx) = oneshot::channel();
        let ticket = s.join(member("a"), 0, t, tx).unwrap();
        s.leave("a", ticket);
        assert!(s.snapshot(t).replicas.iter().all(|r| !r.joined));
        assert!(s.evaluate(t, 0).is_none());
        assert_eq!(s.waiting_reason(t), WaitReason::NoJoiners);
    }

    fn join_at_step(s: &mut LighthouseState, id: &str, step: i64, now: Instant) {
        let (tx, _rx) = oneshot::channel();
        s.join(quorum::Member { step, ..member(id) }, 0, now, tx)
            .unwrap();
    }

    #[test]
    fn a_groups_commits_are_counted_across_its_restart_and_date_its_last_commit() {
        let t = Instant::now();
        let ms = Duration::from_millis;
        let mut s = state();
        let ((a_stream, _), _ea) = open(&mut s, "a", t);
        let _b = open(&mut s, "b", t);
        let totals = |committed, heals| proto::GroupTally {
            steps_committed: committed,
            heals,
            ..Default::default()
        };
        s.report("a", Some(totals(3, 0)), None, t + ms(100));
        s.report("a", Some(totals(3, 0)), None, t + ms(900));
        let snap = s.snapshot(t + ms(1000));
        let age = |id: &str| {
            let r = snap.replicas.iter().find(|r| r.replica_id == id).unwrap();
            (r.last_commit_age_ms, r.history.tally.steps_committed)
        };
        assert_eq!(
            age("a"),
            (900, 3),
            "a beat with no new commit dates nothing"
        );
        assert_eq!(age("b"), (1000, 0), "counted from when it appeared");
        assert_eq!(snap.last_commit_age_ms, 900);

        // Restarted: its manager server counts from zero; the lighthouse goes on.
        s.close_stream("a", a_stream, Eviction::StreamBroken, t + ms(1100));
        let _a = open(&mut s, "a", t + ms(1500));
        s.report("a", Some(totals(0, 0)), None, t + ms(1500));
        s.report("a", Some(totals(2, 1)), None, t + ms(1600));
        let snap = s.snapshot(t + ms(1600));
        let a = snap.replicas.iter().find(|r| r.replica_id == "a").unwrap();
        assert_eq!(
            (a.history.tally.steps_committed, a.history.tally.heals),
            (5, 1)
        );
        assert_eq!(a.last_commit_age_ms, 0);
    }

    #[test]
    fn a_lost_group_is_shown_with_why_and_its_return_is_counted() {
        let t = Instant::now();
        let mut s = state();
        let _a = open(&mut s, "a", t);
        let ((b_stream, _), _eb) = open(&mut s, "b", t);
        form_quorum(&mut s, &["a", "b"], t);
        let killed = t + Duration::from_secs(1);
        s.close_stream("b", b_stream, Eviction::StreamBroken, killed);

        let snap = s.snapshot(killed + Duration::from_millis(250));
        assert_eq!(snap.replicas.len(), 1);
        let [lost] = &snap.lost[..] else {
            panic!("one lost group expected: {:?}", snap.lost);
        };
        assert_eq!(lost.replica_id, "b");
        assert_eq!(lost.cause, Eviction::StreamBroken);
        assert_eq!(lost.lost_ms_ago, 250);
        assert!(lost.was_member);
        assert_eq!(lost.peer, "test");
        assert_eq!(lost.history.losses.stream_broken, 1);

        // Restarted: live again, no longer lost, its loss and return counted.
        let back = killed + Duration::from_secs(5);
        let (_b, _eb) = open(&mut s, "b", back);
        let snap = s.snapshot(back);
        assert!(snap.lost.is_empty());
        let b = &snap.replicas[1];
        assert_eq!((b.history.losses.stream_broken, b.history.returns), (1, 1));

        // Hung this time: the second loss has its own cause, the history goes on.
        let expired = s.expire(back + Duration::from_secs(2));
        assert_eq!(expired.len(), 2);
        let snap = s.snapshot(back + Duration::from_secs(2));
        let b = snap.lost.iter().find(|l| l.replica_id == "b").unwrap();
        assert_eq!(b.cause, Eviction::HeartbeatTimeout);
        assert_eq!(
            b.history.losses,
            Losses {
                stream_broken: 1,
                heartbeat_timeout: 1,
                progress_stalled: 0,
                left: 0,
            }
        );
        assert_eq!(b.history.returns, 1);
    }

    #[test]
    fn lost_groups_are_kept_for_ten_minutes_and_at_most_32_then_start_afresh() {
        let t = Instant::now();
        let mut s = state();
        for i in 0..40 {
            let id = format!("g{i:02}");
            let ((stream, _), _) = open(&mut s, &id, t);
            s.close_stream(
                &id,
                stream,
                Eviction::StreamBroken,
                t + Duration::from_secs(i),
            );
        }
        let snap = s.snapshot(t + Duration::from_secs(40));
        assert_eq!(snap.lost.len(), LOST_KEPT);
        assert_eq!(snap.lost[0].replica_id, "g39", "most recent first");
        assert_eq!(snap.lost[LOST_KEPT - 1].replica_id, "g08");

        let later = t + Duration::from_secs(39) + LOST_KEPT_FOR + Duration::from_millis(1);
        assert!(s.snapshot(later).lost.is_empty());
        s.sample_steps(later);
        assert!(s.lost.is_empty(), "forgotten, not only hidden");
        // Back after it was forgotten: a new group as far as anyone can tell.
        let _g = open(&mut s, "g39", later);
        assert_eq!(s.snapshot(later).replicas[0].history, History::default());
    }

    #[test]
    fn a_groups_step_rate_is_measured_over_the_samples_of_the_last_half_minute() {
        let t = Instant::now();
        let mut s = state();
        let ((_, a), _ea) = open(&mut s, "a", t);
        form_quorum(&mut s, &["a"], t);
        let at = |ms: u64| t + Duration::from_millis(ms);
        s.sample_steps(at(0));
        a.beat(at(500), 5, 0);
        assert_eq!(s.snapshot(at(500)).replicas[0].step_rate, None, "too soon");
        a.beat(at(2000), 20, 0);
        assert_eq!(s.snapshot(at(2000)).replicas[0].step_rate, Some(10.0));
        // Samples every second or so; a rate from the last 30 s only.
        for second in 1..=40 {
            let step = if second <= 20 {
                second * 10
            } else {
                200 + (second - 20) * 2
            };
            a.beat(at(second * 1000), step as i64, 0);
            s.sample_steps(at(second * 1000));
        }
        let rate = s.snapshot(at(40_000)).replicas[0].step_rate.unwrap();
        assert!(
            (rate - (2.0 * 20.0 + 10.0 * 10.0) / 30.0).abs() < 1e-9,
            "{rate}"
        );
        assert!(s.replicas["a"].steps.kept() <= 32);
    }

    #[test]
    fn a_member_below_the_quorums_max_step_is_healing_until_it_reports_that_step() {
        let t = Instant::now();
        let mut s = state();
        let ((_, a), _ea) = open(&mut s, "a", t);
        let ((_, b), _eb) = open(&mut s, "b", t);
        let ((_, c), _ec) = open(&mut s, "c", t);
        join_at_step(&mut s, "a", 10, t);
        join_at_step(&mut s, "b", 0, t);
        // c, live but not asking, is waited for until the join timeout.
        s.evaluate(t + Duration::from_secs(1), 0)
            .expect("quorum of a and b");
        c.beat(t, 3, 0);
        let healing = |s: &LighthouseState| -> Vec<bool> {
            s.snapshot(t).replicas.iter().map(|r| r.healing).collect()
        };
        assert_eq!(s.snapshot(t).max_step, 10);
        assert_eq!(healing(&s), [false, true, false], "c is no member");
        b.beat(t, 10, 1);
        a.beat(t, 11, 1);
        assert_eq!(healing(&s), [false, false, false]);
    }

    #[test]
    fn a_heals_jump_is_no_speed_the_rate_counts_from_where_it_caught_up() {
        let t = Instant::now();
        let at = |ms: u64| t + Duration::from_millis(ms);
        let mut s = state();
        let ((_, a), _ea) = open(&mut s, "a", t);
        let ((_, b), _eb) = open(&mut s, "b", t);
        join_at_step(&mut s, "a", 1000, t);
        join_at_step(&mut s, "b", 0, t);
        s.evaluate(t, 0).expect("quorum");
        let rate = |s: &LighthouseState, ms| s.snapshot(at(ms)).replicas[1].step_rate;
        for second in 0..3 {
            a.beat(at(second * 1000), 1000 + second as i64, 1);
            b.beat(at(second * 1000), 0, 1);
            s.sample_steps(at(second * 1000));
        }
        assert_eq!(rate(&s, 2000), None, "healing");
        // Healed to 1000, then a step a second.
        for second in 3..6 {
            b.beat(at(second * 1000), 1000 + second as i64 - 3, 1);
            s.sample_steps(at(second * 1000));
        }
        assert_eq!(rate(&s, 5000), Some(1.0));
    }
    fn ask(
        s: &mut LighthouseState,
        id: &str,
        held: Identity,
        now: Instant,
    ) -> oneshot::Receiver<QuorumReply> {
        let (tx, rx) = oneshot::channel();
        let m = quorum::Member {
            lineage: held.lineage,
            step: held.step,
            state_quorum_id: held.state_quorum_id,
            ..member(id)
        };
        s.join(m, 0, now, tx).unwrap();
        rx
    }

    fn at(lineage: u64, step: i64, state_quorum_id: u64) -> Identity {
        Identity {
            lineage,
            step,
            state_quorum_id,
        }
    }

    #[test]
    fn a_stale_group_back_from_a_cut_waits_for_the_holders_that_went_silent() {
        let t = Instant::now();
        let secs = |n: u64| t + Duration::from_secs(n);
        let mut s = state();
        let (_g1, _e1) = open(&mut s, "g1", t);
        let (_g3, _e3) = open(&mut s, "g3", t);
        let q = form_quorum(&mut s, &["g1", "g3"], t);
        // g1 and g3 committed up to step 296 in quorum q, then went silent (their
        // host was cut off); g2 is back with the step it had, 186.
        drop((
            ask(&mut s, "g1", at(0, 296, q.quorum_id), t),
            ask(&mut s, "g3", at(0, 296, q.quorum_id), t),
        ));
        s.evaluate(t, 0);
        assert_eq!(s.expire(secs(3)).len(), 2);
        let mut g2 = ask(&mut s, "g2", at(0, 186, 1), secs(3));
        s.evaluate(secs(3), 0);
        assert!(g2.try_recv().is_err(), "no quorum below the newest state");
        assert!(
            s.waiting_reason(secs(3)).to_string().contains("step 296"),
            "{}",
            s.waiting_reason(secs(3))
        );
        // The wait lasts --rollback-after from when a holder was last seen; then the
        // job goes on from g2's state as a new lineage, announced.
        assert_eq!(s.waiting_until(), Some(t + ROLLBACK_AFTER));
        let mut g2 = ask(&mut s, "g2", at(0, 186, 1), secs(31));
        s.evaluate(secs(31), 0).expect("a quorum");
        let issued = decoded(g2.try_recv().unwrap());
        assert_eq!(issued.lineage, issued.quorum_id);
        assert_eq!(issued.participants[0].lineage, issued.quorum_id);
        let rollback = s.rollbacks().next().unwrap();
        assert_eq!(
            (rollback.from, rollback.steps_lost),
            (at(0, 296, q.quorum_id), 110)
        );
        assert_eq!(s.snapshot(secs(31)).rollbacks.len(), 1);
        assert_eq!(s.newest_state(), Some(at(issued.quorum_id, 186, 1)));
    }

    #[test]
    fn holders_that_crashed_or_were_evicted_as_stalled_are_not_waited_for() {
        let t = Instant::now();
        let mut s = state();
        let ((a_stream, _), _a) = open(&mut s, "a", t);
        let q = form_quorum(&mut s, &["a"], t);
        drop(ask(&mut s, "a", at(0, 401, q.quorum_id), t));
        s.evaluate(t, 0);
        assert_eq!(
            s.close_stream("a", a_stream, Eviction::StreamBroken, t),
            Some(Eviction::StreamBroken)
        );
        // Restarted empty, at once: nothing to wait for, the job goes back loudly.
        let mut a = ask(&mut s, "a", at(0, 0, 0), t);
        s.evaluate(t, 0).expect("a quorum at once");
        let issued = decoded(a.try_recv().unwrap());
        assert_eq!(issued.rolled_back_from.map(|r| r.step), Some(401));
    }

    #[test]
    fn a_quorum_at_the_newest_state_goes_on_while_a_stale_group_heals() {
        let t = Instant::now();
        let mut s = state();
        let q = form_quorum(&mut s, &["g1", "g3"], t);
        let (a, b, c) = (
            ask(&mut s, "g1", at(0, 296, q.quorum_id), t),
            ask(&mut s, "g2", at(0, 186, 1), t),
            ask(&mut s, "g3", at(0, 296, q.quorum_id), t),
        );
        s.evaluate(t, 0).expect("a quorum at once");
        for mut reply in [a, b, c] {
            let issued = decoded(reply.try_recv().unwrap());
            assert_eq!((issued.lineage, issued.rolled_back_from), (0, None));
            assert_eq!(issued.participants.len(), 3);
        }
        assert!(s.rollbacks().next().is_none());
    }
    #[test]
    fn a_group_cut_off_from_a_member_is_left_out_and_told_why_at_once() {
        let t = Instant::now();
        let mut s = state();
        let mut replies = Vec::new();
        for (id, unreachable) in [("g1", vec!["g2"]), ("g2", vec!["g1"]), ("g3", vec![])] {
            let (tx, rx) = oneshot::channel();
            let m = quorum::Member {
                unreachable: unreachable.into_iter().map(String::from).collect(),
                ..member(id)
            };
            s.join(m, 0, t, tx).unwrap();
            replies.push(rx);
        }
        s.evaluate(t, 0)
            .expect("a quorum of the two that reach each other");
        let mut g2 = replies.remove(1);
        let refused = g2.try_recv().unwrap().unwrap_err();
        assert_eq!(refused.code(), tonic::Code::DeadlineExceeded);
        assert!(
            refused.message().contains("\"g1\" could not reach"),
            "{refused:?}"
        );
        for mut reply in replies {
            assert_eq!(decoded(reply.try_recv().unwrap()).participants.len(), 2);
        }
        assert!(
            s.joiners.is_empty(),
            "g2 asks again, with what it can reach by then"
        );
    }
    #[test]
    fn the_same_manager_reopening_its_stream_replaces_the_silent_one() {
        let t = Instant::now();
        let mut s = state();
        let first = proto::Beat {
            manager_address: "10.0.0.2:7000".into(),
            ..beat("g2")
        };
        let (tx, _rx) = mpsc::channel(4);
        s.open_stream(&first, "10.0.0.2:5001".into(), tx, t)
            .unwrap();
        // Within the heartbeat timeout, after a cut: a fresh connection, same group.
        let (tx, _rx2) = mpsc::channel(4);
        let later = t + Duration::from_millis(1500);
        s.open_stream(&first, "10.0.0.2:5002".into(), tx, later)
            .expect("the group's own new stream");
        // Another manager under the same id is still refused.
        let impostor = proto::Beat {
            manager_address: "10.0.0.9:7000".into(),
            ..beat("g2")
        };
        let (tx, _rx3) = mpsc::channel(4);
        let refused = s.open_stream(&impostor, "10.0.0.9:1".into(), tx, later);
        assert_eq!(refused.unwrap_err().code(), tonic::Code::AlreadyExists);
    }
}
