/*
 * A freestanding C guest that links vmtsync's C ABI (libvmtsync_capi.a, include/vmtsync.h):
 * it lays out a recorder in its own memory, publishes the header, records N events (N from
 * the kernel command line's `events=N`, default 10000) with a sync beacon every 1000 and one
 * at each end, prints one summary line on COM1 and ends QEMU through isa-debug-exit with
 * code 0 when every call returned VMTSYNC_OK, 1 otherwise (with `hold` on the command line it
 * halts instead, for a host that reads its rings after it is done). Nothing else: no driver, no
 * transport; the host reads the rings out of guest memory.
 *
 * Built by vmtsync_launch::agent::build_guest(Guest::CGuest): gcc -ffreestanding -nostdlib.
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

static uint8_t storage[VMTSYNC_STORAGE_BYTES(1, CAPACITY)]
    __attribute__((aligned(64), section(".recorder")));

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

/* `events=N` from the PVH command line (hvm_start_info.cmdline_paddr at offset 24), else the
 * default. */
static uint32_t events_from_cmdline(const uint8_t *start_info) {
    uint64_t paddr = *(const uint64_t *)(start_info + 24);
    if (paddr == 0) {
        return DEFAULT_EVENTS;
    }
    const char *p = (const char *)(uintptr_t)paddr;
    static const char key[] = "events=";
    for (; *p; p++) {
        size_t k = 0;
        while (key[k] && p[k] == key[k]) {
            k++;
        }
        if (key[k] == 0 && (p == (const char *)(uintptr_t)paddr || p[-1] == ' ')) {
            uint64_t n = 0;
            const char *d = p + k;
            while (*d >= '0' && *d <= '9' && n < 0xffffffffu) {
                n = n * 10 + (uint64_t)(*d++ - '0');
            }
            return n > 0 && n <= CAPACITY ? (uint32_t)n : DEFAULT_EVENTS;
        }
    }
    return DEFAULT_EVENTS;
}

/* Whether the PVH command line holds the word `hold`: then the guest halts when done instead
 * of ending QEMU, so a host can still read its rings out of its memory. */
static int hold_from_cmdline(const uint8_t *start_info) {
    uint64_t paddr = *(const uint64_t *)(start_info + 24);
    if (paddr == 0) {
        return 0;
    }
    const char *line = (const char *)(uintptr_t)paddr;
    static const char key[] = "hold";
    for (const char *p = line; *p; p++) {
        size_t k = 0;
        while (key[k] && p[k] == key[k]) {
            k++;
        }
        if (key[k] == 0 && (p == line || p[-1] == ' ') && (p[k] == 0 || p[k] == ' ')) {
            return 1;
        }
    }
    return 0;
}

void c_main(const uint8_t *start_info) {
    uint32_t n = events_from_cmdline(start_info);
    int32_t first_error = VMTSYNC_OK;
    uint32_t failed = 0, recorded = 0, beacons = 0;
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

    CHECK(vmtsync_storage_bytes(1, CAPACITY) == sizeof storage ? VMTSYNC_OK : VMTSYNC_EINVALID);
    CHECK(vmtsync_recorder_init(storage, sizeof storage, 1, CAPACITY,
                                VMTSYNC_MODE_STOP_WHEN_FULL));
    /* nonce 0: the library makes one; TSC kHz unknown; the records hold the raw TSC. */
    CHECK(vmtsync_publish(0, 0, VMTSYNC_CLOCK_RAW_TSC, BEACON_PORT));
    CHECK(vmtsync_beacon(0));
    beacons++;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t seq = i;
        int32_t s = vmtsync_record(0, EVENT_ID, &seq, sizeof seq);
        CHECK(s);
        recorded += s == VMTSYNC_OK;
        if ((i + 1) % BEACON_EVERY == 0) {
            CHECK(vmtsync_beacon(0));
            beacons++;
        }
    }
    CHECK(vmtsync_beacon(0));
    beacons++;

    const struct vmtsync_header *h = (const struct vmtsync_header *)storage;
    puts_com1("c-guest: recorder at 0x");
    putu((uint64_t)(uintptr_t)storage, 16);
    puts_com1(" magic 0x");
    putu(h->magic, 16);
    puts_com1(" nonce 0x");
    putu(h->nonce, 16);
    puts_com1(" events ");
    putu(recorded, 10);
    puts_com1(" beacons ");
    putu(beacons, 10);
    puts_com1(" failed ");
    putu(failed, 10);
    if (failed != 0) {
        puts_com1(" first error -");
        putu((uint64_t)(-(int64_t)first_error), 10);
    }
    puts_com1("\n");
    if (hold_from_cmdline(start_info)) {
        /* Interrupts stay off (the PVH entry never enables them): the vCPU halts for good
         * and QEMU keeps the guest's memory until it is killed. */
        for (;;) {
            __asm__ volatile("cli; hlt");
        }
    }
    outb(DEBUG_EXIT, failed == 0 ? 0 : 1);
}
