/* Decode attention over the paged KV cache on CPU: one query token per sequence.
 *
 *   out[b, h, :] = softmax(scale * q[b, h, :] . K[b, p, h / G, :] for p < lens[b]) @ V[b, p, h / G, :]
 *
 * K and V are [num_blocks, bs, Hkv, row] caches read through the block table (a long item's chunk of rows copied
 * side by side first, so that memory is read in order, else where they lie; rows in one of the KV formats,
 * cpu_kernels.h: fp32 as they are, int8 and int4 from their codes where AVX-512 is missing (codes_read), the
 * others a chunk of one KV head at a time widened into L1): position p of sequence b is row p % bs of block
 * tables[b * ts + p / bs]. Nothing is gathered into a tensor or padded, so a step costs the positions its sequences
 * have, each read once (the G query heads of a KV head meet each key and value row while it is in L1; on AVX-512
 * one load of a value row serves them all).
 *
 * Work items are (sequence, split of its positions): a batch of one sequence still has as many items as the
 * threads can share evenly (att_splits). An item reads its positions a chunk at a time (ATT_CHUNK rows, from as
 * many cache blocks as that takes: every KV head of those rows, side by side in memory), prefetching the next
 * chunk, which lies in other blocks, and keeps for each query head a running maximum, sum and weighted sum of values
 * (online softmax); the splits of a head are then merged. The result does not depend on which thread ran an
 * item, so it is the same from call to call. Built into the same library as quant_cpu.c (kernels/quant_cpu.py). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ATT_AVX2 1
#if defined(__AVX512F__)
#define ATT_AVX512 1  /* scores and weighted sums 16 lanes at a time: what rows stored in fewer bytes wait on */
#endif
#endif

#include "cpu_kernels.h"

#define ATT_CHUNK 32     /* key rows scored before their values are added */
#define ATT_MAX_G 32     /* query heads per KV head */
#define ATT_MAX_D 256    /* head dimension */
#define ATT_MIN_SPLIT 32 /* positions an item takes at least */
#define ATT_COPY 131072  /* bytes of a chunk's K rows (and of its V rows) copied side by side before they are read */
#define ATT_COPY_FROM 256 /* positions from which an item's chunks are copied (fewer: likely in cache, see att_item) */

#ifdef ATT_AVX2
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

static inline float dot(const float *a, const float *b, int64_t D) {
    float s = 0.f;
    for (int64_t d = 0; d < D; d++) s += a[d] * b[d];
    return s;
}

#ifdef ATT_AVX2
/* the eight sums of a0..a7's lanes, in order */
static inline __m256 hsum8(__m256 a[8]) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

#ifdef ATT_AVX512
/* a's 16 lanes summed pairwise into 8 */
static inline __m256 fold512(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
#endif

/* s[g][i] = q_g . k_i for the G query rows q_g = qs + g * D and the n rows k_i = k + i * stride */
static void scores(const float *qs, int64_t G, const float *k, int64_t stride, int64_t n, int64_t D,
                   float s[][ATT_CHUNK]) {
    int64_t i0 = 0;
#ifdef ATT_AVX512
    if (D % 16 == 0)
        for (; i0 + 8 <= n; i0 += 8)  /* eight rows a pass, 16 lanes each, their sums reduced together */
            for (int64_t g = 0; g < G; g++) {
                __m512 a[8];
                __m256 h[8];
                for (int j = 0; j < 8; j++) a[j] = _mm512_setzero_ps();
                for (int64_t d = 0; d < D; d += 16) {
                    const __m512 qv = _mm512_loadu_ps(qs + g * D + d);
                    for (int j = 0; j < 8; j++)
                        a[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + (i0 + j) * stride + d), a[j]);
                }
                for (int j = 0; j < 8; j++) h[j] = fold512(a[j]);
                _mm256_storeu_ps(s[g] + i0, hsum8(h));
            }
#endif
#ifdef ATT_AVX2
    if (D % 8 == 0)
        for (; i0 + 8 <= n; i0 += 8)  /* eight rows a pass, their sums reduced together */
            for (int64_t g = 0; g < G; g++) {
                __m256 a[8];
                for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
                for (int64_t d = 0; d < D; d += 8) {
                    const __m256 qv = _mm256_loadu_ps(qs + g * D + d);
                    for (int j = 0; j < 8; j++)
                        a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (i0 + j) * stride + d), a[j]);
                }
                _mm256_storeu_ps(s[g] + i0, hsum8(a));
            }
#endif
    for (; i0 < n; i0++)
        for (int64_t g = 0; g < G; g++) s[g][i0] = dot(qs + g * D, k + i0 * stride, D);
}

#ifdef ATT_AVX512
#define WEIGH_HEADS 6  /* heads whose 64 outputs weigh64 keeps in registers at once: 24 of the 32 */

/* acc[g * (D + 2) + d0 ...] for gn (a constant after inlining) heads from g0: their 64 outputs from d0 plus the n value
 * rows times each head's weights, each output a chain of fused multiply-adds over the rows in order; a value row's
 * four loads serve every head */
static inline __attribute__((always_inline)) void weigh64(float p[][ATT_CHUNK], const int gn, int64_t g0,
                                                          const float *v, int64_t stride, int64_t n, int64_t D,
                                                          int64_t d0, float *acc) {
    __m512 a[WEIGH_HEADS][4];
    for (int g = 0; g < gn; g++)
        for (int j = 0; j < 4; j++) a[g][j] = _mm512_loadu_ps(acc + (g0 + g) * (D + 2) + d0 + 16 * j);
    for (int64_t i = 0; i < n; i++) {
        const float *vi = v + i * stride + d0;
        const __m512 v0 = _mm512_loadu_ps(vi), v1 = _mm512_loadu_ps(vi + 16);
        const __m512 v2 = _mm512_loadu_ps(vi + 32), v3 = _mm512_loadu_ps(vi + 48);
        for (int g = 0; g < gn; g++) {
            const __m512 w = _mm512_set1_ps(p[g0 + g][i]);
            a[g][0] = _mm512_fmadd_ps(w, v0, a[g][0]);
            a[g][1] = _mm512_fmadd_ps(w, v1, a[g][1]);
            a[g][2] = _mm512_fmadd_ps(w, v2, a[g][2]);
            a[g][3] = _mm512_fmadd_ps(w, v3, a[g][3]);
        }
    }
    for (int g = 0; g < gn; g++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + (g0 + g) * (D + 2) + d0 + 16 * j, a[g][j]);
}
#endif

/* acc[g * (D + 2) + 2 ...] += sum over i of p[g][i] * v_i for the n rows v_i = v + i * stride: each output a chain
 * of fused multiply-adds over the rows in order, whatever the registers' width */
static void weigh(float p[][ATT_CHUNK], int64_t G, const float *v, int64_t stride, int64_t n, int64_t D, float *acc) {
    int64_t d0 = 0;
#ifdef ATT_AVX512
    for (; d0 + 64 <= D; d0 += 64)  /* 64 outputs of up to WEIGH_HEADS heads in registers over the rows */
        for (int64_t g0 = 0; g0 < G; g0 += WEIGH_HEADS) {
            switch (G - g0 < WEIGH_HEADS ? G - g0 : WEIGH_HEADS) {
            case 1: weigh64(p, 1, g0, v, stride, n, D, d0, acc + 2); break;
            case 2: weigh64(p, 2, g0, v, stride, n, D, d0, acc + 2); break;
            case 3: weigh64(p, 3, g0, v, stride, n, D, d0, acc + 2); break;
            case 4: weigh64(p, 4, g0, v, stride, n, D, d0, acc + 2); break;
            case 5: weigh64(p, 5, g0, v, stride, n, D, d0, acc + 2); break;
            default: weigh64(p, WEIGH_HEADS, g0, v, stride, n, D, d0, acc + 2); break;
            }
        }
#endif
    for (int64_t g = 0; g < G; g++) {
        float *a = acc + g * (D + 2) + 2;
        int64_t d = d0;
#ifdef ATT_AVX2
        for (; d + 32 <= D; d += 32) {  /* 32 outputs in registers over the rows */
            __m256 a0 = _mm256_loadu_ps(a + d), a1 = _mm256_loadu_ps(a + d + 8);
            __m256 a2 = _mm256_loadu_ps(a + d + 16), a3 = _mm256_loadu_ps(a + d + 24);
            for (int64_t i = 0; i < n; i++) {
                const __m256 w = _mm256_set1_ps(p[g][i]);
                const float *vi = v + i * stride + d;
                a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vi), a0);
                a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vi + 8), a1);
                a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vi + 16), a2);
                a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vi + 24), a3);
            }
            _mm256_storeu_ps(a + d, a0);
            _mm256_storeu_ps(a + d + 8, a1);
            _mm256_storeu_ps(a + d + 16, a2);
            _mm256_storeu_ps(a + d + 24, a3);
        }
        for (; d + 8 <= D; d += 8) {
            __m256 a0 = _mm256_loadu_ps(a + d);
            for (int64_t i = 0; i < n; i++)
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[g][i]), _mm256_loadu_ps(v + i * stride + d), a0);
            _mm256_storeu_ps(a + d, a0);
        }
#endif
        for (; d < D; d++) {
            float t = a[d];
            for (int64_t i = 0; i < n; i++) t += p[g][i] * v[i * stride + d];
            a[d] = t;
        }
    }
}

#if defined(ATT_AVX2) && !defined(ATT_AVX512)
/* int8 and int4 rows read straight from their codes where AVX-512 is missing: on AVX2 the widening of a chunk into
 * fp32 (a multiply and a store of every 8 values, then their load; for int4 two table permutes and a blend as
 * well) took as long as the products themselves. Every 8 codes are converted in registers once for all G query
 * heads of their KV head, G at most ATT_CODES_G (the heads' sums stay in registers):
 * - int8 (D codes, then the row's fp16 scale; D a multiple of 16): a key row's scale multiplies its G scores, a
 *   value row's is folded into its G weights;
 * - int4 (D / 2 bytes, byte j holding values j and j + D/2, then an fp16 scale per 32 values; D a multiple of
 *   32): 16 bytes give 32 values through one byte shuffle of the IQ4_NL levels per nibble, each 8 times their
 *   group's scale. Rows stay turned (the query is turned instead).
 * Other shapes, and the other formats, widen as before. */
#define ATT_CODES 1
#define ATT_CODES_G 4

static inline int codes_read(int fmt, int64_t G, int64_t D) {
    return G <= ATT_CODES_G && ((fmt == TKV_KV_I8 && D % 16 == 0) || (fmt == TKV_KV_I4 && D % 32 == 0));
}

static inline __m256 i8_8(const uint8_t *r) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)r)));
}

/* The 16 values an int4 row's 16 bytes at r hold in their low (high = 0) or high (high = 1) nibbles, times s,
 * as two vectors of 8 */
static inline void i4_16(const uint8_t *r, int high, __m256 s, __m256 out[2]) {
    static const int8_t levels[16] = TKV_IQ4_LEVELS;
    const __m128i b = _mm_loadu_si128((const __m128i *)r), m = _mm_set1_epi8(15);
    const __m128i c = _mm_and_si128(high ? _mm_srli_epi16(b, 4) : b, m);
    const __m128i l = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)levels), c);
    out[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(l)), s);
    out[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(l, 8))), s);
}

/* x[g] + y[g] = q_g . (the row at r, less an int8 row's scale); G and fmt constants after inlining */
static inline __attribute__((always_inline)) void row_dots(const float *qs, const int64_t G, const uint8_t *r,
                                                           int64_t D, const int fmt, __m256 x[], __m256 y[]) {
    for (int64_t g = 0; g < G; g++) x[g] = y[g] = _mm256_setzero_ps();
    if (fmt == TKV_KV_I8) {
        for (int64_t d = 0; d < D; d += 16) {
            const __m256 c0 = i8_8(r + d), c1 = i8_8(r + d + 8);
            for (int64_t g = 0; g < G; g++) {
                x[g] = _mm256_fmadd_ps(c0, _mm256_loadu_ps(qs + g * D + d), x[g]);
                y[g] = _mm256_fmadd_ps(c1, _mm256_loadu_ps(qs + g * D + d + 8), y[g]);
            }
        }
        return;
    }
    const int64_t half = D / 2;
    for (int64_t high = 0; high < 2; high++)
        for (int64_t j = 0; j < half; j += 16) {
            const int64_t d = high * half + j;  /* the first of the 16 values, all in one group of 32 */
            __m256 c[2];
            i4_16(r + j, (int)high, _mm256_set1_ps(tkv_h2f_at(r + half + 2 * (d >> 5))), c);
            for (int64_t g = 0; g < G; g++) {
                x[g] = _mm256_fmadd_ps(c[0], _mm256_loadu_ps(qs + g * D + d), x[g]);
                y[g] = _mm256_fmadd_ps(c[1], _mm256_loadu_ps(qs + g * D + d + 8), y[g]);
            }
        }
}

/* scores() over n rows in format fmt, read from their codes */
static inline __attribute__((always_inline)) void scores_codes_g(const float *qs, const int64_t G, const uint8_t *k,
                                                                 int64_t stride, int64_t n, int64_t D, const int fmt,
                                                                 float s[][ATT_CHUNK]) {
    for (int64_t i0 = 0; i0 < n; i0 += 8) {  /* s holds ATT_CHUNK (a multiple of 8) scores a head */
        __m256 a[ATT_CODES_G][8];
        float sc[8];
        for (int64_t j = 0; j < 8; j++) {
            if (i0 + j >= n) {
                for (int64_t g = 0; g < G; g++) a[g][j] = _mm256_setzero_ps();
                sc[j] = 0.f;
                continue;
            }
            const uint8_t *r = k + (i0 + j) * stride;
            __m256 x[ATT_CODES_G], y[ATT_CODES_G];
            row_dots(qs, G, r, D, fmt, x, y);
            for (int64_t g = 0; g < G; g++) a[g][j] = _mm256_add_ps(x[g], y[g]);
            sc[j] = fmt == TKV_KV_I8 ? tkv_h2f_at(r + D) : 1.f;
        }
        const __m256 scales = _mm256_loadu_ps(sc);
        for (int64_t g = 0; g < G; g++) _mm256_storeu_ps(s[g] + i0, _mm256_mul_ps(hsum8(a[g]), scales));
    }
}

/* weigh() over n rows in format fmt, read from their codes: 16 outputs of every head in registers over the rows */
static inline __attribute__((always_inline)) void weigh_codes_g(float p[][ATT_CHUNK], const int64_t G,
                                                                const uint8_t *v, int64_t stride, int64_t n,
                                                                int64_t D, const int fmt, float *acc) {
    float w[ATT_CODES_G][ATT_CHUNK];
    for (int64_t i = 0; i < n; i++) {
        const float sc = fmt == TKV_KV_I8 ? tkv_h2f_at(v + i * stride + D) : 1.f;
        for (int64_t g = 0; g < G; g++) w[g][i] = p[g][i] * sc;
    }
    for (int64_t d = 0; d < D; d += 16) {
        __m256 x[ATT_CODES_G], y[ATT_CODES_G];
        for (int64_t g = 0; g < G; g++) {
            x[g] = _mm256_loadu_ps(acc + g * (D + 2) + 2 + d);
            y[g] = _mm256_loadu_ps(acc + g * (D + 2) + 10 + d);
        }
        const int64_t half = D / 2, high = d >= half, j = d - high * half;  /* int4: the bytes of values d.. */
        for (int64_t i = 0; i < n; i++) {
            const uint8_t *r = v + i * stride;
            __m256 c[2];
            if (fmt == TKV_KV_I8) {
                c[0] = i8_8(r + d);
                c[1] = i8_8(r + d + 8);
            } else {
                i4_16(r + j, (int)high, _mm256_set1_ps(tkv_h2f_at(r + half + 2 * (d >> 5))), c);
            }
            for (int64_t g = 0; g < G; g++) {
                const __m256 wg = _mm256_broadcast_ss(&w[g][i]);
                x[g] = _mm256_fmadd_ps(wg, c[0], x[g]);
                y[g] = _mm256_fmadd_ps(wg, c[1], y[g]);
            }
        }
        for (int64_t g = 0; g < G; g++) {
            _mm256_storeu_ps(acc + g * (D + 2) + 2 + d, x[g]);
            _mm256_storeu_ps(acc + g * (D + 2) + 10 + d, y[g]);
        }
    }
}

/* call(g, f) with G's and fmt's values as constants (fmt int8 or int4, G at most ATT_CODES_G) */
#define CODES_CASES(call)                                                                                        \
    switch ((fmt == TKV_KV_I8 ? 0 : 4) + (G < ATT_CODES_G ? G : ATT_CODES_G) - 1) {                              \
    case 0: call(1, TKV_KV_I8); break;                                                                           \
    case 1: call(2, TKV_KV_I8); break;                                                                           \
    case 2: call(3, TKV_KV_I8); break;                                                                           \
    case 3: call(4, TKV_KV_I8); break;                                                                           \
    case 4: call(1, TKV_KV_I4); break;                                                                           \
    case 5: call(2, TKV_KV_I4); break;                                                                           \
    case 6: call(3, TKV_KV_I4); break;                                                                           \
    default: call(4, TKV_KV_I4); break;                                                                          \
    }

/* scores() and weigh() for rows codes_read takes */
static void scores_codes(const float *qs, int64_t G, const uint8_t *k, int64_t stride, int64_t n, int64_t D, int fmt,
                         float s[][ATT_CHUNK]) {
#define SCORES(g, f) scores_codes_g(qs, g, k, stride, n, D, f, s)
    CODES_CASES(SCORES)
#undef SCORES
}

static void weigh_codes(float p[][ATT_CHUNK], int64_t G, const uint8_t *v, int64_t stride, int64_t n, int64_t D,
                        int fmt, float *acc) {
#define WEIGH(g, f) weigh_codes_g(p, g, v, stride, n, D, f, acc)
    CODES_CASES(WEIGH)
#undef WEIGH
}
#endif

/* x[i] = e^(x[i] - m), returns their sum (eight lanes' sums over the rows in order, then summed) */
static inline float exp_sum(float *x, int64_t n, float m) {
    int64_t i = 0;
    float s = 0.f;
#ifdef ATT_AVX2
    __m256 vs = _mm256_setzero_ps(), vm = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        _mm256_storeu_ps(x + i, e);
        vs = _mm256_add_ps(vs, e);
    }
    s = hsum256(vs);
#endif
    for (; i < n; i++) s += (x[i] = expf(x[i] - m));
    return s;
}

/* x[i] *= scale, returns the largest of m and them */
static inline float scale_max(float *x, int64_t n, float scale, float m) {
    int64_t i = 0;
#ifdef ATT_AVX512
    if (n >= 16) {
        const __m512 sc = _mm512_set1_ps(scale);
        __m512 top = _mm512_set1_ps(m);
        for (; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), sc);
            _mm512_storeu_ps(x + i, v);
            top = _mm512_max_ps(v, top);  /* v where v > top, else top (a NaN score is passed over, as below) */
        }
        m = _mm512_reduce_max_ps(top);
    }
#endif
    for (; i < n; i++) m = (x[i] *= scale) > m ? x[i] : m;
    return m;
}

/* The largest of m and x[0..n) */
static inline float max_of(const float *x, int64_t n, float m) {
    int64_t i = 0;
#ifdef ATT_AVX2
    if (n >= 8) {
        __m256 v = _mm256_loadu_ps(x);
        for (i = 8; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + i));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        const float top = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        m = top > m ? top : m;
    }
#endif
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* The positions of each split of a sequence's `len` in S splits: whole blocks, so that a chunk never straddles two */
static inline int64_t att_per(int64_t len, int64_t S, int64_t bs) {
    const int64_t per = (len + S - 1) / S;
    return (per + bs - 1) / bs * bs;
}

/* Splits of each sequence's positions: at least two items a thread and a multiple of the threads where the
 * positions allow, none shorter than ATT_MIN_SPLIT positions. */
static int64_t att_splits(int64_t B, int64_t longest, int threads) {
    int64_t most = (longest + ATT_MIN_SPLIT - 1) / ATT_MIN_SPLIT, s = 1;
    while (s < most && (B * s < 2 * threads || (B * s) % threads != 0)) s++;
    return s;
}

/* n rows of one side's cache from `src` (stride bytes apart) as fp32 rows: where they lie for fp32 (*fstride: the
 * rows' stride in floats), else widened into `wide` (a chunk of one KV head, which stays in L1) */
static inline const float *att_rows(const uint8_t *src, int fmt, int64_t stride, int64_t n, int64_t D, float *wide,
                                    int64_t *fstride) {
    if (fmt == TKV_KV_F32) {
        *fstride = stride / (int64_t)sizeof(float);
        return (const float *)src;
    }
    tkv_kv_rows(src, fmt, stride, n, D, wide);
    *fstride = D;
    return wide;
}

/* The chunk of an item's positions [p, p1) that starts at p: its rows (returned) and their first row's
 * byte offset in the caches (*first; `row`: a token's bytes) */
static inline int64_t att_chunk(const int32_t *table, int64_t bs, int64_t row, int64_t p, int64_t p1,
                                int64_t *first) {
    int64_t n = bs - p % bs < p1 - p ? bs - p % bs : p1 - p;
    *first = (table[p / bs] * bs + p % bs) * row;
    return n > ATT_CHUNK ? ATT_CHUNK : n;
}

/* Asks for bytes [b0, b1) of K and V from byte `at` of the caches, a cache line at a time */
static inline void att_fetch(const void *kc, const void *vc, int64_t at, int64_t b0, int64_t b1) {
    for (int64_t b = b0 & ~(int64_t)63; b < b1; b += 64) {
        __builtin_prefetch((const char *)kc + at + b);
        __builtin_prefetch((const char *)vc + at + b);
    }
}

/* Each thread's copies of a chunk's K and V rows (att_item) */
static __thread uint8_t att_copy[2][ATT_COPY] __attribute__((aligned(64)));

/* A chunk of an item's positions: up to ATT_CHUNK of them from a position, in spans that each lie in one block (each
 * span's first row's byte offset in the caches and its rows) */
typedef struct {
    int64_t n, spans, first[ATT_CHUNK], rows[ATT_CHUNK];
} att_span;

/* The chunk of [p, p1) that starts at p into *c; returns its rows */
static inline int64_t att_spans(const int32_t *table, int64_t bs, int64_t row, int64_t p, int64_t p1, att_span *c) {
    c->n = c->spans = 0;
    while (c->n < ATT_CHUNK && p + c->n < p1) {
        int64_t first, k = att_chunk(table, bs, row, p + c->n, p1, &first);
        k = k < ATT_CHUNK - c->n ? k : ATT_CHUNK - c->n;
        c->first[c->spans] = first;
        c->rows[c->spans++] = k;
        c->n += k;
    }
    return c->n;
}

/* Asks for one KV head's share (kvh of Hkv) of a chunk's K and V rows */
static inline void att_fetch_share(const void *kc, const void *vc, const att_span *c, int64_t row, int64_t kvh,
                                   int64_t Hkv) {
    for (int64_t j = 0; j < c->spans; j++)
        att_fetch(kc, vc, c->first[j], c->rows[j] * row * kvh / Hkv, c->rows[j] * row * (kvh + 1) / Hkv);
}

/* One item: positions [p0, p1) of one sequence, every head. A chunk of positions (up to ATT_CHUNK, over as many
 * blocks as that takes) is read once, all its KV heads side by side in memory, while the next is fetched: the next
 * chunk lies in other blocks, where the hardware prefetchers' streams stop. The item's first chunk is asked for at
 * once; each next one a KV head's share at a time, as this one's heads are computed (all at once, the requests
 * waited on one another). From memory, the default model's shapes, AMD EPYC Zen 5, 2 threads, us a layer before ->
 * after, two runs: 192 positions 29.5 -> 26.6 and 35.2 -> 34.5, 1,024 positions 122 -> 118 and 105 -> 98, 4,000
 * 421 -> 402. A chunk's softmax step (its maximum, the rescale of the sums so far) and the loads and stores of the
 * weighted sums cost the same for few positions as for many: chunks of 32 positions over two blocks of 16 rather
 * than one block's 16 (with the value rows' loads shared by a KV head's query heads, weigh64, and the scaling and
 * maximum 16 lanes wide) took 0.81-0.86x the time for a verification's 9 rows over 7,000 positions and 0.76-0.93x
 * for one decode row (AMD EPYC Zen 4, 2 threads, the default model's heads, both builds in one process, 30 layers
 * from memory and one from cache). `part` receives each query head's maximum, sum and D weighted values
 * (part[h * (D + 2)]: m, l, acc[D]).
 *
 * R rows at once (speculative decoding's verification: a sequence's consecutive positions) that read the same
 * table from the same first position p0, row r to its own end p1[r], its query at q + r * qs, its results at
 * part + r * ps: each chunk of positions is read once for all of them (the longest row's chunk; a shorter row's
 * last chunk is its first rows), and each row's arithmetic is what it would be alone, the same chunks in the
 * same order (a chunk's spans end at blocks' ends and at the row's end, and nowhere else). */
static void att_item(const float *q, int64_t qs, int64_t R, const uint8_t *kc, const uint8_t *vc, int fmt, int64_t rb,
                     int64_t bs, int64_t Hkv, int64_t D, int64_t G, const int32_t *table, int64_t p0,
                     const int64_t *p1, float scale, float *part, int64_t ps) {
    float s[ATT_MAX_G][ATT_CHUNK];
    /* a chunk's K and V rows of one KV head as fp32, where they are stored otherwise */
    float wide_k[ATT_CHUNK * ATT_MAX_D], wide_v[ATT_CHUNK * ATT_MAX_D];
    att_span chunk, next;
    const int64_t G2 = D + 2, row = Hkv * rb;
    const int kf = fmt & 15, vf = fmt >> 4;
#ifdef ATT_CODES
    const int k_codes = codes_read(kf, G, D), v_codes = codes_read(vf, G, D);
#else
    const int k_codes = 0, v_codes = 0;
#endif
    int64_t end = p0;
    for (int64_t r = 0; r < R; r++) {
        end = p1[r] > end ? p1[r] : end;
        for (int64_t h = 0; h < Hkv * G; h++) {
            float *ph = part + r * ps + h * G2;
            ph[0] = -INFINITY;
            ph[1] = 0.f;
            memset(ph + 2, 0, D * sizeof(float));
        }
    }
    chunk.n = 0;
    if (p0 < end) {
        att_spans(table, bs, row, p0, end, &chunk);
        att_fetch_share(kc, vc, &chunk, row, 0, 1);
    }
    for (int64_t p = p0; p < end; chunk = next) {
        const int64_t n = chunk.n;
        next.n = next.spans = 0;
        if (p + n < end) att_spans(table, bs, row, p + n, end, &next);
        /* each span's first row, K and V: the chunk's rows copied side by side (read from memory in order: reading
         * them a KV head at a time, a slice of each row, went at a third to a half of the memory's speed), or in the
         * caches for a short item or where a chunk's rows are more than ATT_COPY bytes */
        const uint8_t *kb[ATT_CHUNK], *vb[ATT_CHUNK];
        const int copy = end - p0 >= ATT_COPY_FROM && n * row <= ATT_COPY;
        for (int64_t j = 0, o = 0; j < chunk.spans; o += chunk.rows[j++]) {
            kb[j] = copy ? att_copy[0] + o * row : kc + chunk.first[j];
            vb[j] = copy ? att_copy[1] + o * row : vc + chunk.first[j];
            if (copy) {
                memcpy(att_copy[0] + o * row, kc + chunk.first[j], chunk.rows[j] * row);
                memcpy(att_copy[1] + o * row, vc + chunk.first[j], chunk.rows[j] * row);
            }
        }
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            att_fetch_share(kc, vc, &next, row, kvh, Hkv);
            /* each span's rows of this KV head: where they lie (fp32), or widened side by side */
            const float *k[ATT_CHUNK], *v[ATT_CHUNK];
            int64_t k_stride = 0, v_stride = 0;
            for (int64_t j = 0, o = 0; j < chunk.spans; o += chunk.rows[j++]) {
                const int64_t m = chunk.rows[j];
                k[j] = k_codes ? NULL : att_rows(kb[j] + kvh * rb, kf, row, m, D, wide_k + o * D, &k_stride);
                v[j] = v_codes ? NULL : att_rows(vb[j] + kvh * rb, vf, row, m, D, wide_v + o * D, &v_stride);
            }
            for (int64_t r = 0; r < R; r++) {
                const int64_t nr = p1[r] - p < n ? p1[r] - p : n;  /* this row's chunk: n, or its first rows */
                if (nr <= 0) continue;
                const float *qr = q + r * qs + kvh * G * D;
                float *ph = part + r * ps + kvh * G * G2;
                for (int64_t j = 0, o = 0; j < chunk.spans && o < nr; o += chunk.rows[j++]) {
                    const int64_t c = nr - o < chunk.rows[j] ? nr - o : chunk.rows[j];
                    float(*sj)[ATT_CHUNK] = (float(*)[ATT_CHUNK])(s[0] + o);
#ifdef ATT_CODES
                    if (k_codes)
                        scores_codes(qr, G, kb[j] + kvh * rb, row, c, D, kf, sj);
                    else
#endif
                        scores(qr, G, k[j], k_stride, c, D, sj);
                }
                for (int64_t g = 0; g < G; g++) {
                    float *pg = ph + g * G2;
                    const float m = scale_max(s[g], nr, scale, pg[0]);
                    const float alpha = expf(pg[0] - m);  /* 0 at the first chunk (m was -inf) */
                    const float sum = exp_sum(s[g], nr, m);
                    if (alpha != 1.f)
                        for (int64_t d = 0; d < D; d++) pg[2 + d] *= alpha;
                    pg[0] = m;
                    pg[1] = pg[1] * alpha + sum;
                }
                for (int64_t j = 0, o = 0; j < chunk.spans && o < nr; o += chunk.rows[j++]) {
                    const int64_t c = nr - o < chunk.rows[j] ? nr - o : chunk.rows[j];
                    float(*pj)[ATT_CHUNK] = (float(*)[ATT_CHUNK])(s[0] + o);
#ifdef ATT_CODES
                    if (v_codes) {
                        weigh_codes(pj, G, vb[j] + kvh * rb, row, c, D, vf, ph);
                        continue;
                    }
#endif
                    weigh(pj, G, v[j], v_stride, c, D, ph);
                }
            }
        }
        p += n;
    }
}

/* The floats of one item's partial results in `parts`: its Hq heads' (m, l, acc[D]), rounded up to whole cache
 * lines, so that no two threads write one line */
static inline int64_t item_floats(int64_t Hq, int64_t D) {
    return (Hq * (D + 2) + 15) / 16 * 16;
}

/* The floats attention_share's `parts` takes: B * S items' partial results, then, from a cache line of their own
 * (turned_at), the queries turned where K's rows are (tkv_kv_rotates): every item reads them, and a line shared
 * with an item's partial results, which another thread writes, made int4 attention 1.1x the time of the same
 * kernel with no turn at all */
static int64_t turned_at(int64_t B, int64_t S, int64_t Hq, int64_t D) {
    return B * S * item_floats(Hq, D) + 16;
}

static int64_t parts_floats(int64_t B, int64_t S, int64_t Hq, int64_t D) {
    return turned_at(B, S, Hq, D) + B * Hq * D;
}

int64_t tkv_attention_parts(int64_t rows, int64_t splits, int64_t Hq, int64_t D) {
    return parts_floats(rows, splits, Hq, D);
}

/* The work of tkv_paged_decode as worksharing loops (every thread of the enclosing region calls it): each
 * sequence's positions in S splits, their partial results in parts (parts_floats), then merged. Where K's rows
 * are stored turned (int4), the queries are turned the same way first (q . k is unchanged), and where V's
 * are, each output is turned back. Queries qs floats apart. `together`: the B rows are one sequence's (one table,
 * tables' first row), each split the same positions `per` apart for all (att_per), an item each split with all
 * the rows in it (att_item: each chunk of positions read once); else an item each row and split. */
static void attention_share(const float *q, int64_t qs, int64_t B, int64_t Hq, int64_t D, const void *kc,
                            const void *vc, int fmt, int64_t rb, int64_t bs, int64_t Hkv, const int32_t *tables,
                            int64_t ts, const int32_t *lens, float scale, int64_t S, int together, float *parts,
                            float *out) {
    const int64_t G = Hq / Hkv, items = together ? S : B * S, G2 = D + 2, IS = item_floats(Hq, D);
    if (tkv_kv_rotates(fmt & 15, D)) {
        float *turned = parts + turned_at(B, S, Hq, D);
        #pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * Hq; bh++) {
            memcpy(turned + bh * D, q + bh / Hq * qs + bh % Hq * D, D * sizeof(float));
            tkv_hadamard(turned + bh * D, D);
        }
        q = turned;
        qs = Hq * D;
    }
    #pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; it++) {
        const int64_t b = together ? 0 : it / S, sp = together ? it : it % S, n = together ? B : 1;
        const int64_t per = att_per(lens[b], S, bs);
        int64_t p0 = sp * per, p1[TKV_ATT_MAX_ROWS];
        if (!together && p0 > lens[b]) p0 = lens[b];
        for (int64_t r = 0; r < n; r++) {  /* a row whose positions end before the split has none in it */
            const int64_t len = lens[b + r];
            p1[r] = p0 >= len ? p0 : p0 + per < len ? p0 + per : len;
        }
        att_item(q + b * qs, qs, n, (const uint8_t *)kc, (const uint8_t *)vc, fmt, rb, bs, Hkv, D, G,
                 tables + b * ts, p0, p1, scale, parts + (together ? sp : it) * IS, S * IS);
    }
    #pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * Hq; bh++) {  /* the splits of each head merged */
        const int64_t b = bh / Hq, h = bh % Hq;
        const float *first = parts + b * S * IS + h * G2;
        float m = -INFINITY, l = 0.f;
        for (int64_t sp = 0; sp < S; sp++) m = first[sp * IS] > m ? first[sp * IS] : m;
        float *o = out + bh * D;
        memset(o, 0, D * sizeof(float));
        for (int64_t sp = 0; sp < S; sp++) {
            const float *pg = first + sp * IS;
            if (pg[1] == 0.f) continue;  /* a split with no positions */
            const float w = expf(pg[0] - m);
            l += pg[1] * w;
            for (int64_t d = 0; d < D; d++) o[d] += w * pg[2 + d];
        }
        const float inv = 1.f / l;
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
        if (tkv_kv_rotates(fmt >> 4, D)) tkv_hadamard(o, D);
    }
}

int tkv_attention_fits(int64_t Hq, int64_t D, int64_t bs, int64_t Hkv) {
    return Hkv > 0 && Hq % Hkv == 0 && Hq / Hkv <= ATT_MAX_G && D <= ATT_MAX_D && D > 0 && bs > 0;
}

/* The threads that decode attention's splits are chosen for (tkv_split_threads): 0, the team's that runs it;
 * else the count set, fixed while an engine serves, so that a step run on fewer threads (platform/cpu_share.py)
 * splits its positions as every other step does and gives the same bits. */
static int split_threads_set = 0;

void tkv_set_split_threads(int threads) {
    split_threads_set = threads > 0 ? threads : 0;
}

int tkv_split_threads(void) {
    if (split_threads_set > 0) return split_threads_set;
#ifdef _OPENMP
    return omp_in_parallel() ? omp_get_num_threads() : omp_get_max_threads();
#else
    return 1;
#endif
}

/* q [B, Hq, D] fp32; kc, vc [*, bs, Hkv, rb bytes]: rows in K's format (fmt & 15) and V's (fmt >> 4), cpu_kernels.h:
 * TKV_KV_*; tables [B, ts] int32; lens [B] int32 (each >= 1 and within its table); out [B, Hq, D] fp32. Returns -1
 * for a shape the kernel does not take (Hq not a multiple of Hkv, G or D above their limits, an unknown format)
 * or no memory, 0 when done. */
int tkv_paged_decode(const float *q, int64_t B, int64_t Hq, int64_t D, const void *kc, const void *vc, int fmt,
                     int64_t rb, int64_t bs, int64_t Hkv, const int32_t *tables, int64_t ts, const int32_t *lens,
                     float scale, float *out) {
    if (B <= 0 || !tkv_attention_fits(Hq, D, bs, Hkv) || !tkv_kv_row_bytes(fmt & 15, D) ||
        !tkv_kv_row_bytes(fmt >> 4, D))
        return -1;
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) longest = lens[b] > longest ? lens[b] : longest;
    const int64_t S = att_splits(B, longest, tkv_split_threads());
    float *parts = (float *)tkv_scratch((size_t)parts_floats(B, S, Hq, D) * sizeof(float));
    if (!parts) return -1;
    #pragma omp parallel
    attention_share(q, Hq * D, B, Hq, D, kc, vc, fmt, rb, bs, Hkv, tables, ts, lens, scale, S, 0, parts, out);
    return 0;
}

int64_t tkv_attention_splits(int64_t len, int threads) {
    return att_splits(1, len, threads);
}

int64_t tkv_attention_together(const int32_t *lens, int64_t R, int64_t bs, int threads) {
    const int64_t S = att_splits(1, lens[0], threads), per = att_per(lens[0], S, bs);
    int64_t n = 1;
    while (n < R && n < TKV_ATT_MAX_ROWS && att_splits(1, lens[n], threads) == S && att_per(lens[n], S, bs) == per)
        n++;
    return n;
}

void tkv_attention_share(const float *q, int64_t qs, int64_t R, int64_t Hq, int64_t D, const void *kc, const void *vc,
                         int fmt, int64_t rb, int64_t bs, int64_t Hkv, const int32_t *table, const int32_t *lens,
                         float scale, int64_t splits, float *parts, float *out) {
    attention_share(q, qs, R, Hq, D, kc, vc, fmt, rb, bs, Hkv, table, 0, lens, scale, splits, 1, parts, out);
}

/* Prefill attention: the T queries of a prompt's chunk attend causally to the sequence's cached prefix and to
 * themselves (query j of a chunk of T sits at position L - T + j of a sequence of L positions).
 *
 * Where decode reads each key once for one query per head, a chunk's queries meet every key many times, so the
 * keys are read as the operands of small matrix products: per KV head, each sequence's keys are laid out once,
 * turned ([D][L], the positions side by side), and its values as rows [L][D], fp32 (widened from the cache's
 * format); then an item takes a tile of the chunk's query vectors (PF_ROWS of them: positions x the G query heads
 * of the KV head, scaled), and for each chunk of PF_KEYS positions scores PF_SV vectors at a time against them,
 * one load of the turned keys serving every vector (a key's scores come out side by side: no sum across a
 * register's lanes), keeps each vector's running maximum and sum (online softmax), and adds the values times
 * the weights, PF_PV vectors and 4 registers of outputs at a time. A vector meets the positions up to its own:
 * they are a prefix of each chunk of positions, so the exponentials and the values stop there.
 * Vectors are GCC's vector extensions, as wide as the build's registers (16 floats with AVX-512, else 8). */
#ifdef __AVX512F__
#define PF_W 16
#define PF_SV 8  /* vectors scored together: 8 x 2 registers of sums */
#define PF_PV 4  /* vectors weighed together: 4 x 4 registers of outputs */
#else
#define PF_W 8
#define PF_SV 6
#define PF_PV 3
#endif
#define PF_KEYS (2 * PF_W)  /* positions a chunk */
#define PF_ROWS 32          /* query vectors an item takes at most */
/* chunks of at most PF_DECODE_ROWS queries attend as decode rows (chunks_as_decode): a lone sequence's over at least
 * PF_DECODE_SPAN times as many positions, several sequences' where each has at least PF_DECODE_BATCH positions.
 * Measured on an AMD EPYC (Zen 4, 2 threads), the default model's 30 layers (9 query heads, 3 KV heads, 64 dims),
 * against the items. One sequence: 2 to 9 queries over 48 to 4,000 positions 0.18-0.70x the time (9 over 128: 3.12
 * -> 1.93 ms, over 1,000: 21.4 -> 8.3, over 4,000: 44.0 -> 27.2); 9 over 16 1.05x, and 16 queries over 4,000
 * positions 1.22x (there the items' matrix products win). 2 to 8 sequences of 9 queries: over 512 positions
 * 0.70-0.92x, over 1,000 0.36-0.48x, but over 48-128 1.1-1.45x (a group's barriers beside few positions). */
#define PF_DECODE_ROWS 9
#define PF_DECODE_SPAN 4
#define PF_DECODE_BATCH 512
typedef float pf_vec __attribute__((vector_size(PF_W * 4), aligned(4)));  /* loads and stores need no alignment */

/* Positions [p0, p1) of a sequence's keys of KV head h turned into kt [D][Lp] and its values into vt [L][D] (Lp: L
 * rounded up to whole chunks; the positions past L zero, written by the span that ends at L) */
static void pf_lay_out(const uint8_t *kc, const uint8_t *vc, int fmt, int64_t rb, int64_t bs, int64_t Hkv, int64_t D,
                       const int32_t *table, int64_t p0, int64_t p1, int64_t L, int64_t Lp, int64_t h, float *kt,
                       float *vt) {
    float rows[ATT_CHUNK * ATT_MAX_D];
    const int64_t row = Hkv * rb;
    for (int64_t p = p0; p < p1;) {
        int64_t first;
        const int64_t n = att_chunk(table, bs, row, p, p1, &first);
        tkv_kv_rows(kc + first + h * rb, fmt & 15, row, n, D, rows);
        for (int64_t i = 0; i < n; i++)
            for (int64_t d = 0; d < D; d++) kt[d * Lp + p + i] = rows[i * D + d];
        tkv_kv_rows(vc + first + h * rb, fmt >> 4, row, n, D, vt + p * D);
        p += n;
    }
    if (p1 == L)
        for (int64_t d = 0; d < D; d++) memset(kt + d * Lp + L, 0, (Lp - L) * sizeof(float));
}

#define PF_SPAN 128  /* positions a thread lays out at a time (one sequence's keys are shared out too) */
#define PF_KEPT ((size_t)32 << 20)  /* the most layout bytes kept in the thread's scratch between calls */

/* s[v][0..PF_KEYS) = qs_v . the chunk's keys (kt: its first column, Lp floats a row) for the V <= PF_SV vectors */
static inline __attribute__((always_inline)) void pf_scores(const float *qs, int V, int64_t D, const float *kt,
                                                            int64_t Lp, float s[][PF_KEYS]) {
    pf_vec a[PF_SV][2];
    for (int v = 0; v < V; v++) a[v][0] = a[v][1] = (pf_vec){0};
    for (int64_t d = 0; d < D; d++) {
        const pf_vec k0 = *(const pf_vec *)(kt + d * Lp), k1 = *(const pf_vec *)(kt + d * Lp + PF_W);
        for (int v = 0; v < V; v++) {
            const float x = qs[v * D + d];
            a[v][0] += x * k0;
            a[v][1] += x * k1;
        }
    }
    for (int v = 0; v < V; v++) {
        *(pf_vec *)s[v] = a[v][0];
        *(pf_vec *)(s[v] + PF_W) = a[v][1];
    }
}

/* o_v += sum over i < n_v of p[v][i] vt_i for the V <= PF_PV vectors (o: D floats a vector; p zero past n_v) */
static inline __attribute__((always_inline)) void pf_weigh(float p[][PF_KEYS], int V, int64_t n, int64_t D,
                                                           const float *vt, float *o) {
    int64_t d = 0;
    for (; d + 4 * PF_W <= D; d += 4 * PF_W) {
        pf_vec a[PF_PV][4];
        for (int v = 0; v < V; v++)
            for (int j = 0; j < 4; j++) a[v][j] = *(const pf_vec *)(o + v * D + d + j * PF_W);
        for (int64_t i = 0; i < n; i++) {
            const float *r = vt + i * D + d;
            pf_vec r0 = *(const pf_vec *)r, r1 = *(const pf_vec *)(r + PF_W);
            pf_vec r2 = *(const pf_vec *)(r + 2 * PF_W), r3 = *(const pf_vec *)(r + 3 * PF_W);
#ifdef __AVX__
            /* in registers, each read once for the V vectors (left to itself the compiler reads them again from
             * memory in every product, 16 loads where 4 do: a 512-token prefill's attention 8% slower on Zen 4) */
            __asm__("" : "+x"(r0), "+x"(r1), "+x"(r2), "+x"(r3));
#endif
            for (int v = 0; v < V; v++) {
                const float w = p[v][i];
                a[v][0] += w * r0;
                a[v][1] += w * r1;
                a[v][2] += w * r2;
                a[v][3] += w * r3;
            }
        }
        for (int v = 0; v < V; v++)
            for (int j = 0; j < 4; j++) *(pf_vec *)(o + v * D + d + j * PF_W) = a[v][j];
    }
    for (; d < D; d += PF_W) {
        pf_vec a[PF_PV];
        for (int v = 0; v < V; v++) a[v] = *(const pf_vec *)(o + v * D + d);
        for (int64_t i = 0; i < n; i++)
            for (int v = 0; v < V; v++) a[v] += p[v][i] * *(const pf_vec *)(vt + i * D + d);
        for (int v = 0; v < V; v++) *(pf_vec *)(o + v * D + d) = a[v];
    }
}

/* pf_scores and pf_weigh with V a constant: the sums stay in registers (with V read at run time the compiler kept
 * them on the stack) */
static void pf_scores_v(const float *qs, int V, int64_t D, const float *kt, int64_t Lp, float s[][PF_KEYS]) {
    switch (V) {
    case 1: pf_scores(qs, 1, D, kt, Lp, s); break;
    case 2: pf_scores(qs, 2, D, kt, Lp, s); break;
    case 3: pf_scores(qs, 3, D, kt, Lp, s); break;
    case 4: pf_scores(qs, 4, D, kt, Lp, s); break;
    case 5: pf_scores(qs, 5, D, kt, Lp, s); break;
#if PF_SV > 6
    case 6: pf_scores(qs, 6, D, kt, Lp, s); break;
    case 7: pf_scores(qs, 7, D, kt, Lp, s); break;
#endif
    default: pf_scores(qs, PF_SV, D, kt, Lp, s);
    }
}

static void pf_weigh_v(float p[][PF_KEYS], int V, int64_t n, int64_t D, const float *vt, float *o) {
    switch (V) {
    case 1: pf_weigh(p, 1, n, D, vt, o); break;
    case 2: pf_weigh(p, 2, n, D, vt, o); break;
#if PF_PV > 3
    case 3: pf_weigh(p, 3, n, D, vt, o); break;
#endif
    default: pf_weigh(p, PF_PV, n, D, vt, o);
    }
}

/* One item: query vectors [r0, r1) of sequence b for KV head h, vector r being position r / G of the chunk, query
 * head h G + r % G; q the chunk's [T, Hq, D], out likewise */
static void pf_item(const float *q, int64_t T, int64_t Hq, int64_t D, int64_t G, int64_t h, int64_t L, int64_t Lp,
                    const float *kt, const float *vt, int64_t r0, int64_t r1, float scale, float *out) {
    float qs[PF_ROWS * ATT_MAX_D], o[PF_ROWS * ATT_MAX_D], s[PF_ROWS][PF_KEYS], m[PF_ROWS], l[PF_ROWS];
    int64_t pos[PF_ROWS];
    const int64_t R = r1 - r0;
    for (int64_t r = 0; r < R; r++) {
        const int64_t j = (r0 + r) / G, head = h * G + (r0 + r) % G;
        for (int64_t d = 0; d < D; d++) qs[r * D + d] = q[(j * Hq + head) * D + d] * scale;
        pos[r] = L - T + j;
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    memset(o, 0, R * D * sizeof(float));
    const int64_t last = L - T + (r1 - 1) / G;  /* the tile's last position */
    for (int64_t c = 0; c <= last; c += PF_KEYS) {
        for (int64_t v = 0; v < R; v += PF_SV)
            pf_scores_v(qs + v * D, R - v < PF_SV ? (int)(R - v) : PF_SV, D, kt + c, Lp, s + v);
        int64_t most = 0;
        for (int64_t r = 0; r < R; r++) {  /* the positions r meets in this chunk: a prefix of it */
            const int64_t n = pos[r] - c + 1 < 0 ? 0 : pos[r] - c + 1 > PF_KEYS ? PF_KEYS : pos[r] - c + 1;
            most = n > most ? n : most;
            const float mx = max_of(s[r], n, m[r]);
            const float alpha = n ? expf(m[r] - mx) : 1.f;  /* 0 at a vector's first chunk (m was -inf) */
            const float sum = n ? exp_sum(s[r], n, mx) : 0.f;
            memset(s[r] + n, 0, (PF_KEYS - n) * sizeof(float));
            if (alpha != 1.f)
                for (int64_t d = 0; d < D; d++) o[r * D + d] *= alpha;
            m[r] = mx;
            l[r] = l[r] * alpha + sum;
        }
        for (int64_t v = 0; v < R; v += PF_PV)
            pf_weigh_v(s + v, R - v < PF_PV ? (int)(R - v) : PF_PV, most, D, vt + c * D, o + v * D);
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t j = (r0 + r) / G, head = h * G + (r0 + r) % G;
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < D; d++) out[(j * Hq + head) * D + d] = o[r * D + d] * inv;
    }
}

/* Short chunks (a speculative verification each: the last token and its drafts) attend as decode rows: sequence b's
 * T queries, query j meeting positions [0, L - T + j], each row's positions in the splits decode gives it, rows of
 * one sequence whose splits agree together (tkv_attention_together: each chunk of positions read once for them),
 * all threads on every group, each row's arithmetic what decode attention does for it alone. The prefill items
 * take a tile of whole positions (30 query vectors of 3 query heads a KV head: the default model's 9-row chunk is
 * one item a head, on one thread, after its keys are laid out). See PF_DECODE_ROWS for where each serves. */
static int chunks_as_decode(const float *q, int64_t Hq, int64_t D, const void *kc, const void *vc, int fmt, int64_t rb,
                            int64_t bs, int64_t Hkv, int64_t B, const int32_t *tables, int64_t ts,
                            const int32_t *qstart, const int32_t *lens, float scale, float *out) {
    const int threads = tkv_split_threads();
    int64_t most = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t need = parts_floats(qstart[b + 1] - qstart[b], att_splits(1, lens[b], threads), Hq, D);
        most = need > most ? need : most;
    }
    float *parts = (float *)tkv_scratch((size_t)most * sizeof(float));
    if (!parts) return -1;
    #pragma omp parallel
    for (int64_t b = 0; b < B; b++) {  /* (every thread walks the same groups: their loops share the work) */
        const int64_t T = qstart[b + 1] - qstart[b], L = lens[b];
        int32_t len[PF_DECODE_ROWS];
        for (int64_t j = 0; j < T; j++) len[j] = (int32_t)(L - T + j + 1);
        const float *qb = q + (int64_t)qstart[b] * Hq * D;
        float *ob = out + (int64_t)qstart[b] * Hq * D;
        for (int64_t r = 0; r < T;) {
            const int64_t n = tkv_attention_together(len + r, T - r, bs, threads);
            attention_share(qb + r * Hq * D, Hq * D, n, Hq, D, kc, vc, fmt, rb, bs, Hkv, tables + b * ts, 0, len + r,
                            scale, att_splits(1, len[r], threads), 1, parts, ob + r * Hq * D);
            r += n;
        }
    }
    return 0;
}

/* q [sum of chunks, Hq, D] fp32, sequence b's chunk its rows [qstart[b], qstart[b + 1]); kc, vc ([blocks, bs, Hkv,
 * rb bytes]), fmt, rb, bs, Hkv as tkv_paged_decode's (formats whose rows are stored turned, int4, not taken); tables
 * [B, ts]; lens [B] (each sequence's positions, its chunk's included, >= the chunk's length); out like q. Returns -1
 * for what it does not take (those formats, D not whole registers, G or D above their limits) or no memory, -2
 * (before anything is read) where a sequence's positions reach past its table or a block id outside the caches, 0
 * when done. */
int tkv_prefill_attention(const float *q, int64_t Hq, int64_t D, const void *kc, const void *vc, int fmt, int64_t rb,
                          int64_t bs, int64_t Hkv, int64_t blocks, int64_t B, const int32_t *tables, int64_t ts,
                          const int32_t *qstart, const int32_t *lens, float scale, float *out) {
    if (B <= 0 || !tkv_attention_fits(Hq, D, bs, Hkv) || D % PF_W || !tkv_kv_row_bytes(fmt & 15, D) ||
        !tkv_kv_row_bytes(fmt >> 4, D) || tkv_kv_rotates(fmt & 15, D) || tkv_kv_rotates(fmt >> 4, D))
        return -1;
    const int64_t G = Hq / Hkv, per = PF_ROWS / G * G;  /* vectors an item: whole positions */
    int64_t floats = 0, tiles = 0, spans = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t T = qstart[b + 1] - qstart[b], L = lens[b];
        if (T < 1 || L < T) return -1;
        if (L > ts * bs) return -2;
        for (int64_t j = 0; j < (L + bs - 1) / bs; j++)
            if (tables[b * ts + j] < 0 || tables[b * ts + j] >= blocks) return -2;
        floats += ((L + PF_KEYS - 1) / PF_KEYS * PF_KEYS + L) * D;
        tiles += (T * G + per - 1) / per;
        spans += (L + PF_SPAN - 1) / PF_SPAN;
    }
    int short_chunks = 1;
    for (int64_t b = 0; b < B; b++) {
        const int64_t T = qstart[b + 1] - qstart[b];
        short_chunks &= T <= PF_DECODE_ROWS && lens[b] >= (B == 1 ? PF_DECODE_SPAN * T : PF_DECODE_BATCH);
    }
    if (short_chunks)
        return chunks_as_decode(q, Hq, D, kc, vc, fmt, rb, bs, Hkv, B, tables, ts, qstart, lens, scale, out);
    const size_t bytes = (size_t)floats * sizeof(float) + (size_t)(2 * B + tiles + spans) * sizeof(int64_t);
    /* the thread's scratch, which it keeps, up to PF_KEPT bytes; a long context's layout is its own allocation,
     * given back when done (its page faults are small beside that many positions' products) */
    float *own = bytes > PF_KEPT ? (float *)malloc(bytes) : NULL;
    float *mem = bytes > PF_KEPT ? own : (float *)tkv_scratch(bytes);
    if (!mem) return -1;
    /* sequence b's floats from at[b], its tiles from first[b]; the sequence of each tile and of each span */
    int64_t *at = (int64_t *)(mem + floats), *first = at + B, *owner = first + B, *spanned = owner + tiles;
    for (int64_t b = 0, f = 0, t = 0, sp = 0; b < B; b++) {
        const int64_t T = qstart[b + 1] - qstart[b], L = lens[b];
        at[b] = f;
        first[b] = t;
        f += ((L + PF_KEYS - 1) / PF_KEYS * PF_KEYS + L) * D;
        for (int64_t n = (T * G + per - 1) / per; n > 0; n--) owner[t++] = b;
        for (int64_t p = 0; p < L; p += PF_SPAN) spanned[sp++] = b * ((int64_t)1 << 32) + p;
    }
    #pragma omp parallel
    for (int64_t h = 0; h < Hkv; h++) {
        #pragma omp for schedule(dynamic, 1)
        for (int64_t sp = 0; sp < spans; sp++) {
            const int64_t b = spanned[sp] >> 32, p0 = spanned[sp] & 0xffffffff, L = lens[b];
            const int64_t Lp = (L + PF_KEYS - 1) / PF_KEYS * PF_KEYS, p1 = p0 + PF_SPAN < L ? p0 + PF_SPAN : L;
            pf_lay_out((const uint8_t *)kc, (const uint8_t *)vc, fmt, rb, bs, Hkv, D, tables + b * ts, p0, p1, L, Lp,
                       h, mem + at[b], mem + at[b] + Lp * D);
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tiles; t++) {  /* (the later tiles of a chunk meet more positions: dynamic) */
            const int64_t b = owner[t], T = qstart[b + 1] - qstart[b], L = lens[b];
            const int64_t Lp = (L + PF_KEYS - 1) / PF_KEYS * PF_KEYS, r0 = (t - first[b]) * per;
            const int64_t r1 = r0 + per < T * G ? r0 + per : T * G;
            pf_item(q + (int64_t)qstart[b] * Hq * D, T, Hq, D, G, h, L, Lp, mem + at[b], mem + at[b] + Lp * D, r0,
                    r1, scale, out + (int64_t)qstart[b] * Hq * D);
        }
    }
    free(own);
    return 0;
}
