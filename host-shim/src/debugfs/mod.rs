//! KVM debugfs discovery and parsing: which VMs exist and each vCPU's exact TSC mapping.
//!
//! Layout (Linux `virt/kvm/kvm_main.c`, `arch/x86/kvm/debugfs.c`):
//! `<root>/<pid>-<fd>/vcpu<N>/{tsc-offset, tsc-scaling-ratio, tsc-scaling-ratio-frac-bits,
//! guest_mode, pid}`. `<pid>` is the process that created the VM, `<fd>` its VM file
//! descriptor; some kernels append more `-suffix` parts, which are ignored. `<N>` is the vCPU
//! id the VMM chose (`KVM_CREATE_VCPU`), **not** the guest's CPU index: ids can be sparse, and
//! this module never maps them by sort order.
//!
//! The scaling files exist only when the CPU can scale the TSC (`has_tsc_control`); when they
//! are absent KVM does not scale, and the reading says so (`scaling_present: false`) while
//! carrying the identity ratio `1 / 2^0`.
//!
//! Every file is read with one bounded read into a stack buffer and parsed strictly: any byte
//! sequence yields a value or a [`DebugfsError`] naming the file and the bytes, never a panic.

use std::ffi::CStr;
use std::fs::{self, File};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};
use thiserror::Error;

use crate::hosttsc::{TscBracket, read_host_tsc};

mod parse;

pub use parse::{parse_i64_contents, parse_u64_contents, parse_vcpu_dir_name, parse_vm_dir_name};
use parse::{show, strip_newline};

/// The KVM debugfs directory on a standard Linux host.
pub const DEFAULT_KVM_DEBUGFS: &str = "/sys/kernel/debug/kvm";

/// Where debugfs is mounted on a standard Linux host.
pub const DEBUGFS_MOUNTPOINT: &str = "/sys/kernel/debug";

/// Per-vCPU file with the signed TSC offset (`"%lld\n"`, arch/x86/kvm/debugfs.c).
pub const TSC_OFFSET_FILE: &CStr = c"tsc-offset";
/// Per-vCPU file with the TSC scaling multiplier (`"%llu\n"`), present only with TSC scaling.
pub const TSC_RATIO_FILE: &CStr = c"tsc-scaling-ratio";
/// Per-vCPU file with the multiplier's fraction bits (`"%llu\n"`: 48 on VMX, 32 on SVM).
pub const TSC_FRAC_FILE: &CStr = c"tsc-scaling-ratio-frac-bits";
/// Per-vCPU file: `1` while the vCPU runs a nested (L2) guest (arch/x86/kvm/debugfs.c).
pub const GUEST_MODE_FILE: &CStr = c"guest_mode";
/// Per-vCPU file with the TID of the thread that last ran the vCPU, `0` if none yet.
pub const THREAD_PID_FILE: &CStr = c"pid";

/// A file-name constant as a path component.
fn os(name: &CStr) -> &std::ffi::OsStr {
    std::os::unix::ffi::OsStrExt::from_bytes(name.to_bytes())
}

/// How long to wait before deciding that a missing file means a broken tree rather than a
/// VM being torn down (see [`KvmDebugfs::read_vm`]).
pub const TEARDOWN_RECHECK: std::time::Duration = std::time::Duration::from_millis(5);

/// How many times [`TEARDOWN_RECHECK`] (doubling) is waited before a missing file is believed.
pub const TEARDOWN_RECHECKS: u32 = 6;

/// The longest file content accepted. A 64-bit decimal with sign and newline is 21 bytes; more
/// than this means the file is not what we think it is.
const MAX_FILE_BYTES: usize = 64;

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

/// A VM's identity in debugfs: the creating process and its VM file descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VmId {
    /// PID of the process that created the VM (the VMM, e.g. QEMU).
    pub pid: u32,
    /// The VM's file descriptor number in that process.
    pub fd: u32,
}

/// A VM directory found under the debugfs root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmDir {
    /// Which VM.
    pub id: VmId,
    /// Its directory.
    pub path: PathBuf,
}

/// The TSC scaling of one vCPU: `guest = offset + (host * ratio) >> frac_bits`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scaling {
    /// The multiplier (`1 << frac_bits` means no scaling).
    pub ratio: u64,
    /// Fraction bits of the multiplier.
    pub frac_bits: u32,
    /// Whether the scaling files exist. When false the kernel does not scale this host's TSC
    /// and `ratio`/`frac_bits` are the identity `1`/`0`.
    pub present: bool,
}

impl Scaling {
    /// Identity scaling, used when the scaling files are absent (no TSC scaling on this CPU).
    pub const ABSENT: Self = Self {
        ratio: 1,
        frac_bits: 0,
        present: false,
    };

    /// True when the ratio is exactly `1 << frac_bits` (guest TSC runs at host rate).
    #[must_use]
    pub fn is_identity(&self) -> bool {
        self.frac_bits < 64 && self.ratio == 1u64 << self.frac_bits
    }
}

/// One vCPU's state as read from debugfs, with the host TSC interval in which it was true.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VcpuState {
    /// The VMM's vCPU id (`vcpu<N>`), not the guest's CPU index.
    pub vcpu: u32,
    /// `tsc-offset`: added to the scaled host TSC to give the guest TSC.
    pub tsc_offset: i64,
    /// The scaling ratio and fraction bits.
    pub scaling: Scaling,
    /// `guest_mode`: `Some(true)` while the vCPU runs a nested guest, in which case offset and
    /// ratio are the combined L0→L2 values, not L1's. `None` if the file is absent.
    pub guest_mode: Option<bool>,
    /// `pid`: TID of the host thread running the vCPU; `None` if absent or not yet run.
    pub thread_pid: Option<u32>,
    /// Host TSC read before the first and after the last file of this vCPU.
    pub bracket: TscBracket,
}

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

/// True for the errors a debugfs file gives when its VM is destroyed under the reader:
/// `EIO`/`ENODEV` from `read` on a file being removed, `ENOENT` from a path lookup racing the
/// removal.
fn is_teardown_error(e: &DebugfsError) -> bool {
    matches!(e, DebugfsError::Io { source, .. }
        if matches!(source.raw_os_error(), Some(libc::EIO | libc::ENODEV | libc::ENOENT)))
}

/// Turns a teardown-like I/O error into [`DebugfsError::VmExited`] when `gone()` confirms the
/// vCPU directory vanished; any other error, or a directory still present, passes through.
fn settle_teardown<T>(
    r: Result<T, DebugfsError>,
    gone: &dyn Fn() -> bool,
    exited: &dyn Fn() -> DebugfsError,
) -> Result<T, DebugfsError> {
    match r {
        Err(e) if is_teardown_error(&e) && gone() => Err(exited()),
        r => r,
    }
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

fn is_permission(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::PermissionDenied || e.raw_os_error() == Some(libc::EPERM)
}

fn io_error(path: &Path, e: io::Error) -> DebugfsError {
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

/// Outcome of reading one small file.
enum Small {
    /// The file's bytes (at most `MAX_FILE_BYTES + 1`, the extra byte flags "overlong").
    Bytes(usize),
    /// The file does not exist.
    Absent,
}

/// Reads at most `MAX_FILE_BYTES + 1` bytes of `name` in the open directory `dir` into `buf`.
/// `path` names the file in errors. Opened relative to the directory (one path component to
/// resolve instead of the whole path: this is most of a scan's cost) and non-blocking, so a
/// FIFO in the tree cannot hang us.
fn read_small(
    dir: &File,
    name: &CStr,
    path: &dyn Fn() -> PathBuf,
    buf: &mut [u8; MAX_FILE_BYTES + 1],
) -> Result<Small, DebugfsError> {
    let fd = match rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(errno) => {
            let e = io::Error::from(errno);
            if e.kind() == io::ErrorKind::NotFound {
                return Ok(Small::Absent);
            }
            return Err(io_error(&path(), e));
        }
    };
    let mut f = File::from(fd);
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => {
                n += k;
                // A regular file returns everything up to the buffer size in one read; the
                // kernel's values end in a newline. Skip the read that would return 0.
                if buf[n - 1] == b'\n' && n < buf.len() {
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.raw_os_error() == Some(libc::EISDIR) => {
                return Err(DebugfsError::NotAFile {
                    path: path(),
                    kind: "a directory",
                });
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(not_a_file(&path(), &f));
            }
            // A debugfs file of an exiting VM can fail with ENODEV/EIO; the caller decides.
            Err(e) => return Err(io_error(&path(), e)),
        }
    }
    if n == 0 {
        // Empty: report a FIFO/socket/device as such rather than as "empty content".
        if let Ok(m) = f.metadata()
            && !m.file_type().is_file()
        {
            return Err(not_a_file(&path(), &f));
        }
    }
    Ok(Small::Bytes(n))
}

fn not_a_file(path: &Path, f: &File) -> DebugfsError {
    let kind = match f.metadata().map(|m| m.file_type()) {
        Ok(t) if t.is_fifo() => "a FIFO",
        Ok(t) if t.is_socket() => "a socket",
        Ok(t) if t.is_char_device() || t.is_block_device() => "a device",
        Ok(t) if t.is_dir() => "a directory",
        _ => "not a regular file",
    };
    DebugfsError::NotAFile {
        path: path.to_path_buf(),
        kind,
    }
}

/// Reads and parses one file of the open directory `dir`; `Ok(None)` if it does not exist.
fn read_parsed<T>(
    dir: &File,
    name: &CStr,
    path: &dyn Fn() -> PathBuf,
    expected: &'static str,
    parse: impl FnOnce(&[u8]) -> Option<T>,
) -> Result<Option<T>, DebugfsError> {
    let mut buf = [0u8; MAX_FILE_BYTES + 1];
    match read_small(dir, name, path, &mut buf)? {
        Small::Absent => Ok(None),
        Small::Bytes(n) => {
            let bytes = &buf[..n];
            let parsed = if n > MAX_FILE_BYTES {
                None
            } else {
                parse(bytes)
            };
            parsed.map(Some).ok_or_else(|| DebugfsError::Malformed {
                path: path(),
                expected,
                shown: show(bytes),
            })
        }
    }
}

/// Reads one vCPU directory (`.../vcpu<id>`), bracketed by host TSC reads.
///
/// # Errors
/// [`DebugfsError::VmExited`] if the directory vanished; [`DebugfsError::Missing`] without
/// `tsc-offset`; parse and I/O errors naming the file.
pub fn read_vcpu(dir: &Path, vcpu: u32) -> Result<VcpuState, DebugfsError> {
    let vm_dir = dir.parent().unwrap_or(dir);
    let vmf = open_dir(vm_dir)?;
    read_vcpu_at(&vmf, dir, vcpu)
}

/// Opens a directory for `openat`; a missing one means the VM exited.
fn open_dir(dir: &Path) -> Result<File, DebugfsError> {
    match File::options()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(dir)
    {
        Ok(f) => Ok(f),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(DebugfsError::VmExited {
            path: dir.to_path_buf(),
        }),
        Err(e) => Err(io_error(dir, e)),
    }
}

/// `vcpu<N>/<name>` as a C string in `buf`, for `openat` relative to the VM directory.
fn rel_name<'a>(buf: &'a mut [u8; 64], vcpu: u32, name: &CStr) -> &'a CStr {
    use std::io::Write;
    let mut cur = io::Cursor::new(&mut buf[..]);
    // "vcpu" + at most 10 digits + "/" + the longest name (28 bytes with NUL) fits in 64.
    let _ = write!(cur, "vcpu{vcpu}/");
    let _ = cur.write_all(name.to_bytes_with_nul());
    let n = usize::try_from(cur.position()).unwrap_or(0);
    // No interior NUL can occur (decimal digits and constant names), so this never falls back.
    CStr::from_bytes_with_nul(&buf[..n]).unwrap_or(c"")
}

/// Reads vCPU `vcpu` of the VM whose directory is open as `vmf`; `dir` is the vCPU
/// directory's path, used in messages and to tell "absent" from "VM exited".
fn read_vcpu_at(vmf: &File, dir: &Path, vcpu: u32) -> Result<VcpuState, DebugfsError> {
    let exited = || DebugfsError::VmExited {
        path: dir.parent().unwrap_or(dir).to_path_buf(),
    };
    let mut nb = [0u8; 64];
    let dirf = vmf;
    let p_off = || dir.join(os(TSC_OFFSET_FILE));
    let p_ratio = || dir.join(os(TSC_RATIO_FILE));
    let p_frac = || dir.join(os(TSC_FRAC_FILE));
    let p_gm = || dir.join(os(GUEST_MODE_FILE));
    let p_pid = || dir.join(os(THREAD_PID_FILE));

    let before = read_host_tsc();
    let offset = read_parsed(
        dirf,
        rel_name(&mut nb, vcpu, TSC_OFFSET_FILE),
        &p_off,
        "a signed decimal integer",
        parse_i64_contents,
    );
    let ratio = read_parsed(
        dirf,
        rel_name(&mut nb, vcpu, TSC_RATIO_FILE),
        &p_ratio,
        "a non-zero unsigned decimal integer",
        |b| parse_u64_contents(b).filter(|&r| r != 0),
    );
    let frac = read_parsed(
        dirf,
        rel_name(&mut nb, vcpu, TSC_FRAC_FILE),
        &p_frac,
        "an integer from 0 to 63",
        |b| {
            parse_u64_contents(b)
                .filter(|&f| f < 64)
                .and_then(|f| u32::try_from(f).ok())
        },
    );
    let guest_mode = read_parsed(
        dirf,
        rel_name(&mut nb, vcpu, GUEST_MODE_FILE),
        &p_gm,
        "0 or 1",
        |b| match strip_newline(b) {
            b"0" => Some(false),
            b"1" => Some(true),
            _ => None,
        },
    );
    let thread = read_parsed(
        dirf,
        rel_name(&mut nb, vcpu, THREAD_PID_FILE),
        &p_pid,
        "a thread id (unsigned decimal)",
        |b| parse_u64_contents(b).and_then(|p| u32::try_from(p).ok()),
    );
    let after = read_host_tsc();

    // Any absent file may mean the VM exited mid-read: check before believing "absent".
    let gone = || !dir.exists();
    let offset = settle_teardown(offset, &gone, &exited);
    let ratio = settle_teardown(ratio, &gone, &exited);
    let frac = settle_teardown(frac, &gone, &exited);
    let guest_mode = settle_teardown(guest_mode, &gone, &exited);
    let thread = settle_teardown(thread, &gone, &exited);
    let tsc_offset = match offset? {
        Some(o) => o,
        None if gone() => return Err(exited()),
        None => return Err(DebugfsError::Missing { path: p_off() }),
    };
    let (ratio, frac, guest_mode, thread) = (ratio?, frac?, guest_mode?, thread?);
    if (ratio.is_none() || frac.is_none() || guest_mode.is_none() || thread.is_none()) && gone() {
        return Err(exited());
    }
    let scaling = match (ratio, frac) {
        (Some(ratio), Some(frac_bits)) => Scaling {
            ratio,
            frac_bits,
            present: true,
        },
        (None, None) => Scaling::ABSENT,
        (Some(_), None) => {
            return Err(DebugfsError::InconsistentScaling {
                present: p_ratio(),
                missing: p_frac(),
            });
        }
        (None, Some(_)) => {
            return Err(DebugfsError::InconsistentScaling {
                present: p_frac(),
                missing: p_ratio(),
            });
        }
    };
    Ok(VcpuState {
        vcpu,
        tsc_offset,
        scaling,
        guest_mode,
        thread_pid: thread.filter(|&t| t != 0),
        bracket: TscBracket { before, after },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_exiting_between_listing_and_reading_is_reported_as_exited() {
        let tmp = tempfile::Builder::new()
            .prefix("vmtsync-exit-")
            .tempdir()
            .unwrap();
        let root = tmp.path();
        let vcpu0 = root.join("kvm/77-5/vcpu0");
        fs::create_dir_all(&vcpu0).unwrap();
        fs::write(vcpu0.join("tsc-offset"), "-3\n").unwrap();
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
