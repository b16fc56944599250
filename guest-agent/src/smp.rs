//! The application processors: bring-up (INIT-SIPI-SIPI), parking, and TSC reads on request.
//!
//! How many vCPUs there are comes from QEMU's fw_cfg (`FW_CFG_NB_CPUS`, I/O ports 0x510/0x511,
//! checked by its "QEMU" signature); without fw_cfg (the built-in VMM) the agent stays on one
//! vCPU. The APs are started all at once with the "all excluding self" shorthand, so their APIC
//! ids need no table: each AP takes the next [`Slot`] and writes its own id (CPUID.1:EBX[31:24])
//! there. An AP comes up in real mode at [`TRAMPOLINE`], a page below 1 MiB the BSP copies the
//! trampoline to and patches with its own GDTR and CR3; the trampoline goes straight to long
//! mode on the BSP's GDT and page tables and each AP gets its own 4 KiB stack.
//!
//! APs stay in ring 0 (they `hlt`, which ring 3 cannot) and never spin: ring-0 code is emulated
//! on the project's nested KVM, and a spinning AP would burn a host core. An AP waits in
//! `sti; hlt` with interrupts enabled for exactly that instruction (no request can slip in
//! between the check and the halt: `sti` holds interrupts off for one more instruction) and
//! is woken by a fixed IPI ([`WAKE_VECTOR`]) that the BSP sends through the xAPIC's ICR, which
//! its ring-3 protocol loop can write (every page is user-accessible). The request travels in
//! the AP's [`Slot`]: the BSP bumps `request`, the AP reads its TSC through its own skew, stores
//! it, then publishes `done = request` (release); the BSP waits for that (acquire) and only
//! then sends the reply. The AP's read is after the request arrived and before the reply
//! leaves: docs/smp.md has the argument. With `syncport=N` each AP brackets its own read by
//! an `in` and an `out` of the probe's sequence number on that port.

use core::arch::{asm, global_asm};
use core::cell::UnsafeCell;
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::boot::{enter_long_mode, load_data_segments};

use vmtsync_agent::events::AP_PROBE_EVENT;
use vmtsync_agent::options::{MAX_VCPUS, Options};
use vmtsync_agent::port::outw;
use vmtsync_agent::tsc::{Skew, SkewedTsc};
use vmtsync_core::GuestTicks;
use vmtsync_core::agent::AgentClock;
use vmtsync_core::arch::x86_64::NativeTsc;
use vmtsync_core::arch::{PortIo as _, Tsc};
use vmtsync_core::proto::PvclockReport;

/// The SIPI vector: the page number of the real-mode trampoline, a page below 1 MiB that
/// neither the agent (above 1 MiB) nor the PVH loader's data use.
const TRAMPOLINE_PAGE: u32 = 0x08;
/// Physical address of the trampoline.
const TRAMPOLINE: usize = (TRAMPOLINE_PAGE as usize) << 12;
/// The IPI vector that wakes a parked AP.
const WAKE_VECTOR: u32 = 0x30;
/// The local APIC's spurious-interrupt vector (its handler does not EOI).
const SPURIOUS_VECTOR: u32 = 0x3f;
/// IDT entries: the wake and spurious vectors are the highest used. Any exception still ends
/// the VM (a not-present gate escalates to a triple fault), as before there was an IDT.
const IDT_ENTRIES: usize = 64;
/// Application processors served at most.
const MAX_APS: usize = MAX_VCPUS - 1;
/// Each AP's ring-0 stack.
const AP_STACK: usize = 4096;

/// The xAPIC's registers (the APIC base MSR's reset value; KVM and QEMU keep it).
const APIC_BASE: usize = 0xfee0_0000;
const APIC_EOI: usize = 0xb0;
const APIC_SVR: usize = 0xf0;
const APIC_ICR_LOW: usize = 0x300;
const APIC_ICR_HIGH: usize = 0x310;
/// ICR: "all excluding self" shorthand, INIT, level assert.
const ICR_INIT_OTHERS: u32 = 0x000c_4500;
/// ICR: "all excluding self" shorthand, start-up, vector = trampoline page.
const ICR_SIPI_OTHERS: u32 = 0x000c_4600 | TRAMPOLINE_PAGE;

/// QEMU fw_cfg's I/O selector and data ports, and the keys read.
const FW_CFG_SELECTOR: u16 = 0x510;
const FW_CFG_DATA: u16 = 0x511;
const FW_CFG_SIGNATURE: u16 = 0x0000;
const FW_CFG_NB_CPUS: u16 = 0x0005;

/// One AP's mailbox. Written by the BSP (`seq`, `request`) and by its AP (`apic_id`, `tsc`,
/// `done`); 64-byte aligned so two APs never share a cache line.
#[repr(C, align(64))]
struct Slot {
    /// The AP's APIC id plus one; 0 while the AP has not checked in.
    apic_id: AtomicU32,
    /// Bumped by the BSP for each TSC read it asks for.
    request: AtomicU32,
    /// The last request the AP answered; `tsc` belongs to it.
    done: AtomicU32,
    /// The probe's sequence number, written before `request`: the AP's sync-port `out`.
    seq: AtomicU32,
    /// The skewed TSC the AP read for request `done`.
    tsc: AtomicU64,
}

impl Slot {
    const fn new() -> Self {
        Self {
            apic_id: AtomicU32::new(0),
            request: AtomicU32::new(0),
            done: AtomicU32::new(0),
            seq: AtomicU32::new(0),
            tsc: AtomicU64::new(0),
        }
    }
}

static SLOTS: [Slot; MAX_APS] = [const { Slot::new() }; MAX_APS];

/// The next free slot; the trampoline's long-mode entry takes one per AP (`lock xadd`).
static AP_NEXT: AtomicU32 = AtomicU32::new(0);

/// The boot options, for each AP to find its own skew (`skewN=`).
struct SharedOptions(UnsafeCell<Option<Options>>);

// SAFETY: written once by the BSP before it sends the INIT IPI, and only read after that by
// APs, which start running only after the IPI (x86 stores become visible in program order,
// the ICR write included).
unsafe impl Sync for SharedOptions {}

static OPTIONS: SharedOptions = SharedOptions(UnsafeCell::new(None));

/// The IDT the APs load: gates for [`WAKE_VECTOR`] and [`SPURIOUS_VECTOR`], filled by the BSP.
static IDT: [[AtomicU64; 2]; IDT_ENTRIES] =
    [const { [AtomicU64::new(0), AtomicU64::new(0)] }; IDT_ENTRIES];

unsafe extern "C" {
    static ap_trampoline: u8;
    static ap_trampoline_end: u8;
    fn ap_wake_isr();
    fn ap_spurious_isr();
}

/// The vCPUs the agent serves: itself and the APs that checked in.
#[derive(Debug, Clone, Copy)]
pub struct Vcpus {
    bsp: u32,
    aps: usize,
    /// TSC ticks the BSP waits for an AP's answer.
    deadline: u64,
}

impl Vcpus {
    /// Bit `i` set for every vCPU (APIC id `i`) that answers.
    pub fn online(&self) -> u64 {
        let mut bits = 1u64.checked_shl(self.bsp).unwrap_or(0);
        for s in &SLOTS[..self.aps] {
            let id = s.apic_id.load(Ordering::Acquire);
            if id != 0 {
                bits |= 1u64.checked_shl(id - 1).unwrap_or(0);
            }
        }
        bits
    }

    /// Asks AP `vcpu` to read its own (skewed) TSC for probe `seq` and returns it; `None` for
    /// an unknown vCPU or one that did not answer within the deadline. Runs in ring 3 or 0 on
    /// the BSP.
    pub fn read_on(&self, vcpu: u32, seq: u8) -> Option<u64> {
        // The host names the vCPU: 0xff would be the xAPIC broadcast destination (and
        // u32::MAX + 1 the "not checked in" id), so only smaller ids are looked for.
        if vcpu >= 0xff {
            return None;
        }
        let slot = SLOTS[..self.aps]
            .iter()
            .find(|s| s.apic_id.load(Ordering::Acquire) == vcpu.wrapping_add(1))?;
        let req = slot.request.load(Ordering::Relaxed).wrapping_add(1);
        slot.seq.store(u32::from(seq), Ordering::Relaxed);
        // Release: the AP that sees the new request sees everything before it.
        slot.request.store(req, Ordering::Release);
        send_ipi(vcpu, WAKE_VECTOR);
        let tsc = NativeTsc::lfence_rdtsc();
        let start = tsc.read_ordered();
        // The AP answers within microseconds; the BSP's wait runs in ring 3 (natively) and is
        // bounded, so a wedged AP costs one refused probe, never a hang.
        while slot.done.load(Ordering::Acquire) != req {
            if tsc.read_ordered().wrapping_sub(start) > self.deadline {
                return None;
            }
            core::hint::spin_loop();
        }
        Some(slot.tsc.load(Ordering::Relaxed))
    }
}

/// Writes the xAPIC register at `off`.
fn apic_write(off: usize, v: u32) {
    // SAFETY: the xAPIC page is identity-mapped (boot.rs maps 4 GiB, user-accessible) and
    // KVM intercepts it; the registers written here are the ICR, SVR and EOI.
    unsafe { core::ptr::write_volatile((APIC_BASE + off) as *mut u32, v) }
}

/// Sends a fixed IPI with `vector` to APIC id `dest` (physical destination).
fn send_ipi(dest: u32, vector: u32) {
    apic_write(APIC_ICR_HIGH, dest << 24);
    apic_write(APIC_ICR_LOW, vector);
}

/// The vCPU count from QEMU's fw_cfg, or 1 when there is no fw_cfg.
fn fw_cfg_cpus() -> u32 {
    let ports = crate::native_ports();
    let inb = |port| ports.inb(port);
    outw(FW_CFG_SELECTOR, FW_CFG_SIGNATURE);
    let sig = [
        inb(FW_CFG_DATA),
        inb(FW_CFG_DATA),
        inb(FW_CFG_DATA),
        inb(FW_CFG_DATA),
    ];
    if &sig != b"QEMU" {
        return 1;
    }
    outw(FW_CFG_SELECTOR, FW_CFG_NB_CPUS);
    let n = u32::from(inb(FW_CFG_DATA)) | (u32::from(inb(FW_CFG_DATA)) << 8);
    n.max(1)
}

/// One 16-byte 64-bit interrupt gate to `handler` on the 64-bit code segment (0x08).
fn set_gate(vector: u32, handler: usize) {
    let h = handler as u64;
    let low = (h & 0xffff) | (0x08 << 16) | (0x8e << 40) | ((h >> 16 & 0xffff) << 48);
    let gate = &IDT[vector as usize];
    gate[0].store(low, Ordering::Relaxed);
    gate[1].store(h >> 32, Ordering::Relaxed);
}

/// Starts the APs fw_cfg reports and waits (bounded) until they checked in. Ring 0, on the
/// BSP, before the protocol loop; `khz` times the waits (1 GHz assumed when unknown).
pub fn start(opts: &Options, bsp: u32, khz: Option<u32>) -> Vcpus {
    let khz = u64::from(khz.unwrap_or(1_000_000));
    let mut v = Vcpus {
        bsp,
        aps: 0,
        deadline: khz * 50,
    };
    let n = fw_cfg_cpus();
    if n <= 1 {
        return v;
    }
    let want = usize::try_from(n - 1).unwrap_or(MAX_APS).min(MAX_APS);
    // SAFETY: no AP runs yet (see `SharedOptions`).
    unsafe { *OPTIONS.0.get() = Some(*opts) };
    set_gate(WAKE_VECTOR, ap_wake_isr as *const () as usize);
    set_gate(SPURIOUS_VECTOR, ap_spurious_isr as *const () as usize);

    let src = &raw const ap_trampoline;
    let len = (&raw const ap_trampoline_end as usize) - (src as usize);
    let mut gdtr = [0u8; 10];
    let cr3: u64;
    // SAFETY: ring 0 (kmain): `sgdt` stores 10 bytes into `gdtr`, reading CR3 has no effects.
    // The copy writes `len` bytes (under a page) of identity-mapped RAM at TRAMPOLINE, which
    // nothing else uses, then patches the GDTR (limit, 32-bit base: the GDT is below 4 GiB)
    // at offset 8 and CR3 at offset 16, where the trampoline keeps them.
    unsafe {
        asm!("sgdt [{}]", in(reg) gdtr.as_mut_ptr(), options(nostack));
        asm!("mov {}, cr3", out(reg) cr3, options(nomem, nostack));
        let dst = TRAMPOLINE as *mut u8;
        core::ptr::copy_nonoverlapping(src, dst, len);
        core::ptr::copy_nonoverlapping(gdtr.as_ptr(), dst.add(8), 6);
        #[allow(clippy::cast_possible_truncation)]
        core::ptr::write_volatile(dst.add(16).cast::<u32>(), cr3 as u32);
    }
    // The BSP's APIC must be software-enabled to send and take part in IPIs.
    apic_write(APIC_SVR, 0x100 | SPURIOUS_VECTOR);
    let tsc = NativeTsc::lfence_rdtsc();
    // INIT, then two SIPIs (the second is ignored by an AP the first started), 10 ms apart:
    // the spacing the MP start-up protocol asks for after INIT, kept for the SIPIs too (one
    // wait in one loop keeps this boot-only code small). KVM delivers each IPI before the ICR
    // write returns, so there is no delivery status to poll.
    for icr in [ICR_INIT_OTHERS, ICR_SIPI_OTHERS, ICR_SIPI_OTHERS] {
        apic_write(APIC_ICR_HIGH, 0);
        apic_write(APIC_ICR_LOW, icr);
        let sent = tsc.read_ordered();
        while tsc.read_ordered().wrapping_sub(sent) < khz * 10 {
            core::hint::spin_loop();
        }
    }
    // Real mode to long mode is ~40 emulated instructions per AP; a second is plenty even
    // with four vCPUs on two loaded host cores.
    let start = tsc.read_ordered();
    while SLOTS[..want]
        .iter()
        .any(|s| s.apic_id.load(Ordering::Acquire) == 0)
        && tsc.read_ordered().wrapping_sub(start) < khz * 1000
    {
        core::hint::spin_loop();
    }
    v.aps = want;
    v
}

/// An AP's life in ring 0 after the trampoline: check in, then answer requests, parked in
/// `hlt` between them.
#[unsafe(no_mangle)]
extern "C" fn ap_main(index: u32) -> ! {
    let Some(slot) = SLOTS.get(index as usize) else {
        vmtsync_agent::port::halt_forever()
    };
    let idtr: [u16; 5] = {
        let base = IDT.as_ptr() as u64;
        #[allow(clippy::cast_possible_truncation)]
        [
            (IDT_ENTRIES * 16 - 1) as u16,
            base as u16,
            (base >> 16) as u16,
            (base >> 32) as u16,
            (base >> 48) as u16,
        ]
    };
    // SAFETY: ring 0; `idtr` is a valid 10-byte pseudo-descriptor of IDT, which lives forever.
    unsafe { asm!("lidt [{}]", in(reg) idtr.as_ptr(), options(nostack, readonly)) };
    apic_write(APIC_SVR, 0x100 | SPURIOUS_VECTOR);
    let cpuid = vmtsync_core::arch::x86_64::NativeCpuid;
    let id = vmtsync_core::arch::Cpuid::cpuid(&cpuid, 1, 0).ebx >> 24;
    // SAFETY: the BSP wrote OPTIONS before starting this AP and never writes it again.
    let opts = unsafe { &*OPTIONS.0.get() }.as_ref();
    let skew = opts.map_or(Skew::IDENTITY, |o| o.skew_of(id));
    let sync_port = opts.and_then(|o| o.sync_port);
    let events = opts.map_or(0, |o| o.events);
    let mut recorded = 0u32;
    let tsc = NativeTsc::lfence_rdtsc();
    slot.apic_id.store(id + 1, Ordering::Release);
    loop {
        // SAFETY: ring 0; interrupts off while the slot is checked (see the module docs).
        unsafe { asm!("cli", options(nomem, nostack)) };
        let req = slot.request.load(Ordering::Acquire);
        if req == slot.done.load(Ordering::Relaxed) {
            // SAFETY: ring 0 with the IDT above loaded: the wake IPI lands in `ap_wake_isr`,
            // which EOIs and returns here; `sti` delays it until `hlt` has begun.
            unsafe { asm!("sti", "hlt", options(nomem, nostack)) };
            continue;
        }
        // The TSC read: after the request was seen (lfence orders it after that load), before
        // `done` is published (a store never becomes visible before earlier instructions
        // retire). With `syncport=N` this vCPU's own `in`/`out` bracket it, so the host's
        // kvm_pio exits of this vCPU's thread do (docs/smp.md); the skew comes after the `out`.
        #[allow(clippy::cast_possible_truncation)]
        let seq = slot.seq.load(Ordering::Relaxed) as u8;
        let raw = match sync_port {
            Some(port) => {
                let ports = crate::native_ports();
                let _ = ports.inb(port);
                let raw = tsc.read_ordered();
                ports.outb(port, seq);
                raw
            }
            None => tsc.read_ordered(),
        };
        let t = skew.apply(raw);
        slot.tsc.store(t, Ordering::Relaxed);
        slot.done.store(req, Ordering::Release);
        // `events=N`: one event per probe answered, on this vCPU's own ring and clock, after
        // the answer is published (so it costs the probe nothing). This AP is the ring's only
        // producer; a full ring counts it as dropped.
        if recorded < events {
            recorded += 1;
            let stamp = SkewedTsc { tsc, skew };
            let _ = crate::AP_EVENTS
                .ring(id as usize)
                .map(|r| r.record(&stamp, AP_PROBE_EVENT, &[seq]));
        }
    }
}

// The trampoline (copied to TRAMPOLINE, so it addresses its own data there): real mode → long
// mode in one step (PAE, CR3, EFER.LME, then PE and PG together), far jump to the 64-bit code
// segment of the BSP's GDT. Offsets 8 (GDTR) and 16 (CR3) are patched by `start`. The 64-bit
// part takes a slot index and a stack and calls `ap_main`; too many APs halt for good.
global_asm!(
    r#"
    .section .text.ap_trampoline, "ax"
    .code16
    .global ap_trampoline
    .global ap_trampoline_end
ap_trampoline:
    cli
    jmp 1f
    .balign 8
    .word 0
    .long 0
    .balign 8
    .long 0
1:
    xorw %ax, %ax
    movw %ax, %ds
    "#,
    enter_long_mode!("{tramp} + 8", "{tramp} + 16", "ap_long_entry"),
    r#"
ap_trampoline_end:

    .section .text.ap_entry, "ax"
    .code64
ap_long_entry:
    "#,
    load_data_segments!(),
    r#"
    movl $1, %eax
    lock xaddl %eax, {next}(%rip)
    cmpl ${max_aps}, %eax
    jae 2f
    leal 1(%eax), %ecx
    imull ${ap_stack}, %ecx, %ecx
    leaq ap_stacks(%rip), %rsp
    addq %rcx, %rsp
    movl %eax, %edi
    call ap_main
2:
    cli
    hlt
    jmp 2b

    .global ap_wake_isr
ap_wake_isr:
    pushq %rax
    movabsq ${eoi}, %rax
    movl $0, (%rax)
    popq %rax
    iretq

    .global ap_spurious_isr
ap_spurious_isr:
    iretq

    .section .ap_stacks, "aw", @nobits
    .balign 16
ap_stacks:
    .skip {stacks}
    "#,
    tramp = const TRAMPOLINE,
    next = sym AP_NEXT,
    max_aps = const MAX_APS,
    eoi = const APIC_BASE + APIC_EOI,
    ap_stack = const AP_STACK,
    stacks = const AP_STACK * MAX_APS,
    options(att_syntax)
);

/// The agent's clock on an SMP guest: the BSP's `GuestClock` for everything it reads itself,
/// and the APs for [`AgentClock::read_tsc_on`].
#[derive(Debug)]
pub struct SmpClock<C> {
    /// The BSP's own clock.
    pub bsp: C,
    /// The vCPUs that checked in.
    pub vcpus: Vcpus,
}

impl<C: AgentClock> AgentClock for SmpClock<C> {
    #[inline]
    fn read_tsc(&mut self) -> GuestTicks {
        self.bsp.read_tsc()
    }

    fn vcpu_id(&self) -> u32 {
        self.bsp.vcpu_id()
    }

    fn tsc_khz(&self) -> Option<u32> {
        self.bsp.tsc_khz()
    }

    fn pvclock(&mut self) -> Option<PvclockReport> {
        self.bsp.pvclock()
    }

    fn invariant_tsc(&self) -> bool {
        self.bsp.invariant_tsc()
    }

    #[inline]
    fn read_tsc_for_probe(&mut self, seq: u8) -> GuestTicks {
        self.bsp.read_tsc_for_probe(seq)
    }

    fn sync_port(&self) -> bool {
        self.bsp.sync_port()
    }

    fn vcpus(&self) -> u64 {
        self.vcpus.online()
    }

    fn read_tsc_on(&mut self, vcpu: u32, seq: u8) -> Option<GuestTicks> {
        if vcpu == self.bsp.vcpu_id() {
            return Some(self.bsp.read_tsc_for_probe(seq));
        }
        self.vcpus.read_on(vcpu, seq).map(GuestTicks)
    }
}
