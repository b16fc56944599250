//! Ground truth for the tier-2 tests and the demo: which guest TSC a vCPU's agent reports at
//! a given host TSC, taken from outside the code under test.
//!
//! Two facts compose into the truth:
//! - KVM's mapping for the vCPU, read from debugfs ([`truth_mapping`], [`truth_mapping_of`])
//!   with `std::fs` in a few lines of this module's own, not through `vmtsync`'s debugfs
//!   reader (the code under test). On an ordinary KVM host a guest's TSC starts
//!   near zero (a large negative `tsc-offset`); on the project's nested hosts the offset reads
//!   0. Nothing here assumes either.
//! - The agent's software skew (its `skew=OFFSET,RATIO,FRAC` boot option), picked by
//!   [`Skew::pick`] from the host TSC at the time so it never wraps the reported TSC.
//!
//! The agent applies its skew to the TSC KVM shows it, so the reported value at host TSC `h`
//! is `skew(kvm(h))`: [`GuestTruth::guest_at`] computes exactly that, each step with KVM's
//! own arithmetic (`KvmTscMapping::try_guest_from_host`: 128-bit product, floor, offset
//! modulo 2^64). [`GuestTruth::composed`] gives the single mapping KVM's nested composition
//! makes of the two (`vmtsync::compose::compose`), for tools that take one mapping; it is
//! within `KvmTscMapping::try_nested_deviation_bound` (a few ticks) of the exact value.

use std::path::{Path, PathBuf};

use vmtsync_core::mapping::{KvmTscMapping, MappingError};
use vmtsync_core::{GuestTicks, HostTicks};

/// Where KVM keeps its per-VM debugfs directories.
pub const KVM_DEBUGFS: &str = "/sys/kernel/debug/kvm";

/// A VM's directory in KVM debugfs, `<pid>-<fd>`: the thread that created the VM and the VM's
/// file descriptor in it. This is the test's own copy, so the truth does not depend on the
/// parser `vmtsync kvm` uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmId {
    /// The PID (for a test's built-in VMM: the TID) that created the VM.
    pub pid: u32,
    /// The VM's file descriptor number in that process.
    pub fd: u32,
}

/// Why the truth could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TruthError {
    /// A debugfs file or directory could not be read (not mounted, not root).
    #[error("reading {0}: {1}")]
    Io(PathBuf, std::io::Error),
    /// A debugfs file did not hold one decimal number.
    #[error("{0} holds {1:?}, not a number")]
    Parse(PathBuf, String),
    /// No VM directory belongs to the process.
    #[error("no VM of process {0} in KVM debugfs (has the VMM created it yet?)")]
    NoVm(u32),
    /// The process has several VMs; the caller must say which ([`truth_mapping_of`]).
    #[error("process {0} has {1} VMs in KVM debugfs: name one by its fd")]
    SeveralVms(u32, usize),
    /// The VM has no such vCPU.
    #[error("VM {0:?} has no vcpu{1} in KVM debugfs")]
    NoVcpu(VmId, u32),
    /// The vCPU runs a nested guest: debugfs holds the combined L0→L2 values, not its own.
    #[error("vcpu{1} of VM {0:?} runs a nested guest (guest_mode 1): no L1 mapping to read")]
    Nested(VmId, u32),
    /// debugfs held values no mapping can have.
    #[error("vcpu{1} of VM {0:?}: {2:?}")]
    Mapping(VmId, u32, MappingError),
    /// The skew does not compose with the KVM mapping (different fraction bits, overflow).
    #[error("composing the KVM mapping with the skew: {0}")]
    Compose(#[from] vmtsync::compose::ComposeError),
}

/// KVM's TSC mapping of `vcpu` of the only VM process `vm_pid` created (QEMU, `vmtsync-vmm`,
/// idle-vmm), read from `/sys/kernel/debug/kvm`.
///
/// # Errors
/// [`TruthError`]: debugfs unreadable, no VM or several VMs for the PID, no such vCPU.
pub fn truth_mapping(vm_pid: u32, vcpu: u32) -> Result<KvmTscMapping, TruthError> {
    let root = Path::new(KVM_DEBUGFS);
    let entries = std::fs::read_dir(root).map_err(|e| TruthError::Io(root.into(), e))?;
    // A VM directory is named `<pid>-<fd>`; anything else (the global stat files) is skipped.
    let vms: Vec<VmId> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let (pid, fd) = name.split_once('-')?;
            Some(VmId {
                pid: pid.parse().ok()?,
                fd: fd.parse().ok()?,
            })
        })
        .filter(|v| v.pid == vm_pid)
        .collect();
    match vms.as_slice() {
        [] => Err(TruthError::NoVm(vm_pid)),
        [vm] => truth_mapping_of(*vm, vcpu),
        _ => Err(TruthError::SeveralVms(vm_pid, vms.len())),
    }
}

/// KVM's TSC mapping of `vcpu` of the VM `id` (a process with several VMs, such as a test
/// process running built-in VMMs in parallel: [`crate::vmm::Vm::debugfs_id`]).
///
/// The three numbers come straight from KVM's files (`arch/x86/kvm/debugfs.c`:
/// `tsc-offset`, `tsc-scaling-ratio`, `tsc-scaling-ratio-frac-bits`, each one decimal line),
/// read here with `std::fs` so the truth does not go through `vmtsync`'s own debugfs reader,
/// which `vmtsync kvm` uses and the tests check.
///
/// # Errors
/// [`TruthError`]: debugfs unreadable, no such VM or vCPU.
pub fn truth_mapping_of(id: VmId, vcpu: u32) -> Result<KvmTscMapping, TruthError> {
    let vm = Path::new(KVM_DEBUGFS).join(format!("{}-{}", id.pid, id.fd));
    if !vm.is_dir() {
        return Err(TruthError::NoVm(id.pid));
    }
    let dir = vm.join(format!("vcpu{vcpu}"));
    if !dir.is_dir() {
        return Err(TruthError::NoVcpu(id, vcpu));
    }
    // `guest_mode` exists only where KVM supports nesting; 1 means the files hold L0→L2.
    if number::<u8>(&dir, "guest_mode").is_ok_and(|m| m == 1) {
        return Err(TruthError::Nested(id, vcpu));
    }
    let offset: i64 = number(&dir, "tsc-offset")?;
    // KVM creates the two scaling files only on hosts with TSC scaling; without them the
    // guest TSC runs at the host's rate (ratio 1 with no fraction bits).
    let (ratio, frac_bits) = if dir.join("tsc-scaling-ratio").exists() {
        (
            number(&dir, "tsc-scaling-ratio")?,
            number(&dir, "tsc-scaling-ratio-frac-bits")?,
        )
    } else {
        (1, 0)
    };
    KvmTscMapping::try_new(offset, ratio, frac_bits).map_err(|e| TruthError::Mapping(id, vcpu, e))
}

/// The one decimal number in `dir/file`.
fn number<T: std::str::FromStr>(dir: &Path, file: &str) -> Result<T, TruthError> {
    let path = dir.join(file);
    let text = std::fs::read_to_string(&path).map_err(|e| TruthError::Io(path.clone(), e))?;
    text.trim()
        .parse()
        .map_err(|_| TruthError::Parse(path, text.trim().to_owned()))
}

/// Checks the prerequisites of reading the truth from debugfs (root, debugfs mounted) with
/// [`crate::require`]: false (after printing why) when the test must skip; a failure under
/// `CI=true`.
#[must_use]
pub fn truth_ready(test: &str) -> bool {
    crate::require(test, crate::is_root(), "reading KVM debugfs needs root")
        && crate::require(
            test,
            Path::new(KVM_DEBUGFS).is_dir(),
            "debugfs is not mounted (mount -t debugfs none /sys/kernel/debug)",
        )
}

/// The rate of every software skew: `(2^48 + ⌊2^48 / 10^4⌋) / 2^48` ≈ 1.0001 (+100 ppm), so
/// `guest − host` changes with time and a rate or sign error in an estimator shows.
pub const SKEW_RATIO: u64 = (1 << SKEW_FRAC_BITS) + (1 << SKEW_FRAC_BITS) / 10_000;
/// Fraction bits of [`SKEW_RATIO`] (Intel VMX's, as KVM uses there).
pub const SKEW_FRAC_BITS: u32 = 48;
/// Added to the host TSC to make the skew's offset, so the offset is never a round number.
const SKEW_OFFSET_EXTRA: u64 = 1_234_567_891;

/// The agent's software skew: it reports `offset + ((tsc * ratio) >> frac_bits)` instead of
/// the TSC KVM shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Skew(pub KvmTscMapping);

impl Skew {
    /// A skew derived from the host TSC now: offset `+(host TSC + 1 234 567 891)`, rate
    /// [`SKEW_RATIO`]. The offset is positive on purpose: a negative one of that size (the
    /// obvious `−host TSC`) makes the reported TSC wrap below zero on any KVM host whose
    /// guests' TSCs start near zero, and a constant (such as −3·10^12) wraps on a host booted
    /// less than 20 minutes ago. A positive offset below 2^62 cannot wrap for decades, on any
    /// host, and its size still follows the host's uptime, so no run sees a round truth.
    #[must_use]
    pub fn pick() -> Self {
        Self::from_host_tsc(vmtsync::kvm::hosttsc::read_host_tsc())
    }

    /// [`Skew::pick`] for a given host TSC (for tests of the rule itself).
    ///
    /// # Panics
    /// Never for a host TSC below 2^62 (decades of uptime).
    #[must_use]
    pub fn from_host_tsc(host: HostTicks) -> Self {
        let offset = i64::try_from((host.0 & ((1 << 62) - 1)) + SKEW_OFFSET_EXTRA)
            .expect("below 2^62 + 2^31 fits an i64");
        Self(
            KvmTscMapping::try_new(offset, SKEW_RATIO, SKEW_FRAC_BITS)
                .expect("a non-zero ratio with 48 fraction bits is valid"),
        )
    }

    /// Parses the value of the agent's `skew=` option, `OFFSET,RATIO,FRAC` (the inverse of
    /// [`Skew::agent_option`]); `None` when it is not three numbers making a valid mapping.
    #[must_use]
    pub fn parse(value: &str) -> Option<Self> {
        let mut it = value.split(',');
        let offset = it.next()?.parse::<i64>().ok()?;
        let ratio = it.next()?.parse::<u64>().ok()?;
        let frac = it.next()?.parse::<u32>().ok()?;
        if it.next().is_some() {
            return None;
        }
        KvmTscMapping::try_new(offset, ratio, frac).ok().map(Self)
    }

    /// The agent boot option, `skew=OFFSET,RATIO,FRAC`.
    #[must_use]
    pub fn agent_option(&self) -> String {
        format!(
            "skew={},{},{}",
            self.0.offset(),
            self.0.ratio(),
            self.0.frac_bits()
        )
    }

    /// One skew per vCPU `0..n`, each [`Skew::pick`]'s rule applied to the host TSC now plus
    /// a different amount per vCPU (`vcpu × 987 654 321 987`, about 330 s at 3 GHz), so every
    /// vCPU has its own truth and a reply filed under the wrong vCPU misses it.
    #[must_use]
    pub fn pick_per_vcpu(n: u32) -> Vec<Self> {
        let host = vmtsync::kvm::hosttsc::read_host_tsc();
        (0..n)
            .map(|v| Self::from_host_tsc(HostTicks(host.0 + u64::from(v) * PER_VCPU_APART)))
            .collect()
    }

    /// The agent boot option for vCPU `vcpu` alone, `skewN=OFFSET,RATIO,FRAC`.
    #[must_use]
    pub fn agent_option_for(&self, vcpu: u32) -> String {
        format!("skew{vcpu}{}", &self.agent_option()["skew".len()..])
    }
}

/// How far apart [`Skew::pick_per_vcpu`] puts two neighbouring vCPUs' offsets.
const PER_VCPU_APART: u64 = 987_654_321_987;

/// What a vCPU's agent reports: KVM's mapping, then the agent's skew.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestTruth {
    /// KVM's host→guest mapping of the vCPU (debugfs).
    pub kvm: KvmTscMapping,
    /// The agent's skew (the identity when it has none).
    pub skew: KvmTscMapping,
}

impl GuestTruth {
    /// The truth for `vcpu` of the only VM of `vm_pid` with `skew` applied by its agent.
    ///
    /// # Errors
    /// As [`truth_mapping`].
    pub fn read(vm_pid: u32, vcpu: u32, skew: Option<Skew>) -> Result<Self, TruthError> {
        Ok(Self::new(truth_mapping(vm_pid, vcpu)?, skew))
    }

    /// The truth from a KVM mapping and the agent's skew (`None`: no skew).
    #[must_use]
    pub fn new(kvm: KvmTscMapping, skew: Option<Skew>) -> Self {
        Self {
            kvm,
            skew: skew.map_or(KvmTscMapping::offset_only(0), |s| s.0),
        }
    }

    /// The TSC value the agent reports when the host TSC reads `host`: `skew(kvm(host))`,
    /// exactly; `None` if a scaled value leaves 64 bits.
    #[must_use]
    pub fn guest_at(&self, host: HostTicks) -> Option<GuestTicks> {
        let kvm = self.kvm.try_guest_from_host(host)?;
        self.skew.try_guest_from_host(HostTicks(kvm.0))
    }

    /// A lower bound, by the truth, for any TSC the agent reports after host TSC `host`, where
    /// `host` may precede the vCPU (a host TSC taken before the VM was created): `guest_at(host)`,
    /// or 0 when that lies above `guest_at(later)`, `later` being a host TSC after the vCPU's
    /// creation. An ordinary KVM host starts a new vCPU's TSC near zero, so an instant before
    /// its creation maps below zero, which KVM's offset arithmetic (modulo 2^64) wraps to near
    /// 2^64.
    #[must_use]
    pub fn guest_floor_at(&self, host: HostTicks, later: HostTicks) -> GuestTicks {
        match (self.guest_at(host), self.guest_at(later)) {
            (Some(g), Some(l)) if g <= l => g,
            _ => GuestTicks(0),
        }
    }

    /// The true offset `guest − host` at host TSC `host`, in the probe's sign convention and,
    /// like KVM's `tsc-offset`, modulo 2^64 (a signed 64-bit difference). With a rate other
    /// than 1 it changes with `host`; compare an estimate where it refers to (a probe
    /// summary's `at_host`).
    #[must_use]
    pub fn offset_at(&self, host: HostTicks) -> Option<i128> {
        let guest = self.guest_at(host)?.0;
        Some(i128::from(guest.wrapping_sub(host.0).cast_signed()))
    }

    /// True when the guest TSC `guest`, read by the agent some time between host TSC `send`
    /// and `recv` (a probe's or a VM exit's bracket), is what the truth gives inside that
    /// bracket: `guest_at(send) <= guest <= guest_at(recv)` (both mappings are monotonic).
    #[must_use]
    pub fn in_bracket(&self, send: HostTicks, guest: GuestTicks, recv: HostTicks) -> bool {
        match (self.guest_at(send), self.guest_at(recv)) {
            (Some(lo), Some(hi)) => lo <= guest && guest <= hi,
            _ => false,
        }
    }

    /// Checks a guaranteed offset interval `[lo, hi]` that refers to host TSC `at` (a probe
    /// summary's `at_host`) against the truth there; returns the true offset, or a message
    /// saying by how much it missed. With a rate other than 1 the mappings floor
    /// (`(tsc * R) >> F`), so the true offset at a real instant is up to one tick below the
    /// integer value at `at`: `lo` gets that one tick of slack.
    ///
    /// # Errors
    /// The message when the truth lies outside, or overflows.
    pub fn check(&self, at: HostTicks, lo: i64, hi: i64) -> Result<i128, String> {
        let truth = self
            .offset_at(at)
            .ok_or_else(|| format!("the truth at host {} overflows: {self:?}", at.0))?;
        let slack = i128::from(!(self.kvm.is_identity_ratio() && self.skew.is_identity_ratio()));
        if i128::from(lo) - slack <= truth && truth <= i128::from(hi) {
            Ok(truth)
        } else {
            Err(format!(
                "true offset {truth} at host {} lies outside the guaranteed [{lo}, {hi}] \
                 (KVM {:?}, skew {:?})",
                at.0, self.kvm, self.skew
            ))
        }
    }

    /// The skew's offset plus KVM's, modulo 2^64, as an `i64`: the constant truth of a
    /// rate-1 skew over a rate-1 KVM mapping.
    #[must_use]
    pub fn constant_offset(&self) -> Option<i64> {
        (self.kvm.is_identity_ratio() && self.skew.is_identity_ratio())
            .then(|| self.kvm.offset().wrapping_add(self.skew.offset()))
    }

    /// The one mapping KVM's nested composition makes of the two
    /// (`vmtsync tsc compose`), for tools that take a single mapping.
    ///
    /// # Errors
    /// [`TruthError::Compose`] when the fraction bits differ (both sides scaling) or the
    /// result overflows.
    pub fn composed(&self) -> Result<KvmTscMapping, TruthError> {
        Ok(vmtsync::compose::compose(&self.kvm, &self.skew)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_vcpu_skews_differ_and_name_their_vcpu() {
        let skews = Skew::pick_per_vcpu(4);
        for (v, s) in (0u32..).zip(&skews) {
            let opt = s.agent_option_for(v);
            let value = opt.strip_prefix(&format!("skew{v}=")).expect("skewN=");
            assert_eq!(Skew::parse(value), Some(*s));
        }
        for w in skews.windows(2) {
            assert_eq!(
                w[1].0.offset() - w[0].0.offset(),
                i64::try_from(PER_VCPU_APART).unwrap()
            );
        }
    }

    #[test]
    fn skews_follow_the_host_tsc_and_never_wrap() {
        // A host booted a minute ago and one up for a year: both give positive offsets tied
        // to their TSC, and the reported TSC of a guest that starts at 0 does not wrap.
        for host in [150_000_000_000u64, 80_000_000_000_000_000] {
            let s = Skew::from_host_tsc(HostTicks(host));
            assert_eq!(
                s.0.offset(),
                i64::try_from(host + SKEW_OFFSET_EXTRA).unwrap()
            );
            assert_ne!(s.0.ratio(), 1 << s.0.frac_bits(), "rate must not be 1");
            let fresh_guest =
                GuestTruth::new(KvmTscMapping::offset_only(-host.cast_signed()), Some(s));
            let g = fresh_guest.guest_at(HostTicks(host)).unwrap().0;
            assert_eq!(
                g,
                host + SKEW_OFFSET_EXTRA,
                "guest TSC 0 reports the offset"
            );
            assert!(fresh_guest.offset_at(HostTicks(host)).unwrap() > 0);
        }
        let s = Skew::from_host_tsc(HostTicks(1_000));
        assert_eq!(
            s.agent_option(),
            format!("skew={},{SKEW_RATIO},48", 1_000 + SKEW_OFFSET_EXTRA)
        );
        // The option's value parses back to the same skew; nonsense does not parse.
        let opt = s.agent_option();
        assert_eq!(Skew::parse(opt.strip_prefix("skew=").unwrap()), Some(s));
        assert_eq!(
            Skew::parse("-5,3,1"),
            Some(Skew(KvmTscMapping::try_new(-5, 3, 1).unwrap()))
        );
        for bad in ["", "1,2", "1,2,3,4", "1,0,4", "x,1,0", "1,1,99"] {
            assert_eq!(Skew::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn truth_is_the_skew_applied_to_kvms_guest_tsc() {
        let kvm = KvmTscMapping::offset_only(-1_000_000);
        let skew = Skew(KvmTscMapping::try_new(500, 3 << 47, 48).unwrap()); // rate 1.5
        let t = GuestTruth::new(kvm, Some(skew));
        // host 3_000_000 -> KVM 2_000_000 -> 500 + 3_000_000.
        assert_eq!(
            t.guest_at(HostTicks(3_000_000)),
            Some(GuestTicks(3_000_500))
        );
        assert_eq!(t.offset_at(HostTicks(3_000_000)), Some(500));
        assert_eq!(t.constant_offset(), None);
        // The nested composition agrees here (no rounding at these values).
        let c = t.composed().unwrap();
        assert_eq!(
            c.try_guest_from_host(HostTicks(3_000_000)),
            Some(GuestTicks(3_000_500))
        );
        // No skew: KVM's mapping alone, a constant offset.
        let plain = GuestTruth::new(kvm, None);
        assert_eq!(plain.constant_offset(), Some(-1_000_000));
        assert_eq!(plain.offset_at(HostTicks(5_000_000)), Some(-1_000_000));
        // A reading inside a bracket maps inside; one tick past either edge does not.
        let (s, r) = (HostTicks(3_000_000), HostTicks(3_000_010));
        assert!(t.in_bracket(s, GuestTicks(3_000_500), r));
        assert!(t.in_bracket(s, GuestTicks(3_000_515), r));
        assert!(!t.in_bracket(s, GuestTicks(3_000_499), r));
        assert!(!t.in_bracket(s, GuestTicks(3_000_516), r));
        // A host instant before the vCPU existed (KVM's offset -1 000 000: host 400 000 maps
        // below zero) bounds later readings by 0; one after its creation by its image.
        assert_eq!(
            plain.guest_floor_at(HostTicks(400_000), HostTicks(3_000_000)),
            GuestTicks(0)
        );
        assert_eq!(
            plain.guest_floor_at(HostTicks(1_400_000), HostTicks(3_000_000)),
            GuestTicks(400_000)
        );
        // check: inside, on the edges, one tick of floor slack only with a rate != 1.
        assert_eq!(
            plain.check(HostTicks(9), -1_000_000, -1_000_000),
            Ok(-1_000_000)
        );
        assert!(plain.check(HostTicks(9), -999_999, 0).is_err());
        assert!(plain.check(HostTicks(9), -2_000_000, -1_000_001).is_err());
        assert_eq!(t.check(HostTicks(3_000_000), 501, 600), Ok(500));
        assert!(t.check(HostTicks(3_000_000), 502, 600).is_err());
        assert!(t.check(HostTicks(3_000_000), 0, 499).is_err());
    }
}
