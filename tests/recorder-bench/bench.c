/*
 * The C contenders of the recorder bench (tests/src/bin/vmtsync-recorder-bench.rs): the C
 * recorder (capi/), barectf (when tests/build.rs generated it) and the two floors. Each
 * vb_* function runs `n` events of one contender and returns the TSC ticks they took, stamped
 * with `lfence; rdtsc` before and after, the same stamps the Rust contenders use. Every
 * event carries an 8-byte payload.
 */
#include <stdint.h>
#include <string.h>

#include "vmtsync.h"

#define VB_CAPACITY 4096u

static inline uint64_t vb_tsc(void) {
    uint32_t lo, hi;
    __asm__ __volatile__("lfence\n\trdtsc" : "=a"(lo), "=d"(hi) : : "memory");
    return ((uint64_t)hi << 32) | lo;
}

/* Floor 1: the ordered TSC read alone. */
uint64_t vb_floor_tsc(uint64_t n) {
    uint64_t sink = 0, t0 = vb_tsc(), i;
    for (i = 0; i < n; i++) {
        sink += vb_tsc();
    }
    __asm__ __volatile__("" : : "r"(sink) : "memory");
    return vb_tsc() - t0;
}

/* Floor 2: the ordered TSC read and a plain 32-byte slot store (meta, tsc, payload, zero) into
 * a ring of VB_CAPACITY slots: what any recorder of this layout must do at the least. */
static uint64_t vb_slots[VB_CAPACITY][4] __attribute__((aligned(64)));

uint64_t vb_floor_store(uint64_t n, uint64_t payload) {
    uint64_t t0 = vb_tsc(), i;
    for (i = 0; i < n; i++) {
        uint64_t *s = vb_slots[i & (VB_CAPACITY - 1)];
        s[1] = vb_tsc();
        s[2] = payload;
        s[3] = 0;
        s[0] = ((i + 1) << 25) | (8u << 16) | 7u;
        __asm__ __volatile__("" : : : "memory");
    }
    return vb_tsc() - t0;
}

/* The C recorder: one vCPU, a flight ring of VB_CAPACITY records (never full). */
static VMTSYNC_DEFINE_STORAGE(vb_block, 1, VB_CAPACITY);
static struct vmtsync_rec vb_rec;

int vb_c_init(void) {
    int32_t rc = vmtsync_init(&vb_rec, vb_block, sizeof vb_block, 1, VB_CAPACITY,
                              VMTSYNC_MODE_OVERWRITE);
    return rc == VMTSYNC_OK ? vmtsync_publish(&vb_rec, 1, 0, VMTSYNC_CLOCK_RAW_TSC, 0) : rc;
}

uint64_t vb_c_record(uint64_t n, uint64_t payload) {
    uint64_t t0 = vb_tsc(), i;
    for (i = 0; i < n; i++) {
        (void)vmtsync_record(&vb_rec, 0, 7, &payload, 8);
    }
    return vb_tsc() - t0;
}

uint64_t vb_c_produced(void) {
    return vmtsync_produced(&vb_rec, 0);
}

#ifdef VB_HAVE_BARECTF
#include "vbt.h"

/* barectf's platform: one packet buffer that is closed and opened again in place when full
 * (a flight buffer, like the rings above), never a full back end. */
static uint8_t vb_bt_buf[VB_CAPACITY * 32] __attribute__((aligned(64)));
static struct vbt_default_ctx vb_bt_ctx;

static uint64_t vb_bt_clock(void *data) {
    (void)data;
    return vb_tsc();
}
static int vb_bt_full(void *data) {
    (void)data;
    return 0;
}
static void vb_bt_open(void *data) {
    vbt_default_open_packet((struct vbt_default_ctx *)data);
}
static void vb_bt_close(void *data) {
    vbt_default_close_packet((struct vbt_default_ctx *)data);
}

int vb_barectf_init(void) {
    struct vbt_platform_callbacks cbs = {vb_bt_clock, vb_bt_full, vb_bt_open, vb_bt_close};
    vbt_init(&vb_bt_ctx, vb_bt_buf, sizeof vb_bt_buf, cbs, &vb_bt_ctx);
    vbt_default_open_packet(&vb_bt_ctx);
    return 1;
}

uint64_t vb_barectf(uint64_t n, uint64_t payload) {
    uint64_t t0 = vb_tsc(), i;
    for (i = 0; i < n; i++) {
        vbt_trace_ev(&vb_bt_ctx, payload);
    }
    return vb_tsc() - t0;
}
#else
int vb_barectf_init(void) {
    return 0;
}
uint64_t vb_barectf(uint64_t n, uint64_t payload) {
    (void)n;
    (void)payload;
    return 0;
}
#endif
/* Floor 3: floor 2 plus what a ring whose readers follow a head word must add at the least:
 * load the head, mark the slot busy, commit it, store the head (no checks, no mode). */
static uint64_t vb_head_w[8] __attribute__((aligned(64)));

uint64_t vb_floor_head(uint64_t n, uint64_t payload) {
    uint64_t t0 = vb_tsc(), i;
    for (i = 0; i < n; i++) {
        volatile uint64_t *hw = vb_head_w;
        uint64_t h = *hw;
        uint64_t *s = vb_slots[h & (VB_CAPACITY - 1)];
        s[0] = ((h + 1) << 25) | (1u << 24);
        __asm__ __volatile__("" : : : "memory");
        s[1] = vb_tsc();
        s[2] = payload;
        s[3] = 0;
        __asm__ __volatile__("" : : : "memory");
        s[0] = ((h + 1) << 25) | (8u << 16) | 7u;
        __asm__ __volatile__("" : : : "memory");
        *hw = h + 1;
    }
    return vb_tsc() - t0;
}
