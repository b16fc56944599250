/*
 * vmtsync_seabios.c: SeaBIOS's glue to vmtsync's C recorder (capi/include/vmtsync.h and
 * capi/src/vmtsync.c). tests/launch's firmware build copies this file and the recorder's two
 * files into SeaBIOS's src/, and vmtsync.patch calls the functions below from post.c and boot.c.
 * docs/firmware.md explains the choices; the short version:
 *
 * - The ring sits at guest-physical 16 MiB, in ordinary RAM. SeaBIOS starts from the BIOS ROM
 *   region (0xc0000-0xfffff), where writes are lost until make_bios_writable(), and its own
 *   allocator is not up until malloc_preinit(): a fixed RAM address is writable from the first
 *   instruction, and e820 marks it reserved so neither SeaBIOS's allocator nor the OS reuses
 *   it. Below 16 MiB + 1 MiB every address has bit 20 clear, so the A20 gate cannot alias it.
 * - The handle sits right after the block, in the same reserved RAM, for the same reason.
 * - One producer: only SeaBIOS's POST and boot path (one CPU, no interrupt handler) records.
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
#include "vmtsync.c"

/* Guest-physical address and size of the reserved region (the host test reads it there). */
#define VMTSYNC_FW_BASE 0x01000000u
#define VMTSYNC_FW_SIZE 0x00010000u
/* One ring (SeaBIOS records on its boot CPU only), far more records than one boot makes. */
#define VMTSYNC_FW_CAPACITY 1024
/* The sync beacon's port: nothing on QEMU's -M pc decodes 0x2400 (ISA devices sit below
 * 0x1000, the PIIX4 power-management and SMBus blocks at 0x600 and 0x700, and SeaBIOS gives
 * PCI I/O BARs 0xc000 and up), so each access is a plain exit the host traces as kvm_pio. */
#define VMTSYNC_FW_BEACON_PORT 0x2400
/* Event ids: a POST phase (payload: its name) and a boot attempt (payload: the sequence
 * number, 4 bytes). */
#define VMTSYNC_FW_PHASE 1
#define VMTSYNC_FW_BOOT 2
/* Event ids around SeaBIOS's writes to fw_cfg's ports (docs/firmware.md, "Checking against
 * fw_cfg's exits"): one before and one after each write to the selector (0x510) and to the DMA
 * address's low half (0x518, the write that starts a DMA transfer); payload: the step number,
 * 8 bytes. */
#define VMTSYNC_FW_CFG_CTL_BEFORE 3
#define VMTSYNC_FW_CFG_CTL_AFTER 4
#define VMTSYNC_FW_CFG_DMA_BEFORE 5
#define VMTSYNC_FW_CFG_DMA_AFTER 6

/* The next step number of each port: kept beside the handle, in the reserved RAM. */
struct vmtsync_fw_steps {
    u64 next_ctl, next_dma;
};

_Static_assert(VMTSYNC_STORAGE_BYTES(1, VMTSYNC_FW_CAPACITY) + sizeof(struct vmtsync_rec) <=
                   VMTSYNC_FW_SIZE,
               "the block and its handle fit the reserved region");
_Static_assert(VMTSYNC_STORAGE_BYTES(1, VMTSYNC_FW_CAPACITY) + sizeof(struct vmtsync_rec) +
                       sizeof(struct vmtsync_fw_steps) <=
                   VMTSYNC_FW_SIZE,
               "the step counters fit the reserved region too");

static struct vmtsync_rec *vmtsync_fw_rec(void)
{
    return (struct vmtsync_rec *)(VMTSYNC_FW_BASE +
                                  VMTSYNC_STORAGE_BYTES(1, VMTSYNC_FW_CAPACITY));
}

static struct vmtsync_fw_steps *vmtsync_fw_steps(void)
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

/* Records a phase event named `name` (at most 16 bytes kept), then a beacon. */
void vmtsync_fw_phase(const char *name)
{
    u32 len = 0;
    while (len < VMTSYNC_MAX_PAYLOAD && name[len])
        len++;
    vmtsync_record(vmtsync_fw_rec(), 0, VMTSYNC_FW_PHASE, name, len);
    vmtsync_beacon(vmtsync_fw_rec(), 0);
}

/* Lays out and publishes the recorder (a new nonce on every POST, so a reader sees a reset
 * as a new recording), then records the first phase. */
void vmtsync_fw_init(void)
{
    struct vmtsync_rec *r = vmtsync_fw_rec();
    /* RAM keeps its contents across a reset: every POST numbers fw_cfg's writes from 0. */
    vmtsync_fw_steps()->next_ctl = 0;
    vmtsync_fw_steps()->next_dma = 0;
    if (vmtsync_init(r, (void *)VMTSYNC_FW_BASE, VMTSYNC_STORAGE_BYTES(1, VMTSYNC_FW_CAPACITY),
                     1, VMTSYNC_FW_CAPACITY, VMTSYNC_MODE_STOP_WHEN_FULL) == VMTSYNC_OK)
        vmtsync_publish(r, 0, 0, VMTSYNC_CLOCK_RAW_TSC, VMTSYNC_FW_BEACON_PORT);
    vmtsync_fw_phase("post");
}

/* Keeps the region out of SeaBIOS's allocator and the OS's RAM: call after the RAM's own e820
 * entries exist (qemu_preinit) and before malloc_preinit. */
void vmtsync_fw_reserve(void)
{
    e820_add(VMTSYNC_FW_BASE, VMTSYNC_FW_SIZE, E820_RESERVED);
}

/* Records boot attempt `seq`, then a beacon, and prints the recorder's own counts on the debug
 * console: every record stored so far (events and beacons) and every one refused. */
void vmtsync_fw_boot(int seq)
{
    struct vmtsync_rec *r = vmtsync_fw_rec();
    u32 s = seq;
    vmtsync_record(r, 0, VMTSYNC_FW_BOOT, &s, sizeof(s));
    vmtsync_beacon(r, 0);
    dprintf(1, "vmtsync: boot attempt %d produced %u refused %u\n", seq,
            (u32)vmtsync_produced(r, 0), (u32)vmtsync_refused(r, 0));
}
