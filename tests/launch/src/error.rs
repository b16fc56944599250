//! The crate's one error type.

/// Why a launch step failed. Messages say what to do next.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// A program could not be started at all (not installed, not on `PATH`).
    #[error("could not start `{cmd}`: {why}")]
    Spawn {
        /// The command line.
        cmd: String,
        /// The OS error.
        why: String,
    },
    /// A program ran and failed.
    #[error("`{cmd}` failed ({status}){detail}")]
    Failed {
        /// The command line.
        cmd: String,
        /// Its exit status.
        status: String,
        /// The tail of its stderr when it was captured, prefixed with a newline.
        detail: String,
    },
    /// A prerequisite is missing and could not be installed from here.
    #[error("{0}")]
    Missing(String),
}
