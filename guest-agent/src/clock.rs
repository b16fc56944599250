//! The guest clocks as a `vmtsync_core::agent::AgentClock`: the TSC through the software
//! [`Skew`], the vCPU id, the TSC frequency, and the registered pvclock page.

use vmtsync_core::GuestTicks;
use vmtsync_core::agent::AgentClock;
use vmtsync_core::arch::Tsc;
use vmtsync_core::proto::PvclockReport;
use vmtsync_core::pvclock::{DEFAULT_MAX_ATTEMPTS, PvclockSource, try_read_with_tsc};

use crate::tsc::Skew;

/// The agent's clock: every TSC it reports goes through `skew`.
#[derive(Debug)]
pub struct GuestClock<T, P> {
    tsc: T,
    pvclock: Option<P>,
    skew: Skew,
    vcpu: u32,
    tsc_khz: Option<u32>,
    invariant_tsc: bool,
    /// `syncport=N`: the port whose `in`/`out` bracket every probe's TSC read.
    sync_port: Option<u16>,
}

impl<T: Tsc, P: PvclockSource> GuestClock<T, P> {
    /// A clock over `tsc` and, if registered, the pvclock page.
    ///
    /// The page is offered to the host only when `skew` is the identity: it describes the real
    /// TSC, and pairing it with skewed readings would describe no consistent clock.
    pub fn new(
        tsc: T,
        pvclock: Option<P>,
        skew: Skew,
        vcpu: u32,
        tsc_khz: Option<u32>,
        invariant_tsc: bool,
    ) -> Self {
        Self {
            tsc,
            pvclock: pvclock.filter(|_| skew == Skew::IDENTITY),
            skew,
            vcpu,
            tsc_khz,
            invariant_tsc,
            sync_port: None,
        }
    }

    /// Brackets every probe's TSC read by an `in` from `port` right before it and an `out` of
    /// the probe's sequence number right after (`syncport=N`; the host's docs/anchor.md).
    #[must_use]
    pub const fn with_sync_port(mut self, port: Option<u16>) -> Self {
        self.sync_port = port;
        self
    }
}

impl<T: Tsc, P: PvclockSource> AgentClock for GuestClock<T, P> {
    #[inline]
    fn read_tsc(&mut self) -> GuestTicks {
        GuestTicks(self.skew.apply(self.tsc.read_ordered()))
    }

    fn vcpu_id(&self) -> u32 {
        self.vcpu
    }

    fn tsc_khz(&self) -> Option<u32> {
        self.tsc_khz
    }

    fn pvclock(&mut self) -> Option<PvclockReport> {
        let page = self.pvclock.as_ref()?;
        // A page never published, or always mid-update, has nothing to report.
        let s = try_read_with_tsc(page, &self.tsc, DEFAULT_MAX_ATTEMPTS).ok()?;
        let f = s.read.fields;
        Some(PvclockReport {
            vcpu: self.vcpu,
            version: s.read.version,
            tsc_timestamp: f.tsc_timestamp.0,
            system_time: f.system_time.0,
            mul: f.scale.mul,
            shift: f.scale.shift,
            flags: f.flags.0,
            tsc: s.tsc,
        })
    }

    fn invariant_tsc(&self) -> bool {
        self.invariant_tsc
    }

    #[inline]
    fn read_tsc_for_probe(&mut self, seq: u8) -> GuestTicks {
        let Some(port) = self.sync_port else {
            return self.read_tsc();
        };
        // The host's kvm_pio stamps of these two exits bracket the read: nothing but the
        // read sits between them (the skew is applied after the `out`), which matters where
        // ring-0 code is emulated one instruction at a time.
        let _ = crate::port::inb(port);
        let raw = self.tsc.read_ordered();
        crate::port::outb(port, seq);
        GuestTicks(self.skew.apply(raw))
    }

    fn sync_port(&self) -> bool {
        self.sync_port.is_some()
    }
}

#[cfg(test)]
mod tests {
    use vmtsync_core::agent::fake::FakeLink;
    use vmtsync_core::agent::{Agent, AgentState};
    use vmtsync_core::arch::FakeTsc;
    use vmtsync_core::proto::{Features, Hello, Message, PROTOCOL_VERSION, ProbeReplyFull};
    use vmtsync_core::pvclock::PvclockVcpuTimeInfo;

    use super::*;

    fn page(version: u32) -> PvclockVcpuTimeInfo {
        PvclockVcpuTimeInfo {
            version,
            tsc_timestamp: 900,
            system_time: 5_000,
            tsc_to_system_mul: 0x8000_0000,
            tsc_shift: 1,
            flags: 1,
            ..PvclockVcpuTimeInfo::default()
        }
    }

    fn clock(
        skew: Skew,
        p: Option<PvclockVcpuTimeInfo>,
    ) -> GuestClock<FakeTsc, PvclockVcpuTimeInfo> {
        GuestClock::new(FakeTsc::new(1_000, 10), p, skew, 3, Some(2_000_000), true)
    }

    #[test]
    fn identity_clock_reports_raw_tsc_and_the_pvclock_page() {
        let mut c = clock(Skew::IDENTITY, Some(page(4)));
        assert_eq!(c.read_tsc(), GuestTicks(1_000));
        assert_eq!(
            c.pvclock(),
            Some(PvclockReport {
                vcpu: 3,
                version: 4,
                tsc_timestamp: 900,
                system_time: 5_000,
                mul: 0x8000_0000,
                shift: 1,
                flags: 1,
                tsc: GuestTicks(1_010),
            })
        );
        assert_eq!(
            (c.vcpu_id(), c.tsc_khz(), c.invariant_tsc()),
            (3, Some(2_000_000), true)
        );
    }

    #[test]
    fn skewed_clock_scales_reads_and_withholds_pvclock() {
        let skew = Skew {
            offset: 0u64.wrapping_sub(500),
            ratio: 3,
            frac_bits: 1,
        };
        let mut c = clock(skew, Some(page(4)));
        assert_eq!(c.read_tsc(), GuestTicks(1_000 * 3 / 2 - 500));
        assert_eq!(c.pvclock(), None);
    }

    #[test]
    fn unpublished_page_reports_nothing() {
        let mut c = clock(Skew::IDENTITY, Some(page(0)));
        assert_eq!(c.pvclock(), None);
    }

    /// The core agent state machine over this clock: the hello advertises pvclock and the
    /// invariant TSC, and a full probe carries the skewed TSC.
    #[test]
    fn core_agent_serves_this_clock() {
        let skew = Skew {
            offset: 7,
            ..Skew::IDENTITY
        };
        let mut agent: Agent<FakeLink, _> = Agent::new(FakeLink::new(), clock(skew, Some(page(2))));
        assert!(agent.link_mut().push_message(&Message::Hello(Hello {
            version: PROTOCOL_VERSION,
            features: Features::NONE,
        })));
        assert!(
            agent
                .link_mut()
                .push_message(&Message::ProbeFull { seq: 9 })
        );
        assert_eq!(agent.poll().map(|p| p.state), Ok(AgentState::Ready));
        let mut out = std::vec::Vec::new();
        while let Some(m) = agent.link_mut().next_sent() {
            out.push(m.expect("agent frames decode"));
        }
        let Message::Capabilities(caps) = out[0] else {
            panic!("{out:?}")
        };
        // Skewed: no pvclock offered.
        assert!(!caps.features.contains(Features::PVCLOCK));
        assert!(caps.features.contains(Features::INVARIANT_TSC));
        assert_eq!(caps.vcpu, 3);
        assert_eq!(caps.tsc, GuestTicks(1_007));
        assert_eq!(
            out[1],
            Message::ProbeReplyFull(ProbeReplyFull {
                seq: 9,
                vcpu: 3,
                tsc: 1_017
            })
        );
    }
}
