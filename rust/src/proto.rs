//! Generated wire types (see `rust/proto/phalanx.proto`) and their conversions to the
//! engine's own types.

#![allow(clippy::all, missing_docs)]

tonic::include_proto!("phalanx.v1");

/// The protocol version this build speaks; every request carries it. Version 2: a
/// group asks for its quorums on its heartbeat stream, and relies on the lighthouse to
/// answer there (a version 1 lighthouse would take the ask for a beat and never answer).
/// Version 3: states carry their lineage; a group of version 2 would report every
/// state as of the job's first lineage, and be taken for the holder of an old one.
pub const PROTOCOL_VERSION: u32 = 3;

/// The gRPC metadata key that carries the serving lighthouse's address on a refusal:
/// set by a lighthouse of a set that does not serve (`lighthouse::set`), read by
/// `LighthouseClient` to move to the one that does.
pub const LEADER_KEY: &str = "phalanx-leader";

impl From<Member> for crate::quorum::Member {
    fn from(m: Member) -> Self {
        crate::quorum::Member {
            replica_id: m.replica_id,
            manager_address: m.manager_address,
            store_address: m.store_address,
            step: m.step,
            world_size: m.world_size,
            shrink_only: m.shrink_only,
            commit_failures: m.commit_failures,
            state_addresses: m.state_addresses,
            state_quorum_id: m.state_quorum_id,
            torn: m.torn,
            lineage: m.lineage,
            unreachable: m.unreachable,
        }
    }
}

impl From<crate::quorum::Member> for Member {
    fn from(m: crate::quorum::Member) -> Self {
        Member {
            replica_id: m.replica_id,
            manager_address: m.manager_address,
            store_address: m.store_address,
            step: m.step,
            world_size: m.world_size,
            shrink_only: m.shrink_only,
            commit_failures: m.commit_failures,
            state_addresses: m.state_addresses,
            state_quorum_id: m.state_quorum_id,
            torn: m.torn,
            lineage: m.lineage,
            unreachable: m.unreachable,
        }
    }
}

impl From<crate::quorum::Identity> for StateIdentity {
    fn from(i: crate::quorum::Identity) -> Self {
        StateIdentity {
            lineage: i.lineage,
            step: i.step,
            state_quorum_id: i.state_quorum_id,
        }
    }
}

impl From<StateIdentity> for crate::quorum::Identity {
    fn from(i: StateIdentity) -> Self {
        crate::quorum::Identity {
            lineage: i.lineage,
            step: i.step,
            state_quorum_id: i.state_quorum_id,
        }
    }
}
