//! Clients of the lighthouse and of a manager server. Every call has a deadline
//! (invariant I6): the caller's timeout plus a short grace for the server's own
//! answer, after which the call fails with a timeout rather than waiting on.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prost::Message;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::auth::{AttachToken, JobToken};
use crate::manager::LocalManager;
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
    // Said now, not as "connection refused" on every call.
    if endpoint.uri().port_u16().is_none_or(|port| port == 0) {
        return Err(Error::InvalidConfig(format!(
            "{address:?} names no port, or one out of range; write it as host:port with a \
             port from 1 to 65535"
        )));
    }
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

/// The quorum a lighthouse at `address` answered with.
pub(crate) fn decode_quorum(encoded: bytes::Bytes, address: &str) -> Result<proto::Quorum, Error> {
    proto::Quorum::decode(encoded).map_err(|e| {
        Error::Rpc(Status::internal(format!(
            "the lighthouse at {address} answered with a malformed quorum: {e}"
        )))
    })
}

/// A client of the job's lighthouse, or of a set of them (`a:p,b:p,c:p`): calls go to
/// one lighthouse at a time, the one that served last; a call that cannot reach it, or
/// that it refuses because another serves, moves every clone of this client to the
/// lighthouse it names (`lighthouse::set::LEADER_KEY`), or else to the next in the list.
#[derive(Clone)]
pub struct LighthouseClient {
    addresses: Arc<Vec<String>>,
    inners: Vec<proto::lighthouse_client::LighthouseClient<Authed>>,
    /// The index of the lighthouse asked now, shared by clones: a group's heartbeat and
    /// its quorum requests follow the same one.
    current: Arc<watch::Sender<usize>>,
}

/// Whether a failed call says nothing serves there: not reachable, or refused as not
/// the serving lighthouse of a set.
fn unreachable(error: &Error) -> bool {
    match error {
        Error::Connect { .. } => true,
        Error::Rpc(status) => status.code() == Code::Unavailable,
        _ => false,
    }
}

/// The serving lighthouse a refusal names, if it names one.
fn leader_hint(error: &Error) -> Option<String> {
    match error {
        Error::Rpc(status) => status
            .metadata()
            .get(crate::lighthouse::set::LEADER_KEY)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        _ => None,
    }
}

impl LighthouseClient {
    /// Does not connect yet: the first call does, and a lost connection is re-made
    /// on the next call (the lighthouse may restart at any time). `address` is one
    /// host:port, or a comma-separated list of a set's lighthouses.
    pub fn new(address: &str, token: &JobToken, connect_timeout: Duration) -> Result<Self, Error> {
        let addresses: Vec<String> = address
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(str::to_string)
            .collect();
        if addresses.is_empty() {
            return Err(Error::InvalidConfig(format!(
                "{address:?} names no lighthouse; write host:port, or host:port,host:port,... \
                 for a set of lighthouses"
            )));
        }
        let inners = addresses
            .iter()
            .map(|a| {
                let (channel, attach) = channel(a, token, connect_timeout)?;
                Ok(
                    proto::lighthouse_client::LighthouseClient::with_interceptor(channel, attach)
                        .max_decoding_message_size(MAX_RESPONSE_BYTES),
                )
            })
            .collect::<Result<_, Error>>()?;
        Ok(LighthouseClient {
            addresses: Arc::new(addresses),
            inners,
            current: Arc::new(watch::channel(0).0),
        })
    }

    /// The lighthouse asked now.
    pub fn address(&self) -> &str {
        &self.addresses[self.lighthouse_index()]
    }

    /// Every lighthouse this client may ask.
    pub fn addresses(&self) -> &[String] {
        &self.addresses
    }

    pub fn lighthouse_index(&self) -> usize {
        *self.current.borrow()
    }

    /// After a failed call to lighthouse `at`: moves to the one the refusal names, or
    /// else to the next. Returns whether a lighthouse was named (worth asking at once).
    pub fn move_on(&self, at: usize, error: &Error) -> bool {
        let n = self.addresses.len();
        if n == 1 || !unreachable(error) {
            return false;
        }
        let named = leader_hint(error).and_then(|a| self.addresses.iter().position(|x| *x == a));
        let next = named.unwrap_or((at + 1) % n);
        self.current.send_if_modified(|c| {
            let moved = *c == at && next != at;
            if moved {
                *c = next;
            }
            moved
        });
        if named.is_none() {
            tracing::info!(
                "the lighthouse at {} does not serve; trying {}",
                self.addresses[at],
                self.addresses[next]
            );
        }
        named.is_some()
    }

    /// Moves past lighthouse `at` (a heartbeat stream to it went silent).
    pub fn move_past(&self, at: usize, why: &str) {
        self.move_on(
            at,
            &Error::Rpc(Status::unavailable(format!(
                "the lighthouse at {} {why}",
                self.addresses[at]
            ))),
        );
    }

    /// Runs one call on lighthouse `at`; in a set, gives up on it as soon as another
    /// call moved this client elsewhere, and moves on when it does not serve.
    async fn on_current<T, F, Fut>(&self, f: F) -> Result<T, Error>
    where
        F: FnOnce(proto::lighthouse_client::LighthouseClient<Authed>, String) -> Fut,
        Fut: Future<Output = Result<T, Error>>,
    {
        let at = self.lighthouse_index();
        let address = self.addresses[at].clone();
        let call = f(self.inners[at].clone(), address.clone());
        let result = if self.addresses.len() == 1 {
            call.await
        } else {
            let mut moved = self.current.subscribe();
            tokio::select! {
                r = call => r,
                _ = moved.wait_for(|c| *c != at) => Err(Error::Rpc(Status::unavailable(format!(
                    "left the lighthouse at {address}: another call found it does not serve"
                )))),
            }
        };
        if let Err(e) = &result {
            self.move_on(at, e);
        }
        result
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
        decode_quorum(encoded, self.address())
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
            let unreachable = matches!(&result, Err(e) if unreachable(e));
            // A refusal that names the serving lighthouse of a set is followed at once.
            let pause = match &result {
                Err(e) if self.addresses.len() > 1 && leader_hint(e).is_some() => Duration::ZERO,
                _ => jittered(backoff),
            };
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
        let response = self
            .on_current(|mut client, address| async move {
                call("lighthouse", &address, timeout, client.quorum(request)).await
            })
            .await?;
        Ok(response.quorum)
    }

    pub async fn status(&self, timeout: Duration) -> Result<proto::StatusResponse, Error> {
        self.on_current(|mut client, address| async move {
            let request = with_timeout(proto::StatusRequest {}, timeout);
            call("lighthouse", &address, timeout, client.status(request)).await
        })
        .await
    }

    /// Opens a heartbeat stream. Beats are sent from `beats`; events pushed by the
    /// lighthouse come back on the returned stream.
    pub async fn heartbeat(
        &self,
        beats: mpsc::Receiver<proto::Beat>,
        timeout: Duration,
    ) -> Result<tonic::Streaming<proto::LighthouseEvent>, Error> {
        self.on_current(|mut client, address| async move {
            let beats = ReceiverStream::new(beats);
            call("lighthouse", &address, timeout, client.heartbeat(beats)).await
        })
        .await
    }
}

#[derive(Clone)]
pub struct ManagerClient {
    address: String,
    inner: proto::manager_client::ManagerClient<Authed>,
    /// The manager server itself, when this process hosts it: quorums, votes and
    /// progress go to it directly (events still come over the network).
    local: Option<LocalManager>,
}

impl ManagerClient {
    pub fn new(address: &str, token: &JobToken, connect_timeout: Duration) -> Result<Self, Error> {
        let (channel, attach) = channel(address, token, connect_timeout)?;
        Ok(ManagerClient {
            address: address.to_string(),
            inner: proto::manager_client::ManagerClient::with_interceptor(channel, attach)
                .max_decoding_message_size(MAX_RESPONSE_BYTES),
            local: None,
        })
    }

    /// This client's calls go to `server`, hosted by this process, without the network.
    pub fn in_process(self, server: LocalManager) -> Self {
        ManagerClient {
            local: Some(server),
            ..self
        }
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
        if let Some(local) = &self.local {
            return call(
                "manager server",
                &self.address,
                timeout,
                local.quorum(request),
            )
            .await;
        }
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
        if let Some(local) = &self.local {
            return call(
                "manager server",
                &self.address,
                timeout,
                local.should_commit(request),
            )
            .await;
        }
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
        if let Some(local) = &self.local {
            return call(
                "manager server",
                &self.address,
                timeout,
                local.progress(request),
            )
            .await
            .map(|_| ());
        }
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
