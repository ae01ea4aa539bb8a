//! Generates the dflash.v1 gRPC code from `proto/` at the workspace root.
//! A vendored `protoc` keeps the build free of system packages.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; nothing else reads the environment concurrently.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let files = ["common.proto", "coordinator.proto", "drafter.proto"].map(|f| root.join("dflash/v1").join(f));
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    tonic_prost_build::configure()
        // Payload chunks stay `Bytes` end to end: one copy less per side.
        .bytes(".")
        .compile_protos(&files, &[root])?;
    Ok(())
}
