//! vmtsync's tier-2 test target: tests that need real KVM, QEMU, root, debugfs, tracefs or
//! trace-cmd. Tier-1 tests (pure logic, fixtures) are in the `it` target.
//!
//! The harness is libtest-mimic, so the command line is libtest's (filters, `--list`,
//! `--test-threads`, `--ignored`, `--exact`). Each module lists its tests with
//! [`trials!`], naming the prerequisite check they need (a `fn(&str) -> bool` built from
//! `vmtsync_tests::require`, such as `util::vm_ready`). The harness runs that check before
//! the test (`vmtsync_tests::gate`): when a prerequisite is missing the test is reported as
//! ignored, after a `SKIP <test>: <reason>` line, never as passed; under `CI=true` it is a
//! failure with the same reason. A prerequisite a test's body finds missing that its check
//! did not declare fails the test as well (`vmtsync_tests::set_gated`).

use libtest_mimic::{Arguments, Failed, Trial};

mod agent_events;
mod agent_qemu;
mod agent_vmm;
mod anchor;
mod anchor_putc;
mod attach;
mod c_guest;
mod c_guest_smp;
mod causality;
mod console;
mod ctf;
mod e2e;
mod firmware;
mod firmware_graph;
mod firmware_spans;
mod firmware_validate;
mod kvm_real;
mod memory_agent;
mod memory_drain;
mod memory_flight;
mod memory_outputs;
mod memory_reset;
mod minimal_kernel;
mod perf;
mod perfetto;
mod placement;
mod probe;
mod probe_bench;
mod record;
mod record_memory;
mod smoke;
mod smp;
mod span_outputs;
mod tracedat;
mod util;
mod validate;
mod validate_rules;
mod vsock;

/// Lists a module's tier-2 tests with the prerequisite check each needs: `trials!(check; a,
/// b)` defines the module's `trials()`, each test named `module::test` as libtest would; a
/// module whose tests need different checks lists one group per check, `trials!(check_a; a,
/// b; check_b; c)`.
#[macro_export]
macro_rules! trials {
    ($($check:path; $($test:ident),+ $(,)?);+ $(;)?) => {
        pub(crate) fn trials() -> Vec<libtest_mimic::Trial> {
            vec![$($($crate::trial(module_path!(), stringify!($test), $check, $test)),+),+]
        }
    };
}

/// One test as a trial: run as is when `check` holds; ignored with its reason printed when not
/// (off CI); failing with its reason under `CI=true`.
fn trial(module: &str, test: &str, check: fn(&str) -> bool, run: fn()) -> Trial {
    // `module_path!()` is `tier2::module`; libtest names a test `module::test`.
    let module = module.split_once("::").map_or(module, |(_, m)| m);
    let name = format!("{module}::{test}");
    match vmtsync_tests::gate(|| check(&name)) {
        Ok(()) => Trial::test(name, move || {
            run();
            Ok(())
        }),
        Err(reasons) if vmtsync_tests::is_ci() => {
            let why = format!("prerequisite missing under CI=true: {}", reasons.join("; "));
            Trial::test(name, move || Err(Failed::from(why)))
        }
        Err(reasons) => {
            eprintln!("SKIP {name}: {}", reasons.join("; "));
            Trial::test(name, || Ok(())).with_ignored_flag(true)
        }
    }
}

fn main() -> std::process::ExitCode {
    let args = Arguments::from_args();
    let trials: Vec<Trial> = [
        agent_events::trials(),
        agent_qemu::trials(),
        agent_vmm::trials(),
        anchor::trials(),
        anchor_putc::trials(),
        attach::trials(),
        c_guest::trials(),
        c_guest_smp::trials(),
        causality::trials(),
        console::trials(),
        ctf::trials(),
        e2e::trials(),
        firmware::trials(),
        firmware_graph::trials(),
        firmware_spans::trials(),
        firmware_validate::trials(),
        kvm_real::trials(),
        memory_agent::trials(),
        memory_drain::trials(),
        memory_flight::trials(),
        memory_outputs::trials(),
        memory_reset::trials(),
        minimal_kernel::trials(),
        perf::trials(),
        perfetto::trials(),
        placement::trials(),
        probe::trials(),
        probe_bench::trials(),
        record::trials(),
        record_memory::trials(),
        smoke::trials(),
        smp::trials(),
        span_outputs::trials(),
        tracedat::trials(),
        validate::trials(),
        validate_rules::trials(),
        vsock::trials(),
    ]
    .into_iter()
    .flatten()
    .collect();
    vmtsync_tests::set_gated();
    libtest_mimic::run(&args, trials).exit_code()
}
