/*
 * The differential test's C side: runs a call sequence from stdin against the C recorder (two
 * recorders, each with its own handle and block) with a fake clock and logged port I/O, and
 * writes a transcript to stdout: one line per call with its result, the port accesses, and at
 * the end each block's bytes in hex. capi/tests/differential.rs writes the same transcript from
 * vmtsync-core's Rust recorder and compares the two.
 *
 * Input, one call per line (recorder r is 0 or 1; numbers in decimal):
 *   init r vcpus capacity mode len misalign   (the block is `len` bytes at `misalign` bytes
 *                                              past a 64-byte boundary, filled with 0xa5)
 *   publish r nonce tsc_khz clock port
 *   record r vcpu id len hex|-                 (`-`: a NULL payload pointer)
 *   beacon r vcpu
 *   poke r vcpu word value                     (stores a ring header word, as if the ring had
 *                                              run that far)
 *   produced r vcpu
 *   refused r vcpu
 *   span r vcpu end hex|-|z                    (vmtsync_span_begin, or _end when `end` is 1, of
 *                                              the name in hex; `-` NULL, `z` empty)
 *   func r vcpu exit fn site                   (vmtsync_func_enter, or _exit when `exit` is 1)
 *   reloc r vcpu link runtime len
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t fake_tsc = 1000;
static uint64_t next_tsc(void) {
    fake_tsc += 3;
    return fake_tsc;
}
static uint8_t log_in(uint16_t port) {
    printf("in %u\n", (unsigned)port);
    return 0xff;
}
static void log_out(uint16_t port, uint8_t value) {
    printf("out %u %u\n", (unsigned)port, (unsigned)value);
}

#define VMTSYNC_READ_TSC() next_tsc()
#define VMTSYNC_INB(port) log_in(port)
#define VMTSYNC_OUTB(port, value) log_out(port, value)
#include "vmtsync.c"

struct block {
    unsigned char *alloc;
    unsigned char *mem;
    size_t len;
};

static struct vmtsync_rec recs[2];
static struct block blocks[2];

static int hexval(int c) {
    if (c >= '0' && c <= '9') {
        return c - '0';
    }
    if (c >= 'a' && c <= 'f') {
        return c - 'a' + 10;
    }
    return -1;
}

int main(void) {
    char line[512];
    unsigned k;
    while (fgets(line, sizeof line, stdin) != NULL) {
        char op[16];
        unsigned r;
        unsigned long long a = 0, b = 0, c = 0, d = 0, e = 0;
        char hex[64];
        if (sscanf(line, "%15s %u", op, &r) != 2 || r > 1) {
            fprintf(stderr, "bad line: %s", line);
            return 2;
        }
        if (strcmp(op, "init") == 0) {
            if (sscanf(line, "%*s %*u %llu %llu %llu %llu %llu", &a, &b, &c, &d, &e) != 5) {
                return 2;
            }
            free(blocks[r].alloc);
            blocks[r].alloc = aligned_alloc(64, (size_t)((d + e + 64 + 63) / 64 * 64));
            if (blocks[r].alloc == NULL) {
                return 3;
            }
            memset(blocks[r].alloc, 0xa5, (size_t)(d + e + 64));
            blocks[r].mem = blocks[r].alloc + e;
            blocks[r].len = (size_t)d;
            printf("= %d\n", (int)vmtsync_init(&recs[r], blocks[r].mem, (size_t)d, (uint32_t)a,
                                               (uint32_t)b, (uint32_t)c));
        } else if (strcmp(op, "publish") == 0) {
            if (sscanf(line, "%*s %*u %llu %llu %llu %llu", &a, &b, &c, &d) != 4) {
                return 2;
            }
            printf("= %d\n", (int)vmtsync_publish(&recs[r], a, b, (uint32_t)c, (uint16_t)d));
        } else if (strcmp(op, "record") == 0) {
            unsigned char payload[32];
            size_t i, n;
            if (sscanf(line, "%*s %*u %llu %llu %llu %63s", &a, &b, &c, hex) != 4) {
                return 2;
            }
            n = strlen(hex) / 2;
            for (i = 0; i < n && i < sizeof payload; i++) {
                payload[i] = (unsigned char)(hexval(hex[2 * i]) * 16 + hexval(hex[2 * i + 1]));
            }
            printf("= %d\n", (int)vmtsync_record(&recs[r], (uint32_t)a, (uint16_t)b,
                                                 hex[0] == '-' ? NULL : payload, (uint32_t)c));
        } else if (strcmp(op, "beacon") == 0) {
            if (sscanf(line, "%*s %*u %llu", &a) != 1) {
                return 2;
            }
            printf("= %d\n", (int)vmtsync_beacon(&recs[r], (uint32_t)a));
        } else if (strcmp(op, "poke") == 0) {
            if (sscanf(line, "%*s %*u %llu %llu %llu", &a, &b, &c) != 3) {
                return 2;
            }
            if (recs[r].vmtsync_rings_ != NULL && a < recs[r].vmtsync_vcpus_) {
                *VMTSYNC_W_(recs[r].vmtsync_rings_ + (size_t)a * recs[r].vmtsync_stride_, b) = c;
            }
            printf("= poked\n");
        } else if (strcmp(op, "produced") == 0) {
            if (sscanf(line, "%*s %*u %llu", &a) != 1) {
                return 2;
            }
            printf("= %llu\n", (unsigned long long)vmtsync_produced(&recs[r], (uint32_t)a));
        } else if (strcmp(op, "refused") == 0) {
            if (sscanf(line, "%*s %*u %llu", &a) != 1) {
                return 2;
            }
            printf("= %llu\n", (unsigned long long)vmtsync_refused(&recs[r], (uint32_t)a));
        } else if (strcmp(op, "span") == 0) {
            char name[32];
            size_t i, n;
            if (sscanf(line, "%*s %*u %llu %llu %63s", &a, &b, hex) != 3) {
                return 2;
            }
            n = hex[0] == 'z' ? 0 : strlen(hex) / 2;
            for (i = 0; i < n && i + 1 < sizeof name; i++) {
                name[i] = (char)(hexval(hex[2 * i]) * 16 + hexval(hex[2 * i + 1]));
            }
            name[i] = '\0';
            printf("= %d\n", (int)(b ? vmtsync_span_end : vmtsync_span_begin)(
                                 &recs[r], (uint32_t)a, hex[0] == '-' ? NULL : name));
        } else if (strcmp(op, "func") == 0) {
            void *fn, *site;
            if (sscanf(line, "%*s %*u %llu %llu %llu %llu", &a, &b, &c, &d) != 4) {
                return 2;
            }
            fn = (void *)(uintptr_t)c;
            site = (void *)(uintptr_t)d;
            printf("= %d\n", (int)(b ? vmtsync_func_exit(&recs[r], (uint32_t)a, fn, site)
                                     : vmtsync_func_enter(&recs[r], (uint32_t)a, fn, site)));
        } else if (strcmp(op, "reloc") == 0) {
            if (sscanf(line, "%*s %*u %llu %llu %llu %llu", &a, &b, &c, &d) != 4) {
                return 2;
            }
            printf("= %d\n", (int)vmtsync_reloc(&recs[r], (uint32_t)a, b, c, (uint32_t)d));
        } else {
            fprintf(stderr, "bad op: %s", line);
            return 2;
        }
    }
    for (k = 0; k < 2; k++) {
        size_t i;
        printf("mem %u ", k);
        for (i = 0; blocks[k].mem != NULL && i < blocks[k].len; i++) {
            printf("%02x", blocks[k].mem[i]);
        }
        printf("\n");
    }
    return 0;
}
