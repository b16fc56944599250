//! A private tracefs instance: the one way vmtsync turns tracepoints on.
//!
//! `mkdir <tracefs>/instances/vmtsync-<purpose>-<pid>` gives a ring buffer of our own, with its
//! own `trace_clock` (set to `x86-tsc`, so event timestamps are host TSC readings), its own
//! event enables and filters: the global buffer other tools use is never touched
//! (docs/ftrace.md). The instance is removed on drop, so every exit path that unwinds (errors,
//! SIGINT through the CLI's stop flag) leaves nothing behind; one left by a killed process
//! (SIGKILL skips drop) is removed by the next [`Instance::create`] once its process is gone.

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use thiserror::Error;

/// Where tracefs is normally mounted, in the order tried.
pub const TRACEFS_CANDIDATES: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];

/// The prefix of every instance vmtsync creates: `vmtsync-<purpose>-<pid>`.
pub const INSTANCE_PREFIX: &str = "vmtsync-";

/// Errors setting up or reading a tracefs instance.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TraceError {
    /// No tracefs with the event was found.
    #[error(
        "no tracefs with events/{event} found (tried {tried}): mount tracefs as root (mount -t tracefs nodev /sys/kernel/tracing) and load kvm"
    )]
    NoTracefs {
        /// The event looked for (`kvm/kvm_pio`).
        event: &'static str,
        /// The directories tried.
        tried: String,
    },
    /// A tracefs operation failed.
    #[error("tracefs: {action} {path}: {source}{hint}", hint = root_hint(source))]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The event's format description could not be used.
    #[error("tracefs: {path}: {source}")]
    Format {
        /// The `format` file.
        path: PathBuf,
        /// Why.
        #[source]
        source: super::format::FormatError,
    },
}

impl TraceError {
    /// Whether the failure means "tracing is not available here" (no tracefs, no event, no
    /// permission), as opposed to a fault while it was in use.
    #[must_use]
    pub fn is_unavailable(&self) -> bool {
        match self {
            Self::NoTracefs { .. } => true,
            Self::Io { source, .. } => matches!(
                source.kind(),
                io::ErrorKind::PermissionDenied | io::ErrorKind::NotFound
            ),
            Self::Format { .. } => false,
        }
    }
}

fn root_hint(e: &io::Error) -> &'static str {
    if e.kind() == io::ErrorKind::PermissionDenied {
        " (run as root)"
    } else {
        ""
    }
}

/// `map_err` helper naming the action and the file.
pub(crate) fn io_err<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> TraceError + 'a {
    move |source| TraceError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// Finds a tracefs root that has `event` (`system/name`): `explicit` if given, else the
/// standard places.
///
/// # Errors
/// [`TraceError::NoTracefs`].
pub fn find_tracefs(explicit: Option<&Path>, event: &'static str) -> Result<PathBuf, TraceError> {
    let cands: Vec<PathBuf> = match explicit {
        Some(p) => vec![p.to_path_buf()],
        None => TRACEFS_CANDIDATES.iter().map(PathBuf::from).collect(),
    };
    cands
        .iter()
        .find(|c| c.join("events").join(event).is_dir())
        .cloned()
        .ok_or_else(|| TraceError::NoTracefs {
            event,
            tried: cands
                .iter()
                .map(|c| c.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// A private tracefs instance, removed on drop.
///
/// Files opened inside it (pipes) keep it busy: `rmdir` fails while one is open. Owners keep
/// their files in fields declared before the `Instance`, so they are closed first (Rust drops
/// fields in declaration order).
#[derive(Debug)]
pub struct Instance {
    path: PathBuf,
    /// Events enabled here (`system/name`), disabled again on drop.
    enabled: Vec<&'static str>,
    /// Whether the instance clock is `x86-tsc` (timestamps are host TSC).
    tsc_clock: bool,
}

impl Instance {
    /// Creates `instances/vmtsync-<purpose>-<pid>` under `tracefs` (`vmtsync-<purpose>.<n>-<pid>`
    /// for the process's `n`-th further instance of that purpose, so sessions running side by
    /// side in one process each have their own), after removing instances of vmtsync
    /// processes that no longer exist, and sets its clock to `x86-tsc` if the kernel offers it
    /// ([`Instance::tsc_clock`] says whether it did).
    ///
    /// # Errors
    /// [`TraceError::Io`] if the directory cannot be created.
    pub fn create(tracefs: &Path, purpose: &str) -> Result<Self, TraceError> {
        let instances = tracefs.join("instances");
        remove_stale_instances(&instances);
        static CREATED: AtomicU32 = AtomicU32::new(0);
        let n = CREATED.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let path = instances.join(if n == 0 {
            format!("{INSTANCE_PREFIX}{purpose}-{pid}")
        } else {
            format!("{INSTANCE_PREFIX}{purpose}.{n}-{pid}")
        });
        fs::create_dir(&path).map_err(io_err("create", &path))?;
        let mut inst = Self {
            path,
            enabled: Vec::new(),
            tsc_clock: false,
        };
        inst.tsc_clock = fs::write(inst.path.join("trace_clock"), "x86-tsc").is_ok();
        // Overwrite mode, whatever the global options say: a full per-CPU buffer then drops
        // its oldest page and the reader sees the loss flagged; without it the kernel drops
        // new events, unflagged in what the reader reads.
        // (A directory that is not a kernel's instance, as in tests, has no options.)
        let overwrite = inst.path.join("options").join("overwrite");
        if overwrite.exists() {
            fs::write(&overwrite, "1").map_err(io_err("set", &overwrite))?;
        }
        Ok(inst)
    }

    /// The instance directory.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether event timestamps are host TSC readings (the clock is `x86-tsc`).
    #[must_use]
    pub const fn tsc_clock(&self) -> bool {
        self.tsc_clock
    }

    fn event_file(&self, event: &str, file: &str) -> PathBuf {
        self.path.join("events").join(event).join(file)
    }

    /// Sets `event`'s filter in this instance (the kernel's filter syntax, e.g.
    /// `port == 0x3f8 && (common_pid == 12 || common_pid == 13)`).
    ///
    /// # Errors
    /// [`TraceError::Io`] (`EINVAL` for a filter the kernel rejects).
    pub fn set_filter(&self, event: &'static str, filter: &str) -> Result<(), TraceError> {
        let f = self.event_file(event, "filter");
        fs::write(&f, filter).map_err(io_err("set filter", &f))
    }

    /// Enables `event` in this instance.
    ///
    /// # Errors
    /// [`TraceError::Io`].
    pub fn enable(&mut self, event: &'static str) -> Result<(), TraceError> {
        let f = self.event_file(event, "enable");
        fs::write(&f, "1").map_err(io_err("enable", &f))?;
        self.enabled.push(event);
        Ok(())
    }

    /// `event`'s format description, parsed.
    ///
    /// # Errors
    /// [`TraceError::Io`], [`TraceError::Format`].
    pub fn format(&self, event: &'static str) -> Result<super::format::EventFormat, TraceError> {
        let f = self.event_file(event, "format");
        let text = fs::read_to_string(&f).map_err(io_err("read", &f))?;
        super::format::EventFormat::parse(&text)
            .map_err(|source| TraceError::Format { path: f, source })
    }

    /// Opens `rel` (a file of the instance, e.g. `trace_pipe` or
    /// `per_cpu/cpu0/trace_pipe_raw`) for non-blocking reads.
    ///
    /// # Errors
    /// [`TraceError::Io`].
    pub fn open_nonblocking(&self, rel: &str) -> Result<File, TraceError> {
        let p = self.path.join(rel);
        File::options()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&p)
            .map_err(io_err("open", &p))
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        // Best effort: disable what we enabled (so nothing records while the directory goes),
        // then remove it; the owner has closed its pipes already (see the type's docs).
        for event in &self.enabled {
            let _ = fs::write(self.event_file(event, "enable"), "0");
        }
        let _ = fs::remove_dir(&self.path);
    }
}

/// Removes instances left by vmtsync processes that were killed (SIGKILL skips drop):
/// `vmtsync-<purpose>-<pid>` whose process no longer exists.
fn remove_stale_instances(instances: &Path) {
    let Ok(rd) = fs::read_dir(instances) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(INSTANCE_PREFIX))
            .and_then(|rest| rest.rsplit_once('-'))
            .and_then(|(_, p)| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = fs::remove_dir(e.path());
        }
    }
}

/// Whether a read of a non-blocking trace pipe that failed with `e` only found nothing to
/// read now (`EAGAIN`, or a signal): the caller stops reading until its next round.
pub(crate) fn nothing_to_read_now(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake tracefs: `instances/` and one event directory. `mkdir` in a real tracefs creates
    /// the instance's files; here the test creates the ones it needs.
    fn fake_tracefs() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        fs::create_dir_all(d.path().join("instances")).unwrap();
        fs::create_dir_all(d.path().join("events/kvm/kvm_pio")).unwrap();
        d
    }

    #[test]
    fn finds_the_tracefs_with_the_event_or_says_where_it_looked() {
        let d = fake_tracefs();
        assert_eq!(
            find_tracefs(Some(d.path()), "kvm/kvm_pio").unwrap(),
            d.path()
        );
        let e = find_tracefs(Some(d.path()), "kvm/kvm_nope").unwrap_err();
        assert!(e.is_unavailable());
        assert!(
            e.to_string().contains(&d.path().display().to_string()),
            "{e}"
        );
    }

    #[test]
    fn the_instance_is_named_for_its_purpose_and_each_is_its_own() {
        let d = fake_tracefs();
        let inst = Instance::create(d.path(), "anchor").unwrap();
        let other = Instance::create(d.path(), "anchor").unwrap();
        let name = |p: &Path| p.file_name().unwrap().to_str().unwrap().to_owned();
        let pid = std::process::id().to_string();
        for i in [&inst, &other] {
            let n = name(i.path());
            assert!(n.starts_with("vmtsync-anchor"), "{n}");
            assert!(n.ends_with(&format!("-{pid}")), "{n}");
            assert!(i.path().is_dir());
        }
        assert_ne!(inst.path(), other.path());
        // Removal needs tracefs's rmdir (a plain directory keeps the trace_clock file written
        // into it): the tier-2 anchor tests check that the real instance is gone afterwards.
    }

    #[test]
    fn stale_instances_of_dead_processes_go_and_live_ones_stay() {
        let d = fake_tracefs();
        let inst = d.path().join("instances");
        // PIDs above the kernel's pid_max (4M) never exist.
        for name in [
            "vmtsync-watch-4999999",
            "vmtsync-anchor-4999998",
            "other-tool-4999997",
        ] {
            fs::create_dir(inst.join(name)).unwrap();
        }
        let live = format!("vmtsync-watch-{}", std::process::id());
        fs::create_dir(inst.join(&live)).unwrap();
        let mine = Instance::create(d.path(), "anchor").unwrap();
        let mut left: Vec<String> = fs::read_dir(&inst)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        let me = mine
            .path()
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .to_owned();
        let mut want = vec!["other-tool-4999997".to_owned(), me, live];
        want.sort();
        assert_eq!(left, want);
        drop(mine);
    }
}
