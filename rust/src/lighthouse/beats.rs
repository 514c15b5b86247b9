//! A heartbeat stream's beats, whichever way they come: on the stream (`heartbeat`'s
//! `BeatTask`, a task per stream) or as datagrams (`super::datagrams`, one thread for
//! all), each taken by the stream's `BeatSink`: the group's pulse, a lease back now and
//! then (a datagram's renewal as a datagram, every other on the stream), and what the
//! beat reports.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tonic::Status;

use super::pulse::Pulse;
use super::site::Shared;
use crate::proto;
use crate::validate;

/// How often an unchanged lease is renewed at most. A group's lease runs from the
/// send time of the beat acknowledged last, so a beat need not be acknowledged when
/// the previous acknowledgement is this recent and named the same quorum: the lease
/// stays at least this much shorter than granted, and each beat not acknowledged saves
/// the lighthouse a frame, a write and its task wakeups (with a beat every 100 ms, two
/// in three go unacknowledged: 25.7 and 22.1 µs of lighthouse CPU per beat before,
/// 17.5 and 18.5 after, 2,000 groups on a connection each). Well
/// under the second of silence after which a group gives up its stream
/// (`manager::heartbeat`), so acknowledgements alone keep it open.
const RENEW_EVERY: Duration = Duration::from_millis(250);

/// Whether a beat at `now` is acknowledged with a lease of `quorum_id`, the last
/// acknowledgement having gone out at `last` (when, of which quorum): always the first
/// and a new quorum's; else once `RENEW_EVERY` (at most an eighth of the lease) passed.
fn renewal_due(last: Option<(Instant, u64)>, quorum_id: u64, lease_ms: u64, now: Instant) -> bool {
    let every = RENEW_EVERY.min(Duration::from_millis(lease_ms / 8));
    last.is_none_or(|(at, q)| q != quorum_id || now >= at + every)
}

/// Where a heartbeat stream's acknowledgements go: its response stream, held weakly
/// (see `heartbeat`).
pub(super) struct Acks {
    pub(super) events: mpsc::WeakSender<Result<proto::LighthouseEvent, Status>>,
    pub(super) lease_ms: u64,
    /// When the last acknowledgement went out, and of which quorum's lease.
    pub(super) last: Option<(Instant, u64)>,
    /// The datagram channel offered with the stream's first lease.
    pub(super) offer: Option<proto::DatagramOffer>,
    /// Whether the last beat came as a datagram.
    pub(super) by_datagram: bool,
}

/// The stream ended: its events are gone, the beat was malformed, or the group was
/// evicted.
#[derive(Debug)]
pub(crate) struct Ended;

impl Acks {
    /// Acknowledges beat `seq` (a datagram if `by_datagram`) with a lease of
    /// `quorum_id`, unless the last one is recent and of the same quorum (a new
    /// quorum's lease goes out at once, and so does the first datagram's after beats
    /// on the stream: the group that fell back learns that datagrams pass again, both
    /// ways, see `datagram::Fallback`). A datagram's renewal is returned, to go back
    /// as a datagram; every other lease goes on the stream, where a full queue means
    /// the group is not reading (it holds no lease then).
    pub(super) fn send(
        &mut self,
        seq: u64,
        quorum_id: u64,
        now: Instant,
        by_datagram: bool,
    ) -> Result<Option<proto::Lease>, Ended> {
        let events = self.events.upgrade().ok_or(Ended)?;
        let switched = by_datagram && !self.by_datagram;
        self.by_datagram = by_datagram;
        if !switched && !renewal_due(self.last, quorum_id, self.lease_ms, now) {
            return Ok(None);
        }
        let renewal = self.last.is_some_and(|(_, q)| q == quorum_id);
        let granted = proto::Lease {
            seq,
            quorum_id,
            lease_ms: self.lease_ms,
            datagrams: self.offer.take(),
        };
        if by_datagram && renewal && granted.datagrams.is_none() {
            self.last = Some((now, quorum_id));
            return Ok(Some(granted));
        }
        let event = proto::LighthouseEvent {
            event: Some(proto::lighthouse_event::Event::Lease(granted)),
        };
        if events.try_send(Ok(event)).is_ok() {
            self.last = Some((now, quorum_id));
        }
        Ok(None)
    }
}

/// What takes a heartbeat stream's beats, whichever way they came: on the stream, or
/// as datagrams (`super::datagrams`, on a thread of their own).
pub(crate) struct BeatSink {
    pub(super) shared: Arc<Shared>,
    pub(super) pulse: Arc<Pulse>,
    pub(super) replica_id: String,
    /// Locked by one beat at a time; the stream's and its datagrams' beats seldom meet.
    pub(super) acks: Mutex<Acks>,
}

impl BeatSink {
    pub(super) fn acks(&self) -> MutexGuard<'_, Acks> {
        self.acks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The hot path: no state lock, a few atomic operations and one ack; `by_datagram`:
    /// the beat came as a datagram, and a lease returned goes back as one.
    pub(crate) fn take(
        &self,
        beat: &proto::Beat,
        by_datagram: bool,
    ) -> Result<Option<proto::Lease>, Ended> {
        let now = Instant::now();
        if validate::beat(beat).is_err() || !self.pulse.beat(now, beat.step, beat.last_quorum_id) {
            return Err(Ended);
        }
        self.shared.metrics.heartbeats.inc();
        let lease = self
            .acks()
            .send(beat.seq, self.pulse.lease_quorum(), now, by_datagram)?;
        if self.pulse.trained(now, beat) && self.shared.stall_overdue.load(Relaxed) {
            self.shared.wake.notify_one();
        }
        self.shared.report(&self.replica_id, beat);
        Ok(lease)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unchanged_lease_is_renewed_every_250ms_a_new_quorums_at_once() {
        let t = Instant::now();
        let ms = Duration::from_millis;
        // The first beat of a stream, then the same quorum's lease moments later.
        assert!(renewal_due(None, 4, 2000, t));
        assert!(!renewal_due(Some((t, 4)), 4, 2000, t + ms(100)));
        assert!(renewal_due(Some((t, 4)), 4, 2000, t + ms(250)));
        // A new quorum is granted with the first beat that can carry it.
        assert!(renewal_due(Some((t, 4)), 5, 2000, t + ms(1)));
        // A short lease is renewed within an eighth of it.
        assert!(!renewal_due(Some((t, 4)), 4, 400, t + ms(40)));
        assert!(renewal_due(Some((t, 4)), 4, 400, t + ms(50)));
    }

    #[test]
    fn a_datagrams_renewal_goes_back_as_one_the_offer_and_a_new_quorums_lease_on_the_stream() {
        let t = Instant::now();
        let ms = Duration::from_millis;
        let (events, mut on_stream) = mpsc::channel(8);
        let mut acks = Acks {
            events: events.downgrade(),
            lease_ms: 2000,
            last: None,
            offer: Some(proto::DatagramOffer::default()),
            by_datagram: false,
        };
        let mut streamed = || match on_stream.try_recv() {
            Ok(Ok(proto::LighthouseEvent {
                event: Some(proto::lighthouse_event::Event::Lease(lease)),
            })) => Some(lease),
            _ => None,
        };
        // The first beat's lease offers the channel, on the stream.
        assert_eq!(acks.send(1, 4, t, false).unwrap(), None);
        assert!(streamed().unwrap().datagrams.is_some());
        // The first datagram is leased at once, as a datagram; the next not so soon.
        assert_eq!(acks.send(2, 4, t + ms(10), true).unwrap().unwrap().seq, 2);
        assert_eq!(acks.send(3, 4, t + ms(100), true).unwrap(), None);
        assert_eq!(acks.send(4, 4, t + ms(300), true).unwrap().unwrap().seq, 4);
        assert!(streamed().is_none());
        // A new quorum's lease must not be lost: on the stream.
        assert_eq!(acks.send(5, 5, t + ms(310), true).unwrap(), None);
        assert_eq!(streamed().unwrap().quorum_id, 5);
        // A beat on the stream is renewed on it.
        assert_eq!(acks.send(6, 5, t + ms(600), false).unwrap(), None);
        assert_eq!(streamed().unwrap().seq, 6);
        drop(events);
        assert!(acks.send(7, 5, t + ms(900), true).is_err());
    }
}
