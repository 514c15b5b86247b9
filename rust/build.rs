fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A vendored protoc keeps the build free of system packages.
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    println!("cargo:rerun-if-changed=rust/proto/phalanx.proto");
    tonic_prost_build::configure()
        // Shared, not copied: one encoded quorum goes to every member of a round.
        .bytes(".phalanx.v1.LighthouseQuorumResponse.quorum")
        .bytes(".phalanx.v1.QuorumAnswer.quorum")
        // Store values pass through without a copy.
        .bytes(".phalanx.v1.StoreSetRequest.value")
        .bytes(".phalanx.v1.StoreGetResponse.value")
        .bytes(".phalanx.v1.StoreCompareSetRequest.desired")
        .bytes(".phalanx.v1.StoreCompareSetResponse.current")
        .bytes(".phalanx.v1.StoreWaitResponse.values")
        .compile_protos(&["rust/proto/phalanx.proto"], &["rust/proto"])?;
    Ok(())
}
