//! A replica group's liveness, beaten by its heartbeat stream without taking the
//! lighthouse's lock: at 10,000 groups beating ten times a second, a lock per beat
//! would make every quorum request queue behind the beats.
//!
//! A beat and an eviction race on one atomic word: the beat moves the time of the
//! last beat forward unless the pulse is retired, the eviction retires it only if that
//! time is still old. So a beat that succeeded was seen by every later eviction check,
//! and the lease acknowledged for it holds (see `LighthouseState::expire`).

use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicI64, AtomicU64};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `last_beat_ns` of a pulse that is evicted, or replaced by a newer stream.
const RETIRED: i64 = i64::MIN;

#[derive(Debug)]
pub struct Pulse {
    /// Instants are stored as signed nanoseconds from this one.
    epoch: Instant,
    last_beat_ns: AtomicI64,
    step: AtomicI64,
    /// The quorum this group is a live member of (0: none), as its leases name it.
    lease_quorum: AtomicU64,
    /// The highest quorum id the lighthouse has heard from anyone.
    heard: Arc<AtomicU64>,
    /// What the group's beats say of its training (see `Training`); `stalled_since_ns`
    /// is `RETIRED` while the group does not report it, `waiting_since_ns` while it
    /// does not wait.
    stalled_since_ns: AtomicI64,
    waiting_since_ns: AtomicI64,
    stall_timeout_ms: AtomicU64,
    step_time_ms: AtomicU64,
}

/// A group's training progress as its last beat told it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Training {
    /// Since when the group has made no progress (about when its last beat was sent,
    /// while it trains).
    pub stalled_since: Instant,
    /// Since when some rank of it waits on the other groups; None: none does.
    pub waiting_since: Option<Instant>,
    /// The group asks to be evicted after this long without progress while a peer
    /// waits on it.
    pub stall_timeout: Duration,
    /// Its own work per step (waits on others left out); None until measured.
    pub step_time: Option<Duration>,
}

impl Training {
    /// When the group is due for eviction unless it moves.
    pub fn due(&self) -> Instant {
        self.stalled_since + self.stall_timeout
    }
}

impl Pulse {
    pub fn new(epoch: Instant, now: Instant, step: i64, heard: Arc<AtomicU64>) -> Self {
        Pulse {
            epoch,
            last_beat_ns: AtomicI64::new(offset(epoch, now)),
            step: AtomicI64::new(step),
            lease_quorum: AtomicU64::new(0),
            heard,
            stalled_since_ns: AtomicI64::new(RETIRED),
            waiting_since_ns: AtomicI64::new(RETIRED),
            stall_timeout_ms: AtomicU64::new(0),
            step_time_ms: AtomicU64::new(0),
        }
    }

    /// Records what a beat received at `now` says of the group's training; true when
    /// the group just began to wait on the others (a stalled peer may be due now).
    pub fn trained(&self, now: Instant, beat: &crate::proto::Beat) -> bool {
        if beat.stall_timeout_ms == 0 {
            self.stalled_since_ns.store(RETIRED, Relaxed);
            return false;
        }
        let since = now
            .checked_sub(Duration::from_millis(beat.progress_age_ms))
            .unwrap_or(self.epoch);
        self.stall_timeout_ms.store(beat.stall_timeout_ms, Relaxed);
        self.step_time_ms.store(beat.step_time_ms, Relaxed);
        self.stalled_since_ns
            .store(offset(self.epoch, since), Relaxed);
        let waiting_since = match beat.waiting_ms {
            0 => RETIRED,
            ms => offset(
                self.epoch,
                now.checked_sub(Duration::from_millis(ms))
                    .unwrap_or(self.epoch),
            ),
        };
        let before = self.waiting_since_ns.swap(waiting_since, Relaxed);
        before == RETIRED && waiting_since != RETIRED
    }

    /// The group's training progress; None while it does not report it.
    pub fn training(&self) -> Option<Training> {
        let ns = self.stalled_since_ns.load(Relaxed);
        (ns != RETIRED).then(|| Training {
            stalled_since: instant(self.epoch, ns),
            waiting_since: match self.waiting_since_ns.load(Relaxed) {
                RETIRED => None,
                ns => Some(instant(self.epoch, ns)),
            },
            stall_timeout: Duration::from_millis(self.stall_timeout_ms.load(Relaxed)),
            step_time: match self.step_time_ms.load(Relaxed) {
                0 => None,
                ms => Some(Duration::from_millis(ms)),
            },
        })
    }

    /// Records a beat at `now`; false (and nothing recorded) once the pulse is retired.
    pub fn beat(&self, now: Instant, step: i64, last_quorum_id: u64) -> bool {
        let at = offset(self.epoch, now);
        let beaten = self
            .last_beat_ns
            .fetch_update(AcqRel, Acquire, |last| {
                (last != RETIRED).then_some(last.max(at))
            })
            .is_ok();
        if !beaten {
            return false;
        }
        self.step.store(step, Relaxed);
        if last_quorum_id > self.heard.load(Relaxed) {
            self.heard.fetch_max(last_quorum_id, Relaxed);
        }
        true
    }

    /// The last beat; a retired pulse reads as having never beaten since the epoch.
    pub fn last_beat(&self) -> Instant {
        let ns = self.last_beat_ns.load(Acquire);
        if ns == RETIRED {
            return self.epoch;
        }
        instant(self.epoch, ns)
    }

    pub fn step(&self) -> i64 {
        self.step.load(Relaxed)
    }

    pub fn retire(&self) {
        self.last_beat_ns.store(RETIRED, Release);
    }

    /// Retires the pulse if its last beat is no later than `horizon`; false when a
    /// beat came in after it (or it was retired already).
    pub fn retire_if_silent_since(&self, horizon: Instant) -> bool {
        let horizon = offset(self.epoch, horizon);
        self.last_beat_ns
            .fetch_update(AcqRel, Acquire, |last| {
                (last != RETIRED && last <= horizon).then_some(RETIRED)
            })
            .is_ok()
    }

    pub fn is_retired(&self) -> bool {
        self.last_beat_ns.load(Acquire) == RETIRED
    }

    pub fn lease_quorum(&self) -> u64 {
        self.lease_quorum.load(Acquire)
    }

    pub fn set_lease_quorum(&self, quorum_id: u64) {
        self.lease_quorum.store(quorum_id, Release);
    }
}

fn instant(epoch: Instant, ns: i64) -> Instant {
    let magnitude = Duration::from_nanos(ns.unsigned_abs());
    if ns >= 0 {
        epoch + magnitude
    } else {
        epoch - magnitude
    }
}

fn offset(epoch: Instant, at: Instant) -> i64 {
    match at.checked_duration_since(epoch) {
        Some(after) => after.as_nanos() as i64,
        None => -(epoch.duration_since(at).as_nanos() as i64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn beats_before_and_after_the_epoch_read_back_exactly() {
        let epoch = Instant::now();
        let heard = Arc::new(AtomicU64::new(3));
        let before = epoch.checked_sub(Duration::from_millis(5)).unwrap_or(epoch);
        let pulse = Pulse::new(epoch, before, 0, heard.clone());
        assert_eq!(pulse.last_beat(), before);
        let later = epoch + Duration::from_millis(1234);
        assert!(pulse.beat(later, 7, 9));
        assert_eq!(pulse.last_beat(), later);
        assert_eq!(pulse.step(), 7);
        assert_eq!(heard.load(Relaxed), 9);
        pulse.beat(later, 8, 2);
        assert_eq!(
            heard.load(Relaxed),
            9,
            "a lower id never lowers what was heard"
        );
    }

    #[test]
    fn a_beat_never_moves_the_last_beat_back() {
        let epoch = Instant::now();
        let pulse = Pulse::new(epoch, epoch, 0, Arc::new(AtomicU64::new(0)));
        let late = epoch + Duration::from_millis(50);
        pulse.beat(late, 0, 0);
        pulse.beat(epoch + Duration::from_millis(10), 0, 0);
        assert_eq!(pulse.last_beat(), late);
    }

    #[test]
    fn an_eviction_check_and_a_beat_cannot_both_succeed_on_one_instant() {
        let epoch = Instant::now();
        let pulse = Pulse::new(epoch, epoch, 0, Arc::new(AtomicU64::new(0)));
        let horizon = epoch + Duration::from_millis(100);
        // A beat after the horizon saves the pulse from this eviction check...
        assert!(pulse.beat(horizon + Duration::from_millis(1), 0, 0));
        assert!(!pulse.retire_if_silent_since(horizon));
        // ...and once a check has retired it, no beat is taken (nor acknowledged).
        assert!(pulse.retire_if_silent_since(horizon + Duration::from_millis(5)));
        assert!(pulse.is_retired());
        assert!(!pulse.beat(horizon + Duration::from_millis(6), 0, 0));
    }

    #[test]
    fn racing_beats_and_evictions_agree_on_who_won() {
        // Whatever the interleaving, an acknowledged beat at t means no eviction with
        // a horizon before t succeeds.
        for _ in 0..200 {
            let epoch = Instant::now();
            let pulse = Arc::new(Pulse::new(epoch, epoch, 0, Arc::new(AtomicU64::new(0))));
            let at = epoch + Duration::from_millis(10);
            let beater = {
                let pulse = pulse.clone();
                std::thread::spawn(move || pulse.beat(at, 0, 0))
            };
            let evicted = pulse.retire_if_silent_since(epoch + Duration::from_millis(5));
            let beaten = beater.join().unwrap();
            assert!(
                beaten != evicted,
                "beaten {beaten}, evicted {evicted}: exactly one wins"
            );
        }
    }
}
