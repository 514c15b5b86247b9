//! The two runtimes behind the bindings, and the waits on them that release the GIL.
//!
//! Control calls (quorums, votes, heartbeats, the store) run on a small runtime of
//! their own; transfers run on another, so a heal moving gigabytes never delays the
//! heartbeats and quorum calls of the control runtime (a late heartbeat reads as a
//! dead group).

use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use tokio::runtime::Runtime;
use tokio::sync::oneshot;

use super::to_py;
use crate::auth::JobToken;
use crate::Error;

/// A client of the core, made by `make` without the GIL: building its channel needs
/// the control runtime's context.
pub(super) fn connect<T: Send>(
    py: Python<'_>,
    token: Option<String>,
    connect_timeout: f64,
    make: impl FnOnce(&JobToken, Duration) -> Result<T, Error> + Send,
) -> PyResult<T> {
    let connect_timeout = super::seconds("connect_timeout", connect_timeout)?;
    let token = JobToken::new(token);
    py.detach(|| {
        let _enter = control().enter();
        make(&token, connect_timeout)
    })
    .map_err(to_py)
}

/// How often a blocking call wakes up to let Ctrl-C through.
const SIGNAL_CHECK: Duration = Duration::from_millis(100);

/// The control runtime, started on first use.
pub(super) fn control() -> &'static Runtime {
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

/// The transfer runtime, started on first use.
fn transfers() -> &'static Runtime {
    static RUNTIME: OnceLock<Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        // Loopback and NIC copies are CPU work: one worker per core, within reason.
        let workers = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8));
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .thread_name("phalanx-state")
            .enable_all()
            .build()
            .expect("cannot start the phalanx state runtime")
    })
}

/// Runs `fut` to completion on the control runtime without the GIL, checking for
/// Ctrl-C in between.
pub(super) fn wait<T: Send>(
    py: Python<'_>,
    fut: impl Future<Output = Result<T, Error>> + Send,
) -> PyResult<T> {
    let mut fut = Box::pin(fut);
    loop {
        let step = py.detach(|| {
            control().block_on(async { tokio::time::timeout(SIGNAL_CHECK, &mut fut).await })
        });
        match step {
            Ok(result) => return result.map_err(to_py),
            Err(_) => py.check_signals()?,
        }
    }
}

/// What to do with a task when Ctrl-C arrives while Python waits for it.
pub(super) enum OnInterrupt {
    /// It touches no Python memory: drop it.
    Abort,
    /// It writes into Python memory: ask it to stop, then wait until it has.
    Cancel(oneshot::Sender<()>),
    /// It reads Python memory and ends soon on its own: wait for it.
    Finish,
}

/// Runs `fut` as its own task on the transfer runtime and waits for it without the GIL.
pub(super) fn wait_transfer<T: Send + 'static>(
    py: Python<'_>,
    fut: impl Future<Output = Result<T, Error>> + Send + 'static,
    mut on_interrupt: OnInterrupt,
) -> PyResult<T> {
    let mut task = transfers().spawn(fut);
    loop {
        let step = py.detach(|| {
            transfers().block_on(async { tokio::time::timeout(SIGNAL_CHECK, &mut task).await })
        });
        match step {
            Ok(Ok(result)) => return result.map_err(to_py),
            Ok(Err(e)) => {
                return Err(PyRuntimeError::new_err(format!(
                    "a phalanx state task failed: {e}"
                )))
            }
            Err(_) => {
                let Err(interrupt) = py.check_signals() else {
                    continue;
                };
                match std::mem::replace(&mut on_interrupt, OnInterrupt::Abort) {
                    OnInterrupt::Abort => task.abort(),
                    OnInterrupt::Cancel(cancel) => {
                        let _ = cancel.send(());
                        let _ = py.detach(|| transfers().block_on(&mut task));
                    }
                    OnInterrupt::Finish => {
                        let _ = py.detach(|| transfers().block_on(&mut task));
                    }
                }
                return Err(interrupt);
            }
        }
    }
}
