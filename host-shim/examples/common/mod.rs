//! What the synthetic writer examples (`ctf_write`, `perfetto_write`) share: their command line
//! and the events they write.

use std::process::ExitCode;

use vmtsync::formats::{Bound, ExportEvent, Payload};

/// The command line `OUT EVENTS VCPUS`: where to write, how many events, over how many vCPUs.
pub struct WriterArgs {
    /// The output path.
    pub out: String,
    /// How many events.
    pub events: u64,
    /// How many vCPUs (above 0).
    pub vcpus: u32,
}

impl WriterArgs {
    /// The process's arguments; when they are not `OUT EVENTS VCPUS`, prints `usage: {usage}`
    /// and gives the exit code of a usage error (2).
    pub fn parse(usage: &str) -> Result<Self, ExitCode> {
        let args: Vec<String> = std::env::args().collect();
        let (Some(out), Some(events), Some(vcpus)) = (
            args.get(1),
            args.get(2).and_then(|s| s.parse::<u64>().ok()),
            args.get(3)
                .and_then(|s| s.parse::<u32>().ok())
                .filter(|&v| v > 0),
        ) else {
            eprintln!("usage: {usage}");
            return Err(ExitCode::from(2));
        };
        Ok(Self {
            out: out.clone(),
            events,
            vcpus,
        })
    }
}

/// Event `i` of a synthetic run, at `host` on the host's TSC and `guest_tsc` on the guest's:
/// the vCPUs take turns, every field is set, the guaranteed interval is ±5000 ticks, and every
/// other event carries its index as an 8-byte payload.
pub fn synthetic_event(i: u64, vcpus: u32, id: u16, guest_tsc: u64, host: u64) -> ExportEvent {
    let bytes = i.to_le_bytes();
    ExportEvent {
        vcpu: u32::try_from(i % u64::from(vcpus)).unwrap_or(0),
        id,
        guest_tsc: Some(guest_tsc),
        host_tsc: host,
        bound: Some(Bound {
            lo: host - 5_000,
            hi: host + 5_000,
        }),
        payload: Payload::new(if i.is_multiple_of(2) { &[] } else { &bytes }).unwrap_or_default(),
    }
}
