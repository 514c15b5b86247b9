//! The client of the job's lighthouse, or of a set of them: one lighthouse asked at a
//! time, the route moved on when it does not serve or goes silent. Its calls run under
//! the deadlines of `crate::transport`.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prost::Message;
use tokio::sync::{mpsc, watch};
use tonic::transport::Endpoint;
use tonic::{Code, Status};

use super::jobs::{JobRequest, JOB_KEY, RULES_KEY};
use super::wire::{self, BeatEvents, BeatTransport};
use crate::auth::{AttachToken, JobToken};
use crate::proto::{self, LEADER_KEY, PROTOCOL_VERSION};
use crate::transport::{
    answer, answered, endpoint, jittered, timeout_ms, with_timeout, within, Authed,
    MAX_RESPONSE_BYTES, MAX_RETRY_BACKOFF, MIN_RETRY_BACKOFF,
};
use crate::Error;

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
    /// Where and how a framed heartbeat stream opens (see `super::wire`).
    beat_address: String,
    hello: proto::BeatOpen,
    /// The client of the connection in use, and the first epoch it serves in.
    client: Mutex<(u64, Client)>,
}

impl Link {
    fn new(
        address: &str,
        token: &JobToken,
        job: &JobRequest,
        connect_timeout: Duration,
    ) -> Result<Self, Error> {
        let endpoint = endpoint(address, connect_timeout.min(CONNECT_ATTEMPT))?;
        // A call's metadata and a framed stream's opening say the same.
        let mut attach = AttachToken::new(token).map_err(Error::InvalidConfig)?;
        let mut hello = proto::BeatOpen {
            token: token.header_value().unwrap_or_default(),
            ..Default::default()
        };
        for (key, value) in job.metadata() {
            attach = attach.with(key, &value).map_err(Error::InvalidConfig)?;
            match key {
                JOB_KEY => hello.job = value,
                RULES_KEY => hello.job_rules = value,
                _ => {}
            }
        }
        let client = Link::connect(&endpoint, &attach);
        let uri = endpoint.uri();
        let beat_address = format!(
            "{}:{}",
            uri.host().unwrap_or_default(),
            uri.port_u16().unwrap_or_default()
        );
        Ok(Link {
            endpoint,
            attach,
            beat_address,
            hello,
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
/// lighthouse it names (`proto::LEADER_KEY`), or else to the next in the list.
/// A heartbeat stream that goes silent gives up its connection for a fresh one
/// ([`Self::went_silent`]), and every call waiting on the old one asks again.
#[derive(Clone)]
pub struct LighthouseClient {
    addresses: Arc<Vec<String>>,
    links: Arc<Vec<Link>>,
    /// The route asked now, shared by clones: a group's heartbeat and its quorum
    /// requests follow the same one.
    current: Arc<watch::Sender<Route>>,
    beats_over: BeatTransport,
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
            .get(LEADER_KEY)
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
        Self::for_job(address, token, &JobRequest::default(), connect_timeout)
    }

    /// A client whose every request is for job `job` (see `super::jobs`).
    pub fn for_job(
        address: &str,
        token: &JobToken,
        job: &JobRequest,
        connect_timeout: Duration,
    ) -> Result<Self, Error> {
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
            .map(|a| Link::new(a, token, job, connect_timeout))
            .collect::<Result<_, Error>>()?;
        Ok(LighthouseClient {
            addresses: Arc::new(addresses),
            links: Arc::new(links),
            current: Arc::new(watch::channel(Route { index: 0, epoch: 0 }).0),
            beats_over: BeatTransport::default(),
        })
    }

    /// This client's heartbeat streams go over `transport` (framed, beats as
    /// datagrams when offered, by default).
    pub fn beats_over(mut self, transport: BeatTransport) -> Self {
        self.beats_over = transport;
        self
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
        let call = answered(timeout, f(self.links[at.index].lock().1.clone()));
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

    /// Opens a heartbeat stream, framed on a connection of its own unless the client
    /// beats over gRPC (see `super::wire`). Beats are sent from `beats`; events pushed
    /// by the lighthouse come back on the returned stream.
    pub async fn heartbeat(
        &self,
        beats: mpsc::Receiver<proto::Beat>,
        timeout: Duration,
    ) -> Result<BeatEvents, Error> {
        self.open_heartbeat(beats, timeout).await.1
    }

    /// Like [`Self::heartbeat`], and says which route the stream went out on (for
    /// [`Self::move_on`] and [`Self::went_silent`]).
    pub async fn open_heartbeat(
        &self,
        beats: mpsc::Receiver<proto::Beat>,
        timeout: Duration,
    ) -> (Route, Result<BeatEvents, Error>) {
        if self.beats_over == BeatTransport::Grpc {
            let beats = tokio_stream::wrappers::ReceiverStream::new(beats);
            let attempt = self
                .on_route(timeout, |mut client| async move {
                    client.heartbeat(beats).await
                })
                .await;
            return (attempt.route, attempt.result.map(BeatEvents::grpc));
        }
        let at = self.route();
        let link = &self.links[at.index];
        let connect = timeout.min(CONNECT_ATTEMPT);
        let datagrams = self.beats_over == BeatTransport::Datagrams;
        let opening = wire::open(&link.beat_address, &link.hello, beats, connect, datagrams);
        let result = within(timeout, opening).await.unwrap_or_else(|| {
            self.went_silent(at);
            Err(Error::Rpc(Status::deadline_exceeded(format!(
                "the lighthouse at {} took no heartbeat stream within {:.3} s",
                self.addresses[at.index],
                timeout.as_secs_f64()
            ))))
        });
        if let Err(e) = &result {
            self.move_on(at, e);
        }
        (at, result)
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    /// A client of a listener that accepts connections and never answers on them: a
    /// lighthouse behind a cut, as far as an open connection can tell. The listener
    /// lives as long as the task returned.
    async fn cut_off() -> (LighthouseClient, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let held = tokio::spawn(async move {
            let mut connections = Vec::new();
            while let Ok((connection, _)) = listener.accept().await {
                connections.push(connection);
            }
        });
        let client =
            LighthouseClient::new(&address, &JobToken::default(), CONNECT_ATTEMPT).expect("client");
        (client, held)
    }

    #[tokio::test]
    async fn a_silent_route_is_given_up_once_and_its_waiting_call_asks_again() {
        let (client, _held) = cut_off().await;
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
        let (client, _held) = cut_off().await;
        let before = client.route();
        // On a loaded machine the connection itself may take longer than an attempt
        // may (CONNECT_ATTEMPT): that is a failed connect, not a silent lighthouse,
        // and the next call connects again. Some call gets through to the silence. A
        // deadline of a second, not less: a call's connect, made within it, must
        // outlast a loaded machine's scheduling. (Most "failed connects" seen here were
        // tonic's own timeout of the call firing with ours: now read as the silence it
        // is, see `transport::answered`.)
        for _ in 0..10 {
            let status = client.status(Duration::from_secs(1)).await;
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
