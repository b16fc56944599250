//! `vmtsync record --from-memory … -- VMM ARGS…`: the reader starts the VMM itself, paused,
//! so that nothing the guest does happens before the reader is ready.
//!
//! The VMM (QEMU: the arguments must accept `-S` and `-qmp`) starts with `-S` and a private
//! QMP socket. The reader finds its VM in KVM's debugfs, starts its `kvm_pio` trace, takes a
//! host time, and only then resumes the guest with QMP `cont`: every exit of the guest comes
//! after that time, which lets beacon chains bracket from beacon 0 (an observation of the
//! host's, not a promise of the guest's). When the recording ends the VMM is asked to quit
//! (QMP `quit`), then killed by its PID if it has not ended, and always reaped.

use std::io::{BufRead as _, BufReader, Write as _};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use thiserror::Error;

/// How long the VMM gets to open its QMP socket, and to answer one command.
const QMP_WAIT: Duration = Duration::from_secs(20);
/// How long a VMM asked to quit gets before it is killed.
const QUIT_WAIT: Duration = Duration::from_secs(5);

/// Why the VMM could not be started or driven.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// No program after `--`.
    #[error(
        "nothing to start after `--` (give the VMM's command line, e.g. -- qemu-system-x86_64 …)"
    )]
    Empty,
    /// The program did not start.
    #[error("could not start {program}: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The VMM's QMP socket failed or refused a command.
    #[error("QMP at {sock}: {what} (does the VMM take -S and -qmp? QEMU does)")]
    Qmp {
        /// The socket.
        sock: PathBuf,
        /// What went wrong.
        what: String,
    },
    /// The VMM ended before the recording could start.
    #[error("the VMM (PID {pid}) exited before the recording started: {status}")]
    Exited {
        /// Its PID.
        pid: u32,
        /// Its exit status.
        status: std::process::ExitStatus,
    },
}

/// A QMP socket, one connection per command (QEMU serves one client at a time).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Qmp {
    sock: PathBuf,
}

impl Qmp {
    /// The QMP server at `sock`.
    #[must_use]
    pub fn at(sock: &Path) -> Self {
        Self {
            sock: sock.to_owned(),
        }
    }

    fn fail(&self, what: impl Into<String>) -> LaunchError {
        LaunchError::Qmp {
            sock: self.sock.clone(),
            what: what.into(),
        }
    }

    /// Connects (waiting at most `wait` for the socket), negotiates and runs `command` (a
    /// QMP command name without arguments); returns its `return` value (null when the VMM
    /// closed the socket on `quit` before answering).
    ///
    /// # Errors
    /// [`LaunchError::Qmp`]: no socket within `wait`, a refusal, or a closed connection.
    pub fn execute(&self, command: &str, wait: Duration) -> Result<serde_json::Value, LaunchError> {
        let end = Instant::now() + wait;
        let s = loop {
            match UnixStream::connect(&self.sock) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= end => return Err(self.fail(e.to_string())),
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        };
        s.set_read_timeout(Some(wait))
            .map_err(|e| self.fail(e.to_string()))?;
        let mut r = BufReader::new(s.try_clone().map_err(|e| self.fail(e.to_string()))?);
        let mut w = s;
        let mut reply = |cmd: Option<&str>| -> Result<serde_json::Value, LaunchError> {
            if let Some(c) = cmd {
                let line = format!("{{\"execute\": \"{c}\"}}\n");
                w.write_all(line.as_bytes())
                    .map_err(|e| self.fail(e.to_string()))?;
            }
            loop {
                let mut line = String::new();
                let n = r
                    .read_line(&mut line)
                    .map_err(|e| self.fail(e.to_string()))?;
                if n == 0 {
                    // `quit` may close the socket before its answer arrives.
                    return if cmd == Some("quit") {
                        Ok(serde_json::Value::Null)
                    } else {
                        Err(self.fail(format!("closed before it answered {cmd:?}")))
                    };
                }
                let v: serde_json::Value =
                    serde_json::from_str(&line).map_err(|e| self.fail(format!("{e}: {line:?}")))?;
                // Events may come in between; the greeting or a return ends the wait.
                if let Some(ret) = v.get("return") {
                    return Ok(ret.clone());
                }
                if v.get("QMP").is_some() {
                    return Ok(serde_json::Value::Null);
                }
                if v.get("error").is_some() {
                    return Err(self.fail(format!("{cmd:?} refused: {v}")));
                }
            }
        };
        reply(None)?;
        reply(Some("qmp_capabilities"))?;
        reply(Some(command))
    }
}

/// The paused VMM's resume, handed to the recording: it runs `cont` once the reader is armed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resume {
    /// The VMM's QMP socket.
    pub qmp: Qmp,
}

impl Resume {
    /// Resumes the guest.
    ///
    /// # Errors
    /// [`LaunchError::Qmp`].
    pub fn cont(&self) -> Result<(), LaunchError> {
        self.qmp.execute("cont", QMP_WAIT).map(|_| ())
    }
}

/// A VMM this process started, paused; ended (quit, then killed) and reaped when dropped.
#[derive(Debug)]
pub struct Vmm {
    child: Child,
    qmp: Qmp,
    /// The socket's private directory.
    dir: tempfile::TempDir,
}

impl Vmm {
    /// Starts `argv` with `-S` and a private QMP socket added, stdin closed, stdout and stderr
    /// inherited, and waits until its QMP server answers.
    ///
    /// # Errors
    /// [`LaunchError`]: nothing to start, a spawn failure, or no QMP server.
    pub fn spawn_paused(argv: &[String]) -> Result<Self, LaunchError> {
        let (program, args) = argv.split_first().ok_or(LaunchError::Empty)?;
        let dir = tempfile::Builder::new()
            .prefix("vmtsync-vmm-")
            .tempdir()
            .map_err(|source| LaunchError::Spawn {
                program: program.clone(),
                source,
            })?;
        let sock = dir.path().join("qmp.sock");
        let child = Command::new(program)
            .args(args)
            .arg("-S")
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", sock.display()))
            .stdin(Stdio::null())
            .spawn()
            .map_err(|source| LaunchError::Spawn {
                program: program.clone(),
                source,
            })?;
        let mut vmm = Self {
            child,
            qmp: Qmp::at(&sock),
            dir,
        };
        // Its QMP server answering means it has created its VM and vCPUs (QEMU opens the
        // monitor after machine init). That its guest has not run yet is what the beacon
        // chains' arming rests on: the VMM's own status says so, not an assumption about -S.
        let end = Instant::now() + QMP_WAIT;
        loop {
            vmm.exited()?;
            match vmm.qmp.execute("query-status", Duration::from_millis(500)) {
                Ok(status) if status["running"] == serde_json::Value::Bool(false) => {
                    return Ok(vmm);
                }
                Ok(status) => {
                    return Err(vmm.qmp.fail(format!(
                        "the VMM reports {status} after -S: its guest is not paused, so the \
                         reader cannot arm itself before the first instruction"
                    )));
                }
                Err(e) if Instant::now() >= end => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    /// The VMM's PID.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What resumes it.
    #[must_use]
    pub fn resume(&self) -> Resume {
        Resume {
            qmp: self.qmp.clone(),
        }
    }

    /// An error if it has exited.
    ///
    /// # Errors
    /// [`LaunchError::Exited`].
    pub fn exited(&mut self) -> Result<(), LaunchError> {
        match self.child.try_wait() {
            Ok(Some(status)) => Err(LaunchError::Exited {
                pid: self.pid(),
                status,
            }),
            _ => Ok(()),
        }
    }

    /// Ends it: QMP `quit`, then SIGKILL by its PID after [`QUIT_WAIT`], and reaps it.
    /// Returns its exit status when it could be read.
    pub fn finish(&mut self) -> Option<std::process::ExitStatus> {
        if let Ok(Some(s)) = self.child.try_wait() {
            return Some(s);
        }
        let _ = self.qmp.execute("quit", Duration::from_secs(2));
        let end = Instant::now() + QUIT_WAIT;
        while Instant::now() < end {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        self.child.wait().ok()
    }

    /// The socket's directory (removed with the value).
    #[must_use]
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_after_the_separator_is_a_clear_error() {
        let e = Vmm::spawn_paused(&[]).expect_err("empty");
        assert!(matches!(e, LaunchError::Empty), "{e}");
        assert!(e.to_string().contains("--"), "{e}");
    }

    #[test]
    fn a_program_that_is_not_a_vmm_is_reported_and_reaped() {
        // `true` ignores its arguments and exits at once: no QMP server ever answers.
        let e = Vmm::spawn_paused(&["true".into()]).expect_err("not a VMM");
        assert!(matches!(e, LaunchError::Exited { .. }), "{e}");
        let e = Vmm::spawn_paused(&["/nonexistent/vmm".into()]).expect_err("no program");
        assert!(matches!(e, LaunchError::Spawn { .. }), "{e}");
    }
}
