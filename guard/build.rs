//! Fingerprints the guard's own sources (`BATON_GUARD_SOURCE`, answered by `baton-guard
//! source`), so a `baton-guard` built from other sources than the code beside it is told apart:
//! the guard ships as a separate build (scripts/build-guard) that `cargo test` does not redo.

use std::path::{Path, PathBuf};

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("reading guard/src") {
        let path = entry.expect("reading guard/src").path();
        if path.is_dir() {
            files(&path, out);
        } else {
            out.push(path);
        }
    }
}

fn main() {
    let mut all = vec![PathBuf::from("Cargo.toml"), PathBuf::from("build.rs")];
    files(Path::new("src"), &mut all);
    all.sort();
    // FNV-1a over names and contents: the same sources give the same value in every build.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for path in &all {
        let name = path.to_string_lossy().into_owned().into_bytes();
        let body = std::fs::read(path).expect("reading a guard source");
        for byte in name.into_iter().chain([0]).chain(body) {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    println!("cargo:rustc-env=BATON_GUARD_SOURCE={hash:016x}");
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=Cargo.toml");
    println!("cargo:rerun-if-changed=build.rs");
}
