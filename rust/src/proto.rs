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

/// `From` both ways between a wire type and the engine's type of the same fields:
/// one list of fields, so that both directions convert the same ones.
macro_rules! convert_both_ways {
    ($wire:ident, $engine:path { $($field:ident),* $(,)? }) => {
        impl From<$wire> for $engine {
            fn from(value: $wire) -> Self {
                Self { $($field: value.$field),* }
            }
        }

        impl From<$engine> for $wire {
            fn from(value: $engine) -> Self {
                Self { $($field: value.$field),* }
            }
        }
    };
}

convert_both_ways!(
    Member,
    crate::quorum::Member {
        replica_id,
        manager_address,
        store_address,
        step,
        world_size,
        shrink_only,
        commit_failures,
        state_addresses,
        state_quorum_id,
        torn,
        lineage,
        unreachable,
        resumed,
    }
);

convert_both_ways!(
    StateIdentity,
    crate::quorum::Identity {
        lineage,
        step,
        state_quorum_id,
    }
);
