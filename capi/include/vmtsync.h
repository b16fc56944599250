/*
 * vmtsync.h: vmtsync's event recorder for C: firmware, unikernels, kernels, any freestanding
 * x86 code, 32-bit (i386 flat protected mode) or 64-bit. Add this header and
 * capi/src/vmtsync.c to the build; no libc, no libgcc, no floating point.
 *
 * The recorder writes docs/memory-layout.md's block (layout version 1) byte for byte as
 * vmtsync-core's Rust recorder does, so a host reading the guest's memory
 * (`vmtsync record --from-memory`) drains it while the guest runs. docs/c-abi.md is the guide.
 *
 * Use: give vmtsync_init a handle and a 64-byte aligned block of
 * VMTSYNC_STORAGE_BYTES(vcpus, capacity) bytes (VMTSYNC_DEFINE_STORAGE makes a zeroed static
 * one), call vmtsync_publish once, then vmtsync_record / vmtsync_beacon for vCPU v's ring only
 * from vCPU v (one caller at a time per ring). Every int32_t function returns VMTSYNC_OK (0) or
 * a negative VMTSYNC_E* status. An image may hold several recorders (one handle and block each).
 *
 * Overrides, each a macro defined before this header is included (and when vmtsync.c is built):
 * - VMTSYNC_READ_TSC(): the clock read stored in each record (default `lfence; rdtsc`);
 * - VMTSYNC_INB(port), VMTSYNC_OUTB(port, value): the beacon's port I/O (default `inb`/`outb`);
 * - VMTSYNC_HAVE_STDINT: the includer already provides uint8_t..uint64_t and size_t (for a build
 *   without the compiler's <stdint.h>);
 * - VMTSYNC_KEEP_SLOTS (vmtsync.c): vmtsync_init clears the header's magic and the ring headers
 *   but not the slots (the host never reads a slot at or above a ring's head).
 */
#ifndef VMTSYNC_H
#define VMTSYNC_H

#ifndef VMTSYNC_HAVE_STDINT
#include <stddef.h>
#include <stdint.h>
#endif

#if !defined(__x86_64__) && !defined(__i386__)
#error "vmtsync.h: x86 only (i386 or x86_64): the recorder reads the TSC"
#endif

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
/* Span records (docs/memory-layout.md, reserved ids): written only by the calls below. */
#define VMTSYNC_SPAN_BEGIN_ID 0xFF01 /* payload: the phase's name, 1..=16 bytes */
#define VMTSYNC_SPAN_END_ID 0xFF02   /* payload: the same name */
#define VMTSYNC_FUNC_ENTRY_ID 0xFF03 /* payload: function, call site (4 bytes each, or 8) */
#define VMTSYNC_FUNC_EXIT_ID 0xFF04  /* payload: as the entry's */
#define VMTSYNC_RELOC_ID 0xFF05      /* payload: link (6 bytes), runtime (6), length (4) */

/* Modes and clocks. */
#define VMTSYNC_MODE_STOP_WHEN_FULL 0
#define VMTSYNC_MODE_OVERWRITE 1
#define VMTSYNC_CLOCK_RAW_TSC 0
#define VMTSYNC_CLOCK_OTHER 1

/* Status codes. */
#define VMTSYNC_OK 0
#define VMTSYNC_EBAD_SHAPE (-1)          /* vcpus not in 1..=1024, capacity not 2^k in 2..=2^31 */
#define VMTSYNC_ETOO_SMALL (-2)          /* the block is smaller than VMTSYNC_STORAGE_BYTES */
#define VMTSYNC_EMISALIGNED (-3)         /* the block is null or not 64-byte aligned */
#define VMTSYNC_ENOT_INITIALISED (-4)    /* the handle was never initialised successfully */
#define VMTSYNC_EINVALID (-5)            /* a mode or clock out of range, null data with len > 0,
                                          * an empty or NULL span name, a relocation address that
                                          * is not a sign-extended 48-bit value */
#define VMTSYNC_EFULL (-6)               /* stop-when-full ring full: counted as refused */
#define VMTSYNC_EPAYLOAD_TOO_LONG (-7)   /* more than 16 payload bytes: nothing stored or counted */
#define VMTSYNC_ENO_SUCH_VCPU (-8)       /* no ring for that vCPU: nothing counted */
#define VMTSYNC_ENO_BEACON_PORT (-9)     /* not published, or published without a beacon port */
#define VMTSYNC_ERESERVED_ID (-10)       /* id >= VMTSYNC_RESERVED_ID_MIN: nothing counted */

/* Bytes a recorder of `vcpus` rings of `capacity` records needs, header included (the shape
 * must be valid; vmtsync_init checks it). */
#define VMTSYNC_STORAGE_BYTES(vcpus, capacity)                                                 \
    ((size_t)VMTSYNC_HEADER_SIZE +                                                             \
     (size_t)(vcpus) * ((size_t)VMTSYNC_RING_HEADER_SIZE +                                     \
                        (size_t)VMTSYNC_SLOT_SIZE * (size_t)(capacity)))

/* Defines `name`, a 64-byte aligned block for a recorder of that shape. At file scope it has
 * static storage and no initialiser, so it lands in .bss (zero, and never a valid header in the
 * image file). Put `static` in front for internal linkage. */
#define VMTSYNC_DEFINE_STORAGE(name, vcpus, capacity)                                          \
    unsigned char name[VMTSYNC_STORAGE_BYTES(vcpus, capacity)] __attribute__((aligned(64)))

/* A recorder handle: caller-allocated (static, global or on a stack that outlives its use), set
 * up by vmtsync_init. Its fields are private to this library. A zeroed handle (static storage)
 * is "not initialised". */
struct vmtsync_rec {
    unsigned char *vmtsync_rings_; /* ring 0; NULL until vmtsync_init succeeds */
    unsigned char *vmtsync_block_; /* the header */
    size_t vmtsync_stride_;        /* bytes from ring i to ring i + 1 */
    uint32_t vmtsync_vcpus_;
    uint32_t vmtsync_mask_;        /* capacity - 1 */
    uint32_t vmtsync_mode_;
    uint16_t vmtsync_port_;        /* the published beacon port, 0 for none or unpublished */
    uint16_t vmtsync_pad_;
};

/* The published header as it sits at the start of the block (for C code that reads one). */
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

/* Bytes needed for `vcpus` rings of `capacity` records, or 0 for an invalid shape or one that
 * does not fit this address space. */
size_t vmtsync_storage_bytes(uint32_t vcpus, uint32_t capacity);

/* Lays out an empty, unpublished recorder in `mem` (64-byte aligned, `len` bytes, owned by the
 * recorder from now on) and sets up handle `r` for it. `mode`: VMTSYNC_MODE_*. Every ring is
 * cleared, so `mem` needs no zeroing first. Call it before any vCPU records. */
int32_t vmtsync_init(struct vmtsync_rec *r, void *mem, size_t len, uint32_t vcpus,
                     uint32_t capacity, uint32_t mode);

/* Writes the header, magic last, after which a host reading guest memory finds the recorder.
 * `nonce` 0: one made here from mixed TSC reads (never 0); publishing again with another
 * nonce tells a reader the recording restarted. `tsc_khz` 0: unknown. `clock`:
 * VMTSYNC_CLOCK_* (RAW_TSC unless VMTSYNC_READ_TSC is something else). `beacon_port` 0: no
 * beacons; otherwise an I/O port no device decodes. */
int32_t vmtsync_publish(struct vmtsync_rec *r, uint64_t nonce, uint64_t tsc_khz, uint32_t clock,
                        uint16_t beacon_port);

/* Emits `vcpu`'s next sync beacon on the published port: `in`, a beacon record stamped after
 * it, `out` of the sequence number's low byte, then the beacon count. Needs port I/O (ring 0,
 * or IOPL 3). The exits happen and the count advances even when a full ring refuses the record
 * (VMTSYNC_EFULL, counted as refused like any event). */
int32_t vmtsync_beacon(struct vmtsync_rec *r, uint32_t vcpu);

/* Span records (docs/c-abi.md, "Spans and function tracing"). Like vmtsync_record they are
 * for `vcpu`'s ring only, from vCPU v, and a full stop-when-full ring refuses them
 * (VMTSYNC_EFULL, counted); checks: VMTSYNC_ENOT_INITIALISED, _ENO_SUCH_VCPU, _EINVALID.
 *
 * vmtsync_span_begin/_end: the phase `name` began/ended; the name's bytes up to its NUL, at
 * most the first 16 (1..=16: an empty or NULL name is VMTSYNC_EINVALID). */
int32_t vmtsync_span_begin(struct vmtsync_rec *r, uint32_t vcpu, const char *name);
int32_t vmtsync_span_end(struct vmtsync_rec *r, uint32_t vcpu, const char *name);

/* Code linked at [link, link + len) runs at [runtime, runtime + len) from now on (a firmware
 * that copies its code elsewhere). Both addresses must be sign-extended 48-bit values (any
 * 32-bit address is), else VMTSYNC_EINVALID. */
int32_t vmtsync_reloc(struct vmtsync_rec *r, uint32_t vcpu, uint64_t link, uint64_t runtime,
                      uint32_t len);

/* Records stored on `vcpu`'s ring so far (its head), 0 for no such ring. */
uint64_t vmtsync_produced(const struct vmtsync_rec *r, uint32_t vcpu);

/* Events `vcpu`'s ring refused because it was full, 0 for no such ring. */
uint64_t vmtsync_refused(const struct vmtsync_rec *r, uint32_t vcpu);

/* ---- Internals the inline hot path needs (not API) ---- */

/* Aliasing-safe views of the block's words (the block may have any declared type). */
typedef uint64_t __attribute__((may_alias)) vmtsync_u64_;
typedef uint32_t __attribute__((may_alias)) vmtsync_u32_;

/* Every function of the recorder: never instrumented by -finstrument-functions (a hook that
 * records would otherwise call itself). */
#define VMTSYNC_NOINSTR_ __attribute__((no_instrument_function))

/* A compiler barrier. With x86's TSO (stores become visible in program order, loads are not
 * reordered with other loads) it makes each store below a release store. */
#define VMTSYNC_BARRIER_() __asm__ __volatile__("" ::: "memory")

static inline VMTSYNC_NOINSTR_ uint64_t vmtsync_rdtsc_(void) {
    uint32_t lo, hi;
    /* lfence: RDTSC waits for every earlier instruction. "memory": no store moves across. */
    __asm__ __volatile__("lfence\n\trdtsc" : "=a"(lo), "=d"(hi) : : "memory");
    return ((uint64_t)hi << 32) | lo;
}

#ifndef VMTSYNC_READ_TSC
#define VMTSYNC_READ_TSC() vmtsync_rdtsc_()
#endif

/* Word `i` (8 bytes each) of a ring header or slot at `p`. */
#define VMTSYNC_W_(p, i) ((volatile vmtsync_u64_ *)(void *)(p) + (i))

#if defined(__i386__)
/* i386: general-purpose registers store at most 32 bits at once. Each store below still changes
 * the 64-bit word in one access: a word that goes up by one changes only its low half unless
 * the low half wraps, and then `lock cmpxchg8b` writes all 8 bytes at once (the only 8-byte
 * store without x87, MMX or SSE; LOCK makes the SDM's atomicity guarantee explicit and orders
 * it like any locked instruction). docs/c-abi.md says more. */
static inline VMTSYNC_NOINSTR_ void vmtsync_store_inc_(volatile void *w, uint64_t old) {
    uint64_t v = old + 1;
    if ((uint32_t)v != 0) {
        *(volatile vmtsync_u32_ *)w = (uint32_t)v;
    } else {
        uint64_t expected = old;
        __asm__ __volatile__("1:\n\t"
                             "lock cmpxchg8b %0\n\t"
                             "jnz 1b"
                             : "+m"(*(volatile vmtsync_u64_ *)w), "+A"(expected)
                             : "b"((uint32_t)v), "c"((uint32_t)(v >> 32))
                             : "memory", "cc");
    }
}

/* A data word (tsc, payload) as two halves: the reading rule never takes a slot the producer
 * may be writing, so these need no single access. */
static inline VMTSYNC_NOINSTR_ void vmtsync_store_data_(volatile void *w, uint64_t v) {
    volatile vmtsync_u32_ *h = (volatile vmtsync_u32_ *)w;
    h[0] = (uint32_t)v;
    h[1] = (uint32_t)(v >> 32);
}

/* meta = stamp | BUSY: the low half first, so the word's only in-between state carries BUSY
 * (and the new stamp's low bits): it is never a committed record. */
static inline VMTSYNC_NOINSTR_ void vmtsync_store_busy_(volatile void *w, uint64_t v) {
    volatile vmtsync_u32_ *h = (volatile vmtsync_u32_ *)w;
    h[0] = (uint32_t)v;
    VMTSYNC_BARRIER_();
    h[1] = (uint32_t)(v >> 32);
}

/* meta = stamp | len | id over stamp | BUSY: the high halves are equal, one 32-bit store. */
static inline VMTSYNC_NOINSTR_ void vmtsync_store_commit_(volatile void *w, uint64_t v) {
    *(volatile vmtsync_u32_ *)w = (uint32_t)v;
}
#else
static inline VMTSYNC_NOINSTR_ void vmtsync_store_inc_(volatile void *w, uint64_t old) {
    *(volatile vmtsync_u64_ *)w = old + 1;
}
static inline VMTSYNC_NOINSTR_ void vmtsync_store_data_(volatile void *w, uint64_t v) {
    *(volatile vmtsync_u64_ *)w = v;
}
static inline VMTSYNC_NOINSTR_ void vmtsync_store_busy_(volatile void *w, uint64_t v) {
    *(volatile vmtsync_u64_ *)w = v;
}
static inline VMTSYNC_NOINSTR_ void vmtsync_store_commit_(volatile void *w, uint64_t v) {
    *(volatile vmtsync_u64_ *)w = v;
}
#endif

/* Up to 8 bytes at `p` as a little-endian word, zero-extended. */
static inline VMTSYNC_NOINSTR_ uint64_t vmtsync_load_le_(const unsigned char *p, uint32_t n) {
    uint64_t v = 0;
    uint32_t i;
    if (n == 8) {
        /* One 8-byte load (x86 is little-endian); a constant-size builtin copy is inlined. */
        __builtin_memcpy(&v, p, 8);
        return v;
    }
    for (i = 0; i < n; i++) {
        v |= (uint64_t)p[i] << (8 * i);
    }
    return v;
}

/* Stores one record (any id) on `vcpu`'s ring (the caller checked the handle and vcpu).
 * docs/memory-layout.md's order: meta = stamp | BUSY, the TSC read, the data words,
 * meta = stamp | len | id, then head = n + 1; stop-when-full refuses (refused += 1) when
 * head - tail >= capacity. */
static inline VMTSYNC_NOINSTR_ int32_t vmtsync_store_(struct vmtsync_rec *r, uint32_t vcpu,
                                                      uint32_t id_len, uint64_t lo, uint64_t hi) {
    unsigned char *ring = r->vmtsync_rings_ + (size_t)vcpu * r->vmtsync_stride_;
    uint64_t head = *VMTSYNC_W_(ring, 0);
    unsigned char *slot;
    uint64_t stamp;
    if (r->vmtsync_mode_ == VMTSYNC_MODE_STOP_WHEN_FULL &&
        head - *VMTSYNC_W_(ring, 8) > (uint64_t)r->vmtsync_mask_) {
        vmtsync_store_inc_(VMTSYNC_W_(ring, 1), *VMTSYNC_W_(ring, 1));
        return VMTSYNC_EFULL;
    }
    slot = ring + VMTSYNC_RING_HEADER_SIZE +
           (size_t)((uint32_t)head & r->vmtsync_mask_) * VMTSYNC_SLOT_SIZE;
    stamp = (head + 1) << 25;
    vmtsync_store_busy_(VMTSYNC_W_(slot, 0), stamp | (1u << 24));
    VMTSYNC_BARRIER_();
    {
        uint64_t tsc = VMTSYNC_READ_TSC();
        vmtsync_store_data_(VMTSYNC_W_(slot, 2), lo);
        vmtsync_store_data_(VMTSYNC_W_(slot, 3), hi);
        vmtsync_store_data_(VMTSYNC_W_(slot, 1), tsc);
    }
    VMTSYNC_BARRIER_();
    vmtsync_store_commit_(VMTSYNC_W_(slot, 0), stamp | id_len);
    VMTSYNC_BARRIER_();
    vmtsync_store_inc_(VMTSYNC_W_(ring, 0), head);
    return VMTSYNC_OK;
}

/* Records event `id` (below VMTSYNC_RESERVED_ID_MIN) with `len` (0..=16) payload bytes from
 * `data` (may be NULL when `len` is 0) on `vcpu`'s ring, stamped with VMTSYNC_READ_TSC() read
 * after the slot is marked busy. Call it for vCPU v's ring only from vCPU v. Checks, in order:
 * VMTSYNC_ENOT_INITIALISED, _ENO_SUCH_VCPU, _ERESERVED_ID, _EPAYLOAD_TOO_LONG, _EINVALID,
 * then _EFULL (counted as refused). */
static inline VMTSYNC_NOINSTR_ int32_t vmtsync_record(struct vmtsync_rec *r, uint32_t vcpu,
                                                      uint16_t id, const void *data,
                                                      uint32_t len) {
    const unsigned char *p = (const unsigned char *)data;
    uint64_t lo, hi = 0;
    if (r->vmtsync_rings_ == NULL) {
        return VMTSYNC_ENOT_INITIALISED;
    }
    if (vcpu >= r->vmtsync_vcpus_) {
        return VMTSYNC_ENO_SUCH_VCPU;
    }
    if (id >= VMTSYNC_RESERVED_ID_MIN) {
        return VMTSYNC_ERESERVED_ID;
    }
    if (len > VMTSYNC_MAX_PAYLOAD) {
        return VMTSYNC_EPAYLOAD_TOO_LONG;
    }
    if (p == NULL && len != 0) {
        return VMTSYNC_EINVALID;
    }
    if (len > 8) {
        lo = vmtsync_load_le_(p, 8);
        hi = vmtsync_load_le_(p + 8, len - 8);
    } else {
        lo = vmtsync_load_le_(p, len);
    }
    return vmtsync_store_(r, vcpu, (uint32_t)id | len << 16, lo, hi);
}

/* The function address and call site in one record's two data words: 4 bytes each (len 8) in
 * 32-bit code, 8 bytes each (len 16) in 64-bit code. */
static inline VMTSYNC_NOINSTR_ int32_t vmtsync_func_(struct vmtsync_rec *r, uint32_t vcpu,
                                                     uint32_t id, void *fn, void *site) {
    if (r->vmtsync_rings_ == NULL) {
        return VMTSYNC_ENOT_INITIALISED;
    }
    if (vcpu >= r->vmtsync_vcpus_) {
        return VMTSYNC_ENO_SUCH_VCPU;
    }
#if defined(__i386__)
    return vmtsync_store_(r, vcpu, id | 8u << 16,
                          (uint64_t)(uintptr_t)fn | (uint64_t)(uintptr_t)site << 32, 0);
#else
    return vmtsync_store_(r, vcpu, id | 16u << 16, (uint64_t)(uintptr_t)fn,
                          (uint64_t)(uintptr_t)site);
#endif
}

/* The function at `fn` was entered from call site `site` (what -finstrument-functions passes
 * __cyg_profile_func_enter). Checks as vmtsync_span_begin's, without the name. */
static inline VMTSYNC_NOINSTR_ int32_t vmtsync_func_enter(struct vmtsync_rec *r, uint32_t vcpu,
                                                          void *fn, void *site) {
    return vmtsync_func_(r, vcpu, VMTSYNC_FUNC_ENTRY_ID, fn, site);
}

/* The function at `fn` returns to `site` (__cyg_profile_func_exit's arguments). */
static inline VMTSYNC_NOINSTR_ int32_t vmtsync_func_exit(struct vmtsync_rec *r, uint32_t vcpu,
                                                         void *fn, void *site) {
    return vmtsync_func_(r, vcpu, VMTSYNC_FUNC_EXIT_ID, fn, site);
}

/* Opt-in hooks for gcc/clang -finstrument-functions: vmtsync.c built with
 * -DVMTSYNC_PROFILE_HOOKS defines __cyg_profile_func_enter/_exit, which record on the recorder
 * VMTSYNC_PROFILE_REC() names (NULL: nothing recorded) for vCPU VMTSYNC_PROFILE_VCPU(). By
 * default that is the global below (NULL until the program sets it: set it once the recorder
 * is initialised) and vCPU 0. */
#if defined(VMTSYNC_PROFILE_HOOKS) && !defined(VMTSYNC_PROFILE_REC)
extern struct vmtsync_rec *vmtsync_profile_rec;
#define VMTSYNC_PROFILE_REC() vmtsync_profile_rec
#define VMTSYNC_PROFILE_DEFAULT_REC_ 1
#endif
#if defined(VMTSYNC_PROFILE_HOOKS) && !defined(VMTSYNC_PROFILE_VCPU)
#define VMTSYNC_PROFILE_VCPU() 0u
#endif

#ifdef __cplusplus
}
#endif

#endif /* VMTSYNC_H */
