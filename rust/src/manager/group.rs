//! What the manager server knows about its replica group: the ranks gathering for the
//! quorum of a step, the ballots of the steps being voted on, and the decisions already
//! taken. Pure rules: no sockets, no clocks, no awaits. The service (`mod.rs`) holds
//! this behind one mutex, does the talking (lighthouse, lease) in between, and never
//! awaits inside the lock; `now` is passed in where time matters, so every transition
//! is tested without gRPC.
//!
//! A step's decision is recorded in exactly one place, `GroupState::decide`: whatever
//! counts commits and failures hangs off it.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tonic::Status;

use super::heartbeat::Lease;
use crate::proto;

/// Commit decisions remembered for ranks that vote after the others timed out.
const DECISIONS_KEPT: usize = 64;

pub type Decision = proto::ShouldCommitResponse;
pub type Reply<T> = oneshot::Sender<Result<T, Status>>;

/// One rank's request for the quorum of a step, and where its answer goes.
pub struct RankRequest {
    pub state_address: String,
    pub shrink_only: bool,
    pub state_quorum_id: u64,
    pub lineage: u64,
    pub torn: bool,
    /// The groups this rank could not reach.
    pub unreachable: Vec<String>,
    /// This rank's state was restored from a snapshot.
    pub resumed: bool,
    pub reply: Reply<proto::ManagerQuorumResponse>,
}

/// The group's ranks asking for the quorum of one step.
pub struct Gathering {
    pub step: i64,
    pub ranks: BTreeMap<u32, RankRequest>,
}

impl Gathering {
    /// Answers every rank with the same error.
    pub fn fail(self, status: &Status) {
        for r in self.ranks.into_values() {
            let _ = r.reply.send(Err(status.clone()));
        }
    }

    /// Answers every rank with its own answer.
    pub fn answer(
        self,
        mut answer: impl FnMut(u32) -> Result<proto::ManagerQuorumResponse, Status>,
    ) {
        for (rank, r) in self.ranks {
            let _ = r.reply.send(answer(rank));
        }
    }

    /// Whether the group's state is unusable: a rank says so, or the ranks disagree on
    /// which state they hold, so they cannot all hold the job's.
    fn torn(&self) -> bool {
        let held = |r: &RankRequest| (r.lineage, r.state_quorum_id);
        let first = self.ranks.values().next().map(held);
        self.ranks
            .values()
            .any(|r| r.torn || Some(held(r)) != first)
    }
}

/// One rank's vote on committing a step.
#[derive(Clone, Copy, Debug)]
pub struct Vote {
    pub step: i64,
    pub yes: bool,
    /// The rank's state is torn.
    pub torn: bool,
    /// The quorum the rank says the step ran in (0: not said).
    pub quorum_id: u64,
    /// The rank asks for a snapshot of the state the step commits.
    pub snapshot: bool,
}

#[derive(Default)]
struct Ballot {
    voted: BTreeSet<u32>,
    /// Every rank voted yes so far.
    all_yes: bool,
    /// Some rank's state is torn.
    torn: bool,
    /// The quorum ids the ranks said the step ran in.
    quorum_ids: BTreeSet<u64>,
    /// Some rank asked for a snapshot of the step.
    snapshot: bool,
    waiters: Vec<oneshot::Sender<Decision>>,
}

/// The quorum the group's ranks were last handed, and when it arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepQuorum {
    pub id: u64,
    pub received_at: Instant,
}

/// What a vote leads to.
#[derive(Debug, PartialEq, Eq)]
pub enum Voted {
    /// The step was decided already: this is the decision.
    Decided(Decision),
    /// Other ranks have yet to vote; the decision will come on the waiter.
    Waiting,
    /// This was the last vote and it is a "no": the caller records it with `decide`.
    No { torn: bool },
    /// This was the last vote, every rank said yes about `quorum`, none is torn: the
    /// group commits if it still holds the lease of `quorum` (the caller asks the
    /// heartbeat), then records the outcome with `decide` (`snapshot`: some rank asked
    /// for a snapshot of the step).
    YesIfLeased { quorum: StepQuorum, snapshot: bool },
}

/// The manager server's state of one replica group.
pub struct GroupState {
    replica_id: String,
    world_size: u32,
    gathering: Option<Gathering>,
    ballots: BTreeMap<i64, Ballot>,
    decided: VecDeque<(i64, Decision)>,
    last_quorum_id: u64,
    /// Steps not committed since the lighthouse last heard of them.
    commit_failures: u32,
    quorum: Option<StepQuorum>,
    /// What the heartbeat reports to the lighthouse's per-group counters (but the heal
    /// bytes, summed from `healed_bytes`).
    tally: proto::GroupTally,
    /// Each rank's heal bytes so far, as it last reported them.
    healed_bytes: BTreeMap<u32, u64>,
}

impl GroupState {
    pub fn new(replica_id: impl Into<String>, world_size: u32) -> Self {
        GroupState {
            replica_id: replica_id.into(),
            world_size,
            gathering: None,
            ballots: BTreeMap::new(),
            decided: VecDeque::new(),
            last_quorum_id: 0,
            commit_failures: 0,
            quorum: None,
            tally: proto::GroupTally::default(),
            healed_bytes: BTreeMap::new(),
        }
    }

    /// The group's steps and heals so far, for its heartbeat.
    pub fn tally(&self) -> proto::GroupTally {
        proto::GroupTally {
            healed_bytes: self
                .healed_bytes
                .values()
                .fold(0, |sum, b| sum.saturating_add(*b)),
            ..self.tally
        }
    }

    /// Rank `rank` has fetched `bytes` in heals so far.
    pub fn healed(&mut self, rank: u32, bytes: u64) {
        self.healed_bytes.insert(rank, bytes);
    }

    /// The group's ranks were told to heal in this quorum.
    pub fn heals(&mut self) {
        self.tally.heals += 1;
    }

    /// Rank `rank` asks for the quorum of `step`. Returns the whole gathering once
    /// every rank is in, for the caller to ask the lighthouse; an error (also sent to
    /// every waiting rank) when the ranks disagree on the step.
    pub fn ask(
        &mut self,
        rank: u32,
        step: i64,
        request: RankRequest,
    ) -> Result<Option<Gathering>, Status> {
        if let Some(gathering) = self.gathering.take_if(|g| g.step != step) {
            let asked: Vec<String> = gathering
                .ranks
                .keys()
                .map(|r| format!("rank {r} at step {}", gathering.step))
                .collect();
            let status = Status::invalid_argument(format!(
                "the ranks of replica group {:?} disagree on the step: {} but rank {rank} at \
                 step {step}; every rank must start the quorum of the same step",
                self.replica_id,
                asked.join(", "),
            ));
            gathering.fail(&status);
            return Err(status);
        }
        let gathering = self.gathering.get_or_insert_with(|| Gathering {
            step,
            ranks: BTreeMap::new(),
        });
        if let Some(old) = gathering.ranks.insert(rank, request) {
            let _ = old.reply.send(Err(Status::aborted(
                "superseded by a newer request from the same rank",
            )));
        }
        if gathering.ranks.len() < self.world_size as usize {
            return Ok(None);
        }
        // Every rank is past its last vote: a retried step number starts a new ballot
        // instead of getting the remembered answer of the failed attempt.
        self.ballots.clear();
        self.decided.clear();
        Ok(self.gathering.take())
    }

    /// The step the ranks are gathering for and the ranks that asked so far.
    pub fn asking(&self) -> Option<(i64, Vec<u32>)> {
        let g = self.gathering.as_ref()?;
        Some((g.step, g.ranks.keys().copied().collect()))
    }

    /// Rank `rank` gave up waiting for the quorum of `step` after `timeout`: it leaves
    /// the gathering, and the error says who it waited for.
    pub fn give_up_quorum(&mut self, rank: u32, step: i64, timeout: Duration) -> Status {
        let missing: Vec<u32> = match &mut self.gathering {
            Some(gathering) if gathering.step == step => {
                gathering.ranks.remove(&rank);
                (0..self.world_size)
                    .filter(|r| *r != rank && !gathering.ranks.contains_key(r))
                    .collect()
            }
            _ => Vec::new(),
        };
        let why = if missing.is_empty() {
            "the lighthouse did not answer in time".to_string()
        } else {
            format!("rank(s) {missing:?} of the group did not ask")
        };
        Status::deadline_exceeded(format!(
            "no quorum for replica group {:?} at step {step} within {:.3} s: {why}",
            self.replica_id,
            timeout.as_secs_f64()
        ))
    }

    /// The group as one member of the lighthouse's quorum, from its gathered ranks,
    /// and the last quorum id it knows (so that ids keep rising across a lighthouse
    /// restart).
    pub fn member(
        &self,
        gathering: &Gathering,
        manager_address: &str,
        store_address: &str,
    ) -> (proto::Member, u64) {
        let ranks = gathering.ranks.values();
        let member = proto::Member {
            replica_id: self.replica_id.clone(),
            manager_address: manager_address.to_string(),
            store_address: store_address.to_string(),
            step: gathering.step,
            world_size: self.world_size,
            shrink_only: ranks.clone().any(|r| r.shrink_only),
            commit_failures: self.commit_failures,
            state_addresses: ranks.clone().map(|r| r.state_address.clone()).collect(),
            state_quorum_id: ranks.clone().map(|r| r.state_quorum_id).max().unwrap_or(0),
            lineage: ranks.clone().map(|r| r.lineage).max().unwrap_or(0),
            torn: gathering.torn(),
            resumed: ranks.clone().any(|r| r.resumed),
            unreachable: ranks
                .flat_map(|r| r.unreachable.iter().cloned())
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect(),
        };
        (member, self.last_quorum_id)
    }

    /// The lighthouse issued quorum `quorum_id` to the group, which had reported
    /// `reported_failures` uncommitted steps; the ranks are handed it at `now`.
    /// Returns the quorum the ranks held before, when it was another one: its
    /// rendezvous keys are no longer read.
    pub fn quorum_received(
        &mut self,
        quorum_id: u64,
        reported_failures: u32,
        now: Instant,
    ) -> Option<u64> {
        let previous = self.quorum.map(|q| q.id);
        self.last_quorum_id = self.last_quorum_id.max(quorum_id);
        self.commit_failures = self.commit_failures.saturating_sub(reported_failures);
        self.quorum = Some(StepQuorum {
            id: quorum_id,
            received_at: now,
        });
        previous.filter(|id| *id != quorum_id)
    }

    /// Rank `rank` votes; `waiter` gets the decision if it is not known yet.
    pub fn vote(&mut self, rank: u32, vote: Vote, waiter: oneshot::Sender<Decision>) -> Voted {
        if let Some(decision) = self.decided(vote.step) {
            return Voted::Decided(decision);
        }
        let ballot = self.ballots.entry(vote.step).or_insert_with(|| Ballot {
            all_yes: true,
            ..Ballot::default()
        });
        ballot.voted.insert(rank);
        ballot.all_yes &= vote.yes;
        ballot.torn |= vote.torn;
        ballot.snapshot |= vote.snapshot;
        if vote.quorum_id != 0 {
            ballot.quorum_ids.insert(vote.quorum_id);
        }
        ballot.waiters.push(waiter);
        if ballot.voted.len() < self.world_size as usize {
            return Voted::Waiting;
        }
        let (all_yes, torn, snapshot) = (ballot.all_yes, ballot.torn, ballot.snapshot);
        let claimed = std::mem::take(&mut ballot.quorum_ids);
        // The step's quorum is the one the ranks were handed, if every rank that named
        // one named it.
        let agreed = self.quorum.filter(|q| claimed.iter().all(|id| *id == q.id));
        match agreed {
            Some(quorum) if all_yes && !torn => Voted::YesIfLeased { quorum, snapshot },
            _ => Voted::No { torn },
        }
    }

    /// Rank `rank` gave up waiting for the decision of `step`: a rank that never votes
    /// means "no" for everyone, never a hang, and its heal, if it healed, may not have
    /// completed. (With every vote in, the lease was not settled in time: a "no", torn
    /// as the ranks said.) Returns the decision and the ranks that did not vote.
    pub fn give_up_vote(&mut self, step: i64) -> (Decision, Vec<u32>) {
        let (missing, torn): (Vec<u32>, bool) = match self.ballots.get(&step) {
            Some(b) => (
                (0..self.world_size)
                    .filter(|r| !b.voted.contains(r))
                    .collect(),
                b.torn,
            ),
            None => (Vec::new(), true),
        };
        let torn = torn || !missing.is_empty();
        let decision = self.decide(
            step,
            Decision {
                commit: false,
                torn,
                snapshot: false,
            },
        );
        (decision, missing)
    }

    /// Records the decision of `step` and answers every rank waiting on it; a step
    /// is decided once, so a later call gets the first decision back.
    pub fn decide(&mut self, step: i64, decision: Decision) -> Decision {
        if let Some(first) = self.decided(step) {
            return first;
        }
        if let Some(ballot) = self.ballots.remove(&step) {
            for waiter in ballot.waiters {
                let _ = waiter.send(decision);
            }
        }
        if decision.commit {
            self.tally.steps_committed += 1;
        } else {
            self.commit_failures = self.commit_failures.saturating_add(1);
            self.tally.steps_failed += 1;
        }
        self.decided.push_back((step, decision));
        if self.decided.len() > DECISIONS_KEPT {
            self.decided.pop_front();
        }
        decision
    }

    fn decided(&self, step: i64) -> Option<Decision> {
        self.decided
            .iter()
            .rev()
            .find(|(s, _)| *s == step)
            .map(|(_, d)| *d)
    }
}

/// What the lease says about committing a step of quorum `quorum` that arrived at
/// `received_at`: yes, no for good, or not yet known (wait for the next
/// acknowledgement). No for good once a beat sent after the quorum arrived was
/// acknowledged for another quorum: the lighthouse went on without this group.
pub fn lease_verdict(lease: Option<&Lease>, quorum: StepQuorum, now: Instant) -> Option<bool> {
    let lease = lease?;
    if lease.holds(quorum.id, now) {
        Some(true)
    } else if lease.quorum_id != quorum.id && lease.sent_at > quorum.received_at {
        Some(false)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::oneshot::error::TryRecvError;

    type Answer = oneshot::Receiver<Result<proto::ManagerQuorumResponse, Status>>;

    fn request(state_quorum_id: u64) -> (RankRequest, Answer) {
        let (reply, answer) = oneshot::channel();
        let request = RankRequest {
            state_address: format!("state-{state_quorum_id}:1"),
            shrink_only: false,
            state_quorum_id,
            lineage: 0,
            torn: false,
            unreachable: Vec::new(),
            resumed: false,
            reply,
        };
        (request, answer)
    }

    fn yes(step: i64, quorum_id: u64) -> Vote {
        Vote {
            step,
            yes: true,
            torn: false,
            quorum_id,
            snapshot: false,
        }
    }

    fn vote(g: &mut GroupState, rank: u32, v: Vote) -> (Voted, oneshot::Receiver<Decision>) {
        let (tx, rx) = oneshot::channel();
        (g.vote(rank, v, tx), rx)
    }

    /// A group of `world_size` ranks handed quorum `quorum_id` at `now`.
    fn in_quorum(world_size: u32, quorum_id: u64, now: Instant) -> GroupState {
        let mut g = GroupState::new("g", world_size);
        g.quorum_received(quorum_id, 0, now);
        g
    }

    const NO: Decision = Decision {
        commit: false,
        torn: false,
        snapshot: false,
    };

    #[test]
    fn the_tally_counts_each_decision_once_and_sums_the_ranks_heal_bytes() {
        let mut g = in_quorum(2, 1, Instant::now());
        let commit = Decision {
            commit: true,
            torn: false,
            snapshot: false,
        };
        g.decide(4, commit);
        g.decide(4, NO); // a step is decided once
        g.decide(5, NO);
        g.heals();
        g.healed(0, 100);
        g.healed(1, 50);
        g.healed(0, 300); // each rank reports its total so far
        let t = g.tally();
        assert_eq!((t.steps_committed, t.steps_failed, t.heals), (1, 1, 1));
        assert_eq!(t.healed_bytes, 350);
    }

    #[test]
    fn the_group_asks_the_lighthouse_once_every_rank_is_in() {
        let mut g = GroupState::new("g", 2);
        let (r1, _a1) = request(3);
        assert!(g.ask(1, 7, r1).unwrap().is_none(), "rank 0 has yet to ask");
        let (r0, _a0) = request(3);
        let gathering = g.ask(0, 7, r0).unwrap().expect("every rank is in");
        let (member, last) = g.member(&gathering, "m:1", "s:2");
        assert_eq!(member.step, 7);
        assert_eq!(member.world_size, 2);
        assert_eq!(member.state_addresses, ["state-3:1", "state-3:1"]);
        assert_eq!(member.state_quorum_id, 3);
        assert!(!member.torn);
        assert_eq!((member.manager_address.as_str(), last), ("m:1", 0));
    }

    #[test]
    fn ranks_holding_different_states_make_the_group_torn() {
        let mut g = GroupState::new("g", 2);
        let (r0, _a0) = request(3);
        let (r1, _a1) = request(4);
        g.ask(0, 7, r0).unwrap();
        let gathering = g.ask(1, 7, r1).unwrap().unwrap();
        let (member, _) = g.member(&gathering, "m:1", "s:2");
        assert!(member.torn);
        assert_eq!(member.state_quorum_id, 4);
    }

    #[test]
    fn ranks_that_disagree_on_the_step_are_all_refused_with_both_named() {
        let mut g = GroupState::new("g", 2);
        let (r0, mut a0) = request(0);
        g.ask(0, 5, r0).unwrap();
        let (r1, _a1) = request(0);
        let refused = g.ask(1, 6, r1).err().expect("refused");
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
        assert!(refused.message().contains("rank 0 at step 5"));
        assert!(refused.message().contains("rank 1 at step 6"));
        let waiting = a0.try_recv().unwrap().unwrap_err();
        assert_eq!(waiting.message(), refused.message());
        // The next attempt starts afresh.
        let (r1, _a1) = request(0);
        assert!(g.ask(1, 6, r1).unwrap().is_none());
    }

    #[test]
    fn a_repeated_request_supersedes_the_first() {
        let mut g = GroupState::new("g", 2);
        let (first, mut answer) = request(0);
        g.ask(0, 1, first).unwrap();
        let (second, _) = request(0);
        g.ask(0, 1, second).unwrap();
        let status = answer.try_recv().unwrap().unwrap_err();
        assert_eq!(status.code(), tonic::Code::Aborted);
    }

    #[test]
    fn a_rank_that_gives_up_names_the_ranks_that_did_not_ask() {
        let mut g = GroupState::new("g", 3);
        let (r0, _a0) = request(0);
        g.ask(0, 2, r0).unwrap();
        let status = g.give_up_quorum(0, 2, Duration::from_millis(1500));
        assert_eq!(status.code(), tonic::Code::DeadlineExceeded);
        assert!(
            status.message().contains("within 1.500 s: rank(s) [1, 2]"),
            "{}",
            status.message()
        );
        // It left the gathering: the others alone never complete it.
        let (r1, _) = request(0);
        let (r2, _) = request(0);
        g.ask(1, 2, r1).unwrap();
        assert!(g.ask(2, 2, r2).unwrap().is_none());
        // With every rank in, only the lighthouse can be late.
        let late = g.give_up_quorum(0, 9, Duration::from_secs(1));
        assert!(late
            .message()
            .contains("the lighthouse did not answer in time"));
    }

    #[test]
    fn a_new_quorum_names_the_one_it_replaces() {
        let now = Instant::now();
        let mut g = GroupState::new("g", 1);
        assert_eq!(g.quorum_received(4, 0, now), None, "no quorum before");
        assert_eq!(g.quorum_received(4, 0, now), None, "the same quorum");
        assert_eq!(g.quorum_received(5, 0, now), Some(4));
        // A restarted lighthouse may issue a lower id; the group keeps the highest.
        g.quorum_received(2, 0, now);
        let (r0, _) = request(0);
        let gathering = g.ask(0, 1, r0).unwrap().unwrap();
        assert_eq!(g.member(&gathering, "m:1", "s:1").1, 5);
    }

    #[test]
    fn failures_count_until_the_lighthouse_heard_of_them() {
        let now = Instant::now();
        let mut g = in_quorum(1, 1, now);
        for step in 0..3 {
            g.decide(step, NO);
        }
        let (r0, _) = request(0);
        let gathering = g.ask(0, 3, r0).unwrap().unwrap();
        let (member, _) = g.member(&gathering, "m:1", "s:1");
        assert_eq!(member.commit_failures, 3);
        g.decide(3, NO);
        g.quorum_received(2, member.commit_failures, now);
        let (r0, _) = request(0);
        let gathering = g.ask(0, 4, r0).unwrap().unwrap();
        assert_eq!(g.member(&gathering, "m:1", "s:1").0.commit_failures, 1);
    }

    #[test]
    fn every_yes_about_the_handed_quorum_asks_for_the_lease() {
        let now = Instant::now();
        let mut g = in_quorum(2, 9, now);
        let (first, _) = vote(&mut g, 0, yes(1, 9));
        assert_eq!(first, Voted::Waiting);
        let (last, _) = vote(&mut g, 1, yes(1, 0));
        let quorum = StepQuorum {
            id: 9,
            received_at: now,
        };
        assert_eq!(
            last,
            Voted::YesIfLeased {
                quorum,
                snapshot: false
            }
        );
    }

    #[test]
    fn one_rank_asking_for_a_snapshot_is_enough_for_the_group() {
        let now = Instant::now();
        let mut g = in_quorum(2, 9, now);
        let asks = Vote {
            snapshot: true,
            ..yes(1, 9)
        };
        vote(&mut g, 0, asks);
        let (last, _) = vote(&mut g, 1, yes(1, 9));
        assert!(
            matches!(last, Voted::YesIfLeased { snapshot: true, .. }),
            "{last:?}"
        );
    }

    #[test]
    fn a_vote_about_another_quorum_is_a_no() {
        let mut g = in_quorum(2, 9, Instant::now());
        vote(&mut g, 0, yes(1, 9));
        let (last, _) = vote(&mut g, 1, yes(1, 8));
        assert_eq!(last, Voted::No { torn: false });
        let mut never_handed = GroupState::new("g", 1);
        let (only, _) = vote(&mut never_handed, 0, yes(1, 0));
        assert_eq!(only, Voted::No { torn: false });
    }

    #[test]
    fn a_decision_reaches_every_waiter_and_is_remembered_for_late_voters() {
        let mut g = in_quorum(2, 9, Instant::now());
        let (_, mut early) = vote(&mut g, 0, yes(4, 9));
        let decision = Decision {
            commit: true,
            torn: false,
            snapshot: false,
        };
        assert_eq!(g.decide(4, decision), decision);
        assert_eq!(early.try_recv(), Ok(decision));
        assert_eq!(g.decide(4, NO), decision, "a step is decided once");
        let (late, mut rx) = vote(&mut g, 1, yes(4, 9));
        assert_eq!(late, Voted::Decided(decision));
        assert_eq!(rx.try_recv(), Err(TryRecvError::Closed));
    }

    #[test]
    fn a_rank_that_never_votes_makes_the_step_a_torn_no() {
        let mut g = in_quorum(3, 9, Instant::now());
        let (_, mut rx) = vote(&mut g, 1, yes(2, 9));
        let (decision, missing) = g.give_up_vote(2);
        assert_eq!(missing, [0, 2]);
        let torn_no = Decision {
            commit: false,
            torn: true,
            snapshot: false,
        };
        assert_eq!(decision, torn_no);
        assert_eq!(rx.try_recv(), Ok(torn_no));
    }

    #[test]
    fn a_retried_step_starts_a_new_ballot() {
        let mut g = in_quorum(1, 9, Instant::now());
        g.decide(5, NO);
        let (r0, _) = request(0);
        g.ask(0, 5, r0).unwrap().expect("the only rank");
        let (again, _) = vote(&mut g, 0, yes(5, 9));
        assert!(matches!(again, Voted::YesIfLeased { .. }), "{again:?}");
    }

    #[test]
    fn the_lease_settles_a_commit_once_it_can_tell() {
        let t0 = Instant::now();
        let quorum = StepQuorum {
            id: 9,
            received_at: t0,
        };
        let lease = |quorum_id, sent_at| Lease {
            quorum_id,
            until: t0 + Duration::from_secs(2),
            sent_at,
        };
        let later = t0 + Duration::from_millis(10);
        assert_eq!(lease_verdict(None, quorum, t0), None);
        assert_eq!(
            lease_verdict(Some(&lease(9, t0)), quorum, later),
            Some(true)
        );
        let expired = t0 + Duration::from_secs(3);
        assert_eq!(lease_verdict(Some(&lease(9, t0)), quorum, expired), None);
        // A beat sent before the quorum arrived may not know it yet.
        assert_eq!(lease_verdict(Some(&lease(8, t0)), quorum, later), None);
        assert_eq!(
            lease_verdict(Some(&lease(10, later)), quorum, later),
            Some(false)
        );
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        /// A rank's vote: yes, torn, and which quorum it names (0: none, 1: the
        /// handed one, 2: another).
        fn ballots() -> impl Strategy<Value = Vec<(bool, bool, u64)>> {
            prop::collection::vec((any::<bool>(), any::<bool>(), 0u64..3), 1..6)
        }

        proptest! {
            /// I2: the group asks for the lease, the only way to a commit, exactly
            /// when every rank voted yes, none is torn and none named another quorum,
            /// whatever the order of the votes.
            #[test]
            fn a_commit_needs_every_rank_yes_and_whole(votes in ballots(), rotate in 0usize..6) {
                let world = votes.len() as u32;
                let mut g = in_quorum(world, 1, Instant::now());
                let mut outcome = Voted::Waiting;
                for i in 0..votes.len() {
                    let rank = (i + rotate) % votes.len();
                    let (yes, torn, quorum_id) = votes[rank];
                    let v = Vote { step: 3, yes, torn, quorum_id, snapshot: false };
                    let (voted, _rx) = vote(&mut g, rank as u32, v);
                    if i + 1 < votes.len() {
                        prop_assert_eq!(&voted, &Voted::Waiting);
                    }
                    outcome = voted;
                }
                let whole = votes.iter().all(|(yes, torn, q)| *yes && !*torn && *q != 2);
                let any_torn = votes.iter().any(|v| v.1);
                if whole {
                    prop_assert!(matches!(outcome, Voted::YesIfLeased { .. }), "{:?}", outcome);
                } else {
                    prop_assert_eq!(outcome, Voted::No { torn: any_torn });
                }
            }
        }
    }
}
