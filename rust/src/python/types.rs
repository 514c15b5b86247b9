//! What the lighthouse and the manager server answer, as frozen Python objects.

use pyo3::prelude::*;

use crate::proto;

macro_rules! debug_repr {
    ($($t:ty),*) => {$(
        #[pymethods]
        impl $t {
            fn __repr__(&self) -> String {
                format!("{self:?}")
            }
        }
    )*};
}

/// A replica group as it took part in a quorum.
#[pyclass(module = "phalanx._core", frozen, get_all)]
#[derive(Clone, Debug)]
pub struct Member {
    pub(super) replica_id: String,
    pub(super) manager_address: String,
    pub(super) store_address: String,
    pub(super) step: i64,
    pub(super) world_size: u32,
    pub(super) shrink_only: bool,
    pub(super) commit_failures: u32,
    pub(super) state_addresses: Vec<String>,
    pub(super) state_quorum_id: u64,
    pub(super) torn: bool,
    pub(super) lineage: u64,
}

impl From<proto::Member> for Member {
    fn from(m: proto::Member) -> Self {
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
        }
    }
}

/// Which state a group holds: its lineage, step and commit quorum.
#[pyclass(module = "phalanx._core", frozen, get_all)]
#[derive(Clone, Debug)]
pub struct StateIdentity {
    pub(super) lineage: u64,
    pub(super) step: i64,
    pub(super) state_quorum_id: u64,
}

impl From<proto::StateIdentity> for StateIdentity {
    fn from(i: proto::StateIdentity) -> Self {
        StateIdentity {
            lineage: i.lineage,
            step: i.step,
            state_quorum_id: i.state_quorum_id,
        }
    }
}

/// A quorum as the lighthouse issued it.
#[pyclass(module = "phalanx._core", frozen, get_all)]
#[derive(Clone, Debug)]
pub struct Quorum {
    pub(super) quorum_id: u64,
    pub(super) participants: Vec<Member>,
    pub(super) issued_at_unix_ms: i64,
    pub(super) lineage: u64,
    pub(super) rolled_back_from: Option<StateIdentity>,
}

impl From<proto::Quorum> for Quorum {
    fn from(q: proto::Quorum) -> Self {
        Quorum {
            quorum_id: q.quorum_id,
            participants: q.participants.into_iter().map(Into::into).collect(),
            issued_at_unix_ms: q.issued_at_unix_ms,
            lineage: q.lineage,
            rolled_back_from: q.rolled_back_from.map(Into::into),
        }
    }
}

/// An up-to-date peer a healing rank downloads from.
#[pyclass(module = "phalanx._core", frozen, get_all)]
#[derive(Clone, Debug)]
pub struct RecoverySource {
    pub(super) replica_id: String,
    pub(super) state_address: String,
}

/// One rank's answer to a quorum request.
#[pyclass(module = "phalanx._core", frozen, get_all)]
#[derive(Clone, Debug)]
pub struct QuorumResult {
    pub(super) quorum_id: u64,
    pub(super) replica_rank: u32,
    pub(super) replica_world_size: u32,
    pub(super) participants: Vec<Member>,
    pub(super) max_step: i64,
    pub(super) max_state_quorum_id: u64,
    pub(super) heal: bool,
    pub(super) recovery_sources: Vec<RecoverySource>,
    pub(super) contributors: u32,
    pub(super) serves_healers: bool,
    pub(super) store_address: String,
    pub(super) store_prefix: String,
    /// The lineage the quorum trains in (see `StateIdentity`).
    pub(super) lineage: u64,
    /// Set when this quorum starts a new lineage: the newest state, given up.
    pub(super) rolled_back_from: Option<StateIdentity>,
    /// This group's rank among the contributors; None while it heals.
    pub(super) participating_rank: Option<u32>,
}

impl From<proto::ManagerQuorumResponse> for QuorumResult {
    fn from(r: proto::ManagerQuorumResponse) -> Self {
        QuorumResult {
            quorum_id: r.quorum_id,
            replica_rank: r.replica_rank,
            replica_world_size: r.replica_world_size,
            participants: r.participants.into_iter().map(Into::into).collect(),
            max_step: r.max_step,
            max_state_quorum_id: r.max_state_quorum_id,
            heal: r.heal,
            recovery_sources: r
                .recovery_sources
                .into_iter()
                .map(|s| RecoverySource {
                    replica_id: s.replica_id,
                    state_address: s.state_address,
                })
                .collect(),
            contributors: r.contributors,
            serves_healers: r.serves_healers,
            store_address: r.store_address,
            store_prefix: r.store_prefix,
            lineage: r.lineage,
            rolled_back_from: r.rolled_back_from.map(Into::into),
            participating_rank: r.participating_rank,
        }
    }
}

/// A group's decision on a step.
#[pyclass(module = "phalanx._core", frozen, get_all)]
#[derive(Clone, Debug)]
pub struct CommitDecision {
    /// Every rank voted yes in time and the group still counts in the step's quorum.
    pub(super) commit: bool,
    /// Some rank of the group holds a torn state (its heal failed part way).
    pub(super) torn: bool,
    /// The step commits and the group snapshots the state it commits.
    pub(super) snapshot: bool,
}

#[pymethods]
impl CommitDecision {
    fn __bool__(&self) -> bool {
        self.commit
    }

    fn __repr__(&self) -> String {
        format!("{self:?}")
    }
}

/// Members of the current quorum died; abandon the step in flight.
#[pyclass(module = "phalanx._core", frozen, get_all)]
#[derive(Clone, Debug)]
pub struct MembershipLost {
    pub(super) quorum_id: u64,
    pub(super) lost: Vec<String>,
    pub(super) cause: String,
}

impl From<proto::MembershipLost> for MembershipLost {
    fn from(m: proto::MembershipLost) -> Self {
        MembershipLost {
            quorum_id: m.quorum_id,
            lost: m.lost,
            cause: m.cause,
        }
    }
}

#[pyclass(module = "phalanx._core", frozen, get_all)]
#[derive(Clone, Debug)]
pub struct ReplicaStatus {
    pub(super) replica_id: String,
    pub(super) connected: bool,
    pub(super) joined: bool,
    pub(super) in_quorum: bool,
    pub(super) step: i64,
    pub(super) heartbeat_age_ms: u64,
    pub(super) peer: String,
    pub(super) progress_age_ms: u64,
    pub(super) step_time_ms: u64,
    pub(super) straggler: bool,
}

#[pyclass(module = "phalanx._core", frozen, get_all)]
#[derive(Clone, Debug)]
pub struct LighthouseStatus {
    pub(super) quorum_id: u64,
    pub(super) quorum_members: Vec<String>,
    pub(super) replicas: Vec<ReplicaStatus>,
    pub(super) waiting_for: String,
    pub(super) quorums_issued: u64,
    pub(super) uptime_ms: u64,
    pub(super) min_replicas: u32,
    pub(super) join_timeout_ms: u64,
    pub(super) heartbeat_timeout_ms: u64,
}

debug_repr!(
    Member,
    Quorum,
    RecoverySource,
    QuorumResult,
    StateIdentity,
    MembershipLost,
    ReplicaStatus,
    LighthouseStatus
);

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Member>()?;
    m.add_class::<Quorum>()?;
    m.add_class::<RecoverySource>()?;
    m.add_class::<QuorumResult>()?;
    m.add_class::<StateIdentity>()?;
    m.add_class::<CommitDecision>()?;
    m.add_class::<MembershipLost>()?;
    m.add_class::<LighthouseStatus>()?;
    m.add_class::<ReplicaStatus>()?;
    Ok(())
}
