//! A replica group's steps, heals and refusals as the lighthouse counts them.
//!
//! A group's manager server reports totals since it started (on a heartbeat, when they
//! change); the lighthouse adds up what they grew by, so its per-group counters keep
//! growing across the group's restarts: a total below the last one is a restarted
//! group counting from zero again.

use std::collections::BTreeMap;

use crate::gate::RefusalCounts;
use crate::proto;

/// What a group did, added up over its lives while the lighthouse remembers it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Tally {
    pub steps_committed: u64,
    pub steps_failed: u64,
    /// Quorums in which it fetched the state it lacked from its peers.
    pub heals: u64,
    pub healed_bytes: u64,
    /// Requests and connections its manager server and state servers refused, for
    /// the reasons that happened.
    pub refused: BTreeMap<&'static str, u64>,
    /// The totals it reported last.
    #[serde(skip)]
    reported: (proto::GroupTally, RefusalCounts),
}

impl Tally {
    /// The group reported `totals`; returns whether it committed a step since.
    pub fn report(&mut self, totals: proto::GroupTally) -> bool {
        let was = self.reported.0;
        let committed = grown(totals.steps_committed, was.steps_committed);
        add(&mut self.steps_committed, committed);
        add(
            &mut self.steps_failed,
            grown(totals.steps_failed, was.steps_failed),
        );
        add(&mut self.heals, grown(totals.heals, was.heals));
        add(
            &mut self.healed_bytes,
            grown(totals.healed_bytes, was.healed_bytes),
        );
        self.reported.0 = totals;
        committed > 0
    }

    /// The group reported `counts`, its refusals so far by reason.
    pub fn report_refused(&mut self, counts: RefusalCounts) {
        for &(reason, count) in &counts {
            let was = self
                .reported
                .1
                .iter()
                .find(|(r, _)| *r == reason)
                .map_or(0, |(_, n)| *n);
            let grown = grown(count, was);
            if grown > 0 {
                add(self.refused.entry(reason.as_str()).or_default(), grown);
            }
        }
        self.reported.1 = counts;
    }
}

/// What a total grew by since `was`; all of it when it went down (a restart).
fn grown(total: u64, was: u64) -> u64 {
    if total >= was {
        total - was
    } else {
        total
    }
}

/// A garbled report of a huge total pins a counter, never wraps it.
fn add(counter: &mut u64, by: u64) {
    *counter = counter.saturating_add(by);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gate::Refusal;

    fn totals(committed: u64, failed: u64, heals: u64, bytes: u64) -> proto::GroupTally {
        proto::GroupTally {
            steps_committed: committed,
            steps_failed: failed,
            heals,
            healed_bytes: bytes,
        }
    }

    #[test]
    fn totals_grow_the_counters_by_their_difference_and_a_restart_counts_from_zero() {
        let mut t = Tally::default();
        assert!(t.report(totals(5, 1, 0, 0)));
        assert!(!t.report(totals(5, 2, 0, 0)), "no new commit");
        assert!(t.report(totals(9, 2, 0, 0)));
        // Restarted: its totals start again, and it healed once.
        assert!(!t.report(totals(0, 0, 0, 0)));
        assert!(t.report(totals(3, 0, 1, 4096)));
        assert_eq!(
            (t.steps_committed, t.steps_failed, t.heals, t.healed_bytes),
            (12, 2, 1, 4096)
        );
    }

    #[test]
    fn a_huge_total_pins_the_counter() {
        let mut t = Tally::default();
        t.report(totals(u64::MAX, 0, 0, 0));
        t.report(totals(1, 0, 0, 0));
        t.report(totals(u64::MAX, 0, 0, 0));
        assert_eq!(t.steps_committed, u64::MAX);
    }

    #[test]
    fn refusals_are_counted_by_reason_across_restarts() {
        let mut t = Tally::default();
        t.report_refused(vec![(Refusal::Token, 3)]);
        t.report_refused(vec![(Refusal::Token, 5), (Refusal::Crowded, 1)]);
        t.report_refused(vec![(Refusal::Token, 2), (Refusal::Full, 0)]);
        assert_eq!(t.refused[Refusal::Token.as_str()], 7);
        assert_eq!(t.refused[Refusal::Crowded.as_str()], 1);
        assert!(
            !t.refused.contains_key(Refusal::Full.as_str()),
            "none so far"
        );
    }
}
