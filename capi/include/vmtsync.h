/*
 * vmtsync.h: the C ABI of vmtsync's in-memory event recorder and sync beacons
 * (libvmtsync_capi.a, built from capi/ for x86_64-unknown-none).
 *
 * Written by hand to match capi/src/lib.rs; `cargo test -p vmtsync-capi` compiles a C file
 * against it with gcc that checks every constant and the header struct's offsets against the
 * Rust values, so the two cannot drift apart silently. The byte layout the host reads is
 * docs/memory-layout.md's.
 *
 * Use: give vmtsync_recorder_init a 64-byte aligned buffer of VMTSYNC_STORAGE_BYTES(vcpus,
 * capacity) bytes, call vmtsync_publish once, then vmtsync_record / vmtsync_beacon on each
 * vCPU for its own ring only. Every function returns VMTSYNC_OK (0) or a negative
 * VMTSYNC_E* status.
 */
#ifndef VMTSYNC_H
#define VMTSYNC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Layout constants (layout version 1). */
#define VMTSYNC_MAGIC 0x474e495253544d56ULL /* "VMTSRING" as a little-endian u64 */
#define VMTSYNC_LAYOUT_VERSION 1
#define VMTSYNC_HEADER_SIZE 128
#define VMTSYNC_RING_HEADER_SIZE 128
#define VMTSYNC_SLOT_SIZE 32
#define VMTSYNC_MAX_PAYLOAD 16
#define VMTSYNC_MAX_VCPUS 1024
#define VMTSYNC_MIN_CAPACITY 2
#define VMTSYNC_MAX_CAPACITY (1ULL << 31)
#define VMTSYNC_BEACON_ID 0xFFFF
#define VMTSYNC_RESERVED_ID_MIN 0xFF00

/* Bytes a recorder of `vcpus` rings of `capacity` records needs, for a static buffer (the
 * shape must be valid; vmtsync_storage_bytes checks it). */
#define VMTSYNC_STORAGE_BYTES(vcpus, capacity)                                                 \
    (VMTSYNC_HEADER_SIZE +                                                                     \
     (size_t)(vcpus) * (VMTSYNC_RING_HEADER_SIZE + VMTSYNC_SLOT_SIZE * (size_t)(capacity)))

/* Modes and clocks. */
#define VMTSYNC_MODE_STOP_WHEN_FULL 0
#define VMTSYNC_MODE_OVERWRITE 1
#define VMTSYNC_CLOCK_RAW_TSC 0
#define VMTSYNC_CLOCK_OTHER 1

/* Status codes. */
#define VMTSYNC_OK 0
#define VMTSYNC_EBAD_SHAPE (-1)
#define VMTSYNC_ETOO_SMALL (-2)
#define VMTSYNC_EMISALIGNED (-3)
#define VMTSYNC_ENOT_INITIALISED (-4)
#define VMTSYNC_EINVALID (-5)
#define VMTSYNC_EFULL (-6)
#define VMTSYNC_EPAYLOAD_TOO_LONG (-7)
#define VMTSYNC_ENO_SUCH_VCPU (-8)
#define VMTSYNC_ENO_BEACON_PORT (-9)
#define VMTSYNC_ERESERVED_ID (-10)

/* The published header as it sits at the start of the buffer (for C code that reads one). */
struct vmtsync_header {
    uint64_t magic;
    uint32_t version;
    uint32_t header_size;
    uint64_t nonce;
    uint32_t vcpus;
    uint32_t slot_size;
    uint64_t capacity;
    uint64_t tsc_khz;
    uint32_t mode;
    uint32_t clock;
    uint64_t rings_offset;
    uint64_t ring_stride;
    uint16_t beacon_port;
    uint8_t reserved0[46];
    uint32_t checksum;
    uint32_t reserved1;
};

/* Bytes needed for `vcpus` rings of `capacity` records, or 0 for an invalid shape. */
size_t vmtsync_storage_bytes(uint32_t vcpus, uint64_t capacity);

/* Lays out an empty, unpublished recorder in `mem` (64-byte aligned, `len` bytes, owned by
 * the library from now on) and makes it the program's recorder. `mode`: VMTSYNC_MODE_*. */
int32_t vmtsync_recorder_init(void *mem, size_t len, uint32_t vcpus, uint64_t capacity,
                              uint32_t mode);

/* Writes the header, magic last. `nonce` 0: made here; `tsc_khz` 0: unknown; `clock`:
 * VMTSYNC_CLOCK_*; `beacon_port` 0: no beacons. */
int32_t vmtsync_publish(uint64_t nonce, uint64_t tsc_khz, uint32_t clock, uint16_t beacon_port);

/* Records event `id` (below VMTSYNC_RESERVED_ID_MIN) with up to 16 payload bytes on `vcpu`'s
 * ring, stamped with an ordered TSC read. Call it for a vCPU's ring from that vCPU only. */
int32_t vmtsync_record(uint32_t vcpu, uint16_t id, const void *data, size_t len);

/* Emits `vcpu`'s next sync beacon on the published beacon port (needs port I/O). */
int32_t vmtsync_beacon(uint32_t vcpu);

#ifdef __cplusplus
}
#endif

#endif /* VMTSYNC_H */
