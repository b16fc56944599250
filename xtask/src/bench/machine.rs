//! What machine a benchmark run ran on, read from /proc (and CPUID for the TSC rate), at the
//! start and at the end of the run.

use std::process::Command;

use vmtsync_core::arch::cpuid::{TscFreqSource, tsc_freq};
use vmtsync_core::arch::x86_64::NativeCpuid;

/// The machine, as seen when the run started.
#[derive(Debug, Clone)]
pub(crate) struct Machine {
    /// `model name` of the first CPU in /proc/cpuinfo.
    pub cpu: String,
    /// Logical CPUs (`processor` entries in /proc/cpuinfo).
    pub cores: usize,
    /// The TSC rate in kHz and where it came from (CPUID leaf 0x15, the hypervisor's timing
    /// leaf, or leaf 0x16), or `None` when CPUID reports none.
    pub tsc_khz: Option<(u64, &'static str)>,
    /// `cpu MHz` of the first CPU in /proc/cpuinfo (the kernel's calibration).
    pub cpuinfo_mhz: Option<String>,
    /// Whether the CPU flags say the kernel runs under a hypervisor.
    pub hypervisor: bool,
    /// /proc/sys/kernel/osrelease.
    pub kernel: String,
    /// UTC date and time (`date -u`).
    pub date: String,
    /// /proc/loadavg's first three fields.
    pub load: String,
}

impl Machine {
    /// Reads the machine's description now.
    pub(crate) fn now() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let field = |name: &str| {
            cpuinfo
                .lines()
                .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        };
        let tsc_khz = tsc_freq(&NativeCpuid).map(|f| {
            let source = match f.source {
                TscFreqSource::Crystal => "CPUID leaf 0x15",
                TscFreqSource::HypervisorTiming => "the hypervisor's CPUID timing leaf",
                TscFreqSource::BaseFrequency => "CPUID leaf 0x16 (nominal)",
                _ => "CPUID",
            };
            (f.hz / 1000, source)
        });
        let cpuinfo_mhz = field("cpu MHz");
        let tsc_khz = tsc_khz.or_else(|| {
            Some((
                mhz_to_khz(cpuinfo_mhz.as_deref()?)?,
                "CPUID reports none; the kernel's calibration, /proc/cpuinfo `cpu MHz`",
            ))
        });
        Self {
            cpu: field("model name").unwrap_or_else(|| "unknown CPU".into()),
            cores: cpuinfo
                .lines()
                .filter(|l| l.starts_with("processor"))
                .count(),
            tsc_khz,
            cpuinfo_mhz,
            hypervisor: field("flags").is_some_and(|f| f.split(' ').any(|x| x == "hypervisor")),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| s.trim().to_owned())
                .unwrap_or_else(|_| "unknown".into()),
            date: utc_now(),
            load: load_average(),
        }
    }
}

/// `2299.998` (MHz, as /proc/cpuinfo writes it) as kHz.
fn mhz_to_khz(mhz: &str) -> Option<u64> {
    let (int, frac) = mhz.split_once('.').unwrap_or((mhz, ""));
    let frac3: String = frac.chars().chain("000".chars()).take(3).collect();
    Some(int.parse::<u64>().ok()? * 1000 + frac3.parse::<u64>().ok()?)
}

/// /proc/loadavg's 1, 5 and 15 minute averages.
pub(crate) fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "unknown".into())
}

/// The current UTC time as `date -u` formats it (ISO 8601, minutes).
pub(crate) fn utc_now() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown date".into())
}

#[cfg(test)]
mod tests {
    use super::mhz_to_khz;

    #[test]
    fn cpuinfo_mhz_reads_as_khz() {
        assert_eq!(mhz_to_khz("2299.998"), Some(2_299_998));
        assert_eq!(mhz_to_khz("2600"), Some(2_600_000));
        assert_eq!(mhz_to_khz("26.5"), Some(26_500));
        assert_eq!(mhz_to_khz("x"), None);
    }
}
