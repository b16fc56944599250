//! One vCPU's debugfs files: each read once, bounded, non-blocking, relative to the open VM
//! directory, and parsed strictly.

use std::ffi::CStr;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};

use super::entries::{MAX_FILE_BYTES, Scaling, VcpuState};
use super::error::{DebugfsError, io_error, settle_teardown};
use super::parse::{parse_i64_contents, parse_u64_contents, show, strip_newline};
use crate::kvm::hosttsc::{TscBracket, read_host_tsc};

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
pub(super) fn open_dir(dir: &Path) -> Result<File, DebugfsError> {
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

/// Where a vCPU's files are opened from.
#[derive(Clone, Copy)]
enum Base<'a> {
    /// The VM's directory: each file as `vcpu<N>/<name>` (a scan).
    Vm(&'a File),
    /// The vCPU's own directory, held open: each file by its name, one component to resolve
    /// ([`VcpuDir`]).
    Vcpu(&'a File),
}

/// File `name` of vCPU `vcpu` as a C string in `buf`, for `openat` relative to `base`:
/// `vcpu<N>/<name>` from the VM directory, `<name>` from the vCPU's.
fn name_in<'a>(buf: &'a mut [u8; 64], base: Base<'_>, vcpu: u32, name: &CStr) -> &'a CStr {
    use std::io::Write;
    let mut cur = io::Cursor::new(&mut buf[..]);
    // "vcpu" + at most 10 digits + "/" + the longest name (28 bytes with NUL) fits in 64.
    if let Base::Vm(_) = base {
        let _ = write!(cur, "vcpu{vcpu}/");
    }
    let _ = cur.write_all(name.to_bytes_with_nul());
    let n = usize::try_from(cur.position()).unwrap_or(0);
    // No interior NUL can occur (decimal digits and constant names), so this never falls back.
    CStr::from_bytes_with_nul(&buf[..n]).unwrap_or(c"")
}

/// Reads vCPU `vcpu` of the VM whose directory is open as `vmf`; `dir` is the vCPU
/// directory's path, used in messages and to tell "absent" from "VM exited".
pub(super) fn read_vcpu_at(vmf: &File, dir: &Path, vcpu: u32) -> Result<VcpuState, DebugfsError> {
    read_vcpu_in(Base::Vm(vmf), dir, vcpu, Reads::All, &|| !dir.exists())
}

/// A vCPU directory held open, for a reader that follows a vCPU's mapping round after round:
/// each [`VcpuDir::read`] opens its files relative to it (one name to resolve, no walk from
/// the root and no VM directory to open). KVM's files must be opened again for each read:
/// they cannot seek, and a read makes the value anew only at position 0. Held open, the
/// directory also stays this VM's: once the VM exits, its files are gone from it, rather
/// than found again under a reused name.
#[derive(Debug)]
pub struct VcpuDir {
    path: PathBuf,
    fd: File,
    vcpu: u32,
    /// The TSC scaling's fraction bits when KVM scales this host's TSCs, read once at open
    /// (the host's constant); `None` when the scaling files are absent (see
    /// [`VcpuDir::read_mapping`]).
    frac_bits: Option<u32>,
}

impl VcpuDir {
    /// Opens the vCPU directory `path` (`.../vcpu<vcpu>`).
    ///
    /// # Errors
    /// [`DebugfsError::VmExited`] if it does not exist; I/O errors.
    pub fn open(path: &Path, vcpu: u32) -> Result<Self, DebugfsError> {
        let fd = open_dir(path).map_err(|e| match e {
            DebugfsError::VmExited { .. } => DebugfsError::VmExited {
                path: path.parent().unwrap_or(path).to_path_buf(),
            },
            e => e,
        })?;
        let mut dir = Self {
            path: path.to_path_buf(),
            fd,
            vcpu,
            frac_bits: None,
        };
        let scaling = dir.read()?.scaling;
        dir.frac_bits = scaling.present.then_some(scaling.frac_bits);
        Ok(dir)
    }

    /// Reads the vCPU's files, as [`read_vcpu`].
    ///
    /// # Errors
    /// As [`read_vcpu`]; a file missing from the directory once its VM exited:
    /// [`DebugfsError::VmExited`].
    pub fn read(&self) -> Result<VcpuState, DebugfsError> {
        self.read_files(Reads::All)
    }

    /// Reads what the vCPU's mapping needs, for a reader that follows it round after round:
    /// `tsc-offset`, `guest_mode`, and the scaling ratio when KVM scales this host's TSCs
    /// (with the fraction bits read at open). The scaling files exist or not by the host
    /// (KVM creates them with the vCPU's directory when the CPU can scale), and the fraction
    /// bits are the host's constant, so neither is looked for again; the thread is not read
    /// (`thread_pid` is `None`). Two or three files instead of five, and no check for absent
    /// files: `cargo xtask bench` times it per vCPU, as every memory-recording round pays it.
    ///
    /// # Errors
    /// As [`VcpuDir::read`].
    pub fn read_mapping(&self) -> Result<VcpuState, DebugfsError> {
        self.read_files(Reads::Mapping(self.frac_bits))
    }

    fn read_files(&self, reads: Reads) -> Result<VcpuState, DebugfsError> {
        // A directory KVM removed keeps no names: its tsc-offset, there while it lives, is
        // gone.
        let gone = || {
            rustix::fs::statat(&self.fd, TSC_OFFSET_FILE, rustix::fs::AtFlags::empty())
                .is_err_and(|e| e == rustix::io::Errno::NOENT)
        };
        read_vcpu_in(Base::Vcpu(&self.fd), &self.path, self.vcpu, reads, &gone)
    }
}

/// Which of a vCPU's files a read opens.
#[derive(Clone, Copy, Debug)]
enum Reads {
    /// Every file.
    All,
    /// [`VcpuDir::read_mapping`]'s: `tsc-offset`, `guest_mode`, and with `Some(frac_bits)`
    /// the scaling ratio.
    Mapping(Option<u32>),
}

/// Reads vCPU `vcpu`'s files from `base`; `dir` is the vCPU directory's path (in messages),
/// and `gone` tells "absent" from "VM exited".
fn read_vcpu_in(
    base: Base<'_>,
    dir: &Path,
    vcpu: u32,
    reads: Reads,
    gone: &dyn Fn() -> bool,
) -> Result<VcpuState, DebugfsError> {
    let exited = || DebugfsError::VmExited {
        path: dir.parent().unwrap_or(dir).to_path_buf(),
    };
    let mut nb = [0u8; 64];
    let dirf = match base {
        Base::Vm(f) | Base::Vcpu(f) => f,
    };
    let p_off = || dir.join(os(TSC_OFFSET_FILE));
    let p_ratio = || dir.join(os(TSC_RATIO_FILE));
    let p_frac = || dir.join(os(TSC_FRAC_FILE));
    let p_gm = || dir.join(os(GUEST_MODE_FILE));
    let p_pid = || dir.join(os(THREAD_PID_FILE));

    let before = read_host_tsc();
    let offset = read_parsed(
        dirf,
        name_in(&mut nb, base, vcpu, TSC_OFFSET_FILE),
        &p_off,
        "a signed decimal integer",
        parse_i64_contents,
    );
    let ratio = |nb: &mut [u8; 64]| {
        read_parsed(
            dirf,
            name_in(nb, base, vcpu, TSC_RATIO_FILE),
            &p_ratio,
            "a non-zero unsigned decimal integer",
            |b| parse_u64_contents(b).filter(|&r| r != 0),
        )
    };
    let (ratio, frac) = match reads {
        Reads::All => (
            ratio(&mut nb),
            read_parsed(
                dirf,
                name_in(&mut nb, base, vcpu, TSC_FRAC_FILE),
                &p_frac,
                "an integer from 0 to 63",
                |b| {
                    parse_u64_contents(b)
                        .filter(|&f| f < 64)
                        .and_then(|f| u32::try_from(f).ok())
                },
            ),
        ),
        Reads::Mapping(Some(f)) => (ratio(&mut nb), Ok(Some(f))),
        Reads::Mapping(None) => (Ok(None), Ok(None)),
    };
    let guest_mode = read_parsed(
        dirf,
        name_in(&mut nb, base, vcpu, GUEST_MODE_FILE),
        &p_gm,
        "0 or 1",
        |b| match strip_newline(b) {
            b"0" => Some(false),
            b"1" => Some(true),
            _ => None,
        },
    );
    let thread = match reads {
        Reads::All => read_parsed(
            dirf,
            name_in(&mut nb, base, vcpu, THREAD_PID_FILE),
            &p_pid,
            "a thread id (unsigned decimal)",
            |b| parse_u64_contents(b).and_then(|p| u32::try_from(p).ok()),
        ),
        Reads::Mapping(_) => Ok(None),
    };
    let after = read_host_tsc();

    // Any absent file may mean the VM exited mid-read: check before believing "absent".
    let offset = settle_teardown(offset, gone, &exited);
    let ratio = settle_teardown(ratio, gone, &exited);
    let frac = settle_teardown(frac, gone, &exited);
    let guest_mode = settle_teardown(guest_mode, gone, &exited);
    let thread = settle_teardown(thread, gone, &exited);
    let tsc_offset = match offset? {
        Some(o) => o,
        None if gone() => return Err(exited()),
        None => return Err(DebugfsError::Missing { path: p_off() }),
    };
    let (ratio, frac, guest_mode, thread) = (ratio?, frac?, guest_mode?, thread?);
    // Only the files this read looked for and did not find.
    let (scaling_read, thread_read) = match reads {
        Reads::All => (true, true),
        Reads::Mapping(f) => (f.is_some(), false),
    };
    let absent = (scaling_read && (ratio.is_none() || frac.is_none()))
        || guest_mode.is_none()
        || (thread_read && thread.is_none());
    if absent && gone() {
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
