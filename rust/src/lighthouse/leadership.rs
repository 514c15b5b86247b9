//! Who of a set of lighthouses serves: Raft (the `raft` crate) elects a leader, and
//! the leader serves only while it holds a lease from a majority of the set.
//!
//! Pure: every call takes `now`, messages go in and out as values, so the property
//! test (`rust/tests/leadership_properties.rs`) drives a whole set through ticks,
//! partitions and crashes on a fake clock. `set.rs` does the I/O.
//!
//! Why the lease makes "never two serving at once" hold (written out for operators
//! in docs/lighthouse-set.md):
//! - a follower that hears from its leader at `r` (its clock) refuses every vote for
//!   `Timing::stickiness()` after `r` (Raft's check_quorum "leader stickiness"; our
//!   ticks are counted from `now`, so a late tick only makes the refusal longer), and
//!   a lighthouse that (re)starts refuses votes for as long after its start;
//! - every message the leader sends carries its send time `e`; a follower echoes the
//!   newest `e` from its current leader back on its own messages; an echo proves the
//!   follower reset its election timer at some `r >= e`;
//! - the leader serves while a majority (itself counted) echoed an `e` with
//!   `now < e + Timing::lease()`, and `lease()` is shorter than the stickiness by the
//!   clock-rate margin `MAX_DRIFT` and `DECISION_MARGIN`;
//! - a new leader needs a vote from that same majority, which none of its members
//!   gives before its stickiness ends, by which time the old lease has run out.
//!
//! Terms, votes and the log's terms are kept on disk (`VoteStore`): a lighthouse that
//! forgot its vote could vote twice in one term and make two leaders of it, and one
//! that forgot its log could help elect a leader that lacks a committed entry.
//!
//! Because terms are kept, one message with an absurd term would stay for good: Raft
//! adopts any higher term it hears, and every member writes it down. So a message
//! from a peer is taken in only if it is one phalanx's Raft sends and its term is one
//! the set can have reached (`Leadership::check`, `term_ceiling`), and quorum ids are
//! numbered so that no term can take them out of the range groups accept
//! (`quorum_id_floor`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use raft::eraftpb::{ConfState, Entry, EntryType, HardState, Message, MessageType};
use raft::storage::MemStorage;
use raft::Storage;
use raft::{Config, RawNode, StateRole};

use crate::validate::MAX_QUORUM_ID;

/// How far apart two lighthouses' clock rates may be, as a fraction. Monotonic clocks
/// of commodity machines differ by well under 0.1% (crystals ~0.01%, NTP slews at most
/// 0.05%); 1% leaves a tenfold margin.
pub const MAX_DRIFT: f64 = 0.01;
/// Time the leader keeps for itself between checking its lease and acting on it.
pub const DECISION_MARGIN: Duration = Duration::from_millis(20);

/// The set's timers, in ticks of `tick`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timing {
    pub tick: Duration,
    /// A follower that hears nothing for a random time in [election, 2 election)
    /// ticks starts an election.
    pub election_ticks: usize,
    /// The leader sends a heartbeat every this many ticks.
    pub heartbeat_ticks: usize,
}

impl Default for Timing {
    /// Elections after 0.6 to 1.2 s of silence; heartbeats every 100 ms; a lease of
    /// about 0.56 s. Failover costs one election timeout plus a round trip. The fine
    /// tick spreads the followers' random election timeouts over 60 values, not 12:
    /// two followers of a lost leader that time out in the same tick split the vote,
    /// and the election takes another timeout (with 50 ms ticks, about one failover
    /// in six of a set of three took 3 s instead of 2).
    fn default() -> Self {
        Timing {
            tick: Duration::from_millis(10),
            election_ticks: 60,
            heartbeat_ticks: 10,
        }
    }
}

impl Timing {
    /// How long, at least, a follower refuses votes after hearing from its leader:
    /// a message just before a tick boundary counts that tick as one already passed.
    pub fn stickiness(&self) -> Duration {
        self.tick * (self.election_ticks.saturating_sub(1) as u32)
    }

    /// The least time between two elections that each raise the set's highest term,
    /// on the fastest clock the drift bound allows (see `term_ceiling`).
    pub fn fastest_election(&self) -> Duration {
        (self.tick * self.election_ticks as u32).mul_f64(1.0 - MAX_DRIFT)
    }

    /// How long a majority's acknowledgement lets the leader serve.
    pub fn lease(&self) -> Duration {
        self.stickiness()
            .mul_f64(1.0 - MAX_DRIFT)
            .saturating_sub(DECISION_MARGIN)
    }
}

/// What a lighthouse keeps of Raft across restarts. The log holds no data (only
/// leadership goes through Raft), so the term of each entry is all of it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Saved {
    pub term: u64,
    pub vote: u64,
    /// The term of each log entry, from index 1.
    pub log_terms: Vec<u64>,
}

/// Where a lighthouse keeps its `Saved` state across restarts.
pub trait VoteStore: Send {
    fn save(&mut self, saved: &Saved) -> std::io::Result<()>;
}

/// Keeps nothing: for tests that never restart a member, and the property test's own
/// disk (which it keeps itself).
#[derive(Default)]
pub struct NoDisk;

impl VoteStore for NoDisk {
    fn save(&mut self, _saved: &Saved) -> std::io::Result<()> {
        Ok(())
    }
}

/// One Raft message between lighthouses, with the lease timestamps around it.
#[derive(Clone, Debug)]
pub struct Envelope {
    pub message: Message,
    /// The sender's clock when sent, in µs since its start (never 0).
    pub sent_us: u64,
    /// The newest `sent_us` the sender heard from the receiver as its leader in
    /// `message.term`; 0: none.
    pub echo_us: u64,
}

/// How a lighthouse stands in the set, for the status page.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct View {
    pub id: u64,
    pub term: u64,
    pub role: &'static str,
    /// The leader this lighthouse knows of (0: none).
    pub leader: u64,
    /// It issues quorums now.
    pub serving: bool,
    /// Milliseconds left on its lease (leader only).
    pub lease_left_ms: Option<u64>,
    /// Milliseconds since a message from each other member (None: never).
    pub heard_ms: BTreeMap<u64, Option<u64>>,
}

pub struct Leadership {
    id: u64,
    voters: Vec<u64>,
    node: RawNode<MemStorage>,
    timing: Timing,
    epoch: Instant,
    ticks: u64,
    /// Per member, the newest echoed send time of the current term (leader only).
    acked: BTreeMap<u64, Instant>,
    acked_term: u64,
    /// Per member, (term, sent_us) of its newest message as our leader.
    echo: BTreeMap<u64, (u64, u64)>,
    heard: BTreeMap<u64, Instant>,
    disk: Box<dyn VoteStore>,
    saved: Saved,
    /// The ground `term_ceiling` grows from: a term, when this member had it, and how
    /// long before that it was written (the saved state's age at start).
    ground_term: u64,
    ground_at: Instant,
    ground_age: Duration,
    /// It started with no saved state at all (a new member, or one whose state file
    /// was deleted): it has nothing to judge a term by until its term first changes.
    fresh: bool,
}

/// Why a message from a peer was not taken in (`Leadership::check`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Its term is above any the set can have reached by now.
    Term { term: u64, ceiling: u64 },
    /// A kind of message phalanx's Raft never sends to a peer.
    Kind(MessageType),
    /// It carries a log entry no leader of phalanx appends (with data, of another
    /// type, or of a term above the message's own), or acknowledges one this
    /// lighthouse's log does not hold.
    Entry,
}

impl Refusal {
    /// For the `raft_refused` metric's `reason` label.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::Term { .. } => "term",
            Refusal::Kind(_) => "kind",
            Refusal::Entry => "entry",
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Term { term, ceiling } => write!(
                f,
                "its term {term} is above {ceiling}, the highest this set can have reached \
                 by elections since this lighthouse's state was written"
            ),
            Refusal::Kind(kind) => write!(
                f,
                "it is a {kind:?}, which no lighthouse of a set sends (no leadership \
                 transfer, no proposals, no snapshots)"
            ),
            Refusal::Entry => write!(
                f,
                "it carries or acknowledges a log entry no leader appended (the log holds \
                 only the empty entry of each new leader)"
            ),
        }
    }
}

/// Terms a member may be behind the others when its state was written, beyond what
/// elections since then can add (see `term_ceiling`).
pub const TERM_SLACK: u64 = 1_000;

/// The highest term a peer's message may carry for a member that started with
/// `start_term`, written `elapsed` ago, under `timing`.
///
/// Why this bound never refuses a real election storm: with pre-vote and
/// check-quorum on, a member raises its term only by campaigning, and it campaigns
/// only after its election timer ran at least `election_ticks` ticks, a timer that
/// restarts whenever its term changes (by its campaign or by hearing a higher one).
/// So the highest term of the set rises by at most one per `fastest_election` of
/// the member that raises it (a member at a lower term raises nothing above it),
/// however many members campaign at once. Twice that rate, counted from when this
/// member's state was written, plus `TERM_SLACK` for a member that was behind then
/// (by a partition: a member that hears the others catches up at once), is a bound
/// real elections stay under with a factor of two to spare. A member whose state is
/// old (down for a month) gets a bound grown by that month.
///
/// A hostile or buggy sender can push the term up to this bound and no further: at
/// most `TERM_SLACK` at once, and then no faster than twice the fastest storm, each
/// raise costing the set an election. From term 0
/// with the default timing the bound reaches `MAX_TERM` after 81 years of that. It
/// is not capped there: a set past `MAX_TERM` (its quorum ids still valid, see
/// `quorum_id_floor`) must still elect, and its operator resets it at leisure
/// (`phalanx lighthouse --reset-state`, docs/lighthouse-set.md).
pub fn term_ceiling(start_term: u64, elapsed: Duration, timing: &Timing) -> u64 {
    let fastest = timing.fastest_election().as_nanos().max(1);
    let elections = u64::try_from(elapsed.as_nanos() / fastest).unwrap_or(u64::MAX);
    start_term
        .saturating_add(TERM_SLACK)
        .saturating_add(elections.saturating_mul(2))
}

fn us_since(epoch: Instant, now: Instant) -> u64 {
    (now.saturating_duration_since(epoch).as_micros() as u64).max(1)
}

impl Leadership {
    /// Member `id` of `voters` (ids from 1), starting at `now` from what it saved last
    /// (the default the first time).
    pub fn new(
        id: u64,
        voters: Vec<u64>,
        timing: Timing,
        saved: Saved,
        disk: Box<dyn VoteStore>,
        now: Instant,
    ) -> Result<Self, String> {
        if !voters.contains(&id) {
            return Err(format!("lighthouse id {id} is not one of {voters:?}"));
        }
        let config = Config {
            id,
            election_tick: timing.election_ticks,
            heartbeat_tick: timing.heartbeat_ticks,
            check_quorum: true,
            pre_vote: true,
            ..Default::default()
        };
        config.validate().map_err(|e| e.to_string())?;
        let storage = MemStorage::new_with_conf_state(ConfState::from((voters.clone(), vec![])));
        let entries: Vec<Entry> = saved
            .log_terms
            .iter()
            .enumerate()
            .map(|(i, term)| Entry {
                index: i as u64 + 1,
                term: *term,
                ..Default::default()
            })
            .collect();
        storage.wl().append(&entries).map_err(|e| e.to_string())?;
        storage.wl().set_hardstate(HardState {
            term: saved.term,
            vote: saved.vote,
            ..Default::default()
        });
        let logger = slog::Logger::root(slog::Discard, slog::o!());
        let node = RawNode::new(&config, storage, &logger).map_err(|e| e.to_string())?;
        Ok(Leadership {
            id,
            voters,
            node,
            timing,
            epoch: now,
            ticks: 0,
            acked: BTreeMap::new(),
            acked_term: 0,
            echo: BTreeMap::new(),
            heard: BTreeMap::new(),
            disk,
            ground_term: saved.term,
            ground_at: now,
            ground_age: Duration::ZERO,
            fresh: false,
            saved,
        })
    }

    /// Says that the saved state this member started from was written `age` before
    /// its start (a file's age): the set may have gone on electing meanwhile.
    pub fn with_saved_age(mut self, age: Duration) -> Self {
        self.ground_age = age;
        self
    }

    /// Says that this member starts with no saved state at all (no state file): a
    /// new member, or one whose file was deleted while the others ran. The set's
    /// term may be anything by now, so the first leader it hears (a heartbeat or an
    /// append) is taken at its word; from its first change of term on, terms are
    /// judged from there. A hostile first message can take only this member out of
    /// the set (the others judge its messages by their own ground), until its file
    /// is deleted again. A set reset with `--reset-state` has files, so is not fresh.
    pub fn starting_fresh(mut self) -> Self {
        self.fresh = true;
        self
    }

    /// The highest term a peer's message may carry at `now` (`term_ceiling`).
    pub fn term_ceiling(&self, now: Instant) -> u64 {
        let elapsed = self.ground_age + now.saturating_duration_since(self.ground_at);
        term_ceiling(self.ground_term, elapsed, &self.timing)
    }

    /// Whether a message from a peer may be taken in at `now`: of a kind phalanx's
    /// Raft sends between members, with no entry a leader never appends, and of a
    /// term the set can have reached. `receive` drops what this refuses; the caller
    /// asks first to count and report it.
    pub fn check(&self, envelope: &Envelope, now: Instant) -> Result<(), Refusal> {
        use MessageType::*;
        let m = &envelope.message;
        match m.get_msg_type() {
            MsgAppend
            | MsgAppendResponse
            | MsgRequestVote
            | MsgRequestVoteResponse
            | MsgRequestPreVote
            | MsgRequestPreVoteResponse
            | MsgHeartbeat
            | MsgHeartbeatResponse => {}
            // MsgTransferLeader and MsgTimeoutNow start an election that skips the
            // followers' stickiness, which the lease counts on; nothing proposes, and
            // the log is never compacted, so no leader needs a snapshot (one would
            // also replace the set's members). The rest are local to a member.
            other => return Err(Refusal::Kind(other)),
        }
        let entry_ok =
            |e: &Entry| e.get_entry_type() == EntryType::EntryNormal && e.data.is_empty();
        if m.log_term > m.term || m.entries.iter().any(|e| e.term > m.term || !entry_ok(e)) {
            return Err(Refusal::Entry);
        }
        // A follower acknowledges only entries its leader sent it, all in the
        // leader's log: a leader that took a larger index would send from there on,
        // and with no such entry to send, fall back to snapshots the follower refuses.
        let last = self.node.raft.raft_log.last_index();
        if m.get_msg_type() == MsgAppendResponse && !m.reject && m.index > last {
            return Err(Refusal::Entry);
        }
        let from_a_leader = matches!(m.get_msg_type(), MsgHeartbeat | MsgAppend);
        let ceiling = self.term_ceiling(now);
        if m.term > self.node.raft.term && m.term > ceiling && !(self.fresh && from_a_leader) {
            return Err(Refusal::Term {
                term: m.term,
                ceiling,
            });
        }
        Ok(())
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn term(&self) -> u64 {
        self.node.raft.term
    }

    /// The leader this member knows of, if any (possibly itself, possibly deposed).
    pub fn leader(&self) -> Option<u64> {
        Some(self.node.raft.leader_id).filter(|id| *id != 0)
    }

    pub fn timing(&self) -> Timing {
        self.timing
    }

    /// Runs the ticks due by `now`; returns the messages to send.
    pub fn advance(&mut self, now: Instant) -> Vec<(u64, Envelope)> {
        let due = (now.saturating_duration_since(self.epoch).as_nanos()
            / self.timing.tick.as_nanos().max(1)) as u64;
        // After a long stall every election timer has long run out: a few ticks say so.
        let cap = 4 * self.timing.election_ticks as u64;
        self.ticks = self.ticks.max(due.saturating_sub(cap));
        while self.ticks < due {
            self.node.tick();
            self.ticks += 1;
        }
        self.pump(now)
    }

    /// Takes in a message from another member; returns the messages to send.
    pub fn receive(&mut self, envelope: Envelope, now: Instant) -> Vec<(u64, Envelope)> {
        if self.check(&envelope, now).is_err() {
            return Vec::new();
        }
        let mut m = envelope.message;
        let (from, term, kind) = (m.from, m.term, m.get_msg_type());
        if from == self.id || m.to != self.id || !self.voters.contains(&from) {
            return Vec::new();
        }
        // raft-rs panics on a heartbeat committing past this member's log. A leader
        // sends one to a member whose state file was deleted (it still counts the
        // entries that member had); nothing here applies committed entries, so the
        // commit index is only a number: take it as far as the log goes, and the
        // leader's next append fills the log in.
        if kind == MessageType::MsgHeartbeat {
            m.commit = m.commit.min(self.node.raft.raft_log.last_index());
        }
        self.heard.insert(from, now);
        let vote_request = matches!(
            kind,
            MessageType::MsgRequestVote | MessageType::MsgRequestPreVote
        );
        // Before its start this member may have heard from a leader that still counts
        // on it; it forgot that, so it waits as if it had heard at its start.
        if vote_request && now < self.epoch + self.timing.stickiness() {
            return Vec::new();
        }
        let _ = self.node.step(m);
        let (state, now_term, leader_id) = {
            let raft = &self.node.raft;
            (raft.state, raft.term, raft.leader_id)
        };
        // An echo is a time this leader sent: one not yet come (a garbled or replayed
        // message) would stretch the lease past what the follower has acknowledged.
        let echoed = self
            .epoch
            .checked_add(Duration::from_micros(envelope.echo_us))
            .filter(|at| envelope.echo_us > 0 && *at <= now);
        if let (StateRole::Leader, true, Some(at)) = (state, now_term == term, echoed) {
            self.forget_old_acks();
            let entry = self.acked.entry(from).or_insert(at);
            *entry = (*entry).max(at);
        }
        let timer_reset = matches!(
            kind,
            MessageType::MsgAppend | MessageType::MsgHeartbeat | MessageType::MsgSnapshot
        );
        if timer_reset && leader_id == from && now_term == term {
            let entry = self.echo.entry(from).or_insert((term, 0));
            if entry.0 != term {
                *entry = (term, 0);
            }
            entry.1 = entry.1.max(envelope.sent_us);
        }
        self.pump(now)
    }

    fn forget_old_acks(&mut self) {
        if self.acked_term != self.node.raft.term {
            self.acked.clear();
            self.acked_term = self.node.raft.term;
        }
    }

    /// Until when this member may serve, if it leads: the majority's oldest newest
    /// acknowledgement plus the lease. Itself it counts as acknowledging always.
    pub fn lease_until(&self) -> Option<Instant> {
        let raft = &self.node.raft;
        if raft.state != StateRole::Leader {
            return None;
        }
        let majority = self.voters.len() / 2 + 1;
        let needed = majority - 1;
        if needed == 0 {
            return Some(self.epoch + Duration::from_secs(86400 * 365 * 100));
        }
        let mut acks: Vec<Instant> = if self.acked_term == raft.term {
            self.acked.values().copied().collect()
        } else {
            Vec::new()
        };
        if acks.len() < needed {
            return None;
        }
        acks.sort_unstable_by(|a, b| b.cmp(a));
        Some(acks[needed - 1] + self.timing.lease())
    }

    /// The term this member serves in at `now`, if it serves: it leads and holds a
    /// majority's lease.
    pub fn serving(&self, now: Instant) -> Option<u64> {
        self.lease_until()
            .filter(|until| now < *until)
            .map(|_| self.node.raft.term)
    }

    /// When the driver must call `advance` again: the next tick, or the lease's end
    /// if sooner (so that a lost lease is acted on at once).
    pub fn next_wakeup(&self, now: Instant) -> Instant {
        let tick = self.epoch + self.timing.tick * (self.ticks as u32 + 1);
        self.lease_until()
            .filter(|until| *until > now)
            .map_or(tick, |until| until.min(tick))
    }

    pub fn view(&self, now: Instant) -> View {
        let raft = &self.node.raft;
        View {
            id: self.id,
            term: raft.term,
            role: match raft.state {
                StateRole::Leader => "leader",
                StateRole::Candidate => "candidate",
                StateRole::PreCandidate => "pre-candidate",
                StateRole::Follower => "follower",
            },
            leader: raft.leader_id,
            serving: self.serving(now).is_some(),
            lease_left_ms: self
                .lease_until()
                .map(|u| u.saturating_duration_since(now).as_millis() as u64),
            heard_ms: self
                .voters
                .iter()
                .filter(|v| **v != self.id)
                .map(|v| {
                    let age = self
                        .heard
                        .get(v)
                        .map(|t| now.saturating_duration_since(*t).as_millis() as u64);
                    (*v, age)
                })
                .collect(),
        }
    }

    /// Hands Raft's ready state on: saves term and vote, keeps the log in memory,
    /// stamps the outgoing messages.
    fn pump(&mut self, now: Instant) -> Vec<(u64, Envelope)> {
        let mut out = Vec::new();
        if !self.node.has_ready() {
            return out;
        }
        let mut ready = self.node.ready();
        let messages = ready.take_messages();
        self.stamp(&mut out, messages, now);
        if !ready.snapshot().is_empty() {
            let snapshot = ready.snapshot().clone();
            let _ = self.node.mut_store().wl().apply_snapshot(snapshot);
        }
        let _ = self.node.mut_store().wl().append(ready.entries());
        if let Some(hs) = ready.hs() {
            self.node.mut_store().wl().set_hardstate(hs.clone());
        }
        let now_saved = self.to_save();
        let mut durable = true;
        if now_saved != self.saved {
            match self.disk.save(&now_saved) {
                Ok(()) => self.saved = now_saved,
                Err(e) => {
                    // A vote not on disk must not be sent: after a restart this
                    // member could vote again in the same term.
                    tracing::error!("cannot save the lighthouse's Raft state: {e}");
                    durable = false;
                }
            }
        }
        if durable {
            let persisted = ready.take_persisted_messages();
            self.stamp(&mut out, persisted, now);
        }
        let mut light = self.node.advance(ready);
        if let Some(commit) = light.commit_index() {
            self.node.mut_store().wl().mut_hard_state().commit = commit;
        }
        let messages = light.take_messages();
        self.stamp(&mut out, messages, now);
        self.node.advance_apply();
        self.forget_old_acks();
        if self.fresh && self.node.raft.term != self.ground_term {
            (self.ground_term, self.ground_at) = (self.node.raft.term, now);
            self.fresh = false;
        }
        out
    }

    fn to_save(&self) -> Saved {
        let store = self.node.store();
        let hs = store.rl().hard_state().clone();
        let last = store.last_index().unwrap_or(0);
        let log_terms = (1..=last).map(|i| store.term(i).unwrap_or(0)).collect();
        Saved {
            term: hs.term,
            vote: hs.vote,
            log_terms,
        }
    }

    fn stamp(&self, out: &mut Vec<(u64, Envelope)>, messages: Vec<Message>, now: Instant) {
        let sent_us = us_since(self.epoch, now);
        for message in messages {
            let to = message.to;
            let echo_us = self
                .echo
                .get(&to)
                .filter(|(term, _)| *term == message.term)
                .map_or(0, |(_, us)| *us);
            out.push((
                to,
                Envelope {
                    message,
                    sent_us,
                    echo_us,
                },
            ));
        }
    }
}

/// Quorum ids each term has to itself above its floor (`quorum_id_floor`).
pub const IDS_PER_TERM: u64 = 1 << 20;

/// The highest term with ids of its own: every id of it and below is at most
/// `MAX_QUORUM_ID`, the most groups accept.
pub const MAX_TERM: u64 = MAX_QUORUM_ID / IDS_PER_TERM - 1;

/// Quorum ids issued in term `term` start above this: a later leader's ids are above
/// every earlier leader's, whatever the groups report.
///
/// The 2^53 ids groups accept (`MAX_QUORUM_ID`) are split between terms and the
/// quorums of each: 2^33 terms of 2^20 ids. 2^33 terms is 81 years of terms raised
/// at twice the fastest real election storm (the most `term_ceiling` admits), 162
/// years of that storm itself; 2^20 quorums are 29 hours of a new quorum at every
/// step of a 10 Hz job under one leader. A term past `MAX_TERM` keeps its floor
/// (ids stay valid, only the floor no longer rises with the term), and a leader that
/// issues more than 2^20 ids reaches into the next term's: the new leader then starts
/// above the ids the groups report with every beat and ask, and above the job's
/// newest state the set passed on, so ids still only rise.
pub fn quorum_id_floor(term: u64) -> u64 {
    term.min(MAX_TERM) * IDS_PER_TERM
}

#[cfg(test)]
mod tests;
