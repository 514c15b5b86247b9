//! The manager server: one per replica group, hosted by its rank 0. It gathers the
//! quorum requests of the group's ranks, asks the lighthouse once for the whole group,
//! hands each rank its plan, decides the group's commit vote, keeps the group's
//! heartbeat stream open and relays membership-loss events to the ranks. On the same
//! port, behind the same job token, it serves the group's rendezvous store (see
//! `crate::store`): the group's own process groups and the cross-group ones of the
//! quorums this group comes first in meet there.

pub mod client;
mod group;
mod heartbeat;
pub mod plan;
pub mod progress;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::service::interceptor::InterceptedService;
use tonic::service::Routes;
use tonic::{Request, Response, Status};

use crate::auth::JobToken;
use crate::delta::Answer;
use crate::door::Door;
use crate::gate::{self, GateLimits, GroupRefusals};
use crate::lighthouse::client::LighthouseClient;
use crate::lighthouse::jobs::JobRequest;
use crate::proto::store_server::StoreServer;
use crate::proto::{self, manager_server::Manager, manager_server::ManagerServer};
use crate::server::{self, ServerHandle};
use crate::store::service::{max_request_bytes, SharedStore, StoreService};
use crate::store::StoreLimits;
use crate::{validate, Error};
use group::{lease_verdict, Decision, Gathering, GroupState, RankRequest, StepQuorum, Vote, Voted};
use heartbeat::{Asks, Heartbeat};
pub use heartbeat::{Lease, Progress};

const MAX_REQUEST_BYTES: usize = 64 * 1024;
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
    /// The job the group is of, on a lighthouse that serves many (see
    /// `lighthouse::jobs`), and the quorum rules it declares for it.
    pub job: JobRequest,
    /// Caps on connections (see `gate`).
    pub connections: GateLimits,
}

impl ManagerOptions {
    /// How often a group beats to the lighthouse unless told otherwise.
    pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_millis(100);
    /// How long the first connection to the lighthouse may take unless told otherwise.
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
    /// Whether every group but the first heals from it at step 0 unless told otherwise.
    pub const DEFAULT_INIT_SYNC: bool = true;

    /// The options of group `replica_id`'s server under the lighthouse at
    /// `lighthouse_address`, every other one its default: one rank, on loopback at any
    /// free port, serving its own store, without a token.
    pub fn new(replica_id: impl Into<String>, lighthouse_address: impl Into<String>) -> Self {
        ManagerOptions {
            replica_id: replica_id.into(),
            lighthouse_address: lighthouse_address.into(),
            bind: "127.0.0.1:0".into(),
            also_bind: None,
            advertise_host: None,
            store_address: String::new(),
            world_size: 1,
            heartbeat_interval: Self::DEFAULT_HEARTBEAT_INTERVAL,
            connect_timeout: Self::DEFAULT_CONNECT_TIMEOUT,
            init_sync: Self::DEFAULT_INIT_SYNC,
            token: JobToken::default(),
            job: JobRequest::default(),
            connections: GateLimits::RPC,
        }
    }

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

struct Shared {
    options: ManagerOptions,
    manager_address: String,
    lighthouse: LighthouseClient,
    /// Quorum requests on the heartbeat stream; the lighthouse client when none is open.
    asks: Arc<Asks>,
    group: Mutex<GroupState>,
    progress: watch::Sender<Progress>,
    events: broadcast::Sender<proto::MembershipLost>,
    lease: watch::Receiver<Option<Lease>>,
    refusals: Arc<GroupRefusals>,
    store: SharedStore,
    store_address: String,
    /// The ranks' training progress, which the heartbeat reports.
    board: Arc<Mutex<progress::Board>>,
    /// The last quorum the group got, whole: the lighthouse may send the next one as
    /// a change to it (see `crate::delta`).
    known: Mutex<Option<Arc<proto::Quorum>>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, GroupState> {
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

    /// The last vote on `step` was a yes about `quorum`: the group commits if it
    /// still holds the lease of that quorum (and snapshots it if a rank asked).
    async fn commit_if_leased(
        &self,
        step: i64,
        quorum: StepQuorum,
        snapshot: bool,
        deadline: Instant,
    ) {
        let commit = self.holds_lease(quorum, deadline).await;
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
        let decision = Decision {
            commit,
            torn: false,
            snapshot: commit && snapshot,
        };
        if commit {
            // The group now holds the state this step commits: its heartbeat says so
            // from here on, its leaving beat included.
            let lineage = self
                .known
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .filter(|q| q.quorum_id == quorum.id)
                .map(|q| q.lineage);
            if let Some(lineage) = lineage {
                self.progress.send_modify(|p| {
                    p.step = step + 1;
                    p.state_quorum_id = quorum.id;
                    p.lineage = lineage;
                });
            }
        }
        self.lock().decide(step, decision);
    }

    /// All ranks are in: one lighthouse request for the whole group.
    async fn ask_lighthouse(self: Arc<Self>, gathering: Gathering, timeout: Duration) {
        let (member, last_quorum_id) =
            self.lock()
                .member(&gathering, &self.manager_address, &self.store_address);
        let (member, last_quorum_id) = self.asks.fresh(member, last_quorum_id);
        let mut reported_failures = member.commit_failures;
        let held = (member.step, member.state_quorum_id, member.lineage);
        let started = Instant::now();
        // The stream the quorum came on, if it came on one.
        let mut stream = None;
        let known = self.known.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let known_issue = known.as_ref().map_or(0, |q| q.issue);
        let asked = self
            .asks
            .ask(member.clone(), last_quorum_id, known_issue, timeout);
        // An update the group cannot apply (it no longer holds its base) is asked
        // again by a call, whole.
        let answered = asked.await.and_then(|answer| {
            let quorum = match answer.quorum {
                Err(status) => Err(Error::Rpc(status)),
                Ok(encoded) => match encoded.decode(known.as_deref()) {
                    Ok(quorum) => Ok(quorum),
                    Err(e) if matches!(encoded, Answer::Update(_)) => {
                        tracing::warn!("the lighthouse sent {e}; asking again, for it whole");
                        return None;
                    }
                    Err(e) => Err(Error::Rpc(Status::internal(format!(
                        "the lighthouse at {} answered with {e}",
                        self.lighthouse.address()
                    )))),
                },
            };
            Some((answer.stream, quorum))
        });
        let result = match answered {
            Some((on, quorum)) => {
                stream = Some(on);
                quorum
            }
            None => {
                // The stream may have ended meanwhile, and a lease with it.
                let (member, last_quorum_id) = self.asks.fresh(member, last_quorum_id);
                reported_failures = member.commit_failures;
                let left = timeout.saturating_sub(started.elapsed());
                self.lighthouse
                    .quorum_patiently(member, last_quorum_id, left)
                    .await
            }
        };
        let quorum = match result {
            Ok(q) => Arc::new(q),
            Err(Error::Rpc(status)) => return gathering.fail(&status),
            Err(other) => return gathering.fail(&Status::unavailable(other.to_string())),
        };
        *self.known.lock().unwrap_or_else(|e| e.into_inner()) = Some(quorum.clone());
        let previous =
            self.lock()
                .quorum_received(quorum.quorum_id, reported_failures, Instant::now());
        if let Some(previous) = previous {
            // Every rank of the group asked for this quorum, so each is done with the
            // process group of the previous one: its rendezvous keys (if this group
            // hosted them) are no longer read.
            let prefix = format!("{}/", plan::quorum_store_prefix(previous));
            self.store.update(|s| s.remove_prefix(&prefix));
        }
        self.progress.send_modify(|p| {
            p.last_quorum_id = p.last_quorum_id.max(quorum.quorum_id);
            (p.step, p.state_quorum_id, p.lineage) = held;
        });
        let replica_id = &self.options.replica_id;
        // Counted by the stream's end, or else told now: the stream ended since.
        if stream.is_some_and(|s| !self.asks.handed(quorum.quorum_id, s)) {
            let why = "the heartbeat stream it came on ended";
            heartbeat::lease_lost(&self.events, replica_id, quorum.quorum_id, why);
        }
        let init_sync = self.options.init_sync;
        let mut heals = false;
        gathering.answer(|rank| {
            let plan = plan::rank_plan(&quorum, replica_id, rank, init_sync);
            heals |= plan.as_ref().is_ok_and(|p| p.heal);
            plan
        });
        if heals {
            self.lock().heals();
        }
    }
}

#[derive(Clone)]
struct ManagerService {
    shared: Arc<Shared>,
    shutdown: watch::Receiver<bool>,
}

impl ManagerService {
    /// `wait`, unless the server stops first: a stopping server answers the ranks
    /// waiting on it (for a quorum, for the group's vote) at once, instead of holding
    /// them to their deadlines.
    async fn unless_stopping<T>(&self, wait: impl Future<Output = T>) -> Result<T, Status> {
        let mut stopping = self.shutdown.clone();
        tokio::select! {
            out = wait => Ok(out),
            _ = stopping.wait_for(|s| *s) => {
                Err(Status::unavailable("the manager server is shutting down"))
            }
        }
    }
}

/// The manager server as the ranks of its own process call it: the same service and
/// checks, without the network in between (nor the job token: the process is its
/// own). Rank 0 votes and asks for every quorum this way, so the happy path pays no
/// loopback round trip, HTTP/2 framing or encoding for them.
#[derive(Clone)]
pub struct LocalManager(ManagerService);

impl LocalManager {
    /// The step the group's ranks are gathering for and the ranks that asked so far;
    /// None when no rank waits for a quorum.
    pub fn asking(&self) -> Option<(i64, Vec<u32>)> {
        self.0.shared.lock().asking()
    }

    fn serving(&self) -> Result<(), Status> {
        if *self.0.shutdown.borrow() {
            return Err(Status::unavailable("the manager server is shutting down"));
        }
        Ok(())
    }

    pub async fn quorum(
        &self,
        request: Request<proto::ManagerQuorumRequest>,
    ) -> Result<Response<proto::ManagerQuorumResponse>, Status> {
        self.serving()?;
        self.0.quorum(request).await
    }

    pub async fn should_commit(
        &self,
        request: Request<proto::ShouldCommitRequest>,
    ) -> Result<Response<proto::ShouldCommitResponse>, Status> {
        self.serving()?;
        self.0.should_commit(request).await
    }

    pub async fn progress(
        &self,
        request: Request<proto::ProgressReport>,
    ) -> Result<Response<proto::ProgressAck>, Status> {
        self.serving()?;
        self.0.progress(request).await
    }
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
        shared.lock().healed(req.group_rank, req.healed_bytes);

        let (reply, answer) = oneshot::channel();
        let request = RankRequest {
            state_address: req.state_address,
            shrink_only: req.shrink_only,
            state_quorum_id: req.state_quorum_id,
            lineage: req.lineage,
            torn: req.torn,
            unreachable: req.unreachable,
            resumed: req.resumed,
            reply,
        };
        let complete = shared.lock().ask(req.group_rank, req.step, request)?;
        if let Some(gathering) = complete {
            tokio::spawn(shared.clone().ask_lighthouse(gathering, timeout));
        }
        match self
            .unless_stopping(tokio::time::timeout(timeout, answer))
            .await?
        {
            Ok(Ok(result)) => result.map(Response::new),
            Ok(Err(_)) => Err(Status::unavailable("the manager server is shutting down")),
            Err(_) => Err(shared
                .lock()
                .give_up_quorum(req.group_rank, req.step, timeout)),
        }
    }

    async fn should_commit(
        &self,
        request: Request<proto::ShouldCommitRequest>,
    ) -> Result<Response<proto::ShouldCommitResponse>, Status> {
        let req = request.into_inner();
        let shared = &self.shared;
        let timeout = check_rank_request(
            req.protocol_version,
            req.group_rank,
            req.step,
            req.timeout_ms,
            shared.options.world_size,
        )?;
        validate::quorum_id("quorum_id", req.quorum_id)?;
        let deadline = Instant::now() + timeout;

        let vote = Vote {
            step: req.step,
            yes: req.vote,
            torn: req.torn,
            quorum_id: req.quorum_id,
            snapshot: req.snapshot,
        };
        let (waiter, decision) = oneshot::channel();
        let voted = shared.lock().vote(req.group_rank, vote, waiter);
        match voted {
            Voted::Decided(decision) => return Ok(Response::new(decision)),
            Voted::Waiting => {}
            Voted::No { torn } => {
                shared.lock().decide(
                    req.step,
                    Decision {
                        commit: false,
                        torn,
                        snapshot: false,
                    },
                );
            }
            Voted::YesIfLeased { quorum, snapshot } => {
                self.unless_stopping(shared.commit_if_leased(req.step, quorum, snapshot, deadline))
                    .await?;
            }
        }
        let decision = match self
            .unless_stopping(tokio::time::timeout_at(deadline.into(), decision))
            .await?
        {
            Ok(Ok(decision)) => decision,
            Ok(Err(_)) => Decision {
                commit: false,
                torn: true,
                snapshot: false,
            },
            Err(_) => {
                let (decision, missing) = shared.lock().give_up_vote(req.step);
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
    /// The server for the ranks of this process.
    pub local: LocalManager,
}

/// Starts a group's manager server on the current tokio runtime.
pub async fn serve(options: ManagerOptions) -> Result<ManagerHandle, Error> {
    options.validate()?;
    let lighthouse = LighthouseClient::for_job(
        &options.lighthouse_address,
        &options.token,
        &options.job,
        options.connect_timeout,
    )?;
    let (progress, progress_rx) = watch::channel(Progress::default());
    let (events, _) = broadcast::channel(64);
    let (lease, lease_rx) = watch::channel(None);
    let refusals = Arc::new(GroupRefusals::default());
    let board = Arc::new(Mutex::new(progress::Board::default()));
    let asks = Arc::new(Asks::default());
    let (listener, more, manager_address) = listen(&options).await?;
    let store = group_store(&options.replica_id)?;
    let store_address = if options.store_address.is_empty() {
        manager_address.clone()
    } else {
        options.store_address.clone()
    };
    let shared = Arc::new(Shared {
        options: options.clone(),
        manager_address: manager_address.clone(),
        lighthouse: lighthouse.clone(),
        asks: asks.clone(),
        group: Mutex::new(GroupState::new(
            options.replica_id.clone(),
            options.world_size,
        )),
        progress,
        events: events.clone(),
        lease: lease_rx,
        refusals: refusals.clone(),
        store,
        store_address,
        board: board.clone(),
        known: Mutex::new(None),
    });
    let group = Arc::downgrade(&shared);
    let (shutdown, stopping) = watch::channel(false);
    let service = ManagerService {
        shared: shared.clone(),
        shutdown: stopping.clone(),
    };
    let routes = routes(service.clone());
    let door = Door::new(options.connections, refusals.own.clone());
    let mut handle = server::spawn(listener, more, routes, shutdown, door, None);
    let heartbeat = Heartbeat {
        client: lighthouse,
        replica_id: options.replica_id.clone(),
        manager_address: manager_address.clone(),
        interval: options.heartbeat_interval,
        progress: progress_rx,
        events,
        lease,
        refusals: refusals.clone(),
        tally: Arc::new(move || {
            group
                .upgrade()
                .map(|s| s.lock().tally())
                .unwrap_or_default()
        }),
        board,
        asks,
        stopping: stopping.clone(),
    };
    handle.add_task(tokio::spawn(beat_until_stopped(heartbeat, stopping)));
    tracing::info!(
        replica_id = options.replica_id,
        address = manager_address,
        "manager server listening"
    );
    Ok(ManagerHandle {
        server: handle,
        address: manager_address,
        refusals,
        local: LocalManager(service),
    })
}

/// Binds `bind` (and `also_bind`, at the same port); returns the listeners and the
/// address the group's ranks and peers use.
async fn listen(
    options: &ManagerOptions,
) -> Result<(TcpListener, Vec<TcpListener>, String), Error> {
    let (listener, bound) = server::bind(&options.bind).await?;
    let mut more = Vec::new();
    if let Some(host) = options.also_bind.as_deref().filter(|h| !h.is_empty()) {
        more.extend(server::bind_also(bound, host).await?);
    }
    let address = server::advertised_address(bound, options.advertise_host.as_deref());
    Ok((listener, more, address))
}

/// The group's rendezvous store, holding the key that names the group.
fn group_store(replica_id: &str) -> Result<SharedStore, Error> {
    let store = SharedStore::new(StoreLimits::default());
    store
        .update(|s| s.set(REPLICA_ID_KEY, replica_id.to_string().into()))
        .map_err(|e| Error::InvalidConfig(e.to_string()))?;
    Ok(store)
}

/// The manager's gRPC service and the group's store, both behind the job token.
fn routes(service: ManagerService) -> Routes {
    let token = service.shared.options.token.clone();
    let store = service.shared.store.clone();
    let grpc = ManagerServer::new(service).max_decoding_message_size(MAX_REQUEST_BYTES);
    let grpc = InterceptedService::new(grpc, token.clone());
    let store = StoreServer::new(StoreService::new(store))
        .max_decoding_message_size(max_request_bytes(&StoreLimits::default()));
    let store = InterceptedService::new(store, token);
    Routes::new(grpc).add_service(store)
}

/// How long a stopping server waits for the lighthouse to take its leave before it
/// drops the stream (a lighthouse cut off would never answer): the group then goes as
/// if it had died.
const LEAVE_GRACE: Duration = Duration::from_millis(500);

/// A stopping server says on its heartbeat stream that the group leaves and closes
/// the stream, so that the lighthouse and the other groups learn now, not after the
/// shutdown grace, and learn that it ended its run rather than died.
async fn beat_until_stopped(heartbeat: Heartbeat, mut stopping: watch::Receiver<bool>) {
    let run = heartbeat.run();
    tokio::pin!(run);
    tokio::select! {
        _ = &mut run => return,
        _ = stopping.wait_for(|s| *s) => {}
    }
    let _ = tokio::time::timeout(LEAVE_GRACE, run).await;
}

#[cfg(test)]
mod tests {
    use super::client::ManagerClient;
    use super::*;
    use crate::lighthouse::{self, LighthouseOptions};
    use crate::proto::PROTOCOL_VERSION;
    use tokio::net::TcpStream;

    // Shared with the tests of `heartbeat`.
    pub(super) const PATIENCE: Duration = Duration::from_secs(5);

    pub(super) async fn bounded<T>(what: &str, fut: impl Future<Output = T>) -> T {
        tokio::time::timeout(PATIENCE, fut)
            .await
            .unwrap_or_else(|_| panic!("{what}: nothing within {PATIENCE:?}"))
    }

    /// A lighthouse on loopback whose quorums form quickly.
    pub(super) async fn start_lighthouse() -> ServerHandle {
        lighthouse::serve(LighthouseOptions {
            bind: "127.0.0.1:0".into(),
            join_timeout: Duration::from_millis(100),
            ..LighthouseOptions::default()
        })
        .await
        .expect("lighthouse starts")
    }

    /// A proxy in front of `target` whose `reset` closes every connection through it
    /// (both sides), as a lighthouse's host restarting its network would.
    async fn proxy(target: std::net::SocketAddr) -> (String, watch::Sender<u64>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy binds");
        let address = listener.local_addr().expect("proxy address").to_string();
        let (reset, resets) = watch::channel(0);
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let mut reset = resets.clone();
                reset.mark_unchanged();
                tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = reset.changed() => {}
                    }
                });
            }
        });
        (address, reset)
    }

    async fn quorum(group: &LocalManager, step: i64) -> u64 {
        let request = proto::ManagerQuorumRequest {
            protocol_version: PROTOCOL_VERSION,
            step,
            state_address: "g-state:1".into(),
            timeout_ms: 3000,
            ..Default::default()
        };
        let answer = bounded("a quorum", group.quorum(Request::new(request))).await;
        answer.expect("a quorum").into_inner().quorum_id
    }

    async fn commits(group: &LocalManager, step: i64, quorum_id: u64) -> bool {
        let ballot = proto::ShouldCommitRequest {
            protocol_version: PROTOCOL_VERSION,
            step,
            vote: true,
            quorum_id,
            timeout_ms: 3000,
            ..Default::default()
        };
        let decision = bounded("a decision", group.should_commit(Request::new(ballot))).await;
        decision.expect("a decision").into_inner().commit
    }

    /// The manager's stream breaks; the next event its ranks hear must be the loss
    /// of quorum `quorum_id`, soon. Returns once a new stream holds a lease again.
    async fn told_lost(
        group: &LocalManager,
        reset: &watch::Sender<u64>,
        events: &mut tonic::Streaming<proto::ManagerEvent>,
        quorum_id: u64,
    ) {
        let broke = Instant::now();
        reset.send_modify(|n| *n += 1);
        let event = bounded("the ranks told", events.message()).await;
        let lost = event.unwrap().unwrap().membership_lost.expect("a loss");
        let told = broke.elapsed();
        assert_eq!(
            (lost.quorum_id, lost.cause.as_str()),
            (quorum_id, heartbeat::LIGHTHOUSE_LOST)
        );
        assert!(lost.lost.is_empty(), "no group died: {lost:?}");
        assert!(told < Duration::from_millis(500), "told after {told:?}");
        // Asked only once the new stream is acknowledged: a quorum asked before the
        // lighthouse saw the old stream end could be one it then drops the group from.
        let mut lease = group.0.shared.lease.clone();
        let acknowledged = lease.wait_for(|l| l.is_some());
        bounded("a new stream", acknowledged).await.unwrap();
    }

    /// A heartbeat stream broken and opened again to the same lighthouse: the ranks
    /// are told at once that no step of its quorum can commit (and indeed none does),
    /// and the next quorum has a new id, also when no step failed (the lighthouse
    /// would give the same members the same id again), so that the ranks' rule costs
    /// no step that could commit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_broken_stream_tells_the_ranks_its_quorum_is_lost_and_the_next_one_is_new() {
        let server = start_lighthouse().await;
        let (through, reset) = proxy(server.local_addr()).await;
        let handle = serve(ManagerOptions {
            heartbeat_interval: Duration::from_millis(50),
            connect_timeout: Duration::from_millis(500),
            init_sync: false,
            ..ManagerOptions::new("g", through)
        })
        .await
        .expect("manager server starts");
        let rank = ManagerClient::new(&handle.address, &JobToken::default(), PATIENCE).unwrap();
        let mut events = bounded("events", rank.events(PATIENCE)).await.unwrap();
        let group = &handle.local;

        // Between two steps: nothing fails, yet the next quorum is a new one.
        let first = quorum(group, 0).await;
        assert!(
            commits(group, 0, first).await,
            "under the lease of quorum {first}"
        );
        told_lost(group, &reset, &mut events, first).await;
        let second = quorum(group, 1).await;
        assert!(second > first, "quorum {second} after {first}");
        assert!(
            commits(group, 1, second).await,
            "under the lease of {second}"
        );

        // In the middle of a step: that step could indeed never commit.
        assert_eq!(
            quorum(group, 2).await,
            second,
            "an unchanged quorum keeps its id"
        );
        told_lost(group, &reset, &mut events, second).await;
        assert!(
            !commits(group, 2, second).await,
            "committed without a lease"
        );
        let third = quorum(group, 2).await;
        assert!(third > second, "quorum {third} after {second}");
        assert!(commits(group, 2, third).await, "under the lease of {third}");
        handle.server.shutdown().await;
        server.shutdown().await;
    }
}
