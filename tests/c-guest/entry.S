/*
 * The C guest's PVH boot: the Xen ELF note naming the 32-bit entry, and the switch from 32-bit
 * protected mode to long mode, then c_main(start_info).
 *
 * A PVH loader (QEMU -kernel) enters pvh_start32 in 32-bit protected mode with paging off,
 * flat segments, no stack, and ebx = the physical address of the hvm_start_info. Constants:
 * XEN_ELFNOTE_PHYS32_ENTRY = 18 (QEMU reads the descriptor of a 64-bit ELF as a u64, hence
 * .quad); CR4.PAE = bit 5; EFER = MSR 0xC0000080, LME = bit 8; CR0.PG = bit 31, PE = bit 0.
 * Page tables identity-map the first 1 GiB in 2 MiB pages, user-accessible (P|RW|US|PS =
 * 0x87; tables P|RW|US = 0x7), built by the assembler so nothing large is written at run time.
 * GDT: 0x08 64-bit code, 0x10 flat data, 0x18 DPL-3 data, 0x20 DPL-3 64-bit code.
 * No IDT: any exception is a triple fault, which -no-reboot turns into QEMU's exit.
 *
 * c_main runs in ring 3 with IOPL 3 (RFLAGS 0x3002: interrupts stay off), entered by iretq:
 * on nested KVM ring-0 guest code is emulated one instruction at a time (~1 us each) while
 * ring-3 code runs natively, and IOPL 3 keeps port I/O (COM1, the beacons, isa-debug-exit)
 * available there. Nothing returns to ring 0: when c_main returns (or holds) the vCPU spins
 * on `pause` (`hlt` faults in ring 3; `syscall` does reach a ring-0 handler on this nested
 * KVM, but `cli` and `hlt` there triple-fault as if still in ring 3), which keeps one host
 * core busy while a held guest waits to be killed.
 */
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
    lgdtl gdt_ptr
    movl %cr4, %eax
    orl $0x20, %eax
    movl %eax, %cr4
    movl $pml4, %eax
    movl %eax, %cr3
    movl $0xC0000080, %ecx
    rdmsr
    orl $0x100, %eax
    wrmsr
    movl %cr0, %eax
    orl $0x80000001, %eax
    movl %eax, %cr0
    ljmpl $0x08, $long_entry

    .code64
long_entry:
    movl $0x10, %eax
    movl %eax, %ds
    movl %eax, %es
    movl %eax, %ss
    xorl %eax, %eax
    movl %eax, %fs
    movl %eax, %gs
    movabsq $__stack_top, %rsp
    movl %esi, %edi
    movl $0x1b, %eax
    movl %eax, %ds
    movl %eax, %es
    pushq $0x1b
    pushq %rsp
    addq $8, (%rsp)
    pushq $0x3002
    pushq $0x23
    movabsq $user_entry, %rax
    pushq %rax
    iretq

    /* Ring 3, on the same stack (16-byte aligned here, as c_main's call expects). */
user_entry:
    call c_main
1:
    pause
    jmp 1b

    .section .rodata.gdt, "a"
    .balign 16
gdt:
    .quad 0
    .quad 0x00af9a000000ffff
    .quad 0x00cf92000000ffff
    .quad 0x00cff2000000ffff
    .quad 0x00affa000000ffff
gdt_end:
    .balign 4
gdt_ptr:
    .word gdt_end - gdt - 1
    .long gdt

    .section .data.pagetables, "aw"
    .balign 4096
pml4:
    .quad pdpt + 0x7
    .fill 511, 8, 0
pdpt:
    .quad pd + 0x7
    .fill 511, 8, 0
pd:
    .set pd_i, 0
    .rept 512
    .quad (pd_i << 21) | 0x87
    .set pd_i, pd_i + 1
    .endr

    .section .note.GNU-stack, "", @progbits
