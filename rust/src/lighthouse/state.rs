//! What the lighthouse knows: which replica groups are alive, who waits for the next
//! quorum, and the last quorum issued. Soft state only — a restarted lighthouse
//! rebuilds all of it from the groups that reconnect.
//!
//! Every method takes `now`, so the transitions are tested without sockets or sleeps.
//! The server (`site.rs`) holds this behind one mutex and never awaits inside it.
//!
//! Here: the state, what its two halves share, and the status it shows (`snapshot`).
//! The groups' liveness (their heartbeat streams, their expiry and their stalls) is
//! `liveness.rs`; the quorum round (from a join to the quorum issued) is `round.rs`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use super::history::{
    stepping, History, LostGroups, Rollbacks, StepSamples, LOST_KEPT, LOST_KEPT_FOR,
};
use super::newest::NewestState;
use super::pulse::Pulse;
use super::snapshot::{mark_stragglers, ms_since, LostSnapshot, ReplicaSnapshot, Snapshot};
use super::stall::Stalls;
use crate::delta::Answer;
use crate::gate::RefusalCounts;
use crate::proto;
use crate::quorum::{Joiner, Quorum, QuorumConfig, QuorumId, ReplicaId, WaitReason};

mod liveness;
mod round;

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

    fn set_waiting(&mut self, reason: WaitReason, until: Option<Instant>) {
        self.waiting = (reason, until);
        self.waiting_stale = false;
        self.late_cursor = 0;
        self.engine_due = false;
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

    pub fn heartbeat_timeout(&self) -> Duration {
        self.heartbeat_timeout
    }

    pub fn live_replicas(&self) -> usize {
        self.replicas.len()
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
