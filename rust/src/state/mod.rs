//! Checkpoint-free recovery's data path. Every rank serves the state of its last
//! committed step straight from the memory that holds it (`server`); a healing rank
//! stripes the download over all up-to-date peers at once, straight into its own
//! tensors (`fetch`, one connection of it in `link`). The framing (`wire`) and the
//! stripe plan (`plan`) are pure; `baseline` is the raw-TCP yardstick of the benchmark.
//!
//! Bulk bytes go over plain TCP with a small binary framing rather than gRPC: a chunk
//! is read from the socket directly into its destination, with no message buffer and
//! no second copy in between.

pub mod baseline;
pub mod fetch;
mod link;
pub mod plan;
pub mod server;
pub mod wire;

use std::fmt;

use crate::ErrorKind;

pub use fetch::{fetch_manifest, fetch_state, DestRegion, FetchOptions, FetchStats};
pub use server::{Corruption, ServerOptions, SourceRegion, StateServer};

/// A failed transfer, with what to do about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateError {
    pub kind: StateErrorKind,
    pub message: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateErrorKind {
    /// The deadline passed.
    Timeout,
    /// A source is unreachable, went away, or sent damaged data again and again.
    Connection,
    /// Missing or wrong job token, or a request for a step or quorum the source does
    /// not serve (I8).
    Refused,
    /// Bad arguments: a destination that does not match the source, overlapping
    /// regions, a window already open.
    InvalidInput,
    /// The caller gave up (Ctrl-C).
    Cancelled,
}

impl StateError {
    pub fn new(kind: StateErrorKind, message: impl Into<String>) -> Self {
        StateError {
            kind,
            message: message.into(),
        }
    }

    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(StateErrorKind::Timeout, message)
    }

    pub fn connection(message: impl Into<String>) -> Self {
        Self::new(StateErrorKind::Connection, message)
    }

    pub fn refused(message: impl Into<String>) -> Self {
        Self::new(StateErrorKind::Refused, message)
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StateErrorKind::InvalidInput, message)
    }

    /// How the error surfaces to callers of the core, Python included.
    pub fn kind(&self) -> ErrorKind {
        match self.kind {
            StateErrorKind::Timeout => ErrorKind::Timeout,
            StateErrorKind::Connection => ErrorKind::Connection,
            StateErrorKind::Refused => ErrorKind::Permission,
            StateErrorKind::InvalidInput => ErrorKind::InvalidInput,
            StateErrorKind::Cancelled => ErrorKind::Other,
        }
    }
}

impl fmt::Display for StateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for StateError {}
