//! `phalanx._core`: the lighthouse, the manager server and their clients for Python.
//!
//! Few, coarse calls. Every blocking call releases the GIL, wakes every 100 ms to let
//! Ctrl-C through, and has a deadline. Errors arrive as the Python exception that
//! fits: `TimeoutError`, `ConnectionError`, `PermissionError` (wrong or missing job
//! token), `ValueError` (bad input), each with a message that says what to do.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use pyo3::exceptions::{
    PyConnectionError, PyKeyboardInterrupt, PyPermissionError, PyRuntimeError, PyTimeoutError,
    PyValueError,
};
use pyo3::prelude::*;
use tokio::runtime::Runtime;
use tokio::sync::mpsc;

use crate::auth::JobToken;
use crate::cli::LighthouseArgs;
use crate::client;
use crate::gate::{GateLimits, GroupRefusals};
use crate::lighthouse::{self, LighthouseOptions};
use crate::manager::{self, ManagerOptions};
use crate::proto;
use crate::server::ServerHandle;
use crate::{Error, ErrorKind};

/// One runtime for the whole process, started on first use.
fn runtime() -> &'static Runtime {
    static RUNTIME: OnceLock<Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("phalanx-core")
            .enable_all()
            .build()
            .expect("cannot start the phalanx runtime")
    })
}

fn to_py(e: Error) -> PyErr {
    let message = e.message();
    match e.kind() {
        ErrorKind::Timeout => PyTimeoutError::new_err(message),
        ErrorKind::Connection => PyConnectionError::new_err(message),
        ErrorKind::Permission => PyPermissionError::new_err(message),
        ErrorKind::InvalidInput => PyValueError::new_err(message),
        ErrorKind::Other => PyRuntimeError::new_err(message),
    }
}

/// Runs `fut` to completion without the GIL, checking for Ctrl-C in between.
fn wait<T: Send>(
    py: Python<'_>,
    fut: impl Future<Output = Result<T, Error>> + Send,
) -> PyResult<T> {
    let mut fut = Box::pin(fut);
    loop {
        let step = py.detach(|| {
            runtime().block_on(async {
                tokio::time::timeout(Duration::from_millis(100), &mut fut).await
            })
        });
        match step {
            Ok(result) => return result.map_err(to_py),
            Err(_) => py.check_signals()?,
        }
    }
}

/// A count or id from Python, checked into the unsigned type the core uses.
fn unsigned<T: TryFrom<i64>>(name: &str, value: i64) -> PyResult<T> {
    T::try_from(value).map_err(|_| {
        PyValueError::new_err(format!(
            "{name} must be 0 or more (and fit the wire), got {value}"
        ))
    })
}

fn seconds(name: &str, value: f64) -> PyResult<Duration> {
    if !value.is_finite() || value <= 0.0 {
        return Err(PyValueError::new_err(format!(
            "{name} must be a positive number of seconds, got {value}"
        )));
    }
    Ok(Duration::from_secs_f64(value))
}

macro_rules! debug_repr {
    ($($t:ty),*) => {$(
        #[pymethods]
        impl $t {
            fn __repr__(&self) -> String {
                format!("{self:?}")
            }
        }
    )*};
}

/// A replica group as it took part in a quorum.
#[pyclass(module = "phalanx._core", frozen, get_all)]
#[derive(Clone, Debug)]
pub struct Member {
    replica_id: String,
    manager_address: String,
    store_address: String,
    step: i64,
    world_size: u32,
    shrink_only: bool,
    commit_failures: u32,
    state_addresses: Vec<String>,
    state_quorum_id: u64,
    torn: bool,
}

impl From<proto::Member> for Member {
    fn from(m: proto::Member) -> Self {
        Member {
            replica_id: m.replica_id,
            manager_address: m.manager_address,
            store_address: m.store_address,
            step: m.step,
            world_size: m.world_size,
            shrink_only: m.shrink_only,
            commit_failures: m.commit_failures,
            state_addresses: m.state_addresses,
            state_quorum_id: m.state_quorum_id,
            torn: m.torn,
        }
    }
}

/// A quorum as the lighthouse issued it.
#[pyclass(module = "phalanx._core", frozen, get_all)]
#[derive(Clone, Debug)]
pub struct Quorum {
    quorum_id: u64,
    participants: Vec<Member>,
    issued_at_unix_ms: i64,
}

/// An up-to-date peer a healing rank downloads from.
#[pyclass(module = "phalanx._core", frozen, get_all)]
#[derive(Clone, Debug)]
pub struct RecoverySource {
    replica_id: String,
    state_address: String,
}

/// One rank's answer to a quorum request.
#[pyclass(module = "phalanx._core", frozen, get_all)]
#[derive(Clone, Debug)]
pub struct QuorumResult {
    quorum_id: u64,
    replica_rank: u32,
    replica_world_size: u32,
    participants: Vec<Member>,
    max_step: i64,
    max_state_quorum_id: u64,
    heal: bool,
    recovery_sources: Vec<RecoverySource>,
    contributors: u32,
    serves_healers: bool,
    store_address: String,
    store_prefix: String,
}

/// A group's decision on a step.
#[pyclass(module = "phalanx._core", frozen, get_all)]
#[derive(Clone, Debug)]
pub struct CommitDecision {
    /// Every rank voted yes in time and the group still counts in the step's quorum.
    commit: bool,
    /// Some rank of the group holds a torn state (its heal failed part way).
    torn: bool,
}

#[pymethods]
impl CommitDecision {
    fn __bool__(&self) -> bool {
        self.commit
    }

    fn __repr__(&self) -> String {
        format!("{self:?}")
    }
}

/// Members of the current quorum died; abandon the step in flight.
#[pyclass(module = "phalanx._core", frozen, get_all)]
#[derive(Clone, Debug)]
pub struct MembershipLost {
    quorum_id: u64,
    lost: Vec<String>,
    cause: String,
}

impl From<proto::MembershipLost> for MembershipLost {
    fn from(m: proto::MembershipLost) -> Self {
        MembershipLost {
            quorum_id: m.quorum_id,
            lost: m.lost,
            cause: m.cause,
        }
    }
}

#[pyclass(module = "phalanx._core", frozen, get_all)]
#[derive(Clone, Debug)]
pub struct ReplicaStatus {
    replica_id: String,
    connected: bool,
    joined: bool,
    in_quorum: bool,
    step: i64,
    heartbeat_age_ms: u64,
    peer: String,
}

#[pyclass(module = "phalanx._core", frozen, get_all)]
#[derive(Clone, Debug)]
pub struct LighthouseStatus {
    quorum_id: u64,
    quorum_members: Vec<String>,
    replicas: Vec<ReplicaStatus>,
    waiting_for: String,
    quorums_issued: u64,
    uptime_ms: u64,
    min_replicas: u32,
    join_timeout_ms: u64,
    heartbeat_timeout_ms: u64,
}

debug_repr!(
    Member,
    Quorum,
    RecoverySource,
    QuorumResult,
    MembershipLost,
    ReplicaStatus,
    LighthouseStatus
);

/// Stops a server held by a Python object, once.
fn stop(py: Python<'_>, slot: &Mutex<Option<ServerHandle>>) -> PyResult<()> {
    let handle = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(handle) = handle {
        wait(py, async move {
            handle.shutdown().await;
            Ok(())
        })?;
    }
    Ok(())
}

/// The lighthouse of a job, running in this process.
#[pyclass(module = "phalanx._core", frozen)]
pub struct LighthouseServer {
    handle: Mutex<Option<ServerHandle>>,
    #[pyo3(get)]
    address: String,
}

#[pymethods]
impl LighthouseServer {
    #[new]
    #[pyo3(signature = (bind = "127.0.0.1:0", min_replicas = 1, join_timeout = 1.0, heartbeat_timeout = 2.0, token = None, insecure = false))]
    fn new(
        py: Python<'_>,
        bind: &str,
        min_replicas: i64,
        join_timeout: f64,
        heartbeat_timeout: f64,
        token: Option<String>,
        insecure: bool,
    ) -> PyResult<Self> {
        let options = LighthouseOptions {
            bind: bind.to_string(),
            min_replicas: unsigned("min_replicas", min_replicas)?,
            join_timeout: seconds("join_timeout", join_timeout)?,
            heartbeat_timeout: seconds("heartbeat_timeout", heartbeat_timeout)?,
            token: JobToken::new(token),
            connections: GateLimits::RPC,
            insecure,
        };
        let handle = wait(py, lighthouse::serve(options))?;
        let addr = handle.local_addr();
        let address = crate::server::advertised_address(addr, None);
        Ok(LighthouseServer {
            handle: Mutex::new(Some(handle)),
            address,
        })
    }

    /// The status page, for a browser.
    #[getter]
    fn status_url(&self) -> String {
        format!("http://{}/", self.address)
    }

    /// Stops serving; open calls get a short grace. Idempotent.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        stop(py, &self.handle)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _exc: Bound<'_, PyAny>,
        _v: Bound<'_, PyAny>,
        _tb: Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        self.shutdown(py).map(|()| false)
    }
}

fn token_of(token: Option<String>) -> JobToken {
    JobToken::new(token)
}

#[pyclass(module = "phalanx._core", frozen)]
pub struct LighthouseClient {
    inner: client::LighthouseClient,
}

#[pymethods]
impl LighthouseClient {
    #[new]
    #[pyo3(signature = (address, token = None, connect_timeout = 5.0))]
    fn new(
        py: Python<'_>,
        address: &str,
        token: Option<String>,
        connect_timeout: f64,
    ) -> PyResult<Self> {
        let connect_timeout = seconds("connect_timeout", connect_timeout)?;
        let token = token_of(token);
        // Building a channel needs a runtime context.
        let inner = py
            .detach(|| {
                let _enter = runtime().enter();
                client::LighthouseClient::new(address, &token, connect_timeout)
            })
            .map_err(to_py)?;
        Ok(LighthouseClient { inner })
    }

    /// Waits until a quorum that includes `replica_id` is issued.
    #[pyo3(signature = (replica_id, timeout, step = 0, world_size = 1, manager_address = String::new(), store_address = String::new(), state_addresses = Vec::new(), shrink_only = false, commit_failures = 0, last_quorum_id = 0))]
    #[allow(clippy::too_many_arguments)]
    fn quorum(
        &self,
        py: Python<'_>,
        replica_id: String,
        timeout: f64,
        step: i64,
        world_size: i64,
        manager_address: String,
        store_address: String,
        state_addresses: Vec<String>,
        shrink_only: bool,
        commit_failures: i64,
        last_quorum_id: i64,
    ) -> PyResult<Quorum> {
        let timeout = seconds("timeout", timeout)?;
        let member = proto::Member {
            replica_id,
            manager_address,
            store_address,
            step,
            world_size: unsigned("world_size", world_size)?,
            shrink_only,
            commit_failures: unsigned("commit_failures", commit_failures)?,
            state_addresses,
            ..Default::default()
        };
        let last_quorum_id = unsigned("last_quorum_id", last_quorum_id)?;
        let client = self.inner.clone();
        let q = wait(py, async move {
            client.quorum(member, last_quorum_id, timeout).await
        })?;
        Ok(Quorum {
            quorum_id: q.quorum_id,
            participants: q.participants.into_iter().map(Into::into).collect(),
            issued_at_unix_ms: q.issued_at_unix_ms,
        })
    }

    #[pyo3(signature = (timeout = 5.0))]
    fn status(&self, py: Python<'_>, timeout: f64) -> PyResult<LighthouseStatus> {
        let timeout = seconds("timeout", timeout)?;
        let client = self.inner.clone();
        let s = wait(py, async move { client.status(timeout).await })?;
        Ok(LighthouseStatus {
            quorum_id: s.quorum_id,
            quorum_members: s.quorum_members,
            replicas: s
                .replicas
                .into_iter()
                .map(|r| ReplicaStatus {
                    replica_id: r.replica_id,
                    connected: r.connected,
                    joined: r.joined,
                    in_quorum: r.in_quorum,
                    step: r.step,
                    heartbeat_age_ms: r.heartbeat_age_ms,
                    peer: r.peer,
                })
                .collect(),
            waiting_for: s.waiting_for,
            quorums_issued: s.quorums_issued,
            uptime_ms: s.uptime_ms,
            min_replicas: s.min_replicas,
            join_timeout_ms: s.join_timeout_ms,
            heartbeat_timeout_ms: s.heartbeat_timeout_ms,
        })
    }
}

/// A replica group's manager server, hosted by its rank 0.
#[pyclass(module = "phalanx._core", frozen)]
pub struct ManagerServer {
    handle: Mutex<Option<ServerHandle>>,
    #[pyo3(get)]
    address: String,
    refusals: Arc<GroupRefusals>,
}

#[pymethods]
impl ManagerServer {
    #[new]
    #[pyo3(signature = (replica_id, lighthouse_address, world_size = 1, bind = "127.0.0.1:0", store_address = String::new(), advertise_host = None, heartbeat_interval = 0.1, connect_timeout = 5.0, init_sync = true, token = None, also_bind = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        replica_id: String,
        lighthouse_address: String,
        world_size: i64,
        bind: &str,
        store_address: String,
        advertise_host: Option<String>,
        heartbeat_interval: f64,
        connect_timeout: f64,
        init_sync: bool,
        token: Option<String>,
        also_bind: Option<String>,
    ) -> PyResult<Self> {
        let options = ManagerOptions {
            replica_id,
            lighthouse_address,
            bind: bind.to_string(),
            also_bind,
            advertise_host,
            store_address,
            world_size: unsigned("world_size", world_size)?,
            heartbeat_interval: seconds("heartbeat_interval", heartbeat_interval)?,
            connect_timeout: seconds("connect_timeout", connect_timeout)?,
            init_sync,
            token: token_of(token),
            connections: GateLimits::RPC,
        };
        let handle = wait(py, manager::serve(options))?;
        Ok(ManagerServer {
            handle: Mutex::new(Some(handle.server)),
            address: handle.address,
            refusals: handle.refusals,
        })
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

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _exc: Bound<'_, PyAny>,
        _v: Bound<'_, PyAny>,
        _tb: Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        self.shutdown(py).map(|()| false)
    }
}

type EventQueue = Arc<tokio::sync::Mutex<mpsc::Receiver<proto::MembershipLost>>>;

/// One rank's connection to its group's manager server.
#[pyclass(module = "phalanx._core", frozen)]
pub struct ManagerClient {
    inner: client::ManagerClient,
    events: Mutex<Option<EventQueue>>,
}

#[pymethods]
impl ManagerClient {
    #[new]
    #[pyo3(signature = (address, token = None, connect_timeout = 5.0))]
    fn new(
        py: Python<'_>,
        address: &str,
        token: Option<String>,
        connect_timeout: f64,
    ) -> PyResult<Self> {
        let connect_timeout = seconds("connect_timeout", connect_timeout)?;
        let token = token_of(token);
        let inner = py
            .detach(|| {
                let _enter = runtime().enter();
                client::ManagerClient::new(address, &token, connect_timeout)
            })
            .map_err(to_py)?;
        Ok(ManagerClient {
            inner,
            events: Mutex::new(None),
        })
    }

    /// Asks for the quorum of `step` on behalf of `group_rank`; every rank of the group
    /// must ask for the same step.
    #[pyo3(signature = (group_rank, step, timeout, state_address = String::new(), shrink_only = false, state_quorum_id = 0, torn = false, state_refused = None))]
    #[allow(clippy::too_many_arguments)]
    fn quorum(
        &self,
        py: Python<'_>,
        group_rank: i64,
        step: i64,
        timeout: f64,
        state_address: String,
        shrink_only: bool,
        state_quorum_id: u64,
        torn: bool,
        state_refused: Option<HashMap<String, u64>>,
    ) -> PyResult<QuorumResult> {
        let timeout = seconds("timeout", timeout)?;
        let request = proto::ManagerQuorumRequest {
            group_rank: unsigned("group_rank", group_rank)?,
            step,
            state_address,
            shrink_only,
            state_quorum_id,
            torn,
            state_refused: state_refused
                .unwrap_or_default()
                .into_iter()
                .map(|(reason, count)| proto::RefusalCount { reason, count })
                .collect(),
            ..Default::default()
        };
        let client = self.inner.clone();
        let r = wait(py, async move { client.quorum(request, timeout).await })?;
        Ok(QuorumResult {
            quorum_id: r.quorum_id,
            replica_rank: r.replica_rank,
            replica_world_size: r.replica_world_size,
            participants: r.participants.into_iter().map(Into::into).collect(),
            max_step: r.max_step,
            max_state_quorum_id: r.max_state_quorum_id,
            heal: r.heal,
            recovery_sources: r
                .recovery_sources
                .into_iter()
                .map(|s| RecoverySource {
                    replica_id: s.replica_id,
                    state_address: s.state_address,
                })
                .collect(),
            contributors: r.contributors,
            serves_healers: r.serves_healers,
            store_address: r.store_address,
            store_prefix: r.store_prefix,
        })
    }

    /// The group's decision for `step`: commit only if every rank voted yes in time
    /// and the group still holds the lighthouse's lease of the step's quorum.
    /// `quorum_id` (0: the one the group's ranks were last handed) names that quorum;
    /// `torn` says this rank's heal failed part way.
    #[pyo3(signature = (group_rank, step, vote, timeout, quorum_id = 0, torn = false))]
    #[allow(clippy::too_many_arguments)]
    fn should_commit(
        &self,
        py: Python<'_>,
        group_rank: i64,
        step: i64,
        vote: bool,
        timeout: f64,
        quorum_id: u64,
        torn: bool,
    ) -> PyResult<CommitDecision> {
        let timeout = seconds("timeout", timeout)?;
        let vote = proto::ShouldCommitRequest {
            group_rank: unsigned("group_rank", group_rank)?,
            step,
            vote,
            quorum_id,
            torn,
            ..Default::default()
        };
        let client = self.inner.clone();
        let d = wait(py, async move { client.should_commit(vote, timeout).await })?;
        Ok(CommitDecision {
            commit: d.commit,
            torn: d.torn,
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
        runtime().spawn(async move {
            while let Ok(Some(event)) = stream.message().await {
                if let Some(lost) = event.membership_lost {
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
        Ok(event.map(Into::into))
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

/// A connection to a replica group's rendezvous store, served by the group's manager
/// server behind the job token. `timeout` bounds every call; `get` and `wait` wait that
/// long (or their own `timeout`) for the keys, and for a store that is still starting.
#[pyclass(module = "phalanx._core", frozen)]
pub struct StoreClient {
    inner: crate::store::client::StoreClient,
    timeout: Duration,
}

#[pymethods]
impl StoreClient {
    #[new]
    #[pyo3(signature = (address, token = None, timeout = 30.0, connect_timeout = 5.0))]
    fn new(
        address: &str,
        token: Option<String>,
        timeout: f64,
        connect_timeout: f64,
    ) -> PyResult<Self> {
        let timeout = seconds("timeout", timeout)?;
        let connect_timeout = seconds("connect_timeout", connect_timeout)?;
        let token = token_of(token);
        // Building a channel needs a runtime context.
        let inner = {
            let _enter = runtime().enter();
            crate::store::client::StoreClient::new(address, &token, connect_timeout)
        }
        .map_err(to_py)?;
        Ok(StoreClient { inner, timeout })
    }

    #[getter]
    fn address(&self) -> String {
        self.inner.address().to_string()
    }

    /// The deadline of every call, in seconds.
    #[getter]
    fn timeout(&self) -> f64 {
        self.timeout.as_secs_f64()
    }

    fn set(&self, py: Python<'_>, key: String, value: &[u8]) -> PyResult<()> {
        let (client, timeout) = (self.inner.clone(), self.timeout);
        let value = bytes::Bytes::copy_from_slice(value);
        wait(py, async move { client.set(key, value, timeout).await })
    }

    #[pyo3(signature = (key, timeout = None))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        key: String,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let timeout = self.wait_time(timeout)?;
        let client = self.inner.clone();
        let value = wait(py, async move { client.get(&key, timeout).await })?;
        Ok(pyo3::types::PyBytes::new(py, &value))
    }

    fn add(&self, py: Python<'_>, key: String, delta: i64) -> PyResult<i64> {
        let (client, timeout) = (self.inner.clone(), self.timeout);
        wait(py, async move { client.add(key, delta, timeout).await })
    }

    fn compare_set<'py>(
        &self,
        py: Python<'py>,
        key: String,
        expected: &[u8],
        desired: &[u8],
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let (client, timeout) = (self.inner.clone(), self.timeout);
        let (expected, desired) = (expected.to_vec(), bytes::Bytes::copy_from_slice(desired));
        let current = wait(py, async move {
            client.compare_set(key, expected, desired, timeout).await
        })?;
        Ok(pyo3::types::PyBytes::new(py, &current))
    }

    fn check(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<bool> {
        let (client, timeout) = (self.inner.clone(), self.timeout);
        wait(py, async move { client.check(keys, timeout).await })
    }

    /// Returns once every key is set, with their values when they are small (else
    /// an empty list).
    #[pyo3(signature = (keys, timeout = None))]
    fn wait<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        timeout: Option<f64>,
    ) -> PyResult<Vec<Bound<'py, pyo3::types::PyBytes>>> {
        let timeout = self.wait_time(timeout)?;
        let client = self.inner.clone();
        let values = wait(py, async move { client.wait(&keys, timeout).await })?;
        Ok(values
            .iter()
            .map(|v| pyo3::types::PyBytes::new(py, v))
            .collect())
    }

    fn delete_key(&self, py: Python<'_>, key: String) -> PyResult<bool> {
        let (client, timeout) = (self.inner.clone(), self.timeout);
        wait(py, async move { client.delete_key(key, timeout).await })
    }

    fn num_keys(&self, py: Python<'_>) -> PyResult<i64> {
        let (client, timeout) = (self.inner.clone(), self.timeout);
        wait(py, async move { client.num_keys(timeout).await })
    }
}

impl StoreClient {
    fn wait_time(&self, timeout: Option<f64>) -> PyResult<Duration> {
        timeout.map_or(Ok(self.timeout), |t| seconds("timeout", t))
    }
}

/// `phalanx lighthouse ARGS…`: parses the arguments like the standalone binary and
/// serves until SIGINT or SIGTERM. Returns the process exit code.
#[pyfunction]
fn run_lighthouse_cli(py: Python<'_>, argv: Vec<String>) -> PyResult<i32> {
    use clap::Parser;
    let args = match LighthouseArgs::try_parse_from(argv) {
        Ok(args) => args,
        Err(e) => {
            let code = e.exit_code();
            let _ = e.print();
            return Ok(code);
        }
    };
    let served = py.detach(|| runtime().block_on(crate::cli::run_lighthouse(args)));
    // A SIGINT that stopped the lighthouse also reached Python's own handler; it has
    // been acted on, so it must not come back as a KeyboardInterrupt traceback.
    if let Err(e) = py.check_signals() {
        if !e.is_instance_of::<PyKeyboardInterrupt>(py) {
            return Err(e);
        }
    }
    // Like the standalone binary: a line that says what to fix, not a traceback.
    match served {
        Ok(()) => Ok(0),
        Err(e) => {
            eprintln!("phalanx lighthouse: {e}");
            Ok(1)
        }
    }
}

/// The job token given by `token` or `token_file`, else by `env_token` or
/// `env_token_file` (PHALANX_TOKEN, PHALANX_TOKEN_FILE); None when none is. The rules
/// are the lighthouse command's: one of each pair, a token file only its owner can
/// read, printable ASCII.
#[pyfunction]
#[pyo3(signature = (token = None, token_file = None, env_token = None, env_token_file = None))]
fn resolve_token(
    token: Option<String>,
    token_file: Option<std::path::PathBuf>,
    env_token: Option<String>,
    env_token_file: Option<std::path::PathBuf>,
) -> PyResult<Option<String>> {
    use crate::auth::TokenSource;
    crate::auth::resolve_token(
        TokenSource {
            token: token.as_deref(),
            file: token_file.as_deref(),
        },
        TokenSource {
            token: env_token.as_deref(),
            file: env_token_file.as_deref(),
        },
    )
    .map_err(to_py)
}

/// Benchmark load: `replicas` groups ask for `rounds` quorums in lock-step. Returns
/// (seconds from the last request to the last answer, membership changed, quorum id)
/// for each round.
#[pyfunction]
#[pyo3(signature = (address, replicas, rounds, change_every = 0, timeout = 30.0, token = None))]
fn bench_quorum_rounds(
    py: Python<'_>,
    address: String,
    replicas: usize,
    rounds: usize,
    change_every: usize,
    timeout: f64,
    token: Option<String>,
) -> PyResult<Vec<(f64, bool, u64)>> {
    let timeout = seconds("timeout", timeout)?;
    let token = token_of(token);
    let timings = wait(py, async move {
        crate::loadgen::quorum_rounds(&address, &token, replicas, rounds, change_every, timeout)
            .await
    })?;
    Ok(timings
        .into_iter()
        .map(|t| (t.latency.as_secs_f64(), t.changed, t.quorum_id))
        .collect())
}

/// Benchmark load: `replicas` heartbeat streams at `hz` over `connections`
/// connections for `duration` seconds. Returns the beats sent.
#[pyfunction]
#[pyo3(signature = (address, replicas, hz, duration, connections = 64, token = None))]
fn bench_heartbeats(
    py: Python<'_>,
    address: String,
    replicas: usize,
    hz: f64,
    duration: f64,
    connections: usize,
    token: Option<String>,
) -> PyResult<u64> {
    let duration = seconds("duration", duration)?;
    let token = token_of(token);
    wait(py, async move {
        crate::loadgen::heartbeats(&address, &token, replicas, hz, connections, duration).await
    })
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("PROTOCOL_VERSION", proto::PROTOCOL_VERSION)?;
    m.add_class::<LighthouseServer>()?;
    m.add_class::<LighthouseClient>()?;
    m.add_class::<ManagerServer>()?;
    m.add_class::<ManagerClient>()?;
    m.add_class::<StoreClient>()?;
    m.add("STORE_REPLICA_ID_KEY", manager::REPLICA_ID_KEY)?;
    m.add_class::<Member>()?;
    m.add_class::<Quorum>()?;
    m.add_class::<RecoverySource>()?;
    m.add_class::<QuorumResult>()?;
    m.add_class::<CommitDecision>()?;
    m.add_class::<MembershipLost>()?;
    m.add_class::<LighthouseStatus>()?;
    m.add_class::<ReplicaStatus>()?;
    m.add_function(wrap_pyfunction!(run_lighthouse_cli, m)?)?;
    m.add_function(wrap_pyfunction!(resolve_token, m)?)?;
    m.add_function(wrap_pyfunction!(bench_quorum_rounds, m)?)?;
    m.add_function(wrap_pyfunction!(bench_heartbeats, m)?)?;
    crate::python_state::register(m)?;
    Ok(())
}
