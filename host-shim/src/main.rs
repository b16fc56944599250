//! The `vmtsync` command-line tool; everything lives in the library's [`vmtsync::cli`].

#![forbid(unsafe_code)]

use std::process::ExitCode;

fn main() -> ExitCode {
    vmtsync::cli::main()
}
