/* The multiply-add rate of each AVX2 instruction mix a matmul tile of 4 rows x 2 vectors
 * can be built from, in registers only (no memory traffic but the tile's broadcasts), one
 * core: what bounds kernels/qmatmul.c (int16) and kernels/i8matmul.c's AVX2 path (int8)
 * against float32 FMAs (vLLM's GEMMs on AVX2). docs/benchmarks.md, "int8 dot products on
 * AVX2".
 *
 *     cc -O2 benchmarks/avx2_mixes.c -o /tmp/avx2_mixes && /tmp/avx2_mixes
 *
 * Inline assembly, so the compiler neither reorders nor spills the loops; AVX2 and FMA are
 * needed at run time (not at build time).
 */
#include <stdint.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int16_t xs[32] __attribute__((aligned(64)));
static int8_t ws[64] __attribute__((aligned(64)));

/* One iteration of each loop: 8 multiply-add instructions (the tile's 4 x 2). */
#define ITERS 200000000L

static double fma_f32(void) {
    long n = ITERS;
    double t = now();
    __asm__ volatile("1:\n"
                     "vfmadd231ps %%ymm8,%%ymm10,%%ymm0\n vfmadd231ps %%ymm9,%%ymm10,%%ymm1\n"
                     "vfmadd231ps %%ymm8,%%ymm11,%%ymm2\n vfmadd231ps %%ymm9,%%ymm11,%%ymm3\n"
                     "vfmadd231ps %%ymm8,%%ymm12,%%ymm4\n vfmadd231ps %%ymm9,%%ymm12,%%ymm5\n"
                     "vfmadd231ps %%ymm8,%%ymm13,%%ymm6\n vfmadd231ps %%ymm9,%%ymm13,%%ymm7\n"
                     "dec %0\n jnz 1b\n"
                     : "+r"(n)::"memory");
    return ITERS * 8.0 * 8 / (now() - t) / 1e9;
}

/* int16: two weight vectors widened from bytes, each row's activations from memory. */
static double madd_i16(void) {
    long n = ITERS;
    double t = now();
    __asm__ volatile("1:\n"
                     "vpmovsxbw (%1),%%ymm8\n vpmovsxbw 16(%1),%%ymm9\n"
                     "vpmaddwd (%2),%%ymm8,%%ymm10\n vpaddd %%ymm10,%%ymm0,%%ymm0\n"
                     "vpmaddwd (%2),%%ymm9,%%ymm11\n vpaddd %%ymm11,%%ymm1,%%ymm1\n"
                     "vpmaddwd 32(%2),%%ymm8,%%ymm12\n vpaddd %%ymm12,%%ymm2,%%ymm2\n"
                     "vpmaddwd 32(%2),%%ymm9,%%ymm13\n vpaddd %%ymm13,%%ymm3,%%ymm3\n"
                     "vpmaddwd 64(%2),%%ymm8,%%ymm10\n vpaddd %%ymm10,%%ymm4,%%ymm4\n"
                     "vpmaddwd 64(%2),%%ymm9,%%ymm11\n vpaddd %%ymm11,%%ymm5,%%ymm5\n"
                     "vpmaddwd 96(%2),%%ymm8,%%ymm12\n vpaddd %%ymm12,%%ymm6,%%ymm6\n"
                     "vpmaddwd 96(%2),%%ymm9,%%ymm13\n vpaddd %%ymm13,%%ymm7,%%ymm7\n"
                     "dec %0\n jnz 1b\n"
                     : "+r"(n)
                     : "r"(ws), "r"(xs)
                     : "memory");
    return ITERS * 8.0 * 16 / (now() - t) / 1e9;
}

/* One row of the tile against both weight vectors (ymm8, ymm9), into accumulators A and B;
 * ymm15 holds int16 ones, and the macros below load X, the row's 4 activations, into ymm14.
 * UBS: unsigned by signed bytes; SIGN: vpsignb first, |x| (ymm13) the unsigned side. */
#define UBS(A, B)                                                                          \
    "vpmaddubsw %%ymm14,%%ymm8,%%ymm10\n vpmaddwd %%ymm15,%%ymm10,%%ymm10\n"              \
    "vpaddd %%ymm10,%%ymm" #A ",%%ymm" #A "\n"                                             \
    "vpmaddubsw %%ymm14,%%ymm9,%%ymm11\n vpmaddwd %%ymm15,%%ymm11,%%ymm11\n"              \
    "vpaddd %%ymm11,%%ymm" #B ",%%ymm" #B "\n"
#define SIGN(A, B)                                                                         \
    "vpsignb %%ymm14,%%ymm8,%%ymm10\n vpmaddubsw %%ymm10,%%ymm13,%%ymm10\n"               \
    "vpmaddwd %%ymm15,%%ymm10,%%ymm10\n vpaddd %%ymm10,%%ymm" #A ",%%ymm" #A "\n"          \
    "vpsignb %%ymm14,%%ymm9,%%ymm11\n vpmaddubsw %%ymm11,%%ymm13,%%ymm11\n"               \
    "vpmaddwd %%ymm15,%%ymm11,%%ymm11\n vpaddd %%ymm11,%%ymm" #B ",%%ymm" #B "\n"
#define X(OFF) "vpbroadcastd " #OFF "(%2),%%ymm14\n"
#define ABS_X(OFF, ABS_OFF) X(OFF) "vpbroadcastd " #ABS_OFF "(%2),%%ymm13\n"
#define INT8_LOOP(ROWS)                                                                    \
    "vpcmpeqw %%ymm15,%%ymm15,%%ymm15\n vpsrlw $15,%%ymm15,%%ymm15\n"                      \
    "1:\n vmovdqa (%1),%%ymm8\n vmovdqa 32(%1),%%ymm9\n" ROWS "dec %0\n jnz 1b\n"

/* int8, unsigned by signed bytes (7-bit activations would keep the pairs exact), summed to
 * int32 by vpmaddwd with ones; each row's 4 activations broadcast. */
static double maddubs_i8(void) {
    long n = ITERS;
    double t = now();
    __asm__ volatile(INT8_LOOP(X(0) UBS(0, 1) X(4) UBS(2, 3) X(8) UBS(4, 5) X(12) UBS(6, 7))
                     : "+r"(n)
                     : "r"(ws), "r"(xs)
                     : "memory");
    return ITERS * 8.0 * 32 / (now() - t) / 1e9;
}

/* int8 with llama.cpp's sign trick (what i8matmul.c's AVX2 path runs): vpsignb puts the
 * activation's sign on the weights, |x| (broadcast apart) is the unsigned side. */
static double sign_i8(void) {
    long n = ITERS;
    double t = now();
    __asm__ volatile(INT8_LOOP(ABS_X(0, 16) SIGN(0, 1) ABS_X(4, 20) SIGN(2, 3)
                               ABS_X(8, 24) SIGN(4, 5) ABS_X(12, 28) SIGN(6, 7))
                     : "+r"(n)
                     : "r"(ws), "r"(xs)
                     : "memory");
    return ITERS * 8.0 * 32 / (now() - t) / 1e9;
}

int main(void) {
    printf("GMAC/s, one core, a 4 x 2 tile in registers:\n");
    printf("  vfmadd231ps (float32)                 %6.1f\n", fma_f32());
    printf("  vpmaddwd + vpaddd (int16)             %6.1f\n", madd_i16());
    printf("  vpmaddubsw + vpmaddwd + vpaddd (int8) %6.1f\n", maddubs_i8());
    printf("  the same after vpsignb (int8, signed) %6.1f\n", sign_i8());
    return 0;
}
