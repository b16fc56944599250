//! The Perfetto writing section: `cargo bench -p vmtsync --bench perfetto` (`push` with every
//! argument and with the host TSC only, `push` + `finish`) and the max RSS of
//! `examples/perfetto_write` at a small and a large event count.

use std::path::Path;

use anyhow::Result;

use super::writer::{Writer, section};
use super::{Plan, Section};

pub(super) fn perfetto(plan: &Plan, work: &Path) -> Result<Section> {
    section(
        plan,
        work,
        &Writer {
            bench: "perfetto",
            rows: &[
                (
                    "`push`, every argument (guest TSC, interval, payload: the JSON Lines case)",
                    "perfetto/push",
                ),
                (
                    "`push`, host TSC only (a pre-converted trace.dat)",
                    "perfetto/push_host_only",
                ),
                (
                    "`push` + `finish` (flush, fsync, rename)",
                    "perfetto/push_and_finish",
                ),
            ],
            goal_id: "perfetto/push",
            goal_what: "`push`, every argument",
            goal_claim: "Perfetto `push`, in-process (every argument)",
            example: "perfetto_write",
            out_arg: "OUT",
            one_file: true,
            rss_claim: "Perfetto writer max RSS",
        },
    )
}
