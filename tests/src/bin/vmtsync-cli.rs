//! The `vmtsync` command line built into the tests crate, so integration tests can run the
//! real program as a process (Cargo exposes only a package's own binaries to its tests).

use std::process::ExitCode;

fn main() -> ExitCode {
    vmtsync::cli::main()
}
