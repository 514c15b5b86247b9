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

use super::pulse::Pulse;
use crate::proto;
use crate::quorum::{
    self, Decision, Joiner, LiveSet, Quorum, QuorumConfig, QuorumId, ReplicaId, WaitReason,
};

/// Why a replica group was declared dead.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Eviction {
    /// Its heartbeat stream dropped: the process died or its connection was reset.
    StreamBroken,
    /// Connected but silent for longer than the heartbeat timeout: hung.
    HeartbeatTimeout,
}

impl Eviction {
    pub const ALL: [Eviction; 2] = [Eviction::StreamBroken, Eviction::HeartbeatTimeout];

    pub fn as_str(self) -> &'static str {
        match self {
            Eviction::StreamBroken => "stream_broken",
            Eviction::HeartbeatTimeout => "heartbeat_timeout",
        }
    }
}

/// The answer a waiting quorum request gets: the quorum, encoded once for everyone.
pub type QuorumReply = Result<Bytes, Status>;

/// The lighthouse end of a group's heartbeat stream.
struct HeartbeatStream {
    id: u64,
    events: mpsc::Sender<Result<proto::LighthouseEvent, Status>>,
    peer: String,
    /// The group's manager server, as its first beat named it (empty: not named).
    manager_address: String,
}

struct Replica {
    pulse: Arc<Pulse>,
    stream: Option<HeartbeatStream>,
}

struct PendingJoin {
    ticket: u64,
    reply: oneshot::Sender<QuorumReply>,
}

/// A quorum just issued, for the server to record in its metrics.
pub struct Issued {
    pub quorum_id: QuorumId,
    pub changed: bool,
    pub waited: Duration,
}

pub struct LighthouseState {
    config: QuorumConfig,
    heartbeat_timeout: Duration,
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
    next_ticket: u64,
    waiting: (WaitReason, Option<Instant>),
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

impl LighthouseState {
    pub fn new(config: QuorumConfig, heartbeat_timeout: Duration) -> Self {
        LighthouseState {
            config,
            heartbeat_timeout,
            replicas: HashMap::new(),
            joiners: BTreeMap::new(),
            pending: HashMap::new(),
            previous: None,
            previous_at: None,
            heard: Arc::new(AtomicU64::new(0)),
            epoch: Instant::now(),
            quorums_issued: 0,
            next_ticket: 0,
            waiting: (WaitReason::NoJoiners, None),
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
        if let Some(old) = self.pending.remove(&id) {
            let _ = old.reply.send(Err(Status::aborted(
                "superseded by a newer quorum request from the same replica group",
            )));
        }
        self.next_ticket += 1;
        let ticket = self.next_ticket;
        self.pending
            .insert(id.clone(), PendingJoin { ticket, reply });
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
                self.replicas.insert(
                    replica_id.to_string(),
                    Replica {
                        pulse,
                        stream: None,
                    },
                );
            }
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
        if let Some(HeartbeatStream { peer: other, .. }) = self.live_stream(id, now) {
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
            self.evict(id, Eviction::HeartbeatTimeout);
        }
        // A fresh pulse: a stale stream of the same group, should it wake up, beats
        // into its own retired one and ends. A group known so far only from its quorum
        // requests keeps the quorum it is a member of.
        let pulse = self.new_pulse(now, beat.step);
        pulse.beat(now, beat.step, beat.last_quorum_id);
        if let Some(known) = self.replicas.get(id) {
            pulse.set_lease_quorum(known.pulse.lease_quorum());
        }
        self.next_ticket += 1;
        let stream_id = self.next_ticket;
        let replaced = self.replicas.insert(
            id.clone(),
            Replica {
                pulse: pulse.clone(),
                stream: Some(HeartbeatStream {
                    id: stream_id,
                    events,
                    peer,
                    manager_address: beat.manager_address.clone(),
                }),
            },
        );
        if let Some(old) = replaced {
            old.pulse.retire();
        }
        Ok((stream_id, pulse))
    }

    /// The stream dropped: the group is dead now, not after a timeout.
    pub fn close_stream(&mut self, replica_id: &str, stream_id: u64) -> Option<Eviction> {
        let ours = self
            .replicas
            .get(replica_id)
            .and_then(|r| r.stream.as_ref())
            .is_some_and(|s| s.id == stream_id);
        if !ours {
            return None;
        }
        self.evict(replica_id, Eviction::StreamBroken);
        Some(Eviction::StreamBroken)
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
            self.evict(id, Eviction::HeartbeatTimeout);
        }
        stale
            .into_iter()
            .map(|id| (id, Eviction::HeartbeatTimeout))
            .collect()
    }

    /// Forgets a dead group (nothing of it stays in memory), answers its pending
    /// request, and tells the other members of the current quorum at once.
    fn evict(&mut self, replica_id: &str, cause: Eviction) {
        if let Some(r) = self.replicas.remove(replica_id) {
            r.pulse.retire();
        }
        self.joiners.remove(replica_id);
        if let Some(p) = self.pending.remove(replica_id) {
            let _ = p.reply.send(Err(Status::unavailable(format!(
                "replica group {replica_id:?} was declared dead ({}) while waiting for a quorum",
                cause.as_str()
            ))));
        }
        let Some(current) = &self.previous else {
            return;
        };
        if !current.contains(replica_id) {
            return;
        }
        let event = proto::LighthouseEvent {
            event: Some(proto::lighthouse_event::Event::MembershipLost(
                proto::MembershipLost {
                    quorum_id: current.id,
                    lost: vec![replica_id.to_string()],
                    cause: cause.as_str().to_string(),
                },
            )),
        };
        for peer in current.replica_ids() {
            if let Some(stream) = self.replicas.get(peer).and_then(|r| r.stream.as_ref()) {
                // A full queue means the peer is not reading; it will learn from its next quorum.
                let _ = stream.events.try_send(Ok(event.clone()));
            }
        }
    }

    /// The lighthouse is stopping: fails every waiting request and ends every heartbeat
    /// stream now, so that groups re-connect (to a successor) instead of staying
    /// attached to a server that is gone.
    pub fn shut_down(&mut self) {
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
            config: &self.config,
            now,
        })
    }

    /// Runs the engine; on a quorum, answers every member's pending request.
    pub fn evaluate(&mut self, now: Instant, unix_ms: i64) -> Option<Issued> {
        let quorum = match self.decide(now) {
            Decision::Wait { until, reason } => {
                self.waiting = (reason, until);
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
        let reply = Bytes::from(
            proto::Quorum {
                quorum_id: quorum.id,
                participants: quorum.members.iter().cloned().map(Into::into).collect(),
                issued_at_unix_ms: unix_ms,
            }
            .encode_to_vec(),
        );
        for id in quorum.replica_ids() {
            self.joiners.remove(id);
            if let Some(p) = self.pending.remove(id) {
                let _ = p.reply.send(Ok(reply.clone()));
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
        };
        self.previous = Some(quorum);
        self.previous_at = Some(now);
        // Whoever is left (kept out by shrink_only) starts the next round now.
        for j in self.joiners.values_mut() {
            j.joined_at = now;
        }
        self.waiting = match self.decide(now) {
            Decision::Wait { until, reason } => (reason, until),
            Decision::Issue(_) => (WaitReason::NoJoiners, Some(now)),
        };
        Some(issued)
    }

    /// When the background task must look again: the engine's deadline or the next
    /// heartbeat expiry, whichever is first.
    pub fn next_wakeup(&self) -> Option<Instant> {
        let expiry = self
            .replicas
            .values()
            .map(|r| r.pulse.last_beat() + self.heartbeat_timeout)
            .min();
        match (self.waiting.1, expiry) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    pub fn waiting_until(&self) -> Option<Instant> {
        self.waiting.1
    }

    pub fn heartbeat_timeout(&self) -> Duration {
        self.heartbeat_timeout
    }

    pub fn waiting_reason(&self) -> &WaitReason {
        &self.waiting.0
    }

    pub fn live_replicas(&self) -> usize {
        self.replicas.len()
    }

    pub fn current_quorum(&self) -> Option<&Quorum> {
        self.previous.as_ref()
    }

    pub fn snapshot(&self, now: Instant) -> Snapshot {
        let mut replicas: Vec<ReplicaSnapshot> = self
            .replicas
            .iter()
            .map(|(id, r)| ReplicaSnapshot {
                replica_id: id.clone(),
                connected: r.stream.is_some(),
                joined: self.joiners.contains_key(id),
                in_quorum: self.previous.as_ref().is_some_and(|q| q.contains(id)),
                step: r.pulse.step(),
                heartbeat_age_ms: now
                    .saturating_duration_since(r.pulse.last_beat())
                    .as_millis() as u64,
                peer: r
                    .stream
                    .as_ref()
                    .map(|s| s.peer.clone())
                    .unwrap_or_default(),
            })
            .collect();
        replicas.sort_by(|a, b| a.replica_id.cmp(&b.replica_id));
        Snapshot {
            quorum_id: self.previous.as_ref().map_or(0, |q| q.id),
            quorum_members: self
                .previous
                .as_ref()
                .map(|q| q.replica_ids().map(str::to_string).collect())
                .unwrap_or_default(),
            replicas,
            waiting_for: if self.joiners.is_empty() {
                String::new()
            } else {
                self.waiting.0.to_string()
            },
            quorums_issued: self.quorums_issued,
            min_replicas: self.config.min_replicas as u32,
            join_timeout_ms: self.config.join_timeout.as_millis() as u64,
            heartbeat_timeout_ms: self.heartbeat_timeout.as_millis() as u64,
        }
    }
}

/// The lighthouse as the status page, `/status` and the `Status` RPC show it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Snapshot {
    pub quorum_id: QuorumId,
    pub quorum_members: Vec<ReplicaId>,
    pub replicas: Vec<ReplicaSnapshot>,
    /// Why the next quorum is not issued yet; empty when nobody is waiting.
    pub waiting_for: String,
    pub quorums_issued: u64,
    pub min_replicas: u32,
    pub join_timeout_ms: u64,
    pub heartbeat_timeout_ms: u64,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct ReplicaSnapshot {
    pub replica_id: ReplicaId,
    pub connected: bool,
    pub joined: bool,
    pub in_quorum: bool,
    pub step: i64,
    pub heartbeat_age_ms: u64,
    pub peer: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> LighthouseState {
        LighthouseState::new(
            QuorumConfig {
                min_replicas: 1,
                join_timeout: Duration::from_secs(1),
            },
            Duration::from_secs(2),
        )
    }

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
        proto::Quorum::decode(reply.unwrap()).unwrap()
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

    #[test]
    fn a_broken_stream_evicts_at_once_and_tells_the_other_members() {
        let t = Instant::now();
        let mut s = state();
        let ((a_stream, _), mut a_events) = open(&mut s, "a", t);
        let ((b_stream, b_pulse), _b_events) = open(&mut s, "b", t);
        form_quorum(&mut s, &["a", "b"], t);
        assert_eq!(s.close_stream("b", b_stream), Some(Eviction::StreamBroken));
        assert!(b_pulse.is_retired(), "its stream task must end");
        let event = a_events.try_recv().unwrap().unwrap();
        let Some(proto::lighthouse_event::Event::MembershipLost(lost)) = event.event else {
            panic!("expected a membership loss");
        };
        assert_eq!(lost.lost, ["b"]);
        assert_eq!(lost.cause, "stream_broken");
        assert_eq!(s.live_replicas(), 1);
        // A stale stream id (an old connection closing late) changes nothing.
        assert_eq!(s.close_stream("a", a_stream + 100), None);
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
        assert_eq!(s.next_wakeup(), Some(t + Duration::from_millis(3900)));
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
        assert_eq!(s.waiting_reason(), &WaitReason::NoJoiners);
    }
}
