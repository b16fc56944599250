//! KVM debugfs parsing (`vmtsync::kvm::debugfs::parse`): file contents and directory names. A panic
//! is a crash, and so is any disagreement with a reference taken from `std` on what the kernel
//! can have written: `"%lld\n"`/`"%llu\n"` contents (std's integer parser minus its leading
//! `+`, which the kernel never prints), `<pid>-<fd>[-...]` VM directories, and `vcpu%d`
//! directories (exactly the kernel's spelling, so `vcpu01` is not vCPU 1).
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmtsync::kvm::debugfs::{
    VmId, parse_i64_contents, parse_u64_contents, parse_vcpu_dir_name, parse_vm_dir_name,
};

/// std's parse of `s` as `T`, refusing a leading `+` (and anything not UTF-8).
fn std_parse<T: std::str::FromStr>(s: &[u8]) -> Option<T> {
    let s = std::str::from_utf8(s).ok()?;
    if s.starts_with('+') {
        return None;
    }
    s.parse().ok()
}

fuzz_target!(|data: &[u8]| {
    let body = data.strip_suffix(b"\n").unwrap_or(data);
    assert_eq!(parse_u64_contents(data), std_parse::<u64>(body), "{data:?}");
    assert_eq!(parse_i64_contents(data), std_parse::<i64>(body), "{data:?}");

    let Ok(name) = std::str::from_utf8(data) else {
        return;
    };
    let mut parts = name.split('-');
    let want = match (parts.next(), parts.next()) {
        (Some(pid), Some(fd)) => std_parse::<u32>(pid.as_bytes())
            .zip(std_parse::<u32>(fd.as_bytes()))
            .map(|(pid, fd)| VmId { pid, fd }),
        _ => None,
    };
    assert_eq!(parse_vm_dir_name(name), want, "{name:?}");
    match parse_vcpu_dir_name(name) {
        Some(n) => assert_eq!(format!("vcpu{n}"), name),
        None => assert!(
            name.strip_prefix("vcpu")
                .and_then(|d| std_parse::<u32>(d.as_bytes()))
                .is_none_or(|n| format!("vcpu{n}") != name),
            "{name:?} rejected"
        ),
    }
});
