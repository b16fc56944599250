//! The agent's software TSC [`Skew`] over any `vmtsync_core::agent::AgentClock` (on the
//! agent, core's `arch::x86_64::NativeClock`, with the registered pvclock page and the
//! `syncport=` port).

use vmtsync_core::GuestTicks;
use vmtsync_core::agent::AgentClock;
use vmtsync_core::proto::PvclockReport;

use crate::tsc::Skew;

/// A clock whose every TSC reading goes through `skew`; everything else is the inner clock's.
///
/// The pvclock page is offered to the host only when `skew` is the identity: it describes the
/// real TSC, and pairing it with skewed readings would describe no consistent clock. A probe's
/// skew is applied after the inner clock's read returns, so with a sync port it lies outside
/// the `in`/`out` bracket (which matters where ring-0 code is emulated one instruction at a
/// time).
#[derive(Debug, Clone, Copy)]
pub struct GuestClock<C> {
    inner: C,
    skew: Skew,
}

impl<C: AgentClock> GuestClock<C> {
    /// `inner` with every TSC reading skewed by `skew`.
    pub const fn new(inner: C, skew: Skew) -> Self {
        Self { inner, skew }
    }

    fn skewed(&self, t: GuestTicks) -> GuestTicks {
        GuestTicks(self.skew.apply(t.0))
    }
}

impl<C: AgentClock> AgentClock for GuestClock<C> {
    #[inline]
    fn read_tsc(&mut self) -> GuestTicks {
        let t = self.inner.read_tsc();
        self.skewed(t)
    }

    fn vcpu_id(&self) -> u32 {
        self.inner.vcpu_id()
    }

    fn tsc_khz(&self) -> Option<u32> {
        self.inner.tsc_khz()
    }

    fn pvclock(&mut self) -> Option<PvclockReport> {
        if self.skew != Skew::IDENTITY {
            return None;
        }
        self.inner.pvclock()
    }

    fn invariant_tsc(&self) -> bool {
        self.inner.invariant_tsc()
    }

    #[inline]
    fn read_tsc_for_probe(&mut self, seq: u8) -> GuestTicks {
        let t = self.inner.read_tsc_for_probe(seq);
        self.skewed(t)
    }

    fn sync_port(&self) -> bool {
        self.inner.sync_port()
    }
}

#[cfg(test)]
mod tests {
    use vmtsync_core::agent::fake::FakeLink;
    use vmtsync_core::agent::{Agent, AgentState};
    use vmtsync_core::arch::clock::TscClock;
    use vmtsync_core::arch::{FakePorts, FakeTsc, PortAccess};
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

    type Inner = TscClock<FakeTsc, FakePorts, PvclockVcpuTimeInfo>;

    fn clock(skew: Skew, p: Option<PvclockVcpuTimeInfo>) -> GuestClock<Inner> {
        let mut inner = TscClock::new(FakeTsc::new(1_000, 10), 3)
            .with_tsc_khz(Some(2_000_000))
            .with_invariant_tsc(true);
        if let Some(page) = p {
            inner = inner.with_pvclock(page);
        }
        GuestClock::new(inner, skew)
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

    /// A probe on the sync port: the inner clock's `in`, read and `out`, the skew after.
    #[test]
    fn skewed_probe_read_keeps_the_inner_sync_port_bracket() {
        let ports = FakePorts::new();
        let inner: TscClock<_, _, PvclockVcpuTimeInfo> =
            TscClock::new(FakeTsc::new(100, 1), 0).with_sync_port(&ports, 0x2400);
        let skew = Skew {
            offset: 5,
            ratio: 2,
            frac_bits: 0,
        };
        let mut c = GuestClock::new(inner, skew);
        assert!(c.sync_port());
        assert_eq!(c.read_tsc_for_probe(7), GuestTicks(100 * 2 + 5));
        assert_eq!(
            ports.accesses().as_slice(),
            [
                PortAccess::In {
                    port: 0x2400,
                    value: 0xff
                },
                PortAccess::Out {
                    port: 0x2400,
                    value: 7
                },
            ]
        );
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
