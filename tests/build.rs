//! Compiles the recorder bench's C contenders (tests/recorder-bench/bench.c with the C recorder
//! from capi/) into the `vmtsync-recorder-bench` binary. With `VMTSYNC_BARECTF` naming a
//! barectf 3.1.2 executable (`cargo xtask setup` installs one in the project's cache and
//! `cargo xtask bench` sets it), barectf generates its tracer from
//! tests/recorder-bench/barectf.yaml into OUT_DIR and the bench times it too; without it the
//! binary says barectf is missing.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    let root = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("set by cargo"));
    let bench = root.join("recorder-bench");
    let capi = root.join("../capi");
    for f in [
        bench.join("bench.c"),
        bench.join("barectf.yaml"),
        capi.join("include/vmtsync.h"),
        capi.join("src/vmtsync.c"),
    ] {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    println!("cargo:rerun-if-env-changed=VMTSYNC_BARECTF");

    let mut build = cc::Build::new();
    build
        .file(bench.join("bench.c"))
        .file(capi.join("src/vmtsync.c"))
        .include(capi.join("include"))
        .opt_level(2)
        .flag("-std=gnu11")
        .warnings(true)
        // barectf's generated tracer keeps helpers this configuration never calls.
        .flag("-Wno-unused-function");
    if let Some(barectf) = env::var_os("VMTSYNC_BARECTF").filter(|s| !s.is_empty()) {
        let gen_dir = out.join("barectf");
        std::fs::create_dir_all(&gen_dir).expect("OUT_DIR is writable");
        let status = Command::new(&barectf)
            .arg("generate")
            .arg("--code-dir")
            .arg(&gen_dir)
            .arg("--headers-dir")
            .arg(&gen_dir)
            .arg("--metadata-dir")
            .arg(&gen_dir)
            .arg(bench.join("barectf.yaml"))
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "run VMTSYNC_BARECTF={}: {e}",
                    PathBuf::from(&barectf).display()
                )
            });
        assert!(status.success(), "barectf generate failed: {status}");
        build
            .file(gen_dir.join("vbt.c"))
            .include(&gen_dir)
            .define("VB_HAVE_BARECTF", None);
    }
    build.compile("vmtsync_recorder_bench");
}
