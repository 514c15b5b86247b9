//! What every client of a phalanx server shares: the connection and its token, a call
//! under a deadline worded for the user, and the retry and size limits. Every call has
//! a deadline (invariant I6): the caller's timeout plus a short grace for the server's
//! own answer, after which the call fails with a timeout rather than waiting on.

use std::future::Future;
use std::time::Duration;

use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::auth::{AttachToken, JobToken};
use crate::Error;

/// Time the server gets past the caller's timeout to send its own, better-worded error.
pub(crate) const GRACE: Duration = Duration::from_millis(500);
/// How soon, and at most how long apart, a lighthouse that cannot be reached is
/// asked again for a quorum.
pub(crate) const MIN_RETRY_BACKOFF: Duration = Duration::from_millis(50);
pub(crate) const MAX_RETRY_BACKOFF: Duration = Duration::from_millis(500);

/// `base` scaled by a random factor in [0.75, 1.25), so that the groups of a job that
/// lost their lighthouse do not all ask again at the same instant.
pub(crate) fn jittered(base: Duration) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    base.mul_f64(0.75 + (random % 1000) as f64 / 2000.0)
}

/// Answers can list thousands of members; far more than requests.
pub(crate) const MAX_RESPONSE_BYTES: usize = 64 * 1024 * 1024;

pub(crate) type Authed = InterceptedService<Channel, AttachToken>;

pub(crate) fn channel(
    address: &str,
    token: &JobToken,
    connect_timeout: Duration,
) -> Result<(Channel, AttachToken), Error> {
    let channel = endpoint(address, connect_timeout)?.connect_lazy();
    let attach = AttachToken::new(token).map_err(Error::InvalidConfig)?;
    Ok((channel, attach))
}

/// Where `channel` connects to, and how: each `connect_lazy` of it is a connection of
/// its own.
pub(crate) fn endpoint(address: &str, connect_timeout: Duration) -> Result<Endpoint, Error> {
    let uri = if address.contains("://") {
        address.to_string()
    } else {
        format!("http://{address}")
    };
    let endpoint = Endpoint::from_shared(uri).map_err(|e| {
        Error::InvalidConfig(format!(
            "{address:?} is not a valid address ({e}); write it as host:port"
        ))
    })?;
    // Said now, not as "connection refused" on every call.
    if endpoint.uri().port_u16().is_none_or(|port| port == 0) {
        return Err(Error::InvalidConfig(format!(
            "{address:?} names no port, or one out of range; write it as host:port with a \
             port from 1 to 65535"
        )));
    }
    Ok(endpoint
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(20)))
}

/// Runs one call under a deadline and words transport failures for the user.
pub(crate) async fn call<T>(
    what: &'static str,
    address: &str,
    timeout: Duration,
    fut: impl Future<Output = Result<tonic::Response<T>, Status>>,
) -> Result<T, Error> {
    answer(what, address, timeout, answered(timeout, fut).await)
}

/// What a call answered by its deadline; None: nothing came. Tonic ends the call at
/// the same instant, the request's own timeout (`with_timeout`), with
/// `TimeoutExpired`: which of the two timers fires first is chance (a loaded machine
/// lets tonic's win half the time), and both mean the server said nothing.
pub(crate) async fn answered<T>(
    timeout: Duration,
    fut: impl Future<Output = Result<tonic::Response<T>, Status>>,
) -> Option<Result<tonic::Response<T>, Status>> {
    within(timeout, fut)
        .await
        .filter(|answer| !answer.as_ref().is_err_and(expired))
}

/// Whether tonic ended the call at its timeout (no status came from the server).
fn expired(status: &Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(s) = source {
        if s.is::<tonic::TimeoutExpired>() {
            return true;
        }
        source = s.source();
    }
    false
}

/// What `fut` answered by its deadline (the caller's timeout and the grace); None:
/// nothing came, not even the server's own "too late".
pub(crate) async fn within<R>(timeout: Duration, fut: impl Future<Output = R>) -> Option<R> {
    tokio::time::timeout(timeout + GRACE, fut).await.ok()
}

pub(crate) fn answer<T>(
    what: &'static str,
    address: &str,
    timeout: Duration,
    answered: Option<Result<tonic::Response<T>, Status>>,
) -> Result<T, Error> {
    match answered {
        Some(Ok(response)) => Ok(response.into_inner()),
        Some(Err(status)) => Err(word(what, address, status)),
        None => Err(Error::Rpc(Status::deadline_exceeded(format!(
            "no answer from the {what} at {address} within {:.3} s",
            timeout.as_secs_f64()
        )))),
    }
}

/// A transport failure (no server, a connection reset or broken mid-call, whatever
/// code tonic gave it) becomes a `Connect` error naming the server; a status the
/// server sent is passed on as it is.
fn word(what: &'static str, address: &str, status: Status) -> Error {
    let from_transport = std::error::Error::source(&status).is_some();
    if from_transport && status.code() != Code::DeadlineExceeded {
        let mut detail = status.message().to_string();
        let mut source = std::error::Error::source(&status);
        while let Some(s) = source {
            detail = s.to_string();
            source = s.source();
        }
        Error::Connect {
            what,
            address: address.to_string(),
            detail,
        }
    } else {
        Error::Rpc(status)
    }
}

pub(crate) fn with_timeout<T>(message: T, timeout: Duration) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(timeout + GRACE);
    request
}

pub(crate) fn timeout_ms(timeout: Duration) -> u64 {
    timeout.as_millis().clamp(1, u64::MAX as u128) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tonics_own_timeout_of_a_call_is_silence_a_status_from_the_server_is_not() {
        let expired_here = Status::from_error(Box::new(tonic::TimeoutExpired(())));
        assert!(expired(&expired_here));
        assert!(!expired(&Status::deadline_exceeded(
            "the server's own too late"
        )));
        let reset = Status::from_error(Box::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionReset,
        )));
        assert!(!expired(&reset));
    }

    #[tokio::test]
    async fn a_call_tonic_ended_at_its_timeout_answered_nothing() {
        let timed_out = async {
            Err::<tonic::Response<()>, _>(Status::from_error(Box::new(tonic::TimeoutExpired(()))))
        };
        assert!(answered(Duration::from_secs(1), timed_out).await.is_none());
        let refused = async { Err::<tonic::Response<()>, _>(Status::unavailable("not serving")) };
        assert!(answered(Duration::from_secs(1), refused).await.is_some());
    }
}
