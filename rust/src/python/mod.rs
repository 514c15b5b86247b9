//! `phalanx._core`: the Rust core as Python sees it.
//!
//! Few, coarse calls. Every blocking call releases the GIL, wakes every 100 ms to let
//! Ctrl-C through, and has a deadline. Errors arrive as the Python exception that
//! fits: `TimeoutError`, `ConnectionError`, `PermissionError` (wrong or missing job
//! token), `ValueError` (bad input), each with a message that says what to do.
//!
//! By concern: `runtime` (the two runtimes and the waits on them), `types` (what the
//! lighthouse and manager answer), `keywords` (a binding's keyword arguments read into
//! small structs), `lighthouse`, `manager`, `store`, `state` (the data path of a heal),
//! `token`, and with the `testing` feature the private `_testing` (load generators and
//! yardsticks for the benchmarks, the heal tests' corruption hook).

use std::sync::Mutex;
use std::time::Duration;

use pyo3::exceptions::{
    PyConnectionError, PyPermissionError, PyRuntimeError, PyTimeoutError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::lighthouse::jobs::JobRequest;
use crate::server::ServerHandle;
use crate::{proto, ErrorKind};

// First: the others declare their keyword structs with its macro.
#[macro_use]
mod keywords;
mod eviction;
mod lighthouse;
mod manager;
mod runtime;
mod state;
mod store;
#[cfg(feature = "testing")]
mod testing;
mod token;
mod types;

/// The Python exception for an error of the core: one mapping for every call,
/// transfers included.
fn to_py(e: crate::Error) -> PyErr {
    let message = e.message();
    match e.kind() {
        ErrorKind::Timeout => PyTimeoutError::new_err(message),
        ErrorKind::Connection => PyConnectionError::new_err(message),
        ErrorKind::Permission => PyPermissionError::new_err(message),
        ErrorKind::InvalidInput => PyValueError::new_err(message),
        ErrorKind::Other => PyRuntimeError::new_err(message),
    }
}

/// A count or id from Python, checked into the unsigned type the core uses.
/// The job a client names (`job=`, `job_rules=`), checked; ValueError naming the fix.
fn job_request(job: Option<&str>, rules: Option<&str>) -> PyResult<JobRequest> {
    JobRequest::parse(job, rules)
        .map_err(|status| PyValueError::new_err(status.message().to_string()))
}

fn unsigned<T: TryFrom<i64>>(name: &str, value: i64) -> PyResult<T> {
    T::try_from(value).map_err(|_| {
        PyValueError::new_err(format!(
            "{name} must be 0 or more (and fit the wire), got {value}"
        ))
    })
}

/// A positive number of seconds from Python.
fn seconds(name: &str, value: f64) -> PyResult<Duration> {
    if !value.is_finite() || value <= 0.0 {
        return Err(PyValueError::new_err(format!(
            "{name} must be a positive number of seconds, got {value}"
        )));
    }
    Ok(Duration::from_secs_f64(value))
}

/// A number of seconds from Python where 0 means "at once".
fn seconds_or_zero(name: &str, value: f64) -> PyResult<Duration> {
    if !value.is_finite() || value < 0.0 {
        return Err(PyValueError::new_err(format!(
            "{name} must be a number of seconds, 0 or more, got {value}"
        )));
    }
    Ok(Duration::from_secs_f64(value))
}

/// Stops a server held by a Python object, once.
fn stop(py: Python<'_>, slot: &Mutex<Option<ServerHandle>>) -> PyResult<()> {
    let handle = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(handle) = handle {
        runtime::wait(py, async move {
            handle.shutdown().await;
            Ok(())
        })?;
    }
    Ok(())
}

/// The base of every server class of the bindings, for the one thing they share: the
/// `with` protocol. `__exit__` calls the server's own (idempotent) `shutdown()` and
/// lets an exception raised in the block go on. Private: Python code names the
/// servers themselves.
#[pyclass(module = "phalanx._core", name = "_Server", subclass, frozen)]
pub struct Server;

impl Server {
    /// A server class's value as its constructor hands it to Python.
    fn init<T: pyo3::PyClass<BaseType = Server>>(server: T) -> PyClassInitializer<T> {
        PyClassInitializer::from(Server).add_subclass(server)
    }
}

#[pymethods]
impl Server {
    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_exc_info))]
    fn __exit__(slf: &Bound<'_, Self>, _exc_info: &Bound<'_, PyTuple>) -> PyResult<bool> {
        slf.call_method0("shutdown")?;
        Ok(false)
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("PROTOCOL_VERSION", proto::PROTOCOL_VERSION)?;
    types::register(m)?;
    lighthouse::register(m)?;
    manager::register(m)?;
    store::register(m)?;
    state::register(m)?;
    token::register(m)?;
    #[cfg(feature = "testing")]
    testing::register(m)?;
    Ok(())
}
