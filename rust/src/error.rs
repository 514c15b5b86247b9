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
    /// A state transfer (the data path of a heal, see `crate::state`) failed. A
    /// refusal (missing or wrong job token, a step or quorum the source does not
    /// serve: I8) surfaces as `Permission`, a cancelled heal as `Other`.
    #[error("{message}")]
    Transfer { kind: ErrorKind, message: String },
}

/// Every status code a call can end with, as the kind a caller sees. Exhaustive, so
/// that no failure surfaces outside the four documented kinds: tonic reports a
/// connection that broke mid-call as `Unknown` or `Internal` ("transport error",
/// "h2 protocol error"), which is a lost peer like any other.
pub fn rpc_kind(code: Code) -> ErrorKind {
    match code {
        Code::DeadlineExceeded => ErrorKind::Timeout,
        Code::Unavailable
        | Code::Aborted
        | Code::Cancelled
        | Code::Unknown
        | Code::Internal
        | Code::DataLoss => ErrorKind::Connection,
        Code::Unauthenticated | Code::PermissionDenied => ErrorKind::Permission,
        Code::Ok
        | Code::InvalidArgument
        | Code::AlreadyExists
        | Code::FailedPrecondition
        | Code::OutOfRange
        | Code::ResourceExhausted
        | Code::NotFound
        | Code::Unimplemented => ErrorKind::InvalidInput,
    }
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
    pub fn transfer(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error::Transfer {
            kind,
            message: message.into(),
        }
    }

    /// A transfer's deadline passed.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::transfer(ErrorKind::Timeout, message)
    }

    /// A source is unreachable, went away, or sent damaged data again and again.
    pub fn connection(message: impl Into<String>) -> Self {
        Self::transfer(ErrorKind::Connection, message)
    }

    /// A source refused: missing or wrong job token, or a request for a step or quorum
    /// it does not serve (I8).
    pub fn refused(message: impl Into<String>) -> Self {
        Self::transfer(ErrorKind::Permission, message)
    }

    /// Bad arguments: a destination that does not match the source, overlapping
    /// regions, a window already open.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::transfer(ErrorKind::InvalidInput, message)
    }

    /// The caller gave up (Ctrl-C).
    pub fn cancelled(message: impl Into<String>) -> Self {
        Self::transfer(ErrorKind::Other, message)
    }

    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Bind { .. } | Error::Connect { .. } => ErrorKind::Connection,
            Error::InvalidConfig(_) => ErrorKind::InvalidInput,
            Error::Rpc(status) => rpc_kind(status.code()),
            Error::Transfer { kind, .. } => *kind,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_code_surfaces_as_a_documented_kind() {
        let codes = (0..=16).map(Code::from_i32).collect::<Vec<_>>();
        assert_eq!(codes.len(), 17);
        for code in codes {
            let kind = Error::Rpc(Status::new(code, "x")).kind();
            assert_ne!(kind, ErrorKind::Other, "{code:?}");
        }
        let broken = Error::Rpc(Status::unknown("transport error"));
        assert_eq!(broken.kind(), ErrorKind::Connection);
    }
}
