//! What a lighthouse serves: its jobs (`Site`), and each job's core (`Shared`): its
//! state behind a lock, its metrics, the join and leave of a quorum request, and its
//! deadline task. Every way in reaches a job through here: the gRPC service
//! (`service`), the heartbeat streams whatever carries them (`heartbeat`, `wire`), and
//! their beats however they come (`beats`, `datagrams`).
//!
//! Event-driven: the engine runs inline on every join, leave and stream break; a
//! background task sleeps until the next deadline (a join timeout or a heartbeat
//! expiry) and is woken only when an earlier one appears. There is no polling tick.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio_util::task::AbortOnDropHandle;
use tonic::Status;

use super::history::Eviction;
use super::jobs::{judge_idle, Idle, JobName, JobRequest, Tuning};
use super::leadership::quorum_id_floor;
use super::metrics::{Metrics, SiteMetrics, Via};
use super::set::Seat;
use super::state::LighthouseState;
use crate::delta::Answer;
use crate::gate::{self, Refusal, Refusals};
use crate::proto;
use crate::quorum::QuorumConfig;
use crate::validate;

/// Requests to the lighthouse are small; anything bigger is refused unread.
pub(super) const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// Everything a lighthouse serves: its jobs, each with a `Shared` of its own, so that
/// one job's requests never wait on another's lock or deadlines.
pub(crate) struct Site {
    jobs: Mutex<HashMap<JobName, Arc<Shared>>>,
    /// The rules of the default job, and of every job for the rules it leaves out.
    pub(crate) defaults: Tuning,
    limits: JobLimits,
    pub(crate) metrics: SiteMetrics,
    pub(crate) started: Instant,
    /// This lighthouse's place in a set; unset for a lighthouse on its own.
    pub(crate) seat: Arc<OnceLock<Arc<Seat>>>,
    shutdown: watch::Receiver<bool>,
}

/// How many jobs a lighthouse serves at once, and when it forgets one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JobLimits {
    /// Jobs served at once, the default job included; a new one past it is refused.
    pub max_jobs: usize,
    /// A job no group has used for this long is forgotten (the default job never is).
    pub forget_after: Duration,
}

impl JobLimits {
    pub const DEFAULT: JobLimits = JobLimits {
        max_jobs: 1000,
        forget_after: Duration::from_secs(600),
    };
}

/// References to a job's `Shared` that do not mean a group uses it: the site's and
/// its deadline task's. Every stream, join and call holds one more while it lasts.
const HELD_WHEN_UNUSED: usize = 2;

impl Site {
    pub(crate) fn new(
        defaults: Tuning,
        limits: JobLimits,
        shutdown: watch::Receiver<bool>,
    ) -> Arc<Self> {
        let site = Arc::new(Site {
            jobs: Mutex::new(HashMap::new()),
            defaults,
            limits,
            metrics: SiteMetrics::new(),
            started: Instant::now(),
            seat: Arc::new(OnceLock::new()),
            shutdown,
        });
        site.job(&JobRequest::default())
            .expect("the default job's rules are the lighthouse's");
        site
    }

    fn jobs(&self) -> MutexGuard<'_, HashMap<JobName, Arc<Shared>>> {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The job a request is for, made with the rules it declares if it is new; a
    /// request whose rules disagree with its job's, or for a new job past
    /// `--max-jobs`, is refused.
    pub(crate) fn job(&self, request: &JobRequest) -> Result<Arc<Shared>, Status> {
        let mut jobs = self.jobs();
        if let Some(shared) = jobs.get(&request.job) {
            let agreed = request.rules.agree_with(&request.job, &shared.rules);
            return refuse(&self.metrics.refusals, Refusal::Invalid, agreed)
                .map(|_| shared.clone());
        }
        if jobs.len() >= self.limits.max_jobs {
            self.metrics.refusals.count(Refusal::Jobs);
            return Err(Status::resource_exhausted(format!(
                "the lighthouse serves its most jobs ({}, --max-jobs); job {} cannot start \
                 until one ends (a job is forgotten {} s after its last group), or give the \
                 lighthouse a higher --max-jobs",
                self.limits.max_jobs,
                request.job,
                self.limits.forget_after.as_secs()
            )));
        }
        let rules = if request.job.is_default() {
            request.rules.agree_with(&request.job, &self.defaults)?;
            self.defaults
        } else {
            let made = request.rules.over(&self.defaults);
            refuse(&self.metrics.refusals, Refusal::Invalid, made)?
        };
        let shared = Shared::new(
            request.job.clone(),
            rules,
            self.metrics.refusals.clone(),
            self.seat.clone(),
        );
        tokio::spawn(shared.clone().run_deadlines(self.shutdown.clone()));
        // A job that starts while this lighthouse of a set serves starts above the
        // term's floor and at what the set knows of its newest state.
        let term = self.seat.get().and_then(|seat| *seat.serving.borrow());
        if term.is_some() {
            shared.serve_in(term);
        }
        jobs.insert(request.job.clone(), shared.clone());
        self.metrics.jobs.set(jobs.len() as i64);
        if !request.job.is_default() {
            tracing::info!(job = %request.job, rules = %request.rules, "a new job");
        }
        Ok(shared)
    }

    /// The job named `job`, if this lighthouse serves it.
    pub(crate) fn find(&self, job: &JobName) -> Option<Arc<Shared>> {
        self.jobs().get(job).cloned()
    }

    /// Every job served, by name.
    pub(crate) fn all(&self) -> Vec<Arc<Shared>> {
        let mut all: Vec<Arc<Shared>> = self.jobs().values().cloned().collect();
        all.sort_by(|a, b| a.job.cmp(&b.job));
        all
    }

    /// This lighthouse of a set starts or stops serving: every job starts afresh.
    pub(crate) fn serve_in(&self, term: Option<u64>) {
        for shared in self.jobs().values() {
            shared.serve_in(term);
        }
    }

    /// Forgets the jobs no group has used for `forget_after`, until `shutdown`.
    pub(crate) async fn forget_idle_jobs(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let every =
            (self.limits.forget_after / 4).clamp(Duration::from_millis(10), Duration::from_secs(5));
        loop {
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = shutdown.changed() => return,
            }
            self.forget_idle(Instant::now());
        }
    }

    fn forget_idle(&self, now: Instant) {
        let mut jobs = self.jobs();
        let before = jobs.len();
        jobs.retain(|name, shared| {
            // Nothing else holds the job while this holds the map: no request can
            // take it up between the count and its removal.
            let unused =
                Arc::strong_count(shared) <= HELD_WHEN_UNUSED && shared.lock().live_replicas() == 0;
            let mut since = shared.idle_since.lock().unwrap_or_else(|e| e.into_inner());
            match judge_idle(name, unused, *since, self.limits.forget_after, now) {
                Idle::InUse => *since = None,
                Idle::Since(at) => *since = Some(at),
                Idle::Forget => {
                    shared.retire.notify_one();
                    tracing::info!(job = %name, "job forgotten: no group used it");
                    return false;
                }
            }
            true
        });
        let forgotten = before - jobs.len();
        if forgotten > 0 {
            self.metrics.jobs_forgotten.inc_by(forgotten as u64);
            self.metrics.jobs.set(jobs.len() as i64);
        }
    }
}

/// One job's lighthouse: its state, its metrics and its deadline task.
pub(crate) struct Shared {
    pub(crate) job: JobName,
    /// The job's quorum rules, as it was made with them.
    pub(crate) rules: Tuning,
    state: Mutex<LighthouseState>,
    pub(crate) metrics: Metrics,
    /// The lighthouse's refusals (see `SiteMetrics`).
    pub(super) refusals: Refusals,
    pub(super) wake: Notify,
    /// A member of the quorum is due for eviction as stalled but no peer waits on it
    /// yet: the first beat that says a peer began to wait wakes the deadline task.
    pub(super) stall_overdue: AtomicBool,
    /// This lighthouse's place in a set; unset for a lighthouse on its own.
    pub(crate) seat: Arc<OnceLock<Arc<Seat>>>,
    /// Since when no group has used the job (see `Site::forget_idle`).
    idle_since: Mutex<Option<Instant>>,
    /// Ends the deadline task of a job forgotten.
    retire: Notify,
}

fn unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

impl Shared {
    /// What a beat reports besides being alive, if anything: only such a beat (one a
    /// step or so) takes the state lock.
    pub(super) fn report(&self, replica_id: &str, beat: &proto::Beat) {
        if beat.tally.is_none() && beat.refused.is_empty() {
            return;
        }
        let refused = (!beat.refused.is_empty()).then(|| gate::counts_from_wire(&beat.refused));
        self.lock()
            .report(replica_id, beat.tally, refused, Instant::now());
    }

    fn new(
        job: JobName,
        rules: Tuning,
        refusals: Refusals,
        seat: Arc<OnceLock<Arc<Seat>>>,
    ) -> Arc<Self> {
        let state = LighthouseState::new(
            QuorumConfig {
                min_replicas: rules.min_replicas,
                join_timeout: rules.join_timeout,
            },
            rules.heartbeat_timeout,
            rules.rollback_after,
        );
        Arc::new(Shared {
            metrics: Metrics::for_job(&job),
            job,
            rules,
            state: Mutex::new(state),
            refusals,
            wake: Notify::new(),
            stall_overdue: AtomicBool::new(false),
            seat,
            idle_since: Mutex::new(None),
            retire: Notify::new(),
        })
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, LighthouseState> {
        // A panic while holding the lock leaves soft state only; carry on with it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether this lighthouse may take requests and issue quorums at `now`: always on
    /// its own; in a set, only while it serves (see `leadership`).
    pub(super) fn admit(&self, now: Instant) -> Result<(), Status> {
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
            if let Some(newest) = self.seat.get().and_then(|seat| seat.newest(&self.job)) {
                st.learn_newest(newest, now);
            }
        }
        self.evaluate(&mut st, now);
    }

    /// Runs the engine after a change and makes sure the background task wakes in time.
    pub(super) fn evaluate(&self, st: &mut LighthouseState, now: Instant) {
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
                seat.learn_newest(&self.job, newest);
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

    /// After a heartbeat stream opened: runs the engine, unless its decision stands
    /// (see `LighthouseState::decision_stands`); then only the new group's liveness
    /// and its own stall time need a deadline.
    pub(super) fn opened(&self, st: &mut LighthouseState, replica_id: &str, now: Instant) {
        if st.decision_stands(now) {
            self.metrics.live_replicas.set(st.live_replicas() as i64);
            self.schedule(st, Some(now + st.heartbeat_timeout()));
            self.schedule(st, st.stall_of(replica_id, now));
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

    pub(super) fn evicted(&self, cause: Eviction) {
        self.metrics.evicted(cause);
    }

    /// Joins `member` to the next quorum and waits for it, up to `timeout`; returns the
    /// encoded quorum. The join is withdrawn if the caller gives up first (drops this).
    pub(super) async fn quorum_for(
        self: &Arc<Self>,
        member: proto::Member,
        last_quorum_id: u64,
        timeout: Duration,
    ) -> Result<Bytes, Status> {
        match self.join(member, last_quorum_id, 0)?.wait(timeout).await? {
            Answer::Whole(quorum) => Ok(quorum),
            Answer::Update(_) => Err(Status::internal("an update for a call that holds none")),
        }
    }

    /// Joins `member` to the next quorum now; the join is withdrawn when the returned
    /// wait is dropped before its quorum came.
    fn join(
        self: &Arc<Self>,
        member: proto::Member,
        last_quorum_id: u64,
        known_issue: u64,
    ) -> Result<Joined, Status> {
        let replica_id = member.replica_id.clone();
        let (reply_tx, reply) = oneshot::channel();
        let mut st = self.lock();
        let now = Instant::now();
        self.admit(now)?;
        let ticket = refuse(
            &self.refusals,
            Refusal::DuplicateReplica,
            st.join_knowing(member.into(), last_quorum_id, known_issue, now, reply_tx),
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
    pub(super) fn answer_ask(
        self: &Arc<Self>,
        replica_id: &str,
        ask: proto::QuorumAsk,
        last_quorum_id: u64,
        events: mpsc::WeakSender<Result<proto::LighthouseEvent, Status>>,
    ) -> AbortOnDropHandle<()> {
        // Joined before this returns, so the stream's next ask supersedes this one in
        // the order the group sent them.
        let joined = refuse(
            &self.refusals,
            Refusal::Invalid,
            validate::ask(&ask, replica_id),
        )
        .and_then(|(member, timeout)| {
            Ok((self.join(member, last_quorum_id, ask.known_issue)?, timeout))
        });
        self.metrics.quorum_request(Via::Stream).inc();
        AbortOnDropHandle::new(tokio::spawn(async move {
            let answered = match joined {
                Ok((joined, timeout)) => joined.wait(timeout).await,
                Err(status) => Err(status),
            };
            let answer = match answered {
                Ok(Answer::Whole(quorum)) => proto::QuorumAnswer {
                    ask_id: ask.ask_id,
                    quorum,
                    ..Default::default()
                },
                Ok(Answer::Update(update)) => proto::QuorumAnswer {
                    ask_id: ask.ask_id,
                    update,
                    ..Default::default()
                },
                Err(status) => proto::QuorumAnswer {
                    ask_id: ask.ask_id,
                    code: status.code() as i32,
                    message: status.message().to_string(),
                    ..Default::default()
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
                _ = self.retire.notified() => {
                    self.lock().shut_down();
                    return;
                }
            }
        }
    }
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
    async fn wait(mut self, timeout: Duration) -> Result<Answer, Status> {
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

pub(super) fn refuse<T>(
    refusals: &Refusals,
    reason: Refusal,
    r: Result<T, Status>,
) -> Result<T, Status> {
    if r.is_err() {
        refusals.count(reason);
    }
    r
}
