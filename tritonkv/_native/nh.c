/* The NH layer of tritonkv.umac on the CPU (the definition: tritonkv/_umac_core.py, nh_numpy).
 *
 * For each 4 KiB block of little-endian 32-bit words m and each Toeplitz iteration t (the key
 * shifted by 4 words per iteration): the sum mod 2^64 over 8-word groups g and j in 0..3 of
 * (m[8g+j] + k[8g+j+4t] mod 2^32) * (m[8g+j+4] + k[8g+j+4+4t] mod 2^32).
 *
 * Built and loaded by tritonkv/_cpu_umac.py. On x86-64, function clones for AVX-512, AVX2 and the
 * portable instruction set, picked at load time by the CPU's features (ifunc). With GCC >= 12 or clang the
 * loop is written on 64-byte vectors: four 8-word groups at a time, their low halves (words
 * j = 0..3) and high halves (j + 4) gathered into two vectors by one shuffle each, the 32 x 32 ->
 * 64-bit products of even and odd lanes apart (vpmuludq); the key is split into halves once
 * per call. Elsewhere a plain loop does the same sums.
 */
#include <stdint.h>

#define TKV_NH_ABI 1
#define CHUNK_WORDS 1024
#define ITERATIONS 2
#define SHIFT_WORDS 4
#define GROUPS (CHUNK_WORDS / 8)

#if defined(__x86_64__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES /* one build for the machine's baseline (e.g. Arm's NEON) */
#endif

int tkv_nh_abi(void) { return TKV_NH_ABI; }
int tkv_nh_chunk_words(void) { return CHUNK_WORDS; }
int tkv_nh_iterations(void) { return ITERATIONS; }
int tkv_nh_shift_words(void) { return SHIFT_WORDS; }

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
typedef uint32_t v16u __attribute__((vector_size(64), aligned(4))); /* unaligned loads */
typedef uint32_t v16a __attribute__((vector_size(64)));
typedef uint64_t v8q __attribute__((vector_size(64)));

/* words: [num_blocks * CHUNK_WORDS]; key: [CHUNK_WORDS + SHIFT_WORDS * (ITERATIONS - 1)];
 * out: [num_blocks, ITERATIONS]. */
CLONES
void tkv_nh(const uint32_t *restrict words, int64_t num_blocks, const uint32_t *restrict key,
            uint64_t *restrict out) {
    /* the key in the order the message's halves are taken: klo[4g+j] = k[8g+j],
     * khi[4g+j] = k[8g+j+4], knext[4g+j] = k[8g+j+8]; iteration 0 adds klo to the low halves and
     * khi to the high ones, iteration 1 (the key 4 words on) khi and knext */
    v16a klo[GROUPS / 4], khi[GROUPS / 4], knext[GROUPS / 4];
    uint32_t *lo_k = (uint32_t *)klo, *hi_k = (uint32_t *)khi, *next_k = (uint32_t *)knext;
    for (int g = 0; g < GROUPS; g++)
        for (int j = 0; j < 4; j++) {
            lo_k[4 * g + j] = key[8 * g + j];
            hi_k[4 * g + j] = key[8 * g + j + 4];
            next_k[4 * g + j] = key[8 * g + j + 8];
        }
    const v8q low = {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu,
                     0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu};
    for (int64_t c = 0; c < num_blocks; c++) {
        const uint32_t *m = words + c * CHUNK_WORDS;
        v8q acc0 = {0}, acc1 = {0};
        for (int v = 0; v < GROUPS / 4; v++) {
            v16u a = *(const v16u *)(m + 32 * v), b = *(const v16u *)(m + 32 * v + 16);
            v16a lo = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24,
                                              25, 26, 27);
            v16a hi = __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28,
                                              29, 30, 31);
            v8q x0 = (v8q)(lo + klo[v]), y0 = (v8q)(hi + khi[v]); /* 32-bit adds wrap */
            v8q x1 = (v8q)(lo + khi[v]), y1 = (v8q)(hi + knext[v]);
            acc0 += (x0 & low) * (y0 & low) + (x0 >> 32) * (y0 >> 32);
            acc1 += (x1 & low) * (y1 & low) + (x1 >> 32) * (y1 >> 32);
        }
        uint64_t s0 = 0, s1 = 0;
        for (int i = 0; i < 8; i++) {
            s0 += acc0[i];
            s1 += acc1[i];
        }
        out[c * ITERATIONS] = s0;
        out[c * ITERATIONS + 1] = s1;
    }
}
#else
CLONES
void tkv_nh(const uint32_t *restrict words, int64_t num_blocks, const uint32_t *restrict key,
            uint64_t *restrict out) {
    for (int64_t c = 0; c < num_blocks; c++) {
        const uint32_t *restrict m = words + c * CHUNK_WORDS;
        uint64_t acc0[4] = {0, 0, 0, 0}, acc1[4] = {0, 0, 0, 0};
        for (int g = 0; g < CHUNK_WORDS; g += 8) {
            for (int j = 0; j < 4; j++) {
                uint32_t lo = m[g + j], hi = m[g + j + 4];
                acc0[j] += (uint64_t)(uint32_t)(lo + key[g + j]) *
                           (uint32_t)(hi + key[g + j + 4]);
                acc1[j] += (uint64_t)(uint32_t)(lo + key[g + j + SHIFT_WORDS]) *
                           (uint32_t)(hi + key[g + j + 4 + SHIFT_WORDS]);
            }
        }
        out[c * ITERATIONS] = acc0[0] + acc0[1] + acc0[2] + acc0[3];
        out[c * ITERATIONS + 1] = acc1[0] + acc1[1] + acc1[2] + acc1[3];
    }
}
#endif
