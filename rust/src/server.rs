//! Starting and stopping a tonic server, shared by the lighthouse and the manager.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::service::Routes;

use crate::door::{self, Door, Guarded};
use crate::frames;
use crate::Error;

/// How long a stopping server waits for open calls before dropping them.
const GRACE: Duration = Duration::from_secs(1);
/// Calls open at once on one connection: a rank keeps a handful (its event stream, a
/// quorum request, a vote, store waits).
const MAX_STREAMS_PER_CONNECTION: u32 = 64;
/// Request headers are a path and a token; hyper's default allows 16 MiB.
const MAX_HEADER_BYTES: u32 = 16 * 1024;

/// A running server. Dropping it stops the server too, without waiting.
pub struct ServerHandle {
    addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl ServerHandle {
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Signals every task of the server, gives open calls a short grace, then ends them.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(true);
        for task in self.tasks.drain(..) {
            let abort = task.abort_handle();
            if tokio::time::timeout(GRACE, task).await.is_err() {
                abort.abort();
            }
        }
    }

    pub fn add_task(&mut self, task: JoinHandle<()>) {
        self.tasks.push(task);
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// The "host:port" others should use to reach a server bound to `bound`: the given
/// host, else the bound IP, else (bound to all interfaces) this machine's hostname.
pub fn advertised_address(bound: SocketAddr, host: Option<&str>) -> String {
    let host = match host {
        Some(h) if !h.is_empty() => h.to_string(),
        _ if bound.ip().is_unspecified() => {
            gethostname::gethostname().to_string_lossy().into_owned()
        }
        _ => bound.ip().to_string(),
    };
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{}", bound.port())
    } else {
        format!("{host}:{}", bound.port())
    }
}

/// Binds `address` ("host:port", port 0 for any free port).
pub async fn bind(address: &str) -> Result<(TcpListener, SocketAddr), Error> {
    let bind_error = |source| Error::Bind {
        address: address.to_string(),
        source,
    };
    let listener = TcpListener::bind(address).await.map_err(bind_error)?;
    let addr = listener.local_addr().map_err(bind_error)?;
    Ok((listener, addr))
}

/// Binds `host` at the port of `bound` too, unless `bound` already covers it (the same
/// IP, or all interfaces): a server whose group meets it at one address and its
/// peers at another listens on both, and on nothing else.
pub async fn bind_also(bound: SocketAddr, host: &str) -> Result<Option<TcpListener>, Error> {
    let address = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{}", bound.port())
    } else {
        format!("{host}:{}", bound.port())
    };
    let resolved = tokio::net::lookup_host(&address)
        .await
        .ok()
        .and_then(|mut addrs| addrs.next());
    match resolved {
        Some(addr) if bound.ip().is_unspecified() || addr.ip() == bound.ip() => Ok(None),
        _ => bind(&address).await.map(|(listener, _)| Some(listener)),
    }
}

/// Sends each connection `admitted` on to `http` or `framed` by its first byte, read
/// by a task of its own: a connection that sends nothing holds up no other.
async fn sort(
    mut admitted: mpsc::Receiver<Guarded>,
    http: mpsc::Sender<Guarded>,
    framed: FramedDoor,
) {
    while let Some(mut conn) = admitted.recv().await {
        let (http, framed) = (http.clone(), framed.clone());
        tokio::spawn(async move {
            match conn.first_byte().await {
                Some(first) if frames::speaks_frames(first) => framed(conn),
                Some(_) => {
                    let _ = http.send(conn).await;
                }
                None => {}
            }
        });
    }
}

/// Takes the connections that open with `frames::PREFACE` instead of HTTP.
pub type FramedDoor = Arc<dyn Fn(Guarded) + Send + Sync>;

/// Serves `routes` on `listener` (and `more` listeners: the handle reports the first
/// one's address) until `shutdown` is set (or the handle dropped), letting connections
/// in through `door`; those that speak frames go to `framed`, when given.
pub fn spawn(
    listener: TcpListener,
    more: Vec<TcpListener>,
    routes: Routes,
    shutdown: watch::Sender<bool>,
    door: Arc<Door>,
    framed: Option<FramedDoor>,
) -> ServerHandle {
    let addr = listener
        .local_addr()
        .expect("a bound listener has an address");
    let mut stop = shutdown.subscribe();
    let server = tonic::transport::Server::builder()
        .accept_http1(true)
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .max_concurrent_streams(Some(MAX_STREAMS_PER_CONNECTION))
        .http2_max_header_list_size(Some(MAX_HEADER_BYTES))
        .add_routes(routes);
    let (http, incoming) = mpsc::channel(64);
    let incoming = ReceiverStream::new(incoming).map(Ok::<_, std::io::Error>);
    let mut tasks = vec![tokio::spawn(door.clone().sweep(shutdown.subscribe()))];
    let admitted = match framed {
        Some(framed) => {
            let (admitted, sorting) = mpsc::channel(64);
            tasks.push(tokio::spawn(sort(sorting, http, framed)));
            admitted
        }
        None => http,
    };
    for listener in std::iter::once(listener).chain(more) {
        tasks.push(tokio::spawn(door::accept(
            listener,
            door.clone(),
            admitted.clone(),
            shutdown.subscribe(),
        )));
    }
    let task = tokio::spawn(async move {
        let stopped = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        if let Err(e) = server.serve_with_incoming_shutdown(incoming, stopped).await {
            tracing::error!(%addr, "server stopped: {e}");
        }
    });
    tasks.insert(0, task);
    ServerHandle {
        addr,
        shutdown,
        tasks,
    }
}
