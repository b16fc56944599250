//! The VMM's end told from a guest's restart: a VMM that exits takes its memory and its
//! debugfs directory with it; a guest that resets publishes its recorder again.

use std::time::{Duration, Instant};

use super::MemoryOptions;
use crate::guestmem::{self, ProcMemory};
use crate::kvm::debugfs::VmDir;
use crate::kvm::procinfo::ProcFs;
use crate::record::error::MemoryError;
use crate::record::{EndReason, RecordError};

/// Whether the VMM is gone: its KVM debugfs directory went away (the VM's last file closed),
/// or its process is no more than a zombie (its memory is unreadable before it is reaped).
pub(super) fn vmm_gone(proc: &ProcFs, vm: &VmDir) -> bool {
    if !vm.path.exists() {
        return true;
    }
    let stat = proc.root().join(vm.id.pid.to_string()).join("stat");
    match std::fs::read_to_string(stat) {
        // The state is the first field after the parenthesised command name.
        Ok(s) => s
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|state| matches!(state, 'Z' | 'X')),
        Err(_) => true,
    }
}

/// Whether the VMM is gone within `limit`: a VMM that is exiting loses its mappings before
/// its process becomes a zombie and its VM directory goes, so a read that fails then is
/// given that long to turn into an exit.
pub(super) fn vmm_gone_within(proc: &ProcFs, vm: &VmDir, limit: Duration) -> bool {
    let end = Instant::now() + limit;
    loop {
        if vmm_gone(proc, vm) {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether a drain error says the guest restarted: its header went away, or came back with
/// another nonce or geometry.
pub(super) fn is_restart(e: &guestmem::DrainError) -> bool {
    matches!(
        e,
        guestmem::DrainError::HeaderGone { .. }
            | guestmem::DrainError::NonceChanged { .. }
            | guestmem::DrainError::GeometryChanged { .. }
    )
}

/// After a restart: waits for a valid header whose nonce is not `old` (where the first one
/// was looked for), for as long as the recording runs: `Err` with how it ends otherwise (a
/// stop, its duration, the VMM's exit, or a memory error). A header that comes back with
/// the old nonce is the old boot's, not a new one: it is waited past.
pub(super) fn find_again(
    mem: &mut ProcMemory,
    opts: &MemoryOptions,
    proc: &ProcFs,
    old: u64,
    ended: &dyn Fn() -> Option<EndReason>,
) -> Result<guestmem::Found, Result<EndReason, RecordError>> {
    loop {
        if let Some(e) = ended() {
            return Err(Ok(e));
        }
        if vmm_gone(proc, &opts.vm) {
            return Err(Ok(EndReason::VmmExited));
        }
        match guestmem::find(mem, opts.location) {
            Ok(f) if f.header.nonce != old => return Ok(f),
            Ok(_) => {}
            Err(e) if e.not_yet() => {}
            Err(_) if vmm_gone_within(proc, &opts.vm, EXIT_GRACE) => {
                return Err(Ok(EndReason::VmmExited));
            }
            Err(e) => return Err(Err(MemoryError::Find(e).into())),
        }
        // Soon after it appears: the new boot's beacons are bracketed from its second on.
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// How long a failed read waits for the VMM's exit to show.
pub(super) const EXIT_GRACE: Duration = Duration::from_secs(2);
