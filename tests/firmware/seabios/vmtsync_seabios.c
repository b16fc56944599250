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

_Static_assert(VMTSYNC_STORAGE_BYTES(1, VMTSYNC_FW_CAPACITY) + sizeof(struct vmtsync_rec) <=
                   VMTSYNC_FW_SIZE,
               "the block and its handle fit the reserved region");

static struct vmtsync_rec *vmtsync_fw_rec(void)
{
    return (struct vmtsync_rec *)(VMTSYNC_FW_BASE +
                                  VMTSYNC_STORAGE_BYTES(1, VMTSYNC_FW_CAPACITY));
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
