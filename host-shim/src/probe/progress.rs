//! A one-line progress indicator on stderr for long probe runs, shown only on a terminal.
//!
//! Progress is redrawn at most every 1/64 of a round and only when the round has at least
//! [`MIN_STEPS`] probes, so short runs and pipes see nothing and the writes stay far from the
//! probe loop's critical path (they happen after a sample is complete, never between stamps).

use std::io::{IsTerminal, Write};

/// Rounds shorter than this show no progress.
pub const MIN_STEPS: u64 = 256;

/// Where progress goes: nowhere, or stderr.
#[derive(Debug)]
pub struct Progress {
    enabled: bool,
    drawn: bool,
    last_permille: u64,
}

impl Progress {
    /// Progress on stderr if `wanted` and stderr is a terminal.
    #[must_use]
    pub fn stderr_if_terminal(wanted: bool) -> Self {
        Self {
            enabled: wanted && std::io::stderr().is_terminal(),
            drawn: false,
            last_permille: u64::MAX,
        }
    }

    /// No progress output at all.
    #[must_use]
    pub const fn hidden() -> Self {
        Self {
            enabled: false,
            drawn: false,
            last_permille: u64::MAX,
        }
    }

    /// Whether anything will be drawn.
    #[must_use]
    pub const fn enabled(&self) -> bool {
        self.enabled
    }

    /// Reports `done` of `total` probes.
    pub fn step(&mut self, done: u64, total: u64) {
        if !self.enabled || total < MIN_STEPS {
            return;
        }
        let permille = done.saturating_mul(1000) / total.max(1);
        if self.last_permille != u64::MAX && permille < self.last_permille.saturating_add(16) {
            return;
        }
        self.last_permille = permille;
        self.drawn = true;
        let mut e = std::io::stderr().lock();
        let _ = write!(
            e,
            "\rvmtsync probe: {done}/{total} ({}.{}%)",
            permille / 10,
            permille % 10
        );
        let _ = e.flush();
    }

    /// Shows a free-form status line (continuous mode: one per round).
    pub fn status(&mut self, line: &str) {
        if !self.enabled {
            return;
        }
        self.drawn = true;
        let mut e = std::io::stderr().lock();
        let _ = write!(e, "\r\x1b[K{line}");
        let _ = e.flush();
    }

    /// Erases the line if something was drawn.
    pub fn clear(&mut self) {
        if self.drawn {
            let mut e = std::io::stderr().lock();
            let _ = write!(e, "\r\x1b[K");
            let _ = e.flush();
            self.drawn = false;
        }
        self.last_permille = u64::MAX;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hidden_progress_never_draws() {
        let mut p = Progress::hidden();
        assert!(!p.enabled());
        p.step(1, 1000);
        p.status("x");
        assert!(!p.drawn);
        p.clear();
        assert_eq!(p.last_permille, u64::MAX);
    }
}
