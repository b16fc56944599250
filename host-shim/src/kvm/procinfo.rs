//! Mapping a VM's creating PID to its process: `comm`, `cmdline`, and the QEMU guest name.
//!
//! The proc root is injectable ([`ProcFs::new`]) so fixture trees can stand in for `/proc`.

use std::fs;
use std::path::{Path, PathBuf};

/// The standard proc mount.
pub const DEFAULT_PROC_ROOT: &str = "/proc";

/// Longest `cmdline` read (QEMU command lines run to a few KiB; we need only `-name`).
const MAX_CMDLINE_BYTES: u64 = 256 * 1024;

/// A `/proc` tree.
#[derive(Clone, Debug)]
pub struct ProcFs {
    root: PathBuf,
}

/// What we know about a VM's process.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessInfo {
    /// `/proc/<pid>/comm` without the newline (the thread name, 15 bytes at most).
    pub comm: Option<String>,
    /// The guest name from a QEMU-style `-name guest=NAME,…` / `-name NAME` argument.
    pub qemu_name: Option<String>,
}

impl ProcessInfo {
    /// The name to show for the VM: QEMU's guest name if given, else the process name.
    #[must_use]
    pub fn display_name(&self) -> Option<&str> {
        self.qemu_name.as_deref().or(self.comm.as_deref())
    }

    /// True if `name` is this VM's QEMU guest name or its process name.
    #[must_use]
    pub fn matches_name(&self, name: &str) -> bool {
        self.qemu_name.as_deref() == Some(name) || self.comm.as_deref() == Some(name)
    }
}

impl Default for ProcFs {
    fn default() -> Self {
        Self::new(DEFAULT_PROC_ROOT)
    }
}

impl ProcFs {
    /// A proc tree rooted at `root` (normally `/proc`).
    #[must_use]
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The root directory.
    #[must_use]
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The thread ids of process `pid` (`/proc/PID/task`).
    ///
    /// # Errors
    /// The directory could not be read (no such process, or no permission).
    pub fn tasks(&self, pid: u32) -> std::io::Result<Vec<u32>> {
        let mut tids: Vec<u32> = fs::read_dir(self.root.join(pid.to_string()).join("task"))?
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        tids.sort_unstable();
        Ok(tids)
    }

    /// Looks up `pid`. Missing or unreadable files give `None` fields: a VM whose process
    /// cannot be inspected is still listed, just without a name.
    #[must_use]
    pub fn process(&self, pid: u32) -> ProcessInfo {
        let mut dir = self.root.clone();
        dir.push(pid.to_string());
        let comm = fs::read(dir.join("comm")).ok().map(|b| {
            let b = b.strip_suffix(b"\n").unwrap_or(&b);
            String::from_utf8_lossy(b).into_owned()
        });
        let qemu_name = read_cmdline(&dir.join("cmdline")).and_then(|c| qemu_guest_name(&c));
        ProcessInfo { comm, qemu_name }
    }
}

fn read_cmdline(path: &Path) -> Option<Vec<u8>> {
    use std::io::Read;
    let mut buf = Vec::new();
    fs::File::open(path)
        .ok()?
        .take(MAX_CMDLINE_BYTES)
        .read_to_end(&mut buf)
        .ok()?;
    Some(buf)
}

/// Extracts the guest name from a NUL-separated command line with QEMU's `-name` syntax:
/// `-name guest=NAME,debug-threads=on`, `-name NAME,process=…`, `--name …`, `-name=…`.
/// QEMU escapes a literal comma as `,,`.
#[must_use]
pub fn qemu_guest_name(cmdline: &[u8]) -> Option<String> {
    let mut args = cmdline.split(|&b| b == 0);
    while let Some(arg) = args.next() {
        let value = match arg {
            b"-name" | b"--name" => args.next()?,
            _ => match arg
                .strip_prefix(b"-name=")
                .or_else(|| arg.strip_prefix(b"--name="))
            {
                Some(v) => v,
                None => continue,
            },
        };
        return parse_name_opts(&String::from_utf8_lossy(value));
    }
    None
}

/// Parses QEMU's `-name` option string: the implied key is `guest`.
fn parse_name_opts(s: &str) -> Option<String> {
    // Split on single commas; ",," is an escaped comma.
    let mut parts = Vec::new();
    let mut cur = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == ',' {
            if chars.peek() == Some(&',') {
                chars.next();
                cur.push(',');
            } else {
                parts.push(std::mem::take(&mut cur));
            }
        } else {
            cur.push(c);
        }
    }
    parts.push(cur);
    for (i, p) in parts.iter().enumerate() {
        if let Some(v) = p.strip_prefix("guest=") {
            return Some(v.to_owned()).filter(|v| !v.is_empty());
        }
        if i == 0 && !p.contains('=') {
            return Some(p.clone()).filter(|v| !v.is_empty());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::write_fixture;

    fn cmd(args: &[&str]) -> Vec<u8> {
        let mut v = Vec::new();
        for a in args {
            v.extend_from_slice(a.as_bytes());
            v.push(0);
        }
        v
    }

    #[test]
    fn qemu_names() {
        let q = "qemu-system-x86_64";
        assert_eq!(
            qemu_guest_name(&cmd(&[
                q,
                "-m",
                "1G",
                "-name",
                "guest=web1,debug-threads=on"
            ])),
            Some("web1".into())
        );
        assert_eq!(
            qemu_guest_name(&cmd(&[q, "-name", "db,process=qemu-db"])),
            Some("db".into())
        );
        assert_eq!(
            qemu_guest_name(&cmd(&[q, "-name", "debug-threads=on,guest=x"])),
            Some("x".into())
        );
        assert_eq!(
            qemu_guest_name(&cmd(&[q, "--name=a,,b"])),
            Some("a,b".into())
        );
        assert_eq!(qemu_guest_name(&cmd(&[q, "-m", "1G"])), None);
        assert_eq!(qemu_guest_name(&cmd(&[q, "-name"])), None);
        assert_eq!(qemu_guest_name(&cmd(&[q, "-name", "guest="])), None);
        assert_eq!(qemu_guest_name(b"\xff\xfe-name\0"), None);
    }

    #[test]
    fn fixture_proc() {
        let tmp = crate::testutil::temp_dir("vmtsync-proc-");
        let dir = tmp.path();
        write_fixture(dir, "42/comm", "qemu-system-x86\n");
        write_fixture(dir, "42/cmdline", cmd(&["qemu", "-name", "guest=vm7"]));
        let procfs = ProcFs::new(dir);
        let info = procfs.process(42);
        assert_eq!(info.comm.as_deref(), Some("qemu-system-x86"));
        assert_eq!(info.display_name(), Some("vm7"));
        assert!(info.matches_name("vm7") && info.matches_name("qemu-system-x86"));
        assert!(!info.matches_name("vm"));
        assert_eq!(procfs.process(43), ProcessInfo::default());
    }
}
