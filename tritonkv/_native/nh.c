/* The NH layer of tritonkv.umac on the CPU (the definition: tritonkv/_umac_core.py, nh_numpy).
 *
 * For each 4 KiB block of little-endian 32-bit words m and each Toeplitz iteration t (the key
 * shifted by 4 words per iteration): the sum mod 2^64 over 8-word groups g and j in 0..3 of
 * (m[8g+j] + k[8g+j+4t] mod 2^32) * (m[8g+j+4] + k[8g+j+4+4t] mod 2^32).
 * Built and loaded by tritonkv/_cpu_umac.py; function clones for AVX-512, AVX2 and the
 * portable loop, picked at load time by the CPU's features (ifunc).
 */
#include <stdint.h>

#define TKV_NH_ABI 1
#define CHUNK_WORDS 1024
#define ITERATIONS 2
#define SHIFT_WORDS 4

int tkv_nh_abi(void) { return TKV_NH_ABI; }
int tkv_nh_chunk_words(void) { return CHUNK_WORDS; }
int tkv_nh_iterations(void) { return ITERATIONS; }
int tkv_nh_shift_words(void) { return SHIFT_WORDS; }

/* words: [num_blocks * CHUNK_WORDS]; key: [CHUNK_WORDS + SHIFT_WORDS * (ITERATIONS - 1)];
 * out: [num_blocks, ITERATIONS]. */
__attribute__((target_clones("avx512f", "avx2", "default")))
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
