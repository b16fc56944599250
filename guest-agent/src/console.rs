//! `console=N`: when the protocol loop writes its next console line on COM1.

/// Counts handled messages and says when a console line is due: after every `every`-th
/// message (`console=N`), never with `every` = 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConsoleLines {
    every: u32,
    /// Messages handled when the last line was due.
    at: u32,
}

impl ConsoleLines {
    /// Lines every `every` messages (0: none).
    #[must_use]
    pub const fn new(every: u32) -> Self {
        Self { every, at: 0 }
    }

    /// Whether a line is due now that `messages` have been handled in all (the agent's
    /// wrapping `messages_in` counter); a due line is counted as written.
    pub fn due(&mut self, messages: u32) -> bool {
        if self.every == 0 || messages.wrapping_sub(self.at) < self.every {
            return false;
        }
        self.at = messages;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_every_n_messages_and_none_when_off() {
        let mut off = ConsoleLines::new(0);
        assert!((0..10).all(|m| !off.due(m)));
        let mut every = ConsoleLines::new(1);
        assert!(!every.due(0), "no message yet");
        assert!((1..10).all(|m| every.due(m)));
        assert!(!every.due(9), "an idle poll writes nothing");
        let mut third = ConsoleLines::new(3);
        let due: Vec<u32> = (0..10).filter(|&m| third.due(m)).collect();
        assert_eq!(due, [3, 6, 9]);
        // Several messages in one poll (vsock) still give one line, and the count goes on.
        let mut batch = ConsoleLines::new(2);
        assert!(batch.due(5));
        assert!(!batch.due(6));
        assert!(batch.due(7));
        let mut wrap = ConsoleLines {
            every: 2,
            at: u32::MAX,
        };
        assert!(wrap.due(1), "the counter wraps like the agent's");
    }
}
