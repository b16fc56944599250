//! [`ChildGuard`]: a child process killed by its PID when the guard drops.

use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// Kills and reaps a child process by its PID when dropped, also when a test panics or a
/// command fails half-way.
#[derive(Debug)]
pub struct ChildGuard(pub Option<Child>);

impl ChildGuard {
    /// Guards `child`.
    #[must_use]
    pub fn new(child: Child) -> Self {
        Self(Some(child))
    }

    /// The guarded child's PID.
    ///
    /// # Panics
    /// If the child was already taken.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.0.as_ref().expect("child present").id()
    }

    /// Mutable access to the child.
    ///
    /// # Panics
    /// If the child was already taken.
    pub fn child(&mut self) -> &mut Child {
        self.0.as_mut().expect("child present")
    }

    /// Sends signal `sig` (e.g. `libc::SIGINT`) to the child by its PID.
    ///
    /// # Errors
    /// The OS error of `kill`, or a PID out of `pid_t`'s range.
    ///
    /// # Panics
    /// If the child was already taken.
    pub fn signal(&self, sig: i32) -> std::io::Result<()> {
        let pid = libc::pid_t::try_from(self.pid()).map_err(std::io::Error::other)?;
        // SAFETY: kill(2) takes plain integers, here our own child's PID, unreaped (the guard
        // holds it).
        if unsafe { libc::kill(pid, sig) } == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    /// Waits up to `limit` for the child to exit on its own and returns its status; `None`
    /// when it is still running then (the guard still holds it and kills it on drop).
    ///
    /// # Errors
    /// The OS error of `waitpid`.
    ///
    /// # Panics
    /// If the child was already taken.
    pub fn wait_timeout(&mut self, limit: Duration) -> std::io::Result<Option<ExitStatus>> {
        let end = Instant::now() + limit;
        loop {
            if let Some(s) = self.child().try_wait()? {
                // Reaped: nothing is left to kill.
                self.0 = None;
                return Ok(Some(s));
            }
            if Instant::now() >= end {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            // Kill by PID (Child::kill sends SIGKILL to this exact process), then reap it so
            // no zombie outlives its user.
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
