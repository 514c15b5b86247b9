//! The lighthouse as the status page, `/status`, `/metrics` and the `Status` RPC show
//! it: plain records that `LighthouseState::snapshot` fills in, and the rule the page
//! applies to them (who is a straggler).
//!
//! Pure: ages are taken against a `now` passed in.

use std::time::{Duration, Instant};

use super::history::{Eviction, History, Lost, Rollback};
use crate::quorum::{Identity, QuorumId, ReplicaId};

/// The lighthouse as the status page, `/status` and the `Status` RPC show it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Snapshot {
    pub quorum_id: QuorumId,
    pub quorum_members: Vec<ReplicaId>,
    /// The highest step among the current quorum's members when it was issued.
    pub max_step: i64,
    /// Live groups, by replica id.
    pub replicas: Vec<ReplicaSnapshot>,
    /// Groups declared dead recently, most recent first.
    pub lost: Vec<LostSnapshot>,
    /// Why the next quorum is not issued yet; empty when nobody is waiting.
    pub waiting_for: String,
    pub quorums_issued: u64,
    pub min_replicas: u32,
    pub join_timeout_ms: u64,
    pub heartbeat_timeout_ms: u64,
    /// How long, and how many, lost groups are kept.
    pub lost_kept_for_ms: u64,
    pub lost_kept: u32,
    /// Since some group last committed a step (or since the lighthouse started).
    pub last_commit_age_ms: u64,
    /// The job's newest committed state, as far as this lighthouse knows.
    pub newest: Option<Identity>,
    /// The job's rollbacks (new lineages), most recent first.
    pub rollbacks: Vec<Rollback>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct ReplicaSnapshot {
    pub replica_id: ReplicaId,
    pub connected: bool,
    /// Asking for a quorum now.
    pub joined: bool,
    pub in_quorum: bool,
    pub step: i64,
    /// A member of the current quorum still below its max step: catching up.
    pub healing: bool,
    /// Steps per second over the last half minute or so, while it is a member of the
    /// quorum and not healing; none until measured.
    pub step_rate: Option<f64>,
    pub heartbeat_age_ms: u64,
    /// Since it last committed a step (or since it appeared).
    pub last_commit_age_ms: u64,
    /// How long it has made no training progress (a wait on the other groups within
    /// its deadline counts as progress); none when it does not report it.
    pub progress_age_ms: Option<u64>,
    /// Its slowest rank's own work in its last step, waits on the others left out.
    pub step_time_ms: Option<u64>,
    /// A member far slower than the other members (see `straggler`).
    pub straggler: bool,
    pub peer: String,
    #[serde(flatten)]
    pub history: History,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct LostSnapshot {
    pub replica_id: ReplicaId,
    pub cause: Eviction,
    pub lost_ms_ago: u64,
    /// The last step it reported.
    pub step: i64,
    /// It was a member of the quorum current when it died.
    pub was_member: bool,
    pub peer: String,
    #[serde(flatten)]
    pub history: History,
}

impl LostSnapshot {
    /// `lost` as the page shows it at `now`.
    pub fn of(lost: &Lost, now: Instant) -> Self {
        LostSnapshot {
            replica_id: lost.replica_id.clone(),
            cause: lost.cause,
            lost_ms_ago: ms_since(lost.at, now),
            step: lost.step,
            was_member: lost.was_member,
            peer: lost.peer.clone(),
            history: lost.history.clone(),
        }
    }
}

pub fn ms_since(then: Instant, now: Instant) -> u64 {
    now.saturating_duration_since(then).as_millis() as u64
}

/// Marks the members of the quorum far slower than the others (see `straggler`),
/// among those that measured their step time.
pub fn mark_stragglers(replicas: &mut [ReplicaSnapshot]) {
    let members: Vec<(usize, Duration)> = replicas
        .iter()
        .enumerate()
        .filter(|(_, r)| r.in_quorum)
        .filter_map(|(i, r)| Some((i, Duration::from_millis(r.step_time_ms?))))
        .collect();
    let times: Vec<Duration> = members.iter().map(|(_, t)| *t).collect();
    for (k, (i, _)) in members.iter().enumerate() {
        replicas[*i].straggler = straggler(&times, k);
    }
}

/// Whether member `k` of a quorum, whose own work per step takes `times[k]`, is far
/// slower than the others: at least twice their median and 100 ms more. In a
/// synchronous job every group's wall time per step is the slowest one's, so only the
/// time a group spends on its own work, waits on the others left out, tells who
/// holds the others up.
pub fn straggler(times: &[Duration], k: usize) -> bool {
    let mut others: Vec<Duration> = times
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != k)
        .map(|(_, t)| *t)
        .collect();
    if others.is_empty() {
        return false;
    }
    others.sort();
    let median = others[others.len() / 2];
    times[k] >= median * 2 && times[k] >= median + Duration::from_millis(100)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_straggler_is_at_least_twice_the_others_median_and_100_ms_more() {
        let d = Duration::from_millis;
        assert!(straggler(&[d(200), d(210), d(900)], 2));
        assert!(!straggler(&[d(200), d(210), d(900)], 0));
        assert!(
            !straggler(&[d(20), d(21), d(60)], 2),
            "fast steps need 100 ms more"
        );
        assert!(!straggler(&[d(900)], 0), "alone, nobody is slower");
    }
}
