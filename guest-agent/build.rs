//! Passes the linker script to the linker. Cargo does not track linker scripts itself, so the
//! `rerun-if-changed` lines make an edit to `link.ld` relink the agent.

fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:rustc-link-arg-bins=-T{dir}/link.ld");
    // defmt's linker script (its build script puts it on the search path): the `.defmt` INFO
    // section holding the interned log strings the host decoder reads, and the marker symbols.
    println!("cargo:rustc-link-arg-bins=-Tdefmt.x");
    println!("cargo:rustc-link-arg-bins=--no-pie");
    println!("cargo:rerun-if-changed=link.ld");
    println!("cargo:rerun-if-changed=build.rs");
}
