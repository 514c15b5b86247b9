//! Clients of the lighthouse and of a manager server. Every call has a deadline
//! (invariant I6): the caller's timeout plus a short grace for the server's own
//! answer, after which the call fails with a timeout rather than waiting on.

use std::future::Future;
use std::time::{Duration, Instant};

use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::auth::{AttachToken, JobToken};
use crate::proto::{self, PROTOCOL_VERSION};
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
    let channel = endpoint
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(20))
        .connect_lazy();
    let attach = AttachToken::new(token).map_err(Error::InvalidConfig)?;
    Ok((channel, attach))
}

/// Runs one call under a deadline and words transport failures for the user.
pub(crate) async fn call<T>(
    what: &'static str,
    address: &str,
    timeout: Duration,
    fut: impl Future<Output = Result<tonic::Response<T>, Status>>,
) -> Result<T, Error> {
    match tokio::time::timeout(timeout + GRACE, fut).await {
        Ok(Ok(response)) => Ok(response.into_inner()),
        Ok(Err(status)) => Err(word(what, address, status)),
        Err(_) => Err(Error::Rpc(Status::deadline_exceeded(format!(
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

#[derive(Clone)]
pub struct LighthouseClient {
    address: String,
    inner: proto::lighthouse_client::LighthouseClient<Authed>,
}

impl LighthouseClient {
    /// Does not connect yet: the first call does, and a lost connection is re-made
    /// on the next call (the lighthouse may restart at any time).
    pub fn new(address: &str, token: &JobToken, connect_timeout: Duration) -> Result<Self, Error> {
        let (channel, attach) = channel(address, token, connect_timeout)?;
        Ok(LighthouseClient {
            address: address.to_string(),
            inner: proto::lighthouse_client::LighthouseClient::with_interceptor(channel, attach)
                .max_decoding_message_size(MAX_RESPONSE_BYTES),
        })
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    /// Waits for a quorum that includes `requester`, up to `timeout`.
    pub async fn quorum(
        &self,
        requester: proto::Member,
        last_quorum_id: u64,
        timeout: Duration,
    ) -> Result<proto::Quorum, Error> {
        let encoded = self
            .quorum_encoded(requester, last_quorum_id, timeout)
            .await?;
        proto::Quorum::decode(encoded).map_err(|e| {
            Error::Rpc(Status::internal(format!(
                "the lighthouse at {} answered with a malformed quorum: {e}",
                self.address
            )))
        })
    }

    /// Like [`Self::quorum`], but a lighthouse that cannot be reached (down, or
    /// restarting) is asked again, with backoff and jitter, until `timeout`: a step
    /// waits for its quorum instead of failing at once, and a lighthouse back on its
    /// address is used again within `MAX_RETRY_BACKOFF` of its return.
    pub async fn quorum_patiently(
        &self,
        requester: proto::Member,
        last_quorum_id: u64,
        timeout: Duration,
    ) -> Result<proto::Quorum, Error> {
        let deadline = Instant::now() + timeout;
        let mut backoff = MIN_RETRY_BACKOFF;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let result = self.quorum(requester.clone(), last_quorum_id, left).await;
            let unreachable = match &result {
                Err(Error::Connect { .. }) => true,
                Err(Error::Rpc(status)) => status.code() == Code::Unavailable,
                _ => false,
            };
            let pause = jittered(backoff);
            if !unreachable || Instant::now() + pause >= deadline {
                return result;
            }
            tokio::time::sleep(pause).await;
            backoff = (backoff * 2).min(MAX_RETRY_BACKOFF);
        }
    }

    /// Like [`Self::quorum`], but leaves the answer encoded.
    pub async fn quorum_encoded(
        &self,
        requester: proto::Member,
        last_quorum_id: u64,
        timeout: Duration,
    ) -> Result<bytes::Bytes, Error> {
        let request = with_timeout(
            proto::LighthouseQuorumRequest {
                protocol_version: PROTOCOL_VERSION,
                requester: Some(requester),
                last_quorum_id,
                timeout_ms: timeout_ms(timeout),
            },
            timeout,
        );
        let mut client = self.inner.clone();
        let response = call("lighthouse", &self.address, timeout, client.quorum(request)).await?;
        Ok(response.quorum)
    }

    pub async fn status(&self, timeout: Duration) -> Result<proto::StatusResponse, Error> {
        let mut client = self.inner.clone();
        call(
            "lighthouse",
            &self.address,
            timeout,
            client.status(with_timeout(proto::StatusRequest {}, timeout)),
        )
        .await
    }

    /// Opens a heartbeat stream. Beats are sent from `beats`; events pushed by the
    /// lighthouse come back on the returned stream.
    pub async fn heartbeat(
        &self,
        beats: mpsc::Receiver<proto::Beat>,
        timeout: Duration,
    ) -> Result<tonic::Streaming<proto::LighthouseEvent>, Error> {
        let mut client = self.inner.clone();
        call(
            "lighthouse",
            &self.address,
            timeout,
            client.heartbeat(ReceiverStream::new(beats)),
        )
        .await
    }
}

#[derive(Clone)]
pub struct ManagerClient {
    address: String,
    inner: proto::manager_client::ManagerClient<Authed>,
}

impl ManagerClient {
    pub fn new(address: &str, token: &JobToken, connect_timeout: Duration) -> Result<Self, Error> {
        let (channel, attach) = channel(address, token, connect_timeout)?;
        Ok(ManagerClient {
            address: address.to_string(),
            inner: proto::manager_client::ManagerClient::with_interceptor(channel, attach)
                .max_decoding_message_size(MAX_RESPONSE_BYTES),
        })
    }

    /// Asks for the quorum of `request.step`; the protocol version and the timeout
    /// fields are filled in here.
    pub async fn quorum(
        &self,
        request: proto::ManagerQuorumRequest,
        timeout: Duration,
    ) -> Result<proto::ManagerQuorumResponse, Error> {
        let request = with_timeout(
            proto::ManagerQuorumRequest {
                protocol_version: PROTOCOL_VERSION,
                timeout_ms: timeout_ms(timeout),
                ..request
            },
            timeout,
        );
        let mut client = self.inner.clone();
        call(
            "manager server",
            &self.address,
            timeout,
            client.quorum(request),
        )
        .await
    }

    /// Casts `vote.group_rank`'s vote and returns the group's decision.
    pub async fn should_commit(
        &self,
        vote: proto::ShouldCommitRequest,
        timeout: Duration,
    ) -> Result<proto::ShouldCommitResponse, Error> {
        let request = with_timeout(
            proto::ShouldCommitRequest {
                protocol_version: PROTOCOL_VERSION,
                timeout_ms: timeout_ms(timeout),
                ..vote
            },
            timeout,
        );
        let mut client = self.inner.clone();
        call(
            "manager server",
            &self.address,
            timeout,
            client.should_commit(request),
        )
        .await
    }

    /// Reports a rank's training progress (see `proto::ProgressReport`).
    pub async fn progress(
        &self,
        report: proto::ProgressReport,
        timeout: Duration,
    ) -> Result<(), Error> {
        let request = with_timeout(
            proto::ProgressReport {
                protocol_version: PROTOCOL_VERSION,
                ..report
            },
            timeout,
        );
        let mut client = self.inner.clone();
        call(
            "manager server",
            &self.address,
            timeout,
            client.progress(request),
        )
        .await
        .map(|_| ())
    }

    /// Subscribes to the membership-loss events the manager relays.
    pub async fn events(
        &self,
        timeout: Duration,
    ) -> Result<tonic::Streaming<proto::ManagerEvent>, Error> {
        let mut client = self.inner.clone();
        call(
            "manager server",
            &self.address,
            timeout,
            client.events(proto::EventsRequest {
                protocol_version: PROTOCOL_VERSION,
            }),
        )
        .await
    }
}
