//! SIGINT/SIGTERM: a flag that watch and probe poll, and the signal that set it.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

/// Set by SIGINT/SIGTERM so watch mode ends cleanly (and removes its tracefs instance).
pub(super) static STOP: AtomicBool = AtomicBool::new(false);

/// The signal that raised [`STOP`] (SIGINT = 2 until one arrives), for the exit code.
pub(super) static STOP_SIGNAL: AtomicI32 = AtomicI32::new(libc::SIGINT);

extern "C" fn on_stop_signal(sig: libc::c_int) {
    STOP_SIGNAL.store(sig, Ordering::Relaxed);
    STOP.store(true, Ordering::Relaxed);
}

pub(super) fn install_stop_handler() {
    let handler = on_stop_signal as extern "C" fn(libc::c_int);
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe {
            libc::signal(sig, handler as libc::sighandler_t);
        }
    }
}
