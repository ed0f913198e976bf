/* Row copies with the integrity digest of the packed side accumulated on the fly: the CPU twins'
 * fused copy + digest (tritonkv/_cpu_digest.py builds and loads this file; tritonkv/digest.py
 * holds the definition, which this matches bit for bit).
 *
 * The packed tensor is seen as num_views * num_rows rows of row_bytes bytes (view-major: packed
 * [num_layers, 1 + has_v, num_rows, num_kv_heads, head_size] contiguous); packed row r of view v
 * is elements [b, :, n, :] of that view's cache for slot = slots[r], b = slot / block_size,
 * n = slot % block_size, addressed by the view's byte strides. A call handles the global rows
 * [g0, g1) (g = v * num_rows + r). Where a head is whole 32-bit words, each contiguous run (a
 * token row, or one head of it) is copied and digested in one loop: the words the copy loads
 * feed the digest, whose arithmetic overlaps the copy's memory traffic. Otherwise (odd byte
 * counts: words straddle heads) chunks of a few KiB are copied, then digested while in cache;
 * callers split work at multiples of 4 rows, so every chunk starts on a word.
 *
 * No Python headers: plain C, loaded with ctypes (which releases the GIL during the call).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TKV_ABI 1
#define KEY 0x9E3779B1u
#define SEED 0x1B873593u
#define FMIX_1 0x85EBCA6Bu
#define FMIX_2 0xC2B2AE35u
#define CHUNK_BYTES (32 * 1024)

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#error "copy_digest.c: big-endian hosts are not supported (the digest reads little-endian words)"
#endif

/* Lane accumulators: eight vector lanes (GCC vector extensions: AVX2 registers in the avx2
 * clone, pairs of SSE2 registers in the portable one) and a scalar pair for runs' tails; summed
 * once per call (every term adds into lane A or B modulo 2**32, in any order). */
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef struct { /* plain arrays: no alignment assumed (read and written with memcpy) */
    uint32_t a[8], b[8];
    uint32_t sa, sb;
} acc_t;

static const v8u STEPS = {0u, KEY, 2u * KEY, 3u * KEY, 4u * KEY, 5u * KEY, 6u * KEY, 7u * KEY};

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

/* The terms of nwords words at src, the first at position first (mod 2**32), added to acc;
 * with copy, the words are stored to dst as they are read (one pass: the copy's loads feed the
 * digest). Inlined into each clone below, which compiles it for its instruction set. */
static inline __attribute__((always_inline)) void run(uint8_t *restrict dst,
                                                      const uint8_t *restrict src,
                                                      int64_t nwords, uint32_t first,
                                                      acc_t *acc, int copy) {
    v8u a, b, k = (first * KEY + SEED) + STEPS;
    memcpy(&a, acc->a, sizeof a);
    memcpy(&b, acc->b, sizeof b);
    int64_t j = 0;
    for (; j + 8 <= nwords; j += 8, k += 8u * KEY) {
        v8u h;
        memcpy(&h, src + 4 * j, 32);
        if (copy) memcpy(dst + 4 * j, &h, 32);
        MIX(h, k);
        a += h;
        b += h * (k | 1u);
    }
    memcpy(acc->a, &a, sizeof a);
    memcpy(acc->b, &b, sizeof b);
    for (uint32_t kk = first * KEY + SEED + (uint32_t)j * KEY; j < nwords; j++, kk += KEY) {
        uint32_t h;
        memcpy(&h, src + 4 * j, 4);
        if (copy) memcpy(dst + 4 * j, &h, 4);
        MIX(h, kk);
        acc->sa += h;
        acc->sb += h * (kk | 1u);
    }
}

#define LANES_ARGS const uint8_t *restrict src, int64_t nwords, uint32_t first, acc_t *acc
#define COPY_ARGS                                                                               \
    uint8_t *restrict dst, const uint8_t *restrict src, int64_t nwords, uint32_t first,       \
        acc_t *acc

typedef struct {
    void (*lanes)(LANES_ARGS);
    void (*copy_lanes)(COPY_ARGS);
    const char *name;
} kernels_t;

static void lanes_default(LANES_ARGS) { run(NULL, src, nwords, first, acc, 0); }
static void copy_lanes_default(COPY_ARGS) { run(dst, src, nwords, first, acc, 1); }
static const kernels_t KERNELS_DEFAULT = {lanes_default, copy_lanes_default, "default"};

#if defined(__x86_64__) || defined(__i386__)
#define HAVE_AVX2 1
#define AVX2 __attribute__((target("avx2")))
AVX2 static void lanes_avx2(LANES_ARGS) { run(NULL, src, nwords, first, acc, 0); }
AVX2 static void copy_lanes_avx2(COPY_ARGS) { run(dst, src, nwords, first, acc, 1); }
static const kernels_t KERNELS_AVX2 = {lanes_avx2, copy_lanes_avx2, "avx2"};
#endif

static void acc_init(acc_t *acc) { memset(acc, 0, sizeof *acc); }

static void acc_add_to(const acc_t *acc, uint32_t *lanes) {
    uint32_t a = acc->sa, b = acc->sb;
    for (int i = 0; i < 8; i++) {
        a += acc->a[i];
        b += acc->b[i];
    }
    lanes[0] += a;
    lanes[1] += b;
}

static const kernels_t *chosen; /* set by tkv_select before any copy */

/* Pick the lane loops: the AVX2 clone where the CPU has AVX2 (unless portable_only), else the
 * portable one. Returns the name of the one picked. */
const char *tkv_select(int portable_only) {
    const kernels_t *k = &KERNELS_DEFAULT;
#ifdef HAVE_AVX2
    __builtin_cpu_init();
    if (!portable_only && __builtin_cpu_supports("avx2")) k = &KERNELS_AVX2;
#else
    (void)portable_only;
#endif
    __atomic_store_n(&chosen, k, __ATOMIC_RELEASE);
    return k->name;
}

static const kernels_t *kernels(void) {
    const kernels_t *k = __atomic_load_n(&chosen, __ATOMIC_ACQUIRE);
    return k ? k : &KERNELS_DEFAULT;
}

/* Which lane loops run on this CPU: "avx2" or "default". */
const char *tkv_isa(void) { return kernels()->name; }

int tkv_abi(void) { return TKV_ABI; }

/* lanes += the terms of the bytes [0, nbytes) at p, its first word at position first; a last
 * partial word is padded with zero bytes. */
static void lanes_bytes(const kernels_t *k, const uint8_t *p, int64_t nbytes, uint64_t first,
                        acc_t *acc) {
    k->lanes(p, nbytes / 4, (uint32_t)first, acc);
    if (nbytes % 4) {
        uint8_t tail[4] = {0, 0, 0, 0};
        memcpy(tail, p + (nbytes / 4) * 4, (size_t)(nbytes % 4));
        k->lanes(tail, 1, (uint32_t)(first + (uint64_t)(nbytes / 4)), acc);
    }
}

void tkv_lanes(const uint8_t *p, int64_t nbytes, uint64_t first, uint32_t *lanes) {
    acc_t acc;
    acc_init(&acc);
    lanes_bytes(kernels(), p, nbytes, first, &acc);
    acc_add_to(&acc, lanes);
}

/* Copy one element of elem bytes (small fixed sizes inline to plain loads and stores). */
static inline void copy_elem(uint8_t *dst, const uint8_t *src, int64_t elem) {
    switch (elem) {
    case 1: *dst = *src; break;
    case 2: memcpy(dst, src, 2); break;
    case 4: memcpy(dst, src, 4); break;
    case 8: memcpy(dst, src, 8); break;
    default: memcpy(dst, src, (size_t)elem);
    }
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

/* Strided elements of one row: cache <-> q (the packed row, or a scratch row). */
static void copy_elements(const copy_t *c, uint8_t *cache_row, const int64_t *st, uint8_t *q) {
    for (int64_t h = 0; h < c->num_kv_heads; h++) {
        uint8_t *from = cache_row + h * st[1], *row = q + h * c->head_bytes;
        for (int64_t d = 0; d < c->head_size; d++) {
            if (c->unpack)
                copy_elem(from + d * st[3], row + d * c->elem, c->elem);
            else
                copy_elem(row + d * c->elem, from + d * st[3], c->elem);
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
        c->k->copy_lanes(cache, q, n, (uint32_t)pos, acc);
    else if (q == NULL)
        c->k->lanes(cache, n, (uint32_t)pos, acc);
    else
        c->k->copy_lanes(q, cache, n, (uint32_t)pos, acc);
}

/* One packed row <-> cache row whose heads lie apart, and its terms (head_bytes a multiple of
 * 4): one pass per head, or strided elements through q (or scratch), digested from there.
 * (Dense rows are runs of their own: tkv_copy_digest.) */
static void copy_row_lanes(const copy_t *c, uint8_t *cache_row, const int64_t *st, uint8_t *q,
                           uint8_t *scratch, uint64_t pos, acc_t *acc) {
    if (dense_heads(c, st)) {
        for (int64_t h = 0; h < c->num_kv_heads; h++) {
            uint8_t *row = q ? q + h * c->head_bytes : NULL;
            copy_run(c, cache_row + h * st[1], row, c->head_bytes / 4,
                     pos + (uint64_t)(h * c->head_bytes / 4), acc);
        }
    } else {
        uint8_t *row = q ? q : scratch;
        if (!c->unpack) copy_elements(c, cache_row, st, row);
        c->k->lanes(row, c->row_bytes / 4, (uint32_t)pos, acc);
        if (c->unpack) copy_elements(c, cache_row, st, row);
    }
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
 * dense token rows, form one run); otherwise (odd byte counts) chunks of rows are copied, then digested while in
 * cache. Returns 0; -1 if scratch memory could not be had; -2 if the rows are out of range or
 * g0 is not a multiple of 4 (nothing copied). */
int tkv_copy_digest(int unpack, const int64_t *bases, const int64_t *strides, int64_t num_views,
                    const int64_t *slots, int64_t num_rows, int64_t block_size,
                    int64_t num_kv_heads, int64_t head_size, int64_t elem, uint8_t *packed,
                    int64_t total_bytes, int64_t g0, int64_t g1, int do_digest,
                    uint32_t *lanes) {
    copy_t c = {kernels(), unpack, num_kv_heads, head_size, elem, head_size * elem,
                num_kv_heads * head_size * elem};
    int fused = do_digest && c.head_bytes % 4 == 0;
    int64_t chunk_rows = CHUNK_BYTES / (c.row_bytes > 0 ? c.row_bytes : 1);
    chunk_rows = fused ? 1 : (chunk_rows < 4 ? 4 : chunk_rows / 4 * 4);
    uint8_t *scratch = NULL;
    acc_t acc;
    acc_init(&acc);
    if (g0 < 0 || g0 % 4 || g1 > num_views * num_rows || (packed == NULL && unpack)) return -2;
    if (packed == NULL) { /* where rows go that are not kept: a chunk, or one row when fused */
        scratch = malloc((size_t)(chunk_rows * c.row_bytes) + 1);
        if (scratch == NULL) return -1;
    }
    for (int64_t c0 = g0; c0 < g1; c0 += chunk_rows) {
        int64_t c1 = c0 + chunk_rows < g1 ? c0 + chunk_rows : g1;
        uint8_t *chunk = packed ? packed + c0 * c.row_bytes : scratch;
        for (int64_t g = c0; g < c1; g++) {
            int64_t v = g / num_rows, r = g - v * num_rows, slot = slots[r];
            uint8_t *q = chunk + (g - c0) * c.row_bytes;
            if (slot < 0) {
                if (!unpack) memset(q, 0, (size_t)c.row_bytes);
                if (fused) lanes_bytes(c.k, q, c.row_bytes, (uint64_t)(g * c.row_bytes / 4), &acc);
                continue;
            }
            const int64_t *st = strides + 4 * v;
            int64_t b = slot / block_size, n = slot - b * block_size;
            uint8_t *cache_row = (uint8_t *)(intptr_t)bases[v] + b * st[0] + n * st[2];
            if (fused && dense_row(&c, st)) { /* and the rows after it that follow in the cache */
                int64_t m = 1;
                while (g + m < g1 && r + m < num_rows && slots[r + m] >= 0) {
                    int64_t s2 = slots[r + m], b2 = s2 / block_size;
                    uint8_t *next = (uint8_t *)(intptr_t)bases[v] + b2 * st[0] +
                                    (s2 - b2 * block_size) * st[2];
                    if (next != cache_row + m * c.row_bytes) break;
                    m++;
                }
                copy_run(&c, cache_row, packed ? q : NULL, m * c.row_bytes / 4,
                         (uint64_t)(g * c.row_bytes / 4), &acc);
                c0 += m - 1; /* fused: one row per chunk */
            } else if (fused)
                copy_row_lanes(&c, cache_row, st, packed ? q : NULL, scratch,
                               (uint64_t)(g * c.row_bytes / 4), &acc);
            else
                copy_row(&c, cache_row, st, q);
        }
        if (do_digest && !fused) {
            int64_t start = c0 * c.row_bytes, end = c1 * c.row_bytes;
            if (end > total_bytes) end = total_bytes;
            lanes_bytes(c.k, chunk, end - start, (uint64_t)(start / 4), &acc);
        }
    }
    free(scratch);
    acc_add_to(&acc, lanes);
    return 0;
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
            k->lanes(row + h * head_bytes, words, (uint32_t)((uint64_t)g * (uint64_t)words),
                     &acc[h]);
    }
    for (int64_t h = 0; h < num_heads; h++) acc_add_to(&acc[h], lanes + 2 * h);
    free(acc);
    return 0;
}
