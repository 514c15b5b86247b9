//! The job's high-water mark: its newest committed state, and who may still hold it.
//!
//! The state of a job lives only in the memory of its groups. A quorum of groups that
//! all hold older states (a group back from a cut, groups restarted empty) must not
//! go on as if the newest state never was: its step numbers would name two states,
//! and what was committed since would be gone without a word (invariant I11). So the
//! lighthouse keeps the newest state any group reported, and which groups reported
//! holding it. A holder that vanished silently (its heartbeat timed out: cut off,
//! paused, a host down) may come back with it, so the quorum engine waits for it up to
//! `rollback_after` from when it was last seen; a holder known to be gone for good (its
//! stream broke because its process died, it was evicted as stalled and exits, or its
//! replica id came back holding another state) is not waited for. With no holder left,
//! the engine starts a new lineage from the best state there is.
//!
//! A lighthouse that starts serving inherits the mark from its set (see `set.rs`) and
//! from the groups that rejoin; a mark learned that way has no named holder, so it is
//! waited for as if its holder had been seen just then.
//!
//! Pure: every method takes `now`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::quorum::{Identity, Newest, ReplicaId};

#[derive(Debug)]
pub struct NewestState {
    rollback_after: Duration,
    state: Option<Identity>,
    /// The groups seen holding `state`, and when each was last seen alive.
    holders: HashMap<ReplicaId, Instant>,
    /// When `state` was learned without a holder's name (from the set, or at start).
    learned_at: Option<Instant>,
}

impl NewestState {
    pub fn new(rollback_after: Duration) -> Self {
        NewestState {
            rollback_after,
            state: None,
            holders: HashMap::new(),
            learned_at: None,
        }
    }

    pub fn state(&self) -> Option<Identity> {
        self.state
    }

    /// `replica_id` holds `identity` at `now`.
    pub fn observe(&mut self, replica_id: &str, identity: Identity, now: Instant) {
        match self.state {
            Some(state) if identity < state => {
                // This replica id holds an older state now: whichever process of it
                // held the newest one is gone (a replica id is live once at a time).
                self.holders.remove(replica_id);
            }
            Some(state) if identity == state => match self.holders.get_mut(replica_id) {
                Some(seen) => *seen = now,
                None => {
                    self.holders.insert(replica_id.to_string(), now);
                }
            },
            _ => {
                self.state = Some(identity);
                self.holders.clear();
                self.holders.insert(replica_id.to_string(), now);
                self.learned_at = None;
            }
        }
    }

    /// The holders that still live at `now` (their heartbeats beat) were seen then.
    pub fn see_live(&mut self, lives: impl Fn(&str) -> bool, now: Instant) {
        for (id, seen) in &mut self.holders {
            if lives(id) {
                *seen = now;
            }
        }
    }

    /// The groups seen holding the newest state.
    pub fn holders(&self) -> impl Iterator<Item = &str> {
        self.holders.keys().map(String::as_str)
    }

    /// `replica_id` is gone for good, and its state with it.
    pub fn gone(&mut self, replica_id: &str) {
        self.holders.remove(replica_id);
    }

    /// Someone (another lighthouse of the set) knows of `identity`, held by a group
    /// this lighthouse has not heard from yet.
    pub fn learn(&mut self, identity: Identity, now: Instant) {
        if self.state.is_none_or(|state| identity > state) {
            self.state = Some(identity);
            self.holders.clear();
            self.learned_at = Some(now);
        }
    }

    /// A quorum started a new lineage at `start`, held by `holders`.
    pub fn rolled_back<'a>(
        &mut self,
        start: Identity,
        holders: impl Iterator<Item = &'a str>,
        now: Instant,
    ) {
        self.state = Some(start);
        self.holders = holders.map(|id| (id.to_string(), now)).collect();
        self.learned_at = None;
    }

    /// The lighthouse starts serving afresh: the holders are to be heard from again,
    /// and are waited for as if seen at `now`.
    pub fn restart(&mut self, now: Instant) {
        self.holders.clear();
        self.learned_at = self.state.map(|_| now);
    }

    /// What the quorum engine needs to know (see `quorum::Newest`).
    pub fn newest(&self) -> Option<Newest> {
        let state = self.state?;
        let last_seen = self.holders.values().copied().chain(self.learned_at).max();
        Some(Newest {
            state,
            may_return_until: last_seen.map(|at| at + self.rollback_after),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WAIT: Duration = Duration::from_secs(30);

    fn at(step: i64, state_quorum_id: u64) -> Identity {
        Identity {
            lineage: 0,
            step,
            state_quorum_id,
        }
    }

    #[test]
    fn the_newest_state_is_awaited_from_its_last_holder_seen() {
        let t = Instant::now();
        let mut n = NewestState::new(WAIT);
        assert_eq!(n.newest(), None);
        n.observe("g1", at(10, 2), t);
        n.observe("g3", at(10, 2), t);
        n.observe("g2", at(4, 1), t);
        n.see_live(|id| id == "g3", t + Duration::from_secs(5));
        // g2 is not a holder: seeing it has no effect.
        n.see_live(|id| id == "g2", t + Duration::from_secs(9));
        assert_eq!(
            n.newest(),
            Some(Newest {
                state: at(10, 2),
                may_return_until: Some(t + Duration::from_secs(5) + WAIT),
            })
        );
        let mut holders: Vec<&str> = n.holders().collect();
        holders.sort();
        assert_eq!(holders, ["g1", "g3"]);
    }

    #[test]
    fn a_newer_state_replaces_the_holders_and_gone_holders_are_not_awaited() {
        let t = Instant::now();
        let mut n = NewestState::new(WAIT);
        n.observe("g1", at(10, 2), t);
        n.observe("g2", at(11, 2), t);
        assert_eq!(n.holders().collect::<Vec<_>>(), ["g2"]);
        n.gone("g2");
        assert_eq!(
            n.newest(),
            Some(Newest {
                state: at(11, 2),
                may_return_until: None,
            })
        );
    }

    #[test]
    fn a_holders_replica_id_back_with_an_older_state_is_no_holder_any_more() {
        let t = Instant::now();
        let mut n = NewestState::new(WAIT);
        n.observe("g1", at(296, 8), t);
        n.observe("g1", at(0, 0), t + Duration::from_secs(1)); // restarted empty
        assert_eq!(n.newest().unwrap().may_return_until, None);
        assert_eq!(
            n.state(),
            Some(at(296, 8)),
            "the mark itself never goes down"
        );
    }

    #[test]
    fn a_mark_learned_from_the_set_is_awaited_from_when_it_was_learned() {
        let t = Instant::now();
        let mut n = NewestState::new(WAIT);
        n.observe("g1", at(5, 1), t);
        n.learn(at(4, 1), t); // older: ignored
        assert_eq!(n.holders().count(), 1);
        n.learn(at(9, 3), t + Duration::from_secs(2));
        assert_eq!(
            n.newest(),
            Some(Newest {
                state: at(9, 3),
                may_return_until: Some(t + Duration::from_secs(2) + WAIT),
            })
        );
        // A group reports it: from now on it is that group that is awaited.
        n.observe("g3", at(9, 3), t + Duration::from_secs(3));
        assert_eq!(
            n.newest().unwrap().may_return_until,
            Some(t + Duration::from_secs(3) + WAIT)
        );
    }
}
