//! `phalanx._core`: the Rust core as Python sees it.
//!
//! Few, coarse calls. Every blocking call releases the GIL, wakes every 100 ms to let
//! Ctrl-C through, and has a deadline. Errors arrive as the Python exception that
//! fits: `TimeoutError`, `ConnectionError`, `PermissionError` (wrong or missing job
//! token), `ValueError` (bad input), each with a message that says what to do.
//!
//! By concern: `runtime` (the two runtimes and the waits on them), `types` (what the
//! lighthouse and manager answer), `lighthouse`, `manager`, `store`, `state` (the data
//! path of a heal), `token`, `bench` (load generators and yardsticks).

use std::sync::Mutex;
use std::time::Duration;

use pyo3::exceptions::{
    PyConnectionError, PyPermissionError, PyRuntimeError, PyTimeoutError, PyValueError,
};
use pyo3::prelude::*;

use crate::server::ServerHandle;
use crate::{proto, ErrorKind};

mod bench;
mod lighthouse;
mod manager;
mod runtime;
mod state;
mod store;
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
    bench::register(m)?;
    Ok(())
}
