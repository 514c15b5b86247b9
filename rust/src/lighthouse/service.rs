//! The lighthouse's gRPC service and its background deadline task.
//!
//! Event-driven: the engine runs inline on every join, leave and stream break; a
//! background task sleeps until the next deadline (a join timeout or a heartbeat
//! expiry) and is woken only when an earlier one appears. There is no polling tick.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tokio_util::task::AbortOnDropHandle;
use tonic::{Request, Response, Status, Streaming};

use super::history::Eviction;
use super::leadership::quorum_id_floor;
use super::metrics::{Metrics, Via};
use super::pulse::Pulse;
use super::set::Seat;
use super::state::LighthouseState;
use crate::door::Ticket;
use crate::gate::{self, Refusal};
use crate::proto::{self, lighthouse_server::Lighthouse};
use crate::validate;

pub(crate) struct Shared {
    state: Mutex<LighthouseState>,
    pub(crate) metrics: Metrics,
    wake: Notify,
    pub(crate) started: Instant,
    /// A member of the quorum is due for eviction as stalled but no peer waits on it
    /// yet: the first beat that says a peer began to wait wakes the deadline task.
    stall_overdue: AtomicBool,
    /// This lighthouse's place in a set; unset for a lighthouse on its own.
    pub(crate) seat: OnceLock<Arc<Seat>>,
}

fn unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

impl Shared {
    /// What a beat reports besides being alive, if anything: only such a beat (one a
    /// step or so) takes the state lock.
    fn report(&self, replica_id: &str, beat: &proto::Beat) {
        if beat.tally.is_none() && beat.refused.is_empty() {
            return;
        }
        let refused = (!beat.refused.is_empty()).then(|| gate::counts_from_wire(&beat.refused));
        self.lock()
            .report(replica_id, beat.tally, refused, Instant::now());
    }

    pub(crate) fn new(state: LighthouseState) -> Arc<Self> {
        Arc::new(Shared {
            state: Mutex::new(state),
            metrics: Metrics::new(),
            wake: Notify::new(),
            started: Instant::now(),
            stall_overdue: AtomicBool::new(false),
            seat: OnceLock::new(),
        })
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, LighthouseState> {
        // A panic while holding the lock leaves soft state only; carry on with it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether this lighthouse may take requests and issue quorums at `now`: always on
    /// its own; in a set, only while it serves (see `leadership`).
    fn admit(&self, now: Instant) -> Result<(), Status> {
        match self.seat.get() {
            Some(seat) if seat.serving_at(now).is_none() => Err(seat.refusal()),
            _ => Ok(()),
        }
    }

    /// This lighthouse of a set starts (`Some(term)`) or stops serving: its soft state
    /// starts afresh, and a new term's quorum ids start above every earlier term's.
    pub(crate) fn serve_in(&self, term: Option<u64>) {
        let mut st = self.lock();
        let why = match (term, self.seat.get()) {
            (None, Some(seat)) => seat.refusal(),
            _ => Status::unavailable("this lighthouse starts serving afresh; ask again"),
        };
        let now = Instant::now();
        st.reset(why, now);
        if let Some(term) = term {
            st.raise_quorum_floor(quorum_id_floor(term));
            // What the set knows of the job's newest state: never start below it.
            if let Some(newest) = self.seat.get().and_then(|seat| seat.newest()) {
                st.learn_newest(newest, now);
            }
        }
        self.evaluate(&mut st, now);
    }

    /// Runs the engine after a change and makes sure the background task wakes in time.
    fn evaluate(&self, st: &mut LighthouseState, now: Instant) {
        // Only the serving lighthouse of a set decides who is in: stalls and quorums.
        let issued = if self.admit(now).is_ok() {
            let (stalled, overdue) = st.evict_stalled(now);
            for _ in stalled {
                self.evicted(Eviction::ProgressStalled);
            }
            self.stall_overdue.store(overdue, Relaxed);
            st.evaluate(now, unix_ms())
        } else {
            None
        };
        if let Some(issued) = issued {
            self.metrics.quorums_issued.inc();
            self.metrics
                .quorum_wait_seconds
                .observe(issued.waited.as_secs_f64());
            if issued.changed {
                self.metrics.quorum_changes.inc();
            }
            if let Some(steps_lost) = issued.rolled_back {
                self.metrics.rollbacks.inc();
                self.metrics.rollback_steps_lost.inc_by(steps_lost);
            }
            // The other lighthouses of a set hear of it on their next message.
            if let (Some(seat), Some(newest)) = (self.seat.get(), st.newest_state()) {
                seat.learn_newest(newest);
            }
            self.metrics.quorum_id.set(issued.quorum_id as i64);
        }
        self.metrics.live_replicas.set(st.live_replicas() as i64);
        self.schedule(st, st.waiting_until());
        self.schedule(st, Some(now + st.heartbeat_timeout()));
        // A request that just began to wait on a stalled member may have brought its
        // eviction forward, and a new quorum may have left a stalled group out. (Not
        // every group's expiry: that stays the deadline task's, as before.)
        self.schedule(st, st.next_stall(now));
    }

    /// After a quorum request joined: runs the engine, unless the request cannot end
    /// the engine's wait (see `LighthouseState::wait_stands`); then only the
    /// requester's liveness, which the request renewed or began, needs a deadline.
    fn joined(&self, st: &mut LighthouseState, now: Instant) {
        if st.wait_stands(now) {
            self.metrics.live_replicas.set(st.live_replicas() as i64);
            self.schedule(st, Some(now + st.heartbeat_timeout()));
        } else {
            self.evaluate(st, now);
        }
    }

    fn schedule(&self, st: &mut LighthouseState, at: Option<Instant>) {
        if let Some(at) = at {
            if st.ticker_deadline.is_none_or(|d| at < d) {
                st.ticker_deadline = Some(at);
                self.wake.notify_one();
            }
        }
    }

    fn evicted(&self, cause: Eviction) {
        self.metrics.evicted(cause);
    }

    /// Joins `member` to the next quorum and waits for it, up to `timeout`; returns the
    /// encoded quorum. The join is withdrawn if the caller gives up first (drops this).
    async fn quorum_for(
        self: &Arc<Self>,
        member: proto::Member,
        last_quorum_id: u64,
        timeout: Duration,
    ) -> Result<Bytes, Status> {
        self.join(member, last_quorum_id)?.wait(timeout).await
    }

    /// Joins `member` to the next quorum now; the join is withdrawn when the returned
    /// wait is dropped before its quorum came.
    fn join(
        self: &Arc<Self>,
        member: proto::Member,
        last_quorum_id: u64,
    ) -> Result<Joined, Status> {
        let replica_id = member.replica_id.clone();
        let (reply_tx, reply) = oneshot::channel();
        let mut st = self.lock();
        let now = Instant::now();
        self.admit(now)?;
        let ticket = refuse(
            self,
            Refusal::DuplicateReplica,
            st.join(member.into(), last_quorum_id, now, reply_tx),
        )?;
        self.joined(&mut st, now);
        Ok(Joined {
            reply,
            leave: LeaveOnDrop {
                shared: self.clone(),
                replica_id,
                ticket: Some(ticket),
            },
        })
    }

    /// Answers a quorum request that came on `replica_id`'s heartbeat stream, on the
    /// stream's events; dropping the handle withdraws it.
    fn answer_ask(
        self: &Arc<Self>,
        replica_id: &str,
        ask: proto::QuorumAsk,
        last_quorum_id: u64,
        events: mpsc::WeakSender<Result<proto::LighthouseEvent, Status>>,
    ) -> AbortOnDropHandle<()> {
        // Joined before this returns, so the stream's next ask supersedes this one in
        // the order the group sent them.
        let joined = refuse(self, Refusal::Invalid, validate::ask(&ask, replica_id))
            .and_then(|(member, timeout)| Ok((self.join(member, last_quorum_id)?, timeout)));
        self.metrics.quorum_request(Via::Stream).inc();
        AbortOnDropHandle::new(tokio::spawn(async move {
            let answered = match joined {
                Ok((joined, timeout)) => joined.wait(timeout).await,
                Err(status) => Err(status),
            };
            let answer = match answered {
                Ok(quorum) => proto::QuorumAnswer {
                    ask_id: ask.ask_id,
                    quorum,
                    ..Default::default()
                },
                Err(status) => proto::QuorumAnswer {
                    ask_id: ask.ask_id,
                    quorum: Bytes::new(),
                    code: status.code() as i32,
                    message: status.message().to_string(),
                },
            };
            // As a lease: a group whose events queue is full does not read them, and
            // its ask times out on its side.
            if let Some(events) = events.upgrade() {
                let _ = events.try_send(Ok(proto::LighthouseEvent {
                    event: Some(proto::lighthouse_event::Event::Answer(answer)),
                }));
            }
        }))
    }

    /// Expires silent groups and acts on due deadlines until `shutdown` flips.
    pub(crate) async fn run_deadlines(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        loop {
            let next = {
                let mut st = self.lock();
                let now = Instant::now();
                // This task is awake: what it schedules below must not wake it again
                // (a stored permit would make an idle lighthouse spin on a core).
                st.ticker_deadline = Some(now);
                for (_, cause) in st.expire(now) {
                    self.evicted(cause);
                }
                st.sample_steps(now);
                self.evaluate(&mut st, now);
                let next = st.next_wakeup(now);
                st.ticker_deadline = next;
                next
            };
            let sleep = async {
                match next {
                    Some(t) => tokio::time::sleep_until(t.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = sleep => {}
                _ = self.wake.notified() => {}
                _ = shutdown.changed() => {
                    self.lock().shut_down();
                    return;
                }
            }
        }
    }
}

pub(crate) struct LighthouseService {
    pub(crate) shared: Arc<Shared>,
}

/// Withdraws a quorum request whose caller timed out or went away.
struct LeaveOnDrop {
    shared: Arc<Shared>,
    replica_id: String,
    ticket: Option<u64>,
}

impl Drop for LeaveOnDrop {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket {
            let mut st = self.shared.lock();
            st.leave(&self.replica_id, ticket);
            self.shared.evaluate(&mut st, Instant::now());
        }
    }
}

/// A join waiting for its quorum.
struct Joined {
    reply: oneshot::Receiver<super::state::QuorumReply>,
    leave: LeaveOnDrop,
}

impl Joined {
    async fn wait(mut self, timeout: Duration) -> Result<Bytes, Status> {
        let shared = self.leave.shared.clone();
        match tokio::time::timeout(timeout, &mut self.reply).await {
            Ok(Ok(reply)) => {
                self.leave.ticket = None;
                reply
            }
            Ok(Err(_)) => {
                self.leave.ticket = None;
                Err(Status::unavailable("the lighthouse is shutting down"))
            }
            Err(_) => {
                let reason = shared.lock().waiting_reason(Instant::now()).to_string();
                Err(Status::deadline_exceeded(format!(
                    "no quorum within {:.3} s: {reason}",
                    timeout.as_secs_f64()
                )))
            }
        }
    }
}

/// A heartbeat stream's first beat, within the heartbeat timeout and valid: it names
/// the group, so nothing is opened for a stream that sends none.
async fn first_beat(
    shared: &Shared,
    inbound: &mut Streaming<proto::Beat>,
    heartbeat_timeout: Duration,
) -> Result<proto::Beat, Status> {
    let first = match tokio::time::timeout(heartbeat_timeout, inbound.message()).await {
        Ok(Ok(Some(beat))) => beat,
        Ok(Ok(None)) => return Err(Status::invalid_argument("heartbeat stream without a beat")),
        Ok(Err(status)) => return Err(status),
        Err(_) => {
            return Err(Status::deadline_exceeded(
                "no first heartbeat within the heartbeat timeout",
            ))
        }
    };
    let checked = validate::protocol_version(first.protocol_version).and_then(|_| {
        validate::replica_id(&first.replica_id)?;
        validate::beat(&first)
    });
    refuse(shared, Refusal::Invalid, checked)?;
    Ok(first)
}

/// How often an unchanged lease is renewed at most. A group's lease runs from the
/// send time of the beat acknowledged last, so a beat need not be acknowledged when
/// the previous acknowledgement is this recent and named the same quorum: the lease
/// stays at least this much shorter than granted, and each beat not acknowledged saves
/// the lighthouse a frame, a write and its task wakeups (with a beat every 100 ms, two
/// in three go unacknowledged: 25.7 and 22.1 µs of lighthouse CPU per beat before,
/// 17.5 and 18.5 after, 2,000 groups on a connection each). Well
/// under the second of silence after which a group gives up its stream
/// (`manager::heartbeat`), so acknowledgements alone keep it open.
const RENEW_EVERY: Duration = Duration::from_millis(250);

/// Whether a beat at `now` is acknowledged with a lease of `quorum_id`, the last
/// acknowledgement having gone out at `last` (when, of which quorum): always the first
/// and a new quorum's; else once `RENEW_EVERY` (at most an eighth of the lease) passed.
fn renewal_due(last: Option<(Instant, u64)>, quorum_id: u64, lease_ms: u64, now: Instant) -> bool {
    let every = RENEW_EVERY.min(Duration::from_millis(lease_ms / 8));
    last.is_none_or(|(at, q)| q != quorum_id || now >= at + every)
}

/// Where a heartbeat stream's acknowledgements go: its response stream, held weakly
/// (see `heartbeat`).
struct Acks {
    events: mpsc::WeakSender<Result<proto::LighthouseEvent, Status>>,
    lease_ms: u64,
    /// When the last acknowledgement went out, and of which quorum's lease.
    last: Option<(Instant, u64)>,
}

impl Acks {
    /// Acknowledges beat `seq` with a lease of `quorum_id`, unless the last one is
    /// recent and of the same quorum (a new quorum's lease goes out at once); false
    /// once the stream is gone. A full queue means the group is not reading; it holds
    /// no lease then.
    fn send(&mut self, seq: u64, quorum_id: u64, now: Instant) -> bool {
        let Some(events) = self.events.upgrade() else {
            return false;
        };
        if renewal_due(self.last, quorum_id, self.lease_ms, now)
            && events
                .try_send(lease(seq, quorum_id, self.lease_ms))
                .is_ok()
        {
            self.last = Some((now, quorum_id));
        }
        true
    }
}

/// A heartbeat stream after its first beat.
struct BeatTask {
    shared: Arc<Shared>,
    inbound: Streaming<proto::Beat>,
    pulse: Arc<Pulse>,
    replica_id: String,
    stream_id: u64,
    acks: Acks,
    /// The stream's quorum request still waiting, if any; withdrawn with the stream.
    _asking: Option<AbortOnDropHandle<()>>,
}

impl BeatTask {
    /// Ends when the group's side closes or breaks, or at its first beat once it was
    /// evicted or the lighthouse stopped (both retire the pulse, and the stream's
    /// response ends with this task).
    async fn run(mut self) {
        loop {
            match self.inbound.message().await {
                Ok(Some(beat)) if beat.leaving => return self.closed(Eviction::Left),
                Ok(Some(beat)) => {
                    if !self.beat(beat) {
                        return;
                    }
                }
                Ok(None) | Err(_) => return self.closed(Eviction::StreamBroken),
            }
        }
    }

    /// The hot path: no lock, a few atomic operations and one ack. False: the stream
    /// ends.
    fn beat(&mut self, mut beat: proto::Beat) -> bool {
        if validate::beat(&beat).is_err()
            || !self
                .pulse
                .beat(Instant::now(), beat.step, beat.last_quorum_id)
        {
            return false;
        }
        let ask = beat.ask.take();
        // An ask on its own (seq 0) is a sign of life that reports nothing else; its
        // answer acknowledges it.
        if beat.seq != 0 || ask.is_none() {
            self.shared.metrics.heartbeats.inc();
            if !self
                .acks
                .send(beat.seq, self.pulse.lease_quorum(), Instant::now())
            {
                return false;
            }
            if self.pulse.trained(Instant::now(), &beat) && self.shared.stall_overdue.load(Relaxed)
            {
                self.shared.wake.notify_one();
            }
            self.shared.report(&self.replica_id, &beat);
        }
        if let Some(ask) = ask {
            self._asking = Some(self.shared.answer_ask(
                &self.replica_id,
                ask,
                beat.last_quorum_id,
                self.acks.events.clone(),
            ));
        }
        true
    }

    /// The group's side closed or broke (it is dead), or it said it is leaving.
    fn closed(&self, cause: Eviction) {
        let shared = &self.shared;
        let mut st = shared.lock();
        let now = Instant::now();
        if let Some(cause) = st.close_stream(&self.replica_id, self.stream_id, cause, now) {
            shared.evicted(cause);
            let what = match cause {
                Eviction::Left => "replica group left: it ended its run",
                _ => "heartbeat stream closed: replica group is dead",
            };
            tracing::info!(replica_id = self.replica_id, "{what}");
        }
        shared.evaluate(&mut st, Instant::now());
    }
}

/// The acknowledgement of beat `seq` (see `proto::Lease`).
fn lease(seq: u64, quorum_id: u64, lease_ms: u64) -> Result<proto::LighthouseEvent, Status> {
    Ok(proto::LighthouseEvent {
        event: Some(proto::lighthouse_event::Event::Lease(proto::Lease {
            seq,
            quorum_id,
            lease_ms,
        })),
    })
}

type EventStream = Pin<Box<dyn Stream<Item = Result<proto::LighthouseEvent, Status>> + Send>>;

fn refuse<T>(shared: &Shared, reason: Refusal, r: Result<T, Status>) -> Result<T, Status> {
    if r.is_err() {
        shared.metrics.refusals.count(reason);
    }
    r
}

#[tonic::async_trait]
impl Lighthouse for LighthouseService {
    async fn quorum(
        &self,
        request: Request<proto::LighthouseQuorumRequest>,
    ) -> Result<Response<proto::LighthouseQuorumResponse>, Status> {
        self.shared.metrics.quorum_request(Via::Call).inc();
        let req = request.into_inner();
        let checked = validate::protocol_version(req.protocol_version).and_then(|_| {
            let member = req
                .requester
                .ok_or_else(|| Status::invalid_argument("quorum request without a requester"))?;
            validate::member(&member)?;
            validate::quorum_id("last_quorum_id", req.last_quorum_id)?;
            Ok((member, validate::timeout_ms(req.timeout_ms)?))
        });
        let (member, timeout) = refuse(&self.shared, Refusal::Invalid, checked)?;
        let quorum = self
            .shared
            .quorum_for(member, req.last_quorum_id, timeout)
            .await?;
        Ok(Response::new(proto::LighthouseQuorumResponse { quorum }))
    }

    type HeartbeatStream = EventStream;

    /// A group's heartbeat stream: its first beat names the group and opens the stream
    /// in the state (see `first_beat`); a task of its own takes the beats that follow
    /// (see `BeatTask`).
    async fn heartbeat(
        &self,
        request: Request<Streaming<proto::Beat>>,
    ) -> Result<Response<Self::HeartbeatStream>, Status> {
        let peer = request
            .extensions()
            .get::<Ticket>()
            .map_or_else(|| "unknown".to_string(), |t| t.peer().to_string());
        let mut inbound = request.into_inner();
        let heartbeat_timeout = self.shared.lock().heartbeat_timeout();
        let first = first_beat(&self.shared, &mut inbound, heartbeat_timeout).await?;

        let (events_tx, events_rx) = mpsc::channel(16);
        // Weak: the state holds the stream's one strong sender, so that evicting the
        // group ends its response stream at once, beats or no beats.
        let mut acks = Acks {
            events: events_tx.downgrade(),
            lease_ms: heartbeat_timeout.as_millis() as u64,
            last: None,
        };
        let (stream_id, pulse) = {
            let mut st = self.shared.lock();
            let now = Instant::now();
            self.shared.admit(now)?;
            let opened = refuse(
                &self.shared,
                Refusal::DuplicateReplica,
                st.open_stream(&first, peer, events_tx, now),
            )?;
            self.shared.evaluate(&mut st, now);
            opened
        };
        self.shared.metrics.heartbeats.inc();
        acks.send(first.seq, pulse.lease_quorum(), Instant::now());
        pulse.trained(Instant::now(), &first);
        self.shared.report(&first.replica_id, &first);
        let replica_id = first.replica_id.clone();
        let asking = first.ask.map(|ask| {
            self.shared
                .answer_ask(&replica_id, ask, first.last_quorum_id, acks.events.clone())
        });
        let task = BeatTask {
            shared: self.shared.clone(),
            inbound,
            pulse,
            replica_id,
            stream_id,
            acks,
            _asking: asking,
        };
        tokio::spawn(task.run());
        Ok(Response::new(Box::pin(ReceiverStream::new(events_rx))))
    }

    async fn status(
        &self,
        _request: Request<proto::StatusRequest>,
    ) -> Result<Response<proto::StatusResponse>, Status> {
        let snap = self.shared.lock().snapshot(Instant::now());
        Ok(Response::new(proto::StatusResponse {
            quorum_id: snap.quorum_id,
            quorum_members: snap.quorum_members,
            replicas: snap
                .replicas
                .into_iter()
                .map(|r| proto::ReplicaStatus {
                    replica_id: r.replica_id,
                    connected: r.connected,
                    joined: r.joined,
                    in_quorum: r.in_quorum,
                    step: r.step,
                    heartbeat_age_ms: r.heartbeat_age_ms,
                    peer: r.peer,
                    progress_age_ms: r.progress_age_ms.unwrap_or_default(),
                    step_time_ms: r.step_time_ms.unwrap_or_default(),
                    straggler: r.straggler,
                })
                .collect(),
            waiting_for: snap.waiting_for,
            quorums_issued: snap.quorums_issued,
            uptime_ms: self.shared.started.elapsed().as_millis() as u64,
            min_replicas: snap.min_replicas,
            join_timeout_ms: snap.join_timeout_ms,
            heartbeat_timeout_ms: snap.heartbeat_timeout_ms,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unchanged_lease_is_renewed_every_250ms_a_new_quorums_at_once() {
        let t = Instant::now();
        let ms = Duration::from_millis;
        // The first beat of a stream, then the same quorum's lease moments later.
        assert!(renewal_due(None, 4, 2000, t));
        assert!(!renewal_due(Some((t, 4)), 4, 2000, t + ms(100)));
        assert!(renewal_due(Some((t, 4)), 4, 2000, t + ms(250)));
        // A new quorum is granted with the first beat that can carry it.
        assert!(renewal_due(Some((t, 4)), 5, 2000, t + ms(1)));
        // A short lease is renewed within an eighth of it.
        assert!(!renewal_due(Some((t, 4)), 4, 400, t + ms(40)));
        assert!(renewal_due(Some((t, 4)), 4, 400, t + ms(50)));
    }
}
