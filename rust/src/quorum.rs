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
//! - past it, a late member still *on its way* holds the round: its beats say it
//!   made progress within the join timeout, at least [`PROGRESS_FRESH`] (it is
//!   computing or healing, not hung), and the round is younger than twice the time
//!   the quickest member that asked again took for the step (see [`straggler_at`]).
//!   Waiting for it costs less than healing it: a member left out is behind at the
//!   next round, heals there, and misses the round after while it heals, so a job of
//!   many groups would split into cohorts that leapfrog, each averaging few groups'
//!   gradients. A hung member stops progressing and a straggler runs past the bound,
//!   and both are left out. After a member that asks failed the previous quorum's
//!   step there is no straggler bound: a late member may have committed the step the
//!   asker failed, and a quorum without it would commit that step again with other
//!   data; it is waited for while it progresses, and the asker heals from it (a new
//!   life of the group, restarted, holds no step and is not);
//! - a late member counts toward the majority for `LATE_MEMBER_JOIN_TIMEOUTS` join
//!   timeouts after the previous quorum was issued (10 s by default), then no longer:
//!   a group that lives but never asks again cannot stop the job;
//! - the members can reach each other: of two groups where one reports that it could
//!   not reach the other (a cut between their hosts, while both reach the
//!   lighthouse), one is left out of the round (see [`connected`]);
//! - the quorum id moves up whenever the membership changes or a member reports
//!   commit failures, and is never reused: it starts above every id any caller
//!   has seen, which is what lets a restarted lighthouse carry on (invariant I3);
//! - never back (invariant I11): a quorum whose newest member is older than the job's
//!   newest committed state waits while a group holding that state may come back (the
//!   lighthouse says until when, see [`Newest`]); after that it starts a new lineage
//!   from the best state its members hold, numbered by its own quorum id, so that no
//!   step number of a lineage ever names two states;
//! - a state restored from a snapshot is a new lineage's start when no live group holds
//!   one as new: the job may have committed steps after it that no group reported
//!   before every group was lost (a commit reaches the lighthouse only with the next
//!   request), and a step redone must not be taken for the one lost.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::{Duration, Instant};

/// A replica group's name, unique among the live groups of a job.
pub type ReplicaId = String;

/// Numbers quorums; strictly increases whenever the membership changes.
pub type QuorumId = u64;

/// Which state a group holds. Ordered lineage first, then step, then commit quorum,
/// so that the job's state is the greatest: a later lineage supersedes every state
/// of an earlier one, and of two states at one step the one committed later is the
/// job's (a group that committed it earlier was dropped and its peers went on).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub struct Identity {
    /// 0: the job's first lineage; else the id of the quorum that started it.
    pub lineage: u64,
    pub step: i64,
    /// The quorum that committed `step` (0 before the first commit).
    pub state_quorum_id: QuorumId,
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "step {} (committed in quorum {}, lineage {})",
            self.step, self.state_quorum_id, self.lineage
        )
    }
}

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
    /// With `step` and `state_quorum_id`, which state the group holds.
    pub lineage: u64,
    /// Groups this one could not reach in its last quorum (see `connected`).
    pub unreachable: Vec<ReplicaId>,
    /// The state was restored from a snapshot (see `decide`).
    pub resumed: bool,
}

impl Member {
    pub fn identity(&self) -> Identity {
        Identity {
            lineage: self.lineage,
            step: self.step,
            state_quorum_id: self.state_quorum_id,
        }
    }
}

/// The groups that take part in the steps until the next quorum.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quorum {
    pub id: QuorumId,
    /// Ordered by replica id, so every member derives the same replica ranks.
    pub members: Vec<Member>,
    /// The lineage its steps are committed in.
    pub lineage: u64,
    /// Set when it starts a new lineage: the newest state, which the job gives up.
    pub rolled_back_from: Option<Identity>,
    /// Groups that asked but were left out because a member cannot reach them, each
    /// with the one that says so.
    pub left_out: Vec<(ReplicaId, ReplicaId)>,
}

impl Quorum {
    pub fn contains(&self, replica_id: &str) -> bool {
        self.members
            .binary_search_by(|m| m.replica_id.as_str().cmp(replica_id))
            .is_ok()
    }

    pub fn member(&self, replica_id: &str) -> Option<&Member> {
        self.members
            .binary_search_by(|m| m.replica_id.as_str().cmp(replica_id))
            .ok()
            .map(|i| &self.members[i])
    }

    pub fn replica_ids(&self) -> impl Iterator<Item = &str> {
        self.members.iter().map(|m| m.replica_id.as_str())
    }

    /// Membership asked of many ids in replica-id order (another quorum's members, the
    /// joiners' keys): a cursor moves along the members once, where a search for each
    /// id would compare a dozen of them beside thousands of groups.
    pub fn in_order(&self) -> InOrder<'_> {
        InOrder {
            members: &self.members,
        }
    }
}

/// See `Quorum::in_order`.
pub struct InOrder<'a> {
    /// The members not passed yet.
    members: &'a [Member],
}

impl InOrder<'_> {
    /// Whether `replica_id` is a member; each id asked must come after the one before
    /// it in replica-id order (an id out of order reads as no member).
    pub fn contains(&mut self, replica_id: &str) -> bool {
        let passed = self
            .members
            .iter()
            .take_while(|m| m.replica_id.as_str() < replica_id)
            .count();
        self.members = &self.members[passed..];
        self.members
            .first()
            .is_some_and(|m| m.replica_id == replica_id)
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

/// The job's newest committed state, and until when a group holding it may still
/// come back (None: every group that held it is gone for good, so waiting is useless).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Newest {
    pub state: Identity,
    pub may_return_until: Option<Instant>,
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
    /// When the group last made progress in its training, as its beats report it;
    /// None when it does not report it.
    fn progressed_at(&self, _replica_id: &str) -> Option<Instant> {
        None
    }
    /// The manager address the live group beats from, which names its life (a
    /// restarted group serves on new ports); None when unknown.
    fn manager_address(&self, _replica_id: &str) -> Option<&str> {
        None
    }
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
    /// The job's newest committed state, if the lighthouse knows of one.
    pub newest: Option<Newest>,
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
    /// Past the join timeout: late members of the previous quorum that still make
    /// progress (computing or healing their step), until `straggler_at`.
    MembersOnTheirWay {
        missing: Missing,
    },
    /// No group asking holds the job's newest state, and one that held it may come back.
    NewestStateAway {
        newest: Identity,
        /// The best state a group asking holds (None: every one is torn).
        best: Option<Identity>,
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
            WaitReason::MembersOnTheirWay { missing } => write!(
                f,
                "past the join timeout, waiting for members of the previous quorum that are \
                 still computing their step (they make progress; one that stops, or takes \
                 twice as long as the quickest, is left out): {missing}"
            ),
            WaitReason::NewestStateAway { newest, best } => {
                write!(
                    f,
                    "the job's newest state, {newest}, is held by no group asking; waiting up \
                     to --rollback-after for a group that held it to come back, else the job \
                     goes back to "
                )?;
                match best {
                    Some(best) => write!(f, "{best}"),
                    None => write!(f, "a fresh start (every group asking is torn)"),
                }
            }
        }
    }
}

/// How long, in join timeouts from the issue of the previous quorum, a live member of
/// it that has not asked again still counts toward the majority.
pub const LATE_MEMBER_JOIN_TIMEOUTS: u32 = 10;

/// How old a group's last progress may be for it to count as at work, whatever the
/// join timeout: the lighthouse hears of progress on the group's beats (every 100 ms
/// by default), and its ranks' reporters look at their training threads a few times
/// a second, so a group computing its step reports progress some hundreds of
/// milliseconds old.
pub const PROGRESS_FRESH: Duration = Duration::from_secs(1);

/// Until when a round waits for late members of the previous quorum (issued at
/// `issued`) that are on their way, given when the first of its members asked again
/// (`first_rejoin`): as long again as that quickest member took for its step, at
/// least the join timeout. A member that needs more than twice the quickest one's
/// time is a straggler; it is left out and heals, rather than make every group wait
/// for it at every step. Groups that were not members (they wait since the last
/// round: they asked too late for it) say nothing of the step's time, and set no
/// bound. While no member asked again, the bound is the one on late members
/// (`LATE_MEMBER_JOIN_TIMEOUTS`).
///
/// ```
/// # use std::time::{Duration, Instant};
/// # use phalanx::quorum::straggler_at;
/// let issued = Instant::now();
/// let second = Duration::from_secs(1);
/// // The quickest member's step took 3 s: the others are waited for 3 s more.
/// let asked = issued + 3 * second;
/// assert_eq!(straggler_at(Some(asked), issued, second), asked + 3 * second);
/// // A quick step: the join timeout.
/// assert_eq!(straggler_at(Some(issued), issued, second), issued + second);
/// assert_eq!(straggler_at(None, issued, second), issued + 10 * second);
/// ```
pub fn straggler_at(
    first_rejoin: Option<Instant>,
    issued: Instant,
    join_timeout: Duration,
) -> Instant {
    match first_rejoin {
        Some(first) => first + join_timeout.max(first.saturating_duration_since(issued)),
        None => issued + LATE_MEMBER_JOIN_TIMEOUTS * join_timeout,
    }
}

/// Decides the next quorum. See the module documentation for the rules.
pub fn decide(round: &Round<'_>) -> Decision {
    let Round {
        joiners,
        live,
        previous,
        previous_at,
        highest_seen_id,
        newest,
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
    let (members, left_out) = connected(members);

    // Live members of the previous quorum that have not asked yet. Both lists are in
    // replica-id order, so one merged walk finds them (this runs on every request).
    // And when the first member that did asked.
    let mut late: Vec<&str> = Vec::new();
    let mut first_rejoin: Option<Instant> = None;
    if let Some(prev) = previous {
        let mut asking = joiners.iter().peekable();
        for id in prev.replica_ids() {
            while asking.next_if(|(j, _)| j.as_str() < id).is_some() {}
            match asking.peek() {
                Some((j, joiner)) if j.as_str() == id => {
                    let at = joiner.joined_at;
                    first_rejoin = Some(first_rejoin.map_or(at, |f| f.min(at)));
                }
                _ if live.is_live(id) => late.push(id),
                _ => {}
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
        Some(_) => Missing::of(late.iter().copied()),
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
    // Past the join timeout only (a round's requests mostly come before it): when the
    // first late member on its way would stop counting as such, unless its beats
    // report progress again.
    let issued = previous_at.unwrap_or(first_join);
    let straggler = straggler_at(first_rejoin, issued, config.join_timeout);
    // A member that failed the previous quorum's step cannot tell whether its peers
    // committed it (a collective can complete on one side only, a lease can settle on
    // one side only): a late member may hold that very step. Going on without it would
    // commit the step a second time, with other data; waiting lets the failed member
    // heal from it. So after a failed step, a late member on its way is no straggler:
    // it is waited for while it progresses, within the bound on late members. Unless it
    // is a new life of the group (it beats from another manager address than the one
    // in that quorum): a restarted group holds no step until it heals.
    let failed_step = previous.filter(|prev| {
        joined
            .iter()
            .any(|j| j.member.commit_failures > 0 && prev.contains(&j.member.replica_id))
    });
    let bound = |id: &str| {
        let same_life = |prev: &Quorum| {
            let held_by = prev.member(id).map(|m| m.manager_address.as_str());
            live.manager_address(id)
                .is_none_or(|now| held_by == Some(now))
        };
        match failed_step {
            Some(prev) if same_life(prev) => late_expiry,
            _ => straggler,
        }
    };
    // Past every bound, no late member's progress is read (this runs on every request).
    let on_their_way = (now < straggler || (failed_step.is_some() && now < late_expiry))
        .then(|| {
            late.iter()
                .filter_map(|id| {
                    let fresh = live.progressed_at(id)? + config.join_timeout.max(PROGRESS_FRESH);
                    Some(fresh.min(bound(id)))
                })
                .filter(|until| now < *until)
                .min()
        })
        .flatten();
    if let Some(until) = on_their_way {
        return Decision::Wait {
            until: Some(until),
            reason: WaitReason::MembersOnTheirWay { missing },
        };
    }
    if let Some(reason) = blocker {
        let until = match &reason {
            WaitReason::NoMajority { .. } if counted_late > 0 => Some(late_expiry),
            _ => None,
        };
        return Decision::Wait { until, reason };
    }

    let mut members: Vec<Member> = members.iter().map(|j| j.member.clone()).collect();
    let best = members
        .iter()
        .filter(|m| !m.torn)
        .map(Member::identity)
        .max();
    // Only restored states are the best: the steps after them may have been committed.
    let restored = best.filter(|b| {
        members
            .iter()
            .filter(|m| !m.torn && m.identity() == *b)
            .all(|m| m.resumed)
    });
    let rolled_back_from = match newest {
        Some(newest) if best < Some(newest.state) => {
            if let Some(until) = newest.may_return_until.filter(|until| now < *until) {
                return Decision::Wait {
                    until: Some(until),
                    reason: WaitReason::NewestStateAway {
                        newest: newest.state,
                        best,
                    },
                };
            }
            Some(newest.state)
        }
        // What is given up is unknown, at least the restored state itself.
        _ => restored.map(|start| newest.map_or(start, |n| n.state.max(start))),
    };
    // The newest state names quorums the job has used too.
    let heard = newest.map_or(highest_seen_id, |n| {
        highest_seen_id
            .max(n.state.state_quorum_id)
            .max(n.state.lineage)
    });
    let id = next_id(
        &members,
        joiners,
        previous,
        heard,
        rolled_back_from.is_some(),
    );
    let lineage = match rolled_back_from {
        // The members that hold the best state are the new lineage's start; every
        // other member heals to it, as in any quorum.
        Some(_) => {
            for m in members.iter_mut().filter(|m| Some(m.identity()) == best) {
                m.lineage = id;
            }
            id
        }
        None => best.map_or(0, |b| b.lineage),
    };
    Decision::Issue(Quorum {
        id,
        members,
        lineage,
        rolled_back_from,
        left_out,
    })
}

/// The joiners less enough of them that no two left can fail to reach each other, by
/// what they report (either side's word is enough); and those left out, each with
/// the member that could not reach it. Greedy: the group in the most such pairs goes
/// first, then the one holding the older state, then the larger replica id; a
/// group's reports about a group left out no longer count against it. Costs the
/// reports' length, plus the square of the groups named in them.
pub fn connected(members: Vec<&Joiner>) -> (Vec<&Joiner>, Vec<(ReplicaId, ReplicaId)>) {
    let at: BTreeMap<&str, usize> = members
        .iter()
        .enumerate()
        .map(|(i, j)| (j.member.replica_id.as_str(), i))
        .collect();
    let mut pairs: BTreeSet<(usize, usize)> = BTreeSet::new();
    for (i, j) in members.iter().enumerate() {
        for k in j
            .member
            .unreachable
            .iter()
            .filter_map(|id| at.get(id.as_str()))
        {
            if *k != i {
                pairs.insert((i.min(*k), i.max(*k)));
            }
        }
    }
    let mut left_out = Vec::new();
    let mut out = BTreeSet::new();
    while !pairs.is_empty() {
        let mut count: BTreeMap<usize, usize> = BTreeMap::new();
        for &(a, b) in &pairs {
            *count.entry(a).or_default() += 1;
            *count.entry(b).or_default() += 1;
        }
        let key = |i: usize| {
            let m = &members[i].member;
            (
                count[&i],
                std::cmp::Reverse(m.identity()),
                m.replica_id.as_str(),
            )
        };
        let Some(worst) = count.keys().copied().max_by(|a, b| key(*a).cmp(&key(*b))) else {
            break;
        };
        let by = pairs
            .iter()
            .find_map(|&(a, b)| (a == worst).then_some(b).or((b == worst).then_some(a)))
            .map_or_else(String::new, |k| members[k].member.replica_id.clone());
        pairs.retain(|&(a, b)| a != worst && b != worst);
        left_out.push((members[worst].member.replica_id.clone(), by));
        out.insert(worst);
    }
    let kept = members
        .into_iter()
        .enumerate()
        .filter(|(i, _)| !out.contains(i))
        .map(|(_, j)| j)
        .collect();
    (kept, left_out)
}

/// Keeps the previous id for an unchanged, healthy membership that goes on in its
/// lineage; otherwise moves above every id anyone has seen, the ids reported by
/// joiners since declared dead included.
fn next_id(
    members: &[Member],
    joiners: &BTreeMap<ReplicaId, Joiner>,
    previous: Option<&Quorum>,
    highest_seen_id: QuorumId,
    rollback: bool,
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
    if unchanged && !failures && !rollback {
        highest
    } else {
        // Callers refuse ids near the top (validate::MAX_QUORUM_ID); saturating keeps
        // an unchecked caller from wrapping to 0 all the same.
        highest.saturating_add(1)
    }
}

#[cfg(test)]
mod tests;
