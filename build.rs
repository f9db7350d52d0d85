fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    let descriptors = out.join("baton_descriptor.bin");
    tonic_prost_build::configure()
        .file_descriptor_set_path(&descriptors)
        // Well-known types with serde, so the HTTP API speaks proto3's JSON mapping.
        .compile_well_known_types(true)
        .extern_path(".google.protobuf", "::pbjson_types")
        .compile_protos(
            &[
                "proto/baton/v1/cluster.proto",
                "proto/baton/v1/jobs.proto",
                "proto/baton/v1/schedules.proto",
                "proto/baton/v1/workers.proto",
            ],
            &["proto"],
        )?;
    // Field names as in the .proto files (`job_id`), as the CLI's `-o json` prints them; every
    // field present, so a reader need not know proto3's defaults; unknown fields refused.
    pbjson_build::Builder::new()
        .register_descriptors(&std::fs::read(&descriptors)?)?
        .preserve_proto_field_names()
        .emit_fields()
        .build(&[".baton.v1"])?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
