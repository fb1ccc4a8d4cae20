/* What this CPU and its operating system let a process execute: the check that picks the kernel
 * library's variant (library.py, isa.py).
 *
 * It is compiled on its own, without any instruction-set flag, so it runs on every host of its
 * architecture (the kernels themselves are built once per variant, and a variant's code would stop
 * a lesser CPU with SIGILL before it could say anything). A feature counts only when the CPU reports
 * it and the OS saves its registers (XCR0), and AMX only once Linux has granted this process the
 * tile state (arch_prctl ARCH_REQ_XCOMP_PERM): the request the AMX kernels need anyway. Bits are
 * isa.py's FEATURE_BITS.
 */
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

static uint64_t xgetbv0(void) {
    uint32_t eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((uint64_t)edx << 32) | eax;
}

static int amx_granted(void) {
#if defined(__linux__) && defined(SYS_arch_prctl)
    /* ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    return 0;
#endif
}

uint64_t tessera_cpu_features(void) {
    uint32_t a, b, c, d;
    uint64_t f = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1;
    const uint64_t xcr0 = osxsave ? xgetbv0() : 0;
    const int ymm_ok = avx && (xcr0 & 0x6) == 0x6;            /* SSE and AVX state */
    const int zmm_ok = ymm_ok && (xcr0 & 0xe0) == 0xe0;       /* opmask, ZMM0-15 high halves, ZMM16-31 */
    const int tile_ok = zmm_ok && (xcr0 & 0x60000) == 0x60000; /* XTILECFG, XTILEDATA */
    if (ymm_ok) {
        f |= ((c >> 12) & 1ull) << 1; /* fma */
        f |= ((c >> 29) & 1ull) << 2; /* f16c */
    }
    if (__get_cpuid_max(0, 0) >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        if (ymm_ok) f |= ((b >> 5) & 1ull) << 0; /* avx2 */
        if (zmm_ok) {
            f |= ((b >> 16) & 1ull) << 3;  /* avx512f */
            f |= ((b >> 30) & 1ull) << 4;  /* avx512bw */
            f |= ((b >> 31) & 1ull) << 5;  /* avx512vl */
            f |= ((b >> 17) & 1ull) << 6;  /* avx512dq */
            f |= ((c >> 11) & 1ull) << 7;  /* avx512_vnni */
            f |= ((c >> 1) & 1ull) << 8;   /* avx512vbmi */
        }
        const uint32_t max7 = a;
        uint32_t a1 = 0, b1, c1, d1;
        if (max7 >= 1) __cpuid_count(7, 1, a1, b1, c1, d1);
        if (zmm_ok) f |= ((a1 >> 5) & 1ull) << 9; /* avx512_bf16 */
        if (ymm_ok) f |= ((a1 >> 4) & 1ull) << 15; /* avx_vnni */
        if (tile_ok && ((d >> 24) & 1) && ((d >> 22) & 1) && ((d >> 25) & 1)) {
            f |= 1ull << 10; /* amx_tile, amx_bf16, amx_int8 */
            if (amx_granted()) f |= 1ull << 11;
        }
    }
    return f;
}

#elif defined(__aarch64__)
#include <sys/auxv.h>

uint64_t tessera_cpu_features(void) {
    const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    uint64_t f = 0;
    if (hw & (1ul << 1)) f |= 1ull << 12;   /* asimd (NEON) */
    if (hw & (1ul << 20)) f |= 1ull << 13;  /* asimddp (dot product) */
    if (hw2 & (1ul << 13)) f |= 1ull << 14; /* i8mm */
    return f;
}

#else
uint64_t tessera_cpu_features(void) { return 0; }
#endif
