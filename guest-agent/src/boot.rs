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

use core::arch::global_asm;

// XEN_ELFNOTE_PHYS32_ENTRY = 18 (Xen `public/elfnote.h`). QEMU reads the descriptor of a 64-bit
// ELF as a u64, linux-loader reads its first 4 bytes: emit a `.quad`. The page-table entries use
// flags P|RW (0x3) for tables and P|RW|PS (0x83) for 2 MiB pages. GDT entries: 64-bit code
// (0x00af9a000000ffff) and flat data (0x00cf92000000ffff).
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
    ljmpl $0x08, $boot_long_entry

    .code64
boot_long_entry:
    movl $0x10, %eax
    movl %eax, %ds
    movl %eax, %es
    movl %eax, %ss
    xorl %eax, %eax
    movl %eax, %fs
    movl %eax, %gs
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
    .quad boot_pd + 0x1003
    .quad boot_pd + 0x2003
    .quad boot_pd + 0x3003
    .fill 508, 8, 0
boot_pd:
    .set boot_pd_i, 0
    .rept 2048
    .quad (boot_pd_i << 21) | 0x83
    .set boot_pd_i, boot_pd_i + 1
    .endr
    "#,
    options(att_syntax)
);
