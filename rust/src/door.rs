//! The I/O around a `Gate`: accepts connections, hands each one out as a `Guarded`
//! stream that closes itself when the gate says so, and sweeps the gate's deadlines.
//!
//! A `Guarded` stream is what tonic (or the state server) reads and writes; its
//! `Ticket` rides along as the connection info of every request, so the token check
//! can prove the connection (`Ticket::prove`).

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Notify};
use tokio::time::Instant;

use crate::gate::{Admission, ConnectionId, Expiry, Gate, GateLimits, Refusal, Refusals};

/// A guarded stream reports activity to the gate at most this often.
const TOUCH_EVERY: Duration = Duration::from_secs(1);

struct Inside {
    gate: Gate,
    /// Set to true to close the connection.
    closers: HashMap<ConnectionId, watch::Sender<bool>>,
    /// When the sweeper wakes next (None: not before something changes).
    sweep_at: Option<std::time::Instant>,
}

/// The gate of one listener with its I/O.
pub struct Door {
    inside: Mutex<Inside>,
    /// Wakes the sweeper when a connection must be closed before it would wake.
    changed: Notify,
    refusals: Refusals,
}

impl Door {
    pub fn new(limits: GateLimits, refusals: Refusals) -> Arc<Self> {
        Arc::new(Door {
            inside: Mutex::new(Inside {
                gate: Gate::new(limits),
                closers: HashMap::new(),
                sweep_at: None,
            }),
            changed: Notify::new(),
            refusals,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inside> {
        self.inside.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lets `stream` in, or drops it when every slot holds a proven connection.
    pub fn enter(self: &Arc<Self>, stream: TcpStream, peer: SocketAddr) -> Option<Guarded> {
        let now = Instant::now();
        let (closed_tx, mut closed) = watch::channel(false);
        let id = {
            let mut inside = self.lock();
            match inside.gate.admit(peer.ip(), now.into_std()) {
                Admission::Full => {
                    drop(inside);
                    self.refusals.count(Refusal::Full);
                    return None;
                }
                Admission::Admitted { id, crowded_out } => {
                    if let Some(out) = crowded_out {
                        close(&mut inside, out);
                        self.refusals.count(Refusal::Crowded);
                    }
                    inside.closers.insert(id, closed_tx);
                    let deadline = now.into_std() + inside.gate.limits().prove_within;
                    if inside.sweep_at.is_none_or(|at| deadline < at) {
                        inside.sweep_at = Some(deadline);
                        self.changed.notify_one();
                    }
                    id
                }
            }
        };
        Some(Guarded {
            stream,
            ticket: Ticket {
                id,
                peer,
                door: self.clone(),
            },
            closed: Box::pin(async move {
                let _ = closed.wait_for(|c| *c).await;
            }),
            touched: now,
        })
    }

    fn prove(&self, id: ConnectionId) {
        self.lock().gate.prove(id);
    }

    fn touch(&self, id: ConnectionId, now: Instant) {
        self.lock().gate.touch(id, now.into_std());
    }

    fn leave(&self, id: ConnectionId) {
        let mut inside = self.lock();
        inside.gate.leave(id);
        inside.closers.remove(&id);
    }

    /// Closes what the gate expires, sleeping until its next deadline in between.
    pub async fn sweep(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let next = {
                let mut inside = self.lock();
                for (id, why) in inside.gate.expire(Instant::now().into_std()) {
                    close(&mut inside, id);
                    if why == Expiry::Unproven {
                        self.refusals.count(Refusal::Unproven);
                    }
                }
                inside.sweep_at = inside.gate.next_expiry();
                inside.sweep_at
            };
            tokio::select! {
                _ = async {
                    match next {
                        Some(at) => tokio::time::sleep_until(at.into()).await,
                        None => std::future::pending().await,
                    }
                } => {}
                _ = &mut changed => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    }
}

fn close(inside: &mut Inside, id: ConnectionId) {
    inside.gate.leave(id);
    if let Some(closer) = inside.closers.remove(&id) {
        let _ = closer.send(true);
    }
}

/// One connection's pass: it rides with every request on the connection.
#[derive(Clone)]
pub struct Ticket {
    id: ConnectionId,
    peer: SocketAddr,
    door: Arc<Door>,
}

impl Ticket {
    /// A request on this connection carried the job token.
    pub fn prove(&self) {
        self.door.prove(self.id);
    }

    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    pub fn refusals(&self) -> &Refusals {
        &self.door.refusals
    }
}

/// A connection let in by a `Door`: reads and writes fail once the door closes it.
pub struct Guarded {
    stream: TcpStream,
    ticket: Ticket,
    closed: Pin<Box<dyn Future<Output = ()> + Send + Sync>>,
    /// When activity was last reported to the gate.
    touched: Instant,
}

impl Guarded {
    pub fn ticket(&self) -> &Ticket {
        &self.ticket
    }

    /// The connection's first byte, left to be read; None if it closes before one
    /// comes (the door closes a connection that stays silent while unproven).
    pub async fn first_byte(&mut self) -> Option<u8> {
        let mut byte = [0u8; 1];
        tokio::select! {
            peeked = self.stream.peek(&mut byte) => matches!(peeked, Ok(1)).then_some(byte[0]),
            _ = &mut self.closed => None,
        }
    }

    /// Err once the door has closed the connection; else notes the activity.
    fn check(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if self.closed.as_mut().poll(cx).is_ready() {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed by the listener's connection limits",
            ));
        }
        Ok(())
    }

    fn wrote(&mut self, written: &Poll<io::Result<usize>>) {
        if matches!(written, Poll::Ready(Ok(n)) if *n > 0) {
            self.active();
        }
    }

    fn active(&mut self) {
        let now = Instant::now();
        if now >= self.touched + TOUCH_EVERY {
            self.touched = now;
            self.ticket.door.touch(self.ticket.id, now);
        }
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        self.ticket.door.leave(self.ticket.id);
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.check(cx)?;
        let before = buf.filled().len();
        let read = Pin::new(&mut self.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.active();
        }
        read
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.check(cx)?;
        let written = Pin::new(&mut self.stream).poll_write(cx, data);
        self.wrote(&written);
        written
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.check(cx)?;
        let written = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.wrote(&written);
        written
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Guarded {
    type ConnectInfo = Ticket;

    fn connect_info(&self) -> Ticket {
        self.ticket.clone()
    }
}

/// Accepts on `listener` until `stop`, passing every connection the door lets in to
/// `admitted`. Out of file descriptors, it backs off instead of spinning.
pub async fn accept(
    listener: TcpListener,
    door: Arc<Door>,
    admitted: mpsc::Sender<Guarded>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|s| *s) => return,
        };
        match accepted {
            Ok((stream, peer)) => {
                // Without it small messages (a pushed loss, a chunk's trailer) wait
                // ~40 ms for a delayed ACK.
                let _ = stream.set_nodelay(true);
                if let Some(guarded) = door.enter(stream, peer) {
                    if admitted.send(guarded).await.is_err() {
                        return;
                    }
                }
            }
            Err(e) => {
                tracing::warn!("cannot accept a connection: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}
