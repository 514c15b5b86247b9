//! The last resort of a rank evicted as stalled whose interpreter never answers.
//!
//! A rank learns of its group's eviction on its Python membership thread, which logs
//! the evidence and ends the process (`phalanx.watchdog`). A thread that holds the GIL
//! forever (a C extension deadlocked inside a call that never releases it) keeps that
//! thread from running at all, and the process would linger, evicted but never
//! restarted. So the event is also watched here, off the interpreter: if the process
//! still lives a grace period after its own eviction, this dumps the Python stacks
//! through faulthandler's signal handler (which needs no GIL) and exits.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::proto;

/// What to do once the grace after this group's eviction has passed.
#[derive(Clone, Debug)]
pub(super) struct EvictionExit {
    pub replica_id: String,
    pub grace: Duration,
    /// The signal faulthandler dumps every thread's stack on (0: none registered).
    pub dump_signal: i32,
    pub status: i32,
}

impl EvictionExit {
    /// Whether `lost` evicts this very group as stalled.
    fn names(&self, lost: &proto::MembershipLost) -> bool {
        lost.cause == "progress_stalled" && lost.lost.contains(&self.replica_id)
    }
}

/// The armed exit, shared by a client and the task reading its events.
pub(super) type Armed = Arc<Mutex<Option<EvictionExit>>>;

fn armed_now(armed: &Armed) -> Option<EvictionExit> {
    armed.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Called for every membership-loss event: an own eviction starts the grace.
pub(super) fn heard(armed: &Armed, lost: &proto::MembershipLost) {
    let Some(exit) = armed_now(armed).filter(|exit| exit.names(lost)) else {
        return;
    };
    let (armed, quorum_id) = (armed.clone(), lost.quorum_id);
    super::runtime::control().spawn(async move {
        tokio::time::sleep(exit.grace).await;
        // Disarmed meanwhile: the interpreter took the event and chose to live on.
        if armed_now(&armed).is_some() {
            last_resort(&exit, quorum_id);
        }
    });
}

fn last_resort(exit: &EvictionExit, quorum_id: u64) -> ! {
    eprintln!(
        "phalanx: replica group {:?} was evicted from quorum {quorum_id} as stalled, and \
         this process's interpreter has not acted on it for {:.1} s (a thread holds the \
         GIL). Dumping every thread's Python stack and exiting with status {} so that \
         the group is restarted and heals",
        exit.replica_id,
        exit.grace.as_secs_f64(),
        exit.status
    );
    // SAFETY: raise() runs faulthandler's handler on this thread (the signal is not
    // blocked here; the handler is async-signal-safe and reads the interpreter's
    // thread states without the GIL); _exit() ends the process without running any
    // code that could need the lock the stuck thread holds.
    unsafe {
        if exit.dump_signal > 0 {
            libc::raise(exit.dump_signal);
        }
        libc::_exit(exit.status)
    }
}
