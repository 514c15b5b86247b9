//! What one rank of a replica group makes of a quorum: its replica rank, whether it
//! must heal, and from whom. Pure, so every rule is tested without a server.

use tonic::Status;

use crate::proto;
use crate::quorum::Identity;

/// Which state `m` holds: two groups hold the same bytes only if their lineage, step
/// and commit quorum are the same.
fn identity(m: &proto::Member) -> Identity {
    Identity {
        lineage: m.lineage,
        step: m.step,
        state_quorum_id: m.state_quorum_id,
    }
}

/// The state the quorum trains on: the most advanced sound one of the newest
/// lineage, and among states of one step the one committed last (a group that
/// committed that step in an earlier quorum was dropped from it, and its peers went
/// on without it). The lighthouse relabels the start of a new lineage, so it is the
/// newest. None when every participant is torn.
pub fn job_state(participants: &[proto::Member]) -> Option<Identity> {
    participants.iter().filter(|m| !m.torn).map(identity).max()
}

/// The answer for `group_rank` of group `replica_id`.
///
/// A group heals when its state is not the job's (see [`job_state`]): it is behind,
/// it holds a step committed in a quorum its peers went on without, or its state is
/// torn. With `init_sync`, at step 0 every group but the first heals from the first,
/// so that all groups start from the same weights whatever their random initialisation.
pub fn rank_plan(
    quorum: &proto::Quorum,
    replica_id: &str,
    group_rank: u32,
    init_sync: bool,
) -> Result<proto::ManagerQuorumResponse, Status> {
    let participants = &quorum.participants;
    let replica_rank = participants
        .iter()
        .position(|m| m.replica_id == replica_id)
        .ok_or_else(|| {
            Status::internal(format!(
                "the lighthouse answered with quorum {} that does not include {replica_id:?}",
                quorum.quorum_id
            ))
        })?;
    let me = &participants[replica_rank];
    // With every participant torn nobody holds a usable state: all must heal, and
    // with no source their heals fail until a sound group joins.
    let target = job_state(participants);
    let first_sync = init_sync && target.is_some_and(|t| t.step == 0);
    let first_sound = participants.iter().find(|m| !m.torn).map(|m| &m.replica_id);
    // The groups whose state is the job's this step; every other one heals from them.
    let source = |m: &proto::Member| {
        if first_sync {
            Some(&m.replica_id) == first_sound
        } else {
            !m.torn && Some(identity(m)) == target
        }
    };
    let heal = !source(me);

    let recovery_sources = if !heal {
        Vec::new()
    } else {
        participants
            .iter()
            .filter(|m| source(m))
            .filter_map(|m| {
                m.state_addresses
                    .get(group_rank as usize)
                    .filter(|a| !a.is_empty())
                    .map(|a| proto::RecoverySource {
                        replica_id: m.replica_id.clone(),
                        state_address: a.clone(),
                    })
            })
            .collect()
    };
    let contributors = participants.iter().filter(|m| source(m)).count();
    let participating_rank = (!heal).then(|| {
        participants[..replica_rank]
            .iter()
            .filter(|m| source(m))
            .count() as u32
    });
    let serves_healers = !heal && contributors < participants.len();
    let target = target.unwrap_or(Identity {
        lineage: quorum.lineage,
        step: participants.iter().map(|m| m.step).max().unwrap_or(0),
        state_quorum_id: 0,
    });

    let primary = &participants[0];
    Ok(proto::ManagerQuorumResponse {
        quorum_id: quorum.quorum_id,
        replica_rank: replica_rank as u32,
        replica_world_size: participants.len() as u32,
        participants: participants.clone(),
        max_step: target.step,
        max_state_quorum_id: target.state_quorum_id,
        heal,
        recovery_sources,
        contributors: contributors as u32,
        serves_healers,
        lineage: quorum.lineage,
        rolled_back_from: quorum.rolled_back_from,
        participating_rank,
        store_address: primary.store_address.clone(),
        store_prefix: format!("{}/r{group_rank}", quorum_store_prefix(quorum.quorum_id)),
    })
}

/// Where the keys of quorum `quorum_id`'s cross-group process groups live in the
/// store of its first participant; the store drops them once its group moved on.
pub fn quorum_store_prefix(quorum_id: u64) -> String {
    format!("phalanx/q{quorum_id}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: &str, step: i64) -> proto::Member {
        proto::Member {
            replica_id: id.into(),
            store_address: format!("{id}-store:1"),
            step,
            world_size: 2,
            state_addresses: vec![format!("{id}-r0:9"), format!("{id}-r1:9")],
            ..Default::default()
        }
    }

    fn quorum(members: Vec<proto::Member>) -> proto::Quorum {
        proto::Quorum {
            quorum_id: 7,
            participants: members,
            ..Default::default()
        }
    }

    #[test]
    fn a_group_behind_heals_from_every_up_to_date_peer_of_its_own_rank() {
        let q = quorum(vec![member("a", 10), member("b", 10), member("c", 3)]);
        let plan = rank_plan(&q, "c", 1, true).unwrap();
        assert!(plan.heal);
        assert_eq!(plan.max_step, 10);
        assert_eq!(plan.replica_rank, 2);
        assert_eq!(plan.replica_world_size, 3);
        let sources: Vec<_> = plan
            .recovery_sources
            .iter()
            .map(|s| s.state_address.as_str())
            .collect();
        assert_eq!(sources, ["a-r1:9", "b-r1:9"]);
        assert_eq!(plan.store_address, "a-store:1");
        assert_eq!(plan.store_prefix, "phalanx/q7/r1");
    }

    #[test]
    fn an_up_to_date_group_does_not_heal() {
        let q = quorum(vec![member("a", 10), member("b", 10), member("c", 3)]);
        let plan = rank_plan(&q, "a", 0, true).unwrap();
        assert!(!plan.heal);
        assert!(plan.recovery_sources.is_empty());
    }

    #[test]
    fn at_step_zero_every_group_but_the_first_syncs_from_the_first() {
        let q = quorum(vec![member("a", 0), member("b", 0)]);
        assert!(!rank_plan(&q, "a", 0, true).unwrap().heal);
        let b = rank_plan(&q, "b", 0, true).unwrap();
        assert!(b.heal);
        assert_eq!(b.recovery_sources.len(), 1);
        assert_eq!(b.recovery_sources[0].replica_id, "a");
        assert!(!rank_plan(&q, "b", 0, false).unwrap().heal);
    }

    #[test]
    fn a_quorum_without_the_group_is_an_error() {
        let q = quorum(vec![member("a", 0)]);
        assert!(rank_plan(&q, "z", 0, true).is_err());
    }

    fn committed_in(mut m: proto::Member, quorum_id: u64) -> proto::Member {
        m.state_quorum_id = quorum_id;
        m
    }

    fn torn(mut m: proto::Member) -> proto::Member {
        m.torn = true;
        m
    }

    #[test]
    fn one_step_committed_in_two_quorums_is_two_states_and_the_later_one_wins() {
        // c committed step 4 in quorum 2 after a and b had dropped it; they committed
        // step 4 in quorum 3. Same step count, different bytes: c heals.
        let q = quorum(vec![
            committed_in(member("a", 4), 3),
            committed_in(member("b", 4), 3),
            committed_in(member("c", 4), 2),
        ]);
        let c = rank_plan(&q, "c", 0, true).unwrap();
        assert!(c.heal);
        assert_eq!((c.max_step, c.max_state_quorum_id), (4, 3));
        assert_eq!(c.recovery_sources.len(), 2);
        let a = rank_plan(&q, "a", 0, true).unwrap();
        assert!(!a.heal && a.serves_healers);
        assert_eq!(a.contributors, 2);
    }

    #[test]
    fn the_contributors_are_numbered_in_order_and_a_healer_has_no_number() {
        let q = quorum(vec![
            committed_in(member("a", 4), 3),
            committed_in(member("b", 2), 1),
            committed_in(member("c", 4), 3),
        ]);
        let ranks: Vec<_> = ["a", "b", "c"]
            .iter()
            .map(|id| rank_plan(&q, id, 0, true).unwrap().participating_rank)
            .collect();
        assert_eq!(ranks, [Some(0), None, Some(1)]);
    }

    #[test]
    fn a_state_of_an_older_lineage_heals_whatever_its_step() {
        // The job went back to step 186 as lineage 9; the holder of the old lineage's
        // step 296 is back: its state is not the job's any more.
        let mut new = committed_in(member("a", 190), 12);
        new.lineage = 9;
        let old = committed_in(member("b", 296), 8);
        let mut q = quorum(vec![new, old]);
        q.lineage = 9;
        let b = rank_plan(&q, "b", 1, true).unwrap();
        assert!(b.heal);
        assert_eq!((b.lineage, b.max_step, b.max_state_quorum_id), (9, 190, 12));
        assert_eq!(b.recovery_sources.len(), 1);
        assert!(!rank_plan(&q, "a", 1, true).unwrap().heal);
    }

    #[test]
    fn a_torn_group_heals_even_at_the_job_step_and_is_never_a_source() {
        let q = quorum(vec![
            committed_in(member("a", 9), 5),
            torn(committed_in(member("b", 9), 5)),
            torn(committed_in(member("c", 12), 6)),
        ]);
        let b = rank_plan(&q, "b", 1, true).unwrap();
        assert!(b.heal);
        assert_eq!(b.max_step, 9, "a torn state does not set the job's step");
        let sources: Vec<_> = b
            .recovery_sources
            .iter()
            .map(|s| s.replica_id.as_str())
            .collect();
        assert_eq!(sources, ["a"]);
        assert!(rank_plan(&q, "c", 1, true).unwrap().heal);
        assert_eq!(rank_plan(&q, "a", 0, true).unwrap().contributors, 1);
    }

    #[test]
    fn with_every_group_torn_all_heal_and_none_serves() {
        let q = quorum(vec![torn(member("a", 3)), torn(member("b", 5))]);
        for id in ["a", "b"] {
            let plan = rank_plan(&q, id, 0, true).unwrap();
            assert!(plan.heal && plan.recovery_sources.is_empty());
            assert_eq!(plan.contributors, 0);
        }
    }

    #[test]
    fn the_first_sync_comes_from_the_first_sound_group() {
        let q = quorum(vec![torn(member("a", 0)), member("b", 0), member("c", 0)]);
        assert!(rank_plan(&q, "a", 0, true).unwrap().heal);
        let b = rank_plan(&q, "b", 0, true).unwrap();
        assert!(!b.heal && b.serves_healers);
        assert_eq!(b.contributors, 1);
        let c = rank_plan(&q, "c", 0, true).unwrap();
        assert_eq!(c.recovery_sources[0].replica_id, "b");
    }
}
