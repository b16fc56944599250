//! The real x86_64 implementations: TSC, CPUID, port I/O, the native agent clock, pvclock
//! registration, clock pairing.
//!
//! Each is a few instructions long; the logic that uses them is tested through the fakes.

use super::clock::TscClock;
use super::cpuid::{has_rdrand, has_rdtscp};
use super::{Cpuid, CpuidResult, NativePorts, PortIo, PvclockPage, Tsc};

impl PortIo for NativePorts {
    #[inline]
    fn inb(&self, port: u16) -> u8 {
        // SAFETY: `NativePorts::new`'s caller vouched that I/O on every port this value is
        // used on has no effect on memory the program uses. `in` itself touches no memory;
        // without the privilege (CPL 0 or IOPL 3) it raises #GP, a fault, not UB.
        unsafe { x86::io::inb(port) }
    }

    #[inline]
    fn outb(&self, port: u16, value: u8) {
        // SAFETY: as for `inb`: the creator vouched for the port's device, and `out` touches
        // no memory of its own.
        unsafe { x86::io::outb(port, value) }
    }
}

/// The guest's own clock as an [`crate::agent::AgentClock`]: the ordered TSC, the APIC id,
/// the TSC frequency and invariance from CPUID, optionally a sync port on real port I/O and
/// the registered pvclock page (see [`TscClock`]).
pub type NativeClock = TscClock<NativeTsc, NativePorts, PvclockPage<'static>>;

impl NativeClock {
    /// The running vCPU's clock from the CPU's own CPUID ([`NativeTsc::detect`] picks the TSC
    /// read, [`TscClock::from_cpuid`] the rest). No sync port, no pvclock page: add them with
    /// [`TscClock::with_sync_port`] and [`TscClock::with_pvclock`]. Call it on the vCPU it
    /// will serve: the APIC id is that of the vCPU running this.
    #[must_use]
    pub fn detect() -> Self {
        let cpuid = NativeCpuid;
        Self::from_cpuid(NativeTsc::detect(&cpuid), &cpuid)
    }
}

/// The CPU's own CPUID instruction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NativeCpuid;

impl Cpuid for NativeCpuid {
    #[inline]
    fn cpuid(&self, leaf: u32, subleaf: u32) -> CpuidResult {
        // CPUID exists on every x86_64 CPU and works at any privilege level; under KVM it is
        // an exit the hypervisor answers (from KVM_SET_CPUID2).
        let r = x86::cpuid::native_cpuid::cpuid_count(leaf, subleaf);
        CpuidResult {
            eax: r.eax,
            ebx: r.ebx,
            ecx: r.ecx,
            edx: r.edx,
        }
    }
}

/// A non-zero boot nonce for the recorder header ([`super::nonce_from`]): RDRAND where
/// `cpuid` says it exists (up to ten tries, as Intel's DRNG guide advises for a transient
/// underflow), mixed with an ordered TSC read in any case.
#[must_use]
pub fn boot_nonce<C: Cpuid + ?Sized>(cpuid: &C) -> u64 {
    let random = if has_rdrand(cpuid) {
        (0..10).find_map(|_| {
            let mut v = 0u64;
            // SAFETY: CPUID leaf 1 ECX bit 30 says RDRAND exists, so it cannot raise #UD; it
            // writes only `v`, a local.
            unsafe { x86::random::rdrand64(&mut v) }.then_some(v)
        })
    } else {
        None
    };
    super::nonce_from(random, lfence_rdtsc())
}

/// `lfence; rdtsc`: a TSC read that waits for all earlier instructions (Intel SDM Vol. 2B,
/// RDTSC: "If software requires RDTSC to be executed only after all previous instructions
/// have executed ... it can execute LFENCE immediately before RDTSC"; on AMD, LFENCE is
/// dispatch-serializing whenever Linux's `X86_FEATURE_LFENCE_RDTSC` is set, which KVM
/// guests see).
#[inline]
#[must_use]
pub fn lfence_rdtsc() -> u64 {
    x86::fence::lfence();
    // SAFETY: RDTSC touches no memory. Its only failure mode is a #GP when CR4.TSD is set
    // and CPL > 0, which is a fault delivered by the CPU (SIGSEGV in Linux user space), not
    // undefined behaviour; ring-0 agents and Linux processes without PR_SET_TSC never see it.
    unsafe { x86::time::rdtsc() }
}

/// `rdtscp`, which waits for earlier instructions by itself. Private: only [`NativeTsc`]
/// calls it, and only after CPUID said it exists (on nested KVM here it kills the VM).
#[inline]
fn rdtscp() -> u64 {
    let (lo, hi): (u32, u32);
    // SAFETY: called only when CPUID 0x80000001 EDX bit 27 is set (see `NativeTsc::detect`),
    // so the instruction exists; like RDTSC it touches no memory and can only fault (#GP with
    // CR4.TSD at CPL > 0), which is not undefined behaviour. Unlike `x86::time::rdtscp` the
    // asm is not `nomem`, so the compiler cannot sink earlier loads (e.g. of the pvclock
    // page) below it: the read stays ordered for the compiler as well as for the CPU.
    unsafe {
        core::arch::asm!(
            "rdtscp",
            out("eax") lo,
            out("edx") hi,
            out("ecx") _,
            options(nostack, preserves_flags),
        );
    }
    (u64::from(hi) << 32) | u64::from(lo)
}

/// The real ordered TSC: `rdtscp` where CPUID advertises it, else `lfence; rdtsc`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct NativeTsc {
    rdtscp: bool,
}

impl NativeTsc {
    /// Picks the instruction from `cpuid`: `rdtscp` only when leaf 0x80000001 EDX bit 27 is
    /// set, so a guest whose hypervisor hides it never executes it.
    #[must_use]
    pub fn detect<C: Cpuid + ?Sized>(cpuid: &C) -> Self {
        let rdtscp = has_rdtscp(cpuid);
        debug!("tsc: rdtscp {=bool}", rdtscp);
        Self { rdtscp }
    }

    /// Always `lfence; rdtsc`, which every x86_64 CPU has; no CPUID needed.
    #[must_use]
    pub const fn lfence_rdtsc() -> Self {
        Self { rdtscp: false }
    }

    /// Whether reads use `rdtscp`.
    #[must_use]
    pub const fn uses_rdtscp(self) -> bool {
        self.rdtscp
    }
}

impl Tsc for NativeTsc {
    #[inline]
    fn read_ordered(&self) -> u64 {
        if self.rdtscp {
            rdtscp()
        } else {
            lfence_rdtsc()
        }
    }
}

/// Why a ring-0 or hypercall operation was refused before touching the hardware.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum ArchError {
    /// The physical address is not 8-byte aligned (needed so bit 0 is free for the enable
    /// flag and the structure stays inside one page).
    Misaligned,
    /// The hypercall returned this negative KVM error code (e.g. `-KVM_EOPNOTSUPP` when the
    /// host clock is not TSC-based).
    Hypercall(i64),
}

/// Registers a pvclock page for the current vCPU: `wrmsr(MSR_KVM_SYSTEM_TIME_NEW, phys | 1)`.
/// From then on KVM writes a [`crate::pvclock::PvclockVcpuTimeInfo`] at `phys` whenever the
/// clock changes; read it through [`super::PvclockPage`].
///
/// # Errors
///
/// [`ArchError::Misaligned`] when `phys` is not 8-byte aligned (nothing is written).
///
/// # Safety
///
/// - Must run at CPL 0 under KVM with `KVM_FEATURE_CLOCKSOURCE2` (see
///   [`super::cpuid::kvm_info`]); otherwise WRMSR raises #GP.
/// - `phys` must be the guest-physical address of 32 bytes of RAM reserved for this page
///   until [`unregister_pvclock`]: the hypervisor writes there asynchronously.
#[cfg(feature = "ring0")]
pub unsafe fn register_pvclock(phys: u64) -> Result<(), ArchError> {
    use super::kvm_abi::{KVM_SYSTEM_TIME_ENABLE, MSR_KVM_SYSTEM_TIME_NEW};
    if !phys.is_multiple_of(8) {
        return Err(ArchError::Misaligned);
    }
    info!("pvclock: registering page at {=u64:#x}", phys);
    // SAFETY: the caller guarantees CPL 0, KVM with CLOCKSOURCE2, and that `phys` is RAM
    // reserved for the page; the MSR has no other side effect.
    unsafe { x86::msr::wrmsr(MSR_KVM_SYSTEM_TIME_NEW, phys | KVM_SYSTEM_TIME_ENABLE) };
    Ok(())
}

/// Stops KVM from writing the pvclock page: `wrmsr(MSR_KVM_SYSTEM_TIME_NEW, 0)`.
///
/// # Safety
///
/// Must run at CPL 0 under KVM with `KVM_FEATURE_CLOCKSOURCE2`; otherwise WRMSR raises #GP.
#[cfg(feature = "ring0")]
pub unsafe fn unregister_pvclock() {
    // SAFETY: the caller guarantees CPL 0 and KVM with CLOCKSOURCE2; disabling only stops
    // the hypervisor's writes.
    unsafe { x86::msr::wrmsr(super::kvm_abi::MSR_KVM_SYSTEM_TIME_NEW, 0) };
}

/// `KVM_HC_CLOCK_PAIRING` (vmcall with rax = 9, rbx = `phys`, rcx = 0): the host writes its
/// `CLOCK_REALTIME` and the guest TSC of the same instant into `out`, which is returned.
///
/// **Never call this on this project's machines**: on nested KVM the vmcall livelocks the
/// vCPU (docs/host-quirks.md). It is compiled (feature `clock-pairing`), never run by the tests.
/// On AMD, KVM intercepts the `#UD` of `vmcall` and emulates it.
///
/// # Errors
///
/// [`ArchError::Misaligned`] when `phys` is not 8-byte aligned; [`ArchError::Hypercall`]
/// with KVM's negative return value (e.g. `-KVM_EOPNOTSUPP`).
///
/// # Safety
///
/// - Must run under KVM (elsewhere `vmcall` raises #UD or exits to an unknown hypervisor),
///   at CPL 0 (KVM refuses hypercalls from CPL 3 with `-KVM_EPERM`).
/// - `phys` must be the guest-physical address of `out`.
#[cfg(feature = "clock-pairing")]
pub unsafe fn clock_pairing(
    out: &mut super::kvm_abi::KvmClockPairing,
    phys: u64,
) -> Result<super::kvm_abi::KvmClockPairing, ArchError> {
    use super::kvm_abi::{KVM_CLOCK_PAIRING_WALLCLOCK, KVM_HC_CLOCK_PAIRING};
    if !phys.is_multiple_of(8) {
        return Err(ArchError::Misaligned);
    }
    let ret: u64;
    // SAFETY: the caller guarantees KVM at CPL 0 and that `phys` is `out`'s physical
    // address, which `&mut` makes exclusively ours for the call. RBX is reserved by LLVM, so
    // the argument is swapped into it around the vmcall and restored. The asm is not `nomem`:
    // the host writes `out` during it.
    unsafe {
        core::arch::asm!(
            "xchg {arg}, rbx",
            "vmcall",
            "xchg {arg}, rbx",
            arg = inout(reg) phys => _,
            inout("rax") KVM_HC_CLOCK_PAIRING => ret,
            in("rcx") KVM_CLOCK_PAIRING_WALLCLOCK,
            options(nostack),
        );
    }
    let ret = i64::from_ne_bytes(ret.to_ne_bytes());
    if ret != 0 {
        warn!("clock pairing: hypercall returned {=i64}", ret);
        return Err(ArchError::Hypercall(ret));
    }
    // SAFETY: `out` is a valid, aligned `&mut`; the volatile read makes sure the compiler
    // does not reuse values from before the host wrote it.
    Ok(unsafe { core::ptr::read_volatile(out) })
}

#[cfg(test)]
mod tests {
    use super::super::cpuid::{hypervisor_present, kvm_info};
    use super::super::kvm_abi::KVM_SIGNATURE;
    use super::*;
    use std::string::String;

    fn cpuinfo_flags() -> Option<String> {
        let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
        text.lines()
            .find(|l| l.starts_with("flags"))
            .map(String::from)
    }

    fn has_flag(flags: &str, name: &str) -> bool {
        flags.split_whitespace().any(|f| f == name)
    }

    /// The real `lfence; rdtsc` (and the detected reader) never go backwards on one thread.
    #[test]
    fn real_tsc_reads_are_monotonic() {
        let detected = NativeTsc::detect(&NativeCpuid);
        std::println!(
            "NativeTsc::detect: uses_rdtscp = {}",
            detected.uses_rdtscp()
        );
        for tsc in [NativeTsc::lfence_rdtsc(), detected] {
            let mut prev = tsc.read_ordered();
            for _ in 0..1000 {
                let now = tsc.read_ordered();
                assert!(now >= prev, "TSC went back: {prev} -> {now}");
                prev = now;
            }
        }
        let a = lfence_rdtsc();
        let b = lfence_rdtsc();
        assert!(b >= a, "lfence_rdtsc went back: {a} -> {b}");
        std::println!("two lfence;rdtsc reads: {a} {b} (delta {})", b - a);
    }

    /// Real CPUID: whatever KVM answers, the decoders agree with themselves and with Linux.
    #[test]
    fn real_cpuid_is_consistent() {
        let c = NativeCpuid;
        let info = kvm_info(&c);
        std::println!(
            "kvm_info = {info:?}, tsc_freq = {:?}",
            super::super::cpuid::tsc_freq(&c)
        );
        assert_eq!(kvm_info(&c), info, "two probes disagree");
        if let Some(k) = info {
            assert!(hypervisor_present(&c));
            assert!((0x4000_0000..0x4001_0000).contains(&k.base));
            assert_eq!(k.base % 0x100, 0);
            let sig = c.cpuid(k.base, 0);
            assert_eq!([sig.ebx, sig.ecx, sig.edx], KVM_SIGNATURE);
            assert!(k.max_leaf > k.base);
            assert_eq!(k.features.0, c.cpuid(k.base + 1, 0).eax);
        }
        if let Some(flags) = cpuinfo_flags() {
            // Linux derives these flags from the same CPUID bits.
            assert_eq!(has_flag(&flags, "hypervisor"), hypervisor_present(&c));
            if has_flag(&flags, "rdtscp") {
                assert!(has_rdtscp(&c), "Linux reports rdtscp but CPUID does not");
            }
        }
    }
}
