//! The QEMU command line that boots the agent ELF, for the tests, `cargo xtask run-agent`,
//! the vsock rig and the demo alike, and the one that boots a firmware image as the BIOS
//! ([`command_firmware`], traced SeaBIOS: [`crate::firmware`]), paused until [`qmp_cont`].
//!
//! QEMU 7.2 boots a PVH ELF with `-kernel`. Never SeaBIOS (seconds of emulated ring-0 code on
//! nested KVM, docs/launching.md): `microvm` (its default firmware is qboot) or `q35` with
//! `-bios qboot.rom`. COM1 is QEMU's stdio or a Unix socket; COM2 is an extra `isa-serial` at
//! 0x2f8 writing to a file, because `microvm` creates only one UART itself. The file holds the
//! agent's defmt frames: decode it against the same ELF (`vmtsync-defmt`).

use std::path::Path;
use std::process::Command;

/// The QEMU binary.
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

impl Machine {
    /// Parses `microvm` or `q35`.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "microvm" => Some(Self::Microvm),
            "q35" => Some(Self::Q35),
            _ => None,
        }
    }
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

/// The guest value written to isa-debug-exit, from QEMU's exit code; `None` when QEMU did not
/// end through isa-debug-exit (its own exit codes are even).
#[must_use]
pub fn debug_exit_code(status: i32) -> Option<i32> {
    (status & 1 == 1).then_some(status >> 1)
}

/// A QEMU command that boots `elf` with `append` as its PVH command line, COM1 on stdio, COM2
/// written to `com2_log`, and isa-debug-exit at 0xf4. The caller sets up stdio.
///
/// `-cpu host,+invtsc,-arch-capabilities`: `+invtsc` exposes the invariant-TSC bit the agent
/// relies on; QEMU's `host` model otherwise fails on nested KVM with "failed to set MSR
/// 0x10a" (IA32_ARCH_CAPABILITIES is refused), so that MSR's feature is turned off.
#[must_use]
pub fn command(machine: Machine, elf: &Path, append: &str, com2_log: &Path) -> Command {
    command_with_memory(machine, elf, append, com2_log, DEFAULT_MEMORY_MIB)
}

/// The guest RAM every command here gives, in MiB (`-m 64M`), unless
/// [`command_with_memory`] names another size.
/// Whether KVM lists a VM of process `pid` with a vCPU 0 (its debugfs directory
/// `<pid>-<fd>/vcpu0` under `kvm_debugfs`, normally `/sys/kernel/debug/kvm`): QEMU creates its
/// VM a moment after it starts (after its chardevs), and a reader that names the VM by PID
/// needs it.
#[must_use]
pub fn kvm_has_vcpu0(kvm_debugfs: &Path, pid: u32) -> bool {
    let prefix = format!("{pid}-");
    std::fs::read_dir(kvm_debugfs)
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| {
            e.file_name().to_string_lossy().starts_with(&prefix) && e.path().join("vcpu0").is_dir()
        })
}

pub const DEFAULT_MEMORY_MIB: u32 = 64;

/// [`command`] with `memory_mib` MiB of guest RAM (`-m <N>M`) instead of
/// [`DEFAULT_MEMORY_MIB`], e.g. a 4 GiB guest for the memory reader's scan benchmark.
#[must_use]
pub fn command_with_memory(
    machine: Machine,
    elf: &Path,
    append: &str,
    com2_log: &Path,
    memory_mib: u32,
) -> Command {
    command_with_memory_smp(machine, elf, append, com2_log, memory_mib, 1)
}

/// [`command_with_memory`] with `smp` vCPUs (`-smp N`; the guest starts the others itself,
/// as the C guest does, `tests/c-guest/`).
#[must_use]
pub fn command_with_memory_smp(
    machine: Machine,
    elf: &Path,
    append: &str,
    com2_log: &Path,
    memory_mib: u32,
    smp: u32,
) -> Command {
    command_with_com1(
        machine,
        elf,
        append,
        com2_log,
        &["-serial", "stdio"],
        smp,
        memory_mib,
    )
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
    command_com1_socket_smp(machine, elf, append, com2_log, sock, 1)
}

/// [`command_com1_socket`] with `smp` vCPUs (`-smp N`; the agent starts the others itself,
/// see docs/smp.md).
#[must_use]
pub fn command_com1_socket_smp(
    machine: Machine,
    elf: &Path,
    append: &str,
    com2_log: &Path,
    sock: &Path,
    smp: u32,
) -> Command {
    com1_socket(machine, elf, append, com2_log, sock, smp, false)
}

/// [`command_com1_socket`] with `wait=on`: QEMU creates the socket, then waits for a client
/// before it starts the guest, so the client sees every byte the guest writes on COM1 from
/// its first (a boot log; with `wait=off` bytes written before a client connects are lost).
#[must_use]
pub fn command_com1_socket_waiting(
    machine: Machine,
    elf: &Path,
    append: &str,
    com2_log: &Path,
    sock: &Path,
) -> Command {
    com1_socket(machine, elf, append, com2_log, sock, 1, true)
}

fn com1_socket(
    machine: Machine,
    elf: &Path,
    append: &str,
    com2_log: &Path,
    sock: &Path,
    smp: u32,
    wait: bool,
) -> Command {
    let wait = if wait { "on" } else { "off" };
    let chardev = format!(
        "socket,id=com1,path={},server=on,wait={wait}",
        sock.display()
    );
    command_with_com1(
        machine,
        elf,
        append,
        com2_log,
        &["-chardev", &chardev, "-serial", "chardev:com1"],
        smp,
        DEFAULT_MEMORY_MIB,
    )
}

fn command_with_com1(
    machine: Machine,
    elf: &Path,
    append: &str,
    com2_log: &Path,
    com1: &[&str],
    smp: u32,
    memory_mib: u32,
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
        &format!("{memory_mib}M"),
        "-smp",
        smp.to_string().as_str(),
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

/// A QEMU command that boots the firmware image `bios` as the machine's BIOS on `-M pc`
/// (`-bios`; SeaBIOS is QEMU's own choice for this machine), with `memory_mib` MiB of RAM, its
/// debug console (port 0x402, where SeaBIOS prints its log) written to `debug_log`, no NIC
/// (with its default NIC, `-M pc` QEMU exits during SeaBIOS's network boot) and no display.
/// `-no-reboot`: a guest reset ends QEMU. The caller adds `-S` and a QMP socket
/// ([`qmp_cont`]) to attach a reader before the first instruction, and sets up stdio.
#[must_use]
pub fn command_firmware(bios: &Path, debug_log: &Path, memory_mib: u32) -> Command {
    command_firmware_resets(bios, debug_log, memory_mib, false)
}

/// [`command_firmware`], but with `resets` a guest reset restarts the firmware in the same
/// QEMU (no `-no-reboot`).
#[must_use]
pub fn command_firmware_resets(
    bios: &Path,
    debug_log: &Path,
    memory_mib: u32,
    resets: bool,
) -> Command {
    let mut c = Command::new(QEMU);
    c.args([
        "-M",
        "pc",
        "-accel",
        "kvm",
        "-cpu",
        "host,-arch-capabilities",
        "-m",
        &format!("{memory_mib}M"),
        "-display",
        "none",
        "-monitor",
        "none",
        "-nic",
        "none",
    ]);
    if !resets {
        c.arg("-no-reboot");
    }
    c.arg("-bios").arg(bios);
    c.arg("-chardev")
        .arg(format!("file,id=dbg,path={}", debug_log.display()));
    c.args(["-device", "isa-debugcon,iobase=0x402,chardev=dbg"]);
    c
}

/// The arguments that start QEMU paused (`-S`) with a QMP socket at `sock` that it listens on
/// without waiting for a client; [`qmp_cont`] resumes it.
#[must_use]
pub fn paused_with_qmp(sock: &Path) -> [String; 3] {
    [
        "-S".to_owned(),
        "-qmp".to_owned(),
        format!("unix:{},server=on,wait=off", sock.display()),
    ]
}

/// Resumes a QEMU started with [`paused_with_qmp`]: waits (at most `wait`) for its QMP socket
/// at `sock`, then sends `qmp_capabilities` and `cont`.
///
/// # Errors
/// As [`qmp_execute`].
pub fn qmp_cont(sock: &Path, wait: std::time::Duration) -> Result<(), crate::LaunchError> {
    qmp_execute(sock, "cont", wait)
}

/// Sends QMP command `command` (no arguments, e.g. `cont` or `system_reset`) to the QEMU whose
/// QMP socket is `sock`: waits (at most `wait`) for the socket, then sends
/// `qmp_capabilities` and the command, and waits for its answer.
///
/// # Errors
/// [`LaunchError::Missing`] when the socket never appears, QEMU refuses a command or the
/// socket fails.
pub fn qmp_execute(
    sock: &Path,
    command: &str,
    wait: std::time::Duration,
) -> Result<(), crate::LaunchError> {
    qmp_request(sock, &format!("{{\"execute\": \"{command}\"}}"), wait).map(|_| ())
}

/// Runs HMP command `line` (such as `info registers`) through QMP's `human-monitor-command` on
/// the QEMU whose QMP socket is `sock`, and returns its output.
///
/// # Errors
/// As [`qmp_execute`].
pub fn qmp_hmp(
    sock: &Path,
    line: &str,
    wait: std::time::Duration,
) -> Result<String, crate::LaunchError> {
    let req = serde_json::json!({
        "execute": "human-monitor-command",
        "arguments": {"command-line": line},
    });
    let v = qmp_request(sock, &req.to_string(), wait)?;
    Ok(v.as_str().unwrap_or_default().to_owned())
}

/// Sends one QMP request (a JSON object on one line) after `qmp_capabilities`, and returns its
/// `return` value.
fn qmp_request(
    sock: &Path,
    request: &str,
    wait: std::time::Duration,
) -> Result<serde_json::Value, crate::LaunchError> {
    use std::io::{BufRead as _, BufReader, Write as _};
    let fail =
        |what: String| crate::LaunchError::Missing(format!("QMP at {}: {what}", sock.display()));
    let end = std::time::Instant::now() + wait;
    let s = loop {
        match std::os::unix::net::UnixStream::connect(sock) {
            Ok(s) => break s,
            Err(e) if std::time::Instant::now() >= end => return Err(fail(e.to_string())),
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
        }
    };
    s.set_read_timeout(Some(wait))
        .map_err(|e| fail(e.to_string()))?;
    let mut r = BufReader::new(s.try_clone().map_err(|e| fail(e.to_string()))?);
    let mut w = s;
    let mut reply = |cmd: &str| -> Result<serde_json::Value, crate::LaunchError> {
        if !cmd.is_empty() {
            w.write_all(cmd.as_bytes())
                .map_err(|e| fail(e.to_string()))?;
        }
        loop {
            let mut line = String::new();
            if r.read_line(&mut line).map_err(|e| fail(e.to_string()))? == 0 {
                return Err(fail(format!("closed before it answered {cmd:?}")));
            }
            let v: serde_json::Value =
                serde_json::from_str(&line).map_err(|e| fail(format!("{e}: {line:?}")))?;
            // Events (`{"event": ...}`) may come in between; the greeting or a return ends.
            if let Some(ret) = v.get("return") {
                return Ok(ret.clone());
            }
            if v.get("QMP").is_some() {
                return Ok(serde_json::Value::Null);
            }
            if v.get("error").is_some() {
                return Err(fail(format!("{cmd:?} refused: {v}")));
            }
        }
    };
    reply("")?;
    reply("{\"execute\": \"qmp_capabilities\"}\n")?;
    reply(&format!("{request}\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prereq::display;

    #[test]
    fn command_lines_carry_the_flags_nested_kvm_needs() {
        let (elf, log) = (Path::new("/a.elf"), Path::new("/c2"));
        let c = display(&command(Machine::Microvm, elf, "exit=9", log));
        assert!(
            c.starts_with("qemu-system-x86_64 -M microvm -accel kvm"),
            "{c}"
        );
        assert!(c.contains("-cpu host,+invtsc,-arch-capabilities"), "{c}");
        assert!(c.contains("-serial stdio") && c.ends_with("-kernel /a.elf -append exit=9"));
        let c = display(&command_com1_socket(
            Machine::Q35,
            elf,
            "",
            log,
            Path::new("/s"),
        ));
        assert!(c.contains("-M q35 -bios /usr/share/qemu/qboot.rom"), "{c}");
        assert!(
            c.contains("-chardev socket,id=com1,path=/s,server=on,wait=off -serial chardev:com1"),
            "{c}"
        );
        assert!(!c.contains("-serial stdio") && c.contains("-smp 1 "), "{c}");
        let c = display(&command_com1_socket_smp(
            Machine::Microvm,
            elf,
            "",
            log,
            Path::new("/s"),
            4,
        ));
        assert!(c.contains("-smp 4 "), "{c}");
        let c = display(&command_com1_socket_waiting(
            Machine::Microvm,
            elf,
            "",
            log,
            Path::new("/s"),
        ));
        assert!(
            c.contains("path=/s,server=on,wait=on -serial chardev:com1"),
            "{c}"
        );
    }

    #[test]
    fn the_memory_size_can_be_named() {
        let (elf, log) = (Path::new("/a.elf"), Path::new("/c2"));
        let c = display(&command(Machine::Microvm, elf, "", log));
        assert!(c.contains(" -m 64M "), "{c}");
        let c = display(&command_with_memory(Machine::Microvm, elf, "x", log, 4096));
        assert!(c.contains(" -m 4096M ") && !c.contains("64M"), "{c}");
        assert!(c.ends_with("-kernel /a.elf -append x"), "{c}");
        assert!(c.contains(" -smp 1 "), "{c}");
        let c = display(&command_with_memory_smp(
            Machine::Microvm,
            elf,
            "x",
            log,
            128,
            2,
        ));
        assert!(c.contains(" -m 128M -smp 2 "), "{c}");
    }

    #[test]
    fn the_firmware_command_boots_a_bios_on_pc() {
        let c = display(&command_firmware(
            Path::new("/b.bin"),
            Path::new("/d.log"),
            128,
        ));
        assert!(
            c.starts_with(
                "qemu-system-x86_64 -M pc -accel kvm -cpu host,-arch-capabilities -m 128M "
            ),
            "{c}"
        );
        assert!(
            c.contains(" -nic none -no-reboot -bios /b.bin -chardev file,id=dbg,path=/d.log "),
            "{c}"
        );
        assert!(
            c.ends_with("-device isa-debugcon,iobase=0x402,chardev=dbg"),
            "{c}"
        );
        let p = paused_with_qmp(Path::new("/q"));
        assert_eq!(p.join(" "), "-S -qmp unix:/q,server=on,wait=off");
    }

    #[test]
    fn debug_exit_codes_round_trip() {
        assert_eq!(debug_exit_status(9), 19);
        assert_eq!(debug_exit_code(19), Some(9));
        assert_eq!(debug_exit_code(debug_exit_status(0)), Some(0));
        assert_eq!(debug_exit_code(0), None);
        assert_eq!(Machine::parse("q35"), Some(Machine::Q35));
        assert_eq!(Machine::parse("pc"), None);
    }
}
