//! Checkpoint-free recovery's data path: a rank's state server, and the fetch a
//! healing rank runs. `phalanx.recovery` builds on them.
//!
//! Memory is passed as (address, length) pairs of tensors that the Python side keeps
//! alive; the calls below never return while a task of theirs may still touch that
//! memory, Ctrl-C included.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use tokio::sync::oneshot;

use super::keywords::Given;
use super::runtime::{wait_transfer, OnInterrupt};
use super::{seconds_or_zero, to_py, unsigned, Server};
use crate::auth::JobToken;
use crate::state::{self, DestRegion, FetchOptions, ServerOptions, SourceRegion};

fn regions(pairs: &[(usize, usize)]) -> PyResult<()> {
    for (i, &(addr, len)) in pairs.iter().enumerate() {
        if len > 0 && addr == 0 {
            return Err(PyValueError::new_err(format!(
                "region {i} has {len} bytes but no address (a null data_ptr)"
            )));
        }
        if addr.checked_add(len).is_none() {
            return Err(PyValueError::new_err(format!(
                "region {i} ({addr:#x}, {len} bytes) wraps around memory"
            )));
        }
    }
    Ok(())
}

/// A rank's state server: serves one committed step at a time, from memory.
#[pyclass(module = "phalanx._core", frozen, extends = Server)]
pub struct StateServer {
    inner: Mutex<Option<Arc<state::StateServer>>>,
    #[pyo3(get)]
    address: String,
}

impl StateServer {
    pub(super) fn server(&self) -> PyResult<Arc<state::StateServer>> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| {
                PyValueError::new_err("this state server was shut down; start a new one")
            })
    }
}

#[pymethods]
impl StateServer {
    #[new]
    #[pyo3(signature = (bind = "127.0.0.1:0", advertise_host = None, token = None, max_bytes_per_s = None))]
    fn new(
        py: Python<'_>,
        bind: &str,
        advertise_host: Option<String>,
        token: Option<String>,
        max_bytes_per_s: Option<f64>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let options = ServerOptions {
            bind: bind.to_string(),
            advertise_host,
            token: JobToken::new(token),
            max_bytes_per_s,
            ..ServerOptions::default()
        };
        let server = wait_transfer(py, state::StateServer::bind(options), OnInterrupt::Abort)?;
        let server = StateServer {
            address: server.address().to_string(),
            inner: Mutex::new(Some(Arc::new(server))),
        };
        Ok(Server::init(server))
    }

    /// Opens a window over `regions` ((address, length) pairs) for `step` of quorum
    /// `quorum_id`.
    fn publish(
        &self,
        step: i64,
        quorum_id: i64,
        manifest: &[u8],
        regions: Vec<(usize, usize)>,
    ) -> PyResult<()> {
        let quorum_id = unsigned("quorum_id", quorum_id)?;
        self::regions(&regions)?;
        // SAFETY: the caller keeps the memory alive and unchanged until withdraw() or
        // shutdown() returns (phalanx.recovery.StateHost holds the tensors that long).
        let regions = regions
            .into_iter()
            .map(|(addr, len)| unsafe { SourceRegion::new(addr, len) })
            .collect();
        self.server()?
            .publish(step, quorum_id, manifest.to_vec(), regions)
            .map_err(to_py)
    }

    /// Closes the window; waits up to `timeout` s for sends in flight, then cuts
    /// them. Returns how many were cut.
    #[pyo3(signature = (timeout = 5.0))]
    fn withdraw(&self, py: Python<'_>, timeout: f64) -> PyResult<usize> {
        let grace = seconds_or_zero("timeout", timeout)?;
        let server = self.server()?;
        wait_transfer(
            py,
            async move { server.withdraw(grace).await },
            OnInterrupt::Finish,
        )
    }

    /// (step, quorum id) published now, or None.
    #[getter]
    fn serving(&self) -> PyResult<Option<(i64, u64)>> {
        Ok(self.server()?.serving())
    }

    /// Chunk bytes sent so far.
    #[getter]
    fn served_bytes(&self) -> PyResult<u64> {
        Ok(self.server()?.served_bytes())
    }

    /// Requests and connections turned away so far, by reason.
    #[getter]
    fn refused_requests(&self) -> PyResult<HashMap<&'static str, u64>> {
        Ok(self.server()?.refusals().snapshot().into_iter().collect())
    }

    /// Stops serving and closes the window (sends in flight are cut). Idempotent.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let server = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        match server {
            Some(server) => wait_transfer(
                py,
                async move { server.shutdown().await },
                OnInterrupt::Finish,
            ),
            None => Ok(()),
        }
    }
}

/// What a heal moved, and from where.
#[pyclass(module = "phalanx._core", frozen)]
#[derive(Debug)]
pub struct FetchStats {
    inner: state::FetchStats,
}

#[pymethods]
impl FetchStats {
    #[getter]
    fn bytes(&self) -> u64 {
        self.inner.bytes
    }

    #[getter]
    fn seconds(&self) -> f64 {
        self.inner.seconds
    }

    #[getter]
    fn gb_per_s(&self) -> f64 {
        if self.inner.seconds > 0.0 {
            self.inner.bytes as f64 / self.inner.seconds / 1e9
        } else {
            0.0
        }
    }

    #[getter]
    fn chunks(&self) -> usize {
        self.inner.chunks
    }

    #[getter]
    fn refetches(&self) -> u64 {
        self.inner.refetches
    }

    #[getter]
    fn per_source_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for (source, bytes) in &self.inner.per_source {
            out.set_item(source, bytes)?;
        }
        Ok(out)
    }

    #[getter]
    fn failed_sources<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for (source, why) in &self.inner.failed_sources {
            out.set_item(source, why)?;
        }
        Ok(out)
    }

    fn __repr__(&self) -> String {
        let s = &self.inner;
        format!(
            "FetchStats(bytes={}, seconds={:.3}, chunks={}, refetches={}, per_source_bytes={:?}, \
             failed_sources={:?})",
            s.bytes, s.seconds, s.chunks, s.refetches, s.per_source, s.failed_sources
        )
    }
}

keywords! {
    /// How a fetch runs: with the job's token, within `timeout` seconds in all,
    /// `chunk_bytes` a request over `connections_per_source` connections to each
    /// source, a source silent for `stall_timeout` seconds dropped.
    struct FetchKeywords {
        token: Option<String> = None,
        timeout: f64 = 60.0,
        connections_per_source: usize = 2,
        chunk_bytes: u64 = 4 << 20,
        stall_timeout: f64 = 10.0,
    }
}

/// Fetches `regions` ((address, length) pairs) from all `sources` at once, in place.
#[pyfunction]
#[pyo3(
    signature = (sources, step, quorum_id, regions, **how),
    text_signature = "(sources, step, quorum_id, regions, *, token=None, timeout=60.0, \
                      connections_per_source=2, chunk_bytes=4194304, stall_timeout=10.0)"
)]
fn fetch_state(
    py: Python<'_>,
    sources: Vec<String>,
    step: i64,
    quorum_id: i64,
    regions: Vec<(usize, usize)>,
    how: Option<&Bound<'_, PyDict>>,
) -> PyResult<FetchStats> {
    let how: FetchKeywords = Given::new("fetch_state", how)?.only()?;
    let quorum_id = unsigned("quorum_id", quorum_id)?;
    self::regions(&regions)?;
    let options = FetchOptions {
        token: JobToken::new(how.token),
        timeout: seconds_or_zero("timeout", how.timeout)?,
        connections_per_source: how.connections_per_source,
        chunk_bytes: how.chunk_bytes,
        stall_timeout: seconds_or_zero("stall_timeout", how.stall_timeout)?,
        ..FetchOptions::default()
    };
    // SAFETY: the caller keeps the memory alive and untouched until this returns, and
    // `wait` returns only once the fetch task has ended (on Ctrl-C: after cancelling).
    let dest = regions
        .into_iter()
        .map(|(addr, len)| unsafe { DestRegion::new(addr, len) })
        .collect();
    let (cancel, cancelled) = oneshot::channel::<()>();
    let fetch = async move {
        let cancelled = async {
            let _ = cancelled.await;
        };
        state::fetch_state(&sources, step, quorum_id, dest, options, cancelled).await
    };
    let inner = wait_transfer(py, fetch, OnInterrupt::Cancel(cancel))?;
    Ok(FetchStats { inner })
}

/// The manifest that `sources` published for `step` of quorum `quorum_id`, from the
/// first that answers.
#[pyfunction]
#[pyo3(signature = (sources, step, quorum_id, token = None, timeout = 10.0))]
fn fetch_manifest<'py>(
    py: Python<'py>,
    sources: Vec<String>,
    step: i64,
    quorum_id: i64,
    token: Option<String>,
    timeout: f64,
) -> PyResult<Bound<'py, PyBytes>> {
    let quorum_id = unsigned("quorum_id", quorum_id)?;
    let timeout = seconds_or_zero("timeout", timeout)?;
    let token = JobToken::new(token);
    let manifest = wait_transfer(
        py,
        async move { state::fetch_manifest(&sources, step, quorum_id, &token, timeout).await },
        OnInterrupt::Abort,
    )?;
    Ok(PyBytes::new(py, &manifest))
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<StateServer>()?;
    m.add_class::<FetchStats>()?;
    m.add_function(wrap_pyfunction!(fetch_state, m)?)?;
    m.add_function(wrap_pyfunction!(fetch_manifest, m)?)?;
    Ok(())
}
