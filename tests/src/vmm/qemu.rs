//! The same agent ELF under QEMU, for comparison with the built-in VMM.
//!
//! QEMU 7.2 boots a PVH ELF with `-kernel`. Never SeaBIOS here (5–7 s of emulated ring-0
//! code, see docs/qemu.md): `microvm` (its default firmware is qboot) or `q35` with
//! `-bios qboot.rom`. COM1 is QEMU's stdio; COM2 is an extra `isa-serial` at 0x2f8 writing to a
//! file, because `microvm` creates only one UART itself. The file holds the agent's defmt
//! frames: decode it with [`super::defmt_log`] against the same ELF.

use std::path::Path;
use std::process::Command;

/// The QEMU binary the tests and `cargo xtask run-agent` use.
pub const QEMU: &str = "qemu-system-x86_64";
/// qboot, the fast firmware for `q35`.
pub const QBOOT: &str = "/usr/share/qemu/qboot.rom";

/// The QEMU machine to boot on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Machine {
    /// `-M microvm` (qboot built in; ISA serial and isa-debug-exit, no PCI).
    Microvm,
    /// `-M q35 -bios qboot.rom` (PCI; qboot leaves BARs unassigned).
    Q35,
}

/// True when the QEMU binary can be started.
#[must_use]
pub fn have_qemu() -> bool {
    Command::new(QEMU)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// QEMU's exit status for a guest write of `code` to isa-debug-exit: `(code << 1) | 1`.
#[must_use]
pub fn debug_exit_status(code: u8) -> i32 {
    (i32::from(code) << 1) | 1
}

/// A QEMU command that boots `elf` with `append` as its PVH command line, COM1 on stdio, COM2
/// appended to `com2_log`, and isa-debug-exit at 0xf4. The caller sets up stdio.
///
/// `-cpu host,+invtsc,-arch-capabilities`: `+invtsc` exposes the invariant-TSC bit the agent
/// relies on; QEMU's `host` model otherwise fails here with "failed to set MSR 0x10a"
/// (IA32_ARCH_CAPABILITIES is refused by the nested KVM), so that MSR's feature is turned off.
#[must_use]
pub fn command(machine: Machine, elf: &Path, append: &str, com2_log: &Path) -> Command {
    command_with_com1(machine, elf, append, com2_log, &["-serial", "stdio"])
}

/// [`command`] with COM1 on a Unix socket QEMU listens on at `sock` (`server=on,wait=off`:
/// the guest boots without waiting for a client), as `vmtsync probe --connect unix:SOCK`
/// and external tools reach it.
#[must_use]
pub fn command_com1_socket(
    machine: Machine,
    elf: &Path,
    append: &str,
    com2_log: &Path,
    sock: &Path,
) -> Command {
    let chardev = format!("socket,id=com1,path={},server=on,wait=off", sock.display());
    command_with_com1(
        machine,
        elf,
        append,
        com2_log,
        &["-chardev", &chardev, "-serial", "chardev:com1"],
    )
}

fn command_with_com1(
    machine: Machine,
    elf: &Path,
    append: &str,
    com2_log: &Path,
    com1: &[&str],
) -> Command {
    let mut c = Command::new(QEMU);
    match machine {
        Machine::Microvm => c.args(["-M", "microvm"]),
        Machine::Q35 => c.args(["-M", "q35", "-bios", QBOOT]),
    };
    c.args([
        "-accel",
        "kvm",
        "-cpu",
        "host,+invtsc,-arch-capabilities",
        "-m",
        "64M",
        "-smp",
        "1",
        "-display",
        "none",
        "-monitor",
        "none",
        "-no-reboot",
    ]);
    c.args(com1);
    c.args([
        "-device",
        "isa-serial,chardev=com2,iobase=0x2f8,irq=3",
        "-device",
        "isa-debug-exit,iobase=0xf4,iosize=4",
    ]);
    c.arg("-chardev")
        .arg(format!("file,id=com2,path={}", com2_log.display()));
    c.arg("-kernel").arg(elf).arg("-append").arg(append);
    c
}
