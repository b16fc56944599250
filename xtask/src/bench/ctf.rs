//! The CTF writing section: `cargo bench -p vmtsync --bench ctf` (`push` only and `push` +
//! `finish`) and the max RSS of `examples/ctf_write` at a small and a large event count.

use std::path::Path;

use anyhow::Result;

use super::writer::{Writer, section};
use super::{Plan, Section};

pub(super) fn ctf(plan: &Plan, work: &Path) -> Result<Section> {
    section(
        plan,
        work,
        &Writer {
            bench: "ctf",
            rows: &[
                ("`push` only (packets written as they fill)", "ctf/push"),
                (
                    "`push` + `finish` (last packets, metadata, fsync, rename)",
                    "ctf/push_and_finish",
                ),
            ],
            goal_id: "ctf/push",
            goal_what: "`push`",
            goal_claim: "CTF `push`, in-process",
            example: "ctf_write",
            out_arg: "DIR",
            one_file: false,
            rss_claim: "CTF max RSS",
        },
    )
}
