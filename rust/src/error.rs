//! Errors a user can act on: each says what went wrong and what to do.

use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot listen on {address}: {source}; pick a free port (or port 0) and an address of this host")]
    Bind {
        address: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    InvalidConfig(String),
    #[error("cannot reach {what} at {address}: {detail}; check that it runs and that the address is right")]
    Connect {
        what: &'static str,
        address: String,
        detail: String,
    },
    #[error("{0}")]
    Rpc(#[from] Status),
}

/// How an error should surface to a caller, Python included.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    Timeout,
    Connection,
    Permission,
    InvalidInput,
    Other,
}

impl Error {
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Bind { .. } | Error::Connect { .. } => ErrorKind::Connection,
            Error::InvalidConfig(_) => ErrorKind::InvalidInput,
            Error::Rpc(status) => match status.code() {
                Code::DeadlineExceeded => ErrorKind::Timeout,
                Code::Unavailable | Code::Aborted | Code::Cancelled => ErrorKind::Connection,
                Code::Unauthenticated | Code::PermissionDenied => ErrorKind::Permission,
                Code::InvalidArgument
                | Code::AlreadyExists
                | Code::FailedPrecondition
                | Code::OutOfRange
                | Code::ResourceExhausted => ErrorKind::InvalidInput,
                _ => ErrorKind::Other,
            },
        }
    }

    /// The message alone, without tonic's decoration.
    pub fn message(&self) -> String {
        match self {
            Error::Rpc(status) if !status.message().is_empty() => status.message().to_string(),
            other => other.to_string(),
        }
    }
}
