//! The same agent ELF under QEMU, for comparison with the built-in VMM: the one QEMU command
//! line, shared with `cargo xtask` and the demo, lives in `vmtsync_launch::qemu`.

pub use vmtsync_launch::qemu::*;
