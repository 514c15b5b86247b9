//! What the lighthouse remembers of what happened: the groups it declared dead (for
//! a while, see `LOST_KEPT_FOR`) and each replica id's `History` across its deaths,
//! the job's rollbacks, and the steps each group reported, sampled for its step rate.
//! Kept for the status page and `/metrics`; the quorum rules read none of it.
//!
//! Pure: every method takes `now`.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::tally::Tally;
use crate::quorum::{Identity, Quorum, QuorumId, ReplicaId};

/// Lost groups stay on the status page (and in `/metrics`) this long, and at most
/// `LOST_KEPT` of them: long enough to see what happened over a coffee break, few
/// enough that a job losing groups in a loop keeps a bounded page and label set.
pub const LOST_KEPT_FOR: Duration = Duration::from_secs(600);
pub const LOST_KEPT: usize = 32;

/// Why a replica group was declared dead.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Eviction {
    /// Its heartbeat stream dropped: the process died or its connection was reset.
    StreamBroken,
    /// Connected but silent for longer than the heartbeat timeout: hung.
    HeartbeatTimeout,
    /// Beating, but its training made no progress for its stall timeout while a peer
    /// waited on it: a hung training thread.
    ProgressStalled,
    /// It ended its run: its manager server stopped in order (`Beat.leaving`). Not a
    /// failure, but it takes its state with it like one.
    Left,
}

impl Eviction {
    pub const ALL: [Eviction; 4] = [
        Eviction::StreamBroken,
        Eviction::HeartbeatTimeout,
        Eviction::ProgressStalled,
        Eviction::Left,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Eviction::StreamBroken => "stream_broken",
            Eviction::HeartbeatTimeout => "heartbeat_timeout",
            Eviction::ProgressStalled => "progress_stalled",
            Eviction::Left => "left",
        }
    }
}

impl serde::Serialize for Eviction {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// How often a replica id was declared dead, by cause.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Losses {
    pub stream_broken: u64,
    pub heartbeat_timeout: u64,
    pub progress_stalled: u64,
    pub left: u64,
}

impl Losses {
    pub fn of(&self, cause: Eviction) -> u64 {
        match cause {
            Eviction::StreamBroken => self.stream_broken,
            Eviction::HeartbeatTimeout => self.heartbeat_timeout,
            Eviction::ProgressStalled => self.progress_stalled,
            Eviction::Left => self.left,
        }
    }

    pub fn count(&mut self, cause: Eviction) {
        match cause {
            Eviction::StreamBroken => self.stream_broken += 1,
            Eviction::HeartbeatTimeout => self.heartbeat_timeout += 1,
            Eviction::ProgressStalled => self.progress_stalled += 1,
            Eviction::Left => self.left += 1,
        }
    }
}

/// What the lighthouse remembers of a replica id across its deaths. It travels with the
/// group, live or recently lost, and is forgotten with it: a group that comes back
/// after `LOST_KEPT_FOR` starts from zero, as a new one.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct History {
    pub losses: Losses,
    /// Times it came back (the same replica id heartbeating or asking for a quorum
    /// again) after being declared dead: restarts, or a hung group waking up.
    pub returns: u64,
    #[serde(flatten)]
    pub tally: Tally,
}

/// A group declared dead, kept for the status page (see `LOST_KEPT_FOR`).
#[derive(Debug)]
pub struct Lost {
    pub replica_id: ReplicaId,
    pub cause: Eviction,
    pub at: Instant,
    /// The last step it reported.
    pub step: i64,
    /// It was a member of the quorum current when it died.
    pub was_member: bool,
    /// Where its heartbeat stream came from (empty: it had none).
    pub peer: String,
    pub history: History,
}

/// The groups declared dead recently, oldest first: at most `LOST_KEPT`, none older
/// than `LOST_KEPT_FOR`.
#[derive(Debug, Default)]
pub struct LostGroups(VecDeque<Lost>);

impl LostGroups {
    /// Remembers a group just declared dead (its history counts the loss), and
    /// forgets what is old news.
    pub fn remember(&mut self, mut lost: Lost, now: Instant) {
        lost.history.losses.count(lost.cause);
        self.0.push_back(lost);
        self.forget(now);
    }

    /// Drops lost groups beyond `LOST_KEPT` or older than `LOST_KEPT_FOR`.
    pub fn forget(&mut self, now: Instant) {
        while self.0.len() > LOST_KEPT
            || self
                .0
                .front()
                .is_some_and(|l| now.saturating_duration_since(l.at) > LOST_KEPT_FOR)
        {
            self.0.pop_front();
        }
    }

    /// A replica id declared dead came back: its history, one return more (a new
    /// history if it was not lost, or lost too long ago).
    pub fn returned(&mut self, replica_id: &str) -> History {
        let Some(at) = self.0.iter().position(|l| l.replica_id == replica_id) else {
            return History::default();
        };
        let mut history = self.0.remove(at).map(|l| l.history).unwrap_or_default();
        history.returns += 1;
        history
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The groups lost within `LOST_KEPT_FOR` of `now`, most recent first.
    pub fn recent(&self, now: Instant) -> impl Iterator<Item = &Lost> {
        self.0
            .iter()
            .rev()
            .filter(move |l| now.saturating_duration_since(l.at) <= LOST_KEPT_FOR)
    }
}

/// The rollbacks the status page lists (every one is counted in `/metrics`).
pub const ROLLBACKS_KEPT: usize = 16;

/// A quorum that started a new lineage, because no group holding the job's newest
/// state could come back.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Rollback {
    pub quorum_id: QuorumId,
    /// The newest state, given up.
    pub from: Identity,
    /// Where the new lineage starts.
    pub to: Identity,
    /// Committed steps lost: `from.step - to.step` (0 when only the commit quorum of
    /// one step differs).
    pub steps_lost: u64,
    /// When it was issued (Unix time, ms).
    pub unix_ms: i64,
}

/// The job's rollbacks, oldest first (at most `ROLLBACKS_KEPT`).
#[derive(Debug, Default)]
pub struct Rollbacks(VecDeque<Rollback>);

impl Rollbacks {
    pub fn push(&mut self, rollback: Rollback) {
        if self.0.len() == ROLLBACKS_KEPT {
            self.0.pop_front();
        }
        self.0.push_back(rollback);
    }

    /// Oldest first.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &Rollback> {
        self.0.iter()
    }
}

/// A group's step rate is measured over about this long: long enough to span a few
/// samples of the deadline task (it looks about once per heartbeat timeout), short
/// enough to show a slowdown within a minute.
const STEP_RATE_WINDOW: Duration = Duration::from_secs(30);
/// Samples closer together than this add nothing to the rate but memory.
const STEP_SAMPLE_SPACING: Duration = Duration::from_secs(1);

/// The steps a group reported, sampled by the deadline task: beats bypass the lock, so
/// the state sees a group's progress only when it looks.
#[derive(Debug, Default)]
pub struct StepSamples(VecDeque<(Instant, i64)>);

impl StepSamples {
    /// `step` as reported by the beat at `at`; samples older than the window go.
    pub fn record(&mut self, at: Instant, step: i64, now: Instant) {
        if self
            .0
            .back()
            .is_some_and(|&(last, _)| at < last + STEP_SAMPLE_SPACING)
        {
            return;
        }
        self.0.push_back((at, step));
        while self
            .0
            .front()
            .is_some_and(|&(t, _)| now.saturating_duration_since(t) > STEP_RATE_WINDOW)
        {
            self.0.pop_front();
        }
    }

    #[cfg(test)]
    pub fn kept(&self) -> usize {
        self.0.len()
    }

    /// Steps per second from the oldest sample within the window to `latest`; none
    /// until a second of beats has been seen, or when the step went back.
    pub fn rate(&self, latest: (Instant, i64), now: Instant) -> Option<f64> {
        let &(from, first) = self
            .0
            .iter()
            .find(|&&(t, _)| now.saturating_duration_since(t) <= STEP_RATE_WINDOW)?;
        let (to, last) = latest;
        let span = to.checked_duration_since(from)?;
        (span >= STEP_SAMPLE_SPACING && last >= first)
            .then(|| (last - first) as f64 / span.as_secs_f64())
    }
}

/// Whether a group trains, as far as its steps tell: a member of the current quorum at
/// or above the quorum's max step. A heal, or a restarted group's first quorum, moves
/// its step by a jump that says nothing of its speed; its rate starts from there.
pub fn stepping(quorum: Option<&Quorum>, replica_id: &str, step: i64, max_step: i64) -> bool {
    quorum.is_some_and(|q| q.contains(replica_id)) && step >= max_step
}
