//! Reading the host's TSC, the clock every debugfs reading is bracketed with.
//!
//! The host trace clock (`x86-tsc`) is the raw TSC, so a reading of KVM's per-vCPU state is
//! only useful together with the host TSC interval in which it was taken: the offset may change
//! (e.g. on migration or a guest `wrmsr`), and the bracket says when the reading was true.

use serde::Serialize;
use vmtsync_core::HostTicks;

/// Reads the host TSC, ordered after every earlier load (`lfence; rdtsc`).
///
/// `lfence` keeps the read from being executed before the debugfs reads that precede it in
/// program order, so `before <= reading <= after` holds for a bracket built from two calls.
#[must_use]
#[inline]
pub fn read_host_tsc() -> HostTicks {
    #[cfg(target_arch = "x86_64")]
    {
        // vmtsync-core's ordered read (`lfence; rdtsc`), the one the probe engine stamps with.
        HostTicks(vmtsync_core::arch::x86_64::lfence_rdtsc())
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        // Not an x86 host: there is no TSC and KVM debugfs has no tsc-offset either. A zero
        // bracket is honest ("unknown") rather than a made-up clock.
        HostTicks(0)
    }
}

/// A host TSC interval `[before, after]` in which a reading was true.
///
/// It serializes as `host_tsc_before`/`host_tsc_after`, the names a debugfs reading's bracket
/// has in `vmtsync kvm --json` (where it is flattened into the vCPU's object).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct TscBracket {
    /// Host TSC read just before the first file of the reading was opened.
    #[serde(rename = "host_tsc_before")]
    pub before: HostTicks,
    /// Host TSC read just after the last file of the reading was read.
    #[serde(rename = "host_tsc_after")]
    pub after: HostTicks,
}

impl TscBracket {
    /// A bracket from raw tick counts, for tests that build readings by hand.
    #[cfg(test)]
    #[must_use]
    pub(crate) const fn ticks(before: u64, after: u64) -> Self {
        Self {
            before: HostTicks(before),
            after: HostTicks(after),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tsc_is_monotonic_on_one_thread() {
        let a = read_host_tsc();
        let b = read_host_tsc();
        assert!(b >= a, "{b:?} < {a:?}");
        #[cfg(target_arch = "x86_64")]
        assert_ne!(a.0, 0);
    }
}
