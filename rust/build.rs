fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A vendored protoc keeps the build free of system packages.
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    println!("cargo:rerun-if-changed=rust/proto/phalanx.proto");
    tonic_prost_build::configure()
        .compile_protos(&["rust/proto/phalanx.proto"], &["rust/proto"])?;
    Ok(())
}
