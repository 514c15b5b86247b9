//! Clients of the lighthouse and of a manager server. Every call has a deadline
//! (invariant I6): the caller's timeout plus a short grace for the server's own
//! answer, after which the call fails with a timeout rather than waiting on.

use std::future::Future;
use std::sync::{Arc, Mutex};
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
    let channel = endpoint(address, connect_timeout)?.connect_lazy();
    let attach = AttachToken::new(token).map_err(Error::InvalidConfig)?;
    Ok((channel, attach))
}

/// Where `channel` connects to, and how: each `connect_lazy` of it is a connection of
/// its own.
fn endpoint(address: &str, connect_timeout: Duration) -> Result<Endpoint, Error> {
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
    answer(what, address, timeout, within(timeout, fut).await)
}

/// What `fut` answered by its deadline (the caller's timeout and the grace); None:
/// nothing came, not even the server's own "too late".
async fn within<R>(timeout: Duration, fut: impl Future<Output = R>) -> Option<R> {
    tokio::time::timeout(timeout + GRACE, fut).await.ok()
}

fn answer<T>(
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

/// The quorum a lighthouse at `address` answered with.
pub(crate) fn decode_quorum(encoded: bytes::Bytes, address: &str) -> Result<proto::Quorum, Error> {
    proto::Quorum::decode(encoded).map_err(|e| {
        Error::Rpc(Status::internal(format!(
            "the lighthouse at {address} answered with a malformed quorum: {e}"
        )))
    })
}

/// How long one attempt to connect to a lighthouse may take. A SYN lost to a cut is
/// sent again by the kernel only after 1 s, then 3 s more; a new attempt this soon
/// sends a fresh one, so that a group reaches its lighthouse within about this much of
/// the cut's end. Every lighthouse call that matters is asked again on failure (the
/// heartbeat, `quorum_patiently`), so a short attempt costs nothing else.
pub(crate) const CONNECT_ATTEMPT: Duration = Duration::from_millis(500);

type Client = proto::lighthouse_client::LighthouseClient<Authed>;

/// Which lighthouse a client asks now, and over which connection: `epoch` counts every
/// change of either, so that a call can tell that the route it went out on was given up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    pub index: usize,
    pub epoch: u64,
}

/// One lighthouse's connection, swapped for a fresh one when a stream over it goes
/// silent.
struct Link {
    endpoint: Endpoint,
    attach: AttachToken,
    /// The client of the connection in use, and the first epoch it serves in.
    client: Mutex<(u64, Client)>,
}

impl Link {
    fn new(address: &str, token: &JobToken, connect_timeout: Duration) -> Result<Self, Error> {
        let endpoint = endpoint(address, connect_timeout.min(CONNECT_ATTEMPT))?;
        let attach = AttachToken::new(token).map_err(Error::InvalidConfig)?;
        let client = Link::connect(&endpoint, &attach);
        Ok(Link {
            endpoint,
            attach,
            client: Mutex::new((0, client)),
        })
    }

    /// A client over a connection of its own, made on its first call.
    fn connect(endpoint: &Endpoint, attach: &AttachToken) -> Client {
        proto::lighthouse_client::LighthouseClient::with_interceptor(
            endpoint.connect_lazy(),
            attach.clone(),
        )
        .max_decoding_message_size(MAX_RESPONSE_BYTES)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (u64, Client)> {
        self.client.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What one call on the current route came to.
struct Attempt<T> {
    route: Route,
    result: Result<T, Error>,
    /// The route was given up while the call waited (another call moved the client,
    /// or a stream found the connection silent): worth asking again at once.
    superseded: bool,
}

/// A client of the job's lighthouse, or of a set of them (`a:p,b:p,c:p`): calls go to
/// one lighthouse at a time, the one that served last; a call that cannot reach it, or
/// that it refuses because another serves, moves every clone of this client to the
/// lighthouse it names (`lighthouse::set::LEADER_KEY`), or else to the next in the list.
/// A heartbeat stream that goes silent gives up its connection for a fresh one
/// ([`Self::went_silent`]), and every call waiting on the old one asks again.
#[derive(Clone)]
pub struct LighthouseClient {
    addresses: Arc<Vec<String>>,
    links: Arc<Vec<Link>>,
    /// The route asked now, shared by clones: a group's heartbeat and its quorum
    /// requests follow the same one.
    current: Arc<watch::Sender<Route>>,
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
    /// host:port, or a comma-separated list of a set's lighthouses. One attempt to
    /// connect takes at most `connect_timeout`, and never more than `CONNECT_ATTEMPT`.
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
        let links = addresses
            .iter()
            .map(|a| Link::new(a, token, connect_timeout))
            .collect::<Result<_, Error>>()?;
        Ok(LighthouseClient {
            addresses: Arc::new(addresses),
            links: Arc::new(links),
            current: Arc::new(watch::channel(Route { index: 0, epoch: 0 }).0),
        })
    }

    /// The lighthouse asked now.
    pub fn address(&self) -> &str {
        &self.addresses[self.route().index]
    }

    /// Every lighthouse this client may ask.
    pub fn addresses(&self) -> &[String] {
        &self.addresses
    }

    pub fn route(&self) -> Route {
        *self.current.borrow()
    }

    /// After a failed call on route `at`: moves to the lighthouse the refusal names, or
    /// else to the next. Returns whether a lighthouse was named (worth asking at once).
    pub fn move_on(&self, at: Route, error: &Error) -> bool {
        let n = self.addresses.len();
        if n == 1 || !unreachable(error) {
            return false;
        }
        let named = leader_hint(error).and_then(|a| self.addresses.iter().position(|x| *x == a));
        let next = named.unwrap_or((at.index + 1) % n);
        let moved = self.current.send_if_modified(|c| {
            // A failure on a route given up since says nothing of the current one.
            let moved = *c == at && next != at.index;
            if moved {
                *c = Route {
                    index: next,
                    epoch: c.epoch + 1,
                };
            }
            moved
        });
        if moved && named.is_none() {
            tracing::info!(
                "the lighthouse at {} does not serve; trying {}",
                self.addresses[at.index],
                self.addresses[next]
            );
        }
        named.is_some()
    }

    /// A heartbeat stream opened on route `at` heard nothing for too long: its
    /// connection is given up for a fresh one. A connection into a cut sits in the
    /// kernel's retransmission backoff, seconds after the network is back, and
    /// HTTP/2 keepalive would take half a minute to close it; a new one is made as
    /// soon as the lighthouse can be reached. Every call still waiting on the route
    /// asks again, and in a set the next lighthouse is tried.
    pub fn went_silent(&self, at: Route) {
        let n = self.addresses.len();
        self.current.send_if_modified(|c| {
            let link = &self.links[at.index];
            {
                let mut client = link.lock();
                if client.0 > at.epoch {
                    // Given up already, since that stream opened.
                    return false;
                }
                *client = (c.epoch + 1, Link::connect(&link.endpoint, &link.attach));
            }
            if c.index != at.index {
                return false;
            }
            c.epoch += 1;
            if n > 1 {
                c.index = (at.index + 1) % n;
            }
            true
        });
    }

    /// Runs one call on the current route, up to `timeout` and the grace; gives up on
    /// it as soon as another call moved this client elsewhere or its connection was
    /// given up, and moves on when the lighthouse does not serve. A call that hears
    /// nothing at all by its deadline gives up its connection as a silent stream does.
    async fn on_route<T, F, Fut>(&self, timeout: Duration, f: F) -> Attempt<T>
    where
        F: FnOnce(Client) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let at = self.route();
        let address = &self.addresses[at.index];
        let call = within(timeout, f(self.links[at.index].lock().1.clone()));
        let mut moved = self.current.subscribe();
        let (result, superseded) = tokio::select! {
            answered = call => {
                if answered.is_none() {
                    self.went_silent(at);
                }
                (answer("lighthouse", address, timeout, answered), false)
            }
            _ = moved.wait_for(|c| *c != at) => (Err(Error::Rpc(Status::unavailable(format!(
                "left the lighthouse at {address}: another call found it silent, or not serving"
            )))), true),
        };
        if let Err(e) = &result {
            self.move_on(at, e);
        }
        Attempt {
            route: at,
            result,
            superseded,
        }
    }

    /// Waits for a quorum that includes `requester`, up to `timeout`.
    pub async fn quorum(
        &self,
        requester: proto::Member,
        last_quorum_id: u64,
        timeout: Duration,
    ) -> Result<proto::Quorum, Error> {
        let attempt = self
            .quorum_attempt(requester, last_quorum_id, timeout)
            .await;
        self.decoded(attempt)
    }

    /// Like [`Self::quorum`], but a lighthouse that cannot be reached (down,
    /// restarting, or cut off) is asked again, with backoff and jitter, until
    /// `timeout`: a step waits for its quorum instead of failing at once, and a
    /// lighthouse back on its address is used again within `MAX_RETRY_BACKOFF` of its
    /// return (within `CONNECT_ATTEMPT` of a cut's end).
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
            let started = Instant::now();
            let attempt = self
                .quorum_attempt(requester.clone(), last_quorum_id, left)
                .await;
            let superseded = attempt.superseded;
            let result = self.decoded(attempt);
            let unreachable = matches!(&result, Err(e) if unreachable(e));
            let pause = match &result {
                // Given up for a fresh connection, or the serving lighthouse of a set
                // was named: asked again at once.
                _ if superseded => Duration::ZERO,
                Err(e) if self.addresses.len() > 1 && leader_hint(e).is_some() => Duration::ZERO,
                // An attempt that took the pause (a connect into a cut) has waited it.
                _ => jittered(backoff).saturating_sub(started.elapsed()),
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
        self.quorum_attempt(requester, last_quorum_id, timeout)
            .await
            .result
    }

    async fn quorum_attempt(
        &self,
        requester: proto::Member,
        last_quorum_id: u64,
        timeout: Duration,
    ) -> Attempt<bytes::Bytes> {
        let request = with_timeout(
            proto::LighthouseQuorumRequest {
                protocol_version: PROTOCOL_VERSION,
                requester: Some(requester),
                last_quorum_id,
                timeout_ms: timeout_ms(timeout),
            },
            timeout,
        );
        let attempt = self
            .on_route(
                timeout,
                |mut client| async move { client.quorum(request).await },
            )
            .await;
        Attempt {
            route: attempt.route,
            result: attempt.result.map(|response| response.quorum),
            superseded: attempt.superseded,
        }
    }

    fn decoded(&self, attempt: Attempt<bytes::Bytes>) -> Result<proto::Quorum, Error> {
        attempt
            .result
            .and_then(|encoded| decode_quorum(encoded, &self.addresses[attempt.route.index]))
    }

    pub async fn status(&self, timeout: Duration) -> Result<proto::StatusResponse, Error> {
        let request = with_timeout(proto::StatusRequest {}, timeout);
        self.on_route(
            timeout,
            |mut client| async move { client.status(request).await },
        )
        .await
        .result
    }

    /// Opens a heartbeat stream. Beats are sent from `beats`; events pushed by the
    /// lighthouse come back on the returned stream.
    pub async fn heartbeat(
        &self,
        beats: mpsc::Receiver<proto::Beat>,
        timeout: Duration,
    ) -> Result<tonic::Streaming<proto::LighthouseEvent>, Error> {
        self.open_heartbeat(beats, timeout).await.1
    }

    /// Like [`Self::heartbeat`], and says which route the stream went out on (for
    /// [`Self::move_on`] and [`Self::went_silent`]).
    pub async fn open_heartbeat(
        &self,
        beats: mpsc::Receiver<proto::Beat>,
        timeout: Duration,
    ) -> (
        Route,
        Result<tonic::Streaming<proto::LighthouseEvent>, Error>,
    ) {
        let beats = ReceiverStream::new(beats);
        let attempt = self
            .on_route(timeout, |mut client| async move {
                client.heartbeat(beats).await
            })
            .await;
        (attempt.route, attempt.result)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener that accepts connections and never answers on them: a lighthouse
    /// behind a cut, as far as an open connection can tell.
    async fn black_hole() -> (String, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let held = tokio::spawn(async move {
            let mut connections = Vec::new();
            while let Ok((connection, _)) = listener.accept().await {
                connections.push(connection);
            }
        });
        (address, held)
    }

    #[tokio::test]
    async fn a_silent_route_is_given_up_once_and_its_waiting_call_asks_again() {
        let (address, _held) = black_hole().await;
        let client =
            LighthouseClient::new(&address, &JobToken::default(), CONNECT_ATTEMPT).expect("client");
        let before = client.route();
        let waiting = {
            let client = client.clone();
            tokio::spawn(async move {
                let request = with_timeout(proto::StatusRequest {}, Duration::from_secs(30));
                client
                    .on_route(Duration::from_secs(30), |mut c| async move {
                        c.status(request).await
                    })
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiting.is_finished());

        client.went_silent(before);
        let attempt = tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .expect("the waiting call gives up at once")
            .unwrap();
        assert!(attempt.superseded && attempt.route == before);
        assert!(matches!(&attempt.result, Err(e) if unreachable(e)));
        let after = client.route();
        assert_eq!((after.index, after.epoch), (0, before.epoch + 1));

        // The same silence heard again (a second stream of that route) changes nothing.
        client.went_silent(before);
        assert_eq!(client.route(), after);
    }

    #[tokio::test]
    async fn a_call_that_hears_nothing_by_its_deadline_gives_up_its_connection() {
        let (address, _held) = black_hole().await;
        let client =
            LighthouseClient::new(&address, &JobToken::default(), CONNECT_ATTEMPT).expect("client");
        let before = client.route();
        // On a loaded machine the connection itself may take longer than an attempt
        // may (CONNECT_ATTEMPT): that is a failed connect, not a silent lighthouse,
        // and the next call connects again. Some call gets through to the silence.
        for _ in 0..10 {
            let status = client.status(Duration::from_millis(100)).await;
            match &status {
                Err(Error::Connect { .. }) => continue,
                Err(Error::Rpc(s)) if s.code() == Code::DeadlineExceeded => {
                    assert_eq!(client.route().epoch, before.epoch + 1);
                    return;
                }
                other => panic!("{:?}", other.as_ref().err()),
            }
        }
        panic!("ten calls could not connect to a listening socket on loopback");
    }
}
