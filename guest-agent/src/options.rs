//! Boot options from the PVH command line: space-separated `key=value` words.
//!
//! - `transport=uart|vsock|none`: probes over COM1 (default), or over a virtio-vsock stream
//!   on `port=N` (default [`DEFAULT_VSOCK_PORT`]) that the agent opens to the host (CID 2)
//!   (`vsock=connect`, the default) or accepts from the host (`vsock=listen`); or `none`: no
//!   probes and no poll loop. The agent publishes its recorder's header in guest memory
//!   (docs/memory-layout.md), records its `workload=` there with a sync beacon every
//!   `beacons=K` events on the sync port, and a host reads the rings out of guest memory.
//!   When a finite workload is done it emits a last beacon and halts the boot vCPU, leaving
//!   the VM (and the records) in place for the host to read.
//! - `beacons=K`: with `transport=none`, a sync beacon after every K workload events, plus
//!   one before the first and one after the last (default [`DEFAULT_BEACON_EVERY`]; 0: no
//!   beacons). Beacons use the `syncport=` port; `syncport=off` means no beacons.
//! - `virtio_mmio.device=SIZE@BASE:IRQ`: a virtio-mmio transport, in Linux's syntax, which QEMU
//!   `microvm` (with `acpi=off`) appends for each plugged device; `transport=vsock` looks for
//!   its socket device among them before trying PCI. Up to [`MAX_VIRTIO_MMIO`] are kept.
//! - `wire=postcard|line`: the vmtsync probe protocol (postcard + COBS, the default), or a
//!   human-typable line protocol for debugging (`cargo xtask run-agent -- wire=line`).
//! - `ring=0|3`: keep the protocol loop in ring 0 (default) or run it in ring 3 with IOPL 3.
//!   On nested KVM that emulates ring 0 (this project's hosts) the two trade: ring 0's port
//!   exits cost a tenth of ring 3's, so the boot vCPU's sync-port bracket is ~12 k ticks
//!   instead of ~115 k and the estimate's error ~0.4 k instead of ~30 k (the host's
//!   docs/anchor.md, "The boot vCPU's sync-port bracket"), while every other instruction of
//!   the loop runs emulated, so `ring=3` serves bulk work (a vsock event workload) natively.
//!   On an ordinary KVM host both rings run natively and the choice does not matter.
//! - `exit=N`: the code written to isa-debug-exit when the host says quit (default 0).
//! - `events=N`: record up to N guest events, one per loop poll that handled messages (see the
//!   agent binary's docs), and on each application processor up to N more, one per probe it
//!   answers, for the host to drain with `EventsRequest` (default 0: none).
//! - `flight=1`: the boot vCPU's event ring (`events=`, `workload=`) overwrites its oldest
//!   records when full, a flight recorder, instead of refusing new ones (`flight=0`, the
//!   default); the host counts what it overwrote.
//! - `claim=raw`: with `transport=none`, the recorder's header says its records hold the raw
//!   TSC whatever `skew=` makes them: a guest whose header lies, for the host's checks.
//! - `workload=RATE,COUNT[,PORT]`: emit COUNT (0: unlimited) events at RATE per second while
//!   serving probes, each with its sequence number as payload; with PORT, bracket each by an
//!   `out` to and an `in` from PORT (see [`crate::events::Workload`]).
//! - `syncport=N|off`: bracket the TSC read of every probe reply by an `in` from port N right
//!   before it and an `out` of the probe's sequence number right after, so the host's
//!   `kvm:kvm_pio` stamps bracket the read on any transport (the hello announces it as
//!   `Features::SYNC_PORT`). The port must be unused by the VMM. Default
//!   [`DEFAULT_SYNC_PORT`] (`0x2400`), free on QEMU microvm and q35 and the host's
//!   `--sync-port` default (its docs/anchor.md; `0x510` is fw_cfg), so every vCPU's probes are
//!   sync-port bracketed without a boot option; `syncport=off` for a VMM that decodes it.
//! - `skew=OFFSET,RATIO,FRAC`: report `OFFSET + ((tsc * RATIO) >> FRAC)` instead of the raw TSC.
//!   OFFSET may be negative (it wraps, like KVM's offset); numbers are decimal or `0x` hex.
//! - `skewN=OFFSET,RATIO,FRAC` (N below [`MAX_VCPUS`]): the same for the TSC read on vCPU N (the
//!   APIC id KVM names `vcpuN` after), instead of `skew=`; see docs/smp.md.
//! - `uarttx=write-then-wait|wait-then-write`: how COM1's link sends each byte ([`TxOrder`]).
//!   The default writes the byte and then waits for THRE, so nothing but the frame's own
//!   stores lies between a probe's TSC read and the `out` of its reply's first byte.
//!   `wait-then-write` is an ordinary console putc (poll LSR until THRE, then write): a test
//!   build of the guest whose status polls sit between the TSC read and that `out`, which the
//!   host's anchoring must neither trust nor be fooled by.
//! - `console=N`: console text on COM1 between protocol frames (its shared-UART wire rule:
//!   `vmtsync_core::arch::uart16550`): a few boot-log lines, then one line after every N-th
//!   message handled (`console=1`: after every message), and one at shutdown. Default 0: no
//!   text on COM1. For tests of a host that separates console text from frames.
//!
//! Unknown words are reported in the log and otherwise ignored, so a host can pass options a
//! newer agent understands.

use crate::tsc::Skew;

pub use vmtsync_core::arch::uart16550::TxOrder;

/// The transport that carries probes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// 16550 UART on COM1.
    Uart,
    /// virtio-vsock over PCI: a stream connection to host CID 2, port [`Options::vsock_port`].
    Vsock,
    /// No transport: the host reads the recorder out of guest memory.
    None,
}

/// Workload events between two sync beacons with `transport=none`, unless `beacons=` says
/// otherwise: a beacon costs two port exits, so one per 64 events keeps their share of the
/// guest's time small while anchoring every stretch of a fast workload.
pub const DEFAULT_BEACON_EVERY: u32 = 64;

/// The host vsock port the agent connects to unless `port=` says otherwise.
pub const DEFAULT_VSOCK_PORT: u32 = 1234;

/// The sync port unless `syncport=` says otherwise: no device decodes it on QEMU microvm or
/// q35 (an `in` reads `0xff`, an `out` is ignored, both exit to the VMM), it lies below the
/// range firmware gives PCI I/O BARs, and it is the host's `--sync-port` default.
pub const DEFAULT_SYNC_PORT: u16 = 0x2400;

/// What COM1 speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    /// `vmtsync_core::proto` frames: postcard + COBS, `0x00`-delimited.
    Postcard,
    /// One request byte, one text line back (see the agent binary's docs).
    Line,
}

/// The most vCPUs the agent brings up and serves (APIC ids below this): the boot processor and
/// up to `MAX_VCPUS - 1` application processors (docs/smp.md).
pub const MAX_VCPUS: usize = 8;

/// How many `virtio_mmio.device=` words [`Options`] keeps.
pub const MAX_VIRTIO_MMIO: usize = 4;

/// A virtio-mmio transport's register window, from `virtio_mmio.device=SIZE@BASE:IRQ`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioMmio {
    /// Guest-physical base address.
    pub base: u64,
    /// Window size in bytes.
    pub size: u64,
}

/// Parsed boot options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Probe transport.
    pub transport: Transport,
    /// Protocol on the transport.
    pub wire: Wire,
    /// Privilege level of the protocol loop: 0 (default) or 3.
    pub ring: u8,
    /// Code for isa-debug-exit on quit.
    pub exit_code: u8,
    /// Software skew applied to reported TSC values.
    pub skew: Skew,
    /// `skewN=`: the skew of vCPU N's TSC reads where it differs from [`Options::skew`].
    pub vcpu_skews: [Option<Skew>; MAX_VCPUS],
    /// How many guest events to record (0: none).
    pub events: u32,
    /// `flight=1`: the boot vCPU's event ring is a flight recorder (it overwrites its oldest
    /// records) instead of stopping when full.
    pub flight: bool,
    /// `claim=raw`: the memory header claims the raw TSC whatever the skew.
    pub claim_raw: bool,
    /// `workload=RATE,COUNT[,PORT]`: events per second, how many (0: until shutdown), and
    /// the port each event's `out`/`in` goes to.
    pub workload: Option<WorkloadOption>,
    /// vsock port for `transport=vsock`: the host's (connect) or the agent's (listen).
    pub vsock_port: u32,
    /// `vsock=listen`: wait for the host to connect instead of connecting to it.
    pub vsock_listen: bool,
    /// virtio-mmio transports named on the command line, in order.
    pub virtio_mmio: [Option<VirtioMmio>; MAX_VIRTIO_MMIO],
    /// `syncport=N|off`: bracket every probe's TSC read by an `in` from and an `out` to port
    /// N (default [`DEFAULT_SYNC_PORT`]); `None` after `syncport=off`.
    pub sync_port: Option<u16>,
    /// `uarttx=`: the order of COM1's per-byte write and THRE wait.
    pub uart_tx: TxOrder,
    /// `console=N`: a console line on COM1 after every N-th message (0: no console text).
    pub console: u32,
    /// `beacons=K`: with `transport=none`, a sync beacon every K workload events (0: none).
    pub beacon_every: u32,
}

/// Why an option word was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OptionError {
    /// The key is not one the agent knows.
    UnknownKey,
    /// The value does not parse for its key.
    BadValue,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            transport: Transport::Uart,
            wire: Wire::Postcard,
            ring: 0,
            exit_code: 0,
            skew: Skew::IDENTITY,
            vcpu_skews: [None; MAX_VCPUS],
            events: 0,
            flight: false,
            claim_raw: false,
            workload: None,
            vsock_port: DEFAULT_VSOCK_PORT,
            vsock_listen: false,
            virtio_mmio: [None; MAX_VIRTIO_MMIO],
            sync_port: Some(DEFAULT_SYNC_PORT),
            uart_tx: TxOrder::WriteThenWait,
            console: 0,
            beacon_every: DEFAULT_BEACON_EVERY,
        }
    }
}

impl Options {
    /// Parses `cmdline`, calling `on_error(word, error)` for every word it does not accept.
    pub fn parse(cmdline: &[u8], mut on_error: impl FnMut(&[u8], OptionError)) -> Self {
        let mut o = Self::default();
        for word in cmdline.split(|&b| b == b' ').filter(|w| !w.is_empty()) {
            if let Err(e) = o.apply(word) {
                on_error(word, e);
            }
        }
        o
    }

    fn apply(&mut self, word: &[u8]) -> Result<(), OptionError> {
        let eq = word
            .iter()
            .position(|&b| b == b'=')
            .ok_or(OptionError::UnknownKey)?;
        let (key, value) = (&word[..eq], &word[eq + 1..]);
        match key {
            b"transport" => match value {
                b"uart" => self.transport = Transport::Uart,
                b"vsock" => self.transport = Transport::Vsock,
                b"none" => self.transport = Transport::None,
                _ => return Err(OptionError::BadValue),
            },
            b"wire" => match value {
                b"postcard" => self.wire = Wire::Postcard,
                b"line" => self.wire = Wire::Line,
                _ => return Err(OptionError::BadValue),
            },
            b"ring" => match value {
                b"0" => self.ring = 0,
                b"3" => self.ring = 3,
                _ => return Err(OptionError::BadValue),
            },
            b"exit" => {
                let v = parse_u64(value).ok_or(OptionError::BadValue)?;
                self.exit_code = u8::try_from(v).map_err(|_| OptionError::BadValue)?;
            }
            b"events" => {
                let v = parse_u64(value).ok_or(OptionError::BadValue)?;
                self.events = u32::try_from(v).map_err(|_| OptionError::BadValue)?;
            }
            b"beacons" => {
                self.beacon_every = u32::try_from(parse_u64(value).ok_or(OptionError::BadValue)?)
                    .map_err(|_| OptionError::BadValue)?;
            }
            b"console" => {
                let v = parse_u64(value).ok_or(OptionError::BadValue)?;
                self.console = u32::try_from(v).map_err(|_| OptionError::BadValue)?;
            }
            b"flight" => match value {
                b"0" => self.flight = false,
                b"1" => self.flight = true,
                _ => return Err(OptionError::BadValue),
            },
            b"claim" if value == b"raw" => self.claim_raw = true,
            b"port" => {
                let v = parse_u64(value).ok_or(OptionError::BadValue)?;
                self.vsock_port = u32::try_from(v).map_err(|_| OptionError::BadValue)?;
            }
            b"vsock" => match value {
                b"connect" => self.vsock_listen = false,
                b"listen" => self.vsock_listen = true,
                _ => return Err(OptionError::BadValue),
            },
            b"virtio_mmio.device" => {
                let dev = parse_virtio_mmio(value).ok_or(OptionError::BadValue)?;
                let slot = self
                    .virtio_mmio
                    .iter_mut()
                    .find(|s| s.is_none())
                    .ok_or(OptionError::BadValue)?;
                *slot = Some(dev);
            }
            b"syncport" if value == b"off" => self.sync_port = None,
            b"syncport" => {
                let v = parse_u64(value).ok_or(OptionError::BadValue)?;
                self.sync_port = Some(u16::try_from(v).map_err(|_| OptionError::BadValue)?);
            }
            b"uarttx" => match value {
                b"write-then-wait" => self.uart_tx = TxOrder::WriteThenWait,
                b"wait-then-write" => self.uart_tx = TxOrder::WaitThenWrite,
                _ => return Err(OptionError::BadValue),
            },
            b"workload" => {
                self.workload = Some(parse_workload(value).ok_or(OptionError::BadValue)?);
            }
            // `skew=` and `skewN=` (one arm: less `.text`).
            [b's', b'k', b'e', b'w', n @ ..] => {
                let skew = parse_skew(value).ok_or(OptionError::BadValue)?;
                if n.is_empty() {
                    self.skew = skew;
                } else {
                    let vcpu = parse_u64(n).ok_or(OptionError::UnknownKey)?;
                    *usize::try_from(vcpu)
                        .ok()
                        .and_then(|i| self.vcpu_skews.get_mut(i))
                        .ok_or(OptionError::BadValue)? = Some(skew);
                }
            }
            _ => return Err(OptionError::UnknownKey),
        }
        Ok(())
    }

    /// The skew of TSC reads on vCPU `vcpu`: its `skewN=`, else `skew=`.
    #[must_use]
    pub fn skew_of(&self, vcpu: u32) -> Skew {
        usize::try_from(vcpu)
            .ok()
            .and_then(|i| self.vcpu_skews.get(i).copied().flatten())
            .unwrap_or(self.skew)
    }
}

/// Parses Linux's `SIZE@BASE[:IRQ[:ID]]` (SIZE may end in K or M); the IRQ is not used.
fn parse_virtio_mmio(v: &[u8]) -> Option<VirtioMmio> {
    let at = v.iter().position(|&b| b == b'@')?;
    let (size, rest) = (&v[..at], &v[at + 1..]);
    let base = rest.split(|&b| b == b':').next()?;
    let size = match size.split_last() {
        Some((b'K' | b'k', n)) => parse_u64(n)?.checked_mul(1 << 10)?,
        Some((b'M' | b'm', n)) => parse_u64(n)?.checked_mul(1 << 20)?,
        _ => parse_u64(size)?,
    };
    Some(VirtioMmio {
        base: parse_u64(base)?,
        size,
    })
}

/// The `workload=RATE,COUNT[,PORT]` option.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkloadOption {
    /// Events per second (at least 1).
    pub rate: u64,
    /// Events to emit (0: until shutdown).
    pub count: u64,
    /// The port of each event's `out`/`in`, if any.
    pub port: Option<u16>,
}

fn parse_workload(v: &[u8]) -> Option<WorkloadOption> {
    let mut parts = v.split(|&b| b == b',');
    let rate = parse_u64(parts.next()?)?;
    let count = parse_u64(parts.next()?)?;
    let port = match parts.next() {
        Some(p) => Some(u16::try_from(parse_u64(p)?).ok()?),
        None => None,
    };
    if parts.next().is_some() || rate == 0 {
        return None;
    }
    Some(WorkloadOption { rate, count, port })
}

fn parse_skew(v: &[u8]) -> Option<Skew> {
    let mut parts = v.split(|&b| b == b',');
    let offset = parse_i64_wrapping(parts.next()?)?;
    let ratio = parse_u64(parts.next()?)?;
    let frac_bits = u32::try_from(parse_u64(parts.next()?)?).ok()?;
    if parts.next().is_some() || frac_bits > 63 || ratio == 0 {
        return None;
    }
    Some(Skew {
        offset,
        ratio,
        frac_bits,
    })
}

/// Parses an optionally negative number into its two's-complement u64 (KVM stores the TSC
/// offset the same way).
fn parse_i64_wrapping(v: &[u8]) -> Option<u64> {
    match v.split_first() {
        Some((b'-', rest)) => parse_u64(rest).map(u64::wrapping_neg),
        _ => parse_u64(v),
    }
}

/// Parses decimal or `0x`-prefixed hex; `None` on empty input, bad digits or overflow.
pub fn parse_u64(v: &[u8]) -> Option<u64> {
    let (digits, radix) = match v {
        [b'0', b'x' | b'X', rest @ ..] => (rest, 16),
        _ => (v, 10),
    };
    if digits.is_empty() {
        return None;
    }
    let mut n: u64 = 0;
    for &d in digits {
        let x = char::from(d).to_digit(radix)?;
        n = n.checked_mul(u64::from(radix))?.checked_add(u64::from(x))?;
    }
    Some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> (Options, Vec<(String, OptionError)>) {
        let mut errs = Vec::new();
        let o = Options::parse(s.as_bytes(), |w, e| {
            errs.push((String::from_utf8_lossy(w).into_owned(), e));
        });
        (o, errs)
    }

    #[test]
    fn empty_command_line_gives_defaults() {
        assert_eq!(parse(""), (Options::default(), vec![]));
        assert_eq!(parse("   "), (Options::default(), vec![]));
    }

    #[test]
    fn known_options_parse() {
        let (o, errs) = parse(
            "transport=uart exit=0x2a  skew=-1000,0x3,1 wire=line ring=0 events=40 syncport=0x2400",
        );
        assert!(errs.is_empty(), "{errs:?}");
        assert!(!o.flight, "stop-when-full is the default");
        assert_eq!(parse("").0.ring, 0, "ring 0 is the default");
        assert_eq!(parse("ring=3").0.ring, 3);
        assert!(parse("flight=1").0.flight);
        assert!(parse("claim=raw").0.claim_raw && !o.claim_raw);
        assert_eq!(parse("claim=yes").1.len(), 1, "claim is raw");
        assert_eq!(parse("flight=yes").1.len(), 1, "flight is 0 or 1");
        assert_eq!(
            parse("").0.sync_port,
            Some(DEFAULT_SYNC_PORT),
            "on by default"
        );
        assert_eq!(parse("syncport=0x80").0.sync_port, Some(0x80));
        assert_eq!(parse("syncport=off").0.sync_port, None);
        assert_eq!(
            parse("syncport=off syncport=0x2400").0.sync_port,
            Some(0x2400)
        );
        assert_eq!(parse("syncport=65536").1.len(), 1, "a port is 16 bits");
        assert_eq!(parse("syncport=none").1.len(), 1, "only `off` turns it off");
        assert_eq!(o.wire, Wire::Line);
        assert_eq!(o.ring, 0);
        assert_eq!(o.transport, Transport::Uart);
        assert_eq!(o.exit_code, 42);
        assert_eq!(o.events, 40);
        assert_eq!(o.uart_tx, TxOrder::WriteThenWait);
        assert_eq!(
            parse("uarttx=wait-then-write").0.uart_tx,
            TxOrder::WaitThenWrite
        );
        assert_eq!(
            parse("uarttx=wait-then-write uarttx=write-then-wait")
                .0
                .uart_tx,
            TxOrder::WriteThenWait
        );
        assert_eq!(
            parse("uarttx=putc").1.len(),
            1,
            "an unknown order is refused"
        );
        assert_eq!(o.console, 0, "no console text unless asked");
        assert_eq!(parse("console=1").0.console, 1);
        assert_eq!(parse("console=4294967296").1.len(), 1, "a u32");
        assert_eq!(
            o.skew,
            Skew {
                offset: 0u64.wrapping_sub(1000),
                ratio: 3,
                frac_bits: 1
            }
        );
    }

    #[test]
    fn transport_none_takes_a_beacon_interval() {
        let (o, errs) = parse("transport=none beacons=16 beacons=x beacons=4294967296");
        let kinds: Vec<_> = errs.iter().map(|(w, e)| (w.as_str(), *e)).collect();
        assert_eq!(
            kinds,
            [
                ("beacons=x", OptionError::BadValue),
                ("beacons=4294967296", OptionError::BadValue)
            ]
        );
        assert_eq!((o.transport, o.beacon_every), (Transport::None, 16));
        assert_eq!(Options::default().beacon_every, DEFAULT_BEACON_EVERY);
        assert_eq!(parse("beacons=0").0.beacon_every, 0);
    }

    #[test]
    fn per_vcpu_skews_override_the_common_one() {
        let (o, errs) =
            parse("skew2=-5,1,0 skew=7,1,0 skew7=0x10,2,1 skew8=1,1,0 skew1=1,0,0 skewx=1,1,0");
        let kinds: Vec<_> = errs.iter().map(|(w, e)| (w.as_str(), *e)).collect();
        assert_eq!(
            kinds,
            vec![
                ("skew8=1,1,0", OptionError::BadValue),
                ("skew1=1,0,0", OptionError::BadValue),
                ("skewx=1,1,0", OptionError::UnknownKey),
            ]
        );
        let common = Skew {
            offset: 7,
            ratio: 1,
            frac_bits: 0,
        };
        assert_eq!(o.skew_of(0), common);
        assert_eq!(o.skew_of(1), common);
        assert_eq!(o.skew_of(2).offset, 0u64.wrapping_sub(5));
        assert_eq!(o.skew_of(7).apply(100), 0x10 + 100);
        assert_eq!(o.skew_of(8), common);
        assert_eq!(o.skew_of(u32::MAX), common);
    }

    #[test]
    fn bad_words_are_reported_and_ignored() {
        let (o, errs) = parse(
            "ring=1 wire=json exit=256 foo transport=pci skew=1,0,0 skew=1,1,64 skew=1,1 bar=1 \
             events=-1 events=4294967296 exit=7",
        );
        assert_eq!(o.exit_code, 7);
        assert_eq!(o.skew, Skew::IDENTITY);
        assert_eq!(o.events, 0);
        let kinds: Vec<_> = errs.iter().map(|(w, e)| (w.as_str(), *e)).collect();
        assert_eq!(
            kinds,
            vec![
                ("ring=1", OptionError::BadValue),
                ("wire=json", OptionError::BadValue),
                ("exit=256", OptionError::BadValue),
                ("foo", OptionError::UnknownKey),
                ("transport=pci", OptionError::BadValue),
                ("skew=1,0,0", OptionError::BadValue),
                ("skew=1,1,64", OptionError::BadValue),
                ("skew=1,1", OptionError::BadValue),
                ("bar=1", OptionError::UnknownKey),
                ("events=-1", OptionError::BadValue),
                ("events=4294967296", OptionError::BadValue),
            ]
        );
    }

    #[test]
    fn workload_parses_with_and_without_a_port() {
        let (o, errs) = parse("workload=1000000,0");
        assert!(errs.is_empty(), "{errs:?}");
        assert_eq!(
            o.workload,
            Some(WorkloadOption {
                rate: 1_000_000,
                count: 0,
                port: None
            })
        );
        let (o, _) = parse("workload=10,500,0x3f0");
        assert_eq!(
            o.workload,
            Some(WorkloadOption {
                rate: 10,
                count: 500,
                port: Some(0x3f0)
            })
        );
        for bad in [
            "workload=0,5",
            "workload=5",
            "workload=5,5,65536",
            "workload=1,1,1,1",
        ] {
            let (o, errs) = parse(bad);
            assert_eq!((o.workload, errs.len()), (None, 1), "{bad}");
        }
    }

    #[test]
    fn vsock_transport_and_port_parse() {
        let (o, errs) = parse("transport=vsock port=0x10000 port=4294967296 vsock=listen");
        assert_eq!(o.transport, Transport::Vsock);
        assert_eq!(o.vsock_port, 0x10000);
        assert!(o.vsock_listen);
        assert!(!parse("vsock=listen vsock=connect").0.vsock_listen);
        assert_eq!(parse("vsock=bind").1.len(), 1);
        assert_eq!(
            errs,
            vec![("port=4294967296".into(), OptionError::BadValue)]
        );
        assert_eq!(parse("").0.vsock_port, DEFAULT_VSOCK_PORT);
    }

    #[test]
    fn virtio_mmio_devices_parse_in_linux_syntax() {
        let (o, errs) = parse(
            "virtio_mmio.device=512@0xfeb00e00:12 virtio_mmio.device=4K@0xd0000000 \
             virtio_mmio.device=512 virtio_mmio.device=1x@0x1000",
        );
        assert_eq!(
            o.virtio_mmio[..2],
            [
                Some(VirtioMmio {
                    base: 0xfeb0_0e00,
                    size: 512
                }),
                Some(VirtioMmio {
                    base: 0xd000_0000,
                    size: 4096
                }),
            ]
        );
        assert_eq!(o.virtio_mmio[2], None);
        assert_eq!(errs.len(), 2, "{errs:?}");
        let many = "virtio_mmio.device=512@0x1000 ".repeat(MAX_VIRTIO_MMIO + 1);
        let (o, errs) = parse(&many);
        assert!(o.virtio_mmio.iter().all(Option::is_some));
        assert_eq!(errs.len(), 1, "the fifth is refused");
    }

    #[test]
    fn numbers_parse_in_both_radixes_and_reject_overflow() {
        assert_eq!(parse_u64(b"0"), Some(0));
        assert_eq!(parse_u64(b"18446744073709551615"), Some(u64::MAX));
        assert_eq!(parse_u64(b"18446744073709551616"), None);
        assert_eq!(parse_u64(b"0xffffffffffffffff"), Some(u64::MAX));
        assert_eq!(parse_u64(b"0x10000000000000000"), None);
        assert_eq!(parse_u64(b"0x"), None);
        assert_eq!(parse_u64(b""), None);
        assert_eq!(parse_u64(b"12a"), None);
        assert_eq!(parse_i64_wrapping(b"-1"), Some(u64::MAX));
    }
}
