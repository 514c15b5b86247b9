//! The lighthouse served from Python, its client, and the `phalanx lighthouse` command.

use std::sync::Mutex;

use pyo3::exceptions::{PyKeyboardInterrupt, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::keywords::Given;
use super::runtime::{connect, control, wait};
use super::types::{LighthouseStatus, Quorum};
use super::{job_request, seconds, stop, to_py, unsigned, Server};
use crate::auth::JobToken;
use crate::cli::LighthouseArgs;
use crate::gate::GateLimits;
use crate::lighthouse::set::SetOptions;
use crate::lighthouse::{self, client, JobLimits, LighthouseOptions, Tuning};
use crate::proto;
use crate::server::ServerHandle;

/// The lighthouse of a job, running in this process.
#[pyclass(module = "phalanx._core", frozen, extends = Server)]
pub struct LighthouseServer {
    handle: Mutex<Option<ServerHandle>>,
    #[pyo3(get)]
    address: String,
}

keywords! {
    /// The lighthouse's tuning, as `--min-replicas`, `--join-timeout`, … set it; None:
    /// its default (`LIGHTHOUSE_DEFAULTS`).
    struct TuningKeywords {
        min_replicas: Option<i64> = None,
        join_timeout: Option<f64> = None,
        heartbeat_timeout: Option<f64> = None,
        rollback_after: Option<f64> = None,
        max_groups: Option<i64> = None,
    }
}

keywords! {
    /// This lighthouse's place in a set of them: every member's address, its own
    /// place in the list (from 1), and the file that keeps its Raft term and vote.
    struct SetKeywords {
        peers: Option<Vec<String>> = None,
        id: Option<u64> = None,
        state_file: Option<std::path::PathBuf> = None,
    }
}

keywords! {
    /// How many jobs the lighthouse serves at once, and how long it remembers one
    /// that has no group left; None: `JobLimits::DEFAULT`.
    struct JobLimitKeywords {
        max_jobs: Option<i64> = None,
        forget_jobs_after: Option<f64> = None,
    }
}

impl TuningKeywords {
    /// The tuning given, checked, the defaults filling in.
    fn tuning(&self) -> PyResult<Tuning> {
        let defaults = Tuning::DEFAULT;
        let or =
            |given: Option<f64>, default, name| given.map_or(Ok(default), |s| seconds(name, s));
        Ok(Tuning {
            min_replicas: self
                .min_replicas
                .map_or(Ok(defaults.min_replicas), |n| unsigned("min_replicas", n))?,
            join_timeout: or(self.join_timeout, defaults.join_timeout, "join_timeout")?,
            heartbeat_timeout: or(
                self.heartbeat_timeout,
                defaults.heartbeat_timeout,
                "heartbeat_timeout",
            )?,
            rollback_after: or(
                self.rollback_after,
                defaults.rollback_after,
                "rollback_after",
            )?,
            max_groups: self.max_groups.map_or(Ok(defaults.max_groups), groups)?,
        })
    }
}

impl SetKeywords {
    /// The set this lighthouse is one of; None: it serves alone.
    fn set(&self) -> PyResult<Option<SetOptions>> {
        let peers = self.peers.as_deref().unwrap_or_default();
        crate::cli::set_options(peers, self.id, self.state_file.as_deref()).map_err(to_py)
    }
}

impl JobLimitKeywords {
    /// The limits given, checked, `JobLimits::DEFAULT` filling in.
    fn limits(&self) -> PyResult<JobLimits> {
        let defaults = JobLimits::DEFAULT;
        Ok(JobLimits {
            max_jobs: self
                .max_jobs
                .map_or(Ok(defaults.max_jobs), |n| unsigned("max_jobs", n))?,
            forget_after: self
                .forget_jobs_after
                .map_or(Ok(defaults.forget_after), |s| {
                    seconds("forget_jobs_after", s)
                })?,
        })
    }
}

#[pymethods]
impl LighthouseServer {
    /// None: the lighthouse's default (`LIGHTHOUSE_DEFAULTS`), the command line's too.
    #[new]
    #[pyo3(
        signature = (bind = "127.0.0.1:0", *, token = None, insecure = false, datagrams = true, **options),
        text_signature = "(bind='127.0.0.1:0', *, min_replicas=None, join_timeout=None, \
                          heartbeat_timeout=None, token=None, insecure=False, peers=None, \
                          id=None, state_file=None, rollback_after=None, max_groups=None, \
                          max_jobs=None, forget_jobs_after=None, datagrams=True)"
    )]
    fn new(
        py: Python<'_>,
        bind: &str,
        token: Option<String>,
        insecure: bool,
        datagrams: bool,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let mut given = Given::new("LighthouseServer", options)?;
        let tuning = given.take::<TuningKeywords>()?.tuning()?;
        let set = given.take::<SetKeywords>()?.set()?;
        let jobs = given.take::<JobLimitKeywords>()?.limits()?;
        given.finish()?;
        let options = LighthouseOptions {
            bind: bind.to_string(),
            min_replicas: tuning.min_replicas,
            join_timeout: tuning.join_timeout,
            heartbeat_timeout: tuning.heartbeat_timeout,
            rollback_after: tuning.rollback_after,
            token: JobToken::new(token),
            connections: GateLimits::lighthouse(tuning.max_groups),
            insecure,
            jobs,
            datagrams,
        };
        let handle = wait(py, lighthouse::serve_in_set(options, set))?;
        let addr = handle.local_addr();
        let address = crate::server::advertised_address(addr, None);
        let server = LighthouseServer {
            handle: Mutex::new(Some(handle)),
            address,
        };
        Ok(Server::init(server))
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
}

keywords! {
    /// The group as it joins a quorum (`Member`): its step, its ranks, where its
    /// manager server, store and state servers are, and what it asks of the quorum.
    struct MemberKeywords {
        step: i64 = 0,
        world_size: i64 = 1,
        manager_address: String = String::new(),
        store_address: String = String::new(),
        state_addresses: Vec<String> = Vec::new(),
        shrink_only: bool = false,
        commit_failures: i64 = 0,
    }
}

#[pyclass(module = "phalanx._core", frozen)]
pub struct LighthouseClient {
    inner: client::LighthouseClient,
}

#[pymethods]
impl LighthouseClient {
    #[new]
    #[pyo3(signature = (address, token = None, connect_timeout = 5.0, job = None, job_rules = None))]
    fn new(
        py: Python<'_>,
        address: &str,
        token: Option<String>,
        connect_timeout: f64,
        job: Option<String>,
        job_rules: Option<String>,
    ) -> PyResult<Self> {
        let job = job_request(job.as_deref(), job_rules.as_deref())?;
        let inner = connect(py, token, connect_timeout, |token, timeout| {
            client::LighthouseClient::for_job(address, token, &job, timeout)
        })?;
        Ok(LighthouseClient { inner })
    }

    /// Waits until a quorum that includes `replica_id` is issued.
    #[pyo3(
        signature = (replica_id, timeout, *, last_quorum_id = 0, **member),
        text_signature = "($self, replica_id, timeout, *, step=0, world_size=1, \
                          manager_address='', store_address='', state_addresses=..., \
                          shrink_only=False, commit_failures=0, last_quorum_id=0)"
    )]
    fn quorum(
        &self,
        py: Python<'_>,
        replica_id: String,
        timeout: f64,
        last_quorum_id: i64,
        member: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Quorum> {
        let member: MemberKeywords = Given::new("quorum", member)?.only()?;
        let timeout = seconds("timeout", timeout)?;
        let member = proto::Member {
            replica_id,
            manager_address: member.manager_address,
            store_address: member.store_address,
            step: member.step,
            world_size: unsigned("world_size", member.world_size)?,
            shrink_only: member.shrink_only,
            commit_failures: unsigned("commit_failures", member.commit_failures)?,
            state_addresses: member.state_addresses,
            ..Default::default()
        };
        let last_quorum_id = unsigned("last_quorum_id", last_quorum_id)?;
        let client = self.inner.clone();
        wait(py, async move {
            client.quorum(member, last_quorum_id, timeout).await
        })
    }

    #[pyo3(signature = (timeout = 5.0))]
    fn status(&self, py: Python<'_>, timeout: f64) -> PyResult<LighthouseStatus> {
        let timeout = seconds("timeout", timeout)?;
        let client = self.inner.clone();
        wait(py, async move { client.status(timeout).await })
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
    let served = py.detach(|| control().block_on(crate::cli::run_lighthouse(args)));
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

/// Seconds from "15s", "500ms", "2m" or a plain number of seconds, read as the
/// lighthouse's command line reads them.
#[pyfunction]
fn parse_duration(text: &str) -> PyResult<f64> {
    crate::cli::parse_duration(text)
        .map(|d| d.as_secs_f64())
        .map_err(PyValueError::new_err)
}

/// The lighthouse's defaults by option name, timeouts in seconds.
/// `max_groups` from Python: what `--max-groups` accepts.
fn groups(n: i64) -> PyResult<usize> {
    match usize::try_from(n) {
        Ok(n @ 1..=1_000_000) => Ok(n),
        _ => Err(pyo3::exceptions::PyValueError::new_err(format!(
            "max_groups must be 1 to 1000000 (the replica groups the lighthouse is ready to \
             serve), got {n}"
        ))),
    }
}

fn defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let tuning = Tuning::DEFAULT;
    let out = PyDict::new(py);
    out.set_item("min_replicas", tuning.min_replicas)?;
    out.set_item("join_timeout", tuning.join_timeout.as_secs_f64())?;
    out.set_item("heartbeat_timeout", tuning.heartbeat_timeout.as_secs_f64())?;
    out.set_item("rollback_after", tuning.rollback_after.as_secs_f64())?;
    out.set_item("max_groups", tuning.max_groups)?;
    Ok(out)
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("LIGHTHOUSE_DEFAULTS", defaults(m.py())?)?;
    m.add("LIGHTHOUSE_TUNING_FLAGS", crate::cli::tuning_flags())?;
    m.add_function(wrap_pyfunction!(parse_duration, m)?)?;
    m.add_class::<LighthouseServer>()?;
    m.add_class::<LighthouseClient>()?;
    m.add_function(wrap_pyfunction!(run_lighthouse_cli, m)?)?;
    Ok(())
}
