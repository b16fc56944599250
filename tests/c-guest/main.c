/*
 * A freestanding C guest built with vmtsync's C recorder (capi/include/vmtsync.h and
 * capi/src/vmtsync.c, compiled in as they are): it lays out a recorder in its own memory, publishes the header, records N events (N from
 * the kernel command line's `events=N`, default 10000) with a sync beacon every 1000 and one
 * at each end, prints one summary line on COM1 and ends QEMU through isa-debug-exit with
 * code 0 when every call returned VMTSYNC_OK, 1 otherwise (with `hold` on the command line it
 * spins instead, for a host that reads its rings after it is done). Nothing else: no driver, no
 * transport; the host reads the rings out of guest memory.
 *
 * Options for benchmarks (cargo xtask bench's memory section), all on the command line:
 * - `ring=N`: N records per ring (a power of two, VMTSYNC_MIN_CAPACITY..2^31) in RAM from
 *   RING_BASE instead of the built-in 32,768-record buffer; `events=N` may then exceed the
 *   ring (up to 2^32-1).
 *   The guest checks the ring lies inside a RAM entry of the PVH memory map and below the
 *   1 GiB entry.S maps, and fails (`failed 1 first error -5`) otherwise.
 * - `flight`: the ring overwrites its oldest records instead of refusing new ones.
 * - `rate=R`: R events per second, paced by the TSC (event i is recorded once the TSC passes
 *   the first event's TSC + i * tsc_khz * 1000 / R); needs `tsc_khz=K` (the host's TSC rate,
 *   which the guest's TSC runs at), else the run fails with VMTSYNC_EINVALID.
 * - `tsc_khz=K`: also published in the header.
 * A full stop-when-full ring refuses events and beacons (VMTSYNC_EFULL): those are counted
 * as `refused` on the summary line, not as failed calls. The line also carries `tsc0` and `tsc1`, TSC
 * reads right before the first event and right after the last, in hex.
 *
 * Built by vmtsync_launch::agent::build_guest(Guest::CGuest): gcc -ffreestanding -nostdlib,
 * with capi/src/vmtsync.c as one more source file.
 */
#include <stddef.h>
#include <stdint.h>

#include "vmtsync.h"

/* Records per ring: a power of two above the largest default run, so stop-when-full keeps
 * every event of a run up to this many. */
#define CAPACITY 32768u
/* The sync port of the beacons (an unused port, the one the agent's tests use). */
#define BEACON_PORT 0x2400
/* The event id of the workload's events; below VMTSYNC_RESERVED_ID_MIN. */
#define EVENT_ID 0x0C01
#define BEACON_EVERY 1000u
#define DEFAULT_EVENTS 10000u
#define COM1 0x3f8
#define DEBUG_EXIT 0xf4
/* Where a `ring=N` recorder starts: guest-physical 16 MiB, above the image and its buffers. */
#define RING_BASE 0x1000000ull
/* The end of what entry.S identity-maps. */
#define MAPPED_END 0x40000000ull
/* hvm_memmap_table_entry's type for RAM. */
#define E820_RAM 1u

static VMTSYNC_DEFINE_STORAGE(storage, 1, CAPACITY) __attribute__((section(".recorder")));
/* The recorder's handle. */
static struct vmtsync_rec rec;

static inline void outb(uint16_t port, uint8_t v) {
    __asm__ volatile("outb %0, %1" : : "a"(v), "Nd"(port));
}

static inline uint8_t inb(uint16_t port) {
    uint8_t v;
    __asm__ volatile("inb %1, %0" : "=a"(v) : "Nd"(port));
    return v;
}

static void putc_com1(char c) {
    /* Wait for the transmit holding register to be empty (LSR bit 5). */
    while ((inb(COM1 + 5) & 0x20) == 0) {
    }
    outb(COM1, (uint8_t)c);
}

static void puts_com1(const char *s) {
    while (*s) {
        putc_com1(*s++);
    }
}

static void putu(uint64_t v, unsigned base) {
    char buf[24];
    int i = 0;
    do {
        unsigned d = (unsigned)(v % base);
        buf[i++] = (char)(d < 10 ? '0' + d : 'a' + d - 10);
        v /= base;
    } while (v != 0);
    while (i > 0) {
        putc_com1(buf[--i]);
    }
}

/* The PVH command line (hvm_start_info.cmdline_paddr at offset 24), or NULL. */
static const char *cmdline(const uint8_t *start_info) {
    uint64_t paddr = *(const uint64_t *)(start_info + 24);
    return paddr == 0 ? NULL : (const char *)(uintptr_t)paddr;
}

/* Where the word `key` (a whole word, or followed by `=` when `key` ends in `=`) starts on
 * the command line, or NULL. */
static const char *option(const uint8_t *start_info, const char *key) {
    const char *line = cmdline(start_info);
    if (line == NULL) {
        return NULL;
    }
    size_t len = 0;
    while (key[len]) {
        len++;
    }
    int value = len > 0 && key[len - 1] == '=';
    for (const char *p = line; *p; p++) {
        size_t k = 0;
        while (k < len && p[k] == key[k]) {
            k++;
        }
        if (k == len && (p == line || p[-1] == ' ') && (value || p[k] == 0 || p[k] == ' ')) {
            return p + len;
        }
    }
    return NULL;
}

/* The decimal value of `key=` (`key` ends in `=`): 0 when absent, not a number, or above
 * `max`; `*given` says whether the key was there. */
static uint64_t number(const uint8_t *start_info, const char *key, uint64_t max, int *given) {
    const char *d = option(start_info, key);
    *given = d != NULL;
    if (d == NULL) {
        return 0;
    }
    uint64_t n = 0;
    const char *first = d;
    while (*d >= '0' && *d <= '9') {
        if (n > (max - (uint64_t)(*d - '0')) / 10) {
            return 0;
        }
        n = n * 10 + (uint64_t)(*d++ - '0');
    }
    return d == first || (*d != 0 && *d != ' ') ? 0 : n;
}

/* Whether [start, start + len) lies inside one RAM entry of the PVH memory map
 * (hvm_start_info version >= 1: memmap_paddr at 40, memmap_entries at 48; entries of 24 bytes:
 * addr, size, type). */
static int in_ram(const uint8_t *start_info, uint64_t start, uint64_t len) {
    uint32_t version = *(const uint32_t *)(start_info + 4);
    uint64_t map = *(const uint64_t *)(start_info + 40);
    uint32_t entries = *(const uint32_t *)(start_info + 48);
    if (version < 1 || map == 0) {
        return 0;
    }
    for (uint32_t i = 0; i < entries; i++) {
        const uint8_t *e = (const uint8_t *)(uintptr_t)(map + 24ull * i);
        uint64_t addr = *(const uint64_t *)e;
        uint64_t size = *(const uint64_t *)(e + 8);
        uint32_t type = *(const uint32_t *)(e + 16);
        if (type == E820_RAM && addr <= start && start - addr <= size && len <= size - (start - addr)) {
            return 1;
        }
    }
    return 0;
}

static inline uint64_t rdtsc(void) {
    uint32_t lo, hi;
    __asm__ volatile("lfence; rdtsc" : "=a"(lo), "=d"(hi));
    return ((uint64_t)hi << 32) | lo;
}

void c_main(const uint8_t *start_info) {
    int32_t first_error = VMTSYNC_OK;
    uint32_t failed = 0, recorded = 0, refused = 0, beacons = 0;
#define CHECK(call)                                                                            \
    do {                                                                                       \
        int32_t s_ = (call);                                                                   \
        if (s_ != VMTSYNC_OK) {                                                                \
            failed++;                                                                          \
            if (first_error == VMTSYNC_OK) {                                                   \
                first_error = s_;                                                              \
            }                                                                                  \
        }                                                                                      \
    } while (0)
    /* A beacon a full ring refuses counts as refused, as an event does. */
#define BEACON()                                                                               \
    do {                                                                                       \
        int32_t b_ = vmtsync_beacon(&rec, 0);                                                        \
        if (b_ == VMTSYNC_EFULL) {                                                             \
            refused++;                                                                         \
        } else {                                                                               \
            CHECK(b_);                                                                         \
            beacons += b_ == VMTSYNC_OK;                                                       \
        }                                                                                      \
    } while (0)

    int given_ring, given_events, given_rate, given_khz;
    uint64_t ring = number(start_info, "ring=", VMTSYNC_MAX_CAPACITY, &given_ring);
    uint64_t events = number(start_info, "events=", 0xffffffffu, &given_events);
    uint64_t rate = number(start_info, "rate=", 1000000000u, &given_rate);
    uint64_t tsc_khz = number(start_info, "tsc_khz=", 100000000u, &given_khz);
    int flight = option(start_info, "flight") != NULL;
    int hold = option(start_info, "hold") != NULL;

    uint8_t *mem = storage;
    uint64_t capacity = CAPACITY;
    /* Without `ring=`, `events=N` above the built-in ring falls back to the default (as
     * before these options existed). */
    uint64_t n = events > 0 && events <= CAPACITY ? events : DEFAULT_EVENTS;
    if (given_ring) {
        capacity = ring;
        size_t bytes = vmtsync_storage_bytes(1, (uint32_t)capacity);
        int fits = bytes != 0 && RING_BASE + bytes <= MAPPED_END &&
                   in_ram(start_info, RING_BASE, bytes);
        CHECK(fits ? VMTSYNC_OK : VMTSYNC_EINVALID);
        mem = fits ? (uint8_t *)(uintptr_t)RING_BASE : NULL;
        n = given_events ? events : DEFAULT_EVENTS;
    }
    /* A rate needs the TSC's: the period in ticks, 0 for as fast as possible. */
    uint64_t period = 0;
    if (given_rate) {
        CHECK(rate != 0 && tsc_khz != 0 ? VMTSYNC_OK : VMTSYNC_EINVALID);
        period = rate != 0 ? tsc_khz * 1000u / rate : 0;
    }

    uint64_t tsc0 = 0, tsc1 = 0;
    if (failed == 0) {
        size_t bytes = vmtsync_storage_bytes(1, (uint32_t)capacity);
        CHECK(bytes != 0 && (mem != storage || bytes == sizeof storage) ? VMTSYNC_OK
                                                                       : VMTSYNC_EINVALID);
        CHECK(vmtsync_init(&rec, mem, bytes, 1, (uint32_t)capacity,
                           flight ? VMTSYNC_MODE_OVERWRITE : VMTSYNC_MODE_STOP_WHEN_FULL));
        /* nonce 0: the library makes one; the records hold the raw TSC. */
        CHECK(vmtsync_publish(&rec, 0, tsc_khz, VMTSYNC_CLOCK_RAW_TSC, BEACON_PORT));
        BEACON();
        tsc0 = rdtsc();
        uint64_t next = tsc0;
        for (uint64_t i = 0; i < n; i++) {
            if (period != 0) {
                while (rdtsc() < next) {
                }
                next += period;
            }
            uint64_t seq = i;
            int32_t s = vmtsync_record(&rec, 0, EVENT_ID, &seq, sizeof seq);
            if (s == VMTSYNC_EFULL) {
                refused++;
            } else {
                CHECK(s);
            }
            recorded += s == VMTSYNC_OK;
            if ((i + 1) % BEACON_EVERY == 0) {
                BEACON();
            }
        }
        tsc1 = rdtsc();
        BEACON();
    }

    const struct vmtsync_header *h = (const struct vmtsync_header *)mem;
    puts_com1("c-guest: recorder at 0x");
    putu((uint64_t)(uintptr_t)mem, 16);
    puts_com1(" magic 0x");
    putu(mem != NULL ? h->magic : 0, 16);
    puts_com1(" nonce 0x");
    putu(mem != NULL ? h->nonce : 0, 16);
    puts_com1(" events ");
    putu(recorded, 10);
    puts_com1(" refused ");
    putu(refused, 10);
    puts_com1(" beacons ");
    putu(beacons, 10);
    puts_com1(" tsc0 0x");
    putu(tsc0, 16);
    puts_com1(" tsc1 0x");
    putu(tsc1, 16);
    puts_com1(" failed ");
    putu(failed, 10);
    if (failed != 0) {
        puts_com1(" first error -");
        putu((uint64_t)(-(int64_t)first_error), 10);
    }
    puts_com1("\n");
    if (hold) {
        /* Ring 3 cannot halt (entry.S): the vCPU spins, and QEMU keeps the guest's memory
         * until it is killed. */
        for (;;) {
            __asm__ volatile("pause");
        }
    }
    outb(DEBUG_EXIT, failed == 0 ? 0 : 1);
}
