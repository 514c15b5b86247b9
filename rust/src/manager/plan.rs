//! What one rank of a replica group makes of a quorum: its replica rank, whether it
//! must heal, and from whom. Pure, so every rule is tested without a server.

use tonic::Status;

use crate::proto;

/// The answer for `group_rank` of group `replica_id`.
///
/// A group heals when it is behind the most advanced participant. With `init_sync`,
/// at step 0 every group but the first heals from the first, so that all groups
/// start from the same weights whatever their random initialisation.
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
    let max_step = participants.iter().map(|m| m.step).max().unwrap_or(0);
    let first_sync = init_sync && max_step == 0 && replica_rank != 0;
    let heal = me.step < max_step || first_sync;

    let recovery_sources = if !heal {
        Vec::new()
    } else {
        let up_to_date = |m: &&proto::Member| {
            if first_sync {
                m.replica_id == participants[0].replica_id
            } else {
                m.step == max_step
            }
        };
        participants
            .iter()
            .filter(up_to_date)
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

    let primary = &participants[0];
    Ok(proto::ManagerQuorumResponse {
        quorum_id: quorum.quorum_id,
        replica_rank: replica_rank as u32,
        replica_world_size: participants.len() as u32,
        participants: participants.clone(),
        max_step,
        heal,
        recovery_sources,
        store_address: primary.store_address.clone(),
        store_prefix: format!("phalanx/q{}/r{group_rank}", quorum.quorum_id),
    })
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
            issued_at_unix_ms: 0,
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
}
