//! The guest-memory reader (`vmtsync::guestmem`): arbitrary bytes as a VMM's memory, with
//! arbitrary guest stores between the reader's reads, then a scan and a few drain rounds.
//! A panic, a hang or unbounded memory is a crash, and so is a broken count: per ring,
//! delivered + overwritten + corrupt must equal the records the reader moved past, every
//! delivered record must have a payload of at most 16 bytes with zeros after it, and
//! indices must rise.
//!
//! Input: byte 0 picks the round bound (1..=16), byte 1 the number of stores (0..=7); then
//! 12 bytes per store (u32 offset into the image, u64 value), one store before each read;
//! the rest is the image, at the start of a writable mapping at 0x10000 (whole pages).
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmtsync::guestmem::{Drainer, FakeMemory, Location, find};

const BASE: u64 = 0x10000;

fuzz_target!(|data: &[u8]| {
    let [bound, stores, rest @ ..] = data else {
        return;
    };
    let stores = usize::from(stores % 8);
    let Some((store_bytes, image)) = rest.split_at_checked(stores * 12) else {
        return;
    };
    if image.is_empty() {
        return;
    }
    let mut m = FakeMemory::new();
    // Whole pages, as real mappings are: the scan reads page by page.
    m.map(BASE, image.len().next_multiple_of(4096), true);
    m.write(BASE, image);
    let len = image.len() as u64;
    let stores: Vec<(u64, u64)> = store_bytes
        .chunks_exact(12)
        .map(|c| {
            let off = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            let mut v = [0u8; 8];
            v.copy_from_slice(&c[4..12]);
            (u64::from(off), u64::from_le_bytes(v))
        })
        .collect();
    let mut i = 0;
    m.set_hook(Box::new(move |m| {
        if let Some(&(off, v)) = stores.get(i)
            && len >= 8
        {
            m.write_u64(BASE + (off % (len - 7)), v);
        }
        i += 1;
    }));
    let Ok(found) = find(&mut m, Location::Scan) else {
        return;
    };
    let mut d = Drainer::new(&found, usize::from(bound % 16) + 1);
    // Records each ring's sink saw: exactly what its delivered counter says, never more.
    let mut sunk: Vec<u64> = vec![0; found.header.vcpus as usize];
    for _ in 0..4 {
        let r = d.poll(&mut m, &mut |r| {
            assert!(r.len <= 16 && r.payload[usize::from(r.len)..].iter().all(|&b| b == 0));
            sunk[r.vcpu as usize] += 1;
        });
        let counts = match &r {
            Ok(_) => d.counts(),
            Err(e) => e.counts(),
        };
        for (c, &s) in counts.iter().zip(&sunk) {
            assert_eq!(
                u128::from(c.delivered) + u128::from(c.overwritten) + u128::from(c.corrupt),
                u128::from(c.next)
            );
            assert_eq!(
                c.delivered, s,
                "every delivered record reached the sink once"
            );
        }
        if r.is_err() {
            break;
        }
    }
});
