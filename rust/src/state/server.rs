//! A rank's state server. It serves the state of one committed step straight from the
//! memory that holds it — no copy — to healing ranks that present the job token and
//! name that step and the current quorum (I8). The memory is lent for a *window*:
//! `publish` opens it, `withdraw` closes it and returns only once no send reads it any
//! more, so the training loop may then change the tensors again.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::wire::{
    encode_layout, encode_response, Checksum, Request, RequestHead, RequestKind, ResponseHeader,
    Status, WireError, MAX_CHUNK_LEN, REQUEST_HEADER_LEN,
};
use crate::auth::JobToken;
use crate::door::{self, Door, Guarded};
use crate::gate::{GateLimits, Refusal, Refusals};
use crate::server::advertised_address;
use crate::Error;

/// Bytes per pacing step when a byte rate caps the sends.
const PACED_PIECE: usize = 256 << 10;
/// The most one write of a chunk hands the kernel: what it copied is still in this
/// core's cache when it is checksummed. A write as large as the socket takes (4 MiB
/// on loopback) left most of it in memory again, and its checksum cost 0.7 of the
/// copy itself in a profile of a 1 GiB heal.
const WRITE_PIECE: usize = 256 << 10;
/// After a withdraw's grace, sends still reading the window are cut; they stop at
/// their next write, well within this.
const CUT_GRACE: Duration = Duration::from_secs(1);

/// Memory a server reads from while a window is open.
#[derive(Clone, Copy, Debug)]
pub struct SourceRegion {
    addr: usize,
    len: usize,
}

impl SourceRegion {
    /// # Safety
    /// `len` bytes from `addr` must stay readable and unmodified from `publish` until
    /// `withdraw` (or `shutdown`) of that server has returned, or the server has been
    /// dropped. `addr` may be anything when `len` is 0.
    pub unsafe fn new(addr: usize, len: usize) -> Self {
        SourceRegion { addr, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the contract of `new`; only called while a lease keeps the window open.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
}

#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// "host:port" to listen on; port 0 picks a free one.
    pub bind: String,
    /// The host healing peers use to reach this server; by default the bind host, or
    /// this machine's hostname when bound to all interfaces.
    pub advertise_host: Option<String>,
    pub token: JobToken,
    /// Cap on the bytes per second sent over all connections (None: no cap), so a heal
    /// does not starve the training collectives on a shared link.
    pub max_bytes_per_s: Option<f64>,
    /// Caps on connections (see `gate`).
    pub connections: GateLimits,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            bind: "127.0.0.1:0".into(),
            advertise_host: None,
            token: JobToken::default(),
            max_bytes_per_s: None,
            connections: GateLimits::STATE,
        }
    }
}

/// Test only: flip the byte at `byte % len` of each of the next `chunks` chunks sent.
/// The checksum is computed over the intact bytes, so the receiver must notice.
#[derive(Clone, Copy, Debug)]
pub struct Corruption {
    pub chunks: u64,
    pub byte: u64,
}

/// The memory of one step of one quorum, open for reading.
struct Window {
    step: i64,
    quorum_id: u64,
    manifest: Vec<u8>,
    layout: Vec<u8>,
    regions: Vec<SourceRegion>,
    /// Set when the window's grace is over: sends still in flight stop.
    cut: watch::Sender<bool>,
}

struct Shared {
    token: JobToken,
    refusals: Refusals,
    window: Mutex<Option<Arc<Window>>>,
    /// Woken whenever a send lets go of a window.
    released: Notify,
    pacer: Option<Pacer>,
    /// Test only (see `damage_next_chunks`); idle unless a test arms it.
    corruption: CorruptionHook,
    served_bytes: AtomicU64,
}

impl Shared {
    fn window(&self) -> MutexGuard<'_, Option<Arc<Window>>> {
        self.window.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A hold on the published window, if it is the one asked for; else the refusal.
    fn lease(self: &Arc<Self>, step: i64, quorum_id: u64) -> Result<Lease, Vec<u8>> {
        match &*self.window() {
            Some(w) if w.step == step && w.quorum_id == quorum_id => Ok(Lease {
                window: Some(w.clone()),
                shared: self.clone(),
            }),
            Some(w) => Err(encode_response(
                Status::OtherWindow,
                w.step,
                w.quorum_id,
                b"",
            )),
            None => Err(encode_response(Status::NotPublished, 0, 0, b"")),
        }
    }

    /// Waits until nobody but the caller holds `window`; false if `within` passed.
    async fn wait_unread(&self, window: &Arc<Window>, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            if Arc::strong_count(window) == 1 {
                return true;
            }
            if tokio::time::timeout_at(deadline, released).await.is_err() {
                return Arc::strong_count(window) == 1;
            }
        }
    }
}

/// A send's hold on a window: while one exists, the window's memory may be read.
struct Lease {
    window: Option<Arc<Window>>,
    shared: Arc<Shared>,
}

impl Lease {
    fn window(&self) -> &Window {
        self.window
            .as_ref()
            .expect("a lease holds its window until dropped")
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        drop(self.window.take());
        self.shared.released.notify_waiters();
    }
}

/// Spreads sends over time so that they stay under a byte rate.
struct Pacer {
    bytes_per_s: f64,
    next: Mutex<Instant>,
}

impl Pacer {
    async fn admit(&self, bytes: usize) {
        let cost = Duration::from_secs_f64(bytes as f64 / self.bytes_per_s);
        let at = {
            let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
            let at = (*next).max(Instant::now());
            *next = at + cost;
            at
        };
        tokio::time::sleep_until(at).await;
    }
}

#[derive(Default)]
struct CorruptionHook {
    remaining: AtomicU64,
    byte: AtomicU64,
}

impl CorruptionHook {
    fn arm(&self, corruption: Corruption) {
        self.byte.store(corruption.byte, Ordering::Relaxed);
        self.remaining.store(corruption.chunks, Ordering::Release);
    }

    /// Where to damage the next chunk of `len` bytes, if it is to be damaged.
    fn next(&self, len: u64) -> Option<usize> {
        if len == 0 {
            return None;
        }
        self.remaining
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .ok()
            .map(|_| (self.byte.load(Ordering::Relaxed) % len) as usize)
    }
}

pub struct StateServer {
    address: String,
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    accept: JoinHandle<()>,
}

impl StateServer {
    /// Binds and starts serving; nothing is published yet.
    pub async fn bind(options: ServerOptions) -> Result<Self, Error> {
        if let Some(rate) = options.max_bytes_per_s {
            if !rate.is_finite() || rate <= 0.0 {
                return Err(Error::invalid(format!(
                    "max_bytes_per_s must be a positive number of bytes per second, got {rate}"
                )));
            }
        }
        let (listener, local_addr) = crate::server::bind(&options.bind)
            .await
            .map_err(|e| Error::connection(e.to_string()))?;
        let address = advertised_address(local_addr, options.advertise_host.as_deref());
        let refusals = Refusals::default();
        let shared = Arc::new(Shared {
            token: options.token,
            refusals: refusals.clone(),
            window: Mutex::new(None),
            released: Notify::new(),
            pacer: options.max_bytes_per_s.map(|bytes_per_s| Pacer {
                bytes_per_s,
                next: Mutex::new(Instant::now()),
            }),
            corruption: CorruptionHook::default(),
            served_bytes: AtomicU64::new(0),
        });
        let (shutdown, stop) = watch::channel(false);
        let door = Door::new(options.connections, refusals);
        let accept = tokio::spawn(accept_loop(listener, door, shared.clone(), stop));
        Ok(StateServer {
            address,
            local_addr,
            shared,
            shutdown,
            accept,
        })
    }

    /// "host:port" for healing peers.
    pub fn address(&self) -> &str {
        &self.address
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Requests and connections turned away, by reason.
    pub fn refusals(&self) -> &Refusals {
        &self.shared.refusals
    }

    /// Test only: damages the next chunks sent, as a bad link would (see `Corruption`).
    pub fn damage_next_chunks(&self, corruption: Corruption) {
        self.shared.corruption.arm(corruption);
    }

    /// Chunk bytes sent so far, over all windows.
    pub fn served_bytes(&self) -> u64 {
        self.shared.served_bytes.load(Ordering::Relaxed)
    }

    /// The (step, quorum id) published now, if any.
    pub fn serving(&self) -> Option<(i64, u64)> {
        self.shared.window().as_ref().map(|w| (w.step, w.quorum_id))
    }

    /// Opens a window over `regions` for `step` of quorum `quorum_id`. The manifest
    /// travels as it is; it describes the regions to whoever asks.
    pub fn publish(
        &self,
        step: i64,
        quorum_id: u64,
        manifest: Vec<u8>,
        regions: Vec<SourceRegion>,
    ) -> Result<(), Error> {
        if step < 0 {
            return Err(Error::invalid(format!(
                "step must be 0 or more, got {step}"
            )));
        }
        if u32::try_from(regions.len()).is_err() {
            return Err(Error::invalid(format!(
                "{} regions are more than the wire can name (2^32)",
                regions.len()
            )));
        }
        let mut slot = self.shared.window();
        if let Some(open) = &*slot {
            return Err(Error::invalid(format!(
                "the state of step {} (quorum {}) is still published; withdraw() it before \
                 publishing step {step} (quorum {quorum_id})",
                open.step, open.quorum_id
            )));
        }
        let lens: Vec<u64> = regions.iter().map(|r| r.len as u64).collect();
        *slot = Some(Arc::new(Window {
            step,
            quorum_id,
            manifest,
            layout: encode_layout(&lens),
            regions,
            cut: watch::channel(false).0,
        }));
        Ok(())
    }

    /// Closes the window: new requests are refused at once; sends in flight get
    /// `grace` to finish and are cut after it. Returns how many sends were cut. When
    /// it returns Ok, nothing reads the published memory any more.
    pub async fn withdraw(&self, grace: Duration) -> Result<usize, Error> {
        let Some(window) = self.shared.window().take() else {
            return Ok(0);
        };
        if self.shared.wait_unread(&window, grace).await {
            return Ok(0);
        }
        let cut = Arc::strong_count(&window).saturating_sub(1);
        let _ = window.cut.send(true);
        if self.shared.wait_unread(&window, CUT_GRACE).await {
            return Ok(cut);
        }
        Err(Error::timeout(format!(
            "sends of step {} did not stop within {CUT_GRACE:?} of being cut; the runtime is \
             starved — do not change or free the published tensors yet, call withdraw again",
            window.step
        )))
    }

    /// Stops accepting, cuts every send and closes the window.
    pub async fn shutdown(&self) -> Result<(), Error> {
        let _ = self.shutdown.send(true);
        self.withdraw(Duration::ZERO).await.map(|_| ())
    }
}

impl Drop for StateServer {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
        self.accept.abort();
        if let Some(window) = self.shared.window().take() {
            let _ = window.cut.send(true);
            // The owner may free the memory right after this: wait (bounded) until
            // the cut sends have let go of it. They stop at their next poll.
            let deadline = std::time::Instant::now() + CUT_GRACE;
            while Arc::strong_count(&window) > 1 && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

/// Serves every connection the door lets in, until `stop`.
async fn accept_loop(
    listener: TcpListener,
    door: Arc<Door>,
    shared: Arc<Shared>,
    stop: watch::Receiver<bool>,
) {
    let (admitted, mut connections) = mpsc::channel(64);
    let accept = door::accept(listener, door.clone(), admitted, stop.clone());
    let sweep = door.sweep(stop.clone());
    let serve = async {
        while let Some(connection) = connections.recv().await {
            tokio::spawn(serve_connection(connection, shared.clone(), stop.clone()));
        }
    };
    tokio::join!(accept, sweep, serve);
}

enum ReadError {
    /// The peer closed or the socket broke: nothing to answer.
    Gone,
    Wire(WireError),
}

async fn read_request(stream: &mut Guarded) -> Result<Request, ReadError> {
    let mut header = [0u8; REQUEST_HEADER_LEN];
    stream
        .read_exact(&mut header)
        .await
        .map_err(|_| ReadError::Gone)?;
    let head = RequestHead::decode(&header).map_err(ReadError::Wire)?;
    let mut token = vec![0u8; head.token_len()];
    stream
        .read_exact(&mut token)
        .await
        .map_err(|_| ReadError::Gone)?;
    head.finish(&token).map_err(ReadError::Wire)
}

async fn serve_connection(
    mut stream: Guarded,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let request = tokio::select! {
            request = read_request(&mut stream) => request,
            _ = stop.wait_for(|s| *s) => return,
        };
        let request = match request {
            Ok(request) => request,
            Err(ReadError::Wire(e)) => {
                let message = format!("bad request: {e}");
                let _ = stream
                    .write_all(&encode_response(
                        Status::BadRequest,
                        0,
                        0,
                        message.as_bytes(),
                    ))
                    .await;
                return;
            }
            Err(ReadError::Gone) => return,
        };
        match answer(&mut stream, &shared, request).await {
            Ok(true) => {}
            Ok(false) | Err(_) => return,
        }
    }
}

/// Answers one request; Ok(false) when the connection must be closed after it.
async fn answer(stream: &mut Guarded, shared: &Arc<Shared>, request: Request) -> io::Result<bool> {
    let presented = std::str::from_utf8(&request.token)
        .ok()
        .filter(|t| !t.is_empty());
    if shared.token.admits(presented) {
        stream.ticket().prove();
    } else {
        shared.refusals.count(Refusal::Token);
        let message = "missing or wrong job token: start every rank of the job with the same \
                       token (PHALANX_TOKEN)";
        stream
            .write_all(&encode_response(
                Status::Unauthorized,
                0,
                0,
                message.as_bytes(),
            ))
            .await?;
        return Ok(false);
    }
    let lease = match shared.lease(request.step, request.quorum_id) {
        Ok(lease) => lease,
        Err(refusal) => {
            stream.write_all(&refusal).await?;
            return Ok(true);
        }
    };
    let window = lease.window();
    let small = match request.kind {
        RequestKind::Layout => &window.layout,
        RequestKind::Manifest => &window.manifest,
        RequestKind::Chunk => {
            return match chunk_of(window, &request) {
                Ok(bytes) => send_chunk(stream, shared, window, bytes)
                    .await
                    .map(|()| true),
                Err(message) => {
                    stream
                        .write_all(&encode_response(
                            Status::BadRequest,
                            0,
                            0,
                            message.as_bytes(),
                        ))
                        .await?;
                    Ok(false)
                }
            };
        }
    };
    // Layout and manifest belong to the window, not to the lent memory: copy them out
    // and let go of the window, so a slow reader never holds up a withdraw.
    let frame = encode_response(Status::Ok, window.step, window.quorum_id, small);
    drop(lease);
    stream.write_all(&frame).await?;
    Ok(true)
}

/// The bytes a chunk request names, if they lie inside a published region.
fn chunk_of<'w>(window: &'w Window, request: &Request) -> Result<&'w [u8], String> {
    let region = window.regions.get(request.region as usize).ok_or_else(|| {
        format!(
            "region {} does not exist; {} are published",
            request.region,
            window.regions.len()
        )
    })?;
    if request.len > MAX_CHUNK_LEN {
        return Err(format!(
            "a chunk of {} bytes is larger than the limit of {MAX_CHUNK_LEN}",
            request.len
        ));
    }
    let end = request.offset.checked_add(request.len);
    match end {
        Some(end) if end <= region.len as u64 => {
            Ok(&region.bytes()[request.offset as usize..end as usize])
        }
        _ => Err(format!(
            "bytes {}..+{} lie outside region {} ({} bytes)",
            request.offset, request.len, request.region, region.len
        )),
    }
}

/// Writes `bytes`, each write at most `WRITE_PIECE`, and checksums each part right
/// after it went out: the kernel's copy has just pulled it into cache, so the checksum
/// pass costs a fraction of a trip to memory. The window's bytes do not change while
/// it is open, so the checksum covers what was sent.
async fn write_checksummed(
    stream: &mut Guarded,
    bytes: &[u8],
    crc: &mut Checksum,
) -> io::Result<()> {
    let mut sent = 0;
    while sent < bytes.len() {
        let end = bytes.len().min(sent + WRITE_PIECE);
        let n = stream.write(&bytes[sent..end]).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        crc.update(&bytes[sent..sent + n]);
        sent += n;
    }
    Ok(())
}

/// Streams one chunk: header, the bytes straight from the window, their checksum.
/// Stops at the next write once the window is cut.
async fn send_chunk(
    stream: &mut Guarded,
    shared: &Shared,
    window: &Window,
    bytes: &[u8],
) -> io::Result<()> {
    let mut cut = window.cut.subscribe();
    let send = async {
        let header = ResponseHeader {
            status: Status::Ok,
            payload_len: bytes.len() as u64,
            step: window.step,
            quorum_id: window.quorum_id,
        };
        stream.write_all(&header.encode()).await?;
        let mut crc = Checksum::new();
        if let Some(at) = shared.corruption.next(bytes.len() as u64) {
            let mut damaged = bytes.to_vec();
            damaged[at] ^= 0xFF;
            stream.write_all(&damaged).await?;
            crc.update(bytes);
        } else if let Some(pacer) = &shared.pacer {
            for piece in bytes.chunks(PACED_PIECE) {
                pacer.admit(piece.len()).await;
                write_checksummed(stream, piece, &mut crc).await?;
            }
        } else {
            write_checksummed(stream, bytes, &mut crc).await?;
        }
        stream.write_all(&crc.finish().to_le_bytes()).await?;
        shared
            .served_bytes
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(())
    };
    // Biased: once cut, not one more byte is read from the window.
    tokio::select! {
        biased;
        _ = cut.wait_for(|c| *c) => Err(io::Error::other("the window was withdrawn mid-send")),
        sent = send => sent,
    }
}
