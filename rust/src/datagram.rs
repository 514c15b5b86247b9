//! Beats as UDP datagrams beside a framed heartbeat stream (`frames`,
//! `proto::DatagramOffer`), and the leases that renew them back the same way: the
//! layout of each, their authenticator, the rule that takes a datagram only once and in
//! order, and the rule by which a group gives datagrams up for its stream. Pure: bytes
//! in, beats and leases out; the I/O is `lighthouse::datagrams` and `lighthouse::wire`.
//!
//! Why: a beat on a TCP stream costs the lighthouse's kernel a data segment in and an
//! ACK out, and epoll and the runtime a wakeup, about 5 µs of its 8-9 µs per beat at
//! 10,000 groups. A datagram costs a share of one `recvmmsg` that takes many. A lease
//! written on the stream cost about 10 µs (a task's wakeup, a write, a segment and its
//! ACK), one beat in three; as a datagram it is a share of one `sendmmsg` from the
//! thread that read the beat. A new quorum's lease, and the first, still go on the
//! stream: they must not be lost; a renewal lost is renewed again a quarter second on.
//!
//! Why it is as safe as the stream: only the lighthouse and the group know the
//! stream's key, so no one else can make a datagram it takes; a datagram's sequence
//! number must exceed every one taken before on its channel, so a copy replayed later
//! keeps no dead group alive; and a lease still acknowledges a beat by its sequence
//! number and counts from when the group sent it, whichever way the beat went.

use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::proto;

/// The first bytes of a datagram: tells a beat from stray traffic at a glance, and
/// names the layout's version.
const MAGIC: &[u8; 4] = b"PXB1";

/// Bytes of the authenticator: a keyed SHA-256 of the rest, cut to 128 bits.
const TAG: usize = 16;

/// Bytes of the beat's fields: the channel, the sequence number, and six fields of
/// the beat, each 8 bytes big-endian.
const FIELDS: usize = 8 * 8;

/// Bytes of every beat's datagram; any other length is dropped unread.
pub const LEN: usize = MAGIC.len() + FIELDS + TAG;

/// The first bytes of a lease's datagram. Beats and leases are sealed with the same
/// key: their first bytes, under the authenticator, keep a beat from being read as a
/// lease (reflected back at the group) or a lease as a beat.
const LEASE_MAGIC: &[u8; 4] = b"PXL1";

/// Bytes of a lease's fields: the channel, the sequence number of the beat it
/// acknowledges, the quorum and the lease's length, each 8 bytes big-endian.
const LEASE_FIELDS: usize = 4 * 8;

/// Bytes of every lease's datagram.
pub const LEASE_LEN: usize = LEASE_MAGIC.len() + LEASE_FIELDS + TAG;

// Both kinds' fields start at the same place (`field`).
const _: () = assert!(MAGIC.len() == LEASE_MAGIC.len());

/// A stream's key, drawn by the lighthouse for that stream alone.
pub type Key = [u8; 16];

/// What a datagram carries: which stream's beat it is and the fields a beat reports
/// every time. What a beat reports now and then (its tally, refusals, an ask, that the
/// group leaves) goes on the stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DatagramBeat {
    pub channel: u64,
    pub seq: u64,
    pub last_quorum_id: u64,
    pub step: i64,
    pub progress_age_ms: u64,
    pub waiting_ms: u64,
    pub stall_timeout_ms: u64,
    pub step_time_ms: u64,
}

impl DatagramBeat {
    /// `beat` as a datagram of `channel`; None when it must go on the stream: it
    /// names the group, asks, reports counts or leaves, or has no sequence number.
    ///
    /// ```
    /// use phalanx::datagram::DatagramBeat;
    /// use phalanx::proto;
    /// let beat = proto::Beat { seq: 7, step: 3, ..Default::default() };
    /// assert_eq!(DatagramBeat::of(9, &beat).unwrap().to_beat().step, 3);
    /// let leaving = proto::Beat { leaving: true, ..beat };
    /// assert!(DatagramBeat::of(9, &leaving).is_none());
    /// ```
    pub fn of(channel: u64, beat: &proto::Beat) -> Option<Self> {
        let plain = beat.seq != 0
            && beat.replica_id.is_empty()
            && beat.manager_address.is_empty()
            && beat.refused.is_empty()
            && beat.tally.is_none()
            && beat.ask.is_none()
            && !beat.leaving;
        plain.then_some(DatagramBeat {
            channel,
            seq: beat.seq,
            last_quorum_id: beat.last_quorum_id,
            step: beat.step,
            progress_age_ms: beat.progress_age_ms,
            waiting_ms: beat.waiting_ms,
            stall_timeout_ms: beat.stall_timeout_ms,
            step_time_ms: beat.step_time_ms,
        })
    }

    /// The beat as the stream would have carried it (protocol version included: the
    /// layout's version stands for it).
    pub fn to_beat(&self) -> proto::Beat {
        proto::Beat {
            protocol_version: proto::PROTOCOL_VERSION,
            seq: self.seq,
            last_quorum_id: self.last_quorum_id,
            step: self.step,
            progress_age_ms: self.progress_age_ms,
            waiting_ms: self.waiting_ms,
            stall_timeout_ms: self.stall_timeout_ms,
            step_time_ms: self.step_time_ms,
            ..Default::default()
        }
    }
}

/// A lease as a datagram: the lighthouse's acknowledgement of beat `seq` of
/// `channel`, renewing the group's lease of `quorum_id` for `lease_ms` from when it sent
/// that beat (see `proto::Lease`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DatagramLease {
    pub channel: u64,
    pub seq: u64,
    pub quorum_id: u64,
    pub lease_ms: u64,
}

impl DatagramLease {
    /// `lease` as a datagram of `channel`; None when it must go on the stream: it
    /// offers the datagram channel itself.
    ///
    /// ```
    /// use phalanx::datagram::DatagramLease;
    /// use phalanx::proto;
    /// let lease = proto::Lease { seq: 7, quorum_id: 3, lease_ms: 2000, datagrams: None };
    /// assert_eq!(DatagramLease::of(9, &lease).unwrap().to_lease(), lease);
    /// let offer = proto::Lease { datagrams: Some(Default::default()), ..lease };
    /// assert!(DatagramLease::of(9, &offer).is_none());
    /// ```
    pub fn of(channel: u64, lease: &proto::Lease) -> Option<Self> {
        lease.datagrams.is_none().then_some(DatagramLease {
            channel,
            seq: lease.seq,
            quorum_id: lease.quorum_id,
            lease_ms: lease.lease_ms,
        })
    }

    /// The lease as the stream would have carried it.
    pub fn to_lease(&self) -> proto::Lease {
        proto::Lease {
            seq: self.seq,
            quorum_id: self.quorum_id,
            lease_ms: self.lease_ms,
            datagrams: None,
        }
    }
}

/// Why the lighthouse dropped a datagram; the label of its `datagrams_dropped`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dropped {
    /// Not a beat's datagram: the wrong length or first bytes.
    Garbage,
    /// A channel no open stream was offered (or whose stream has ended).
    Unknown,
    /// The authenticator does not match the channel's key.
    Forged,
    /// A sequence number no greater than one the channel took already: a copy, or a
    /// datagram overtaken by a later one.
    Replayed,
}

impl Dropped {
    pub const ALL: [Dropped; 4] = [
        Dropped::Garbage,
        Dropped::Unknown,
        Dropped::Forged,
        Dropped::Replayed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Dropped::Garbage => "garbage",
            Dropped::Unknown => "unknown_channel",
            Dropped::Forged => "forged",
            Dropped::Replayed => "replayed",
        }
    }
}

/// The channel a beat's datagram names, before it is authenticated (to find its key).
pub fn channel_of(bytes: &[u8]) -> Result<u64, Dropped> {
    laid_out(bytes, MAGIC, LEN).map(|()| field(bytes, 0))
}

/// The channel a lease's datagram names, before it is authenticated.
pub fn lease_channel_of(bytes: &[u8]) -> Result<u64, Dropped> {
    laid_out(bytes, LEASE_MAGIC, LEASE_LEN).map(|()| field(bytes, 0))
}

/// Whether `bytes` have the length and first bytes of one kind of datagram.
fn laid_out(bytes: &[u8], magic: &[u8; 4], len: usize) -> Result<(), Dropped> {
    if bytes.len() != len || &bytes[..magic.len()] != magic {
        return Err(Dropped::Garbage);
    }
    Ok(())
}

/// The `i`th 8-byte field after the magic.
fn field(bytes: &[u8], i: usize) -> u64 {
    let at = MAGIC.len() + 8 * i;
    u64::from_be_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

/// Seals and opens the datagrams of one stream with its key.
#[derive(Clone)]
pub struct Sealer(Hmac<Sha256>);

impl Sealer {
    pub fn new(key: &Key) -> Self {
        Sealer(Hmac::new_from_slice(key).expect("HMAC takes a key of any length"))
    }

    /// `beat` as the bytes of one datagram.
    pub fn seal(&self, beat: &DatagramBeat) -> [u8; LEN] {
        let mut out = [0u8; LEN];
        self.seal_into(
            MAGIC,
            &[
                beat.channel,
                beat.seq,
                beat.last_quorum_id,
                beat.step as u64,
                beat.progress_age_ms,
                beat.waiting_ms,
                beat.stall_timeout_ms,
                beat.step_time_ms,
            ],
            &mut out,
        );
        out
    }

    /// The beat in `bytes`, if this key sealed them (compared in constant time).
    pub fn open(&self, bytes: &[u8]) -> Result<DatagramBeat, Dropped> {
        let [channel, seq, last_quorum_id, step, progress_age_ms, waiting_ms, stall_timeout_ms, step_time_ms] =
            self.open_from(MAGIC, bytes)?;
        Ok(DatagramBeat {
            channel,
            seq,
            last_quorum_id,
            step: step as i64,
            progress_age_ms,
            waiting_ms,
            stall_timeout_ms,
            step_time_ms,
        })
    }

    /// `lease` as the bytes of one datagram.
    pub fn seal_lease(&self, lease: &DatagramLease) -> [u8; LEASE_LEN] {
        let mut out = [0u8; LEASE_LEN];
        let fields = [lease.channel, lease.seq, lease.quorum_id, lease.lease_ms];
        self.seal_into(LEASE_MAGIC, &fields, &mut out);
        out
    }

    /// The lease in `bytes`, if this key sealed them.
    pub fn open_lease(&self, bytes: &[u8]) -> Result<DatagramLease, Dropped> {
        let [channel, seq, quorum_id, lease_ms] = self.open_from(LEASE_MAGIC, bytes)?;
        Ok(DatagramLease {
            channel,
            seq,
            quorum_id,
            lease_ms,
        })
    }

    /// Writes `magic`, `fields` and their authenticator into `out`, exactly their
    /// length.
    fn seal_into(&self, magic: &[u8; 4], fields: &[u64], out: &mut [u8]) {
        out[..magic.len()].copy_from_slice(magic);
        for (i, value) in fields.iter().enumerate() {
            let at = magic.len() + 8 * i;
            out[at..at + 8].copy_from_slice(&value.to_be_bytes());
        }
        let signed = out.len() - TAG;
        let mut mac = self.0.clone();
        mac.update(&out[..signed]);
        out[signed..].copy_from_slice(&mac.finalize().into_bytes()[..TAG]);
    }

    /// The `N` fields after `magic` in `bytes`, if this key sealed them.
    fn open_from<const N: usize>(
        &self,
        magic: &[u8; 4],
        bytes: &[u8],
    ) -> Result<[u64; N], Dropped> {
        laid_out(bytes, magic, magic.len() + 8 * N + TAG)?;
        let signed = bytes.len() - TAG;
        let mut mac = self.0.clone();
        mac.update(&bytes[..signed]);
        mac.verify_truncated_left(&bytes[signed..])
            .map_err(|_| Dropped::Forged)?;
        Ok(std::array::from_fn(|i| field(bytes, i)))
    }
}

/// A channel's sequence numbers: each datagram taken must number above every one
/// taken before, so a copy is taken at most once and never after a newer beat.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sequence {
    last: u64,
}

impl Sequence {
    /// Takes `seq` if it grows the sequence.
    ///
    /// ```
    /// use phalanx::datagram::Sequence;
    /// let mut seq = Sequence::default();
    /// assert!(seq.take(2) && seq.take(5));
    /// assert!(!seq.take(5) && !seq.take(3));
    /// ```
    pub fn take(&mut self, seq: u64) -> bool {
        let grows = seq > self.last;
        if grows {
            self.last = seq;
        }
        grows
    }
}

/// Whether a group still sends its beats as datagrams: it gives them up for the
/// stream once `UNANSWERED` datagrams in a row went out over `SILENCE` (or a quarter
/// of the lease, if shorter) without a lease coming back: a firewall that drops UDP, a
/// lighthouse that stopped reading them, or one too busy to lease in time. The
/// lighthouse renews a lease every 250 ms (or an eighth of it) at most, and a group
/// gives up a stream silent for a second (`manager::heartbeat`): this falls back well
/// before that and before its lease runs out, and a slow beat (one a second) needs
/// three unanswered ones, never one late lease.
///
/// Given up, every `PROBE_EVERY`th beat still goes as a datagram alone (that beat is
/// lost if UDP does not pass, and the others are on the stream): a lease that
/// acknowledges one says datagrams pass again, and the group goes back to them.
#[derive(Clone, Copy, Debug)]
pub struct Fallback {
    silence: Duration,
    last_lease: Instant,
    unanswered: u32,
    given_up: bool,
    /// Beats since the last probe, and the last probe's sequence number.
    since_probe: u32,
    probe: Option<u64>,
}

impl Fallback {
    pub const SILENCE: Duration = Duration::from_millis(500);
    pub const UNANSWERED: u32 = 3;
    pub const PROBE_EVERY: u32 = 10;

    /// Datagrams were offered at `now`, with the stream's first lease, of `lease`.
    pub fn new(now: Instant, lease: Duration) -> Self {
        Fallback {
            silence: Self::SILENCE.min(lease / 4),
            last_lease: now,
            unanswered: 0,
            given_up: false,
            since_probe: 0,
            probe: None,
        }
    }

    /// How long without a lease gives datagrams up.
    pub fn silence(&self) -> Duration {
        self.silence
    }

    /// A lease of beat `seq` came at `now`.
    pub fn leased(&mut self, now: Instant, seq: u64) {
        self.last_lease = now;
        self.unanswered = 0;
        if self.given_up && self.probe == Some(seq) {
            self.given_up = false;
            self.probe = None;
        }
    }

    /// Whether beat `seq`, sent at `now`, goes as a datagram (counted as sent if so)
    /// rather than on the stream.
    pub fn by_datagram(&mut self, now: Instant, seq: u64) -> bool {
        if !self.given_up
            && self.unanswered >= Self::UNANSWERED
            && now.saturating_duration_since(self.last_lease) >= self.silence
        {
            self.given_up = true;
            self.since_probe = 0;
        }
        if self.given_up {
            self.since_probe += 1;
            if self.since_probe < Self::PROBE_EVERY {
                return false;
            }
            self.since_probe = 0;
            self.probe = Some(seq);
            return true;
        }
        self.unanswered += 1;
        true
    }

    pub fn given_up(&self) -> bool {
        self.given_up
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn every_drop_reason_indexes_its_place_in_all() {
        // The lighthouse keeps a counter per reason in `ALL`'s order, found by `as usize`.
        for (i, why) in Dropped::ALL.into_iter().enumerate() {
            assert_eq!(why as usize, i, "{why:?}");
        }
    }

    const KEY: Key = *b"0123456789abcdef";

    fn beat() -> impl Strategy<Value = DatagramBeat> {
        (
            any::<u64>(),
            1..u64::MAX,
            any::<u64>(),
            any::<i64>(),
            any::<[u64; 4]>(),
        )
            .prop_map(|(channel, seq, last_quorum_id, step, ms)| DatagramBeat {
                channel,
                seq,
                last_quorum_id,
                step,
                progress_age_ms: ms[0],
                waiting_ms: ms[1],
                stall_timeout_ms: ms[2],
                step_time_ms: ms[3],
            })
    }

    proptest! {
        #[test]
        fn a_sealed_beat_opens_as_itself_with_its_key(b in beat()) {
            let bytes = Sealer::new(&KEY).seal(&b);
            prop_assert_eq!(channel_of(&bytes), Ok(b.channel));
            prop_assert_eq!(Sealer::new(&KEY).open(&bytes), Ok(b));
            let proto = b.to_beat();
            prop_assert_eq!(DatagramBeat::of(b.channel, &proto), Some(b));
        }

        #[test]
        fn any_changed_bit_or_another_key_is_a_forgery(
            b in beat(), bit in 0..(LEN - MAGIC.len()) * 8, other in any::<Key>()
        ) {
            let bytes = Sealer::new(&KEY).seal(&b);
            let mut flipped = bytes;
            let at = MAGIC.len() + bit / 8;
            flipped[at] ^= 1 << (bit % 8);
            prop_assert_eq!(Sealer::new(&KEY).open(&flipped), Err(Dropped::Forged));
            prop_assume!(other != KEY);
            prop_assert_eq!(Sealer::new(&other).open(&bytes), Err(Dropped::Forged));
        }

        #[test]
        fn garbage_is_told_before_any_key_is_used(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            prop_assume!(bytes.len() != LEN || bytes[..4] != MAGIC[..]);
            prop_assert_eq!(channel_of(&bytes), Err(Dropped::Garbage));
            prop_assert_eq!(Sealer::new(&KEY).open(&bytes), Err(Dropped::Garbage));
        }

        #[test]
        fn a_sealed_lease_opens_as_itself_with_its_key_and_never_as_a_beat(
            l in any::<[u64; 4]>(), bit in 0..(LEASE_LEN - LEASE_MAGIC.len()) * 8, other in any::<Key>()
        ) {
            let lease = DatagramLease { channel: l[0], seq: l[1], quorum_id: l[2], lease_ms: l[3] };
            let bytes = Sealer::new(&KEY).seal_lease(&lease);
            prop_assert_eq!(lease_channel_of(&bytes), Ok(lease.channel));
            prop_assert_eq!(Sealer::new(&KEY).open_lease(&bytes), Ok(lease));
            prop_assert_eq!(DatagramLease::of(lease.channel, &lease.to_lease()), Some(lease));
            prop_assert_eq!(Sealer::new(&KEY).open(&bytes), Err(Dropped::Garbage));
            let mut flipped = bytes;
            flipped[LEASE_MAGIC.len() + bit / 8] ^= 1 << (bit % 8);
            prop_assert_eq!(Sealer::new(&KEY).open_lease(&flipped), Err(Dropped::Forged));
            prop_assume!(other != KEY);
            prop_assert_eq!(Sealer::new(&other).open_lease(&bytes), Err(Dropped::Forged));
        }

        #[test]
        fn a_beat_never_opens_as_a_lease(b in beat()) {
            let bytes = Sealer::new(&KEY).seal(&b);
            prop_assert_eq!(lease_channel_of(&bytes), Err(Dropped::Garbage));
            prop_assert_eq!(Sealer::new(&KEY).open_lease(&bytes), Err(Dropped::Garbage));
        }

        #[test]
        fn a_sequence_takes_each_number_once_and_only_growing(seqs in proptest::collection::vec(0..50u64, 0..100)) {
            let mut sequence = Sequence::default();
            let mut taken = Vec::new();
            for s in seqs {
                if sequence.take(s) {
                    taken.push(s);
                }
            }
            prop_assert!(taken.windows(2).all(|w| w[0] < w[1]), "{:?}", taken);
        }
    }

    #[test]
    fn only_a_plain_numbered_beat_goes_as_a_datagram() {
        let plain = proto::Beat {
            seq: 4,
            ..Default::default()
        };
        assert!(DatagramBeat::of(1, &plain).is_some());
        let on_the_stream = [
            proto::Beat {
                seq: 0,
                ..plain.clone()
            },
            proto::Beat {
                replica_id: "g".into(),
                ..plain.clone()
            },
            proto::Beat {
                manager_address: "m:1".into(),
                ..plain.clone()
            },
            proto::Beat {
                tally: Some(Default::default()),
                ..plain.clone()
            },
            proto::Beat {
                refused: vec![Default::default()],
                ..plain.clone()
            },
            proto::Beat {
                ask: Some(Default::default()),
                ..plain.clone()
            },
            proto::Beat {
                leaving: true,
                ..plain.clone()
            },
        ];
        for beat in on_the_stream {
            assert_eq!(DatagramBeat::of(1, &beat), None, "{beat:?}");
        }
    }

    #[test]
    fn a_group_gives_datagrams_up_after_half_a_second_unanswered_and_probes_to_come_back() {
        let t = Instant::now();
        let ms = Duration::from_millis;
        let mut fallback = Fallback::new(t, Duration::from_secs(2));
        // Beats every 100 ms, a lease every third: datagrams throughout.
        for i in 1..=30u64 {
            assert!(fallback.by_datagram(t + ms(100 * i), i), "beat {i}");
            if i % 3 == 0 {
                fallback.leased(t + ms(100 * i + 1), i);
            }
        }
        // Then no lease: five more datagrams, and the stream from half a second on.
        let quiet = t + ms(3001);
        let sent: Vec<bool> = (31..=38u64)
            .map(|i| fallback.by_datagram(quiet + ms(100 * (i - 30)), i))
            .collect();
        assert_eq!(sent, [true, true, true, true, false, false, false, false]);
        // Leases of beats on the stream: still on the stream, but every tenth beat
        // probes with a datagram alone.
        fallback.leased(quiet + ms(900), 37);
        let sent: Vec<bool> = (39..=48u64)
            .map(|i| fallback.by_datagram(quiet + ms(100 * (i - 30)), i))
            .collect();
        assert_eq!(sent.iter().filter(|&&d| d).count(), 1, "{sent:?}");
        assert!(
            sent[44 - 39],
            "the tenth beat since it gave up (35): {sent:?}"
        );
        assert!(fallback.given_up());
        fallback.leased(quiet + ms(1900), 47);
        assert!(
            !fallback.by_datagram(quiet + ms(2000), 49),
            "not the probe's lease"
        );
        // The probe's lease: datagrams pass again.
        fallback.leased(quiet + ms(2001), 44);
        assert!(!fallback.given_up());
        assert!(fallback.by_datagram(quiet + ms(2100), 50));

        // A beat a second: one late lease is no reason, three unanswered ones are.
        let mut slow = Fallback::new(t, Duration::from_secs(5));
        assert!(slow.by_datagram(t + ms(1000), 2));
        assert!(slow.by_datagram(t + ms(2000), 3));
        assert!(slow.by_datagram(t + ms(3000), 4));
        assert!(!slow.by_datagram(t + ms(4000), 5));

        // A short lease falls back within a quarter of it.
        let mut short = Fallback::new(t, ms(400));
        assert_eq!(short.silence(), ms(100));
        let sent: Vec<bool> = (1..=4u64)
            .map(|i| short.by_datagram(t + ms(40 * i), i))
            .collect();
        assert_eq!(sent, [true, true, true, false]);
    }
}
