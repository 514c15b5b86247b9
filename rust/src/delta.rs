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

fn identity_of(member: &Member) -> StateIdentity {
    StateIdentity {
        lineage: member.lineage,
        step: member.step,
        state_quorum_id: member.state_quorum_id,
    }
}

/// `next` as a change to `known`: None unless both are of one quorum id with the same
/// members in the same order, or when most members changed more than their state
/// (then the whole quorum is as small).
///
/// ```
/// use phalanx::delta::{apply, between};
/// use phalanx::proto::{Member, Quorum};
/// let member = |id: &str, step| Member { replica_id: id.into(), step, ..Default::default() };
/// let at = |step, issue| Quorum {
///     quorum_id: 7,
///     issue,
///     participants: vec![member("a", step), member("b", step)],
///     ..Default::default()
/// };
/// let update = between(&at(4, 1), &at(5, 2)).unwrap();
/// assert!(update.changed.is_empty());
/// assert_eq!(apply(&at(4, 1), &update).unwrap(), at(5, 2));
/// ```
pub fn between(known: &Quorum, next: &Quorum) -> Option<QuorumUpdate> {
    let same_members = known.quorum_id == next.quorum_id
        && known.participants.len() == next.participants.len()
        && known
            .participants
            .iter()
            .zip(&next.participants)
            .all(|(k, n)| k.replica_id == n.replica_id);
    if !same_members || next.participants.is_empty() {
        return None;
    }
    let identity = most_held(&next.participants);
    let changed: Vec<ChangedMember> = known
        .participants
        .iter()
        .zip(&next.participants)
        .enumerate()
        .filter(|(_, (k, n))| holding(k, &identity) != **n)
        .map(|(index, (_, n))| ChangedMember {
            index: index as u32,
            member: Some(n.clone()),
        })
        .collect();
    if 2 * changed.len() > next.participants.len() {
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
/// error that says what does not match when `known` is another.
pub fn apply(known: &Quorum, update: &QuorumUpdate) -> Result<Quorum, String> {
    if known.issue != update.base_issue || known.quorum_id != update.quorum_id {
        return Err(format!(
            "a quorum update of issue {} of quorum {} for a group that holds issue {} of \
             quorum {}",
            update.base_issue, update.quorum_id, known.issue, known.quorum_id
        ));
    }
    let identity = update
        .identity
        .unwrap_or_else(|| identity_of(&Member::default()));
    let mut participants: Vec<Member> = known
        .participants
        .iter()
        .map(|m| holding(m, &identity))
        .collect();
    for changed in &update.changed {
        let slot = participants
            .get_mut(changed.index as usize)
            .ok_or_else(|| {
                format!(
                    "a quorum update changes member {} of a quorum of {}",
                    changed.index,
                    known.participants.len()
                )
            })?;
        let member = changed.member.clone().unwrap_or_default();
        if member.replica_id != slot.replica_id {
            return Err(format!(
                "a quorum update puts {:?} where the quorum holds {:?}",
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
        /// Whatever changed between two quorums of one membership, the update gives
        /// back the next one exactly, or there is none and the whole one goes.
        #[test]
        fn an_update_applied_to_the_known_quorum_is_the_next_quorum(
            n in 1usize..40,
            steps in proptest::collection::vec((0i64..4, any::<bool>(), 0u8..3), 40),
            advance in 0i64..3,
        ) {
            let known = quorum(5, 1, (0..n).map(|i| member(i, 10, false, 0)).collect());
            let next_members = (0..n)
                .map(|i| {
                    let (step, torn, address) = steps[i];
                    member(i, 10 + advance * step, torn && step == 0, address)
                })
                .collect();
            let next = quorum(5, 2, next_members);
            match between(&known, &next) {
                Some(update) => {
                    prop_assert!(2 * update.changed.len() <= n);
                    prop_assert_eq!(apply(&known, &update).unwrap(), next);
                }
                None => {
                    // Only when most members changed more than their state.
                    let identity = most_held(&next.participants);
                    let changed = known
                        .participants
                        .iter()
                        .zip(&next.participants)
                        .filter(|(k, n)| holding(k, &identity) != **n)
                        .count();
                    prop_assert!(2 * changed > n);
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
        // Another id, or other members, go whole.
        assert!(between(&known, &quorum(6, 2, next.participants.clone())).is_none());
        let mut other = next.clone();
        other.participants[7].replica_id = "x".into();
        assert!(between(&known, &other).is_none());
    }

    #[test]
    fn an_update_for_another_quorum_than_the_one_held_is_refused_by_name() {
        let known = quorum(5, 1, (0..4).map(|i| member(i, 9, false, 0)).collect());
        let next = quorum(5, 2, (0..4).map(|i| member(i, 10, false, 0)).collect());
        let update = between(&known, &next).unwrap();
        let e = apply(&next, &update).unwrap_err();
        assert!(
            e.contains("issue 1 of quorum 5 for a group that holds issue 2"),
            "{e}"
        );
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
