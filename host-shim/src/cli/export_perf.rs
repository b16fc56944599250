//! `vmtsync export perf`: a VM's KVM TSC mapping as `perf inject --guest-data`'s offset and
//! scale, or why perf cannot take it.
//!
//! perf (tools/perf/builtin-inject.c, `guest_session__convert_time`) turns a guest TSC into a
//! host TSC with `tsc -= time_offset; tsc /= time_scale` in unsigned 64-bit arithmetic (the
//! offset parsed with `strtoull`, so a negative offset wraps and still subtracts correctly),
//! one offset and scale for the whole guest. KVM's relation per vCPU is
//! `guest = offset + ((host * ratio) >> frac_bits)`. So perf is exact when every vCPU (or the
//! one chosen) has the same offset and `ratio` is an integer multiple `k` of `2^frac_bits`:
//! then `host = (guest - offset) / k`. Otherwise the best perf can do is the nearest integer
//! scale, and its error grows with the guest TSC; the explanation gives it at the current
//! guest TSC. Details in `docs/attach.md`.

use clap::Args;
use vmtsync_core::mapping::KvmTscMapping;

use super::exit::CliError;
use super::source::{SourceArgs, single_vm};
use crate::hosttsc::read_host_tsc;
use crate::scan::{VcpuReport, VmSelector};

/// `vmtsync export perf`.
#[derive(Debug, Args)]
pub struct PerfArgs {
    /// The VM (PID, PID-FD or name): its KVM debugfs entry gives the mapping, its PID is
    /// perf's machine PID.
    #[arg(long, value_name = "PID|NAME")]
    pub vm: VmSelector,
    /// Only this vCPU's mapping (default: every vCPU, which must agree).
    #[arg(long, value_name = "N")]
    pub vcpu: Option<u32>,
    /// The guest's perf.data path to put in the argument.
    #[arg(long, value_name = "PATH", default_value = "guest.perf.data")]
    pub perf_data: String,
    /// Accept vCPUs in guest mode (their debugfs values are the L0->L2 mapping).
    #[arg(long)]
    pub nested_l2: bool,
    /// Debugfs and /proc locations.
    #[command(flatten)]
    pub source: SourceArgs,
}

/// What perf can do with a set of vCPU mappings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PerfMapping {
    /// Exact: `host = (guest - offset) / scale` for every vCPU.
    Exact {
        /// perf's `time_offset` (our sign: guest - host at the origin).
        offset: i64,
        /// perf's `time_scale` (1 for no TSC scaling).
        scale: u64,
    },
    /// perf cannot express it; why, and the error the closest perf arguments would make.
    Inexpressible(String),
}

/// perf's host TSC for `guest` with `offset` and `scale` (its wrapping u64 arithmetic).
fn perf_host(guest: u64, offset: i64, scale: u64) -> u64 {
    guest.wrapping_sub(offset.cast_unsigned()) / scale.max(1)
}

/// The exact host TSC of `guest` under `m`: the first host tick at which the guest TSC has
/// reached it (`KvmTscMapping::try_host_from_guest_ceil`).
fn exact_host(m: &KvmTscMapping, guest: u64) -> Option<u64> {
    m.try_host_from_guest_ceil(vmtsync_core::GuestTicks(guest))
        .map(|h| h.0)
}

/// Decides what perf can do with `maps` (`(vCPU, mapping)`), judging errors at the guest TSC
/// each vCPU reads at host tick `host_now`.
#[must_use]
pub fn perf_mapping(maps: &[(u32, KvmTscMapping)], host_now: u64) -> PerfMapping {
    let Some(&(v0, m0)) = maps.first() else {
        return PerfMapping::Inexpressible("the VM has no vCPU".into());
    };
    let one = 1u128 << m0.frac_bits();
    let r = u128::from(m0.ratio());
    // The nearest integer scale (at least 1: perf divides by it).
    let scale = u64::try_from(((r + one / 2) / one).max(1)).unwrap_or(u64::MAX);
    let integer = r % one == 0;
    let mut why = Vec::new();
    for &(v, m) in &maps[1..] {
        if m.offset() != m0.offset() || m.ratio() != m0.ratio() || m.frac_bits() != m0.frac_bits() {
            why.push(format!(
                "vcpu{v} (offset {}, ratio {}/2^{}) differs from vcpu{v0} (offset {}, ratio {}/2^{}): perf takes one offset and scale per guest",
                m.offset(),
                m.ratio(),
                m.frac_bits(),
                m0.offset(),
                m0.ratio(),
                m0.frac_bits()
            ));
        }
    }
    if !integer {
        why.push(format!(
            "the TSC scaling ratio {}/2^{} is not an integer: perf divides by an integer-valued scale",
            m0.ratio(),
            m0.frac_bits()
        ));
    }
    if why.is_empty() {
        return PerfMapping::Exact {
            offset: m0.offset(),
            scale,
        };
    }
    // The error of the closest arguments (vcpu0's offset, the nearest integer scale) at each
    // vCPU's current guest TSC, against the exact inverse.
    let mut worst: Option<(u32, u64)> = None;
    for &(v, m) in maps {
        let Some(g) = m.try_guest_from_host(vmtsync_core::HostTicks(host_now)) else {
            continue;
        };
        if let Some(exact) = exact_host(&m, g.0) {
            let err = perf_host(g.0, m0.offset(), scale).abs_diff(exact);
            if worst.is_none_or(|(_, w)| err > w) {
                worst = Some((v, err));
            }
        }
    }
    let err = worst.map_or_else(
        || "no vCPU's current guest TSC maps back to the host".to_owned(),
        |(v, e)| {
            format!(
                "with --guest-data=…,{},{scale} perf would be off by {e} ticks for vcpu{v} at its current guest TSC, and the error grows with the guest TSC",
                m0.offset()
            )
        },
    );
    PerfMapping::Inexpressible(format!("{}; {err}", why.join("; ")))
}

fn mapping_of(v: &VcpuReport) -> Result<KvmTscMapping, CliError> {
    KvmTscMapping::try_new(v.tsc_offset, v.tsc_scaling_ratio, v.tsc_frac_bits)
        .map_err(|e| CliError::Usage(format!("vcpu{}: {e}", v.vcpu)))
}

pub(super) fn run_export_perf(a: &PerfArgs) -> Result<(), CliError> {
    let vm = single_vm(&a.source, &a.vm)?;
    let vm_name = format!("{}-{}", vm.pid, vm.fd);
    let vcpus: Vec<&VcpuReport> = vm
        .vcpus
        .iter()
        .filter(|v| a.vcpu.is_none_or(|n| v.vcpu == n))
        .collect();
    if let (Some(n), true) = (a.vcpu, vcpus.is_empty()) {
        return Err(CliError::NoVcpu {
            vm: vm_name,
            vcpu: n,
            available: vm
                .vcpus
                .iter()
                .map(|v| format!("vcpu{}", v.vcpu))
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    let mut maps = Vec::with_capacity(vcpus.len());
    for v in vcpus {
        if v.guest_mode == Some(true) && !a.nested_l2 {
            return Err(CliError::Nested {
                vm: vm_name,
                vcpu: v.vcpu,
            });
        }
        maps.push((v.vcpu, mapping_of(v)?));
    }
    match perf_mapping(&maps, read_host_tsc().0) {
        PerfMapping::Exact { offset, scale } => {
            let scale = if scale == 1 {
                String::new()
            } else {
                format!(",{scale}")
            };
            println!("--guest-data={},{},{offset}{scale}", a.perf_data, vm.pid);
            Ok(())
        }
        PerfMapping::Inexpressible(why) => Err(CliError::NotExpressible(format!(
            "perf inject --guest-data cannot express VM {vm_name}'s TSC mapping exactly: {why}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(offset: i64, ratio: u64, frac: u32) -> KvmTscMapping {
        KvmTscMapping::try_new(offset, ratio, frac).unwrap()
    }

    #[test]
    fn identity_and_integer_scales_are_exact_in_perfs_arithmetic() {
        let id = m(-123_456_789, 1 << 48, 48);
        assert_eq!(
            perf_mapping(&[(0, id), (1, id)], 5_000_000_000),
            PerfMapping::Exact {
                offset: -123_456_789,
                scale: 1
            }
        );
        // Twice the host rate: guest = offset + 2 host, so host = (guest - offset) / 2.
        let twice = m(1000, 2 << 32, 32);
        let PerfMapping::Exact { offset, scale } = perf_mapping(&[(0, twice)], 1 << 40) else {
            panic!()
        };
        for host in [0u64, 1, 12_345, 1 << 40] {
            let g = twice
                .try_guest_from_host(vmtsync_core::HostTicks(host))
                .unwrap()
                .0;
            assert_eq!(perf_host(g, offset, scale), host);
        }
    }

    #[test]
    fn a_fractional_ratio_or_differing_vcpus_are_explained_with_the_error() {
        // 1.25x (the intel fixture's ratio): perf's nearest integer scale is 1.
        let frac = m(-123_456_789, 351_843_720_888_320, 48);
        let PerfMapping::Inexpressible(why) = perf_mapping(&[(0, frac)], 4_000_000_000) else {
            panic!()
        };
        assert!(why.contains("not an integer"), "{why}");
        // At host 4e9 the guest reads ~5e9 - 123e6; perf's (g - off) / 1 is 1e9 ticks late.
        assert!(why.contains("off by 1000000000 ticks"), "{why}");
        let a = m(-5, 1 << 48, 48);
        let b = m(-7, 1 << 48, 48);
        let PerfMapping::Inexpressible(why) = perf_mapping(&[(0, a), (1, b)], 1 << 30) else {
            panic!()
        };
        assert!(
            why.contains("vcpu1") && why.contains("off by 2 ticks"),
            "{why}"
        );
    }
}
