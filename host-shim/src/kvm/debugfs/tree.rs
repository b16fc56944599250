//! [`KvmDebugfs`]: the tree, VM discovery, and reading a VM that may be torn down meanwhile.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::entries::{VcpuState, VmDir};
use super::error::{DebugfsError, io_error, is_permission};
use super::files::{open_dir, read_vcpu_at};
use super::parse::{parse_vcpu_dir_name, parse_vm_dir_name};

/// The KVM debugfs directory on a standard Linux host.
pub const DEFAULT_KVM_DEBUGFS: &str = "/sys/kernel/debug/kvm";

/// How long to wait before deciding that a missing file means a broken tree rather than a
/// VM being torn down (see [`KvmDebugfs::read_vm`]).
pub const TEARDOWN_RECHECK: std::time::Duration = std::time::Duration::from_millis(5);

/// How many times [`TEARDOWN_RECHECK`] (doubling) is waited before a missing file is believed.
pub const TEARDOWN_RECHECKS: u32 = 6;

/// A KVM debugfs tree (normally [`DEFAULT_KVM_DEBUGFS`]; any directory for fixtures).
#[derive(Clone, Debug)]
pub struct KvmDebugfs {
    root: PathBuf,
}

impl KvmDebugfs {
    /// Opens the tree at `root` (e.g. `/sys/kernel/debug/kvm`), checking that it exists so the
    /// caller gets the "mount debugfs" advice up front rather than an empty VM list.
    ///
    /// # Errors
    /// [`DebugfsError::NotMounted`], [`DebugfsError::NoKvmDir`], [`DebugfsError::PermissionDenied`].
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, DebugfsError> {
        let root = root.into();
        match fs::metadata(&root) {
            Ok(m) if m.is_dir() => Ok(Self { root }),
            Ok(_) => Err(DebugfsError::NotAFile {
                path: root,
                kind: "not a directory",
            }),
            Err(e) if is_permission(&e) => Err(DebugfsError::PermissionDenied { path: root }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                if debugfs_parent_unmounted(&root) {
                    Err(DebugfsError::NotMounted { root })
                } else {
                    Err(DebugfsError::NoKvmDir { root })
                }
            }
            Err(source) => Err(DebugfsError::Io { path: root, source }),
        }
    }

    /// The root directory.
    #[must_use]
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Lists the VM directories, sorted by (pid, fd). Entries that are not `<pid>-<fd>[-…]`
    /// directories (the per-VM statistics files) are skipped.
    ///
    /// # Errors
    /// When the root cannot be listed.
    pub fn vms(&self) -> Result<Vec<VmDir>, DebugfsError> {
        let mut out = Vec::new();
        for entry in read_dir(&self.root)? {
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            let Some(id) = parse_vm_dir_name(&name) else {
                continue;
            };
            // file_type() comes from readdir's d_type: no extra syscall on debugfs/tmpfs.
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            out.push(VmDir {
                id,
                path: entry.path(),
            });
        }
        out.sort_by_key(|v| v.id);
        Ok(out)
    }

    /// Reads every vCPU of a VM, sorted by vCPU id.
    ///
    /// The kernel removes a VM's directory bottom-up when the VM is destroyed, so a reader
    /// can meet a `vcpuN` directory that has already lost its `tsc-offset`. A missing file is
    /// therefore re-checked after [`TEARDOWN_RECHECK`], with doubling pauses up to
    /// [`TEARDOWN_RECHECKS`] times: if the VM directory is gone by then it exited; if the file
    /// is still missing, the tree is broken.
    ///
    /// # Errors
    /// [`DebugfsError::VmExited`] if the VM exits while being read; parse and I/O errors of
    /// any file.
    pub fn read_vm(&self, vm: &VmDir) -> Result<Vec<VcpuState>, DebugfsError> {
        recheck_teardown(&vm.path, || self.read_vm_once(vm))
    }

    fn read_vm_once(&self, vm: &VmDir) -> Result<Vec<VcpuState>, DebugfsError> {
        let entries = match fs::read_dir(&vm.path) {
            Ok(rd) => rd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(DebugfsError::VmExited {
                    path: vm.path.clone(),
                });
            }
            Err(e) => return Err(io_error(&vm.path, e)),
        };
        let mut ids = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| io_error(&vm.path, e))?;
            let name = entry.file_name();
            // parse_vcpu_dir_name rejects leading zeros, so `vcpu<id>` is this entry's name.
            let Some(id) = name.to_str().and_then(parse_vcpu_dir_name) else {
                continue;
            };
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                ids.push(id);
            }
        }
        ids.sort_unstable();
        let vmf = open_dir(&vm.path)?;
        let mut path = vm.path.clone();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            path.push(format!("vcpu{id}"));
            let r = read_vcpu_at(&vmf, &path, id);
            path.pop();
            match r {
                Ok(v) => out.push(v),
                Err(DebugfsError::VmExited { .. }) => {
                    return Err(DebugfsError::VmExited {
                        path: vm.path.clone(),
                    });
                }
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }
}

/// Runs `read` and, if it fails the way a VM being torn down makes reads fail (a missing file,
/// or an I/O error such as the `EIO` debugfs returns for a file whose VM was destroyed between
/// `openat` and `read`), looks again after [`TEARDOWN_RECHECK`], doubling the pause up to
/// [`TEARDOWN_RECHECKS`] times (≈ 0.3 s in all): a vanished `vm_path` means the VM exited; a
/// read that succeeds stands; an error that outlasts every recheck is the tree's real state.
/// One pause is not enough on a loaded host, where the bottom-up removal of a VM's directory
/// can take longer than the first few milliseconds.
fn recheck_teardown<T>(
    vm_path: &Path,
    mut read: impl FnMut() -> Result<T, DebugfsError>,
) -> Result<T, DebugfsError> {
    let mut r = read();
    let mut pause = TEARDOWN_RECHECK;
    for _ in 0..TEARDOWN_RECHECKS {
        if !matches!(
            r,
            Err(DebugfsError::Missing { .. } | DebugfsError::Io { .. })
        ) {
            break;
        }
        std::thread::sleep(pause);
        pause = pause.saturating_mul(2);
        if !vm_path.exists() {
            return Err(DebugfsError::VmExited {
                path: vm_path.to_path_buf(),
            });
        }
        r = read();
    }
    r
}

fn read_dir(path: &Path) -> Result<Vec<fs::DirEntry>, DebugfsError> {
    let rd = fs::read_dir(path).map_err(|e| io_error(path, e))?;
    rd.collect::<Result<Vec<_>, _>>()
        .map_err(|e| io_error(path, e))
}

/// True if `root`'s parent (the debugfs mount point) exists but is empty or missing, which is
/// what an unmounted debugfs looks like.
fn debugfs_parent_unmounted(root: &Path) -> bool {
    let Some(parent) = root.parent() else {
        return false;
    };
    match fs::read_dir(parent) {
        Ok(mut rd) => rd.next().is_none(),
        Err(e) => e.kind() == io::ErrorKind::NotFound,
    }
}

#[cfg(test)]
mod tests {
    use super::super::entries::Scaling;
    use super::super::error::settle_teardown;
    use super::*;

    #[test]
    fn vm_exiting_between_listing_and_reading_is_reported_as_exited() {
        let tmp = crate::testutil::temp_dir("vmtsync-exit-");
        let root = tmp.path();
        crate::testutil::write_fixture(root, "kvm/77-5/vcpu0/tsc-offset", "-3\n");
        let vcpu0 = root.join("kvm/77-5/vcpu0");
        let d = KvmDebugfs::open(root.join("kvm")).unwrap();
        let vms = d.vms().unwrap();
        assert_eq!(vms.len(), 1);
        let v = d.read_vm(&vms[0]).unwrap();
        assert_eq!(
            (v[0].vcpu, v[0].tsc_offset, v[0].scaling),
            (0, -3, Scaling::ABSENT)
        );
        assert!(v[0].bracket.before <= v[0].bracket.after);
        fs::remove_dir_all(root.join("kvm/77-5")).unwrap();
        let e = d.read_vm(&vms[0]).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "{} vanished while reading it: the VM exited",
                vms[0].path.display()
            )
        );
        // A vCPU directory whose files vanish (VM torn down mid-read) is "exited", not
        // "identity scaling" or "missing tsc-offset".
        fs::create_dir_all(&vcpu0).unwrap();
        let vmf = open_dir(&root.join("kvm/77-5")).unwrap();
        fs::remove_dir_all(root.join("kvm/77-5")).unwrap();
        assert!(matches!(
            read_vcpu_at(&vmf, &vcpu0, 0),
            Err(DebugfsError::VmExited { .. })
        ));
    }

    /// A vCPU directory held open reads what the path reads, sees each new value, and once
    /// its VM's tree is removed says the VM exited, also when a new VM's tree takes the same
    /// path (it never reads the other VM's files).
    #[test]
    fn a_held_vcpu_directory_reads_anew_and_sees_its_vm_exit() {
        let tmp = crate::testutil::temp_dir("vmtsync-held-");
        let root = tmp.path();
        crate::testutil::write_fixture(root, "kvm/77-5/vcpu0/tsc-offset", "-3\n");
        crate::testutil::write_fixture(root, "kvm/77-5/vcpu0/guest_mode", "0\n");
        let vcpu0 = root.join("kvm/77-5/vcpu0");
        let held = super::super::VcpuDir::open(&vcpu0, 0).unwrap();
        let a = held.read().unwrap();
        let b = super::super::read_vcpu(&vcpu0, 0).unwrap();
        assert_eq!(
            (a.vcpu, a.tsc_offset, a.scaling, a.guest_mode),
            (b.vcpu, b.tsc_offset, b.scaling, b.guest_mode)
        );
        assert_eq!((a.tsc_offset, a.guest_mode), (-3, Some(false)));
        crate::testutil::write_fixture(root, "kvm/77-5/vcpu0/tsc-offset", "12\n");
        assert_eq!(held.read().unwrap().tsc_offset, 12);
        fs::remove_dir_all(root.join("kvm/77-5")).unwrap();
        assert!(matches!(held.read(), Err(DebugfsError::VmExited { .. })));
        crate::testutil::write_fixture(root, "kvm/77-5/vcpu0/tsc-offset", "99\n");
        assert!(matches!(held.read(), Err(DebugfsError::VmExited { .. })));
        assert_eq!(super::super::read_vcpu(&vcpu0, 0).unwrap().tsc_offset, 99);
        assert!(matches!(
            super::super::VcpuDir::open(&root.join("kvm/77-5/vcpu1"), 1),
            Err(DebugfsError::VmExited { .. })
        ));
    }

    /// The mapping-only read gives what a full read gives of the mapping, with the scaling
    /// files absent and present (a new ratio seen, the fraction bits kept from the open),
    /// reads no thread, and sees the VM exit.
    #[test]
    fn a_mapping_read_reads_the_mapping_of_a_full_read() {
        let tmp = crate::testutil::temp_dir("vmtsync-mapping-");
        let root = tmp.path();
        crate::testutil::write_fixture(root, "kvm/77-5/vcpu0/tsc-offset", "-3\n");
        crate::testutil::write_fixture(root, "kvm/77-5/vcpu0/guest_mode", "0\n");
        crate::testutil::write_fixture(root, "kvm/77-5/vcpu0/pid", "4242\n");
        crate::testutil::write_fixture(root, "kvm/77-5/vcpu1/tsc-offset", "7\n");
        crate::testutil::write_fixture(root, "kvm/77-5/vcpu1/guest_mode", "1\n");
        crate::testutil::write_fixture(root, "kvm/77-5/vcpu1/tsc-scaling-ratio", "3\n");
        crate::testutil::write_fixture(root, "kvm/77-5/vcpu1/tsc-scaling-ratio-frac-bits", "48\n");
        for v in [0, 1] {
            let path = root.join(format!("kvm/77-5/vcpu{v}"));
            let held = super::super::VcpuDir::open(&path, v).unwrap();
            let (full, light) = (held.read().unwrap(), held.read_mapping().unwrap());
            assert_eq!(
                (
                    light.vcpu,
                    light.tsc_offset,
                    light.scaling,
                    light.guest_mode
                ),
                (full.vcpu, full.tsc_offset, full.scaling, full.guest_mode),
                "vCPU {v}"
            );
            assert_eq!(light.thread_pid, None);
        }
        assert_eq!(
            super::super::read_vcpu(&root.join("kvm/77-5/vcpu0"), 0)
                .unwrap()
                .thread_pid,
            Some(4242)
        );
        let scaled = super::super::VcpuDir::open(&root.join("kvm/77-5/vcpu1"), 1).unwrap();
        crate::testutil::write_fixture(root, "kvm/77-5/vcpu1/tsc-scaling-ratio", "5\n");
        crate::testutil::write_fixture(root, "kvm/77-5/vcpu1/tsc-offset", "-9\n");
        let now = scaled.read_mapping().unwrap();
        assert_eq!(
            (now.tsc_offset, now.scaling.ratio, now.scaling.frac_bits),
            (-9, 5, 48)
        );
        fs::remove_dir_all(root.join("kvm/77-5")).unwrap();
        assert!(matches!(
            scaled.read_mapping(),
            Err(DebugfsError::VmExited { .. })
        ));
    }

    fn eio(path: &str, errno: i32) -> DebugfsError {
        DebugfsError::Io {
            path: PathBuf::from(path),
            source: io::Error::from_raw_os_error(errno),
        }
    }

    #[test]
    fn eio_from_a_vanished_vcpu_is_vm_exited_and_otherwise_stays_an_error() {
        let exited = || DebugfsError::VmExited {
            path: PathBuf::from("/k/1-2"),
        };
        for errno in [libc::EIO, libc::ENODEV, libc::ENOENT] {
            let r: Result<(), _> =
                settle_teardown(Err(eio("/k/1-2/vcpu0/pid", errno)), &|| true, &exited);
            assert!(
                matches!(r, Err(DebugfsError::VmExited { .. })),
                "errno {errno}: {r:?}"
            );
            // The directory is still there: a real I/O error, reported as such.
            let r: Result<(), _> =
                settle_teardown(Err(eio("/k/1-2/vcpu0/pid", errno)), &|| false, &exited);
            assert!(
                matches!(r, Err(DebugfsError::Io { .. })),
                "errno {errno}: {r:?}"
            );
        }
        // Other errors never turn into "exited", even when the directory is gone.
        let r: Result<(), _> = settle_teardown(
            Err(eio("/k/1-2/vcpu0/pid", libc::EINVAL)),
            &|| true,
            &exited,
        );
        assert!(matches!(r, Err(DebugfsError::Io { .. })), "{r:?}");
        assert_eq!(settle_teardown(Ok(7), &|| true, &exited).unwrap(), 7);
    }

    #[test]
    fn read_vm_rechecks_after_an_io_error() {
        // The VM directory is gone after an EIO: the VM exited (this was exit 1 before).
        let gone = Path::new("/nonexistent/vmtsync-test/1-2");
        let mut calls = 0;
        let r: Result<(), _> = recheck_teardown(gone, || {
            calls += 1;
            Err(eio(
                "/nonexistent/vmtsync-test/1-2/vcpu0/tsc-offset",
                libc::EIO,
            ))
        });
        assert!(
            matches!(r, Err(DebugfsError::VmExited { ref path }) if path == gone),
            "{r:?}"
        );
        assert_eq!(calls, 1);
        // Still there: read again, and the second result stands.
        let here = std::env::temp_dir();
        let mut calls = 0;
        let r = recheck_teardown(&here, || {
            calls += 1;
            if calls == 1 {
                Err(eio("x", libc::EIO))
            } else {
                Ok(calls)
            }
        });
        assert_eq!(r.unwrap(), 2);
        // Errors that are not teardown-like are not retried.
        let mut calls = 0;
        let r: Result<(), _> = recheck_teardown(gone, || {
            calls += 1;
            Err(DebugfsError::PermissionDenied {
                path: PathBuf::from("x"),
            })
        });
        assert!(matches!(r, Err(DebugfsError::PermissionDenied { .. })));
        assert_eq!(calls, 1);
    }
}
