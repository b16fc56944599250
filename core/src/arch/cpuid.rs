//! Decoding of the CPUID leaves vmtsync needs, over any [`Cpuid`] (real or fake).
//!
//! Every probe first checks the relevant maximum leaf: a CPU asked for a leaf above its
//! maximum returns the data of some other leaf (Intel SDM Vol. 2A, CPUID, "If a value entered
//! for CPUID.EAX is higher than the maximum input value ... the data for the highest basic
//! information leaf is returned"), which would otherwise be misread as a feature.

use super::kvm_abi::{
    HYPERVISOR_LEAF_END, HYPERVISOR_LEAF_STRIDE, HYPERVISOR_TIMING_OFFSET,
    KVM_CPUID_FEATURES_OFFSET, KVM_CPUID_SIGNATURE, KVM_FEATURE_CLOCKSOURCE,
    KVM_FEATURE_CLOCKSOURCE_STABLE_BIT, KVM_FEATURE_CLOCKSOURCE2, KVM_SIGNATURE,
};

/// The four registers one CPUID query returns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct CpuidResult {
    /// EAX after `cpuid`.
    pub eax: u32,
    /// EBX after `cpuid`.
    pub ebx: u32,
    /// ECX after `cpuid`.
    pub ecx: u32,
    /// EDX after `cpuid`.
    pub edx: u32,
}

/// A CPUID instruction, real or faked, so feature detection can be tested on any host.
pub trait Cpuid {
    /// Executes CPUID with EAX = `leaf` and ECX = `subleaf`.
    fn cpuid(&self, leaf: u32, subleaf: u32) -> CpuidResult;
}

impl<C: Cpuid + ?Sized> Cpuid for &C {
    #[inline]
    fn cpuid(&self, leaf: u32, subleaf: u32) -> CpuidResult {
        (**self).cpuid(leaf, subleaf)
    }
}

/// Basic leaf 0: EAX = highest basic leaf (Intel SDM Vol. 2A, CPUID).
pub const LEAF_BASIC_MAX: u32 = 0;
/// Basic leaf 1: feature flags (Intel SDM Vol. 2A, CPUID).
pub const LEAF_FEATURES: u32 = 1;
/// Leaf 1 ECX bit 31: running under a hypervisor (reserved for hypervisor use by Intel and
/// AMD; Linux `X86_FEATURE_HYPERVISOR`, arch/x86/include/asm/cpufeatures.h).
pub const FEATURES_ECX_HYPERVISOR: u32 = 31;
/// Leaf 1 ECX bit 30: RDRAND is available (Intel SDM Vol. 2A, CPUID; Linux
/// `X86_FEATURE_RDRAND`).
pub const FEATURES_ECX_RDRAND: u32 = 30;
/// Leaf 0x15: TSC / core crystal clock ratio, EAX = denominator, EBX = numerator,
/// ECX = crystal Hz (Intel SDM Vol. 2A, CPUID leaf 15H).
pub const LEAF_TSC_CRYSTAL: u32 = 0x15;
/// Leaf 0x16: processor base frequency in MHz in EAX bits 15..0 (Intel SDM Vol. 2A, leaf 16H).
pub const LEAF_FREQUENCY: u32 = 0x16;
/// Extended leaf 0x80000000: EAX = highest extended leaf (Intel SDM / AMD APM Vol. 3).
pub const LEAF_EXT_MAX: u32 = 0x8000_0000;
/// Extended leaf 0x80000001: extended feature flags (Intel SDM / AMD APM Vol. 3).
pub const LEAF_EXT_FEATURES: u32 = 0x8000_0001;
/// Leaf 0x80000001 EDX bit 27: RDTSCP is available (Linux `X86_FEATURE_RDTSCP`).
pub const EXT_FEATURES_EDX_RDTSCP: u32 = 27;
/// Extended leaf 0x80000007: advanced power management (Intel SDM / AMD APM Vol. 3).
pub const LEAF_EXT_POWER: u32 = 0x8000_0007;
/// Leaf 0x80000007 EDX bit 8: invariant TSC, constant rate in all P/C-states
/// (Linux `X86_FEATURE_CONSTANT_TSC` + `X86_FEATURE_NONSTOP_TSC`).
pub const EXT_POWER_EDX_INVARIANT_TSC: u32 = 8;

const fn bit(word: u32, n: u32) -> bool {
    (word >> n) & 1 == 1
}

/// Whether `leaf` is at most the CPU's maximum for its range (basic or extended).
fn leaf_exists<C: Cpuid + ?Sized>(c: &C, leaf: u32) -> bool {
    let max_leaf = if leaf >= LEAF_EXT_MAX {
        LEAF_EXT_MAX
    } else {
        LEAF_BASIC_MAX
    };
    c.cpuid(max_leaf, 0).eax >= leaf
}

/// Whether CPUID says a hypervisor is present (leaf 1 ECX bit 31). Hypervisor leaves are only
/// probed when it is set, like Linux does, so bare metal never misreads them.
pub fn hypervisor_present<C: Cpuid + ?Sized>(c: &C) -> bool {
    bit(c.cpuid(LEAF_FEATURES, 0).ecx, FEATURES_ECX_HYPERVISOR)
}

/// Whether `rdrand` may be executed (leaf 1 ECX bit 30); without it the instruction raises
/// #UD.
pub fn has_rdrand<C: Cpuid + ?Sized>(c: &C) -> bool {
    bit(c.cpuid(LEAF_FEATURES, 0).ecx, FEATURES_ECX_RDRAND)
}

/// Whether `rdtscp` may be executed (leaf 0x80000001 EDX bit 27). On this project's nested
/// KVM it is absent and executing it kills the VM, so the TSC reader gates on this.
pub fn has_rdtscp<C: Cpuid + ?Sized>(c: &C) -> bool {
    leaf_exists(c, LEAF_EXT_FEATURES)
        && bit(c.cpuid(LEAF_EXT_FEATURES, 0).edx, EXT_FEATURES_EDX_RDTSCP)
}

/// Whether the TSC is invariant (leaf 0x80000007 EDX bit 8): it ticks at a constant rate
/// through P-, C- and T-states, which a linear host↔guest mapping assumes.
pub fn has_invariant_tsc<C: Cpuid + ?Sized>(c: &C) -> bool {
    leaf_exists(c, LEAF_EXT_POWER)
        && bit(c.cpuid(LEAF_EXT_POWER, 0).edx, EXT_POWER_EDX_INVARIANT_TSC)
}

/// KVM's paravirtual feature bits (EAX of the features leaf).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct KvmFeatures(pub u32);

impl KvmFeatures {
    /// The legacy kvmclock MSRs exist (`KVM_FEATURE_CLOCKSOURCE`).
    #[must_use]
    pub const fn clocksource(self) -> bool {
        bit(self.0, KVM_FEATURE_CLOCKSOURCE)
    }

    /// `MSR_KVM_SYSTEM_TIME_NEW` exists, so a pvclock page can be registered
    /// (`KVM_FEATURE_CLOCKSOURCE2`).
    #[must_use]
    pub const fn clocksource2(self) -> bool {
        bit(self.0, KVM_FEATURE_CLOCKSOURCE2)
    }

    /// The pvclock `TSC_STABLE` flag is meaningful (`KVM_FEATURE_CLOCKSOURCE_STABLE_BIT`);
    /// without this bit a set flag must not be trusted.
    #[must_use]
    pub const fn stable_bit(self) -> bool {
        bit(self.0, KVM_FEATURE_CLOCKSOURCE_STABLE_BIT)
    }
}

/// What the KVM hypervisor leaves say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct KvmInfo {
    /// The leaf holding `"KVMKVMKVM\0\0\0"` (0x40000000, or higher next to Hyper-V leaves).
    pub base: u32,
    /// Highest hypervisor leaf (EAX of the base leaf; old KVMs report 0, read as `base + 1`).
    pub max_leaf: u32,
    /// Paravirtual feature bits from leaf `base + 1`.
    pub features: KvmFeatures,
}

/// Finds KVM's CPUID leaves, or `None` when not running under KVM (no hypervisor bit, or no
/// leaf in 0x40000000..0x40010000 carries the KVM signature).
pub fn kvm_info<C: Cpuid + ?Sized>(c: &C) -> Option<KvmInfo> {
    if !hypervisor_present(c) {
        return None;
    }
    let mut base = KVM_CPUID_SIGNATURE;
    while base < HYPERVISOR_LEAF_END {
        let r: CpuidResult = c.cpuid(base, 0);
        if [r.ebx, r.ecx, r.edx] == KVM_SIGNATURE {
            let features_leaf = base + KVM_CPUID_FEATURES_OFFSET;
            let max_leaf = r.eax.max(features_leaf);
            let features = KvmFeatures(c.cpuid(features_leaf, 0).eax);
            debug!("cpuid: KVM base {=u32:#x} max {=u32:#x}", base, max_leaf);
            return Some(KvmInfo {
                base,
                max_leaf,
                features,
            });
        }
        base += HYPERVISOR_LEAF_STRIDE;
    }
    None
}

/// Where a TSC frequency came from, most exact first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum TscFreqSource {
    /// Leaf 0x15: crystal Hz × numerator / denominator (exact up to the floor division).
    Crystal,
    /// Hypervisor timing leaf `base + 0x10`: kHz as the hypervisor configured it.
    HypervisorTiming,
    /// Leaf 0x16: nominal base MHz; only an approximation of the TSC rate.
    BaseFrequency,
}

/// A TSC frequency read from CPUID.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct TscFreq {
    /// Ticks per second, rounded down.
    pub hz: u64,
    /// Which leaf it came from (how far to trust it).
    pub source: TscFreqSource,
}

/// Leaf 0x15's TSC rate, `crystal_hz * numerator / denominator` rounded down, or `None` when
/// the leaf is absent or any of the three is 0 (enumerated but not reported).
pub fn tsc_hz_crystal_floor<C: Cpuid + ?Sized>(c: &C) -> Option<u64> {
    if !leaf_exists(c, LEAF_TSC_CRYSTAL) {
        return None;
    }
    let r = c.cpuid(LEAF_TSC_CRYSTAL, 0);
    if r.eax == 0 || r.ebx == 0 || r.ecx == 0 {
        return None;
    }
    // u32 * u32 fits u64 exactly, so only the division rounds.
    Some(u64::from(r.ecx) * u64::from(r.ebx) / u64::from(r.eax))
}

/// The hypervisor timing leaf's TSC rate in kHz, or `None` when KVM does not expose it.
pub fn hypervisor_tsc_khz<C: Cpuid + ?Sized>(c: &C, kvm: &KvmInfo) -> Option<u32> {
    // `KvmInfo`'s fields are public, so do not trust `base` to be small.
    let leaf = kvm.base.checked_add(HYPERVISOR_TIMING_OFFSET)?;
    if kvm.max_leaf < leaf {
        return None;
    }
    Some(c.cpuid(leaf, 0).eax).filter(|&khz| khz != 0)
}

/// Leaf 0x16's nominal base frequency in MHz, or `None` when absent or 0.
pub fn base_mhz<C: Cpuid + ?Sized>(c: &C) -> Option<u16> {
    if !leaf_exists(c, LEAF_FREQUENCY) {
        return None;
    }
    let mhz = c.cpuid(LEAF_FREQUENCY, 0).eax & 0xffff;
    u16::try_from(mhz).ok().filter(|&m| m != 0)
}

/// The best TSC frequency CPUID offers: leaf 0x15, then the KVM timing leaf, then leaf 0x16.
/// `None` when none is reported (then calibrate against pvclock: `PvclockScale::try_tsc_khz_floor`).
pub fn tsc_freq<C: Cpuid + ?Sized>(c: &C) -> Option<TscFreq> {
    if let Some(hz) = tsc_hz_crystal_floor(c) {
        return Some(TscFreq {
            hz,
            source: TscFreqSource::Crystal,
        });
    }
    if let Some(khz) = kvm_info(c).and_then(|k| hypervisor_tsc_khz(c, &k)) {
        return Some(TscFreq {
            hz: u64::from(khz) * 1000,
            source: TscFreqSource::HypervisorTiming,
        });
    }
    base_mhz(c).map(|mhz| TscFreq {
        hz: u64::from(mhz) * 1_000_000,
        source: TscFreqSource::BaseFrequency,
    })
}

#[cfg(test)]
mod tests {
    use super::super::kvm_abi::KVM_SIGNATURE;
    use super::super::{CpuidEntry, FakeCpuid};
    use super::*;

    const fn e(leaf: u32, eax: u32, ebx: u32, ecx: u32, edx: u32) -> CpuidEntry {
        CpuidEntry::new(leaf, 0, CpuidResult { eax, ebx, ecx, edx })
    }

    /// A KVM guest like this project's nested KVM: KVM at 0x40000000 with CLOCKSOURCE2 and
    /// STABLE_BIT, no RDTSCP, invariant TSC, leaf 0x15 absent (max basic leaf 0xd).
    const KVM_GUEST: [CpuidEntry; 7] = [
        e(0, 0xd, 0, 0, 0),
        e(1, 0, 0, 1 << 31, 0),
        e(
            0x4000_0000,
            0x4000_0010,
            KVM_SIGNATURE[0],
            KVM_SIGNATURE[1],
            KVM_SIGNATURE[2],
        ),
        e(0x4000_0001, (1 << 3) | (1 << 24) | 1, 0, 0, 0),
        e(0x4000_0010, 2_450_000, 1_000_000, 0, 0),
        e(0x8000_0000, 0x8000_0008, 0, 0, 0),
        e(0x8000_0007, 0, 0, 0, 1 << 8),
    ];

    #[test]
    fn kvm_guest_decodes() {
        let c = FakeCpuid::new(&KVM_GUEST);
        let k = kvm_info(&c).expect("KVM signature present");
        assert_eq!(k.base, 0x4000_0000);
        assert_eq!(k.max_leaf, 0x4000_0010);
        assert!(k.features.clocksource2());
        assert!(k.features.stable_bit());
        assert!(k.features.clocksource());
        assert!(!has_rdtscp(&c));
        assert!(has_invariant_tsc(&c));
        assert_eq!(tsc_hz_crystal_floor(&c), None);
        assert_eq!(
            tsc_freq(&c),
            Some(TscFreq {
                hz: 2_450_000_000,
                source: TscFreqSource::HypervisorTiming
            })
        );
    }

    #[test]
    fn kvm_after_hyperv_leaves_is_found() {
        let table = [
            e(1, 0, 0, 1 << 31, 0),
            e(0x4000_0000, 0x4000_000a, u32::from_le_bytes(*b"Micr"), 0, 0),
            e(
                0x4000_0100,
                0,
                KVM_SIGNATURE[0],
                KVM_SIGNATURE[1],
                KVM_SIGNATURE[2],
            ),
            e(0x4000_0101, 1 << 3, 0, 0, 0),
        ];
        let c = FakeCpuid::new(&table);
        let k = kvm_info(&c).expect("KVM at 0x40000100");
        assert_eq!(k.base, 0x4000_0100);
        // Old KVMs report EAX = 0: the features leaf still exists.
        assert_eq!(k.max_leaf, 0x4000_0101);
        assert!(k.features.clocksource2());
        assert!(!k.features.stable_bit());
        assert_eq!(hypervisor_tsc_khz(&c, &k), None);
        let bogus = KvmInfo {
            base: u32::MAX,
            max_leaf: u32::MAX,
            features: KvmFeatures(0),
        };
        assert_eq!(hypervisor_tsc_khz(&c, &bogus), None);
    }

    #[test]
    fn no_hypervisor_bit_means_no_kvm() {
        // The signature is there but the hypervisor bit is not: do not trust it.
        let table = [e(
            0x4000_0000,
            0,
            KVM_SIGNATURE[0],
            KVM_SIGNATURE[1],
            KVM_SIGNATURE[2],
        )];
        assert_eq!(kvm_info(&FakeCpuid::new(&table)), None);
        // A different hypervisor is not KVM.
        let other = [e(1, 0, 0, 1 << 31, 0), e(0x4000_0000, 0, 1, 2, 3)];
        assert_eq!(kvm_info(&FakeCpuid::new(&other)), None);
    }

    #[test]
    fn features_above_max_leaf_are_ignored() {
        // RDTSCP/invariant bits set, but the max extended leaf says those leaves do not exist.
        let table = [
            e(0x8000_0000, 0x8000_0000, 0, 0, 0),
            e(0x8000_0001, 0, 0, 0, 1 << 27),
            e(0x8000_0007, 0, 0, 0, 1 << 8),
        ];
        let c = FakeCpuid::new(&table);
        assert!(!has_rdtscp(&c));
        assert!(!has_invariant_tsc(&c));
        let present = [
            e(0x8000_0000, 0x8000_0007, 0, 0, 0),
            e(0x8000_0001, 0, 0, 0, 1 << 27),
        ];
        assert!(has_rdtscp(&FakeCpuid::new(&present)));
    }

    #[test]
    fn crystal_and_base_frequency() {
        // 24 MHz crystal, ratio 188/2: 2.256 GHz.
        let table = [
            e(0, 0x16, 0, 0, 0),
            e(0x15, 2, 188, 24_000_000, 0),
            e(0x16, 2200, 0, 0, 0),
        ];
        let c = FakeCpuid::new(&table);
        assert_eq!(tsc_hz_crystal_floor(&c), Some(2_256_000_000));
        assert_eq!(tsc_freq(&c).map(|f| f.source), Some(TscFreqSource::Crystal));
        assert_eq!(base_mhz(&c), Some(2200));
        // Crystal not enumerated (ECX = 0): fall back to the base frequency.
        let no_crystal = [
            e(0, 0x16, 0, 0, 0),
            e(0x15, 2, 188, 0, 0),
            e(0x16, 2200, 0, 0, 0),
        ];
        assert_eq!(
            tsc_freq(&FakeCpuid::new(&no_crystal)),
            Some(TscFreq {
                hz: 2_200_000_000,
                source: TscFreqSource::BaseFrequency
            })
        );
        assert_eq!(tsc_freq(&FakeCpuid::new(&[])), None);
    }
}
