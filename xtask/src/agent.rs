//! `cargo xtask build-agent` and `cargo xtask run-agent`: build the bare-metal guest agent and
//! boot it under QEMU or the built-in VMM (`vmtsync-tests`' `vmtsync-vmm` binary).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use vmtsync_launch::ChildGuard;
use vmtsync_launch::agent::{BuildOutput, agent_cargo};
use vmtsync_launch::qemu::{self, Machine};

use crate::{cargo, sh};

/// Largest `.text` of what an embedder links: vmtsync-core's agent state machine, a UART link
/// and memory mode, as `tests/minimal-kernel/` links them (docs/embedding.md: a guest links
/// `vmtsync-core` and nothing else of this repository). The budget is on that code because it
/// is the code meant to go into other people's guests. The bundled agent is a whole kernel of
/// its own (both transports, PCI and virtio, a heap, SMP bring-up, defmt logging, its console)
/// that nobody embeds, and no loader bounds its `.text` (link.ld starts `.rodata` at the next
/// page; PVH loaders load each segment at its address), so its size is reported, not budgeted.
pub(crate) const TEXT_LIMIT: u64 = 64 * 1024;

/// Builds the agent (release; the rustup target is installed first when missing) with cargo's
/// progress shown, and returns its ELF (`vmtsync_launch::agent`, the build the tests use).
pub(crate) fn build() -> Result<PathBuf> {
    Ok(vmtsync_launch::agent::build(BuildOutput::Shown)?)
}

/// Builds `tests/minimal-kernel/` (release), the embedding example, and returns its ELF.
pub(crate) fn build_minimal_kernel() -> Result<PathBuf> {
    use vmtsync_launch::agent::{Guest, build_guest};
    Ok(build_guest(Guest::MinimalKernel, BuildOutput::Shown)?)
}

/// `cargo xtask build-agent`: builds, prints the ELF path and `.text` size (reported, not
/// budgeted: see [`TEXT_LIMIT`]).
pub(crate) fn build_agent() -> Result<()> {
    let elf = build()?;
    let text = section_size(&elf, ".text")?;
    println!("{}", elf.display());
    println!(".text: {text} bytes ({:.1} KiB)", kib(text));
    Ok(())
}

/// Fails when the minimal kernel's `.text` (what an embedder links) exceeds [`TEXT_LIMIT`].
fn check_embedded_text(elf: &Path) -> Result<()> {
    let text = section_size(elf, ".text")?;
    println!(
        "{}: .text {text} bytes ({:.1} KiB of the {} KiB an embedder's share may take)",
        elf.display(),
        kib(text),
        TEXT_LIMIT / 1024
    );
    if text > TEXT_LIMIT {
        bail!("the minimal kernel's .text is {text} bytes, over the {TEXT_LIMIT}-byte limit");
    }
    Ok(())
}

/// The `ci` step for the agent, which the host workspace's fmt/clippy/test do not reach (it is
/// excluded from the workspace): fmt check, clippy for the bare-metal target and for the host
/// unit tests, the host unit tests, and the release build (its `.text` size printed).
pub(crate) fn ci_check() -> Result<()> {
    vmtsync_launch::prereq::ensure_rustup_target(&vmtsync_launch::agent::agent_dir())?;
    let host = "x86_64-unknown-linux-gnu";
    sh(agent_cargo().args(["fmt", "--check"]))?;
    sh(agent_cargo().args(["clippy", "--release", "--", "-D", "warnings"]))?;
    sh(agent_cargo().args([
        "clippy", "--lib", "--tests", "--target", host, "--", "-D", "warnings",
    ]))?;
    sh(agent_cargo().args(["test", "--lib", "--target", host]))?;
    build_agent()
}

/// The `ci` step for `tests/minimal-kernel/` (excluded from the workspace like the agent):
/// fmt check, clippy for the bare-metal target, and the release build the tier-2 tests boot,
/// with its `.text` limit ([`TEXT_LIMIT`]).
pub(crate) fn ci_check_minimal_kernel() -> Result<()> {
    use vmtsync_launch::agent::{Guest, guest_cargo};
    let guest = Guest::MinimalKernel;
    vmtsync_launch::prereq::ensure_rustup_target(&guest.dir())?;
    sh(guest_cargo(guest).args(["fmt", "--check"]))?;
    sh(guest_cargo(guest).args(["clippy", "--release", "--", "-D", "warnings"]))?;
    check_embedded_text(&build_minimal_kernel()?)
}

#[allow(clippy::cast_precision_loss)] // Display only; sizes are far below 2^52.
fn kib(bytes: u64) -> f64 {
    bytes as f64 / 1024.0
}

/// Options of `run-agent`.
struct RunArgs {
    vmm: String,
    machine: String,
    transport: String,
    timeout: u64,
    agent_opts: Vec<String>,
}

fn parse_run_args(args: &[String]) -> Result<RunArgs> {
    let (ours, agent) = match args.iter().position(|a| a == "--") {
        Some(i) => (&args[..i], &args[i + 1..]),
        None => (args, &[][..]),
    };
    let mut r = RunArgs {
        vmm: "qemu".into(),
        machine: "microvm".into(),
        transport: "uart".into(),
        timeout: 3600,
        agent_opts: agent.to_vec(),
    };
    let mut it = ours.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--vmm" => r.vmm = value()?.clone(),
            "--machine" => r.machine = value()?.clone(),
            "--transport" => r.transport = value()?.clone(),
            "--timeout" => {
                r.timeout = value()?.parse().context("--timeout takes whole seconds")?;
            }
            other => bail!("run-agent: unknown option `{other}`\n\n{}", crate::HELP),
        }
    }
    if !matches!(r.vmm.as_str(), "qemu" | "builtin") {
        bail!("--vmm must be qemu or builtin, not `{}`", r.vmm);
    }
    if !matches!(r.transport.as_str(), "uart" | "vsock") {
        bail!("--transport must be uart or vsock, not `{}`", r.transport);
    }
    if !matches!(r.machine.as_str(), "microvm" | "q35") {
        bail!("--machine must be microvm or q35, not `{}`", r.machine);
    }
    Ok(r)
}

/// `cargo xtask run-agent [--vmm qemu|builtin] [--machine microvm|q35] [--timeout S]
/// [-- AGENT OPTIONS]`: builds the agent and boots it with COM1 on this terminal and COM2 (the
/// defmt log, decoded against the ELF by `vmtsync-tests`' `vmtsync-defmt` / `vmtsync-vmm`)
/// on stderr. Fails unless the guest ends through isa-debug-exit with code 0.
pub(crate) fn run_agent(args: &[String]) -> Result<()> {
    let r = parse_run_args(args)?;
    let elf = build()?;
    let append = r.agent_opts.join(" ");
    if r.transport == "vsock" {
        return run_vsock(&elf, &r);
    }
    match r.vmm.as_str() {
        "builtin" => {
            let mut c = cargo();
            c.args([
                "run",
                "-q",
                "-p",
                "vmtsync-tests",
                "--bin",
                "vmtsync-vmm",
                "--",
            ])
            .arg(&elf)
            .args(["--timeout", &r.timeout.to_string(), "--"])
            .args(&r.agent_opts);
            let status = run_interactive(&mut c)?;
            match status.code() {
                Some(0) => Ok(()),
                Some(code) => bail!("agent ended with code {code} (see vmtsync-vmm's exit codes)"),
                None => bail!("vmtsync-vmm was killed: {status}"),
            }
        }
        _ => {
            ensure_qemu()?;
            let machine = Machine::parse(&r.machine).context("--machine")?;
            // COM2 carries defmt frames: QEMU writes them to a file that `vmtsync-defmt`
            // follows, printing decoded lines to stderr until QEMU has exited.
            let dir =
                std::env::temp_dir().join(format!("vmtsync-run-agent-{}", std::process::id()));
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let com2 = dir.join("com2.defmt");
            std::fs::write(&com2, b"").with_context(|| format!("creating {}", com2.display()))?;
            let mut decoder = cargo();
            decoder
                .args([
                    "run",
                    "-q",
                    "-p",
                    "vmtsync-tests",
                    "--bin",
                    "vmtsync-defmt",
                    "--",
                ])
                .arg(&elf)
                .arg(&com2)
                .arg("--follow")
                .stdin(Stdio::piped())
                .stdout(Stdio::from(std::io::stderr()));
            eprintln!("$ {}", crate::display(&decoder));
            let mut decoder = ChildGuard::new(
                decoder
                    .spawn()
                    .context("could not start the COM2 decoder (vmtsync-defmt)")?,
            );
            let mut c = qemu::command(machine, &elf, &append, &com2);
            let status = run_bounded(&mut c, Duration::from_secs(r.timeout));
            // Closing its stdin tells the decoder the guest is gone: it prints the rest, exits.
            drop(decoder.child().stdin.take());
            let decoded = decoder.wait_timeout(Duration::from_secs(30));
            let _ = std::fs::remove_dir_all(&dir);
            let status = status?;
            if !decoded
                .context("waiting for vmtsync-defmt")?
                .is_some_and(|s| s.success())
            {
                bail!("vmtsync-defmt could not decode COM2 (see its message above)");
            }
            match status.code().map(qemu::debug_exit_code) {
                Some(Some(0)) => Ok(()),
                Some(Some(code)) => {
                    bail!("agent exited through isa-debug-exit with code {code:#x}")
                }
                _ => bail!("QEMU ended without isa-debug-exit: {status}"),
            }
        }
    }
}

/// `--transport vsock`: `vmtsync-tests`' `vmtsync-vsock` binary boots the agent under QEMU
/// (`--machine`: microvm with vhost-user-vsock-device, q35 with vhost-user-vsock-pci) and runs
/// a probe session over the agent's vsock connection.
fn run_vsock(elf: &Path, r: &RunArgs) -> Result<()> {
    let mut c = cargo();
    c.args([
        "run",
        "-q",
        "-p",
        "vmtsync-tests",
        "--bin",
        "vmtsync-vsock",
        "--",
    ])
    .arg(elf)
    .args(["--machine", &r.machine])
    .args(["--timeout", &r.timeout.min(600).to_string(), "--"])
    .args(&r.agent_opts);
    match run_interactive(&mut c)?.code() {
        Some(0) => Ok(()),
        Some(code) => bail!("vmtsync-vsock ended with code {code}"),
        None => bail!("vmtsync-vsock was killed"),
    }
}

fn run_interactive(c: &mut Command) -> Result<ExitStatus> {
    eprintln!("$ {}", crate::display(c));
    c.stdin(Stdio::inherit())
        .status()
        .with_context(|| format!("could not start `{}`", crate::display(c)))
}

/// Runs `c` interactively (stdin and COM1 on this terminal) for at most `limit`; past that it
/// is killed by its PID.
fn run_bounded(c: &mut Command, limit: Duration) -> Result<ExitStatus> {
    eprintln!("$ {}", crate::display(c));
    let child = c
        .stdin(Stdio::inherit())
        .spawn()
        .with_context(|| format!("could not start `{}`", crate::display(c)))?;
    let mut g = ChildGuard::new(child);
    match g.wait_timeout(limit)? {
        Some(s) => Ok(s),
        None => bail!("`{}` still ran after {limit:?}: killed", crate::display(c)),
    }
}

/// Makes sure QEMU runs: installs it with apt when missing and root, else says how.
fn ensure_qemu() -> Result<()> {
    Ok(vmtsync_launch::prereq::ensure_qemu()?)
}

/// Size of section `name` in a 64-bit little-endian ELF, read from its section headers.
pub(crate) fn section_size(elf: &Path, name: &str) -> Result<u64> {
    let b = std::fs::read(elf).with_context(|| format!("reading {}", elf.display()))?;
    parse_section_size(&b, name).with_context(|| format!("{}: no section {name}", elf.display()))
}

fn parse_section_size(b: &[u8], name: &str) -> Option<u64> {
    let u16_at = |o: usize| Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?));
    if b.get(..5)? != b"\x7fELF\x02" {
        return None;
    }
    let shoff = usize::try_from(u64_at(0x28)?).ok()?;
    let shentsize = usize::from(u16_at(0x3a)?);
    let shnum = usize::from(u16_at(0x3c)?);
    let shstrndx = usize::from(u16_at(0x3e)?);
    let sh = |i: usize| shoff.checked_add(i.checked_mul(shentsize)?);
    let strtab = usize::try_from(u64_at(sh(shstrndx)? + 0x18)?).ok()?;
    (0..shnum).find_map(|i| {
        let h = sh(i)?;
        let name_off = strtab.checked_add(usize::try_from(u32_at(h)?).ok()?)?;
        let rest = b.get(name_off..)?;
        let end = rest.iter().position(|&c| c == 0)?;
        (&rest[..end] == name.as_bytes()).then(|| u64_at(h + 0x20))?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ELF64 with sections ["", ".shstrtab", ".text"] and `.text` of size 0x1234.
    fn tiny_elf() -> Vec<u8> {
        let strtab = b"\0.shstrtab\0.text\0";
        let mut b = vec![0u8; 0x40];
        b[..5].copy_from_slice(b"\x7fELF\x02");
        let str_off = b.len();
        b.extend_from_slice(strtab);
        let shoff = b.len();
        b[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        b[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        b[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        b[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
        for (name, off, size) in [(0u32, 0u64, 0u64), (1, str_off as u64, 17), (11, 0, 0x1234)] {
            let mut h = [0u8; 64];
            h[..4].copy_from_slice(&name.to_le_bytes());
            h[0x18..0x20].copy_from_slice(&off.to_le_bytes());
            h[0x20..0x28].copy_from_slice(&size.to_le_bytes());
            b.extend_from_slice(&h);
        }
        b
    }

    #[test]
    fn finds_section_sizes_and_rejects_garbage() {
        let b = tiny_elf();
        assert_eq!(parse_section_size(&b, ".text"), Some(0x1234));
        assert_eq!(parse_section_size(&b, ".shstrtab"), Some(17));
        assert_eq!(parse_section_size(&b, ".data"), None);
        assert_eq!(parse_section_size(&b[..0x50], ".text"), None);
        assert_eq!(parse_section_size(b"not an elf", ".text"), None);
    }

    #[test]
    fn run_args_split_at_double_dash_and_validate() {
        let a = |v: &[&str]| v.iter().map(|s| (*s).to_string()).collect::<Vec<_>>();
        let r =
            parse_run_args(&a(&["--vmm", "builtin", "--", "exit=1", "skew=5,1,0"])).expect("valid");
        assert_eq!(r.vmm, "builtin");
        assert_eq!(r.machine, "microvm");
        assert_eq!(r.agent_opts, a(&["exit=1", "skew=5,1,0"]));
        assert!(parse_run_args(&a(&["--vmm", "xen"])).is_err());
        assert!(parse_run_args(&a(&["--machine", "pc"])).is_err());
        assert!(parse_run_args(&a(&["--timeout", "soon"])).is_err());
        assert!(parse_run_args(&a(&["--vmm"])).is_err());
        assert_eq!(
            parse_run_args(&a(&["--transport", "vsock"]))
                .expect("valid")
                .transport,
            "vsock"
        );
        assert!(parse_run_args(&a(&["--transport", "pci"])).is_err());
    }
}
