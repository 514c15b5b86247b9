//! A replica group's manager server and a rank's client of it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tokio::sync::{mpsc, oneshot};

use super::eviction;
use super::keywords::Given;
use super::runtime::{connect, control, wait};
use super::types::{CommitDecision, MembershipLost, QuorumResult};
use super::{job_request, seconds, seconds_or_zero, stop, unsigned, Server};
use crate::auth::JobToken;
use crate::gate::GroupRefusals;
use crate::manager::{self, client, ManagerOptions};
use crate::proto;
use crate::server::ServerHandle;

/// A replica group's manager server, hosted by its rank 0.
#[pyclass(module = "phalanx._core", frozen, extends = Server)]
pub struct ManagerServer {
    handle: Mutex<Option<ServerHandle>>,
    #[pyo3(get)]
    address: String,
    refusals: Arc<GroupRefusals>,
    local: manager::LocalManager,
}

keywords! {
    /// Where the server listens and how the others reach it (see `ManagerOptions`).
    struct AddressKeywords {
        bind: String = "127.0.0.1:0".into(),
        also_bind: Option<String> = None,
        advertise_host: Option<String> = None,
        store_address: String = String::new(),
    }
}

keywords! {
    /// How the server keeps in touch with the lighthouse, in seconds; None: the
    /// default (`MANAGER_DEFAULTS`).
    struct HeartbeatKeywords {
        heartbeat_interval: Option<f64> = None,
        connect_timeout: Option<f64> = None,
    }
}

keywords! {
    /// The job the group is of, the quorum rules it declares for it, and the token
    /// every request carries.
    struct JobKeywords {
        token: Option<String> = None,
        job: Option<String> = None,
        job_rules: Option<String> = None,
    }
}

#[pymethods]
impl ManagerServer {
    #[new]
    #[pyo3(
        signature = (replica_id, lighthouse_address, world_size = 1, *, init_sync = ManagerOptions::DEFAULT_INIT_SYNC, **options),
        text_signature = "(replica_id, lighthouse_address, world_size=1, *, bind='127.0.0.1:0', \
                          store_address='', advertise_host=None, heartbeat_interval=None, \
                          connect_timeout=None, init_sync=True, token=None, also_bind=None, \
                          job=None, job_rules=None)"
    )]
    fn new(
        py: Python<'_>,
        replica_id: String,
        lighthouse_address: String,
        world_size: i64,
        init_sync: bool,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let mut given = Given::new("ManagerServer", options)?;
        let addresses: AddressKeywords = given.take()?;
        let heartbeat: HeartbeatKeywords = given.take()?;
        let job: JobKeywords = given.take()?;
        given.finish()?;
        let heartbeat_interval = heartbeat
            .heartbeat_interval
            .map_or(Ok(ManagerOptions::DEFAULT_HEARTBEAT_INTERVAL), |s| {
                seconds("heartbeat_interval", s)
            })?;
        let connect_timeout = heartbeat
            .connect_timeout
            .map_or(Ok(ManagerOptions::DEFAULT_CONNECT_TIMEOUT), |s| {
                seconds("connect_timeout", s)
            })?;
        let options = ManagerOptions {
            bind: addresses.bind,
            also_bind: addresses.also_bind,
            advertise_host: addresses.advertise_host,
            store_address: addresses.store_address,
            world_size: unsigned("world_size", world_size)?,
            heartbeat_interval,
            connect_timeout,
            init_sync,
            token: JobToken::new(job.token),
            job: job_request(job.job.as_deref(), job.job_rules.as_deref())?,
            ..ManagerOptions::new(replica_id, lighthouse_address)
        };
        let handle = wait(py, manager::serve(options))?;
        let server = ManagerServer {
            handle: Mutex::new(Some(handle.server)),
            address: handle.address,
            refusals: handle.refusals,
            local: handle.local,
        };
        Ok(Server::init(server))
    }

    /// The step the group's ranks are gathering for and the group ranks that asked
    /// for its quorum so far; None when no rank waits for a quorum.
    #[getter]
    fn asking(&self) -> Option<(i64, Vec<u32>)> {
        self.local.asking()
    }

    /// Requests and connections turned away so far, by reason.
    #[getter]
    fn refused_requests(&self) -> HashMap<&'static str, u64> {
        self.refusals
            .totals()
            .into_iter()
            .map(|(reason, n)| (reason.as_str(), n))
            .collect()
    }

    /// Stops serving and closes the group's heartbeat stream. Idempotent.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        stop(py, &self.handle)
    }
}

keywords! {
    /// What one rank asks its group's manager server for: the quorum of `step`, and
    /// what the group reports to the lighthouse with it. Checked when it is made, so
    /// that a bad value is named where it was written.
    #[pyclass(module = "phalanx._core", frozen, get_all)]
    #[derive(Debug)]
    pub struct QuorumRequest {
        /// This rank's place in its group, 0 to the group's world size - 1.
        group_rank: i64,
        /// The step the rank is about to take; every rank of the group asks for the same.
        step: i64,
        /// Seconds the rank waits for its quorum.
        timeout: f64,
        /// Where this rank serves its state to healing peers (host:port).
        state_address: String = String::new(),
        /// The group would rather wait than have the quorum grow.
        shrink_only: bool = false,
        /// With `step`, which state this rank holds: the quorum that committed it.
        state_quorum_id: u64 = 0,
        /// This rank's heal failed part way: its state is unusable.
        torn: bool = false,
        /// This rank's state server's refusals so far, by reason.
        state_refused: Option<HashMap<String, u64>> = None,
        /// Tensor bytes this rank fetched from its peers in heals so far.
        healed_bytes: u64 = 0,
        /// The lineage of this rank's state.
        lineage: u64 = 0,
        /// The groups of the last quorum this rank could not reach.
        unreachable: Vec<String> = Vec::new(),
        /// This rank's state was read from storage (a snapshot).
        resumed: bool = false,
    }
}

#[pymethods]
impl QuorumRequest {
    #[new]
    #[pyo3(
        signature = (**fields),
        text_signature = "(*, group_rank, step, timeout, state_address='', shrink_only=False, \
                          state_quorum_id=0, torn=False, state_refused=None, healed_bytes=0, \
                          lineage=0, unreachable=..., resumed=False)"
    )]
    fn new(fields: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let request: Self = Given::new("QuorumRequest", fields)?.only()?;
        unsigned::<u32>("group_rank", request.group_rank)?;
        seconds("timeout", request.timeout)?;
        Ok(request)
    }

    fn __repr__(&self) -> String {
        format!("{self:?}")
    }
}

impl QuorumRequest {
    /// The request as the wire carries it.
    fn wire(&self) -> PyResult<proto::ManagerQuorumRequest> {
        Ok(proto::ManagerQuorumRequest {
            group_rank: unsigned("group_rank", self.group_rank)?,
            step: self.step,
            state_address: self.state_address.clone(),
            shrink_only: self.shrink_only,
            state_quorum_id: self.state_quorum_id,
            torn: self.torn,
            state_refused: self
                .state_refused
                .iter()
                .flatten()
                .map(|(reason, &count)| proto::RefusalCount {
                    reason: reason.clone(),
                    count,
                })
                .collect(),
            healed_bytes: self.healed_bytes,
            lineage: self.lineage,
            unreachable: self.unreachable.clone(),
            resumed: self.resumed,
            ..Default::default()
        })
    }
}

type EventQueue = Arc<tokio::sync::Mutex<mpsc::Receiver<proto::MembershipLost>>>;

type QuorumAnswer = Result<proto::ManagerQuorumResponse, crate::Error>;

/// A quorum asked for by `ManagerClient.start_quorum`, on its way.
#[pyclass(module = "phalanx._core", frozen)]
pub struct PendingQuorum {
    answered: Mutex<Option<oneshot::Receiver<QuorumAnswer>>>,
}

#[pymethods]
impl PendingQuorum {
    /// Waits for the quorum (its own timeout bounds the wait) and returns it, or
    /// raises as `ManagerClient.quorum()` does. It can be taken once.
    fn result(&self, py: Python<'_>) -> PyResult<QuorumResult> {
        let answered = self
            .answered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| {
                PyRuntimeError::new_err(
                    "this quorum was taken already: result() answers once; keep what it returned",
                )
            })?;
        wait(py, async move {
            answered.await.unwrap_or_else(|_| {
                Err(crate::Error::Rpc(tonic::Status::unavailable(
                    "the phalanx runtime stopped before the quorum came",
                )))
            })
        })
    }
}

keywords! {
    /// What a rank's vote says besides yes or no: the quorum its step ran in (0: the
    /// one the group's ranks were last handed), that its heal failed part way, that
    /// it asks the group to snapshot the state the step commits.
    struct BallotKeywords {
        quorum_id: u64 = 0,
        torn: bool = false,
        snapshot: bool = false,
    }
}

/// How long a progress report may take: a rank reports every heartbeat interval, and
/// a report that cannot get through is superseded by the next one.
const PROGRESS_REPORT_TIMEOUT: Duration = Duration::from_secs(1);

/// One rank's connection to its group's manager server.
#[pyclass(module = "phalanx._core", frozen)]
pub struct ManagerClient {
    inner: client::ManagerClient,
    events: Mutex<Option<EventQueue>>,
    eviction_exit: eviction::Armed,
}

#[pymethods]
impl ManagerClient {
    #[new]
    #[pyo3(signature = (address, token = None, connect_timeout = 5.0, server = None))]
    fn new(
        py: Python<'_>,
        address: &str,
        token: Option<String>,
        connect_timeout: f64,
        server: Option<Bound<'_, ManagerServer>>,
    ) -> PyResult<Self> {
        let mut inner = connect(py, token, connect_timeout, |token, timeout| {
            client::ManagerClient::new(address, token, timeout)
        })?;
        if let Some(server) = server {
            let server = server.get();
            if server.address != address {
                return Err(PyValueError::new_err(format!(
                    "the manager server given serves {}, not {address}: pass the server \
                     this process hosts at the address the client connects to",
                    server.address
                )));
            }
            inner = inner.in_process(server.local.clone());
        }
        Ok(ManagerClient {
            inner,
            events: Mutex::new(None),
            eviction_exit: Arc::default(),
        })
    }

    /// Asks for the quorum `request` names; every rank of the group must ask for the
    /// same step.
    fn quorum(&self, py: Python<'_>, request: &Bound<'_, QuorumRequest>) -> PyResult<QuorumResult> {
        self.start_quorum(request)?.result(py)
    }

    /// `quorum()` in the background: returns at once, and `result()` of what it
    /// returns waits for the quorum. Ask before the forward pass, take it after.
    fn start_quorum(&self, request: &Bound<'_, QuorumRequest>) -> PyResult<PendingQuorum> {
        let request = request.get();
        let timeout = seconds("timeout", request.timeout)?;
        let request = request.wire()?;
        let client = self.inner.clone();
        let (answer, answered) = oneshot::channel();
        control().spawn(async move {
            let _ = answer.send(client.quorum(request, timeout).await);
        });
        Ok(PendingQuorum {
            answered: Mutex::new(Some(answered)),
        })
    }

    /// The group's decision for `step`: commit only if every rank voted yes in time
    /// and the group still holds the lighthouse's lease of the step's quorum.
    /// `quorum_id` (0: the one the group's ranks were last handed) names that quorum;
    /// `torn` says this rank's heal failed part way; `snapshot` asks the group to
    /// snapshot the state the step commits.
    #[pyo3(
        signature = (group_rank, step, vote, timeout, **ballot),
        text_signature = "($self, group_rank, step, vote, timeout, *, quorum_id=0, torn=False, \
                          snapshot=False)"
    )]
    fn should_commit(
        &self,
        py: Python<'_>,
        group_rank: i64,
        step: i64,
        vote: bool,
        timeout: f64,
        ballot: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<CommitDecision> {
        let ballot: BallotKeywords = Given::new("should_commit", ballot)?.only()?;
        let timeout = seconds("timeout", timeout)?;
        let vote = proto::ShouldCommitRequest {
            group_rank: unsigned("group_rank", group_rank)?,
            step,
            vote,
            quorum_id: ballot.quorum_id,
            torn: ballot.torn,
            snapshot: ballot.snapshot,
            ..Default::default()
        };
        let client = self.inner.clone();
        wait(py, async move { client.should_commit(vote, timeout).await })
    }

    /// Reports what `group_rank`'s training thread did lately: `marks` counts its
    /// progress (only a change matters); `wait_left` (seconds), when given, says it
    /// sits in a wait on the other groups that ends within that long. The group's
    /// heartbeat carries the sum of its ranks' reports, and the lighthouse evicts a
    /// group that made no progress for `stall_timeout` while its peers wait on it.
    #[pyo3(signature = (group_rank, marks, wait_left, stall_timeout, step_time = 0.0))]
    fn report_progress(
        &self,
        py: Python<'_>,
        group_rank: i64,
        marks: u64,
        wait_left: Option<f64>,
        stall_timeout: f64,
        step_time: f64,
    ) -> PyResult<()> {
        let stall_timeout = seconds("stall_timeout", stall_timeout)?;
        // At most a day: the server refuses longer ones.
        let day = 86_400.0;
        let millis = |d: Duration| d.as_millis().min(u128::from(u64::MAX)) as u64;
        let wait_left = wait_left
            .map(|w| seconds_or_zero("wait_left", w.min(day)))
            .transpose()?;
        let report = proto::ProgressReport {
            group_rank: unsigned("group_rank", group_rank)?,
            marks,
            waiting: wait_left.is_some(),
            wait_left_ms: wait_left.map_or(0, millis),
            stall_timeout_ms: millis(stall_timeout.min(Duration::from_secs_f64(day))),
            step_time_ms: millis(seconds_or_zero("step_time", step_time.min(day))?),
            ..Default::default()
        };
        let client = self.inner.clone();
        wait(py, async move {
            client.progress(report, PROGRESS_REPORT_TIMEOUT).await
        })
    }

    /// Starts listening for membership-loss events (idempotent). Events that happen
    /// before the first call are not seen.
    #[pyo3(signature = (timeout = 5.0))]
    fn subscribe_events(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        if self.events_slot().is_some() {
            return Ok(());
        }
        let timeout = seconds("timeout", timeout)?;
        let client = self.inner.clone();
        let mut stream = wait(py, async move { client.events(timeout).await })?;
        let (tx, rx) = mpsc::channel(64);
        let eviction_exit = self.eviction_exit.clone();
        control().spawn(async move {
            while let Ok(Some(event)) = stream.message().await {
                if let Some(lost) = event.membership_lost {
                    eviction::heard(&eviction_exit, &lost);
                    if tx.send(lost).await.is_err() {
                        return;
                    }
                }
            }
        });
        let mut slot = self.events.lock().unwrap_or_else(|e| e.into_inner());
        slot.get_or_insert_with(|| Arc::new(tokio::sync::Mutex::new(rx)));
        Ok(())
    }

    /// Ends the process with `status` if it still lives `grace` seconds after the
    /// lighthouse evicted `replica_id` as stalled, first raising `dump_signal` (on
    /// which faulthandler dumps every thread's stack; 0: none). The last resort of a
    /// rank whose interpreter is frozen; listens for events from now on.
    #[pyo3(signature = (replica_id, grace, status, dump_signal = 0))]
    fn arm_eviction_exit(
        &self,
        py: Python<'_>,
        replica_id: String,
        grace: f64,
        status: i32,
        dump_signal: i32,
    ) -> PyResult<()> {
        if !(0..=255).contains(&status) || !(0..=libc::SIGRTMAX()).contains(&dump_signal) {
            return Err(PyValueError::new_err(format!(
                "arm_eviction_exit: status {status} or dump_signal {dump_signal} is out of \
                 range: pass an exit status from 0 to 255 and a signal number from 1 to {} \
                 (0: no dump)",
                libc::SIGRTMAX()
            )));
        }
        let exit = eviction::EvictionExit {
            replica_id,
            grace: seconds("grace", grace)?,
            dump_signal,
            status,
        };
        *self.eviction_exit.lock().unwrap_or_else(|e| e.into_inner()) = Some(exit);
        self.subscribe_events(py, 5.0)
    }

    /// Cancels `arm_eviction_exit` (the interpreter acted on the eviction itself).
    fn disarm_eviction_exit(&self) {
        *self.eviction_exit.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// The next membership-loss event, or None after `timeout` seconds (0: don't wait).
    #[pyo3(signature = (timeout = 0.0))]
    fn next_event(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<MembershipLost>> {
        self.subscribe_events(py, 5.0)?;
        let Some(events) = self.events_slot() else {
            return Ok(None);
        };
        let wait_for = if timeout > 0.0 {
            seconds("timeout", timeout)?
        } else {
            Duration::ZERO
        };
        let event = wait(py, async move {
            let mut rx = events.lock().await;
            // Elapsed: no event within the timeout.
            Ok(tokio::time::timeout(wait_for, rx.recv())
                .await
                .unwrap_or_default())
        })?;
        Ok(event)
    }
}

impl ManagerClient {
    fn events_slot(&self) -> Option<EventQueue> {
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// The manager server's defaults by option name, durations in seconds.
fn defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);
    let interval = ManagerOptions::DEFAULT_HEARTBEAT_INTERVAL;
    out.set_item("heartbeat_interval", interval.as_secs_f64())?;
    let connect = ManagerOptions::DEFAULT_CONNECT_TIMEOUT;
    out.set_item("connect_timeout", connect.as_secs_f64())?;
    out.set_item("init_sync", ManagerOptions::DEFAULT_INIT_SYNC)?;
    Ok(out)
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("MANAGER_DEFAULTS", defaults(m.py())?)?;
    m.add_class::<ManagerServer>()?;
    m.add_class::<ManagerClient>()?;
    m.add_class::<QuorumRequest>()?;
    m.add_class::<PendingQuorum>()?;
    m.add("STORE_REPLICA_ID_KEY", manager::REPLICA_ID_KEY)?;
    Ok(())
}
