//! The manager server: one per replica group, hosted by its rank 0. It gathers the
//! quorum requests of the group's ranks, asks the lighthouse once for the whole group,
//! hands each rank its plan, decides the group's commit vote, keeps the group's
//! heartbeat stream open and relays membership-loss events to the ranks. On the same
//! port, behind the same job token, it serves the group's rendezvous store (see
//! `crate::store`): the group's own process groups and the cross-group ones of the
//! quorums this group comes first in meet there.

mod heartbeat;
pub mod plan;
pub mod progress;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::service::interceptor::InterceptedService;
use tonic::service::Routes;
use tonic::{Request, Response, Status};

use crate::auth::JobToken;
use crate::client::LighthouseClient;
use crate::door::Door;
use crate::gate::{self, GateLimits, GroupRefusals};
use crate::proto::store_server::StoreServer;
use crate::proto::{self, manager_server::Manager, manager_server::ManagerServer};
use crate::server::{self, ServerHandle};
use crate::store::service::{max_request_bytes, SharedStore, StoreService};
use crate::store::StoreLimits;
use crate::{validate, Error};
use heartbeat::Heartbeat;
pub use heartbeat::{Lease, Progress};

const MAX_REQUEST_BYTES: usize = 64 * 1024;
/// Commit decisions remembered for ranks that vote after the others timed out.
const DECISIONS_KEPT: usize = 64;
/// The store key that names the replica group whose manager serves the store: a rank
/// given another group's MASTER_PORT reads it and says so, instead of joining that group.
pub const REPLICA_ID_KEY: &str = "phalanx/manager/replica_id";

#[derive(Clone, Debug)]
pub struct ManagerOptions {
    pub replica_id: String,
    pub lighthouse_address: String,
    /// "host:port" to listen on; port 0 picks a free one.
    pub bind: String,
    /// Another host to listen on, at the same port: the advertised one, when the
    /// group's own ranks meet the server at `bind` (e.g. loopback) and the other
    /// groups at this host. Never all interfaces unless `bind` says so.
    pub also_bind: Option<String>,
    /// The host peers and ranks use to reach this server; by default the bind host,
    /// or this machine's hostname when binding to all interfaces.
    pub advertise_host: Option<String>,
    /// The group's rendezvous store, passed on to the cross-group process group; empty:
    /// the store this server serves itself, at its own address.
    pub store_address: String,
    pub world_size: u32,
    pub heartbeat_interval: Duration,
    pub connect_timeout: Duration,
    pub init_sync: bool,
    pub token: JobToken,
    /// Caps on connections (see `gate`).
    pub connections: GateLimits,
}

impl ManagerOptions {
    pub fn validate(&self) -> Result<(), Error> {
        let check = |r: Result<(), Status>| r.map_err(|s| Error::InvalidConfig(s.message().into()));
        check(validate::replica_id(&self.replica_id))?;
        check(validate::world_size(self.world_size))?;
        check(validate::address("store address", &self.store_address))?;
        if self.heartbeat_interval.is_zero() {
            return Err(Error::InvalidConfig(
                "the heartbeat interval must be positive, e.g. 100ms".into(),
            ));
        }
        Ok(())
    }
}

type Reply<T> = oneshot::Sender<Result<T, Status>>;

struct RankRequest {
    state_address: String,
    shrink_only: bool,
    state_quorum_id: u64,
    torn: bool,
    reply: Reply<proto::ManagerQuorumResponse>,
}

/// The group's ranks asking for the quorum of one step.
struct Gathering {
    step: i64,
    ranks: BTreeMap<u32, RankRequest>,
}

type Decision = proto::ShouldCommitResponse;

#[derive(Default)]
struct Ballot {
    voted: BTreeSet<u32>,
    /// Every rank voted yes so far.
    all_yes: bool,
    /// Some rank's state is torn.
    torn: bool,
    /// The quorum ids the ranks said the step ran in (0: not said).
    quorum_ids: BTreeSet<u64>,
    waiters: Vec<oneshot::Sender<Decision>>,
}

/// The quorum the group's ranks were last handed, and when it arrived.
#[derive(Clone, Copy, Debug)]
struct StepQuorum {
    id: u64,
    received_at: Instant,
}

#[derive(Default)]
struct Group {
    gathering: Option<Gathering>,
    ballots: BTreeMap<i64, Ballot>,
    decided: VecDeque<(i64, Decision)>,
    last_quorum_id: u64,
    commit_failures: u32,
    quorum: Option<StepQuorum>,
}

impl Group {
    /// Records the decision of `step` and answers every rank waiting on it; a step
    /// is decided once, so a later call gets the first decision back.
    fn decide(&mut self, step: i64, decision: Decision) -> Decision {
        if let Some(first) = self.decided(step) {
            return first;
        }
        if let Some(ballot) = self.ballots.remove(&step) {
            for waiter in ballot.waiters {
                let _ = waiter.send(decision);
            }
        }
        if !decision.commit {
            self.commit_failures = self.commit_failures.saturating_add(1);
        }
        self.decided.push_back((step, decision));
        if self.decided.len() > DECISIONS_KEPT {
            self.decided.pop_front();
        }
        decision
    }

    fn decided(&self, step: i64) -> Option<Decision> {
        self.decided
            .iter()
            .rev()
            .find(|(s, _)| *s == step)
            .map(|(_, d)| *d)
    }
}

/// What the lease says about committing a step of quorum `quorum` that arrived at
/// `received_at`: yes, no for good, or not yet known (wait for the next
/// acknowledgement). No for good once a beat sent after the quorum arrived was
/// acknowledged for another quorum: the lighthouse went on without this group.
fn lease_verdict(lease: Option<&Lease>, quorum: StepQuorum, now: Instant) -> Option<bool> {
    let lease = lease?;
    if lease.holds(quorum.id, now) {
        Some(true)
    } else if lease.quorum_id != quorum.id && lease.sent_at > quorum.received_at {
        Some(false)
    } else {
        None
    }
}

struct Shared {
    options: ManagerOptions,
    manager_address: String,
    lighthouse: LighthouseClient,
    group: Mutex<Group>,
    progress: watch::Sender<Progress>,
    events: broadcast::Sender<proto::MembershipLost>,
    lease: watch::Receiver<Option<Lease>>,
    refusals: Arc<GroupRefusals>,
    store: SharedStore,
    store_address: String,
    /// The ranks' training progress, which the heartbeat reports.
    board: Arc<Mutex<progress::Board>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Group> {
        self.group.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the group still holds a lease of `quorum`, waiting for the lighthouse's
    /// next acknowledgement when it cannot tell yet, up to `deadline`.
    async fn holds_lease(&self, quorum: StepQuorum, deadline: Instant) -> bool {
        let mut lease = self.lease.clone();
        let verdict = async move {
            let mut verdict = None;
            let _ = lease
                .wait_for(|l| {
                    verdict = lease_verdict(l.as_ref(), quorum, Instant::now());
                    verdict.is_some()
                })
                .await;
            verdict
        };
        matches!(
            tokio::time::timeout_at(deadline.into(), verdict).await,
            Ok(Some(true))
        )
    }

    /// Every rank has voted: the group commits if all said yes, no rank is torn, and
    /// it still holds the lease of the step's quorum.
    async fn decide(&self, step: i64, ballot: (bool, bool, BTreeSet<u64>), deadline: Instant) {
        let (all_yes, torn, claimed) = ballot;
        let quorum = self.lock().quorum;
        let agreed = quorum.filter(|q| claimed.iter().all(|id| *id == q.id));
        let mut commit = all_yes && !torn && agreed.is_some();
        if let (true, Some(quorum)) = (commit, agreed) {
            commit = self.holds_lease(quorum, deadline).await;
            if !commit {
                tracing::warn!(
                    replica_id = self.options.replica_id,
                    step,
                    quorum_id = quorum.id,
                    "every rank voted yes, but the lighthouse no longer counts this group in \
                     quorum {}: the step is not committed",
                    quorum.id
                );
            }
        }
        self.lock().decide(step, Decision { commit, torn });
    }

    /// All ranks are in: one lighthouse request for the whole group.
    async fn ask_lighthouse(self: Arc<Self>, gathering: Gathering, timeout: Duration) {
        let (last_quorum_id, commit_failures) = {
            let g = self.lock();
            (g.last_quorum_id, g.commit_failures)
        };
        let member = proto::Member {
            replica_id: self.options.replica_id.clone(),
            manager_address: self.manager_address.clone(),
            store_address: self.store_address.clone(),
            step: gathering.step,
            world_size: self.options.world_size,
            shrink_only: gathering.ranks.values().any(|r| r.shrink_only),
            commit_failures,
            state_addresses: gathering
                .ranks
                .values()
                .map(|r| r.state_address.clone())
                .collect(),
            state_quorum_id: gathering
                .ranks
                .values()
                .map(|r| r.state_quorum_id)
                .max()
                .unwrap_or(0),
            // Ranks that disagree on which state they hold cannot all hold the job's.
            torn: gathering.ranks.values().any(|r| r.torn)
                || !gathering
                    .ranks
                    .values()
                    .all(|r| r.state_quorum_id == gathering.ranks[&0].state_quorum_id),
        };
        let result = self
            .lighthouse
            .quorum_patiently(member, last_quorum_id, timeout)
            .await;
        let quorum = match result {
            Ok(q) => q,
            Err(e) => {
                let status = match e {
                    Error::Rpc(status) => status,
                    other => Status::unavailable(other.to_string()),
                };
                for r in gathering.ranks.into_values() {
                    let _ = r.reply.send(Err(status.clone()));
                }
                return;
            }
        };
        let previous = {
            let mut g = self.lock();
            let previous = g.quorum.map(|q| q.id);
            g.last_quorum_id = g.last_quorum_id.max(quorum.quorum_id);
            g.commit_failures = g.commit_failures.saturating_sub(commit_failures);
            g.quorum = Some(StepQuorum {
                id: quorum.quorum_id,
                received_at: Instant::now(),
            });
            previous
        };
        if let Some(previous) = previous.filter(|id| *id != quorum.quorum_id) {
            // Every rank of the group asked for this quorum, so each is done with the
            // process group of the previous one: its rendezvous keys (if this group
            // hosted them) are no longer read.
            let prefix = format!("{}/", plan::quorum_store_prefix(previous));
            self.store.update(|s| s.remove_prefix(&prefix));
        }
        self.progress.send_modify(|p| {
            p.last_quorum_id = p.last_quorum_id.max(quorum.quorum_id);
            p.step = gathering.step;
        });
        for (rank, r) in gathering.ranks {
            let plan = plan::rank_plan(
                &quorum,
                &self.options.replica_id,
                rank,
                self.options.init_sync,
            );
            let _ = r.reply.send(plan);
        }
    }
}

struct ManagerService {
    shared: Arc<Shared>,
    shutdown: watch::Receiver<bool>,
}

/// The checks every rank's request goes through; returns its timeout.
fn check_rank_request(
    protocol_version: u32,
    rank: u32,
    step: i64,
    timeout_ms: u64,
    world_size: u32,
) -> Result<std::time::Duration, Status> {
    validate::protocol_version(protocol_version)?;
    check_rank(rank, world_size)?;
    validate::step(step)?;
    validate::timeout_ms(timeout_ms)
}

fn check_rank(rank: u32, world_size: u32) -> Result<(), Status> {
    if rank >= world_size {
        return Err(Status::invalid_argument(format!(
            "group rank {rank} is out of range for a group of {world_size} ranks"
        )));
    }
    Ok(())
}

type EventStream = Pin<Box<dyn Stream<Item = Result<proto::ManagerEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Manager for ManagerService {
    async fn quorum(
        &self,
        request: Request<proto::ManagerQuorumRequest>,
    ) -> Result<Response<proto::ManagerQuorumResponse>, Status> {
        let req = request.into_inner();
        let shared = &self.shared;
        let world_size = shared.options.world_size;
        let timeout = check_rank_request(
            req.protocol_version,
            req.group_rank,
            req.step,
            req.timeout_ms,
            world_size,
        )?;
        validate::address("state address", &req.state_address)?;
        validate::quorum_id("state_quorum_id", req.state_quorum_id)?;
        shared
            .refusals
            .report(req.group_rank, gate::counts_from_wire(&req.state_refused));

        let (reply, answer) = oneshot::channel();
        let complete = {
            let mut g = shared.lock();
            if let Some(gathering) = &g.gathering {
                if gathering.step != req.step {
                    let asked: Vec<String> = gathering
                        .ranks
                        .keys()
                        .map(|r| format!("rank {r} at step {}", gathering.step))
                        .collect();
                    let status = Status::invalid_argument(format!(
                        "the ranks of replica group {:?} disagree on the step: {} but rank {} at \
                         step {}; every rank must start the quorum of the same step",
                        shared.options.replica_id,
                        asked.join(", "),
                        req.group_rank,
                        req.step
                    ));
                    for r in g
                        .gathering
                        .take()
                        .into_iter()
                        .flat_map(|g| g.ranks.into_values())
                    {
                        let _ = r.reply.send(Err(status.clone()));
                    }
                    return Err(status);
                }
            }
            let gathering = g.gathering.get_or_insert_with(|| Gathering {
                step: req.step,
                ranks: BTreeMap::new(),
            });
            let request = RankRequest {
                state_address: req.state_address,
                shrink_only: req.shrink_only,
                state_quorum_id: req.state_quorum_id,
                torn: req.torn,
                reply,
            };
            if let Some(old) = gathering.ranks.insert(req.group_rank, request) {
                let _ = old.reply.send(Err(Status::aborted(
                    "superseded by a newer request from the same rank",
                )));
            }
            if gathering.ranks.len() == world_size as usize {
                // Every rank is past its last vote: a retried step number starts a new
                // ballot instead of getting the remembered answer of the failed attempt.
                g.ballots.clear();
                g.decided.clear();
                g.gathering.take()
            } else {
                None
            }
        };
        if let Some(gathering) = complete {
            tokio::spawn(shared.clone().ask_lighthouse(gathering, timeout));
        }

        match tokio::time::timeout(timeout, answer).await {
            Ok(Ok(result)) => result.map(Response::new),
            Ok(Err(_)) => Err(Status::unavailable("the manager server is shutting down")),
            Err(_) => {
                let mut g = shared.lock();
                let missing: Vec<u32> = match &mut g.gathering {
                    Some(gathering) if gathering.step == req.step => {
                        gathering.ranks.remove(&req.group_rank);
                        (0..world_size)
                            .filter(|r| *r != req.group_rank && !gathering.ranks.contains_key(r))
                            .collect()
                    }
                    _ => Vec::new(),
                };
                let why = if missing.is_empty() {
                    "the lighthouse did not answer in time".to_string()
                } else {
                    format!("rank(s) {missing:?} of the group did not ask")
                };
                Err(Status::deadline_exceeded(format!(
                    "no quorum for replica group {:?} at step {} within {:.3} s: {why}",
                    shared.options.replica_id,
                    req.step,
                    timeout.as_secs_f64()
                )))
            }
        }
    }

    async fn should_commit(
        &self,
        request: Request<proto::ShouldCommitRequest>,
    ) -> Result<Response<proto::ShouldCommitResponse>, Status> {
        let req = request.into_inner();
        let shared = &self.shared;
        let world_size = shared.options.world_size;
        let timeout = check_rank_request(
            req.protocol_version,
            req.group_rank,
            req.step,
            req.timeout_ms,
            world_size,
        )?;

        validate::quorum_id("quorum_id", req.quorum_id)?;
        let deadline = Instant::now() + timeout;

        let (tx, rx) = oneshot::channel();
        let complete = {
            let mut g = shared.lock();
            if let Some(decision) = g.decided(req.step) {
                return Ok(Response::new(decision));
            }
            let ballot = g.ballots.entry(req.step).or_insert_with(|| Ballot {
                all_yes: true,
                ..Ballot::default()
            });
            ballot.voted.insert(req.group_rank);
            ballot.all_yes &= req.vote;
            ballot.torn |= req.torn;
            if req.quorum_id != 0 {
                ballot.quorum_ids.insert(req.quorum_id);
            }
            ballot.waiters.push(tx);
            (ballot.voted.len() == world_size as usize).then(|| {
                (
                    ballot.all_yes,
                    ballot.torn,
                    std::mem::take(&mut ballot.quorum_ids),
                )
            })
        };
        if let Some(ballot) = complete {
            shared.decide(req.step, ballot, deadline).await;
        }
        let decision = match tokio::time::timeout_at(deadline.into(), rx).await {
            Ok(Ok(decision)) => decision,
            Ok(Err(_)) => Decision {
                commit: false,
                torn: true,
            },
            Err(_) => {
                // A rank that never votes means "no" for everyone, never a hang; and
                // its heal, if it healed, may not have completed. (With every vote in,
                // the lease was not settled in time: a "no", torn as the ranks said.)
                let mut g = shared.lock();
                let (missing, torn): (Vec<u32>, bool) = match g.ballots.get(&req.step) {
                    Some(b) => (
                        (0..world_size).filter(|r| !b.voted.contains(r)).collect(),
                        b.torn,
                    ),
                    None => (Vec::new(), true),
                };
                let torn = torn || !missing.is_empty();
                let decision = g.decide(
                    req.step,
                    Decision {
                        commit: false,
                        torn,
                    },
                );
                if !missing.is_empty() {
                    tracing::warn!(
                        replica_id = shared.options.replica_id,
                        step = req.step,
                        "rank(s) {missing:?} did not vote within {:.3} s; the step is not committed",
                        timeout.as_secs_f64()
                    );
                }
                decision
            }
        };
        Ok(Response::new(decision))
    }

    async fn progress(
        &self,
        request: Request<proto::ProgressReport>,
    ) -> Result<Response<proto::ProgressAck>, Status> {
        let req = request.into_inner();
        validate::protocol_version(req.protocol_version)?;
        check_rank(req.group_rank, self.shared.options.world_size)?;
        let report = progress::RankReport {
            marks: req.marks,
            wait_left: if req.waiting {
                Some(Duration::from_millis(
                    req.wait_left_ms.min(validate::MAX_TIMEOUT_MS),
                ))
            } else {
                None
            },
            stall_timeout: if req.stall_timeout_ms == 0 {
                Duration::ZERO
            } else {
                validate::timeout_ms(req.stall_timeout_ms).map_err(|s| {
                    Status::invalid_argument(format!("stall_timeout_ms: {}", s.message()))
                })?
            },
            step_time: Duration::from_millis(req.step_time_ms.min(validate::MAX_TIMEOUT_MS)),
        };
        self.shared
            .board
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .report(req.group_rank, report, Instant::now());
        Ok(Response::new(proto::ProgressAck {}))
    }

    type EventsStream = EventStream;

    async fn events(
        &self,
        request: Request<proto::EventsRequest>,
    ) -> Result<Response<Self::EventsStream>, Status> {
        validate::protocol_version(request.into_inner().protocol_version)?;
        let mut events = self.shared.events.subscribe();
        let mut stopping = self.shutdown.clone();
        let (tx, rx) = mpsc::channel(16);
        // Forwards until the listener goes or the server stops: a stopping server ends
        // the stream, so that its listeners learn at once.
        tokio::spawn(async move {
            loop {
                let lost = tokio::select! {
                    e = events.recv() => match e {
                        Ok(lost) => lost,
                        // A lagging listener misses events; they are hints, the next
                        // quorum is the truth.
                        Err(broadcast::error::RecvError::Lagged(_)) => continue,
                        Err(broadcast::error::RecvError::Closed) => return,
                    },
                    _ = stopping.wait_for(|s| *s) => return,
                    _ = tx.closed() => return,
                };
                let event = proto::ManagerEvent {
                    membership_lost: Some(lost),
                };
                if tx.send(Ok(event)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// A running manager server and the address its ranks and peers use.
pub struct ManagerHandle {
    pub server: ServerHandle,
    pub address: String,
    /// Requests and connections turned away, by reason.
    pub refusals: Arc<GroupRefusals>,
}

/// Starts a group's manager server on the current tokio runtime.
pub async fn serve(options: ManagerOptions) -> Result<ManagerHandle, Error> {
    options.validate()?;
    let lighthouse = LighthouseClient::new(
        &options.lighthouse_address,
        &options.token,
        options.connect_timeout,
    )?;
    let (progress, progress_rx) = watch::channel(Progress::default());
    let (events, _) = broadcast::channel(64);
    let (lease, lease_rx) = watch::channel(None);
    let refusals = Arc::new(GroupRefusals::default());
    let board = Arc::new(Mutex::new(progress::Board::default()));
    let (listener, bound) = server::bind(&options.bind).await?;
    let mut more = Vec::new();
    if let Some(host) = options.also_bind.as_deref().filter(|h| !h.is_empty()) {
        more.extend(server::bind_also(bound, host).await?);
    }
    let manager_address = server::advertised_address(bound, options.advertise_host.as_deref());
    let limits = StoreLimits::default();
    let store = SharedStore::new(limits);
    store
        .update(|s| s.set(REPLICA_ID_KEY, options.replica_id.clone().into()))
        .map_err(|e| Error::InvalidConfig(e.to_string()))?;
    let store_address = if options.store_address.is_empty() {
        manager_address.clone()
    } else {
        options.store_address.clone()
    };
    let shared = Arc::new(Shared {
        options: options.clone(),
        manager_address: manager_address.clone(),
        lighthouse: lighthouse.clone(),
        group: Mutex::new(Group::default()),
        progress,
        events: events.clone(),
        lease: lease_rx,
        refusals: refusals.clone(),
        store: store.clone(),
        store_address,
        board: board.clone(),
    });
    let (shutdown, mut stopping) = watch::channel(false);
    let grpc = ManagerServer::new(ManagerService {
        shared,
        shutdown: stopping.clone(),
    })
    .max_decoding_message_size(MAX_REQUEST_BYTES);
    let grpc = InterceptedService::new(grpc, options.token.clone());
    let store = StoreServer::new(StoreService::new(store))
        .max_decoding_message_size(max_request_bytes(&limits));
    let store = InterceptedService::new(store, options.token.clone());
    let routes = Routes::new(grpc).add_service(store);
    let door = Door::new(options.connections, refusals.own.clone());
    let mut handle = server::spawn(listener, more, routes, shutdown, door);
    let heartbeat = Heartbeat {
        client: lighthouse,
        replica_id: options.replica_id.clone(),
        manager_address: manager_address.clone(),
        interval: options.heartbeat_interval,
        progress: progress_rx,
        events,
        lease,
        refusals: refusals.clone(),
        board,
    }
    .run();
    // A stopping server closes its heartbeat stream at once, so that the lighthouse
    // and the other groups learn now, not after the shutdown grace.
    handle.add_task(tokio::spawn(async move {
        tokio::select! {
            _ = heartbeat => {}
            _ = stopping.wait_for(|s| *s) => {}
        }
    }));
    tracing::info!(
        replica_id = options.replica_id,
        address = manager_address,
        "manager server listening"
    );
    Ok(ManagerHandle {
        server: handle,
        address: manager_address,
        refusals,
    })
}
