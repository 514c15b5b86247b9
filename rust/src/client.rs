//! Clients of the lighthouse and of a manager server. Every call has a deadline
//! (invariant I6): the caller's timeout plus a short grace for the server's own
//! answer, after which the call fails with a timeout rather than waiting on.

use std::future::Future;
use std::time::Duration;

use prost::Message;
use tokio::sync::{broadcast, mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::auth::{AttachToken, JobToken};
use crate::proto::{self, PROTOCOL_VERSION};
use crate::Error;

/// Time the server gets past the caller's timeout to send its own, better-worded error.
const GRACE: Duration = Duration::from_millis(500);
/// A lighthouse that restarts is back within a second or so; its groups should be too.
const MAX_REOPEN_BACKOFF: Duration = Duration::from_millis(250);
/// Answers can list thousands of members; far more than requests.
const MAX_RESPONSE_BYTES: usize = 64 * 1024 * 1024;

type Authed = InterceptedService<Channel, AttachToken>;

fn channel(
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
async fn call<T>(
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

/// A transport failure (no server, connection reset) becomes a `Connect` error; a
/// status the server sent is passed on as it is.
fn word(what: &'static str, address: &str, status: Status) -> Error {
    let from_transport = std::error::Error::source(&status).is_some();
    if status.code() == Code::Unavailable && from_transport {
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

fn with_timeout<T>(message: T, timeout: Duration) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(timeout + GRACE);
    request
}

fn timeout_ms(timeout: Duration) -> u64 {
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

/// What a group's heartbeat reports besides being alive.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    pub last_quorum_id: u64,
    pub step: i64,
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Keeps a group's heartbeat stream open for as long as the task runs, re-opening it
/// after a lighthouse restart, and forwards the membership-loss events it receives.
pub async fn keep_heartbeat(
    client: LighthouseClient,
    replica_id: String,
    interval: Duration,
    progress: watch::Receiver<Progress>,
    events: broadcast::Sender<proto::MembershipLost>,
) {
    let mut backoff = interval;
    loop {
        let (beats_tx, beats_rx) = mpsc::channel(4);
        // Only the first beat names the group; the server reads it before answering,
        // so it is queued before the call.
        let beat = |p: Progress| proto::Beat {
            protocol_version: PROTOCOL_VERSION,
            replica_id: String::new(),
            last_quorum_id: p.last_quorum_id,
            step: p.step,
        };
        let _ = beats_tx.try_send(proto::Beat {
            replica_id: replica_id.clone(),
            ..beat(*progress.borrow())
        });
        let sender = {
            let progress = progress.clone();
            AbortOnDrop(tokio::spawn(async move {
                let mut ticker = tokio::time::interval(interval);
                ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                ticker.tick().await;
                loop {
                    ticker.tick().await;
                    let next = beat(*progress.borrow());
                    if beats_tx.send(next).await.is_err() {
                        return;
                    }
                }
            }))
        };
        match client
            .heartbeat(beats_rx, interval.max(Duration::from_secs(1)))
            .await
        {
            Ok(mut stream) => {
                backoff = interval;
                loop {
                    match stream.message().await {
                        Ok(Some(proto::LighthouseEvent {
                            event: Some(proto::lighthouse_event::Event::MembershipLost(lost)),
                        })) => {
                            let _ = events.send(lost);
                        }
                        Ok(Some(_)) => {}
                        Ok(None) => {
                            tracing::warn!(
                                replica_id,
                                "the lighthouse ended the heartbeat stream; re-opening"
                            );
                            break;
                        }
                        Err(status) => {
                            tracing::warn!(
                                replica_id,
                                "heartbeat stream lost: {}; re-opening",
                                status.message()
                            );
                            break;
                        }
                    }
                }
            }
            Err(e) => {
                tracing::warn!(
                    replica_id,
                    "cannot open the heartbeat stream: {}",
                    e.message()
                );
                backoff = (backoff * 2).min(MAX_REOPEN_BACKOFF.max(interval));
            }
        }
        drop(sender);
        tokio::time::sleep(backoff).await;
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

    pub async fn quorum(
        &self,
        group_rank: u32,
        step: i64,
        state_address: String,
        shrink_only: bool,
        timeout: Duration,
    ) -> Result<proto::ManagerQuorumResponse, Error> {
        let request = with_timeout(
            proto::ManagerQuorumRequest {
                protocol_version: PROTOCOL_VERSION,
                group_rank,
                step,
                state_address,
                shrink_only,
                timeout_ms: timeout_ms(timeout),
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

    pub async fn should_commit(
        &self,
        group_rank: u32,
        step: i64,
        vote: bool,
        timeout: Duration,
    ) -> Result<bool, Error> {
        let request = with_timeout(
            proto::ShouldCommitRequest {
                protocol_version: PROTOCOL_VERSION,
                group_rank,
                step,
                vote,
                timeout_ms: timeout_ms(timeout),
            },
            timeout,
        );
        let mut client = self.inner.clone();
        let r = call(
            "manager server",
            &self.address,
            timeout,
            client.should_commit(request),
        )
        .await?;
        Ok(r.commit)
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
