//! The group's side of beats as datagrams (`crate::datagram`): where a stream's beats
//! go once the lighthouse offered a channel, whether they still may (`Fallback`), and
//! the process's one UDP socket of each address family, which sends every stream's
//! beats and, on a thread of its own, reads the leases that come back and hands each
//! to its stream's events (`wire::BeatEvents`).
//!
//! One socket for all: a socket per stream would double a group's file descriptors
//! (a load generator of 10,000 groups in one process ran out of 20,000). A lease
//! finds its stream by the channel it names and the key that sealed it.

use std::collections::HashMap;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::datagrams::enlarge_queue;
use crate::datagram::{self, DatagramBeat, Fallback, Key, Sealer, Sequence, LEASE_LEN};
use crate::proto;

/// The socket's queue of leases not read yet: a lighthouse sends a batch's leases at
/// once, and a process may hold thousands of groups (a load generator).
const RECEIVE_BUFFER: usize = 4 << 20;

/// Where a stream's beats go as datagrams, and whether they still do; while it lives,
/// leases that come back for its channel go to its stream's events.
pub(super) struct DatagramPath {
    socket: Arc<BeatSocket>,
    lighthouse: SocketAddr,
    channel: u64,
    sealer: Sealer,
    fallback: Mutex<Fallback>,
    /// This path's place among the socket's inboxes.
    inbox: u64,
}

impl DatagramPath {
    /// Leases waiting for a stream's events to read them; more are dropped (a stream
    /// that does not read holds no lease, as on the stream).
    pub(super) const WAITING: usize = 16;

    /// The path `offer` opens to the lighthouse at `lighthouse`, its leases sent to
    /// `leases`; None if the offer is malformed or no UDP socket can be had (the beats
    /// stay on the stream).
    pub(super) fn offered(
        offer: &proto::DatagramOffer,
        lease: Duration,
        lighthouse: SocketAddr,
        leases: mpsc::Sender<proto::Lease>,
    ) -> Option<Self> {
        let key: Key = offer.key[..].try_into().ok()?;
        let sealer = Sealer::new(&key);
        let socket = BeatSocket::of_this_process(lighthouse.is_ipv6())?;
        let inbox = socket.register(offer.channel, sealer.clone(), leases);
        Some(DatagramPath {
            socket,
            lighthouse,
            channel: offer.channel,
            sealer,
            fallback: Mutex::new(Fallback::new(Instant::now(), lease)),
            inbox,
        })
    }

    /// A lease of beat `seq` came, on the stream or as a datagram.
    pub(super) fn leased(&self, seq: u64) {
        self.fallback().leased(Instant::now(), seq);
    }

    fn fallback(&self) -> MutexGuard<'_, Fallback> {
        self.fallback.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends `beat` as a datagram if it may go as one; false: it goes on the stream.
    pub(super) fn send(&self, beat: &proto::Beat) -> bool {
        let Some(datagram) = DatagramBeat::of(self.channel, beat) else {
            return false;
        };
        let mut fallback = self.fallback();
        let was_given_up = fallback.given_up();
        if !fallback.by_datagram(Instant::now(), datagram.seq) {
            if !was_given_up {
                tracing::warn!(
                    "no lease came for the heartbeat datagrams sent to {} for {:.1} s: \
                     beating on the stream instead, and trying a datagram every {} beats \
                     (does a firewall drop UDP to or from the lighthouse's port?)",
                    self.lighthouse,
                    fallback.silence().as_secs_f64(),
                    Fallback::PROBE_EVERY
                );
            }
            return false;
        }
        drop(fallback);
        // A full socket buffer or an unreachable port: this beat goes on the stream,
        // and lost ones count towards falling back.
        self.socket
            .socket
            .send_to(&self.sealer.seal(&datagram), self.lighthouse)
            .is_ok()
    }
}

impl Drop for DatagramPath {
    fn drop(&mut self) {
        self.socket.unregister(self.channel, self.inbox);
    }
}

/// Where the leases of one stream's channel go.
struct Inbox {
    id: u64,
    sealer: Sealer,
    /// The beats its leases acknowledged so far: a lease must acknowledge a later beat
    /// than every one taken before, so a copy replayed later cannot pass for a lease
    /// that came (and hold off the fallback to the stream while no lease comes).
    acknowledged: Sequence,
    leases: mpsc::Sender<proto::Lease>,
}

impl Inbox {
    fn new(id: u64, sealer: Sealer, leases: mpsc::Sender<proto::Lease>) -> Self {
        Inbox {
            id,
            sealer,
            acknowledged: Sequence::default(),
            leases,
        }
    }

    /// The lease in `bytes` if this stream's key sealed it and it acknowledges a later
    /// beat than any lease taken before.
    fn take(&mut self, bytes: &[u8]) -> Option<proto::Lease> {
        let lease = self.sealer.open_lease(bytes).ok()?;
        self.acknowledged.take(lease.seq).then(|| lease.to_lease())
    }
}

/// The process's UDP socket of one address family, and the streams whose leases it
/// reads, by channel (channels of different lighthouses may share a number: the key
/// tells them apart).
struct BeatSocket {
    socket: UdpSocket,
    inboxes: Mutex<HashMap<u64, Vec<Inbox>>>,
    next: AtomicU64,
}

impl BeatSocket {
    /// This process's socket of the family: a process forked from one that had a
    /// socket makes its own (the parent's thread would read its leases).
    fn of_this_process(v6: bool) -> Option<Arc<BeatSocket>> {
        /// Each family's socket, and the process that opened it.
        type Opened = Option<(u32, Arc<BeatSocket>)>;
        static SOCKETS: Mutex<[Opened; 2]> = Mutex::new([None, None]);
        let pid = std::process::id();
        let mut sockets = SOCKETS.lock().unwrap_or_else(|e| e.into_inner());
        let slot = &mut sockets[usize::from(v6)];
        if slot.as_ref().is_none_or(|(of, _)| *of != pid) {
            *slot = BeatSocket::open(v6).map(|socket| (pid, socket));
        }
        slot.as_ref().map(|(_, socket)| socket.clone())
    }

    /// A socket on any address of the family, and its reading thread.
    fn open(v6: bool) -> Option<Arc<BeatSocket>> {
        let any: SocketAddr = if v6 {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        } else {
            ([0, 0, 0, 0], 0).into()
        };
        let socket = UdpSocket::bind(any).ok()?;
        socket.set_nonblocking(true).ok()?;
        enlarge_queue(&socket, RECEIVE_BUFFER);
        let opened = Arc::new(BeatSocket {
            socket,
            inboxes: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
        });
        let reading = opened.clone();
        std::thread::Builder::new()
            .name("phalanx-leases".into())
            .spawn(move || reading.read())
            .ok()?;
        Some(opened)
    }

    fn inboxes(&self) -> MutexGuard<'_, HashMap<u64, Vec<Inbox>>> {
        self.inboxes.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn register(&self, channel: u64, sealer: Sealer, leases: mpsc::Sender<proto::Lease>) -> u64 {
        let id = self.next.fetch_add(1, Relaxed);
        let inbox = Inbox::new(id, sealer, leases);
        self.inboxes().entry(channel).or_default().push(inbox);
        id
    }

    fn unregister(&self, channel: u64, id: u64) {
        let mut inboxes = self.inboxes();
        if let Some(those) = inboxes.get_mut(&channel) {
            those.retain(|inbox| inbox.id != id);
            if those.is_empty() {
                inboxes.remove(&channel);
            }
        }
    }

    /// Reads leases for as long as the process lives (the socket is never closed):
    /// waits for one, then takes every one queued.
    fn read(&self) {
        let fd = self.socket.as_raw_fd();
        let mut buf = [0u8; 2 * LEASE_LEN];
        loop {
            let mut ready = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one pollfd that lives across the call; -1: wait as long as it
            // takes.
            unsafe { libc::poll(&mut ready, 1, -1) };
            while let Ok(n) = self.socket.recv(&mut buf) {
                self.deliver(&buf[..n]);
            }
        }
    }

    /// Hands a lease to the stream whose key sealed it (see `Inbox::take`); anything
    /// else is dropped.
    fn deliver(&self, bytes: &[u8]) {
        let Ok(channel) = datagram::lease_channel_of(bytes) else {
            return;
        };
        let mut inboxes = self.inboxes();
        let Some(those) = inboxes.get_mut(&channel) else {
            return;
        };
        if let Some((inbox, lease)) = those
            .iter_mut()
            .find_map(|inbox| inbox.take(bytes).map(|lease| (&*inbox, lease)))
        {
            let _ = inbox.leases.try_send(lease);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datagram::DatagramLease;

    #[test]
    fn a_stream_takes_a_lease_of_its_key_once_and_only_for_a_later_beat() {
        let key: Key = *b"0123456789abcdef";
        let (tx, _rx) = mpsc::channel(1);
        let mut inbox = Inbox::new(1, Sealer::new(&key), tx);
        let sealed = |key: &Key, seq: u64| {
            let lease = DatagramLease {
                channel: 7,
                seq,
                quorum_id: 3,
                lease_ms: 2000,
            };
            Sealer::new(key).seal_lease(&lease)
        };
        let first = sealed(&key, 5);
        assert_eq!(
            inbox.take(&first).map(|l| (l.seq, l.quorum_id)),
            Some((5, 3))
        );
        assert_eq!(inbox.take(&first), None, "a copy");
        assert_eq!(inbox.take(&sealed(&key, 4)), None, "an older beat's");
        assert_eq!(
            inbox.take(&sealed(b"not the rightkey", 9)),
            None,
            "another key's"
        );
        let mut beat = [0u8; datagram::LEN];
        beat[..first.len()].copy_from_slice(&first);
        assert_eq!(inbox.take(&beat), None, "not a lease's length");
        assert_eq!(inbox.take(&sealed(&key, 6)).map(|l| l.seq), Some(6));
    }
}
