//! The quorum engine: which replica groups take part in the next step.
//!
//! Pure logic: no sockets, no clock reads. The lighthouse hands it who has asked
//! to join, who is alive, the previous quorum and the current time, and gets back
//! either a quorum to issue or the instant to look again and why.
//!
//! The rules, in the order they are applied:
//! - only live replicas that asked to join can be members (a dead one never is);
//! - at least `min_replicas` members, and more than half of the replicas that
//!   matter — the live members of the previous quorum plus those asking now — must
//!   have joined, so that two halves of a partitioned job never both go on;
//! - fast path: once every live member of the previous quorum has rejoined, issue at
//!   once. Dead members never hold a quorum back, and a live newcomer that has not
//!   asked yet (a restarted group still importing torch) joins at the next round;
//! - otherwise (the job's first quorum, or a live previous member is late) wait up
//!   to `join_timeout` after the first request of the round;
//! - a late member counts toward the majority for `LATE_MEMBER_JOIN_TIMEOUTS` join
//!   timeouts after the previous quorum was issued (10 s by default), then no longer:
//!   a group that lives but never asks again cannot stop the job;
//! - the quorum id moves up whenever the membership changes or a member reports
//!   commit failures, and is never reused: it starts above every id any caller
//!   has seen, which is what lets a restarted lighthouse carry on (invariant I3).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::{Duration, Instant};

/// A replica group's name, unique among the live groups of a job.
pub type ReplicaId = String;

/// Numbers quorums; strictly increases whenever the membership changes.
pub type QuorumId = u64;

/// A replica group as it asks to join a quorum.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Member {
    pub replica_id: ReplicaId,
    pub manager_address: String,
    pub store_address: String,
    pub step: i64,
    pub world_size: u32,
    pub shrink_only: bool,
    pub commit_failures: u32,
    pub state_addresses: Vec<String>,
    /// With `step`, which state the group holds: the quorum that committed its step.
    pub state_quorum_id: QuorumId,
    /// A heal failed part way; the state is unusable until a heal succeeds.
    pub torn: bool,
}

/// The groups that take part in the steps until the next quorum.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quorum {
    pub id: QuorumId,
    /// Ordered by replica id, so every member derives the same replica ranks.
    pub members: Vec<Member>,
}

impl Quorum {
    pub fn contains(&self, replica_id: &str) -> bool {
        self.members
            .binary_search_by(|m| m.replica_id.as_str().cmp(replica_id))
            .is_ok()
    }

    pub fn replica_ids(&self) -> impl Iterator<Item = &str> {
        self.members.iter().map(|m| m.replica_id.as_str())
    }
}

/// A pending request to join the next quorum.
#[derive(Clone, Debug)]
pub struct Joiner {
    pub member: Member,
    /// The highest quorum id this group has seen.
    pub last_quorum_id: QuorumId,
    pub joined_at: Instant,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuorumConfig {
    pub min_replicas: usize,
    pub join_timeout: Duration,
}

/// Which replicas are alive right now, as the lighthouse's liveness tracking sees it.
pub trait LiveSet {
    fn is_live(&self, replica_id: &str) -> bool;
    /// Every live replica, in any order.
    fn live_ids(&self) -> Box<dyn Iterator<Item = &str> + '_>;
}

impl LiveSet for BTreeSet<ReplicaId> {
    fn is_live(&self, replica_id: &str) -> bool {
        self.contains(replica_id)
    }
    fn live_ids(&self) -> Box<dyn Iterator<Item = &str> + '_> {
        Box::new(self.iter().map(String::as_str))
    }
}

/// Everything one evaluation looks at.
pub struct Round<'a> {
    pub joiners: &'a BTreeMap<ReplicaId, Joiner>,
    pub live: &'a dyn LiveSet,
    pub previous: Option<&'a Quorum>,
    /// When `previous` was issued: its live members that have not asked again since
    /// count toward the majority for a bounded time from then.
    pub previous_at: Option<Instant>,
    /// The highest quorum id heard from anyone (requests and heartbeats).
    pub highest_seen_id: QuorumId,
    pub config: &'a QuorumConfig,
    pub now: Instant,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    Issue(Quorum),
    /// Evaluate again at `until` (or at the next join, leave or death when `None`).
    Wait {
        until: Option<Instant>,
        reason: WaitReason,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WaitReason {
    NoJoiners,
    TooFewReplicas {
        joined: usize,
        min_replicas: usize,
    },
    NoMajority {
        joined: usize,
        relevant: usize,
    },
    /// The job's first quorum: live replicas that have not asked yet.
    GatheringFirstQuorum {
        missing: Missing,
    },
    /// The lighthouse restarted: giving every group the join timeout to re-connect.
    RejoiningAfterRestart {
        missing: Missing,
    },
    /// Live members of the previous quorum that have not rejoined yet.
    LateMembers {
        missing: Missing,
    },
}

/// The replicas a round is waiting for: how many, and the first few by name (a
/// round can wait for thousands; naming them all would cost more than deciding).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Missing {
    pub count: usize,
    /// The smallest replica ids among them, in order.
    pub first: Vec<ReplicaId>,
}

impl Missing {
    const NAMED: usize = 8;

    fn of<'a>(ids: impl Iterator<Item = &'a str>) -> Missing {
        let mut missing = Missing::default();
        for id in ids {
            missing.count += 1;
            if missing.first.len() == Self::NAMED
                && missing.first.last().is_some_and(|last| last.as_str() <= id)
            {
                continue;
            }
            let at = missing.first.partition_point(|f| f.as_str() < id);
            missing.first.insert(at, id.to_string());
            missing.first.truncate(Self::NAMED);
        }
        missing
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
}

impl fmt::Display for Missing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.first.join(", "))?;
        if self.count > self.first.len() {
            write!(f, " and {} more", self.count - self.first.len())?;
        }
        Ok(())
    }
}

impl fmt::Display for WaitReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WaitReason::NoJoiners => write!(f, "no replica group has asked for a quorum"),
            WaitReason::TooFewReplicas {
                joined,
                min_replicas,
            } => write!(
                f,
                "{joined} replica group(s) joined, at least {min_replicas} needed (--min-replicas)"
            ),
            WaitReason::NoMajority { joined, relevant } => write!(
                f,
                "{joined} of {relevant} live replica groups joined; more than half must join so a \
                 partitioned job cannot split in two"
            ),
            WaitReason::GatheringFirstQuorum { missing } => write!(
                f,
                "first quorum: waiting up to the join timeout for live groups that have not asked yet: {missing}"
            ),
            WaitReason::RejoiningAfterRestart { missing } if missing.is_empty() => write!(
                f,
                "the lighthouse restarted: waiting out the join timeout for groups re-connecting"
            ),
            WaitReason::RejoiningAfterRestart { missing } => write!(
                f,
                "the lighthouse restarted: waiting out the join timeout for groups re-connecting; \
                 live but not asking yet: {missing}"
            ),
            WaitReason::LateMembers { missing } => write!(
                f,
                "waiting up to the join timeout for live members of the previous quorum: {missing}"
            ),
        }
    }
}

/// How long, in join timeouts from the issue of the previous quorum, a live member of
/// it that has not asked again still counts toward the majority.
pub const LATE_MEMBER_JOIN_TIMEOUTS: u32 = 10;

/// Decides the next quorum. See the module documentation for the rules.
pub fn decide(round: &Round<'_>) -> Decision {
    let Round {
        joiners,
        live,
        previous,
        previous_at,
        highest_seen_id,
        config,
        now,
    } = *round;

    let joined: Vec<&Joiner> = joiners
        .values()
        .filter(|j| live.is_live(&j.member.replica_id))
        .collect();
    let Some(first_join) = joined.iter().map(|j| j.joined_at).min() else {
        return Decision::Wait {
            until: None,
            reason: WaitReason::NoJoiners,
        };
    };
    let shrink_only = joined.iter().any(|j| j.member.shrink_only);
    let members: Vec<&Joiner> = match previous {
        Some(prev) if shrink_only => joined
            .iter()
            .copied()
            .filter(|j| prev.contains(&j.member.replica_id))
            .collect(),
        _ => joined.clone(),
    };

    // Live members of the previous quorum that have not asked yet. Both lists are in
    // replica-id order, so one merged walk finds them (this runs on every request).
    let mut late: Vec<&str> = Vec::new();
    if let Some(prev) = previous {
        let mut asking = joiners.keys().peekable();
        for id in prev.replica_ids() {
            while asking.next_if(|j| j.as_str() < id).is_some() {}
            let asked = asking.peek().is_some_and(|j| j.as_str() == id);
            if !asked && live.is_live(id) {
                late.push(id);
            }
        }
    }
    // A late member counts toward the majority for a bounded time only: one that never
    // asks again (wedged, or dead without anyone noticing) must not stop the job. The
    // time counts from the previous quorum, not from this round: the others' requests
    // time out and come again, and each would start the clock anew.
    let late_expiry =
        previous_at.unwrap_or(first_join) + LATE_MEMBER_JOIN_TIMEOUTS * config.join_timeout;
    let counted_late = if now < late_expiry { late.len() } else { 0 };
    let relevant = counted_late + joined.len();

    let blocker = if members.len() < config.min_replicas {
        Some(WaitReason::TooFewReplicas {
            joined: members.len(),
            min_replicas: config.min_replicas,
        })
    } else if 2 * members.len() <= relevant {
        Some(WaitReason::NoMajority {
            joined: members.len(),
            relevant,
        })
    } else {
        None
    };

    let missing = match previous {
        Some(_) => Missing::of(late.into_iter()),
        None => Missing::of(live.live_ids().filter(|id| !joiners.contains_key(*id))),
    };
    let deadline = first_join + config.join_timeout;
    // A fresh lighthouse that hears of earlier quorums was restarted: the other groups
    // are re-connecting right now, so its first quorum waits the whole join timeout
    // rather than let the quickest group go on alone.
    let restarted =
        previous.is_none() && (highest_seen_id > 0 || joined.iter().any(|j| j.last_quorum_id > 0));
    if restarted && now < deadline {
        return Decision::Wait {
            until: Some(deadline),
            reason: WaitReason::RejoiningAfterRestart { missing },
        };
    }
    if !missing.is_empty() && now < deadline {
        let reason = match previous {
            Some(_) => WaitReason::LateMembers { missing },
            None => WaitReason::GatheringFirstQuorum { missing },
        };
        return Decision::Wait {
            until: Some(deadline),
            reason,
        };
    }
    if let Some(reason) = blocker {
        let until = match &reason {
            WaitReason::NoMajority { .. } if counted_late > 0 => Some(late_expiry),
            _ => None,
        };
        return Decision::Wait { until, reason };
    }

    let members: Vec<Member> = members.iter().map(|j| j.member.clone()).collect();
    let id = next_id(&members, joiners, previous, highest_seen_id);
    Decision::Issue(Quorum { id, members })
}

/// Keeps the previous id for an unchanged, healthy membership; otherwise moves above
/// every id anyone has seen, the ids reported by joiners since declared dead included.
fn next_id(
    members: &[Member],
    joiners: &BTreeMap<ReplicaId, Joiner>,
    previous: Option<&Quorum>,
    highest_seen_id: QuorumId,
) -> QuorumId {
    let highest = joiners
        .values()
        .map(|j| j.last_quorum_id)
        .chain(previous.map(|p| p.id))
        .fold(highest_seen_id, QuorumId::max);
    let unchanged = previous.is_some_and(|p| {
        p.id == highest
            && p.members.len() == members.len()
            && p.replica_ids()
                .eq(members.iter().map(|m| m.replica_id.as_str()))
    });
    let failures = members.iter().any(|m| m.commit_failures > 0);
    if unchanged && !failures {
        highest
    } else {
        // Callers refuse ids near the top (validate::MAX_QUORUM_ID); saturating keeps
        // an unchecked caller from wrapping to 0 all the same.
        highest.saturating_add(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_wait_list_names_the_first_few_in_order_and_counts_the_rest() {
        let ids: Vec<String> = (0..20).rev().map(|i| format!("g{i:02}")).collect();
        let missing = Missing::of(ids.iter().map(String::as_str));
        assert_eq!(missing.count, 20);
        assert_eq!(
            missing.to_string(),
            "g00, g01, g02, g03, g04, g05, g06, g07 and 12 more"
        );
    }

    fn member(id: &str) -> Member {
        Member {
            replica_id: id.to_string(),
            world_size: 1,
            ..Member::default()
        }
    }

    struct Scene {
        t0: Instant,
        joiners: BTreeMap<ReplicaId, Joiner>,
        live: BTreeSet<ReplicaId>,
        previous: Option<Quorum>,
        previous_at: Option<Instant>,
        config: QuorumConfig,
    }

    impl Scene {
        fn new(live: &[&str]) -> Self {
            Scene {
                t0: Instant::now(),
                joiners: BTreeMap::new(),
                live: live.iter().map(|s| s.to_string()).collect(),
                previous: None,
                previous_at: None,
                config: QuorumConfig {
                    min_replicas: 1,
                    join_timeout: Duration::from_secs(1),
                },
            }
        }

        fn join_at(&mut self, id: &str, ms: u64) {
            self.join_member(member(id), ms);
        }

        fn join_member(&mut self, m: Member, ms: u64) {
            self.live.insert(m.replica_id.clone());
            self.joiners.insert(
                m.replica_id.clone(),
                Joiner {
                    member: m,
                    last_quorum_id: self.previous.as_ref().map_or(0, |p| p.id),
                    joined_at: self.t0 + Duration::from_millis(ms),
                },
            );
        }

        fn decide_at(&self, ms: u64) -> Decision {
            decide(&Round {
                joiners: &self.joiners,
                live: &self.live,
                previous: self.previous.as_ref(),
                previous_at: self.previous_at,
                highest_seen_id: 0,
                config: &self.config,
                now: self.t0 + Duration::from_millis(ms),
            })
        }

        /// Issues at `ms` (panicking otherwise) and starts the next round.
        fn issue_at(&mut self, ms: u64) -> Quorum {
            match self.decide_at(ms) {
                Decision::Issue(q) => {
                    self.previous = Some(q.clone());
                    self.previous_at = Some(self.t0 + Duration::from_millis(ms));
                    self.joiners.clear();
                    q
                }
                wait => panic!("expected a quorum, got {wait:?}"),
            }
        }
    }

    fn ids(q: &Quorum) -> Vec<&str> {
        q.replica_ids().collect()
    }

    #[test]
    fn first_quorum_waits_for_every_live_group_then_issues_at_once() {
        let mut s = Scene::new(&["a", "b", "c"]);
        s.join_at("b", 0);
        s.join_at("a", 5);
        assert_eq!(
            s.decide_at(10),
            Decision::Wait {
                until: Some(s.t0 + Duration::from_secs(1)),
                reason: WaitReason::GatheringFirstQuorum {
                    missing: Missing::of(["c"].into_iter())
                },
            }
        );
        s.join_at("c", 20);
        let q = s.issue_at(20);
        assert_eq!(ids(&q), ["a", "b", "c"]);
        assert_eq!(q.id, 1);
    }

    #[test]
    fn first_quorum_goes_ahead_without_a_silent_group_after_the_join_timeout() {
        let mut s = Scene::new(&["a", "b", "c"]);
        s.join_at("a", 0);
        s.join_at("b", 0);
        let q = s.issue_at(1000);
        assert_eq!(ids(&q), ["a", "b"]);
    }

    #[test]
    fn unchanged_membership_keeps_its_id_and_issues_without_waiting() {
        let mut s = Scene::new(&["a", "b"]);
        s.join_at("a", 0);
        s.join_at("b", 0);
        let first = s.issue_at(0);
        s.join_at("a", 100);
        s.join_at("b", 101);
        let second = s.issue_at(101);
        assert_eq!(second.id, first.id);
    }

    #[test]
    fn a_dead_member_never_holds_the_quorum_back() {
        let mut s = Scene::new(&["a", "b", "c"]);
        for id in ["a", "b", "c"] {
            s.join_at(id, 0);
        }
        let first = s.issue_at(0);
        s.live.remove("c");
        s.join_at("a", 100);
        s.join_at("b", 100);
        let second = s.issue_at(100);
        assert_eq!(ids(&second), ["a", "b"]);
        assert!(second.id > first.id);
    }

    #[test]
    fn a_late_live_member_is_waited_for_up_to_the_join_timeout() {
        let mut s = Scene::new(&["a", "b", "c"]);
        for id in ["a", "b", "c"] {
            s.join_at(id, 0);
        }
        s.issue_at(0);
        s.join_at("a", 100);
        s.join_at("b", 150);
        assert_eq!(
            s.decide_at(200),
            Decision::Wait {
                until: Some(s.t0 + Duration::from_millis(1100)),
                reason: WaitReason::LateMembers {
                    missing: Missing::of(["c"].into_iter())
                },
            }
        );
        assert_eq!(ids(&s.issue_at(1100)), ["a", "b"]);
    }

    #[test]
    fn a_newcomer_that_has_not_asked_does_not_stall_the_others() {
        let mut s = Scene::new(&["a", "b"]);
        s.join_at("a", 0);
        s.join_at("b", 0);
        s.issue_at(0);
        s.live.insert("c".into()); // heartbeating, still starting up
        s.join_at("a", 100);
        s.join_at("b", 100);
        assert_eq!(ids(&s.issue_at(100)), ["a", "b"]);
    }

    #[test]
    fn a_newcomer_that_asks_joins_on_the_fast_path() {
        let mut s = Scene::new(&["a", "b"]);
        s.join_at("a", 0);
        s.join_at("b", 0);
        let first = s.issue_at(0);
        s.join_at("c", 50);
        s.join_at("a", 100);
        s.join_at("b", 100);
        let second = s.issue_at(100);
        assert_eq!(ids(&second), ["a", "b", "c"]);
        assert_eq!(second.id, first.id + 1);
    }

    #[test]
    fn shrink_only_keeps_newcomers_out() {
        let mut s = Scene::new(&["a", "b"]);
        s.join_at("a", 0);
        s.join_at("b", 0);
        s.issue_at(0);
        s.join_at("c", 50);
        s.join_member(
            Member {
                shrink_only: true,
                ..member("a")
            },
            100,
        );
        s.join_at("b", 100);
        assert_eq!(ids(&s.issue_at(100)), ["a", "b"]);
    }

    #[test]
    fn a_minority_waits_for_live_late_members_for_a_bounded_time_only() {
        let mut s = Scene::new(&["a", "b", "c"]);
        for id in ["a", "b", "c"] {
            s.join_at(id, 0);
        }
        s.issue_at(0);
        s.join_at("a", 100);
        // b and c live but do not ask: they still count toward the majority...
        let expiry = u64::from(LATE_MEMBER_JOIN_TIMEOUTS) * 1000;
        assert_eq!(
            s.decide_at(5000),
            Decision::Wait {
                until: Some(s.t0 + Duration::from_millis(expiry)),
                reason: WaitReason::NoMajority {
                    joined: 1,
                    relevant: 3
                },
            }
        );
        // ...until LATE_MEMBER_JOIN_TIMEOUTS join timeouts after the previous quorum,
        // however often a's own request times out and comes again: a group that never
        // asks again (wedged) cannot stop the job.
        // (Its last request still gives them the join timeout to come, as ever.)
        s.joiners.clear();
        s.join_at("a", expiry - 500);
        assert!(matches!(s.decide_at(expiry - 1), Decision::Wait { .. }));
        assert_eq!(ids(&s.issue_at(expiry + 500)), ["a"]);
    }

    #[test]
    fn min_replicas_holds_the_quorum_until_enough_groups_join() {
        let mut s = Scene::new(&["a"]);
        s.config.min_replicas = 2;
        s.join_at("a", 0);
        assert_eq!(
            s.decide_at(5000),
            Decision::Wait {
                until: None,
                reason: WaitReason::TooFewReplicas {
                    joined: 1,
                    min_replicas: 2
                },
            }
        );
    }

    #[test]
    fn commit_failures_force_a_new_id() {
        let mut s = Scene::new(&["a", "b"]);
        s.join_at("a", 0);
        s.join_at("b", 0);
        let first = s.issue_at(0);
        s.join_member(
            Member {
                commit_failures: 1,
                ..member("a")
            },
            100,
        );
        s.join_at("b", 100);
        assert_eq!(s.issue_at(100).id, first.id + 1);
    }

    #[test]
    fn a_restarted_lighthouse_numbers_above_the_ids_its_callers_report() {
        let mut s = Scene::new(&["a", "b"]);
        s.join_at("a", 0);
        s.join_at("b", 0);
        s.joiners.get_mut("b").unwrap().last_quorum_id = 41;
        assert_eq!(s.issue_at(1000).id, 42);
    }

    #[test]
    fn a_restarted_lighthouse_waits_the_join_timeout_before_its_first_quorum() {
        let mut s = Scene::new(&["a"]);
        s.join_at("a", 0);
        s.joiners.get_mut("a").unwrap().last_quorum_id = 7;
        assert_eq!(
            s.decide_at(10),
            Decision::Wait {
                until: Some(s.t0 + Duration::from_secs(1)),
                reason: WaitReason::RejoiningAfterRestart {
                    missing: Missing::default()
                },
            }
        );
        s.join_at("b", 500);
        assert_eq!(ids(&s.issue_at(1000)), ["a", "b"]);
    }
}
