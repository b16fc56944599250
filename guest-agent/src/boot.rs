//! PVH boot: the Xen ELF note that names the 32-bit entry, the entry itself, and the switch to
//! long mode.
//!
//! A PVH loader (QEMU `-kernel`, linux-loader in our built-in VMM) enters `pvh_start32` in 32-bit
//! protected mode with paging off, flat segments, and `ebx` = physical address of the
//! `hvm_start_info` (Xen `arch-x86/hvm/start_info.h`). There is no stack. The entry enables PAE,
//! loads pre-built identity page tables (4 GiB in 2 MiB pages, initialised in `.data` so nothing
//! large is zeroed at run time: ring-0 code is emulated slowly on the project's machines),
//! sets EFER.LME, turns on paging, and far-jumps into a 64-bit code segment that calls
//! [`crate::kmain`] with the start-info address.
//!
//! [`enter_ring3`] then drops to CPL 3 with IOPL 3 (boot option `ring=3`, the default): on the
//! project's nested KVM, ring-0 guest code is emulated one instruction at a time (~1 µs each)
//! while ring-3 code runs natively (see docs/host-quirks.md), and IOPL 3 keeps port I/O (the UARTs,
//! isa-debug-exit) available there. All pages are mapped user-accessible for this, the GDT has
//! DPL-3 code and data segments, and nothing ever returns to ring 0 (there is no IDT: any
//! exception is a triple fault, which the VMM reports as a shutdown).

use core::arch::{asm, global_asm};

/// The switch to long mode that the BSP's 32-bit entry and the APs' 16-bit trampoline share, as
/// AT&T assembly text for `global_asm!`: load the GDT from pseudo-descriptor `$gdtr`, enable PAE,
/// load CR3 from `$cr3` (an immediate or a memory operand), set EFER.LME, then turn on protection
/// and paging together (a no-op for PE when already in protected mode) and far-jump to `$entry`
/// in the GDT's 64-bit code segment (selector 0x08). Both paths assemble the same instructions
/// from this one text, so they cannot drift apart; the assembler's current `.code16`/`.code32`
/// mode picks the operand-size prefixes.
macro_rules! enter_long_mode {
    ($gdtr:literal, $cr3:literal, $entry:literal) => {
        concat!(
            "lgdtl ",
            $gdtr,
            "\n",
            "movl %cr4, %eax\n",
            "orl $0x20, %eax\n",
            "movl %eax, %cr4\n",
            "movl ",
            $cr3,
            ", %eax\n",
            "movl %eax, %cr3\n",
            "movl $0xC0000080, %ecx\n",
            "rdmsr\n",
            "orl $0x100, %eax\n",
            "wrmsr\n",
            "movl %cr0, %eax\n",
            "orl $0x80000001, %eax\n",
            "movl %eax, %cr0\n",
            "ljmpl $0x08, $",
            $entry,
            "\n",
        )
    };
}
pub(crate) use enter_long_mode;

/// The first 64-bit instructions after [`enter_long_mode`]'s far jump, shared the same way: the
/// flat data segment (selector 0x10) in DS, ES and SS, and null FS and GS. They clobber `eax`.
macro_rules! load_data_segments {
    () => {
        concat!(
            "movl $0x10, %eax\n",
            "movl %eax, %ds\n",
            "movl %eax, %es\n",
            "movl %eax, %ss\n",
            "xorl %eax, %eax\n",
            "movl %eax, %fs\n",
            "movl %eax, %gs\n",
        )
    };
}
pub(crate) use load_data_segments;

/// GDT selector of the DPL-3 data segment, with RPL 3.
const USER_DS: u64 = 0x18 | 3;
/// GDT selector of the DPL-3 64-bit code segment, with RPL 3.
const USER_CS: u64 = 0x20 | 3;
/// RFLAGS for ring 3: reserved bit 1, IOPL = 3 (bits 12-13), interrupts off.
const USER_RFLAGS: u64 = 0x3002;

unsafe extern "C" {
    /// Top of the ring-3 stack (link.ld).
    static __user_stack_top: u8;
}

/// Switches to CPL 3 with IOPL 3 on the ring-3 stack and calls `f(arg)` there, for good.
///
/// # Safety
/// Must run in ring 0 on the GDT and user-accessible page tables set up by this module, and
/// `arg` must stay valid forever (it lives on the ring-0 stack, which is never unwound).
pub unsafe fn enter_ring3(f: extern "C" fn(usize) -> !, arg: usize) -> ! {
    // Taking the address of a linker-provided symbol reads nothing (and needs no unsafe).
    let top = (&raw const __user_stack_top) as u64;
    // At a function's entry, rsp + 8 must be 16-byte aligned (as after a `call`).
    let user_rsp = (top & !0xf) - 8;
    // SAFETY: the frame pushed is a valid IRETQ frame to a DPL-3 64-bit code segment of our
    // GDT, on a user-accessible stack; `f` never returns, so nothing after `iretq` runs.
    unsafe {
        asm!(
            "mov ds, {ds:e}",
            "mov es, {ds:e}",
            "push {ds}",
            "push {rsp_user}",
            "push {flags}",
            "push {cs}",
            "push {entry}",
            "iretq",
            ds = in(reg) USER_DS,
            rsp_user = in(reg) user_rsp,
            flags = in(reg) USER_RFLAGS,
            cs = in(reg) USER_CS,
            entry = in(reg) f as usize,
            in("rdi") arg,
            options(noreturn)
        );
    }
}

// XEN_ELFNOTE_PHYS32_ENTRY = 18 (Xen `public/elfnote.h`). QEMU reads the descriptor of a 64-bit
// ELF as a u64, linux-loader reads its first 4 bytes: emit a `.quad`. The page-table entries use
// flags P|RW|US (0x7) for tables and P|RW|US|PS (0x87) for 2 MiB pages (US: ring 3 runs the
// agent). GDT entries: 0x08 64-bit code (0x00af9a000000ffff), 0x10 flat data
// (0x00cf92000000ffff), 0x18 DPL-3 data (0x00cff2000000ffff), 0x20 DPL-3 64-bit code
// (0x00affa000000ffff).
global_asm!(
    r#"
    .section .note.Xen, "a", @note
    .balign 4
    .long 4
    .long 8
    .long 18
    .asciz "Xen"
    .balign 4
    .quad pvh_start32
    .balign 4

    .section .text.boot, "ax"
    .code32
    .global pvh_start32
pvh_start32:
    cli
    cld
    movl %ebx, %esi

    movl $__bss_start, %edi
    movl $__bss_end, %ecx
    subl %edi, %ecx
    xorl %eax, %eax
    rep stosb

    "#,
    enter_long_mode!("boot_gdt_ptr", "$boot_pml4", "boot_long_entry"),
    r#"
    .code64
boot_long_entry:
    "#,
    load_data_segments!(),
    r#"
    movabsq $__stack_top, %rsp
    movl %esi, %edi
    call kmain
1:
    hlt
    jmp 1b

    .section .rodata.boot_gdt, "a"
    .balign 16
boot_gdt:
    .quad 0
    .quad 0x00af9a000000ffff
    .quad 0x00cf92000000ffff
    .quad 0x00cff2000000ffff
    .quad 0x00affa000000ffff
boot_gdt_end:
    .balign 4
boot_gdt_ptr:
    .word boot_gdt_end - boot_gdt - 1
    .long boot_gdt

    .section .data.pagetables, "aw"
    .balign 4096
boot_pml4:
    .quad boot_pdpt + 0x7
    .fill 511, 8, 0
boot_pdpt:
    .quad boot_pd + 0x7
    .quad boot_pd + 0x1007
    .quad boot_pd + 0x2007
    .quad boot_pd + 0x3007
    .fill 508, 8, 0
boot_pd:
    .set boot_pd_i, 0
    .rept 2048
    .quad (boot_pd_i << 21) | 0x87
    .set boot_pd_i, boot_pd_i + 1
    .endr
    "#,
    options(att_syntax)
);
