//! Stall detection: which group hangs while its peers wait on it.
//!
//! A group reports its training progress on every beat (see `Pulse::trained`): since
//! when it made no progress, since when some rank of it waits on the others, and how
//! long it may go without progress (its stall timeout). A member of the current
//! quorum that made no progress for its stall timeout is *due*; it is evicted once
//! due and once a peer has waited on it for half the timeout. A shorter wait is no
//! sign of a hang (a peer's vote waiting for its lease while this group, done with
//! its steps, idles); a hang keeps its peers waiting from about when it began, so the
//! half is over before the timeout. A group that trained but dropped out of the
//! quorum stalled (a thread hung after its vote, so it missed the next quorum) is
//! evicted too, though no peer waits on it any more.
//!
//! Groups outside the quorum are looked at again when the quorum changes, when one of
//! them is due, or at a judgement once `RELOOK` passed, not at every judgement: a look
//! reads every live group, and a judgement comes with every quorum request (beside
//! 10,000 live groups, two looks a request were most of the lighthouse's time in a
//! quorum round of 8 others, whose p50 was 3 ms).
//!
//! Pure: the lighthouse state lends its groups through `Groups`, and every judgement
//! takes `now`.

use std::time::{Duration, Instant};

use super::pulse::Training;
use crate::quorum::{Quorum, ReplicaId};

/// A group as stall detection sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Watched {
    /// Its training progress; none when it does not report it (or is not live).
    pub training: Option<Training>,
    /// When it asked for the next quorum; none while it does not ask.
    pub asked_at: Option<Instant>,
    /// The last step it reported.
    pub step: i64,
    /// It was a member of a quorum since it appeared.
    pub joined: bool,
    /// When its heartbeat stream opened; none without one.
    pub stream_opened_at: Option<Instant>,
}

impl Watched {
    /// Since when it waits on the others: it asks for the next quorum, or some rank of
    /// it sits in a collective, a vote or a heal.
    pub fn waiting_since(&self) -> Option<Instant> {
        let training = self.training.and_then(|t| t.waiting_since);
        self.asked_at.into_iter().chain(training).min()
    }
}

/// What stall detection reads of the lighthouse: the current quorum and its groups.
pub trait Groups {
    fn quorum(&self) -> Option<&Quorum>;
    /// One group, live or not.
    fn watched(&self, replica_id: &str) -> Watched;
    /// The members of the quorum in its order, each as `watched` has it: in one walk,
    /// where a lookup each (beside 10,000 members) was most of a judgement's time.
    fn members(&self) -> Box<dyn Iterator<Item = (&str, Watched)> + '_>;
    /// Every live group that dropped out of the quorum, and when it is due as stalled
    /// (each as `dropped_due` has it).
    fn dropped(&self) -> Box<dyn Iterator<Item = (&str, Instant)> + '_>;
}

/// How long a look at the groups outside the quorum stands at most. A group becomes
/// one of them by a new quorum (which looks again at once) or, rarely, by ending its
/// ask or reporting its first step while outside: its eviction as dropped, a stall
/// timeout after it stalled, may then come late by this, or, with no request coming,
/// until the deadline task's next judgement (it runs at least once a heartbeat
/// timeout while any group is live).
pub const RELOOK: Duration = Duration::from_millis(250);

/// Stall detection's memory between two looks.
#[derive(Debug, Default)]
pub struct Stalls {
    /// A member of the current quorum is due as stalled and no peer waits on it yet:
    /// the next request to join makes a peer wait, so it runs the stall check.
    overdue: bool,
    /// The last look at the groups outside the current quorum.
    outside: Option<Look>,
}

/// A look at the groups outside the quorum (see `dropped_due`).
#[derive(Clone, Copy, Debug)]
struct Look {
    at: Instant,
    /// The quorum they were outside of.
    quorum_id: Option<u64>,
    /// The earliest one of them is due, after `at`.
    next: Option<Instant>,
}

impl Look {
    /// Whether it still stands at `now` with the quorum `quorum_id` current.
    fn stands(&self, quorum_id: Option<u64>, now: Instant) -> bool {
        self.quorum_id == quorum_id && now < self.at + RELOOK && self.next.is_none_or(|n| now < n)
    }
}

impl Stalls {
    pub fn overdue(&self) -> bool {
        self.overdue
    }

    /// The groups to evict as stalled at `now`: every member of the current quorum
    /// due and waited on (see `member_due`), and every group that dropped out of it
    /// stalled (see `dropped_due`). Remembers, and returns, whether a member is due
    /// but waited on by nobody yet (the first peer that begins to wait wakes the
    /// deadline task, see `Pulse::trained`).
    pub fn judge(&mut self, groups: &impl Groups, now: Instant) -> (Vec<ReplicaId>, bool) {
        let mut overdue = false;
        let mut stalled = Vec::new();
        let quorum_id = groups.quorum().map(|q| q.id);
        if !self.outside.is_some_and(|look| look.stands(quorum_id, now)) {
            let mut next: Option<Instant> = None;
            for (id, at) in groups.dropped() {
                if at <= now {
                    stalled.push(id.to_string());
                } else {
                    next = Some(next.map_or(at, |n| n.min(at)));
                }
            }
            self.outside = Some(Look {
                at: now,
                quorum_id,
                next,
            });
        }
        if groups.quorum().is_some() {
            let members: Vec<_> = groups.members().collect();
            let waits = EarliestWaits::of(&members);
            for (k, (id, member)) in members.iter().enumerate() {
                match member_due(k, member, &waits) {
                    (_, Some(at)) if at <= now => stalled.push(id.to_string()),
                    (Some(due), None) if due <= now => overdue = true,
                    _ => {}
                }
            }
        }
        self.overdue = overdue;
        (stalled, overdue)
    }

    /// When a member of the current quorum is next due as stalled, or due for
    /// eviction, or a group outside it is, as the last look found (see `judge`): a
    /// member due already waits for a peer to wait, which wakes the deadline task
    /// itself. Before any judgement, every group outside is looked at.
    pub fn next(&self, groups: &impl Groups, now: Instant) -> Option<Instant> {
        let outside = match self.outside {
            Some(look) => look.next.filter(|at| *at > now),
            None => next_dropped(groups, now),
        };
        [next_member(groups, now), outside]
            .into_iter()
            .flatten()
            .min()
    }
}

fn next_member(groups: &impl Groups, now: Instant) -> Option<Instant> {
    groups.quorum()?;
    let members: Vec<_> = groups.members().collect();
    let waits = EarliestWaits::of(&members);
    members
        .iter()
        .enumerate()
        .flat_map(|(k, (_, member))| {
            let (due, evict_at) = member_due(k, member, &waits);
            [due, evict_at].into_iter().flatten().filter(|at| *at > now)
        })
        .min()
}

fn next_dropped(groups: &impl Groups, now: Instant) -> Option<Instant> {
    groups
        .dropped()
        .map(|(_, at)| at)
        .filter(|at| *at > now)
        .min()
}

/// The two earliest waits among a quorum's members (see `Watched::waiting_since`):
/// the earliest with the index of its member, and the next. Each member's stall is
/// judged by the earliest wait of the others, and with the two earliest at hand that
/// takes no second pass over them.
#[derive(Default)]
pub struct EarliestWaits {
    first: Option<(Instant, usize)>,
    second: Option<Instant>,
}

impl EarliestWaits {
    /// Found in one pass over the members of the quorum, in its order.
    pub fn of(members: &[(&str, Watched)]) -> Self {
        let mut waits = EarliestWaits::default();
        for (k, (_, member)) in members.iter().enumerate() {
            let Some(since) = member.waiting_since() else {
                continue;
            };
            match waits.first {
                Some((first, _)) if first <= since => {
                    waits.second = Some(waits.second.map_or(since, |s| s.min(since)));
                }
                _ => {
                    waits.second = waits.first.map(|(first, _)| first);
                    waits.first = Some((since, k));
                }
            }
        }
        waits
    }

    /// The earliest wait of a member other than member `k`.
    fn of_others(&self, k: usize) -> Option<Instant> {
        match self.first {
            Some((_, who)) if who == k => self.second,
            first => first.map(|(since, _)| since),
        }
    }
}

/// When member `k` (`member`) of the current quorum is due as stalled (it made no
/// progress for its stall timeout) and when it is to be evicted: once due, and once a
/// peer has waited for half the timeout (`waits`). Neither for a group that does not
/// report its progress, or that asks for a quorum itself (every one of its ranks got
/// that far); no eviction time while no peer waits.
pub fn member_due(
    k: usize,
    member: &Watched,
    waits: &EarliestWaits,
) -> (Option<Instant>, Option<Instant>) {
    let Some(training) = member.training else {
        return (None, None);
    };
    if member.asked_at.is_some() {
        return (None, None);
    }
    let evict_at = waits
        .of_others(k)
        .map(|since| (since + training.stall_timeout / 2).max(training.due()));
    (Some(training.due()), evict_at)
}

/// When a group that trained (it reported a step above 0, or was a member of a
/// quorum) but is outside the current quorum is to be evicted as stalled: a thread
/// that hung after its vote made its group miss the next quorum (the join timeout
/// went on without it), so no peer waits on it any more, yet it is hung and should be
/// restarted. So did a healing group's thread that hung loading the state it fetched
/// (at its step's end, still at step 0). A healthy group out of the quorum asks for
/// the next one at once; one still starting up (step 0, never a member) may take its
/// time. Counted from its stream's opening too, so that a group resumed from SIGSTOP
/// reports its progress before it is judged.
pub fn dropped_due(groups: &impl Groups, id: &str) -> Option<Instant> {
    if groups.quorum().is_some_and(|q| q.contains(id)) {
        return None;
    }
    dropped_at(&groups.watched(id))
}

/// When `group`, outside the current quorum, is to be evicted as stalled (see
/// `dropped_due`).
pub fn dropped_at(group: &Watched) -> Option<Instant> {
    if group.asked_at.is_some() {
        return None;
    }
    let training = group.training?;
    let opened_at = group.stream_opened_at?;
    (group.step > 0 || group.joined).then(|| training.due().max(opened_at + training.stall_timeout))
}
