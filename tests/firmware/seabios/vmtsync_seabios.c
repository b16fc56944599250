/*
 * vmtsync_seabios.c: SeaBIOS's glue to vmtsync's C recorder (capi/include/vmtsync.h and
 * capi/src/vmtsync.c). tests/launch's firmware build copies this file and the recorder's two
 * files into SeaBIOS's src/, and vmtsync.patch calls the functions below from post.c and boot.c
 * (vmtsync-functions.patch also from post.c's reloc_preinit and resume.c's handle_resume32).
 * docs/firmware.md explains the choices; the short version:
 *
 * - The ring sits at guest-physical 16 MiB, in ordinary RAM. SeaBIOS starts from the BIOS ROM
 *   region (0xc0000-0xfffff), where writes are lost until make_bios_writable(), and its own
 *   allocator is not up until malloc_preinit(): a fixed RAM address is writable from the first
 *   instruction, and e820 marks it reserved so neither SeaBIOS's allocator nor the OS reuses
 *   it. Below 16 MiB + 1 MiB every address has bit 20 clear, so the A20 gate cannot alias it.
 * - The handle sits right after the block, in the same reserved RAM, for the same reason.
 * - One producer: only SeaBIOS's POST and boot path (one CPU) records. Its 32-bit code runs with
 *   interrupts off; an interrupt handler's 32-bit code (with function tracing) runs only while
 *   POST waits in 16-bit mode, never inside a record call.
 */
#include "types.h"   /* u8..u64, size_t */
#include "output.h"  /* dprintf */
#include "e820map.h" /* e820_add, E820_RESERVED */
#include "util.h"    /* the prototypes vmtsync.patch adds */
#include "x86.h"     /* outw, outl */

/* SeaBIOS has no <stdint.h> types; the recorder needs them. */
typedef u8 uint8_t;
typedef u16 uint16_t;
typedef u32 uint32_t;
typedef u64 uint64_t;
typedef s32 int32_t;
typedef u32 uintptr_t;
#define VMTSYNC_HAVE_STDINT

/* Guest-physical address and size of the reserved region (the host test reads it there). */
#define VMTSYNC_FW_BASE 0x01000000u
#ifdef VMTSYNC_FW_FUNCS
/* Function tracing (vmtsync-functions.patch builds the 32-bit flat code with
 * -finstrument-functions and -DVMTSYNC_FW_FUNCS): a flight ring of 65536 records (2 MiB), which
 * a live reader drains long before it wraps. It reaches past 17 MiB, where bit 20 is set: sound,
 * because SeaBIOS enables A20 on every entry to 32-bit mode (romlayout.S, transition32), the
 * only mode that records. Slots are not cleared (VMTSYNC_KEEP_SLOTS): 2 MiB of stores take
 * seconds where ring 0 is emulated, and a reader never reads a slot at or above the head. */
#define VMTSYNC_FW_SIZE 0x00210000u
#define VMTSYNC_FW_CAPACITY 65536
#define VMTSYNC_FW_MODE VMTSYNC_MODE_OVERWRITE
#define VMTSYNC_KEEP_SLOTS
#else
#define VMTSYNC_FW_SIZE 0x00010000u
/* One ring (SeaBIOS records on its boot CPU only), far more records than one boot makes. */
#define VMTSYNC_FW_CAPACITY 1024
#define VMTSYNC_FW_MODE VMTSYNC_MODE_STOP_WHEN_FULL
#endif
/* The sync beacon's port: nothing on QEMU's -M pc decodes 0x2400 (ISA devices sit below
 * 0x1000, the PIIX4 power-management and SMBus blocks at 0x600 and 0x700, and SeaBIOS gives
 * PCI I/O BARs 0xc000 and up), so each access is a plain exit the host traces as kvm_pio. */
#define VMTSYNC_FW_BEACON_PORT 0x2400
/* The -finstrument-functions hooks record on the recorder below, on vCPU 0, only while
 * vmtsync_fw_hooks_on() (further down) says so. */
#ifdef VMTSYNC_FW_FUNCS
#define VMTSYNC_PROFILE_HOOKS
#define VMTSYNC_PROFILE_REC() (vmtsync_fw_hooks_on() ? vmtsync_fw_rec() : NULL)
#include "vmtsync.h"
static inline VMTSYNC_NOINSTR_ int vmtsync_fw_hooks_on(void);
static inline VMTSYNC_NOINSTR_ struct vmtsync_rec *vmtsync_fw_rec(void);
#endif
#include "vmtsync.c"

/* Event id of a boot attempt (payload: the sequence number, 4 bytes). POST phases are span
 * records (VMTSYNC_SPAN_BEGIN_ID and _END_ID, payload: the phase's name). */
#define VMTSYNC_FW_BOOT 2
/* Event ids around SeaBIOS's writes to fw_cfg's ports (docs/firmware.md, "Checking against
 * fw_cfg's exits"): one before and one after each write to the selector (0x510) and to the DMA
 * address's low half (0x518, the write that starts a DMA transfer); payload: the step number,
 * 8 bytes. */
#define VMTSYNC_FW_CFG_CTL_BEFORE 3
#define VMTSYNC_FW_CFG_CTL_AFTER 4
#define VMTSYNC_FW_CFG_DMA_BEFORE 5
#define VMTSYNC_FW_CFG_DMA_AFTER 6

/* The glue's state, beside the handle in the reserved RAM (RAM keeps it across a reset, so
 * vmtsync_fw_init sets it afresh on every POST): the next step number of each fw_cfg port, the
 * open phase's name (NUL-terminated; "" when none), and whether the function hooks have
 * stopped. */
struct vmtsync_fw_steps {
    u64 next_ctl, next_dma;
    char phase[VMTSYNC_MAX_PAYLOAD + 1];
    u8 hooks_done;
};

_Static_assert(VMTSYNC_STORAGE_BYTES(1, VMTSYNC_FW_CAPACITY) + sizeof(struct vmtsync_rec) <=
                   VMTSYNC_FW_SIZE,
               "the block and its handle fit the reserved region");
_Static_assert(VMTSYNC_STORAGE_BYTES(1, VMTSYNC_FW_CAPACITY) + sizeof(struct vmtsync_rec) +
                       sizeof(struct vmtsync_fw_steps) <=
                   VMTSYNC_FW_SIZE,
               "the step counters fit the reserved region too");

static inline VMTSYNC_NOINSTR_ struct vmtsync_rec *vmtsync_fw_rec(void)
{
    return (struct vmtsync_rec *)(VMTSYNC_FW_BASE +
                                  VMTSYNC_STORAGE_BYTES(1, VMTSYNC_FW_CAPACITY));
}

static inline VMTSYNC_NOINSTR_ struct vmtsync_fw_steps *vmtsync_fw_steps(void)
{
    return (struct vmtsync_fw_steps *)(VMTSYNC_FW_BASE +
                                       VMTSYNC_STORAGE_BYTES(1, VMTSYNC_FW_CAPACITY) +
                                       sizeof(struct vmtsync_rec));
}

/* Writes `value` (`width` 2 or 4 bytes) to fw_cfg's `port` between two events that carry the
 * write's step number. The host cannot see a step number in what SeaBIOS writes (a selector
 * key, a DMA address), so both sides number the port's writes alike from the first one:
 * each write is the smallest number above the previous one whose low byte is the low byte
 * written (the first: its low byte), which is how `vmtsync validate` numbers the `out`s of
 * its host trace. No other I/O on `port` lies between an event and its write. */
void vmtsync_fw_out(u32 value, u16 port, int width)
{
    struct vmtsync_fw_steps *st = vmtsync_fw_steps();
    int dma = port != 0x510;
    u64 *next = dma ? &st->next_dma : &st->next_ctl;
    u64 step = *next + (u8)((u8)value - (u8)*next);
    *next = step + 1;
    vmtsync_record(vmtsync_fw_rec(), 0,
                   dma ? VMTSYNC_FW_CFG_DMA_BEFORE : VMTSYNC_FW_CFG_CTL_BEFORE, &step,
                   sizeof(step));
    if (width == 2)
        outw(value, port);
    else
        outl(value, port);
    vmtsync_record(vmtsync_fw_rec(), 0, dma ? VMTSYNC_FW_CFG_DMA_AFTER : VMTSYNC_FW_CFG_CTL_AFTER,
                   &step, sizeof(step));
}

#ifdef VMTSYNC_FW_FUNCS
/* Whether this POST laid its recorder out: set by each phase, in the BIOS's own data
 * (0xe0000-0xfffff), which holds the ROM's 0 at power-on (its stores are lost until
 * make_bios_writable()) and again once SeaBIOS's reboot path restored its pristine image. A
 * reset alone keeps it: QEMU leaves the shadowed BIOS as it was, so SeaBIOS first runs its
 * reboot path (handle_resume32, which vmtsync-functions.patch makes call vmtsync_fw_stop). */
static int vmtsync_fw_hooks_ready;

/* The hooks record once this POST's recorder is ready, until the first boot attempt (so that
 * the counts printed there are final; boot attempts record their own events) or a reset. RAM
 * at 16 MiB, where the stop is kept, survives the reset with the last recorder in it: without
 * the stop, the reboot path would record into the last boot's recording. */
static inline VMTSYNC_NOINSTR_ int vmtsync_fw_hooks_on(void)
{
    return vmtsync_fw_hooks_ready && !vmtsync_fw_steps()->hooks_done;
}
#endif

/* Stops the function hooks until the next POST lays its recorder out: SeaBIOS's reboot path
 * after a reset (handle_resume32) calls it first. */
void vmtsync_fw_stop(void)
{
    vmtsync_fw_steps()->hooks_done = 1;
}

/* Ends the open phase, if any, then begins phase `name` (at most 16 bytes kept), then a beacon:
 * POST's phases follow one another, each one's begin ending the one before. */
void vmtsync_fw_phase(const char *name)
{
    struct vmtsync_fw_steps *st = vmtsync_fw_steps();
    u32 len = 0;
    if (st->phase[0])
        vmtsync_span_end(vmtsync_fw_rec(), 0, st->phase);
    vmtsync_span_begin(vmtsync_fw_rec(), 0, name);
    while (len < VMTSYNC_MAX_PAYLOAD && name[len]) {
        st->phase[len] = name[len];
        len++;
    }
    st->phase[len] = 0;
#ifdef VMTSYNC_FW_FUNCS
    vmtsync_fw_hooks_ready = 1;
#endif
    vmtsync_beacon(vmtsync_fw_rec(), 0);
}

/* Records where SeaBIOS moved its init code (reloc_preinit): code linked at `link` runs at
 * `runtime` from now on, so the host can name its functions from the image's symbols. */
void vmtsync_fw_reloc(u32 link, u32 runtime, u32 len)
{
    vmtsync_reloc(vmtsync_fw_rec(), 0, link, runtime, len);
}

/* Lays out and publishes the recorder (a new nonce on every POST, so a reader sees a reset
 * as a new recording), then records the first phase. */
void vmtsync_fw_init(void)
{
    struct vmtsync_rec *r = vmtsync_fw_rec();
    /* RAM keeps its contents across a reset: every POST numbers fw_cfg's writes from 0. */
    vmtsync_fw_steps()->next_ctl = 0;
    vmtsync_fw_steps()->next_dma = 0;
    vmtsync_fw_steps()->phase[0] = 0;
    vmtsync_fw_steps()->hooks_done = 0;
    if (vmtsync_init(r, (void *)VMTSYNC_FW_BASE, VMTSYNC_STORAGE_BYTES(1, VMTSYNC_FW_CAPACITY),
                     1, VMTSYNC_FW_CAPACITY, VMTSYNC_FW_MODE) == VMTSYNC_OK)
        vmtsync_publish(r, 0, 0, VMTSYNC_CLOCK_RAW_TSC, VMTSYNC_FW_BEACON_PORT);
    vmtsync_fw_phase("post");
}

/* Keeps the region out of SeaBIOS's allocator and the OS's RAM: call after the RAM's own e820
 * entries exist (qemu_preinit) and before malloc_preinit. */
void vmtsync_fw_reserve(void)
{
    e820_add(VMTSYNC_FW_BASE, VMTSYNC_FW_SIZE, E820_RESERVED);
}

/* Ends the last phase (at the first attempt), records boot attempt `seq`, then a beacon, and
 * prints the recorder's own counts on the debug console: every record stored so far (events
 * and beacons) and every one refused. From here on the function hooks record nothing, so the
 * last attempt's counts are final. */
void vmtsync_fw_boot(int seq)
{
    struct vmtsync_rec *r = vmtsync_fw_rec();
    struct vmtsync_fw_steps *st = vmtsync_fw_steps();
    u32 s = seq;
    st->hooks_done = 1;
    if (st->phase[0]) {
        vmtsync_span_end(r, 0, st->phase);
        st->phase[0] = 0;
    }
    vmtsync_record(r, 0, VMTSYNC_FW_BOOT, &s, sizeof(s));
    vmtsync_beacon(r, 0);
    dprintf(1, "vmtsync: boot attempt %d produced %u refused %u\n", seq,
            (u32)vmtsync_produced(r, 0), (u32)vmtsync_refused(r, 0));
}
