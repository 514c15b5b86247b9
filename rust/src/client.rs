//! Clients of the lighthouse and of a manager server. Every call has a deadline
//! (invariant I6): the caller's timeout plus a short grace for the server's own
//! answer, after which the call fails with a timeout rather than waiting on.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prost::Message;
use tokio::sync::{broadcast, mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::auth::{AttachToken, JobToken};
use crate::gate::{self, GroupRefusals, RefusalCounts};
use crate::proto::{self, PROTOCOL_VERSION};
use crate::Error;

/// Time the server gets past the caller's timeout to send its own, better-worded error.
pub(crate) const GRACE: Duration = Duration::from_millis(500);
/// A lighthouse that restarts is back within a second or so; its groups should be too.
const MAX_REOPEN_BACKOFF: Duration = Duration::from_millis(250);
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

/// What a group's heartbeat reports besides being alive.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    pub last_quorum_id: u64,
    pub step: i64,
}

/// What the lighthouse last acknowledged: while `until` is ahead, it will not declare
/// this group dead, and the group is a live member of quorum `quorum_id` (0: none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    pub quorum_id: u64,
    pub until: Instant,
    /// When the acknowledged beat was sent.
    pub sent_at: Instant,
}

impl Lease {
    /// Whether the group may still commit a step of `quorum_id` at `now`.
    pub fn holds(&self, quorum_id: u64, now: Instant) -> bool {
        quorum_id != 0 && self.quorum_id == quorum_id && now < self.until
    }
}

/// The part of a lease the group keeps for itself: clocks tick at slightly different
/// rates and a decision takes a moment after its check.
fn lease_length(lease_ms: u64) -> Duration {
    let granted = Duration::from_millis(lease_ms);
    granted.saturating_sub((granted / 10).max(Duration::from_millis(20)))
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
/// The send times of the beats not acknowledged yet, by sequence number.
#[derive(Default)]
struct InFlight(Mutex<VecDeque<(u64, Instant)>>);

impl InFlight {
    /// Keeps a bounded history: a lighthouse that never answers cannot grow it.
    const KEPT: usize = 256;

    fn sent(&self, seq: u64, at: Instant) {
        let mut sent = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if sent.len() == Self::KEPT {
            sent.pop_front();
        }
        sent.push_back((seq, at));
    }

    /// The send time of `seq`, forgetting it and every earlier beat.
    fn acknowledged(&self, seq: u64) -> Option<Instant> {
        let mut sent = self.0.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(&(s, at)) = sent.front() {
            if s > seq {
                return None;
            }
            sent.pop_front();
            if s == seq {
                return Some(at);
            }
        }
        None
    }
}

#[allow(clippy::too_many_arguments)]
pub async fn keep_heartbeat(
    client: LighthouseClient,
    replica_id: String,
    manager_address: String,
    interval: Duration,
    progress: watch::Receiver<Progress>,
    events: broadcast::Sender<proto::MembershipLost>,
    lease: watch::Sender<Option<Lease>>,
    refusals: Arc<GroupRefusals>,
) {
    let mut backoff = interval;
    loop {
        let (beats_tx, beats_rx) = mpsc::channel(4);
        let in_flight = Arc::new(InFlight::default());
        // Refusal counts ride on a beat when they changed (and on a stream's first).
        let mut reported = RefusalCounts::new();
        let refusals = refusals.clone();
        let mut beat = move |p: Progress, seq: u64| {
            let totals = refusals.totals();
            let refused = if totals == reported {
                Vec::new()
            } else {
                reported = totals;
                gate::counts_to_wire(&reported)
            };
            proto::Beat {
                protocol_version: PROTOCOL_VERSION,
                replica_id: String::new(),
                manager_address: String::new(),
                last_quorum_id: p.last_quorum_id,
                step: p.step,
                seq,
                refused,
            }
        };
        // Only the first beat names the group; the server reads it before answering,
        // so it is queued before the call.
        in_flight.sent(1, Instant::now());
        let _ = beats_tx.try_send(proto::Beat {
            replica_id: replica_id.clone(),
            manager_address: manager_address.clone(),
            ..beat(*progress.borrow(), 1)
        });
        let sender = {
            let progress = progress.clone();
            let in_flight = in_flight.clone();
            AbortOnDrop(tokio::spawn(async move {
                let mut ticker = tokio::time::interval(interval);
                ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                ticker.tick().await;
                let mut seq = 1;
                loop {
                    ticker.tick().await;
                    seq += 1;
                    // Stamped before it is queued: a lease counts from no later than
                    // the beat's real departure.
                    in_flight.sent(seq, Instant::now());
                    let next = beat(*progress.borrow(), seq);
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
                        Ok(Some(proto::LighthouseEvent {
                            event: Some(proto::lighthouse_event::Event::Lease(granted)),
                        })) => {
                            if let Some(sent_at) = in_flight.acknowledged(granted.seq) {
                                lease.send_replace(Some(Lease {
                                    quorum_id: granted.quorum_id,
                                    until: sent_at + lease_length(granted.lease_ms),
                                    sent_at,
                                }));
                            }
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
        // Without a stream the group cannot know whether the lighthouse still counts
        // it in: no lease until a new stream's first acknowledgement.
        lease.send_replace(None);
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
