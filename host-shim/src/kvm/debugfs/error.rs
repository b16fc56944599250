//! Everything that can go wrong reading KVM debugfs, and the mapping of I/O errors onto it.

use std::io;
use std::path::{Path, PathBuf};

use thiserror::Error;

use super::entries::DEBUGFS_MOUNTPOINT;

/// Everything that can go wrong reading KVM debugfs; each message says what to do next.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum DebugfsError {
    /// debugfs is not mounted at the standard mount point.
    #[error(
        "{root} does not exist: debugfs is not mounted (as root: mount -t debugfs none {DEBUGFS_MOUNTPOINT}, or rerun with --mount-debugfs)"
    )]
    NotMounted {
        /// The KVM debugfs root that was looked for.
        root: PathBuf,
    },
    /// debugfs is mounted but has no `kvm` directory, or a custom root does not exist.
    #[error(
        "{root} does not exist: is the kvm module loaded (lsmod | grep kvm), or is --debugfs-root wrong?"
    )]
    NoKvmDir {
        /// The KVM debugfs root that was looked for.
        root: PathBuf,
    },
    /// The caller may not read debugfs.
    #[error(
        "permission denied reading {path}: KVM debugfs is readable by root only (run as root, e.g. with sudo)"
    )]
    PermissionDenied {
        /// The path that refused.
        path: PathBuf,
    },
    /// A VM directory disappeared while it was being read.
    #[error("{path} vanished while reading it: the VM exited")]
    VmExited {
        /// The VM's debugfs directory.
        path: PathBuf,
    },
    /// A file that every vCPU directory has is missing.
    #[error("{path} is missing: every KVM vCPU directory has it (is the debugfs root right?)")]
    Missing {
        /// The missing file.
        path: PathBuf,
    },
    /// A path that should be a regular file is something else (directory, FIFO, socket, …).
    #[error("{path} is not a regular file ({kind}): is the debugfs root right?")]
    NotAFile {
        /// The offending path.
        path: PathBuf,
        /// What it is instead.
        kind: &'static str,
    },
    /// The file's bytes are not what the kernel writes there.
    #[error("malformed {path}: expected {expected}, found \"{shown}\"")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What the kernel writes there.
        expected: &'static str,
        /// The bytes found, escaped (and cut after 64 bytes).
        shown: String,
    },
    /// Only one of the two scaling files exists; the kernel creates both or neither.
    #[error("{present} exists but {missing} does not: the kernel creates both or neither")]
    InconsistentScaling {
        /// The scaling file that exists.
        present: PathBuf,
        /// The scaling file that does not.
        missing: PathBuf,
    },
    /// Any other I/O error.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The path being read.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

pub(super) fn is_permission(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::PermissionDenied || e.raw_os_error() == Some(libc::EPERM)
}

pub(super) fn io_error(path: &Path, e: io::Error) -> DebugfsError {
    if is_permission(&e) {
        DebugfsError::PermissionDenied {
            path: path.to_path_buf(),
        }
    } else {
        DebugfsError::Io {
            path: path.to_path_buf(),
            source: e,
        }
    }
}

/// True for the errors a debugfs file gives when its VM is destroyed under the reader:
/// `EIO`/`ENODEV` from `read` on a file being removed, `ENOENT` from a path lookup racing the
/// removal.
pub(super) fn is_teardown_error(e: &DebugfsError) -> bool {
    matches!(e, DebugfsError::Io { source, .. }
        if matches!(source.raw_os_error(), Some(libc::EIO | libc::ENODEV | libc::ENOENT)))
}

/// Turns a teardown-like I/O error into [`DebugfsError::VmExited`] when `gone()` confirms the
/// vCPU directory vanished; any other error, or a directory still present, passes through.
pub(super) fn settle_teardown<T>(
    r: Result<T, DebugfsError>,
    gone: &dyn Fn() -> bool,
    exited: &dyn Fn() -> DebugfsError,
) -> Result<T, DebugfsError> {
    match r {
        Err(e) if is_teardown_error(&e) && gone() => Err(exited()),
        r => r,
    }
}
