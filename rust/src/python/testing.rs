//! `phalanx._core._testing`, built with the `testing` feature only: load generators
//! and yardsticks for `benches/`, and the hook that damages a state server's chunks
//! for the tests of a heal. None of it is part of the training API.

use std::time::Duration;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::keywords::Given;
use super::runtime::wait;
use super::state::StateServer;
use super::{job_request, seconds, unsigned};
use crate::auth::JobToken;
use crate::lighthouse::wire::BeatTransport;
use crate::loadgen::{floor, RoundsLoad};
use crate::state::{baseline, Corruption};
use crate::Error;

keywords! {
    /// How a load of quorum rounds reaches the lighthouse: the job it asks as, with
    /// the job's token, its heartbeats over `transport` ("framed" or "grpc").
    struct AccessKeywords {
        token: Option<String> = None,
        job: Option<String> = None,
        transport: String = "framed".into(),
    }
}

/// Benchmark load: `replicas` groups ask for `rounds` quorums in lock-step. Returns
/// (seconds from the last request to the last answer, membership changed, quorum id)
/// for each round.
#[pyfunction]
#[pyo3(
    signature = (address, replicas, rounds, change_every = 0, timeout = 30.0, **access),
    text_signature = "(address, replicas, rounds, change_every=0, timeout=30.0, *, token=None, \
                      job=None, transport='framed')"
)]
fn bench_quorum_rounds(
    py: Python<'_>,
    address: String,
    replicas: usize,
    rounds: usize,
    change_every: usize,
    timeout: f64,
    access: Option<&Bound<'_, PyDict>>,
) -> PyResult<Vec<(f64, bool, u64)>> {
    let access: AccessKeywords = Given::new("bench_quorum_rounds", access)?.only()?;
    let timeout = seconds("timeout", timeout)?;
    let transport = beat_transport(&access.transport)?;
    let token = JobToken::new(access.token);
    let job = job_request(access.job.as_deref(), None)?;
    let load = RoundsLoad {
        replicas,
        rounds,
        change_every,
    };
    let timings = wait(py, async move {
        crate::loadgen::quorum_rounds(&address, &token, &job, transport, load, timeout).await
    })?;
    Ok(timings
        .into_iter()
        .map(|t| (t.latency.as_secs_f64(), t.changed, t.quorum_id))
        .collect())
}

/// Benchmark load: `replicas` groups in a quorum; in each of `trials` one more joins
/// it and crashes. Returns the seconds until every other group was told, per trial.
#[pyfunction]
#[pyo3(signature = (address, replicas, trials, timeout = 30.0, token = None, transport = "framed"))]
fn bench_crash_told(
    py: Python<'_>,
    address: String,
    replicas: usize,
    trials: usize,
    timeout: f64,
    token: Option<String>,
    transport: &str,
) -> PyResult<Vec<f64>> {
    let timeout = seconds("timeout", timeout)?;
    let token = JobToken::new(token);
    let transport = beat_transport(transport)?;
    let told = wait(py, async move {
        crate::loadgen::crash_told(&address, &token, transport, replicas, trials, timeout).await
    })?;
    Ok(told.iter().map(Duration::as_secs_f64).collect())
}

keywords! {
    /// The heartbeat streams of a load: over `transport`, "framed" (a connection
    /// each) or "grpc" (`connections` connections in all).
    struct StreamKeywords {
        connections: usize = 64,
        transport: String = "framed".into(),
    }
}

/// Benchmark load: `replicas` heartbeat streams at `hz` for `duration` seconds.
/// Returns the beats sent.
#[pyfunction]
#[pyo3(
    signature = (address, replicas, hz, duration, *, token = None, **streams),
    text_signature = "(address, replicas, hz, duration, *, token=None, connections=64, \
                      transport='framed')"
)]
fn bench_heartbeats(
    py: Python<'_>,
    address: String,
    replicas: usize,
    hz: f64,
    duration: f64,
    token: Option<String>,
    streams: Option<&Bound<'_, PyDict>>,
) -> PyResult<u64> {
    let streams: StreamKeywords = Given::new("bench_heartbeats", streams)?.only()?;
    let duration = seconds("duration", duration)?;
    let token = JobToken::new(token);
    let transport = beat_transport(&streams.transport)?;
    wait(py, async move {
        crate::loadgen::heartbeats(
            &address,
            &token,
            transport,
            replicas,
            hz,
            streams.connections,
            duration,
        )
        .await
    })
}

fn beat_transport(name: &str) -> PyResult<BeatTransport> {
    name.parse()
        .map_err(|e: String| pyo3::exceptions::PyValueError::new_err(e))
}

/// Benchmark load: `rate` requests a second of job `job` (status calls and garbage
/// quorum requests in turn) over `connections` connections for `duration` seconds.
/// Returns (sent, answered).
#[pyfunction]
#[pyo3(signature = (address, job, rate, duration, connections = 16, token = None))]
fn bench_flood(
    py: Python<'_>,
    address: String,
    job: String,
    rate: f64,
    duration: f64,
    connections: usize,
    token: Option<String>,
) -> PyResult<(u64, u64)> {
    let duration = seconds("duration", duration)?;
    let token = JobToken::new(token);
    let job = job_request(Some(&job), None)?;
    let flood = wait(py, async move {
        crate::loadgen::flood(&address, &token, &job, rate, connections, duration).await
    })?;
    Ok((flood.sent, flood.answered))
}

/// Sends one Raft heartbeat to the lighthouse of a set at `address`, as member
/// `sender` of the set to member `to`, at `term` (committing `commit`), with the job
/// token: what a buggy or hostile token holder can send. Raises what it answers.
#[pyfunction]
#[pyo3(signature = (address, sender, to, term, commit = 0, token = None))]
fn send_raft_heartbeat(
    py: Python<'_>,
    address: String,
    sender: u64,
    to: u64,
    term: u64,
    commit: u64,
    token: Option<String>,
) -> PyResult<()> {
    let mut message = raft::eraftpb::Message::default();
    message.set_msg_type(raft::eraftpb::MessageType::MsgHeartbeat);
    message.from = sender;
    message.to = to;
    message.term = term;
    message.commit = commit;
    let token = JobToken::new(token);
    wait(py, async move {
        crate::lighthouse::set::send_raft(&address, &token, message).await
    })
}

/// Benchmark yardstick: serves the floor of the lighthouse's benchmarks on `bind`
/// (see `loadgen::floor`) until the process ends, with room for `groups` connections.
#[pyfunction]
fn serve_floor(py: Python<'_>, bind: String, groups: usize) -> PyResult<()> {
    if let Some(warning) = crate::fdlimit::ensure(groups, "the floor's groups") {
        tracing::warn!("{warning}");
    }
    wait(py, async move {
        let listener = tokio::net::TcpListener::bind(&bind)
            .await
            .map_err(|source| Error::Bind {
                address: bind.clone(),
                source,
            })?;
        floor::serve(listener)
            .await
            .map_err(|e| floor_error(&bind, e))
    })
}

/// Benchmark yardstick: `groups` connections to the floor server at `address` ask for
/// `rounds` rounds in lock-step. Returns each round's seconds from the last ask to
/// the last answer.
#[pyfunction]
#[pyo3(signature = (address, groups, rounds, timeout = 30.0))]
fn bench_floor_rounds(
    py: Python<'_>,
    address: String,
    groups: usize,
    rounds: usize,
    timeout: f64,
) -> PyResult<Vec<f64>> {
    let timeout = seconds("timeout", timeout)?;
    let timings = wait(py, async move {
        floor::rounds(&address, groups, rounds, timeout)
            .await
            .map_err(|e| floor_error(&address, e))
    })?;
    Ok(timings.iter().map(Duration::as_secs_f64).collect())
}

/// Benchmark yardstick: `groups` connections to the floor server at `address` wait
/// while, `trials` times, one more is dropped. Returns the seconds until all were
/// told, per trial.
#[pyfunction]
#[pyo3(signature = (address, groups, trials, timeout = 30.0))]
fn bench_floor_told(
    py: Python<'_>,
    address: String,
    groups: usize,
    trials: usize,
    timeout: f64,
) -> PyResult<Vec<f64>> {
    let timeout = seconds("timeout", timeout)?;
    let told = wait(py, async move {
        floor::losses_told(&address, groups, trials, timeout)
            .await
            .map_err(|e| floor_error(&address, e))
    })?;
    Ok(told.iter().map(Duration::as_secs_f64).collect())
}

fn floor_error(address: &str, e: std::io::Error) -> Error {
    Error::Connect {
        what: "the floor server",
        address: address.to_string(),
        detail: e.to_string(),
    }
}

/// Benchmark yardstick: seconds to move `nbytes` over `connections` raw loopback
/// TCP connections (blocking threads, no framing, no checksum).
#[pyfunction]
#[pyo3(signature = (nbytes, connections = 2))]
fn bench_raw_tcp(py: Python<'_>, nbytes: usize, connections: usize) -> PyResult<f64> {
    py.detach(|| baseline::raw_tcp_seconds(nbytes, connections))
        .map_err(|e| PyRuntimeError::new_err(format!("raw TCP baseline failed: {e}")))
}

/// Test hook: `server` flips the byte at `byte % chunk length` of each of the next
/// `chunks` chunks it sends (checksums stay those of the intact bytes, so the
/// receiver must notice), as a bad link would.
#[pyfunction]
fn damage_next_chunks(server: &Bound<'_, StateServer>, chunks: i64, byte: i64) -> PyResult<()> {
    let corruption = Corruption {
        chunks: unsigned("chunks", chunks)?,
        byte: unsigned("byte", byte)?,
    };
    server.get().server()?.damage_next_chunks(corruption);
    Ok(())
}

/// Adds `_testing` to `parent` and to `sys.modules`, so that both
/// `from phalanx._core import _testing` and `import phalanx._core._testing` work.
pub(super) fn register(parent: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = parent.py();
    let m = PyModule::new(py, "_testing")?;
    m.add_function(wrap_pyfunction!(bench_quorum_rounds, &m)?)?;
    m.add_function(wrap_pyfunction!(bench_heartbeats, &m)?)?;
    m.add_function(wrap_pyfunction!(bench_flood, &m)?)?;
    m.add_function(wrap_pyfunction!(bench_crash_told, &m)?)?;
    m.add_function(wrap_pyfunction!(bench_raw_tcp, &m)?)?;
    m.add_function(wrap_pyfunction!(serve_floor, &m)?)?;
    m.add_function(wrap_pyfunction!(bench_floor_rounds, &m)?)?;
    m.add_function(wrap_pyfunction!(bench_floor_told, &m)?)?;
    m.add_function(wrap_pyfunction!(damage_next_chunks, &m)?)?;
    m.add_function(wrap_pyfunction!(send_raft_heartbeat, &m)?)?;
    parent.add_submodule(&m)?;
    py.import("sys")?
        .getattr("modules")?
        .set_item("phalanx._core._testing", &m)?;
    Ok(())
}
