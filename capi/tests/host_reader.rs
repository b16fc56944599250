//! The host's reader (`vmtsync::guestmem`: find the header, drain the rings) on memory the C
//! recorder wrote, built by every toolchain: every record comes back exactly, with exact
//! counts, also when the block held a previous boot's records and `VMTSYNC_KEEP_SLOTS` left
//! them in the slots.

use std::path::PathBuf;
use std::process::Command;

use vmtsync::guestmem::{Drainer, FakeMemory, GuestRecord, Location, find};
use vmtsync_capi::usable_toolchains;

/// The C side: a block of 2 rings of 8 records (flight mode) pre-filled with a previous boot's
/// records (ids 0x7777, stamps of indices 0..8), then laid out, published and recorded into:
/// 3 events on vCPU 0, 11 on vCPU 1, each payload its event number. Prints the block in hex.
const PROGRAM: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static unsigned long long fake_tsc = 5000;
#define VMTSYNC_READ_TSC() (fake_tsc += 10)
#include "vmtsync.c"

int main(void) {
    size_t len = VMTSYNC_STORAGE_BYTES(2, 8), i, v;
    unsigned char *block = aligned_alloc(64, len);
    struct vmtsync_rec r;
    unsigned long long n;
    if (block == NULL) return 2;
    memset(block, 0xa5, len);
    for (v = 0; v < 2; v++) {
        for (i = 0; i < 8; i++) {
            unsigned long long meta = (unsigned long long)(i + 1) << 25 | 16u << 16 | 0x7777u;
            memcpy(block + 128 + v * (128 + 32 * 8) + 128 + 32 * i, &meta, 8);
        }
    }
    if (vmtsync_init(&r, block, len, 2, 8, VMTSYNC_MODE_OVERWRITE) != 0) return 3;
    if (vmtsync_publish(&r, 77, 0, VMTSYNC_CLOCK_RAW_TSC, 0) != 0) return 4;
    for (n = 0; n < 3; n++) if (vmtsync_record(&r, 0, 0x0101, &n, sizeof n) != 0) return 5;
    for (n = 0; n < 11; n++) if (vmtsync_record(&r, 1, 0x0202, &n, sizeof n) != 0) return 6;
    for (i = 0; i < len; i++) printf("%02x", block[i]);
    return 0;
}
"#;

const AT: u64 = 0x4000_0040;

/// A ring's (delivered, overwritten, corrupt, refused, beacons).
type Counts = (u64, u64, u64, u64, u64);

fn drain(image: &[u8]) -> (Vec<GuestRecord>, Vec<Counts>) {
    let mut m = FakeMemory::new();
    m.map(AT - 0x40, 1 << 16, true);
    m.write(AT, image);
    let found = find(&mut m, Location::Scan).expect("the C recorder's header");
    assert_eq!(found.addr, AT);
    let mut d = Drainer::new(&found, 64);
    let mut got = Vec::new();
    while d.poll(&mut m, &mut |r| got.push(*r)).expect("drains").more {}
    let counts = d
        .counts()
        .iter()
        .map(|c| (c.delivered, c.overwritten, c.corrupt, c.refused, c.beacons))
        .collect();
    (got, counts)
}

#[test]
fn the_host_reads_exactly_what_the_c_recorder_wrote() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("capi-host-reader");
    std::fs::create_dir_all(&dir).unwrap();
    let prog = dir.join("image.c");
    std::fs::write(&prog, PROGRAM).unwrap();
    for t in usable_toolchains(&dir) {
        for keep in [false, true] {
            let exe = dir.join(format!("image-{}-{keep}", t.name()));
            let extra: &[&str] = if keep { &["-DVMTSYNC_KEEP_SLOTS"] } else { &[] };
            t.program(&[&prog], &exe, extra)
                .unwrap_or_else(|e| panic!("{e}"));
            let out = Command::new(&exe).output().unwrap();
            assert!(out.status.success(), "{}: {:?}", t.name(), out.status);
            let hex = String::from_utf8(out.stdout).unwrap();
            let image: Vec<u8> = (0..hex.len() / 2)
                .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
                .collect();
            let (got, counts) = drain(&image);
            let what = format!("{} keep_slots={keep}", t.name());
            // vCPU 0: all 3. vCPU 1: 11 records in 8 slots; the reader vouches for the newest
            // 7 (the oldest one's slot is the next to be written), so 4 are overwritten.
            assert_eq!(counts, [(3, 0, 0, 0, 0), (7, 4, 0, 0, 0)], "{what}");
            let mut tsc = 5000u64;
            let mut want = Vec::new();
            for (vcpu, id, n) in (0..3)
                .map(|n: u64| (0u32, 0x0101u16, n))
                .chain((0..11).map(|n: u64| (1u32, 0x0202u16, n)))
            {
                tsc += 10;
                if vcpu == 0 || n >= 4 {
                    // The payload is the record's number in its ring.
                    want.push((vcpu, id, tsc, n.to_le_bytes().to_vec()));
                }
            }
            let got: Vec<_> = got
                .iter()
                .map(|r| (r.vcpu, r.id, r.tsc, r.payload().to_vec()))
                .collect();
            assert_eq!(got, want, "{what}");
        }
    }
}
