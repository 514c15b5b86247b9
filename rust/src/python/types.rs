//! What the lighthouse and the manager server answer, as frozen Python objects: the
//! protocol's own records (`rust/build.rs` makes them Python classes), under the
//! names Python knows them by.

use pyo3::prelude::*;

pub use crate::proto::{
    ManagerQuorumResponse as QuorumResult, Member, MembershipLost, Quorum, RecoverySource,
    ReplicaStatus, ShouldCommitResponse as CommitDecision, StateIdentity,
    StatusResponse as LighthouseStatus,
};

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

#[pymethods]
impl CommitDecision {
    /// True when the step commits.
    fn __bool__(&self) -> bool {
        self.commit
    }

    fn __repr__(&self) -> String {
        format!("{self:?}")
    }
}

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
