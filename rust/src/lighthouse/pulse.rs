//! A replica group's liveness, beaten by its heartbeat stream without taking the
//! lighthouse's lock: at 10,000 groups beating ten times a second, a lock per beat
//! would make every quorum request queue behind the beats.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct Pulse {
    /// Instants are stored as signed nanoseconds from this one.
    epoch: Instant,
    last_beat_ns: AtomicI64,
    step: AtomicI64,
    /// Evicted, or replaced by a newer stream: its stream should end.
    retired: AtomicBool,
    /// The highest quorum id the lighthouse has heard from anyone.
    heard: Arc<AtomicU64>,
}

impl Pulse {
    pub fn new(epoch: Instant, now: Instant, step: i64, heard: Arc<AtomicU64>) -> Self {
        Pulse {
            epoch,
            last_beat_ns: AtomicI64::new(offset(epoch, now)),
            step: AtomicI64::new(step),
            retired: AtomicBool::new(false),
            heard,
        }
    }

    pub fn beat(&self, now: Instant, step: i64, last_quorum_id: u64) {
        self.last_beat_ns.store(offset(self.epoch, now), Relaxed);
        self.step.store(step, Relaxed);
        if last_quorum_id > self.heard.load(Relaxed) {
            self.heard.fetch_max(last_quorum_id, Relaxed);
        }
    }

    pub fn last_beat(&self) -> Instant {
        let ns = self.last_beat_ns.load(Relaxed);
        let magnitude = Duration::from_nanos(ns.unsigned_abs());
        if ns >= 0 {
            self.epoch + magnitude
        } else {
            self.epoch - magnitude
        }
    }

    pub fn step(&self) -> i64 {
        self.step.load(Relaxed)
    }

    pub fn retire(&self) {
        self.retired.store(true, Relaxed);
    }

    pub fn is_retired(&self) -> bool {
        self.retired.load(Relaxed)
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
        pulse.beat(later, 7, 9);
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
}
