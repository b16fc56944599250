//! The kernel's own PVH boot: the Xen ELF note naming the 32-bit entry, and the switch from
//! 32-bit protected mode to long mode.
//!
//! A PVH loader (QEMU `-kernel`) enters `pvh_start32` in 32-bit protected mode with paging
//! off, flat segments, no stack, and `ebx` = the physical address of the `hvm_start_info` (Xen
//! `public/arch-x86/hvm/start_info.h`). The entry zeroes `.bss`, enables PAE, loads page
//! tables that identity-map the first 1 GiB in 2 MiB pages (built by the assembler in `.data`,
//! so nothing large is written at run time), sets EFER.LME, enables paging and far-jumps to
//! a 64-bit code segment that calls `kmain(start_info)`. The kernel stays in ring 0 with
//! interrupts off; it has no IDT, so any exception is a triple fault (QEMU `-no-reboot` then
//! ends the VM).
//!
//! Constants: XEN_ELFNOTE_PHYS32_ENTRY = 18 (Xen `public/elfnote.h`; QEMU reads the
//! descriptor of a 64-bit ELF as a u64, hence `.quad`); CR4.PAE = bit 5; EFER = MSR
//! 0xC000_0080, LME = bit 8; CR0.PG = bit 31, PE = bit 0. Page-table flags: P|RW (0x3) for a
//! table, P|RW|PS (0x83) for a 2 MiB page. GDT: 0x08 the 64-bit code segment
//! (0x00af9a000000ffff), 0x10 flat data (0x00cf92000000ffff).

use core::arch::global_asm;

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
    movl %cr4, %eax
    orl $0x20, %eax
    movl %eax, %cr4
    movl $boot_pml4, %eax
    movl %eax, %cr3
    movl $0xC0000080, %ecx
    rdmsr
    orl $0x100, %eax
    wrmsr
    movl %cr0, %eax
    orl $0x80000001, %eax
    movl %eax, %cr0
    lgdtl boot_gdt_ptr
    ljmpl $0x08, $boot_long

    .code64
boot_long:
    movl $0x10, %eax
    movl %eax, %ds
    movl %eax, %es
    movl %eax, %ss
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
boot_gdt_end:
    .balign 4
boot_gdt_ptr:
    .word boot_gdt_end - boot_gdt - 1
    .long boot_gdt

    .section .data.pagetables, "aw"
    .balign 4096
boot_pml4:
    .quad boot_pdpt + 0x3
    .fill 511, 8, 0
boot_pdpt:
    .quad boot_pd + 0x3
    .fill 511, 8, 0
boot_pd:
    .set boot_pd_i, 0
    .rept 512
    .quad (boot_pd_i << 21) | 0x83
    .set boot_pd_i, boot_pd_i + 1
    .endr
    "#,
    options(att_syntax)
);
