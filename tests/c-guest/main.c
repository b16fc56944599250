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
 * - `smp=N`: record on N vCPUs (1..QEMU's -smp count). Without it, every vCPU QEMU's fw_cfg
 *   reports (FW_CFG_NB_CPUS; 1 without fw_cfg): `-smp 1` is the single-vCPU guest as before.
 *   With N > 1 the BSP starts the APs (INIT-SIPI-SIPI from ring 3 through the xAPIC, the
 *   trampoline in entry.S) and each vCPU records the same run (`events=`, `rate=`, paced by
 *   its own TSC, beacons on its own ring) on its own ring of the one recorder (ring = APIC
 *   id; `ring=N` is then N records per ring), in ring 3 with IOPL 3. The BSP waits for every
 *   AP to finish, parks them with an INIT IPI and prints one line per vCPU (`c-guest vcpu V:
 *   events ... failed F`) before the summary line, whose counts are then the sums over the
 *   vCPUs (tsc0 the earliest, tsc1 the latest) and which ends with `vcpus N`. An AP that
 *   never checked in or never finished counts as a failed call with error -100. With `smp=N`
 *   below QEMU's count the other APs start too (the IPIs go to all) and spin in ring 3 until
 *   that INIT parks them.
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
/* vCPUs served at most: the BSP and entry.S's MAX_APS application processors. */
#define MAX_VCPUS 8u
/* Where the APs' real-mode trampoline is copied: page 0x08, the start-up IPI's vector. */
#define AP_TRAMPOLINE 0x8000u
#define SIPI_VECTOR 0x08u
/* The xAPIC (its base MSR's reset value) and its registers. */
#define APIC_BASE 0xfee00000ull
#define APIC_ID 0x20u
#define APIC_SVR 0xf0u
#define APIC_ICR_LOW 0x300u
#define APIC_ICR_HIGH 0x310u
/* ICR: "all excluding self" shorthand; INIT (level assert), start-up with the vector. */
#define ICR_INIT_OTHERS 0x000c4500u
#define ICR_SIPI_OTHERS (0x000c4600u | SIPI_VECTOR)
/* QEMU fw_cfg's I/O selector and data ports, and the keys read. */
#define FW_CFG_SELECTOR 0x510
#define FW_CFG_DATA 0x511
#define FW_CFG_SIGNATURE 0x0000
#define FW_CFG_NB_CPUS 0x0005
/* This guest's own status (not a VMTSYNC_E* code): an AP that never checked in, or did not
 * finish its run in time. */
#define GUEST_ETIMEOUT (-100)

/* The built-in recorder: room for MAX_VCPUS rings of CAPACITY records (one vCPU uses the
 * first ring's worth). */
static VMTSYNC_DEFINE_STORAGE(storage, MAX_VCPUS, CAPACITY) __attribute__((section(".recorder")));
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

static inline void outw(uint16_t port, uint16_t v) {
    __asm__ volatile("outw %0, %1" : : "a"(v), "Nd"(port));
}

static inline void pause(void) {
    __asm__ volatile("pause" ::: "memory");
}

/* This vCPU's APIC id, from its local APIC's ID register (xAPIC: bits 31:24): its ring. QEMU
 * numbers -smp N's vCPUs 0..N-1, the BSP 0. Not CPUID.1:EBX[31:24], the "initial APIC id":
 * under nested KVM on an AMD host it was 1 in about half the boots of a -smp 1 guest (the
 * same value all boot long), while the ID register, which KVM's local APIC holds, said 0
 * (docs/host-quirks.md). */
static uint32_t apic_id(void) {
    return *(volatile uint32_t *)(uintptr_t)(APIC_BASE + APIC_ID) >> 24;
}

/* The vCPU count from QEMU's fw_cfg (FW_CFG_NB_CPUS, checked by its "QEMU" signature), or 1
 * without fw_cfg. Port I/O from ring 3 (IOPL 3). */
static uint32_t fw_cfg_cpus(void) {
    static const char sig[4] = {'Q', 'E', 'M', 'U'};
    outw(FW_CFG_SELECTOR, FW_CFG_SIGNATURE);
    for (int i = 0; i < 4; i++) {
        if (inb(FW_CFG_DATA) != (uint8_t)sig[i]) {
            return 1;
        }
    }
    outw(FW_CFG_SELECTOR, FW_CFG_NB_CPUS);
    uint32_t n = inb(FW_CFG_DATA);
    n |= (uint32_t)inb(FW_CFG_DATA) << 8;
    return n == 0 ? 1 : n;
}

/* Writes the local APIC's register at `off` (entry.S maps its page, user-accessible). */
static void apic_write(uint32_t off, uint32_t v) {
    *(volatile uint32_t *)(uintptr_t)(APIC_BASE + off) = v;
}

/* Sends an IPI to every other vCPU ("all excluding self"): INIT or start-up. */
static void ipi_others(uint32_t icr) {
    apic_write(APIC_ICR_HIGH, 0);
    apic_write(APIC_ICR_LOW, icr);
}

static void wait_ticks(uint64_t ticks) {
    uint64_t t0 = rdtsc();
    while (rdtsc() - t0 < ticks) {
        pause();
    }
}

/* One vCPU's results, written by that vCPU only (`present` and `done` published last, with
 * release stores; the BSP reads them with acquire loads). 64-byte aligned: no shared lines. */
struct tally {
    uint32_t failed, recorded, refused, beacons;
    int32_t first_error;
    uint32_t present, done;
    uint64_t tsc0, tsc1;
} __attribute__((aligned(64)));

static struct tally tallies[MAX_VCPUS];
/* Set by the BSP once every AP checked in: all vCPUs start recording. */
static uint32_t go;
/* The run every vCPU records, written by the BSP before it starts the APs. */
static uint64_t run_events, run_period;
static uint32_t run_vcpus;

static void fail(struct tally *t, int32_t s) {
    t->failed++;
    if (t->first_error == VMTSYNC_OK) {
        t->first_error = s;
    }
}

static void check(struct tally *t, int32_t s) {
    if (s != VMTSYNC_OK) {
        fail(t, s);
    }
}

/* A beacon a full ring refuses counts as refused, as an event does. */
static void beacon(struct tally *t, uint32_t vcpu) {
    int32_t b = vmtsync_beacon(&rec, vcpu);
    if (b == VMTSYNC_EFULL) {
        t->refused++;
    } else {
        check(t, b);
        t->beacons += b == VMTSYNC_OK;
    }
}

/* `n` events on ring `vcpu`, one every `period` TSC ticks (0: as fast as possible), with a
 * beacon before the first, after every BEACON_EVERY and after the last. */
static void record_run(struct tally *t, uint32_t vcpu, uint64_t n, uint64_t period) {
    beacon(t, vcpu);
    t->tsc0 = rdtsc();
    uint64_t next = t->tsc0;
    for (uint64_t i = 0; i < n; i++) {
        if (period != 0) {
            while (rdtsc() < next) {
            }
            next += period;
        }
        uint64_t seq = i;
        int32_t s = vmtsync_record(&rec, vcpu, EVENT_ID, &seq, sizeof seq);
        if (s == VMTSYNC_EFULL) {
            t->refused++;
        } else {
            check(t, s);
        }
        t->recorded += s == VMTSYNC_OK;
        if ((i + 1) % BEACON_EVERY == 0) {
            beacon(t, vcpu);
        }
    }
    t->tsc1 = rdtsc();
    beacon(t, vcpu);
}

/* An application processor, in ring 3 from entry.S's ap_user_entry: check in on its own
 * tally, wait for the start, record the run on its own ring, report done. It then returns
 * to entry.S's `pause` loop, where the BSP's INIT parks it. */
void c_ap_main(uint32_t index) {
    (void)index;
    uint32_t id = apic_id();
    uint32_t vcpus = __atomic_load_n(&run_vcpus, __ATOMIC_ACQUIRE);
    if (id == 0 || id >= vcpus) {
        return;
    }
    struct tally *t = &tallies[id];
    __atomic_store_n(&t->present, 1, __ATOMIC_RELEASE);
    while (!__atomic_load_n(&go, __ATOMIC_ACQUIRE)) {
        pause();
    }
    record_run(t, id, run_events, run_period);
    __atomic_store_n(&t->done, 1, __ATOMIC_RELEASE);
}

/* Starts the APs (INIT, then two start-up IPIs, 10 ms apart, as the MP start-up protocol
 * asks) and waits up to a second for vCPUs 1..vcpus-1 to check in. */
static void start_aps(uint32_t vcpus, uint64_t ms) {
    extern const uint8_t ap_trampoline[], ap_trampoline_end[];
    volatile uint8_t *dst = (volatile uint8_t *)(uintptr_t)AP_TRAMPOLINE;
    for (const uint8_t *p = ap_trampoline; p < ap_trampoline_end; p++) {
        *dst++ = *p;
    }
    __atomic_store_n(&run_vcpus, vcpus, __ATOMIC_RELEASE);
    /* The BSP's APIC software-enabled (spurious vector 0xff), to send IPIs. */
    apic_write(APIC_SVR, 0x1ff);
    ipi_others(ICR_INIT_OTHERS);
    wait_ticks(10 * ms);
    ipi_others(ICR_SIPI_OTHERS);
    wait_ticks(10 * ms);
    ipi_others(ICR_SIPI_OTHERS);
    uint64_t t0 = rdtsc();
    for (uint32_t v = 1; v < vcpus;) {
        if (__atomic_load_n(&tallies[v].present, __ATOMIC_ACQUIRE)) {
            v++;
        } else if (rdtsc() - t0 > 1000 * ms) {
            break;
        } else {
            pause();
        }
    }
}

static void put_tally(const struct tally *t) {
    const struct {
        const char *label;
        uint64_t value;
        unsigned base;
    } fields[] = {
        {" events ", t->recorded, 10}, {" refused ", t->refused, 10},
        {" beacons ", t->beacons, 10}, {" tsc0 0x", t->tsc0, 16},
        {" tsc1 0x", t->tsc1, 16},     {" failed ", t->failed, 10},
    };
    for (unsigned i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        puts_com1(fields[i].label);
        putu(fields[i].value, fields[i].base);
    }
    if (t->failed != 0) {
        puts_com1(" first error -");
        putu((uint64_t)(-(int64_t)t->first_error), 10);
    }
}

void c_main(const uint8_t *start_info) {
    struct tally *t = &tallies[0];
    int given_ring, given_events, given_rate, given_khz, given_smp;
    uint64_t ring = number(start_info, "ring=", VMTSYNC_MAX_CAPACITY, &given_ring);
    uint64_t events = number(start_info, "events=", 0xffffffffu, &given_events);
    uint64_t rate = number(start_info, "rate=", 1000000000u, &given_rate);
    uint64_t tsc_khz = number(start_info, "tsc_khz=", 100000000u, &given_khz);
    uint64_t smp = number(start_info, "smp=", MAX_VCPUS, &given_smp);
    int flight = option(start_info, "flight") != NULL;
    int hold = option(start_info, "hold") != NULL;

    /* vCPUs: QEMU's -smp N (fw_cfg), or `smp=N` of those. */
    uint32_t machine_cpus = fw_cfg_cpus();
    uint32_t vcpus = machine_cpus;
    if (given_smp) {
        check(t, smp >= 1 && smp <= machine_cpus ? VMTSYNC_OK : VMTSYNC_EINVALID);
        vcpus = smp >= 1 && smp <= machine_cpus ? (uint32_t)smp : 1;
    } else if (vcpus > MAX_VCPUS) {
        check(t, VMTSYNC_EINVALID);
        vcpus = 1;
    }
    check(t, apic_id() == 0 ? VMTSYNC_OK : VMTSYNC_EINVALID);

    uint8_t *mem = storage;
    uint64_t capacity = CAPACITY;
    /* Without `ring=`, `events=N` above the built-in ring falls back to the default (as
     * before these options existed). */
    uint64_t n = events > 0 && events <= CAPACITY ? events : DEFAULT_EVENTS;
    if (given_ring) {
        capacity = ring;
        size_t bytes = vmtsync_storage_bytes(vcpus, (uint32_t)capacity);
        int fits = bytes != 0 && RING_BASE + bytes <= MAPPED_END &&
                   in_ram(start_info, RING_BASE, bytes);
        check(t, fits ? VMTSYNC_OK : VMTSYNC_EINVALID);
        mem = fits ? (uint8_t *)(uintptr_t)RING_BASE : NULL;
        n = given_events ? events : DEFAULT_EVENTS;
    }
    /* A rate needs the TSC's: the period in ticks, 0 for as fast as possible. */
    uint64_t period = 0;
    if (given_rate) {
        check(t, rate != 0 && tsc_khz != 0 ? VMTSYNC_OK : VMTSYNC_EINVALID);
        period = rate != 0 ? tsc_khz * 1000u / rate : 0;
    }
    /* TSC ticks per millisecond for the APs' start-up waits: 4 GHz when unknown (at least
     * the time asked for on any slower TSC). */
    uint64_t ms = tsc_khz != 0 ? tsc_khz : 4000000u;

    if (t->failed == 0) {
        size_t bytes = vmtsync_storage_bytes(vcpus, (uint32_t)capacity);
        check(t, bytes != 0 && (mem != storage || bytes <= sizeof storage) ? VMTSYNC_OK
                                                                          : VMTSYNC_EINVALID);
        check(t, vmtsync_init(&rec, mem, bytes, vcpus, (uint32_t)capacity,
                              flight ? VMTSYNC_MODE_OVERWRITE : VMTSYNC_MODE_STOP_WHEN_FULL));
        /* nonce 0: the library makes one; the records hold the raw TSC. */
        check(t, vmtsync_publish(&rec, 0, tsc_khz, VMTSYNC_CLOCK_RAW_TSC, BEACON_PORT));
    }
    int started = 0;
    if (t->failed == 0) {
        if (vcpus > 1) {
            run_events = n;
            run_period = period;
            start_aps(vcpus, ms);
            started = 1;
            __atomic_store_n(&go, 1, __ATOMIC_RELEASE);
        }
        record_run(t, 0, n, period);
    }
    if (started) {
        /* Every AP that checked in records as long as the BSP (give it 10 s more, and as
         * long again); one that never checked in or never finished is a failure. */
        uint64_t limit = (t->tsc1 - t->tsc0) + 10000 * ms;
        uint64_t t0 = rdtsc();
        for (uint32_t v = 1; v < vcpus; v++) {
            struct tally *a = &tallies[v];
            while (__atomic_load_n(&a->present, __ATOMIC_ACQUIRE) &&
                   !__atomic_load_n(&a->done, __ATOMIC_ACQUIRE) && rdtsc() - t0 < limit) {
                pause();
            }
            if (!__atomic_load_n(&a->done, __ATOMIC_ACQUIRE)) {
                fail(a, GUEST_ETIMEOUT);
            }
        }
        /* INIT parks every AP (wait-for-SIPI: its vCPU thread sleeps, no spinning). */
        ipi_others(ICR_INIT_OTHERS);
    }

    /* With several vCPUs: one line per vCPU, then the summary line over all of them (sums;
     * the earliest tsc0, the latest tsc1; the first vCPU's first error), with `vcpus N`. */
    struct tally sum = *t;
    for (uint32_t v = 0; vcpus > 1 && v < vcpus; v++) {
        const struct tally *a = &tallies[v];
        puts_com1("c-guest vcpu ");
        putu(v, 10);
        puts_com1(":");
        put_tally(a);
        puts_com1("\n");
        if (v == 0) {
            continue;
        }
        sum.failed += a->failed;
        sum.recorded += a->recorded;
        sum.refused += a->refused;
        sum.beacons += a->beacons;
        if (sum.first_error == VMTSYNC_OK) {
            sum.first_error = a->first_error;
        }
        sum.tsc0 = a->tsc0 < sum.tsc0 ? a->tsc0 : sum.tsc0;
        sum.tsc1 = a->tsc1 > sum.tsc1 ? a->tsc1 : sum.tsc1;
    }
    const struct vmtsync_header *h = (const struct vmtsync_header *)mem;
    puts_com1("c-guest: recorder at 0x");
    putu((uint64_t)(uintptr_t)mem, 16);
    puts_com1(" magic 0x");
    putu(mem != NULL ? h->magic : 0, 16);
    puts_com1(" nonce 0x");
    putu(mem != NULL ? h->nonce : 0, 16);
    put_tally(&sum);
    if (vcpus > 1) {
        puts_com1(" vcpus ");
        putu(vcpus, 10);
    }
    puts_com1("\n");
    if (hold) {
        /* Ring 3 cannot halt (entry.S): the vCPU spins, and QEMU keeps the guest's memory
         * until it is killed. */
        for (;;) {
            pause();
        }
    }
    outb(DEBUG_EXIT, sum.failed == 0 ? 0 : 1);
}
