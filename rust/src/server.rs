//! Starting and stopping a tonic server, shared by the lighthouse and the manager.

use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::{Stream, StreamExt};
use tonic::service::Routes;
use tonic::transport::server::TcpIncoming;

use crate::Error;

/// How long a stopping server waits for open calls before dropping them.
const GRACE: Duration = Duration::from_secs(1);

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

type Incoming = Pin<Box<dyn Stream<Item = Result<TcpStream, std::io::Error>> + Send>>;

/// Serves `routes` on `listener` until `shutdown` is set (or the handle dropped).
pub fn spawn(listener: TcpListener, routes: Routes, shutdown: watch::Sender<bool>) -> ServerHandle {
    spawn_on(listener, Vec::new(), routes, shutdown)
}

/// Like `spawn`, on `more` listeners too; the handle reports the first one's address.
pub fn spawn_on(
    listener: TcpListener,
    more: Vec<TcpListener>,
    routes: Routes,
    shutdown: watch::Sender<bool>,
) -> ServerHandle {
    let addr = listener
        .local_addr()
        .expect("a bound listener has an address");
    let mut stop = shutdown.subscribe();
    let server = tonic::transport::Server::builder()
        .accept_http1(true)
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .add_routes(routes);
    // The builder's `tcp_nodelay` does not reach a listener we bound ourselves; without
    // it, small pushes (membership-loss events) wait ~40 ms for a delayed ACK.
    let incoming = std::iter::once(listener).chain(more).fold(
        Box::pin(tokio_stream::empty()) as Incoming,
        |all, listener| Box::pin(all.merge(TcpIncoming::from(listener).with_nodelay(Some(true)))),
    );
    let task = tokio::spawn(async move {
        let stopped = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        if let Err(e) = server.serve_with_incoming_shutdown(incoming, stopped).await {
            tracing::error!(%addr, "server stopped: {e}");
        }
    });
    ServerHandle {
        addr,
        shutdown,
        tasks: vec![task],
    }
}
