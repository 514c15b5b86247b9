fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A vendored protoc keeps the build free of system packages.
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    println!("cargo:rerun-if-changed=rust/proto/phalanx.proto");
    let mut config = tonic_prost_build::configure();
    // What the lighthouse and the manager server answer reaches Python as the very
    // records of the wire, frozen (`rust/src/python/types.rs`), never a copy.
    for (message, name) in PYTHON_RECORDS {
        let class = format!(
            "#[cfg_attr(feature = \"python\", pyo3::pyclass(module = \"phalanx._core\", \
             name = \"{name}\", frozen, get_all))]"
        );
        config = config.type_attribute(format!(".phalanx.v1.{message}"), class);
    }
    config
        // Shared, not copied: one encoded quorum goes to every member of a round.
        .bytes(".phalanx.v1.LighthouseQuorumResponse.quorum")
        .bytes(".phalanx.v1.QuorumAnswer.quorum")
        .bytes(".phalanx.v1.QuorumAnswer.update")
        // Store values pass through without a copy.
        .bytes(".phalanx.v1.StoreSetRequest.value")
        .bytes(".phalanx.v1.StoreGetResponse.value")
        .bytes(".phalanx.v1.StoreCompareSetRequest.desired")
        .bytes(".phalanx.v1.StoreCompareSetResponse.current")
        .bytes(".phalanx.v1.StoreWaitResponse.values")
        .compile_protos(&["rust/proto/phalanx.proto"], &["rust/proto"])?;
    Ok(())
}

/// The messages Python receives as they are: (message, its Python class).
const PYTHON_RECORDS: &[(&str, &str)] = &[
    ("Member", "Member"),
    ("StateIdentity", "StateIdentity"),
    ("Quorum", "Quorum"),
    ("RecoverySource", "RecoverySource"),
    ("ManagerQuorumResponse", "QuorumResult"),
    ("ShouldCommitResponse", "CommitDecision"),
    ("MembershipLost", "MembershipLost"),
    ("ReplicaStatus", "ReplicaStatus"),
    ("StatusResponse", "LighthouseStatus"),
];
