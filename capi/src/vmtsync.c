/*
 * vmtsync.c: the recorder's cold paths (layout, publication, beacons, counters). The hot path,
 * vmtsync_record, is static inline in vmtsync.h. Freestanding C: no libc, no libgcc helpers (no
 * 64-bit division), no floating point. docs/memory-layout.md is the byte layout written here.
 * Every function is no_instrument_function, so a build may compile this file with
 * -finstrument-functions too; -DVMTSYNC_PROFILE_HOOKS adds the hooks (vmtsync.h).
 */
#include "vmtsync.h"

#ifndef VMTSYNC_INB
#define VMTSYNC_INB(port) vmtsync_inb_(port)
#endif
#ifndef VMTSYNC_OUTB
#define VMTSYNC_OUTB(port, value) vmtsync_outb_(port, value)
#endif

/* Port I/O. "memory": a compiler barrier, so no memory access moves across a port access (the
 * host's beacon bracket rests on that order); `in`/`out` serialise nothing else and need none. */
static inline VMTSYNC_NOINSTR_ uint8_t vmtsync_inb_(uint16_t port) {
    uint8_t v;
    __asm__ __volatile__("inb %w1, %b0" : "=a"(v) : "Nd"(port) : "memory");
    return v;
}

static inline VMTSYNC_NOINSTR_ void vmtsync_outb_(uint16_t port, uint8_t value) {
    __asm__ __volatile__("outb %b0, %w1" : : "a"(value), "Nd"(port) : "memory");
}

/* Whether the shape is one a header can describe. */
VMTSYNC_NOINSTR_ static int vmtsync_valid_shape_(uint32_t vcpus, uint32_t capacity) {
    return vcpus >= 1 && vcpus <= VMTSYNC_MAX_VCPUS && capacity >= VMTSYNC_MIN_CAPACITY &&
           capacity <= VMTSYNC_MAX_CAPACITY && (capacity & (capacity - 1)) == 0;
}

/* The block's size in 64-bit arithmetic (multiplication only: no libgcc on i386). */
VMTSYNC_NOINSTR_ static uint64_t vmtsync_bytes64_(uint32_t vcpus, uint32_t capacity) {
    uint64_t stride = VMTSYNC_RING_HEADER_SIZE + ((uint64_t)capacity << 5);
    return VMTSYNC_HEADER_SIZE + (uint64_t)vcpus * stride;
}

VMTSYNC_NOINSTR_ size_t vmtsync_storage_bytes(uint32_t vcpus, uint32_t capacity) {
    uint64_t n;
    if (!vmtsync_valid_shape_(vcpus, capacity)) {
        return 0;
    }
    n = vmtsync_bytes64_(vcpus, capacity);
    return n > (uint64_t)(size_t)-1 ? 0 : (size_t)n;
}

/* A plain 64-bit store of a word no reader relies on while it changes (ring headers during
 * init, header words before the magic): two halves on i386. */
VMTSYNC_NOINSTR_ static void vmtsync_put_(unsigned char *p, uint64_t v) {
    vmtsync_store_data_(p, v);
}

VMTSYNC_NOINSTR_ int32_t vmtsync_init(struct vmtsync_rec *r, void *mem, size_t len, uint32_t vcpus,
                     uint32_t capacity, uint32_t mode) {
    unsigned char *block = (unsigned char *)mem;
    size_t stride, v, i;
    if (r == NULL) {
        return VMTSYNC_EINVALID;
    }
    r->vmtsync_rings_ = NULL;
    if (mode > VMTSYNC_MODE_OVERWRITE) {
        return VMTSYNC_EINVALID;
    }
    if (!vmtsync_valid_shape_(vcpus, capacity)) {
        return VMTSYNC_EBAD_SHAPE;
    }
    if (block == NULL || ((uintptr_t)block & 63) != 0) {
        return VMTSYNC_EMISALIGNED;
    }
    if (vmtsync_bytes64_(vcpus, capacity) > (uint64_t)len) {
        return VMTSYNC_ETOO_SMALL;
    }
    stride = VMTSYNC_RING_HEADER_SIZE + (size_t)capacity * VMTSYNC_SLOT_SIZE;
    /* The magic first: a reader sees no header until the next publication. */
    vmtsync_put_(block, 0);
    VMTSYNC_BARRIER_();
    for (v = 0; v < vcpus; v++) {
        unsigned char *ring = block + VMTSYNC_HEADER_SIZE + v * stride;
        /* Volatile word stores: also keeps the compiler from making this a memset call. The
         * slots are cleared too unless VMTSYNC_KEEP_SLOTS is defined: a reader never takes a
         * slot at or above head, so stale slots are harmless, and where every instruction is
         * slow (ring 0 emulated) a build may skip the clearing. */
#ifdef VMTSYNC_KEEP_SLOTS
        for (i = 0; i < VMTSYNC_RING_HEADER_SIZE; i += 8) {
#else
        for (i = 0; i < stride; i += 8) {
#endif
            vmtsync_put_(ring + i, 0);
        }
        vmtsync_put_(ring + 16, mode); /* the mode byte (16); "claimed" (17) stays 0 */
    }
    VMTSYNC_BARRIER_();
    r->vmtsync_block_ = block;
    r->vmtsync_stride_ = stride;
    r->vmtsync_vcpus_ = vcpus;
    r->vmtsync_mask_ = capacity - 1;
    r->vmtsync_mode_ = mode;
    r->vmtsync_port_ = 0;
    r->vmtsync_pad_ = 0;
    r->vmtsync_rings_ = block + VMTSYNC_HEADER_SIZE;
    return VMTSYNC_OK;
}

/* CRC-32C (Castagnoli, reflected 0x82F63B78, initial value and final XOR all ones), bitwise:
 * it runs once per publication, so a 1 KiB table is not worth it. */
VMTSYNC_NOINSTR_ static uint32_t vmtsync_crc32c_(uint32_t crc, const volatile unsigned char *p, size_t n) {
    size_t i;
    int k;
    for (i = 0; i < n; i++) {
        crc ^= p[i];
        for (k = 0; k < 8; k++) {
            crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
        }
    }
    return crc;
}

/* SplitMix64's finalizer: every input bit affects every output bit. */
VMTSYNC_NOINSTR_ static uint64_t vmtsync_mix_(uint64_t x) {
    uint64_t z = x + 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

VMTSYNC_NOINSTR_ int32_t vmtsync_publish(struct vmtsync_rec *r, uint64_t nonce, uint64_t tsc_khz, uint32_t clock,
                        uint16_t beacon_port) {
    unsigned char *h;
    unsigned char magic[8];
    uint64_t capacity;
    uint32_t crc;
    int i;
    if (r == NULL || r->vmtsync_rings_ == NULL) {
        return VMTSYNC_ENOT_INITIALISED;
    }
    if (clock > VMTSYNC_CLOCK_OTHER) {
        return VMTSYNC_EINVALID;
    }
    if (nonce == 0) {
        /* Two TSC reads mixed with the block's address: different per boot and per recorder
         * (the low bits of the TSC move between the reads). Zero is reserved. */
        uint64_t a = VMTSYNC_READ_TSC();
        uint64_t b = VMTSYNC_READ_TSC();
        nonce = vmtsync_mix_(a ^ vmtsync_mix_(b ^ (uint64_t)(uintptr_t)r->vmtsync_block_));
        if (nonce == 0) {
            nonce = 1;
        }
    }
    h = r->vmtsync_block_;
    capacity = (uint64_t)r->vmtsync_mask_ + 1;
    r->vmtsync_port_ = 0;
    /* The magic to zero first, then every other word, then the checksum, the magic last. */
    vmtsync_put_(h, 0);
    VMTSYNC_BARRIER_();
    vmtsync_put_(h + 8, (uint64_t)VMTSYNC_LAYOUT_VERSION | (uint64_t)VMTSYNC_HEADER_SIZE << 32);
    vmtsync_put_(h + 16, nonce);
    vmtsync_put_(h + 24, (uint64_t)r->vmtsync_vcpus_ | (uint64_t)VMTSYNC_SLOT_SIZE << 32);
    vmtsync_put_(h + 32, capacity);
    vmtsync_put_(h + 40, tsc_khz);
    vmtsync_put_(h + 48, (uint64_t)r->vmtsync_mode_ | (uint64_t)clock << 32);
    vmtsync_put_(h + 56, VMTSYNC_HEADER_SIZE);
    vmtsync_put_(h + 64, (uint64_t)r->vmtsync_stride_);
    vmtsync_put_(h + 72, beacon_port);
    for (i = 80; i < 120; i += 8) {
        vmtsync_put_(h + i, 0);
    }
    /* The checksum covers the magic as published, fed on its own: the whole valid header never
     * sits in memory before the magic's store. */
    for (i = 0; i < 8; i++) {
        magic[i] = (unsigned char)(VMTSYNC_MAGIC >> (8 * i));
    }
    crc = vmtsync_crc32c_(0xFFFFFFFFu, magic, 8);
    crc = ~vmtsync_crc32c_(crc, h + 8, 112);
    vmtsync_put_(h + 120, crc);
    VMTSYNC_BARRIER_();
    /* The magic: the high half first on i386, so no in-between state is the magic. */
    ((volatile vmtsync_u32_ *)(void *)h)[1] = (uint32_t)(VMTSYNC_MAGIC >> 32);
    VMTSYNC_BARRIER_();
    ((volatile vmtsync_u32_ *)(void *)h)[0] = (uint32_t)VMTSYNC_MAGIC;
    r->vmtsync_port_ = beacon_port;
    return VMTSYNC_OK;
}

VMTSYNC_NOINSTR_ int32_t vmtsync_beacon(struct vmtsync_rec *r, uint32_t vcpu) {
    unsigned char *ring;
    uint64_t seq;
    uint16_t port;
    int32_t stored;
    if (r == NULL || r->vmtsync_rings_ == NULL) {
        return VMTSYNC_ENOT_INITIALISED;
    }
    if (vcpu >= r->vmtsync_vcpus_) {
        return VMTSYNC_ENO_SUCH_VCPU;
    }
    port = r->vmtsync_port_;
    if (port == 0) {
        return VMTSYNC_ENO_BEACON_PORT;
    }
    ring = r->vmtsync_rings_ + (size_t)vcpu * r->vmtsync_stride_;
    seq = *VMTSYNC_W_(ring, 3);
    (void)VMTSYNC_INB(port);
    VMTSYNC_BARRIER_();
    stored = vmtsync_store_(r, vcpu, VMTSYNC_BEACON_ID | 8u << 16, seq, 0);
    VMTSYNC_BARRIER_();
    VMTSYNC_OUTB(port, (uint8_t)seq);
    VMTSYNC_BARRIER_();
    vmtsync_store_inc_(VMTSYNC_W_(ring, 3), seq);
    return stored;
}

VMTSYNC_NOINSTR_ uint64_t vmtsync_produced(const struct vmtsync_rec *r, uint32_t vcpu) {
    if (r == NULL || r->vmtsync_rings_ == NULL || vcpu >= r->vmtsync_vcpus_) {
        return 0;
    }
    return *VMTSYNC_W_(r->vmtsync_rings_ + (size_t)vcpu * r->vmtsync_stride_, 0);
}

VMTSYNC_NOINSTR_ uint64_t vmtsync_refused(const struct vmtsync_rec *r, uint32_t vcpu) {
    if (r == NULL || r->vmtsync_rings_ == NULL || vcpu >= r->vmtsync_vcpus_) {
        return 0;
    }
    return *VMTSYNC_W_(r->vmtsync_rings_ + (size_t)vcpu * r->vmtsync_stride_, 1);
}

/* A span name's first bytes up to its NUL, at most 16, as the record's two data words. */
static VMTSYNC_NOINSTR_ int32_t vmtsync_span_(struct vmtsync_rec *r, uint32_t vcpu, uint32_t id,
                                              const char *name) {
    uint64_t w[2] = {0, 0};
    uint32_t len = 0;
    if (r == NULL || r->vmtsync_rings_ == NULL) {
        return VMTSYNC_ENOT_INITIALISED;
    }
    if (vcpu >= r->vmtsync_vcpus_) {
        return VMTSYNC_ENO_SUCH_VCPU;
    }
    if (name == NULL || name[0] == '\0') {
        return VMTSYNC_EINVALID;
    }
    while (len < VMTSYNC_MAX_PAYLOAD && name[len] != '\0') {
        w[len >> 3] |= (uint64_t)(unsigned char)name[len] << (8 * (len & 7));
        len++;
    }
    return vmtsync_store_(r, vcpu, id | len << 16, w[0], w[1]);
}

VMTSYNC_NOINSTR_ int32_t vmtsync_span_begin(struct vmtsync_rec *r, uint32_t vcpu,
                                            const char *name) {
    return vmtsync_span_(r, vcpu, VMTSYNC_SPAN_BEGIN_ID, name);
}

VMTSYNC_NOINSTR_ int32_t vmtsync_span_end(struct vmtsync_rec *r, uint32_t vcpu, const char *name) {
    return vmtsync_span_(r, vcpu, VMTSYNC_SPAN_END_ID, name);
}

/* Whether `v` is its low 48 bits sign-extended from bit 47 (the upper 17 bits all equal). */
static VMTSYNC_NOINSTR_ int vmtsync_canonical48_(uint64_t v) {
    uint32_t top = (uint32_t)(v >> 47);
    return top == 0 || top == 0x1FFFFu;
}

VMTSYNC_NOINSTR_ int32_t vmtsync_reloc(struct vmtsync_rec *r, uint32_t vcpu, uint64_t link,
                                       uint64_t runtime, uint32_t len) {
    const uint64_t low48 = 0xFFFFFFFFFFFFULL;
    if (r == NULL || r->vmtsync_rings_ == NULL) {
        return VMTSYNC_ENOT_INITIALISED;
    }
    if (vcpu >= r->vmtsync_vcpus_) {
        return VMTSYNC_ENO_SUCH_VCPU;
    }
    if (!vmtsync_canonical48_(link) || !vmtsync_canonical48_(runtime)) {
        return VMTSYNC_EINVALID;
    }
    /* Bytes 0..6 link, 6..12 runtime, 12..16 len: runtime's low 2 bytes end the first word. */
    return vmtsync_store_(r, vcpu, VMTSYNC_RELOC_ID | 16u << 16,
                          (link & low48) | (runtime & 0xFFFFu) << 48,
                          ((runtime & low48) >> 16) | (uint64_t)len << 32);
}

#ifdef VMTSYNC_PROFILE_HOOKS
#ifdef VMTSYNC_PROFILE_DEFAULT_REC_
/* The hooks' default recorder: NULL (nothing recorded) until the program points it at an
 * initialised one. Defined only when the build names no VMTSYNC_PROFILE_REC of its own. */
struct vmtsync_rec *vmtsync_profile_rec;
#endif

/* gcc/clang -finstrument-functions call these at every instrumented function's entry and
 * exit. A NULL recorder, or one not initialised yet, records nothing; a full ring counts. */
void __cyg_profile_func_enter(void *fn, void *site) VMTSYNC_NOINSTR_;
void __cyg_profile_func_exit(void *fn, void *site) VMTSYNC_NOINSTR_;

VMTSYNC_NOINSTR_ void __cyg_profile_func_enter(void *fn, void *site) {
    struct vmtsync_rec *r = VMTSYNC_PROFILE_REC();
    if (r != NULL) {
        (void)vmtsync_func_enter(r, VMTSYNC_PROFILE_VCPU(), fn, site);
    }
}

VMTSYNC_NOINSTR_ void __cyg_profile_func_exit(void *fn, void *site) {
    struct vmtsync_rec *r = VMTSYNC_PROFILE_REC();
    if (r != NULL) {
        (void)vmtsync_func_exit(r, VMTSYNC_PROFILE_VCPU(), fn, site);
    }
}
#endif
