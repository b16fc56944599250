//! Fixtures the unit tests of several modules share.

use std::path::{Path, PathBuf};

use tempfile::TempDir;

/// A fresh directory whose name starts with `prefix` (each module's tests give their own, so
/// a leftover says whose it is), removed with its contents when dropped.
pub(crate) fn temp_dir(prefix: &str) -> TempDir {
    tempfile::Builder::new().prefix(prefix).tempdir().unwrap()
}

/// `name` in a fresh [`temp_dir`], with the guard that removes it.
pub(crate) fn temp_path(prefix: &str, name: &str) -> (TempDir, PathBuf) {
    let dir = temp_dir(prefix);
    let path = dir.path().join(name);
    (dir, path)
}

/// `name` in a fresh [`temp_dir`], written with `contents`, with the guard that removes it.
pub(crate) fn temp_file(
    prefix: &str,
    name: &str,
    contents: impl AsRef<[u8]>,
) -> (TempDir, PathBuf) {
    let (dir, path) = temp_path(prefix, name);
    std::fs::write(&path, contents).unwrap();
    (dir, path)
}

/// Writes `contents` to `rel` below `root`, creating the directories on the way (the debugfs
/// and /proc fixture trees).
pub(crate) fn write_fixture(root: &Path, rel: &str, contents: impl AsRef<[u8]>) {
    let path = root.join(rel);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, contents).unwrap();
}
