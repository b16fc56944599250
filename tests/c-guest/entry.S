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
 * The local APIC's page (0xFEE00000) is mapped too, uncached and user-accessible, so c_main
 * can send the INIT and start-up IPIs from ring 3 (the application processors' part below).
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
/*
 * From protected mode with paging off (or real mode: the same instructions, the assembler
 * adding operand-size prefixes in .code16) to long mode on the shared page tables, then a far
 * jump to 64-bit code at `target`: CR4.PAE, CR3 = pml4, EFER.LME, CR0.PG|PE. The BSP and the
 * APs both take this one path.
 */
    .macro LONG_MODE target
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
    ljmpl $0x08, $\target
    .endm

/*
 * To ring 3 with IOPL 3 at `target`, on the current stack: DS/ES the DPL-3 data selector
 * (0x1b), and an iretq frame of SS 0x1b, RSP as it was, RFLAGS 0x3002 (IOPL 3, interrupts
 * off), CS 0x23 (DPL-3 64-bit code). The BSP and the APs both enter ring 3 this way.
 */
    .macro RING3 target
    movl $0x1b, %eax
    movl %eax, %ds
    movl %eax, %es
    pushq $0x1b
    pushq %rsp
    addq $8, (%rsp)
    pushq $0x3002
    pushq $0x23
    movabsq $\target, %rax
    pushq %rax
    iretq
    .endm

/*
 * In long mode, the kernel's data segments: DS, ES and SS the flat data selector (0x10), FS and
 * GS null. The BSP and the APs both start their 64-bit code with it.
 */
    .macro FLAT_SEGMENTS
    movl $0x10, %eax
    movl %eax, %ds
    movl %eax, %es
    movl %eax, %ss
    xorl %eax, %eax
    movl %eax, %fs
    movl %eax, %gs
    .endm

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
    LONG_MODE long_entry

    .code64
long_entry:
    FLAT_SEGMENTS
    movabsq $__stack_top, %rsp
    movl %esi, %edi
    RING3 user_entry

    /* Ring 3, on the same stack (16-byte aligned here, as c_main's call expects). */
user_entry:
    call c_main
1:
    pause
    jmp 1b

/*
 * Application processors (c_main starts them with INIT-SIPI-SIPI when QEMU has -smp N > 1).
 * c_main copies ap_trampoline..ap_trampoline_end to AP_TRAMPOLINE (0x8000, the SIPI vector
 * 0x08: a page below 1 MiB that neither the image nor the PVH loader's data use), where each
 * AP starts in real mode. The trampoline is position-independent in its own page: it names
 * only its own GDT pointer (relative to its start) and absolute addresses in the image (the
 * GDT, pml4, ap_long_entry), all below 4 GiB. It goes from real mode to long mode in one step
 * (PAE, CR3, EFER.LME, then PE and PG together) and far-jumps to the 64-bit code segment,
 * the same steps as pvh_start32. ap_long_entry takes the next AP index (lock xadd), its own
 * stack, and enters ring 3 with IOPL 3 by iretq exactly as the BSP does, then calls
 * c_ap_main(index). An AP beyond MAX_APS halts in ring 0. Every ring-0 instruction here is
 * emulated on nested KVM (~1 us each): about 40 per AP.
 */
    .set AP_TRAMPOLINE, 0x8000
    .set MAX_APS, 7
    .set AP_STACK_SHIFT, 14

    .section .text.ap_trampoline, "ax"
    .code16
    .global ap_trampoline
    .global ap_trampoline_end
ap_trampoline:
    cli
    cld
    xorw %ax, %ax
    movw %ax, %ds
    lgdtl AP_TRAMPOLINE + (ap_gdt_ptr - ap_trampoline)
    LONG_MODE ap_long_entry
    .balign 4
ap_gdt_ptr:
    .word gdt_end - gdt - 1
    .long gdt
ap_trampoline_end:

    .section .text.ap_entry, "ax"
    .code64
ap_long_entry:
    FLAT_SEGMENTS
    movl $1, %eax
    lock xaddl %eax, ap_next(%rip)
    cmpl $MAX_APS, %eax
    jae 2f
    leal 1(%eax), %ecx
    shll $AP_STACK_SHIFT, %ecx
    leaq ap_stacks(%rip), %rsp
    addq %rcx, %rsp
    movl %eax, %edi
    RING3 ap_user_entry
2:
    cli
    hlt
    jmp 2b

    /* Ring 3 on the AP's own stack (16-byte aligned, as at user_entry). */
ap_user_entry:
    call c_ap_main
1:
    pause
    jmp 1b

    .section .bss.ap, "aw", @nobits
    .balign 4
    .global ap_next
ap_next:
    .skip 4

    /* NOLOAD, never zeroed (link.ld's .stack): one 16 KiB ring-3 stack per AP. */
    .section .ap_stacks, "aw", @nobits
    .balign 16
ap_stacks:
    .skip MAX_APS << AP_STACK_SHIFT

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
    .fill 2, 8, 0
    .quad pd_apic + 0x7
    .fill 508, 8, 0
pd:
    .set pd_i, 0
    .rept 512
    .quad (pd_i << 21) | 0x87
    .set pd_i, pd_i + 1
    .endr
    /* The 4th GiB: only the 2 MiB page holding the local APIC (0xFEE00000), PCD|PWT. */
pd_apic:
    .fill 503, 8, 0
    .quad 0xFEE00000 | 0x9f
    .fill 8, 8, 0

    .section .note.GNU-stack, "", @progbits
