//! The lighthouse's side of beats as UDP datagrams (`crate::datagram`): the channels
//! it offers its framed streams, and a thread that reads datagrams in batches
//! (`recvmmsg`), gives each to its stream's `BeatSink`, as the stream's own task
//! would, and sends the leases that renews back to where each beat came from, a batch
//! in one `sendmmsg`. Nothing else is done on this thread; a new quorum's lease goes
//! out on the stream.

use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio::sync::watch;

use super::beats::BeatSink;
use super::metrics::SiteMetrics;
use crate::datagram::{self, DatagramLease, Dropped, Key, Sealer, Sequence, LEASE_LEN};
use crate::{proto, sockopt};

/// Datagrams read by one `recvmmsg` at most: more than `GATHER` of 10,000 groups'
/// beats at 10 Hz.
const BATCH: usize = 256;

/// How long the thread lets datagrams gather after a read that did not fill a batch.
/// Read as they come, 30,000 beats a second cost a wakeup each (3,000 groups: 7.9 µs
/// of lighthouse CPU per beat, of which the wakeups took the most); a millisecond's
/// wait makes it at most a thousand wakeups a second, and delays a beat by that much
/// against timeouts of a second or more.
const GATHER: Duration = Duration::from_millis(1);

/// Room for one datagram: more than a beat's, so that a longer one shows its length.
const SLOT: usize = 2 * datagram::LEN;

/// How long a read waits before the thread looks whether the lighthouse stopped.
const LOOK_EVERY: Duration = Duration::from_millis(100);

/// The kernel's queue of datagrams not read yet: 10,000 groups' beats that arrive
/// together while the thread is busy must not overflow it.
const RECEIVE_BUFFER: usize = 8 << 20;

/// The channels of the open framed streams, by id.
pub(crate) struct Channels {
    open: Mutex<HashMap<u64, Arc<Open>>>,
    next: AtomicU64,
    taken: Counter,
    leases: Counter,
    /// `datagrams_dropped`, one counter per `Dropped` (in `Dropped::ALL`'s order), found
    /// once: a flood of stray datagrams costs no lookup each.
    dropped: [Counter; Dropped::ALL.len()],
}

/// An open stream's channel: its key, the sequence numbers it took, and what takes its
/// beats.
struct Open {
    sealer: Sealer,
    sequence: Mutex<Sequence>,
    sink: Arc<BeatSink>,
}

/// A stream's hold on its channel: the channel closes when the stream ends, and its
/// datagrams are unknown from then on.
pub(crate) struct Channel {
    channels: Arc<Channels>,
    id: u64,
}

impl Drop for Channel {
    fn drop(&mut self) {
        self.channels.lock().remove(&self.id);
    }
}

impl Channels {
    pub(crate) fn new(metrics: &SiteMetrics) -> Arc<Self> {
        Arc::new(Channels {
            open: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            taken: metrics.datagram_beats.clone(),
            leases: metrics.datagram_leases.clone(),
            dropped: Dropped::ALL.map(|why| {
                metrics
                    .datagrams_dropped
                    .get_or_create(&vec![("reason", why.as_str())])
                    .clone()
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Arc<Open>>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Opens a channel for the stream whose beats `sink` takes: the offer goes to the
    /// group with the stream's first lease.
    pub(crate) fn open(self: &Arc<Self>, sink: Arc<BeatSink>) -> (Channel, proto::DatagramOffer) {
        let id = self.next.fetch_add(1, Relaxed);
        let key = random_key();
        let open = Open {
            sealer: Sealer::new(&key),
            sequence: Mutex::new(Sequence::default()),
            sink,
        };
        self.lock().insert(id, Arc::new(open));
        let offer = proto::DatagramOffer {
            channel: id,
            key: key.to_vec(),
        };
        let channel = Channel {
            channels: self.clone(),
            id,
        };
        (channel, offer)
    }

    /// Takes one datagram, or counts why not; returns the lease that renews it, if one
    /// is due, sealed.
    fn receive(&self, bytes: &[u8]) -> Option<[u8; LEASE_LEN]> {
        match self.take(bytes) {
            Ok(lease) => {
                self.taken.inc();
                lease
            }
            Err(why) => {
                self.dropped[why as usize].inc();
                None
            }
        }
    }

    fn take(&self, bytes: &[u8]) -> Result<Option<[u8; LEASE_LEN]>, Dropped> {
        let id = datagram::channel_of(bytes)?;
        let open = self.lock().get(&id).cloned().ok_or(Dropped::Unknown)?;
        let beat = open.sealer.open(bytes)?;
        let grows = open
            .sequence
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take(beat.seq);
        if !grows {
            return Err(Dropped::Replayed);
        }
        // A beat the stream refuses (the group was evicted, its stream is ending) ends
        // nothing here: the stream's task ends it.
        let lease = open.sink.take(&beat.to_beat(), true).ok().flatten();
        Ok(lease
            .and_then(|lease| DatagramLease::of(id, &lease))
            .map(|lease| open.sealer.seal_lease(&lease)))
    }
}

/// 16 bytes from the kernel's random source.
fn random_key() -> Key {
    let mut key = Key::default();
    let mut filled = 0;
    while filled < key.len() {
        // SAFETY: the pointer and length name the unfilled rest of `key`, which
        // outlives the call.
        let n =
            unsafe { libc::getrandom(key[filled..].as_mut_ptr().cast(), key.len() - filled, 0) };
        if n > 0 {
            filled += n as usize;
        } else {
            let e = io::Error::last_os_error();
            assert!(
                e.kind() == io::ErrorKind::Interrupted,
                "the kernel's random source failed: {e}"
            );
        }
    }
    key
}

/// A UDP socket on the lighthouse's own address and port number, its reads bounded
/// by `LOOK_EVERY` and its queue large.
pub(crate) fn bind(at: SocketAddr) -> io::Result<UdpSocket> {
    let socket = UdpSocket::bind(at)?;
    socket.set_read_timeout(Some(LOOK_EVERY))?;
    enlarge_queue(&socket, RECEIVE_BUFFER);
    Ok(socket)
}

/// Asks for a queue of `size` bytes of datagrams not read yet on `socket`: beyond
/// net.core.rmem_max where the process may (root), else up to it.
pub(crate) fn enlarge_queue(socket: &UdpSocket, size: usize) {
    for option in [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF] {
        if sockopt::set_int(socket.as_raw_fd(), libc::SOL_SOCKET, option, size).is_ok() {
            break;
        }
    }
}

/// Reads `socket` on a thread of its own until `shutdown` says the lighthouse stops
/// (or its sender is gone), giving each datagram to `channels`.
pub(crate) fn spawn_reader(
    socket: UdpSocket,
    channels: Arc<Channels>,
    shutdown: watch::Receiver<bool>,
) -> io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("lighthouse-datagrams".into())
        .spawn(move || read(&socket, &channels, &shutdown))
}

fn read(socket: &UdpSocket, channels: &Channels, shutdown: &watch::Receiver<bool>) {
    let mut slots = vec![[0u8; SLOT]; BATCH];
    // SAFETY: sockaddr_storage is plain data; all zeros is an empty address.
    let mut senders: Vec<libc::sockaddr_storage> = vec![unsafe { std::mem::zeroed() }; BATCH];
    let mut iovecs: Vec<libc::iovec> = slots
        .iter_mut()
        .map(|slot| libc::iovec {
            iov_base: slot.as_mut_ptr().cast(),
            iov_len: SLOT,
        })
        .collect();
    let mut messages: Vec<libc::mmsghdr> = iovecs
        .iter_mut()
        .zip(senders.iter_mut())
        .map(|(iovec, sender)| header(iovec, sender, 0))
        .collect();
    let mut replies = Replies::default();
    let fd = socket.as_raw_fd();
    while shutdown.has_changed().is_ok() && !*shutdown.borrow() {
        for m in &mut messages {
            m.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as _;
        }
        // SAFETY: every header points at one iovec of `iovecs`, each at a slot of
        // `slots`, SLOT bytes long, and at one address of `senders`, its size given;
        // all live across the call and nothing else touches them meanwhile.
        // MSG_WAITFORONE: wait for the first datagram only, then take what else is
        // queued.
        let n = unsafe {
            libc::recvmmsg(
                fd,
                messages.as_mut_ptr(),
                BATCH as libc::c_uint,
                libc::MSG_WAITFORONE,
                std::ptr::null_mut(),
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock
                | io::ErrorKind::TimedOut
                | io::ErrorKind::Interrupted => {}
                _ => {
                    tracing::warn!("reading heartbeat datagrams failed: {e}");
                    std::thread::sleep(LOOK_EVERY);
                }
            }
            continue;
        }
        for ((message, slot), sender) in messages.iter().zip(&slots).zip(&senders).take(n as usize)
        {
            // A datagram longer than a slot was cut to it: its length is then no
            // beat's either.
            let len = (message.msg_len as usize).min(SLOT);
            if let Some(lease) = channels.receive(&slot[..len]) {
                replies.add(lease, *sender, message.msg_hdr.msg_namelen);
            }
        }
        let sent = replies.send(fd);
        channels.leases.inc_by(sent as u64);
        if (n as usize) < BATCH {
            std::thread::sleep(GATHER);
        }
    }
}

/// The header of one datagram of a `recvmmsg` or `sendmmsg`: its one buffer, and the
/// address it came from or goes to (`len` bytes of it; a read sets its own).
fn header(
    iovec: &mut libc::iovec,
    address: &mut libc::sockaddr_storage,
    len: libc::socklen_t,
) -> libc::mmsghdr {
    // SAFETY: mmsghdr is plain data; all zeros is an empty header.
    let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
    m.msg_hdr.msg_iov = iovec;
    m.msg_hdr.msg_iovlen = 1;
    m.msg_hdr.msg_name = (address as *mut libc::sockaddr_storage).cast();
    m.msg_hdr.msg_namelen = len;
    m
}

/// Leases to send back, each to the address its beat came from.
#[derive(Default)]
struct Replies {
    leases: Vec<[u8; LEASE_LEN]>,
    to: Vec<(libc::sockaddr_storage, libc::socklen_t)>,
}

impl Replies {
    fn add(&mut self, lease: [u8; LEASE_LEN], to: libc::sockaddr_storage, len: libc::socklen_t) {
        self.leases.push(lease);
        self.to.push((to, len));
    }

    /// Sends them all in as few `sendmmsg` as the socket takes, and forgets them;
    /// returns how many went. One the socket does not take now is not retried: the
    /// next beat renews it (and a group that hears no lease falls back to its stream).
    fn send(&mut self, fd: libc::c_int) -> usize {
        let mut iovecs: Vec<libc::iovec> = self
            .leases
            .iter_mut()
            .map(|lease| libc::iovec {
                iov_base: lease.as_mut_ptr().cast(),
                iov_len: LEASE_LEN,
            })
            .collect();
        let mut messages: Vec<libc::mmsghdr> = iovecs
            .iter_mut()
            .zip(self.to.iter_mut())
            .map(|(iovec, (to, len))| header(iovec, to, *len))
            .collect();
        let mut sent = 0;
        while sent < messages.len() {
            // SAFETY: the headers from `sent` on point at iovecs and addresses that
            // live across the call, their lengths given. MSG_DONTWAIT: a full buffer
            // never holds the thread that reads the beats.
            let n = unsafe {
                libc::sendmmsg(
                    fd,
                    messages[sent..].as_mut_ptr(),
                    (messages.len() - sent) as libc::c_uint,
                    libc::MSG_DONTWAIT,
                )
            };
            if n <= 0 {
                break;
            }
            sent += n as usize;
        }
        drop(messages);
        self.leases.clear();
        self.to.clear();
        sent
    }
}
