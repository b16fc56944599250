//! One scan of KVM debugfs joined with `/proc`: the VMs, their names and every vCPU's mapping,
//! in the versioned JSON shape of `vmtsync kvm --json`.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;
use thiserror::Error;

use crate::kvm::debugfs::{DebugfsError, KvmDebugfs, VcpuState, VmDir, VmId};
use crate::kvm::procinfo::ProcFs;

/// Version of the `vmtsync kvm --json` schema. Bump it when a field changes meaning.
pub const SCHEMA_VERSION: u32 = 1;

/// Which VM(s) `--vm` selects: a creating PID (all digits) or a name (QEMU `-name` or the
/// process name).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VmSelector {
    /// The VMM's PID (the `<pid>` of `<pid>-<fd>`).
    Pid(u32),
    /// One VM by its debugfs directory name `<pid>-<fd>` (a process may own several VMs).
    Dir(VmId),
    /// The QEMU guest name or the process `comm`.
    Name(String),
}

impl FromStr for VmSelector {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let all_digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
        if all_digits(s)
            && let Ok(p) = s.parse::<u32>()
        {
            return Ok(Self::Pid(p));
        }
        if let Some((p, f)) = s.split_once('-')
            && all_digits(p)
            && all_digits(f)
            && let (Ok(pid), Ok(fd)) = (p.parse(), f.parse())
        {
            return Ok(Self::Dir(VmId { pid, fd }));
        }
        Ok(Self::Name(s.to_owned()))
    }
}

impl fmt::Display for VmSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Pid(p) => write!(f, "{p}"),
            Self::Dir(id) => write!(f, "{}-{}", id.pid, id.fd),
            Self::Name(n) => f.write_str(n),
        }
    }
}

/// Errors of a scan.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ScanError {
    /// Reading debugfs failed.
    #[error(transparent)]
    Debugfs(#[from] DebugfsError),
    /// `--vm` matched nothing.
    #[error("no VM matches --vm {selector}; running VMs: {available} (see `vmtsync kvm`)")]
    NoMatch {
        /// What was asked for.
        selector: String,
        /// The VMs that exist, as `pid-fd (name)`, or "none".
        available: String,
    },
}

/// The whole `vmtsync kvm --json` document.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KvmReport {
    /// Always [`SCHEMA_VERSION`].
    pub schema: u32,
    /// The VMs found, sorted by (pid, fd).
    pub vms: Vec<VmReport>,
}

/// One VM.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct VmReport {
    /// PID of the process that created the VM.
    pub pid: u32,
    /// The VM's file descriptor in that process.
    pub fd: u32,
    /// QEMU guest name (`-name`) or else the process name; `null` if the process is gone.
    pub name: Option<String>,
    /// The vCPUs, sorted by vCPU id: each reading as it was read, which serializes as the
    /// schema's flat vCPU object (see [`VcpuState`]).
    pub vcpus: Vec<VcpuState>,
}

impl VmReport {
    /// The VM's debugfs identity.
    #[must_use]
    pub fn id(&self) -> VmId {
        VmId {
            pid: self.pid,
            fd: self.fd,
        }
    }
}

/// Debugfs plus `/proc`: everything a scan reads.
#[derive(Clone, Debug)]
pub struct Scanner {
    /// The KVM debugfs tree.
    pub debugfs: KvmDebugfs,
    /// The proc tree used for names.
    pub proc: ProcFs,
}

impl Scanner {
    /// Lists the VM directories matching `sel` (all if `None`), with their display names.
    /// Does not read vCPUs.
    ///
    /// # Errors
    /// Debugfs errors; [`ScanError::NoMatch`] if `sel` is given and nothing matches.
    pub fn select(
        &self,
        sel: Option<&VmSelector>,
    ) -> Result<Vec<(VmDir, Option<String>)>, ScanError> {
        let all = self.debugfs.vms()?;
        let mut out = Vec::new();
        let mut seen = Vec::new();
        for vm in all {
            let info = self.proc.process(vm.id.pid);
            let keep = match sel {
                None => true,
                Some(VmSelector::Pid(p)) => vm.id.pid == *p,
                Some(VmSelector::Dir(id)) => vm.id == *id,
                Some(VmSelector::Name(n)) => info.matches_name(n),
            };
            let name = info.display_name().map(str::to_owned);
            if keep {
                out.push((vm, name));
            } else {
                seen.push(match &name {
                    Some(n) => format!("{}-{} ({n})", vm.id.pid, vm.id.fd),
                    None => format!("{}-{}", vm.id.pid, vm.id.fd),
                });
            }
        }
        if let Some(sel) = sel
            && out.is_empty()
        {
            return Err(ScanError::NoMatch {
                selector: sel.to_string(),
                available: if seen.is_empty() {
                    "none".to_owned()
                } else {
                    seen.join(", ")
                },
            });
        }
        Ok(out)
    }

    /// Scans the VMs matching `sel`. Without a selector, a VM that exits during the scan is
    /// left out (it is no longer running); with one, that is an error.
    ///
    /// # Errors
    /// Debugfs errors (naming the file); [`ScanError::NoMatch`].
    pub fn scan(&self, sel: Option<&VmSelector>) -> Result<KvmReport, ScanError> {
        let selected = self.select(sel)?;
        // Reading is one openat+read+close per file: spread big hosts over the CPUs.
        let threads = std::thread::available_parallelism()
            .map_or(1, std::num::NonZero::get)
            .min(selected.len().div_ceil(PARALLEL_MIN_VMS));
        let read_all = |part: &[(VmDir, Option<String>)]| {
            part.iter()
                .map(|(vm, _)| self.debugfs.read_vm(vm))
                .collect::<Vec<_>>()
        };
        let results: Vec<Result<Vec<VcpuState>, DebugfsError>> = if threads > 1 {
            let chunk = selected.len().div_ceil(threads);
            std::thread::scope(|s| {
                let handles: Vec<_> = selected
                    .chunks(chunk)
                    .map(|part| s.spawn(move || read_all(part)))
                    .collect();
                handles
                    .into_iter()
                    .flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                    .collect()
            })
        } else {
            read_all(&selected)
        };
        let mut vms = Vec::with_capacity(selected.len());
        for ((vm, name), r) in selected.into_iter().zip(results) {
            match r {
                Ok(vcpus) => vms.push(VmReport {
                    pid: vm.id.pid,
                    fd: vm.id.fd,
                    name,
                    vcpus,
                }),
                Err(DebugfsError::VmExited { .. }) if sel.is_none() => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(KvmReport {
            schema: SCHEMA_VERSION,
            vms,
        })
    }
}

/// Below this many VMs per thread, a scan stays on one thread (spawning costs more).
const PARALLEL_MIN_VMS: usize = 64;

/// Warnings a reader of `report` must see: nested vCPUs (values are L0→L2) and, once, the
/// absence of scaling files (identity assumed).
#[must_use]
pub fn warnings(report: &KvmReport) -> Vec<String> {
    let mut out = Vec::new();
    let mut absent = 0usize;
    for vm in &report.vms {
        for v in &vm.vcpus {
            if v.guest_mode == Some(true) {
                out.push(format!(
                    "VM {}-{} vcpu{} is running a nested guest (guest_mode=1): its tsc-offset and ratio are the combined L0->L2 mapping, not this VM's (L1) mapping",
                    vm.pid, vm.fd, v.vcpu
                ));
            }
            if !v.scaling.present {
                absent += 1;
            }
        }
    }
    if absent > 0 {
        out.push(format!(
            "{absent} vCPU(s) have no tsc-scaling-ratio files (this host has no TSC scaling): identity scaling assumed (ratio 1, frac bits 0)"
        ));
    }
    out
}

/// Renders the human table of `vmtsync kvm`.
///
/// # Errors
/// Write errors.
pub fn write_table(report: &KvmReport, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    if report.vms.is_empty() {
        return writeln!(out, "no VMs found");
    }
    for vm in &report.vms {
        writeln!(
            out,
            "VM {}-{}  name: {}  vcpus: {}",
            vm.pid,
            vm.fd,
            vm.name.as_deref().unwrap_or("-"),
            vm.vcpus.len()
        )?;
        writeln!(
            out,
            "  {:>5}  {:>8}  {:>21}  {:>20}  {:>4}  {:>7}  {:>6}  {:>20}  {:>20}",
            "vcpu",
            "thread",
            "tsc-offset",
            "ratio",
            "frac",
            "scaling",
            "nested",
            "host-tsc-before",
            "host-tsc-after"
        )?;
        for v in &vm.vcpus {
            let thread = v
                .thread_pid
                .map_or_else(|| "-".to_owned(), |t| t.to_string());
            let nested = match v.guest_mode {
                Some(true) => "L2!",
                Some(false) => "no",
                None => "?",
            };
            writeln!(
                out,
                "  {:>5}  {:>8}  {:>21}  {:>20}  {:>4}  {:>7}  {:>6}  {:>20}  {:>20}",
                v.vcpu,
                thread,
                v.tsc_offset,
                v.scaling.ratio,
                v.scaling.frac_bits,
                if v.scaling.present { "yes" } else { "absent" },
                nested,
                v.bracket.before.0,
                v.bracket.after.0
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

    #[test]
    fn selector_parses() {
        assert_eq!("123".parse::<VmSelector>().unwrap(), VmSelector::Pid(123));
        assert_eq!(
            "+123".parse::<VmSelector>().unwrap(),
            VmSelector::Name("+123".into())
        );
        assert_eq!(
            "12-7".parse::<VmSelector>().unwrap(),
            VmSelector::Dir(VmId { pid: 12, fd: 7 })
        );
        assert_eq!(
            "web".parse::<VmSelector>().unwrap(),
            VmSelector::Name("web".into())
        );
        assert_eq!(
            "99999999999".parse::<VmSelector>().unwrap(),
            VmSelector::Name("99999999999".into())
        );
    }

    #[test]
    fn warnings_name_nested_and_absent_scaling() {
        let v = VcpuState {
            vcpu: 3,
            tsc_offset: 0,
            scaling: Scaling::ABSENT,
            guest_mode: Some(true),
            thread_pid: None,
            bracket: TscBracket::ticks(0, 0),
        };
        let r = KvmReport {
            schema: 1,
            vms: vec![VmReport {
                pid: 5,
                fd: 9,
                name: None,
                vcpus: vec![
                    v,
                    VcpuState {
                        guest_mode: Some(false),
                        ..v
                    },
                ],
            }],
        };
        let w = warnings(&r);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].starts_with("VM 5-9 vcpu3 is running a nested guest"));
        assert!(w[1].starts_with("2 vCPU(s) have no tsc-scaling-ratio files"));
    }

    /// A vCPU reading serializes as the schema's flat object, its fields in this order (the
    /// scaling and the bracket flattened in), as `vmtsync kvm --json` has always printed it.
    #[test]
    fn a_vcpu_serializes_as_the_flat_schema_object() {
        let v = VcpuState {
            vcpu: 2,
            tsc_offset: -7,
            scaling: Scaling {
                ratio: 3,
                frac_bits: 48,
                present: true,
            },
            guest_mode: None,
            thread_pid: Some(99),
            bracket: TscBracket::ticks(10, 11),
        };
        assert_eq!(
            serde_json::to_string(&v).unwrap(),
            "{\"vcpu\":2,\"tsc_offset\":-7,\"tsc_scaling_ratio\":3,\"tsc_frac_bits\":48,\"scaling_present\":true,\"guest_mode\":null,\"thread_pid\":99,\"host_tsc_before\":10,\"host_tsc_after\":11}"
        );
    }
}
