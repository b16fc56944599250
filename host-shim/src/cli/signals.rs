//! SIGINT/SIGTERM: a flag that watch and probe poll, and the signal that set it.
//!
//! The handlers are signal-hook's flag handlers (they only store to atomics, which is
//! async-signal-safe), so this module needs no `unsafe`.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};

use signal_hook::consts::{SIGINT, SIGTERM};

/// Set by SIGINT/SIGTERM so watch mode ends cleanly (and removes its tracefs instance) and
/// probe ends after the current round or abandons what it waits for.
static STOP: LazyLock<Arc<AtomicBool>> = LazyLock::new(|| Arc::new(AtomicBool::new(false)));

/// The signal that raised [`STOP`] (SIGINT until one arrives), for the exit code.
static STOP_SIGNAL: LazyLock<Arc<AtomicUsize>> =
    LazyLock::new(|| Arc::new(AtomicUsize::new(signal_number(SIGINT))));

/// A signal number as the `usize` signal-hook stores (signal numbers are small and positive).
fn signal_number(sig: i32) -> usize {
    usize::try_from(sig).unwrap_or(0)
}

/// The flag SIGINT/SIGTERM raise, for [`crate::kvm::watch::WatchOptions::stop`] and
/// [`crate::probe::ProbeOptions::stop`].
pub(super) fn stop_flag() -> &'static AtomicBool {
    &STOP
}

/// The number of the signal that raised [`stop_flag`], SIGINT if none has arrived yet.
pub(super) fn stop_signal() -> usize {
    STOP_SIGNAL.load(Ordering::Relaxed)
}

/// Makes SIGINT and SIGTERM record which of them arrived and then raise [`stop_flag`]
/// (signal-hook runs a signal's actions in registration order).
pub(super) fn install_stop_handler() {
    for sig in [SIGINT, SIGTERM] {
        // Registration fails only for signals that cannot be caught, which these are not; if
        // it failed anyway the signal would keep its default action and end the process.
        let _ =
            signal_hook::flag::register_usize(sig, Arc::clone(&STOP_SIGNAL), signal_number(sig));
        let _ = signal_hook::flag::register(sig, Arc::clone(&STOP));
    }
}
