//! Memory mode (`memory` on the kernel command line, docs/memory-layout.md): no link, no
//! protocol and no poll loop. The kernel publishes its recorder's header in its own memory
//! (the raw TSC, the beacon port [`SYNC_PORT`]) and records its requests there as in the
//! protocol mode, with a sync beacon before the first event, after every [`BEACON_EVERY`]
//! events and after the last; then it prints its count and halts, leaving the VM up so a host
//! (`vmtsync record --from-memory --vm PID`) can read the records out of the VMM's memory
//! while the kernel runs and after. Its console stays its own: COM1 carries only its text.
//!
//! What this mode adds to the kernel's glue lies between the `vmtsync-memory-glue` markers;
//! it reuses the protocol mode's recorder static, producer handle and two record calls.

use core::fmt::Write as _;

use super::{App, RECORDER, REQUESTS, SYNC_PORT, io};
// vmtsync-memory-glue: begin (the header's pieces)
use vmtsync_core::agent::AgentClock as _;
use vmtsync_core::arch::NativePorts;
use vmtsync_core::arch::x86_64::{NativeClock, NativeCpuid, boot_nonce};
use vmtsync_core::recorder::{ClockKind, HeaderInfo};
// vmtsync-memory-glue: end

/// Events between two sync beacons.
pub const BEACON_EVERY: u64 = 100;

/// Runs the application in memory mode; never returns.
pub fn run(mut app: App) -> ! {
    // vmtsync-memory-glue: begin (publish the header once; real port I/O for the beacons)
    RECORDER.publish(&HeaderInfo {
        nonce: boot_nonce(&NativeCpuid),
        tsc_khz: NativeClock::detect().tsc_khz().map_or(0, u64::from),
        clock: ClockKind::RawTsc,
        beacon_port: SYNC_PORT,
    });
    // SAFETY: nothing in the VM decodes SYNC_PORT: its I/O only exits to the host.
    let ports = unsafe { NativePorts::new() };
    // vmtsync-memory-glue: end
    let _ = writeln!(
        io::Console,
        "minimal-kernel: memory mode, recorder published, a beacon on port {SYNC_PORT:#x} \
         every {BEACON_EVERY} events"
    );
    // vmtsync-memory-glue: begin (the first beacon)
    let _ = app.events.beacon(&app.tsc, &ports, SYNC_PORT);
    // vmtsync-memory-glue: end
    let mut since_beacon = 0;
    while app.done < REQUESTS {
        let before = app.done;
        app.step();
        since_beacon += 2 * (app.done - before);
        if since_beacon >= BEACON_EVERY || app.done == REQUESTS && since_beacon > 0 {
            // vmtsync-memory-glue: begin (a beacon every BEACON_EVERY events and after the last)
            let _ = app.events.beacon(&app.tsc, &ports, SYNC_PORT);
            // vmtsync-memory-glue: end
            since_beacon = 0;
        }
    }
    let _ = writeln!(
        io::Console,
        "minimal-kernel: memory mode done, {} events, {} beacons; halting",
        2 * REQUESTS,
        app.events.ring().beacons()
    );
    io::halt()
}
