//! [`TscClock`]: the ready-made [`AgentClock`] over an ordered TSC, with what CPUID says about
//! it, an optional sync port and an optional pvclock page. On real hardware it is
//! `arch::x86_64::NativeClock`; tests build it over the fakes.

use super::cpuid::{has_invariant_tsc, tsc_freq};
use super::{Cpuid, PortIo, PvclockPage, Tsc};
use crate::agent::AgentClock;
use crate::proto::PvclockReport;
use crate::pvclock::{DEFAULT_MAX_ATTEMPTS, PvclockSource, try_read_with_tsc};
use crate::units::GuestTicks;

/// An [`AgentClock`] over the TSC `T`: the vCPU id, TSC frequency and invariance it reports
/// are fixed at construction ([`TscClock::from_cpuid`] reads them from CPUID).
///
/// With a sync port ([`TscClock::with_sync_port`]) every probe's TSC read is bracketed by an
/// `in` from the port right before it and an `out` of the probe's sequence number right after
/// it, so the host's `kvm:kvm_pio` stamps of those two exits bracket the read on any
/// transport ([`crate::proto::Features::SYNC_PORT`]). The port must be one the VMM does not
/// use (`0x2400` is free on QEMU `microvm` and `q35`).
///
/// With a pvclock page ([`TscClock::with_pvclock`]) it reports KVM's kvmclock parameters.
#[derive(Clone, Copy, Debug)]
pub struct TscClock<T, P, V = PvclockPage<'static>> {
    tsc: T,
    vcpu: u32,
    tsc_khz: Option<u32>,
    invariant: bool,
    sync: Option<(P, u16)>,
    pvclock: Option<V>,
}

impl<T: Tsc, P: PortIo, V: PvclockSource> TscClock<T, P, V> {
    /// A clock over `tsc` on vCPU `vcpu`, frequency unknown, not known to be invariant, no
    /// sync port, no pvclock page.
    #[must_use]
    pub const fn new(tsc: T, vcpu: u32) -> Self {
        Self {
            tsc,
            vcpu,
            tsc_khz: None,
            invariant: false,
            sync: None,
            pvclock: None,
        }
    }

    /// A clock over `tsc` described by `cpuid`: the vCPU id is the initial APIC id
    /// (CPUID.1:EBX\[31:24\], which KVM names `vcpuN` after; guests with more than 255 vCPUs
    /// need the x2APIC id instead), the frequency comes from
    /// [`tsc_freq`](super::cpuid::tsc_freq) (leaf 0x15, else KVM's timing leaf
    /// 0x4000_0010, else leaf 0x16's nominal MHz), invariance from CPUID.8000_0007:EDX\[8\].
    #[must_use]
    pub fn from_cpuid<C: Cpuid + ?Sized>(tsc: T, cpuid: &C) -> Self {
        let vcpu = cpuid.cpuid(1, 0).ebx >> 24;
        let tsc_khz = tsc_freq(cpuid).and_then(|f| u32::try_from(f.hz / 1000).ok());
        Self::new(tsc, vcpu)
            .with_tsc_khz(tsc_khz)
            .with_invariant_tsc(has_invariant_tsc(cpuid))
    }

    /// The same clock reporting `khz` as its TSC frequency.
    #[must_use]
    pub fn with_tsc_khz(mut self, khz: Option<u32>) -> Self {
        self.tsc_khz = khz;
        self
    }

    /// The same clock reporting whether the TSC is invariant.
    #[must_use]
    pub fn with_invariant_tsc(mut self, invariant: bool) -> Self {
        self.invariant = invariant;
        self
    }

    /// The same clock on vCPU `vcpu`.
    #[must_use]
    pub fn with_vcpu(mut self, vcpu: u32) -> Self {
        self.vcpu = vcpu;
        self
    }

    /// The same clock bracketing every probe's TSC read by an `in` from `port` and an `out`
    /// of the probe's sequence number to it, through `ports`.
    #[must_use]
    pub fn with_sync_port(mut self, ports: P, port: u16) -> Self {
        self.sync = Some((ports, port));
        self
    }

    /// The same clock reporting the kvmclock parameters of `page`.
    #[must_use]
    pub fn with_pvclock(mut self, page: V) -> Self {
        self.pvclock = Some(page);
        self
    }

    /// The TSC it reads.
    #[must_use]
    pub const fn tsc(&self) -> &T {
        &self.tsc
    }

    /// The sync port, if any.
    #[must_use]
    pub fn sync_port_number(&self) -> Option<u16> {
        self.sync.as_ref().map(|&(_, port)| port)
    }
}

impl<T: Tsc, P: PortIo, V: PvclockSource> AgentClock for TscClock<T, P, V> {
    #[inline]
    fn read_tsc(&mut self) -> GuestTicks {
        GuestTicks(self.tsc.read_ordered())
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
        self.invariant
    }

    #[inline]
    fn read_tsc_for_probe(&mut self, seq: u8) -> GuestTicks {
        let Some((ports, port)) = &self.sync else {
            return self.read_tsc();
        };
        // Nothing but the ordered read sits between the two exits, which matters where
        // ring-0 code is emulated one instruction at a time.
        let _ = ports.inb(*port);
        let t = self.tsc.read_ordered();
        ports.outb(*port, seq);
        GuestTicks(t)
    }

    fn sync_port(&self) -> bool {
        self.sync.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::super::kvm_abi::PvclockVcpuTimeInfo;
    use super::super::{CpuidEntry, CpuidResult, FakeCpuid, FakePorts, FakeTsc, PortAccess};
    use super::*;

    /// A TSC that leaves a [`PortAccess::Mark`] in the port log at every read, so a test sees
    /// where the read falls among the port accesses.
    struct MarkingTsc<'a> {
        ports: &'a FakePorts,
        tsc: FakeTsc,
    }

    const TSC_READ: u32 = 0x75c;

    impl Tsc for MarkingTsc<'_> {
        fn read_ordered(&self) -> u64 {
            self.ports.mark(TSC_READ);
            self.tsc.read_ordered()
        }
    }

    const fn e(leaf: u32, eax: u32, ebx: u32, ecx: u32, edx: u32) -> CpuidEntry {
        CpuidEntry::new(leaf, 0, CpuidResult { eax, ebx, ecx, edx })
    }

    #[test]
    fn from_cpuid_reads_apic_id_frequency_and_invariance() {
        let table = [
            e(0, 0x15, 0, 0, 0),
            e(1, 0, 3 << 24, 0, 0),
            // 25 MHz crystal × 120 / 2 = 1.5 GHz.
            e(0x15, 2, 120, 25_000_000, 0),
            e(0x8000_0000, 0x8000_0007, 0, 0, 0),
            e(0x8000_0007, 0, 0, 0, 1 << 8),
        ];
        let c: TscClock<FakeTsc, FakePorts, PvclockVcpuTimeInfo> =
            TscClock::from_cpuid(FakeTsc::new(10, 1), &FakeCpuid::new(&table));
        assert_eq!(
            (c.vcpu_id(), c.tsc_khz(), c.invariant_tsc(), c.sync_port()),
            (3, Some(1_500_000), true, false)
        );
        let bare: TscClock<FakeTsc, FakePorts, PvclockVcpuTimeInfo> =
            TscClock::from_cpuid(FakeTsc::new(10, 1), &FakeCpuid::new(&[]));
        assert_eq!(
            (bare.vcpu_id(), bare.tsc_khz(), bare.invariant_tsc()),
            (0, None, false),
            "a CPUID without those leaves reports nothing"
        );
    }

    #[test]
    fn sync_port_brackets_the_probe_read_and_nothing_else() {
        let ports = FakePorts::new();
        let tsc = MarkingTsc {
            ports: &ports,
            tsc: FakeTsc::new(1_000, 5),
        };
        let mut c: TscClock<_, _, PvclockVcpuTimeInfo> =
            TscClock::new(tsc, 0).with_sync_port(&ports, 0x2400);
        assert!(c.sync_port());
        assert_eq!(c.sync_port_number(), Some(0x2400));
        assert_eq!(c.read_tsc_for_probe(0x42), GuestTicks(1_000));
        assert_eq!(
            ports.accesses().as_slice(),
            [
                PortAccess::In {
                    port: 0x2400,
                    value: 0xff
                },
                PortAccess::Mark(TSC_READ),
                PortAccess::Out {
                    port: 0x2400,
                    value: 0x42
                },
            ]
        );
        ports.clear_log();
        assert_eq!(c.read_tsc(), GuestTicks(1_005));
        assert_eq!(
            ports.accesses().as_slice(),
            [PortAccess::Mark(TSC_READ)],
            "a plain read touches no port"
        );
    }

    #[test]
    fn pvclock_page_is_reported_with_a_tsc_read_inside_it() {
        let page = PvclockVcpuTimeInfo {
            version: 4,
            tsc_timestamp: 900,
            system_time: 5_000,
            tsc_to_system_mul: 0x8000_0000,
            tsc_shift: 1,
            flags: 1,
            ..PvclockVcpuTimeInfo::default()
        };
        let mut c: TscClock<FakeTsc, FakePorts, _> =
            TscClock::new(FakeTsc::new(1_000, 10), 2).with_pvclock(page);
        assert_eq!(
            c.pvclock(),
            Some(PvclockReport {
                vcpu: 2,
                version: 4,
                tsc_timestamp: 900,
                system_time: 5_000,
                mul: 0x8000_0000,
                shift: 1,
                flags: 1,
                tsc: GuestTicks(1_000),
            })
        );
        let unpublished = PvclockVcpuTimeInfo { version: 0, ..page };
        let mut c: TscClock<FakeTsc, FakePorts, _> =
            TscClock::new(FakeTsc::new(1_000, 10), 2).with_pvclock(unpublished);
        assert_eq!(c.pvclock(), None, "version 0: never published");
        let mut none: TscClock<FakeTsc, FakePorts, PvclockVcpuTimeInfo> =
            TscClock::new(FakeTsc::new(1, 1), 0);
        assert_eq!(none.pvclock(), None);
    }
}
