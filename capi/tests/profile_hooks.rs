//! The opt-in `-finstrument-functions` hooks (`vmtsync.c` built with `-DVMTSYNC_PROFILE_HOOKS`):
//! a small C program, all of it (the recorder's two files included) compiled with
//! `-finstrument-functions`, records every entry and exit of its own functions, in call order,
//! with the address gcc or clang passes, for every toolchain (4-byte addresses from `-m32`,
//! 8-byte ones from `-m64`). The host's reader drains the block and vmtsync-core's span decoder
//! reads each record. Nothing is recorded while `vmtsync_profile_rec` is NULL, and the
//! recorder's own functions are never instrumented (else the hooks would call themselves).

use std::path::PathBuf;
use std::process::Command;

use vmtsync::guestmem::{Drainer, FakeMemory, Location, find};
use vmtsync_capi::{source, usable_toolchains};
use vmtsync_core::recorder::span::{SpanRecord, decode};

/// `main` sets the hooks' recorder, calls `outer` (which calls `inner` twice) and `inner`,
/// clears the recorder, calls `inner` again (unrecorded), then prints the functions' addresses
/// and the block in hex.
const PROGRAM: &str = r#"
#include <stdio.h>
#include <stdint.h>
#include "vmtsync.h"

static VMTSYNC_DEFINE_STORAGE(block_, 1, 64);
static struct vmtsync_rec rec_;
static volatile int sink_;

__attribute__((noinline)) static void inner(int x) { sink_ += x; }
__attribute__((noinline)) static void outer(void) { inner(1); inner(2); }

int main(void) {
    size_t i;
    if (vmtsync_init(&rec_, block_, sizeof block_, 1, 64, VMTSYNC_MODE_STOP_WHEN_FULL) != 0)
        return 2;
    if (vmtsync_publish(&rec_, 5, 0, VMTSYNC_CLOCK_RAW_TSC, 0) != 0) return 3;
    vmtsync_profile_rec = &rec_;
    outer();
    inner(3);
    vmtsync_profile_rec = NULL;
    inner(4);
    printf("%llu %llu\n", (unsigned long long)(uintptr_t)outer,
           (unsigned long long)(uintptr_t)inner);
    for (i = 0; i < sizeof block_; i++) printf("%02x", block_[i]);
    printf("\n");
    return 0;
}
"#;

const AT: u64 = 0x4000_0040;

#[test]
fn instrumented_functions_record_their_entries_and_exits_in_order() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("capi-profile-hooks");
    std::fs::create_dir_all(&dir).unwrap();
    let prog = dir.join("hooks.c");
    std::fs::write(&prog, PROGRAM).unwrap();
    let src = source();
    let mut checked = 0;
    for t in usable_toolchains(&dir) {
        let exe = dir.join(format!("hooks-{}", t.name()));
        t.program(
            &[&prog, &src],
            &exe,
            &["-finstrument-functions", "-DVMTSYNC_PROFILE_HOOKS"],
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let out = Command::new(&exe).output().unwrap();
        assert!(out.status.success(), "{}: {:?}", t.name(), out.status);
        let text = String::from_utf8(out.stdout).unwrap();
        let mut lines = text.lines();
        let addrs: Vec<u64> = lines
            .next()
            .unwrap()
            .split_whitespace()
            .map(|a| a.parse().unwrap())
            .collect();
        let (outer, inner) = (addrs[0], addrs[1]);
        let hex = lines.next().unwrap();
        let image: Vec<u8> = (0..hex.len() / 2)
            .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
            .collect();

        let mut m = FakeMemory::new();
        m.map(AT - 0x40, 1 << 16, true);
        m.write(AT, &image);
        let found = find(&mut m, Location::Scan).expect("the C recorder's header");
        let mut d = Drainer::new(&found, 64);
        let mut got = Vec::new();
        while d.poll(&mut m, &mut |r| got.push(*r)).expect("drains").more {}
        let wide = t.abi == "-m64";
        let width = if wide { 16 } else { 8 };
        assert!(
            got.iter().all(|r| usize::from(r.len) == width),
            "{}: {width}-byte payloads",
            t.name()
        );
        let spans: Vec<SpanRecord> = got
            .iter()
            .map(|r| decode(r.id, r.payload()).expect("a function record"))
            .collect();
        let calls: Vec<(bool, u64)> = spans
            .iter()
            .map(|s| match *s {
                SpanRecord::Entry { func, .. } => (true, func),
                SpanRecord::Exit { func, .. } => (false, func),
                ref other => panic!("{}: not a function record: {other:?}", t.name()),
            })
            .collect();
        assert_eq!(
            calls,
            [
                (true, outer),
                (true, inner),
                (false, inner),
                (true, inner),
                (false, inner),
                (false, outer),
                (true, inner),
                (false, inner),
            ],
            "{}: entries and exits in call order (main's entry came before the recorder was set, \
             its exit and inner(4) after it was cleared)",
            t.name()
        );
        // Each exit carries its entry's function and call site (paired by a call stack).
        let mut stack = Vec::new();
        for s in &spans {
            match *s {
                SpanRecord::Entry { func, site } => {
                    assert_ne!(site, 0, "{}: a call site", t.name());
                    stack.push((func, site));
                }
                SpanRecord::Exit { func, site } => {
                    assert_eq!(stack.pop(), Some((func, site)), "{}", t.name());
                }
                _ => {}
            }
        }
        assert!(stack.is_empty(), "{}", t.name());
        let tscs: Vec<u64> = got.iter().map(|r| r.tsc).collect();
        assert!(tscs.windows(2).all(|w| w[0] <= w[1]), "{}", t.name());
        checked += 1;
    }
    eprintln!("{checked} toolchains checked");
}
