//! A quorum as the change to the last one a group holds (`proto::QuorumUpdate`).
//!
//! Every member of a round needs the whole quorum (its rank, who heals from whom, the
//! first member's store), and a round of N members sent whole costs the lighthouse N
//! quorums of N members: at 2,048 groups, 70 MB a round, and the square of the job
//! after that. But from one round to the next an unchanged membership keeps its
//! quorum id and its members' records, but for their state, which is most often the
//! same for all (the step every member committed). So a member that holds the last
//! quorum issued gets, instead, the state most members hold and the few records that
//! differ otherwise: a few dozen bytes in a steady round, the same for every member,
//! encoded once. Pure: `between` is the lighthouse's side, `apply` the group's.

use std::collections::HashMap;

use bytes::Bytes;
use prost::Message;

use crate::proto::{ChangedMember, Member, Quorum, QuorumUpdate, StateIdentity};

/// A quorum as one member gets it, encoded: whole, or as the change to the last one
/// issued, which it holds.
#[derive(Clone, Debug)]
pub enum Answer {
    /// An encoded `proto::Quorum`.
    Whole(Bytes),
    /// An encoded `proto::QuorumUpdate`.
    Update(Bytes),
}

impl Answer {
    /// The quorum this answer is, for a group that holds `known` (if any) whole.
    pub fn decode(&self, known: Option<&Quorum>) -> Result<Quorum, String> {
        match self {
            Answer::Whole(bytes) => {
                Quorum::decode(bytes.clone()).map_err(|e| format!("a malformed quorum: {e}"))
            }
            Answer::Update(bytes) => {
                let update = QuorumUpdate::decode(bytes.clone())
                    .map_err(|e| format!("a malformed quorum update: {e}"))?;
                let known = known.ok_or("a quorum update for a group that holds no quorum")?;
                apply(known, &update)
            }
        }
    }
}

/// `member` holding state `identity`.
fn holding(member: &Member, identity: &StateIdentity) -> Member {
    Member {
        lineage: identity.lineage,
        step: identity.step,
        state_quorum_id: identity.state_quorum_id,
        ..member.clone()
    }
}

/// `next` as a change to `known`: the members gone and come (both quorums are in
/// replica-id order, so one merged walk finds them), the state most members of
/// `next` hold, and the records that differ otherwise. None when that is most of the
/// quorum (then the whole quorum is as small).
///
/// ```
/// use phalanx::delta::{apply, between};
/// use phalanx::proto::{Member, Quorum};
/// let member = |id: &str, step| Member { replica_id: id.into(), step, ..Default::default() };
/// let quorum = |id, issue, members: Vec<Member>| Quorum {
///     quorum_id: id,
///     issue,
///     participants: members,
///     ..Default::default()
/// };
/// let at = |step, ids: &str| ids.split(' ').map(|id| member(id, step)).collect();
/// let known = quorum(7, 1, at(4, "a b c d e"));
/// let steady = quorum(7, 2, at(5, "a b c d e"));
/// let update = between(&known, &steady).unwrap();
/// assert!(update.changed.is_empty() && update.added.is_empty());
/// assert_eq!(apply(&known, &update).unwrap(), steady);
/// // c crashed; f came, and heals from step 0.
/// let mut members: Vec<Member> = at(5, "a b d e");
/// members.push(member("f", 0));
/// let changed = quorum(8, 3, members);
/// let update = between(&steady, &changed).unwrap();
/// assert_eq!((update.removed.len(), update.added.len()), (1, 1));
/// assert_eq!(apply(&steady, &update).unwrap(), changed);
/// ```
pub fn between(known: &Quorum, next: &Quorum) -> Option<QuorumUpdate> {
    if next.participants.is_empty() {
        return None;
    }
    let identity = most_held(&next.participants);
    let (old, new) = (&known.participants, &next.participants);
    let (mut removed, mut added, mut changed) = (Vec::new(), Vec::new(), Vec::new());
    let (mut i, mut j) = (0, 0);
    while i < old.len() || j < new.len() {
        match (old.get(i), new.get(j)) {
            (Some(o), Some(n)) if o.replica_id == n.replica_id => {
                if holding(o, &identity) != *n {
                    changed.push(ChangedMember {
                        index: j as u32,
                        member: Some(n.clone()),
                    });
                }
                i += 1;
                j += 1;
            }
            (Some(o), Some(n)) if o.replica_id < n.replica_id => {
                removed.push(i as u32);
                i += 1;
            }
            (Some(_), None) => {
                removed.push(i as u32);
                i += 1;
            }
            (_, Some(n)) => {
                added.push(n.clone());
                j += 1;
            }
            (None, None) => unreachable!("the walk ends with both lists"),
        }
    }
    if 2 * (removed.len() + added.len() + changed.len()) > new.len() {
        return None;
    }
    Some(QuorumUpdate {
        quorum_id: next.quorum_id,
        issued_at_unix_ms: next.issued_at_unix_ms,
        lineage: next.lineage,
        rolled_back_from: next.rolled_back_from,
        issue: next.issue,
        base_issue: known.issue,
        identity: Some(identity),
        changed,
        removed,
        added,
    })
}

/// The state most of `members` hold (the first of those held by as many).
fn most_held(members: &[Member]) -> StateIdentity {
    let mut counts: HashMap<(u64, i64, u64), (usize, usize)> = HashMap::new();
    for (at, m) in members.iter().enumerate() {
        let entry = counts
            .entry((m.lineage, m.step, m.state_quorum_id))
            .or_insert((0, at));
        entry.0 += 1;
    }
    let (&(lineage, step, state_quorum_id), _) = counts
        .iter()
        .max_by_key(|(_, (count, first))| (*count, std::cmp::Reverse(*first)))
        .expect("a quorum has members");
    StateIdentity {
        lineage,
        step,
        state_quorum_id,
    }
}

/// The quorum `update` describes, from `known`, the quorum of its `base_issue`; an
/// error that says what does not match when `known` is another, or when the update
/// is not one `between` makes.
pub fn apply(known: &Quorum, update: &QuorumUpdate) -> Result<Quorum, String> {
    if known.issue != update.base_issue {
        return Err(format!(
            "a quorum update of issue {} for a group that holds issue {} (quorum {})",
            update.base_issue, known.issue, known.quorum_id
        ));
    }
    let bad = |what: String| Err(format!("a quorum update that {what}"));
    let identity = update.identity.unwrap_or_default();
    let mut gone = update.removed.iter().map(|&k| k as usize).peekable();
    let mut kept = Vec::with_capacity(known.participants.len());
    for (k, member) in known.participants.iter().enumerate() {
        if gone.next_if_eq(&k).is_none() {
            kept.push(holding(member, &identity));
        }
    }
    if let Some(k) = gone.next() {
        return bad(format!(
            "removes member {k} of a quorum of {} (or not in order)",
            known.participants.len()
        ));
    }
    // Both in replica-id order: merged, they are the new quorum's members.
    let mut participants = Vec::with_capacity(kept.len() + update.added.len());
    let mut added = update.added.iter().peekable();
    for member in kept {
        while let Some(a) = added.next_if(|a| a.replica_id < member.replica_id) {
            participants.push(a.clone());
        }
        if added
            .peek()
            .is_some_and(|a| a.replica_id == member.replica_id)
        {
            return bad(format!("adds {:?}, a member already", member.replica_id));
        }
        participants.push(member);
    }
    participants.extend(added.cloned());
    if participants
        .windows(2)
        .any(|w| w[0].replica_id >= w[1].replica_id)
    {
        return bad("adds members out of replica-id order".into());
    }
    for changed in &update.changed {
        let count = participants.len();
        let Some(slot) = participants.get_mut(changed.index as usize) else {
            return bad(format!(
                "changes member {} of a quorum of {count}",
                changed.index
            ));
        };
        let member = changed.member.clone().unwrap_or_default();
        if member.replica_id != slot.replica_id {
            return bad(format!(
                "puts {:?} where the quorum holds {:?}",
                member.replica_id, slot.replica_id
            ));
        }
        *slot = member;
    }
    Ok(Quorum {
        quorum_id: update.quorum_id,
        participants,
        issued_at_unix_ms: update.issued_at_unix_ms,
        lineage: update.lineage,
        rolled_back_from: update.rolled_back_from,
        issue: update.issue,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn member(id: usize, step: i64, torn: bool, address: u8) -> Member {
        Member {
            replica_id: format!("g{id:03}"),
            manager_address: format!("h{address}:1"),
            step,
            state_quorum_id: step as u64 / 3,
            torn,
            world_size: 1,
            ..Default::default()
        }
    }

    fn quorum(id: u64, issue: u64, members: Vec<Member>) -> Quorum {
        Quorum {
            quorum_id: id,
            issue,
            participants: members,
            issued_at_unix_ms: issue as i64,
            lineage: 1,
            rolled_back_from: None,
        }
    }

    proptest! {
        /// Whatever changed between two quorums (members gone and come, states,
        /// records), the update gives back the next one exactly, or there is none
        /// because most of the quorum changed.
        #[test]
        fn an_update_applied_to_the_known_quorum_is_the_next_quorum(
            known_ids in proptest::collection::btree_set(0usize..60, 1..30),
            next_ids in proptest::collection::btree_set(0usize..60, 1..30),
            states in proptest::collection::vec((0i64..4, any::<bool>(), 0u8..3), 60),
        ) {
            let known = quorum(5, 1, known_ids.iter().map(|&i| member(i, 10, false, 0)).collect());
            let next_members: Vec<Member> = next_ids
                .iter()
                .map(|&i| {
                    let (step, torn, address) = states[i];
                    member(i, 10 + step, torn && step == 0, address)
                })
                .collect();
            let n = next_members.len();
            let next = quorum(6, 2, next_members);
            match between(&known, &next) {
                Some(update) => {
                    let size = update.removed.len() + update.added.len() + update.changed.len();
                    prop_assert!(2 * size <= n);
                    prop_assert_eq!(apply(&known, &update).unwrap(), next);
                }
                None => {
                    // Only when most of the quorum changed more than its state.
                    let identity = most_held(&next.participants);
                    let same = next
                        .participants
                        .iter()
                        .filter(|m| {
                            known
                                .participants
                                .iter()
                                .any(|k| holding(k, &identity) == **m)
                        })
                        .count();
                    let gone = known_ids.difference(&next_ids).count();
                    prop_assert!(2 * (n - same + gone) > n);
                }
            }
        }
    }

    #[test]
    fn a_steady_round_is_the_state_alone_and_a_new_membership_goes_whole() {
        let known = quorum(5, 1, (0..100).map(|i| member(i, 9, false, 0)).collect());
        let next = quorum(5, 2, (0..100).map(|i| member(i, 10, false, 0)).collect());
        let update = between(&known, &next).unwrap();
        assert!(update.changed.is_empty());
        assert_eq!(update.identity.unwrap().step, 10);
        // A healer's record is given whole; the others are the common state.
        let mut healing = next.clone();
        healing.participants[3].step = 0;
        let update = between(&next, &healing).unwrap();
        assert_eq!(update.changed.len(), 1);
        assert_eq!(update.changed[0].index, 3);
        // A crash and a newcomer are a member removed and one added; a quorum mostly
        // new goes whole.
        let mut changed = quorum(6, 3, next.participants.clone());
        changed.participants[7].replica_id = "g007b".into();
        let update = between(&next, &changed).unwrap();
        assert_eq!((update.removed.clone(), update.added.len()), (vec![7], 1));
        assert_eq!(apply(&next, &update).unwrap(), changed);
        let fresh = quorum(6, 3, (100..150).map(|i| member(i, 10, false, 0)).collect());
        assert!(between(&next, &fresh).is_none());
    }

    #[test]
    fn an_update_for_another_quorum_than_the_one_held_is_refused_by_name() {
        let known = quorum(5, 1, (0..4).map(|i| member(i, 9, false, 0)).collect());
        let next = quorum(5, 2, (0..4).map(|i| member(i, 10, false, 0)).collect());
        let update = between(&known, &next).unwrap();
        let e = apply(&next, &update).unwrap_err();
        assert!(e.contains("issue 1 for a group that holds issue 2"), "{e}");
        let mut wrong = update.clone();
        wrong.changed.push(ChangedMember {
            index: 9,
            member: Some(member(9, 1, false, 0)),
        });
        assert!(apply(&known, &wrong)
            .unwrap_err()
            .contains("member 9 of a quorum of 4"));
        let mut moved = update;
        moved.changed.push(ChangedMember {
            index: 0,
            member: Some(member(1, 1, false, 0)),
        });
        assert!(apply(&known, &moved)
            .unwrap_err()
            .contains("puts \"g001\" where"));
    }
}
