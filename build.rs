fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("baton_descriptor.bin"))
        .compile_protos(
            &[
                "proto/baton/v1/cluster.proto",
                "proto/baton/v1/jobs.proto",
                "proto/baton/v1/schedules.proto",
                "proto/baton/v1/workers.proto",
            ],
            &["proto"],
        )?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
