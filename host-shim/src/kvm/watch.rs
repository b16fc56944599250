//! `vmtsync kvm --watch`: poll debugfs and emit one JSON line per change.
//!
//! Events (each a JSON object on one line, all with `"schema":1` and `"event"`):
//! - `watch_started`: `host_tsc`, `trace_events` (whether the tracepoint is subscribed), first.
//! - `vm_found` (at start) / `vm_added` (later): `pid`, `fd`, `name`, `vcpus` (as in
//!   `vmtsync kvm --json`).
//! - `vcpu_added`: `pid`, `fd`, `vcpu` (one vCPU object).
//! - `vcpu_changed`: `pid`, `fd`, `vcpu` (new state), `previous` (old state): any change of
//!   offset, scaling, guest_mode or thread.
//! - `vcpu_removed`: `pid`, `fd`, `vcpu` (id), `host_tsc_before`/`host_tsc_after`.
//! - `vm_gone`: `pid`, `fd`, `name`, `host_tsc_before` (last time it was seen) and
//!   `host_tsc_after` (first time it was missing).
//! - `tsc_offset_written` (with `--trace-events`): `thread`, `pid`/`fd` when the thread is a
//!   known vCPU thread, `vcpu`, `previous_tsc_offset`, `tsc_offset`, `host_tsc` (the event's
//!   timestamp) and `host_tsc_clock` (false if the trace clock could not be set to x86-tsc),
//!   `writes`: writes of one vCPU thread are merged per wait (at most one line per vCPU per
//!   rescan), `previous_tsc_offset` from the first, `tsc_offset`/`host_tsc` from the last.
//!
//! Rate limits, so a guest writing its TSC in a loop cannot flood the output or the CPU: one
//! wait reads at most [`crate::ftrace::tsc_offset::MAX_READ_PER_WAIT`] bytes, writes are merged as
//! above, and an event triggers a rescan at most once per [`rescan_gap`] (a tenth of the
//! interval, at least 10 ms).
//!
//! The tracepoint reports the offset KVM *wrote* (its L1 bookkeeping); debugfs reports the
//! offset in effect. They can differ: on this project's nested `kvm_pvm` hosts the tracepoint
//! shows KVM's creation-time offset (about minus the host TSC) while debugfs, and the guest's
//! real TSC, say 0. So a `tsc_offset_written` event is a "re-read now" trigger and a record that
//! a write happened; the mapping is always the debugfs reading that follows it.
//!
//! With `--vm`, the VMs selected at start are watched and the command exits 0 once all of them
//! are gone; without it, every VM is watched until the process is interrupted.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use thiserror::Error;

use crate::ftrace::TraceError;
use crate::ftrace::tsc_offset::{CoalescedWrites, Subscription, coalesce_into};
use crate::kvm::debugfs::{DebugfsError, VcpuState, VmId};
use crate::kvm::hosttsc::read_host_tsc;
use crate::kvm::scan::{SCHEMA_VERSION, ScanError, Scanner, VmSelector};

/// The longest single sleep or tracepoint wait, so a raised stop flag is seen promptly.
const STOP_POLL: Duration = Duration::from_millis(50);

/// The shortest time between two scans when tracepoint events trigger them: a tenth of the
/// poll interval, at least 10 ms, at most the interval itself.
#[must_use]
pub fn rescan_gap(interval: Duration) -> Duration {
    (interval / 10).max(Duration::from_millis(10)).min(interval)
}

/// Errors of watch mode.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum WatchError {
    /// Scanning failed.
    #[error(transparent)]
    Scan(#[from] ScanError),
    /// The tracepoint subscription failed.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// Writing output failed (a broken pipe is handled by the caller).
    #[error("writing output: {0}")]
    Output(#[from] std::io::Error),
}

impl From<DebugfsError> for WatchError {
    fn from(e: DebugfsError) -> Self {
        Self::Scan(e.into())
    }
}

/// Watch-mode settings.
#[derive(Debug)]
pub struct WatchOptions<'a> {
    /// Poll interval.
    pub interval: Duration,
    /// Only these VMs (fixed at start); the stream ends when they are all gone.
    pub selector: Option<&'a VmSelector>,
    /// The tracepoint subscription, if `--trace-events`.
    pub trace: Option<Subscription>,
    /// Set (e.g. by a SIGINT handler) to stop after the current poll.
    pub stop: &'a AtomicBool,
}

struct VmState {
    name: Option<String>,
    vcpus: BTreeMap<u32, VcpuState>,
    last_seen: u64,
}

/// True if two readings of a vCPU differ in anything but their host TSC bracket.
fn changed(a: &VcpuState, b: &VcpuState) -> bool {
    VcpuState {
        bracket: b.bracket,
        ..*a
    } != *b
}

/// One output line: `{"schema":1,"event":NAME,…}` (see the module docs for every event).
#[derive(Serialize)]
struct Line<'a> {
    schema: u32,
    #[serde(flatten)]
    event: Event<'a>,
}

/// The events, tagged by `"event"`.
#[derive(Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
enum Event<'a> {
    WatchStarted {
        host_tsc: u64,
        trace_events: bool,
    },
    VmFound(VmEvent<'a>),
    VmAdded(VmEvent<'a>),
    VcpuAdded {
        pid: u32,
        fd: u32,
        vcpu: &'a VcpuState,
    },
    VcpuChanged {
        pid: u32,
        fd: u32,
        vcpu: &'a VcpuState,
        previous: &'a VcpuState,
    },
    VcpuRemoved {
        pid: u32,
        fd: u32,
        vcpu: u32,
        host_tsc_before: u64,
        host_tsc_after: u64,
    },
    VmGone {
        pid: u32,
        fd: u32,
        name: Option<&'a str>,
        host_tsc_before: u64,
        host_tsc_after: u64,
    },
    TscOffsetWritten {
        pid: Option<u32>,
        fd: Option<u32>,
        thread: u32,
        vcpu: u32,
        previous_tsc_offset: i64,
        tsc_offset: i64,
        host_tsc: u64,
        host_tsc_clock: bool,
        writes: u64,
    },
}

/// A VM as `vm_found`/`vm_added` report it: its vCPUs as in `vmtsync kvm --json`.
#[derive(Serialize)]
struct VmEvent<'a> {
    pid: u32,
    fd: u32,
    name: Option<&'a str>,
    vcpus: Vec<&'a VcpuState>,
}

fn emit(out: &mut dyn Write, event: Event<'_>) -> Result<(), WatchError> {
    let line = Line {
        schema: SCHEMA_VERSION,
        event,
    };
    serde_json::to_writer(&mut *out, &line).map_err(std::io::Error::from)?;
    out.write_all(b"\n")?;
    // One line per change, visible at once to whoever reads the pipe.
    out.flush()?;
    Ok(())
}

/// Runs watch mode until the selected VMs are gone or `opts.stop` is set.
///
/// # Errors
/// Scan errors (other than a VM exiting, which is an event), trace errors, output errors.
pub fn watch(
    scanner: &Scanner,
    mut opts: WatchOptions<'_>,
    out: &mut dyn Write,
) -> Result<(), WatchError> {
    let mut state: BTreeMap<VmId, VmState> = BTreeMap::new();
    // The fixed set of VMs to watch when a selector is given.
    let selected: Option<Vec<VmId>> = match opts.selector {
        Some(sel) => Some(
            scanner
                .select(Some(sel))?
                .iter()
                .map(|(v, _)| v.id)
                .collect(),
        ),
        None => None,
    };
    emit(
        out,
        Event::WatchStarted {
            host_tsc: read_host_tsc().0,
            trace_events: opts.trace.is_some(),
        },
    )?;
    let mut first = true;
    let stopped = || opts.stop.load(Ordering::Relaxed);
    loop {
        poll_once(scanner, selected.as_deref(), &mut state, first, out)?;
        let scanned = Instant::now();
        first = false;
        if selected.is_some() && state.is_empty() {
            return Ok(());
        }
        if stopped() {
            return Ok(());
        }
        let end = scanned + opts.interval;
        match opts.trace.as_mut() {
            Some(sub) => {
                // Wait out the interval, or after the first event until rescan_gap after the
                // last scan, merging the writes of each vCPU thread meanwhile.
                let early = scanned + rescan_gap(opts.interval);
                let mut writes: Vec<CoalescedWrites> = Vec::new();
                loop {
                    let until = if writes.is_empty() { end } else { early };
                    let now = Instant::now();
                    if now >= until || stopped() {
                        break;
                    }
                    coalesce_into(&mut writes, &sub.wait((until - now).min(STOP_POLL))?);
                }
                for w in &writes {
                    emit_trace(w, &state, sub.tsc_clock(), selected.as_deref(), out)?;
                }
            }
            None => {
                while let Some(left) = end.checked_duration_since(Instant::now()) {
                    if left.is_zero() || stopped() {
                        break;
                    }
                    std::thread::sleep(left.min(STOP_POLL));
                }
            }
        }
    }
}

fn emit_trace(
    w: &CoalescedWrites,
    state: &BTreeMap<VmId, VmState>,
    tsc_clock: bool,
    selected: Option<&[VmId]>,
    out: &mut dyn Write,
) -> Result<(), WatchError> {
    let ev = &w.write;
    let owner = state
        .iter()
        .find(|(_, s)| s.vcpus.values().any(|v| v.thread_pid == Some(ev.thread)));
    let owner_id = owner.map(|(id, _)| *id);
    // With --vm, only events of the watched VMs (when the thread is known) are reported.
    if selected.is_some() && owner_id.is_none() {
        return Ok(());
    }
    emit(
        out,
        Event::TscOffsetWritten {
            pid: owner_id.map(|i| i.pid),
            fd: owner_id.map(|i| i.fd),
            thread: ev.thread,
            vcpu: ev.vcpu,
            previous_tsc_offset: ev.previous,
            tsc_offset: ev.next,
            host_tsc: ev.timestamp,
            host_tsc_clock: tsc_clock,
            writes: w.writes,
        },
    )
}

fn poll_once(
    scanner: &Scanner,
    selected: Option<&[VmId]>,
    state: &mut BTreeMap<VmId, VmState>,
    first: bool,
    out: &mut dyn Write,
) -> Result<(), WatchError> {
    let listing = scanner.debugfs.vms()?;
    let mut present = Vec::with_capacity(listing.len());
    for vm in &listing {
        if selected.is_some_and(|s| !s.contains(&vm.id)) {
            continue;
        }
        let vcpus = match scanner.debugfs.read_vm(vm) {
            Ok(v) => v,
            Err(DebugfsError::VmExited { .. }) => continue,
            Err(e) => return Err(e.into()),
        };
        present.push(vm.id);
        let now: BTreeMap<u32, VcpuState> = vcpus.into_iter().map(|v| (v.vcpu, v)).collect();
        let last_seen = now
            .values()
            .map(|v| v.bracket.after.0)
            .max()
            .unwrap_or_else(|| read_host_tsc().0);
        let Some(old) = state.get_mut(&vm.id) else {
            let name = scanner
                .proc
                .process(vm.id.pid)
                .display_name()
                .map(str::to_owned);
            let found = VmEvent {
                pid: vm.id.pid,
                fd: vm.id.fd,
                name: name.as_deref(),
                vcpus: now.values().collect(),
            };
            emit(
                out,
                if first {
                    Event::VmFound(found)
                } else {
                    Event::VmAdded(found)
                },
            )?;
            state.insert(
                vm.id,
                VmState {
                    name,
                    vcpus: now,
                    last_seen,
                },
            );
            continue;
        };
        let (pid, fd) = (vm.id.pid, vm.id.fd);
        for (id, new) in &now {
            match old.vcpus.get(id) {
                None => emit(out, Event::VcpuAdded { pid, fd, vcpu: new })?,
                Some(prev) if changed(prev, new) => emit(
                    out,
                    Event::VcpuChanged {
                        pid,
                        fd,
                        vcpu: new,
                        previous: prev,
                    },
                )?,
                Some(_) => {}
            }
        }
        for id in old.vcpus.keys().filter(|id| !now.contains_key(id)) {
            emit(
                out,
                Event::VcpuRemoved {
                    pid,
                    fd,
                    vcpu: *id,
                    host_tsc_before: old.last_seen,
                    host_tsc_after: last_seen,
                },
            )?;
        }
        old.vcpus = now;
        old.last_seen = last_seen;
    }
    let gone: Vec<VmId> = state
        .keys()
        .filter(|id| !present.contains(id))
        .copied()
        .collect();
    for id in gone {
        let now = read_host_tsc().0;
        if let Some(s) = state.remove(&id) {
            emit(
                out,
                Event::VmGone {
                    pid: id.pid,
                    fd: id.fd,
                    name: s.name.as_deref(),
                    host_tsc_before: s.last_seen,
                    host_tsc_after: now,
                },
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kvm::debugfs::Scaling;
    use crate::kvm::hosttsc::TscBracket;

    /// The line shapes are the documented schema: `schema` and `event` first, then the fields.
    #[test]
    fn events_serialize_to_the_documented_lines() {
        let line = |e| {
            let mut out = Vec::new();
            emit(&mut out, e).unwrap();
            String::from_utf8(out).unwrap()
        };
        assert_eq!(
            line(Event::VcpuRemoved {
                pid: 1,
                fd: 2,
                vcpu: 3,
                host_tsc_before: 4,
                host_tsc_after: 5
            }),
            "{\"schema\":1,\"event\":\"vcpu_removed\",\"pid\":1,\"fd\":2,\"vcpu\":3,\"host_tsc_before\":4,\"host_tsc_after\":5}\n"
        );
        assert_eq!(
            line(Event::VmAdded(VmEvent {
                pid: 7,
                fd: 9,
                name: Some("web"),
                vcpus: Vec::new()
            })),
            "{\"schema\":1,\"event\":\"vm_added\",\"pid\":7,\"fd\":9,\"name\":\"web\",\"vcpus\":[]}\n"
        );
        let v = VcpuState {
            vcpu: 3,
            tsc_offset: -4,
            scaling: Scaling::ABSENT,
            guest_mode: Some(false),
            thread_pid: None,
            bracket: TscBracket::ticks(5, 6),
        };
        assert_eq!(
            line(Event::VcpuAdded {
                pid: 1,
                fd: 2,
                vcpu: &v
            }),
            "{\"schema\":1,\"event\":\"vcpu_added\",\"pid\":1,\"fd\":2,\"vcpu\":{\"vcpu\":3,\"tsc_offset\":-4,\"tsc_scaling_ratio\":1,\"tsc_frac_bits\":0,\"scaling_present\":false,\"guest_mode\":false,\"thread_pid\":null,\"host_tsc_before\":5,\"host_tsc_after\":6}}\n"
        );
        let started: serde_json::Value = serde_json::from_str(&line(Event::WatchStarted {
            host_tsc: 11,
            trace_events: true,
        }))
        .unwrap();
        assert_eq!(
            started,
            serde_json::json!({"schema": 1, "event": "watch_started", "host_tsc": 11, "trace_events": true})
        );
    }

    #[test]
    fn change_ignores_bracket_only() {
        let a = VcpuState {
            vcpu: 0,
            tsc_offset: 5,
            scaling: Scaling::ABSENT,
            guest_mode: Some(false),
            thread_pid: Some(7),
            bracket: TscBracket::ticks(1, 2),
        };
        let b = VcpuState {
            bracket: TscBracket::ticks(10, 20),
            ..a
        };
        assert!(!changed(&a, &b));
        assert!(changed(&a, &VcpuState { tsc_offset: 6, ..b }));
        assert!(changed(
            &a,
            &VcpuState {
                guest_mode: Some(true),
                ..b
            }
        ));
    }

    #[test]
    fn rescans_are_at_most_one_per_tenth_of_the_interval() {
        let ms = Duration::from_millis;
        assert_eq!(rescan_gap(ms(1000)), ms(100));
        assert_eq!(rescan_gap(ms(50)), ms(10));
        assert_eq!(rescan_gap(ms(5)), ms(5));
    }
}
