/* Dense layers on CPU (the same weights in tiles of 16 rows, multiplied on int8 activation blocks, and the
 * one-row products on oneDNN's packed fp32/bf16 weights are at the end).
 * Weight-only quantized dense layers: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), W stored as
 *   q8: int8 codes [N, K] and one fp16 scale per group of g inputs, w = q * d, or with an fp16 offset
 *       per group too (mn not NULL), w = q * d + m (GGUF's 5-bit and 2-bit asymmetric types)
 *   q4: 4-bit codes [N, K/2] and an fp16 scale and offset per group, w = q * d + m (q in 0..15);
 *       byte j of a group holds input j in its low nibble and input j + g/2 in its high nibble
 *       (GGUF's Q4_0/Q4_1 order, which this generalizes to any group size).
 * Built at run time for the processor at hand (-march=native) by kernels/quant_cpu.py.
 *
 * The activations are quantized per row to int16 (scale = max|x| / 32767, so the error is at most
 * 2^-16 of the row's largest value, finer than bf16), which lets the inner loop multiply 16 weights by
 * 16 activations and add pairs in one instruction (vpmaddwd); the sums are exact in int32 and each
 * group's sum is scaled in fp32. The offsets multiply the group's sum of the fp32 activations.
 * The one-row kernels and the blocks of several rows take a row's sums in one order (q4_row, q8_row, row_out),
 * so a row's output is the same bits alone or among others (a batched decode step, a speculative step's
 * verification rows); so do the 512-bit ones for int4 groups of 32 (q4_row512 after q4_block512).
 * On a processor without AVX2 the same arithmetic runs in plain C. */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TKV_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TKV_AVX512 1  /* q4 groups of 32 on 512-bit registers (tkv_q4_gemv, tkv_q4_linear) */
#if defined(__AVX512VNNI__)
#define DPWSSD(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define DPWSSD(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif
#endif
#endif

#define RB 4        /* weight rows per block: each activation load serves all of them */
#define INLINE static inline __attribute__((always_inline))
#define SPAN 2048   /* int32 sums are moved to fp32 at least this often: 2048/16 * 2*127*32767 < 2^31 */

#define h2f tkv_h2f

/* Scratch memory for a call's activations (their integer codes, scales and group sums, attention's partial
 * results): one buffer per calling thread, kept and grown as needed, handed back with the thread. A decode
 * step makes ~150 calls; each allocating and freeing its few KB made glibc consolidate its fast bins (which
 * Python and torch keep filling) on nearly every call: on an Intel Xeon (KVM guest, 2 threads) the Q4_1 file's
 * batch-1 decode took 0.95-0.98x the time with this (the builds bound in turn, 9-15 rounds), int4 0.98x, int8
 * 0.99x. Returns NULL when the memory cannot be had. One buffer: a call takes it once, before its parallel
 * loop, and gives it to no other call. */
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static __thread void *scratch_ptr;
static __thread size_t scratch_bytes;

static void scratch_key_make(void) { pthread_key_create(&scratch_key, free); }

void *tkv_scratch(size_t bytes) {
    if (scratch_ptr && bytes <= scratch_bytes) return scratch_ptr;
    bytes = bytes < 4096 ? 4096 : bytes;
    pthread_once(&scratch_once, scratch_key_make);
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes)) return NULL;
    free(scratch_ptr);
    scratch_ptr = p;
    scratch_bytes = bytes;
    pthread_setspecific(scratch_key, p);  /* freed when the thread ends */
    return p;
}

/* Bytes rounded up to whole cache lines (the pieces a call cuts its scratch into) */
static size_t lines(size_t bytes) { return (bytes + 63) & ~(size_t)63; }

#ifdef TKV_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* Each row of x as int16 codes and one fp32 scale; for q4 also each group's sum of x. With AVX2 eight at a
 * time (the same codes: the conversion rounds to nearest even, as lrintf does); a call's fixed cost at batch
 * 1, where a layer's product takes tens of microseconds. */
static void quantize_rows(const float *x, int64_t M, int64_t K, int64_t g, int16_t *xq, float *sx, float *xsum) {
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        int16_t *qr = xq + m * K;
        float amax = 0.f, probe = 0.f;  /* probe: the sum of x * 0, NaN where an input is NaN or infinite */
        int64_t k = 0;
#ifdef TKV_AVX2
        __m256 vmax = _mm256_setzero_ps(), vprobe = _mm256_setzero_ps();
        for (; k + 8 <= K; k += 8) {
            const __m256 v = _mm256_loadu_ps(xr + k);
            vmax = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), v), vmax);
            vprobe = _mm256_add_ps(vprobe, _mm256_mul_ps(v, _mm256_setzero_ps()));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        probe = hsum(vprobe);
#endif
        for (; k < K; k++) {
            amax = fmaxf(amax, fabsf(xr[k]));
            probe += xr[k] * 0.f;
        }
        /* a NaN or infinity makes the row's scale NaN (codes 0), so every output of the row is NaN, as the
         * float product's would be: the sampler's test for bad rows sees it */
        const int finite = probe == 0.f;
        float s = !finite ? NAN : amax > 0.f ? amax / 32767.f : 1.f, inv = finite ? 1.f / s : 0.f;
        sx[m] = s;
        k = 0;
#ifdef TKV_AVX2
        for (; k + 8 <= K; k += 8) {
            __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + k), _mm256_set1_ps(inv)));
            __m128i codes = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            _mm_storeu_si128((__m128i *)(qr + k), codes);
        }
#endif
        for (; k < K; k++) qr[k] = (int16_t)lrintf(xr[k] * inv);
        if (xsum) {
            for (int64_t b = 0; b < K / g; b++) {
                float t = 0.f;
                for (int64_t j = 0; j < g; j++) t += xr[b * g + j];
                xsum[m * (K / g) + b] = t;
            }
        }
    }
}


/* The offsets' part of one output: sum over the G groups of m[b] * (the group's sum of the activations) (the tail's
 * products added with an explicit fma: the compiler's contraction of `z + a * b` may differ between inlined copies,
 * and a row's output must be the same bits whichever product computes it) */
static float offset_sum(const uint16_t *mr, const float *xs, int64_t G) {
    float z = 0.f;
    int64_t b = 0;
#ifdef TKV_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; b + 8 <= G; b += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mr + b))), _mm256_loadu_ps(xs + b),
                              acc);
    z = hsum(acc);
#endif
    for (; b < G; b++) z = fmaf(h2f(mr[b]), xs[b], z);
    return z;
}

/* One output of the int16-row products, in the same operations whichever product computes it (one row or many):
 * the products' sum `total` times the activation row's scale plus the bias, in one explicit fma, then the offsets'
 * part `z` */
static inline float row_out(float total, float sx, float bias, float z) { return fmaf(total, sx, bias) + z; }

#ifndef TKV_AVX2
/* Without AVX2: one weight row times one activation row, the arithmetic the vector paths do (exact int32 sums
 * over at most SPAN inputs, scaled in fp32); for q4 *z gets the offsets' part. */
static float q8_row_c(const int8_t *qr, const int16_t *x, const uint16_t *dr, int64_t K, int64_t g) {
    float total = 0.f;
    for (int64_t b = 0; b < K / g; b++)
        for (int64_t s0 = b * g; s0 < (b + 1) * g; s0 += SPAN) {
            int64_t s1 = s0 + SPAN < (b + 1) * g ? s0 + SPAN : (b + 1) * g;
            int32_t acc = 0;
            for (int64_t k = s0; k < s1; k++) acc += (int32_t)qr[k] * x[k];
            total += (float)acc * h2f(dr[b]);
        }
    return total;
}

static float q4_row_c(const uint8_t *qr, const int16_t *x, const uint16_t *dr, const uint16_t *mr, const float *xs,
                      int64_t K, int64_t g, float *z) {
    const int64_t h = g / 2;
    float total = 0.f;
    *z = 0.f;
    for (int64_t b = 0; b < K / g; b++) {
        int32_t acc = 0;
        for (int64_t j = 0; j < h; j++) {
            uint8_t v = qr[b * h + j];
            acc += (int32_t)(v & 15) * x[b * g + j] + (int32_t)(v >> 4) * x[b * g + j + h];
        }
        total += (float)acc * h2f(dr[b]);
        *z += h2f(mr[b]) * xs[b];
    }
    return total;
}
#endif

/* The one-row products ask for the codes of the row AHEAD_ROWS past the one they start: the hardware
 * prefetcher alone left their loads waiting on memory. Measured on an AMD EPYC (Zen 5, 2 threads): the default
 * model's int4 layers over 30 distinct layers, cold, 1.73 -> 1.36 ms (median of 12 rounds alternated; 4 rows
 * ahead 1.55, 12 rows 1.34; asking for the scales too gave nothing more); batch-1 decode in the engine, the two
 * builds bound in turn: int4 0.91x the time, int8 0.84x, the Q4_1 file 0.86x. (The same on the fp32 and bf16
 * packed blocks there, 16-64 inputs ahead: within the noise, 0.95-1.08x; on an Intel Xeon the bf16 blocks gained:
 * BF16_AHEAD.) On that Xeon (KVM guest) these rows' reads from memory did not gain from any distance (2-48 rows)
 * or cache level asked for. */
#define AHEAD_ROWS 8
INLINE void ahead(const void *row, int64_t bytes) {
#ifdef TKV_AVX2
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)row + o, _MM_HINT_T0);
#else
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)row + o);
#endif
}

/* The multi-row blocks' weight rows AHEAD_ROWS past block n (N: the weight's rows), asked for before block n is
 * multiplied by every activation row: as for the one-row products, the hardware prefetcher alone leaves the loads of
 * four interleaved rows waiting on memory. Measured on an AMD EPYC (Zen 3, 2 threads), the default model's Q4_1
 * file, the two builds alternated in one process (medians of 12): the Q8_0 LM head 0.89x the time at 2 rows, 0.93x
 * at 5, 0.89x at 9; the 120 layer products 0.93x at 2 rows, 0.95x at 5, 1.00x at 9 (the arithmetic's share grows). */
INLINE void block_ahead(const void *q, int64_t row_bytes, int64_t n, int64_t N) {
    for (int r = 0; r < RB && n + AHEAD_ROWS + r < N; r++)
        ahead((const char *)q + (n + AHEAD_ROWS + r) * row_bytes, row_bytes);
}

/* Rows [n, n + rows) of the output for activation rows [m, m + mt), mt 1 or 2 (inlined with a constant mt, so
 * the one-row case does half the multiplies). */
INLINE void q8_block(const int16_t *xq, const float *sx, const float *xsum, int64_t m, int mt, int64_t K,
                     const int8_t *q, const uint16_t *d, const uint16_t *mn, int64_t g, int64_t N, int64_t n,
                     int rows, const float *bias, float *out) {
    const int8_t *qr[RB];
    const uint16_t *dr[RB];
    for (int r = 0; r < RB; r++) {
        int64_t row = n + (r < rows ? r : 0);
        qr[r] = q + row * K;
        dr[r] = d + row * (K / g);
    }
    float res[2][RB];
#ifdef TKV_AVX2
    __m256 facc[2][RB];
    for (int i = 0; i < 2; i++) for (int r = 0; r < RB; r++) facc[i][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / g; b++) {
        for (int64_t s0 = b * g; s0 < (b + 1) * g; s0 += SPAN) {
            int64_t s1 = s0 + SPAN < (b + 1) * g ? s0 + SPAN : (b + 1) * g;
            __m256i acc[2][RB];
            for (int i = 0; i < 2; i++) for (int r = 0; r < RB; r++) acc[i][r] = _mm256_setzero_si256();
            for (int64_t k = s0; k < s1; k += 16) {
                __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + m * K + k));
                __m256i x1 = mt > 1 ? _mm256_loadu_si256((const __m256i *)(xq + (m + 1) * K + k)) : x0;
                for (int r = 0; r < RB; r++) {
                    __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qr[r] + k)));
                    acc[0][r] = _mm256_add_epi32(acc[0][r], _mm256_madd_epi16(w, x0));
                    if (mt > 1) acc[1][r] = _mm256_add_epi32(acc[1][r], _mm256_madd_epi16(w, x1));
                }
            }
            for (int r = 0; r < RB; r++) {
                __m256 s = _mm256_set1_ps(h2f(dr[r][b]));
                for (int i = 0; i < mt; i++)
                    facc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][r]), s, facc[i][r]);
            }
        }
    }
    for (int i = 0; i < mt; i++) for (int r = 0; r < RB; r++) res[i][r] = hsum(facc[i][r]);
#else
    for (int i = 0; i < mt; i++)
        for (int r = 0; r < RB; r++) res[i][r] = q8_row_c(qr[r], xq + (m + i) * K, dr[r], K, g);
#endif
    for (int i = 0; i < mt; i++)
        for (int r = 0; r < rows; r++)
            out[(m + i) * N + n + r] = row_out(res[i][r], sx[m + i], bias ? bias[n + r] : 0.f,
                                               mn ? offset_sum(mn + (n + r) * (K / g), xsum + (m + i) * (K / g), K / g)
                                                  : 0.f);
}

/* The codes, scales and offsets of weight rows n..n+RB-1 (a short block repeats row n past its `rows`) */
INLINE void q4_block_rows(const uint8_t *q, const uint16_t *d, const uint16_t *mn, int64_t K, int64_t G, int64_t n,
                          int rows, const uint8_t **qr, const uint16_t **dr, const uint16_t **mr) {
    for (int r = 0; r < RB; r++) {
        int64_t row = n + (r < rows ? r : 0);
        qr[r] = q + row * (K / 2);
        dr[r] = d + row * G;
        mr[r] = mn + row * G;
    }
}

#ifdef TKV_AVX2
/* 16 bytes of q4 codes as int16: their low nibbles (*wl) and high nibbles (*wh). The bytes are widened once;
 * each lane's low nibble is masked, and the byte shifted down is its high one (one widening where two took
 * 5% longer over the default model's layers, AMD EPYC Zen 5; the same codes) */
INLINE void q4_nibbles256(const uint8_t *p, __m256i *wl, __m256i *wh) {
    __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    *wl = _mm256_and_si256(w, _mm256_set1_epi16(15));
    *wh = _mm256_srli_epi16(w, 4);
}

/* Group b of a q4 row times the activations: the group's 8 lanes of int32 sums */
INLINE __m256i q4_group(const uint8_t *qr, const int16_t *xq, int64_t b, int64_t g) {
    const int64_t h = g / 2;
    __m256i acc = _mm256_setzero_si256();
    for (int64_t j = 0; j < h; j += 16) {  /* once for groups of 32 (the caller's constant g) */
        __m256i wl, wh;
        q4_nibbles256(qr + b * h + j, &wl, &wh);
        acc = _mm256_add_epi32(acc, _mm256_add_epi32(
            _mm256_madd_epi16(wl, _mm256_loadu_si256((const __m256i *)(xq + b * g + j))),
            _mm256_madd_epi16(wh, _mm256_loadu_si256((const __m256i *)(xq + b * g + h + j)))));
    }
    return acc;
}

/* A q4 row's G groups times one activation row, in the order of the multi-row blocks (q4_block, block32), so that
 * a row's product is the same bits alone or among others (a decode step alone or batched, a speculative step's
 * verification rows against plain decoding): each group's int32 sums scaled into one fp32 accumulator, group after
 * group (the scales converted eight at a time), its lanes summed at the end. Returns that sum. */
INLINE float q4_row(const uint8_t *qr, const int16_t *xq, const uint16_t *dr, int64_t G, int64_t g) {
    __m256 f = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= G; b += 8) {
        float ds[8];
        _mm256_storeu_ps(ds, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dr + b))));
        for (int i = 0; i < 8; i++)
            f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_group(qr, xq, b + i, g)), _mm256_broadcast_ss(ds + i), f);
    }
    for (; b < G; b++) f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_group(qr, xq, b, g)), _mm256_set1_ps(h2f(dr[b])), f);
    return hsum(f);
}
#endif

#ifdef TKV_AVX512
/* Groups of 32 two at a time on 512-bit registers: the 32 bytes of groups b and b+1 give their low nibbles
 * (inputs 0..15 of each) and high nibbles (16..31) as 32 int16 each; xp holds the activations in that order
 * (pair_order), so two multiply-adds leave group b's sums in int32 lanes 0-7 and group b+1's in 8-15, which
 * `scale` ([d_b x8, d_b+1 x8]) turns to fp32. Half the instructions of the 256-bit groups, which on a Zen 5
 * run below the memory's speed for weights in cache. */
/* 32 bytes of q4 codes as int16, as q4_nibbles256 does 16 */
INLINE void q4_nibbles512(const uint8_t *p, __m512i *wl, __m512i *wh) {
    __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    *wl = _mm512_and_si512(w, _mm512_set1_epi16(15));
    *wh = _mm512_srli_epi16(w, 4);
}

INLINE __m512 q4_pair(const uint8_t *qr, const int16_t *xp, int64_t b, __m512 scale, __m512 f) {
    __m512i wl, wh;
    q4_nibbles512(qr + b * 16, &wl, &wh);
    __m512i acc = DPWSSD(_mm512_setzero_si512(), wl, _mm512_loadu_si512(xp + b * 32));
    acc = DPWSSD(acc, wh, _mm512_loadu_si512(xp + b * 32 + 32));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), scale, f);
}

INLINE __m256 halves_sum(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* An output of the 512-bit q4 products (q4_block512, q4_row512): the chunks' sums `acc` and the later groups' `f`
 * summed, times the activation row's scale, plus the offsets' parts and the bias, in explicit operations (the
 * compiler's contraction of `a * b + c` may differ between inlined copies) */
INLINE float q4_out512(__m512 acc, __m256 f, __m256 zacc, float ztail, float sx, float bias) {
    return fmaf(hsum(_mm256_add_ps(halves_sum(acc), f)), sx, hsum(zacc)) + ztail + bias;
}

/* The int16 activations of groups of 32, each pair of groups as q4_pair reads them: the pair's inputs 0..15
 * of both groups, then 16..31 of both */
static void pair_order(const int16_t *xq, int64_t groups, int16_t *xp) {
    for (int64_t b = 0; b + 2 <= groups; b += 2)
        for (int half = 0; half < 2; half++)
            for (int gi = 0; gi < 2; gi++)
                memcpy(xp + b * 32 + half * 32 + gi * 16, xq + (b + gi) * 32 + half * 16, 16 * sizeof(int16_t));
}

/* Weight rows n..n+RB-1 times activation rows m..m+mt-1 (mt <= 2), groups of 32, on 512-bit registers: the
 * one-row product's pairs of groups (q4_pair) for each weight row and activation row, the scales and offsets
 * of eight groups converted at once; groups past the last whole eight as q4_block does them. xp holds each
 * activation row's int16 codes in pair order (pair_order). q4_pair's steps written out: each weight row's
 * codes are unpacked once for both activation rows. */
INLINE void q4_block512(const int16_t *xq, const int16_t *xp, const float *sx, const float *xsum, int64_t m, int mt,
                        int64_t K, const uint8_t *q, const uint16_t *d, const uint16_t *mn, int64_t N, int64_t n,
                        int rows, const float *bias, float *out) {
    const int64_t G = K / 32, G8 = G / 8 * 8;
    const __m512i two = _mm512_set1_epi32(2);
    const uint8_t *qr[RB];
    const uint16_t *dr[RB], *mr[RB];
    q4_block_rows(q, d, mn, K, G, n, rows, qr, dr, mr);
    __m512 acc[2][RB];
    __m256 f[2][RB], zacc[2][RB];
    for (int i = 0; i < 2; i++)
        for (int r = 0; r < RB; r++) {
            acc[i][r] = _mm512_setzero_ps();
            f[i][r] = zacc[i][r] = _mm256_setzero_ps();
        }
    for (int64_t b = 0; b < G8; b += 8) {
        __m512 ds[RB];
        for (int r = 0; r < RB; r++) {
            ds[r] = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dr[r] + b))));
            __m256 ms = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mr[r] + b)));
            for (int i = 0; i < mt; i++)
                zacc[i][r] = _mm256_fmadd_ps(ms, _mm256_loadu_ps(xsum + (m + i) * G + b), zacc[i][r]);
        }
        __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        for (int64_t bb = b; bb < b + 8; bb += 2, idx = _mm512_add_epi32(idx, two)) {
            for (int r = 0; r < RB; r++) {
                __m512i wl, wh;
                q4_nibbles512(qr[r] + bb * 16, &wl, &wh);
                __m512 scale = _mm512_permutexvar_ps(idx, ds[r]);
                for (int i = 0; i < mt; i++) {
                    const int16_t *xa = xp + (m + i) * K + bb * 32;
                    __m512i a = DPWSSD(_mm512_setzero_si512(), wl, _mm512_loadu_si512(xa));
                    a = DPWSSD(a, wh, _mm512_loadu_si512(xa + 32));
                    acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), scale, acc[i][r]);
                }
            }
        }
    }
    float ztail[2][RB] = {{0.f}};
    for (int64_t b = G8; b < G; b++)
        for (int r = 0; r < RB; r++) {
            __m256 s = _mm256_set1_ps(h2f(dr[r][b]));
            for (int i = 0; i < mt; i++) {
                f[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_group(qr[r], xq + (m + i) * K, b, 32)), s, f[i][r]);
                ztail[i][r] = fmaf(h2f(mr[r][b]), xsum[(m + i) * G + b], ztail[i][r]);
            }
        }
    for (int i = 0; i < mt; i++)
        for (int r = 0; r < rows; r++)
            out[(m + i) * N + n + r] = q4_out512(acc[i][r], f[i][r], zacc[i][r], ztail[i][r], sx[m + i],
                                                 bias ? bias[n + r] : 0.f);
}
#endif

INLINE void q4_block(const int16_t *xq, const float *sx, const float *xsum, int64_t m, int mt, int64_t K,
                     const uint8_t *q, const uint16_t *d, const uint16_t *mn, int64_t g, int64_t N, int64_t n,
                     int rows, const float *bias, float *out) {
    const int64_t G = K / g;
    const uint8_t *qr[RB];
    const uint16_t *dr[RB], *mr[RB];
    q4_block_rows(q, d, mn, K, G, n, rows, qr, dr, mr);
    float res[2][RB], zsum[2][RB];
    for (int i = 0; i < 2; i++) for (int r = 0; r < RB; r++) zsum[i][r] = 0.f;
#ifdef TKV_AVX2
    const int64_t h = g / 2;
    __m256 facc[2][RB];
    for (int i = 0; i < 2; i++) for (int r = 0; r < RB; r++) facc[i][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < G; b++) {
        __m256i acc[2][RB];
        for (int i = 0; i < 2; i++) for (int r = 0; r < RB; r++) acc[i][r] = _mm256_setzero_si256();
        for (int64_t j = 0; j < h; j += 16) {
            const int16_t *xa = xq + m * K + b * g + j;
            __m256i xl0 = _mm256_loadu_si256((const __m256i *)xa);
            __m256i xh0 = _mm256_loadu_si256((const __m256i *)(xa + h));
            __m256i xl1 = xl0, xh1 = xh0;
            if (mt > 1) {
                xl1 = _mm256_loadu_si256((const __m256i *)(xa + K));
                xh1 = _mm256_loadu_si256((const __m256i *)(xa + K + h));
            }
            for (int r = 0; r < RB; r++) {
                __m256i wl, wh;
                q4_nibbles256(qr[r] + b * h + j, &wl, &wh);
                acc[0][r] = _mm256_add_epi32(acc[0][r],
                                             _mm256_add_epi32(_mm256_madd_epi16(wl, xl0), _mm256_madd_epi16(wh, xh0)));
                if (mt > 1)
                    acc[1][r] = _mm256_add_epi32(
                        acc[1][r], _mm256_add_epi32(_mm256_madd_epi16(wl, xl1), _mm256_madd_epi16(wh, xh1)));
            }
        }
        for (int r = 0; r < RB; r++) {
            __m256 s = _mm256_set1_ps(h2f(dr[r][b]));
            for (int i = 0; i < mt; i++) facc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][r]), s, facc[i][r]);
        }
    }
    for (int i = 0; i < mt; i++)
        for (int r = 0; r < RB; r++) {
            res[i][r] = hsum(facc[i][r]);
            zsum[i][r] = offset_sum(mr[r], xsum + (m + i) * G, G);
        }
#else
    for (int i = 0; i < mt; i++)
        for (int r = 0; r < RB; r++)
            res[i][r] = q4_row_c(qr[r], xq + (m + i) * K, dr[r], mr[r], xsum + (m + i) * G, K, g, &zsum[i][r]);
#endif
    for (int i = 0; i < mt; i++)
        for (int r = 0; r < rows; r++)
            out[(m + i) * N + n + r] = row_out(res[i][r], sx[m + i], bias ? bias[n + r] : 0.f, zsum[i][r]);
}

#ifdef TKV_AVX2
/* Group b (of 32 inputs) of a q4 (bits 4) or q8 row as int16: inputs 0..15 (*w0) and 16..31 (*w1) */
INLINE void codes32(const int bits, const uint8_t *row, int64_t b, __m256i *w0, __m256i *w1) {
    if (bits == 4) {
        q4_nibbles256(row + b * 16, w0, w1);
    } else {
        *w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + b * 32)));
        *w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + b * 32 + 16)));
    }
}

/* q4_block and q8_block for groups of 32 (bits 4 or 8, a constant where inlined): each group's int32 sums scaled
 * as soon as they are made, each weight row's scales converted eight groups at a time, and the offsets' part
 * summed after, eight groups at a time (offset_sum), where q4_block converts each scale and offset on its own and
 * keeps every accumulator live across the group loop. q8's sums are q8_block's, in its order. */
INLINE void block32(const int bits, const int16_t *xq, const float *sx, const float *xsum, int64_t m, int mt,
                    int64_t K, const uint8_t *q, const uint16_t *d, const uint16_t *mn, int64_t N, int64_t n,
                    int rows, const float *bias, float *out) {
    const int64_t G = K / 32, row_bytes = bits == 4 ? K / 2 : K;
    const uint8_t *qr[RB];
    const uint16_t *dr[RB];
    for (int r = 0; r < RB; r++) {
        const int64_t row = n + (r < rows ? r : 0);
        qr[r] = q + row * row_bytes;
        dr[r] = d + row * G;
    }
    __m256 facc[2][RB];
    for (int i = 0; i < 2; i++) for (int r = 0; r < RB; r++) facc[i][r] = _mm256_setzero_ps();
    float ds[RB][8];
    for (int64_t b = 0; b < G; b++) {
        if (b % 8 == 0)
            for (int r = 0; r < RB; r++) {
                if (b + 8 <= G)
                    _mm256_storeu_ps(ds[r], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dr[r] + b))));
                else
                    for (int64_t j = 0; j < G - b; j++) ds[r][j] = h2f(dr[r][b + j]);
            }
        const int16_t *xa = xq + m * K + b * 32;
        const __m256i x00 = _mm256_loadu_si256((const __m256i *)xa);
        const __m256i x01 = _mm256_loadu_si256((const __m256i *)(xa + 16));
        __m256i x10 = x00, x11 = x01;
        if (mt > 1) {
            x10 = _mm256_loadu_si256((const __m256i *)(xa + K));
            x11 = _mm256_loadu_si256((const __m256i *)(xa + K + 16));
        }
        for (int r = 0; r < RB; r++) {
            __m256i w0, w1;
            codes32(bits, qr[r], b, &w0, &w1);
            const __m256 s = _mm256_broadcast_ss(&ds[r][b % 8]);
            facc[0][r] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(w0, x00), _mm256_madd_epi16(w1, x01))), s,
                facc[0][r]);
            if (mt > 1)
                facc[1][r] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(w0, x10), _mm256_madd_epi16(w1, x11))), s,
                    facc[1][r]);
        }
    }
    for (int i = 0; i < mt; i++)
        for (int r = 0; r < rows; r++)
            out[(m + i) * N + n + r] = row_out(hsum(facc[i][r]), sx[m + i], bias ? bias[n + r] : 0.f,
                                               mn ? offset_sum(mn + (n + r) * G, xsum + (m + i) * G, G) : 0.f);
}
#endif

/* q4_block, or for groups of 32 with AVX2, block32: on an AMD EPYC (Zen 3, 2 threads) the default model's Q4_1
 * layers take 0.73-0.80x q4_block's time for 2 to 6 activation rows (the two builds alternated in one process),
 * batched decode of 2 and 4 streams 1.14x and 1.16x the output rate, speculative decoding on the file 1.11-1.13x */
INLINE void q4_rows_block(const int16_t *xq, const float *sx, const float *xsum, int64_t m, int mt, int64_t K,
                          const uint8_t *q, const uint16_t *d, const uint16_t *mn, int64_t g, int64_t N, int64_t n,
                          int rows, const float *bias, float *out) {
#ifdef TKV_AVX2
    if (g == 32) {
        block32(4, xq, sx, xsum, m, mt, K, q, d, mn, N, n, rows, bias, out);
        return;
    }
#endif
    q4_block(xq, sx, xsum, m, mt, K, q, d, mn, g, N, n, rows, bias, out);
}

/* q8_block, or for groups of 32 with AVX2, block32: the same sums in the same order (the outputs are equal), the
 * default model's Q8_0 LM head 0.74-0.86x the time for 2-6 activation rows (AMD EPYC Zen 3, 2 threads, the two
 * builds alternated in one process) */
INLINE void q8_rows_block(const int16_t *xq, const float *sx, const float *xsum, int64_t m, int mt, int64_t K,
                          const int8_t *q, const uint16_t *d, const uint16_t *mn, int64_t g, int64_t N, int64_t n,
                          int rows, const float *bias, float *out) {
#ifdef TKV_AVX2
    if (g == 32) {
        block32(8, xq, sx, xsum, m, mt, K, (const uint8_t *)q, d, mn, N, n, rows, bias, out);
        return;
    }
#endif
    q8_block(xq, sx, xsum, m, mt, K, q, d, mn, g, N, n, rows, bias, out);
}

/* Returns 0, or -1 when scratch memory could not be had. */
int tkv_q8_linear(const float *x, int64_t M, int64_t K, const int8_t *q, const uint16_t *d, const uint16_t *mn,
                  int64_t g, int64_t N, const float *bias, float *out) {
    const size_t a = lines((size_t)(M * K) * sizeof(int16_t)), b = lines((size_t)M * sizeof(float));
    char *mem = tkv_scratch(a + b + (size_t)(M * (K / g)) * sizeof(float));
    if (!mem) return -1;
    int16_t *xq = (int16_t *)mem;
    float *sx = (float *)(mem + a), *xsum = mn ? (float *)(mem + a + b) : NULL;
    quantize_rows(x, M, K, g, xq, sx, xsum);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n += RB) {
        int rows = N - n < RB ? (int)(N - n) : RB;
        block_ahead(q, K, n, N);
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) q8_rows_block(xq, sx, xsum, m, 2, K, q, d, mn, g, N, n, rows, bias, out);
        if (m < M) q8_rows_block(xq, sx, xsum, m, 1, K, q, d, mn, g, N, n, rows, bias, out);
    }
    return 0;
}

/* The most activation rows for which tkv_q4_linear beats dequantizing into fp32 and oneDNN's GEMM, in a mixed
 * workload of 32 requests (bench_decode.py): 16 with the 256-bit blocks (an AVX2 EPYC), 32 with the 512-bit
 * ones (a Zen 5: 0.954x of fp32's throughput at 32, 0.900x at 16, 0.945x at 64). quant.py reads it. */
int tkv_q4_max_rows(void) {
#ifdef TKV_AVX512
    return 32;
#else
    return 16;
#endif
}

int tkv_q4_linear(const float *x, int64_t M, int64_t K, const uint8_t *q, const uint16_t *d, const uint16_t *mn,
                  int64_t g, int64_t N, const float *bias, float *out) {
    const size_t a = lines((size_t)(M * K) * 2 * sizeof(int16_t)), b = lines((size_t)M * sizeof(float));
    char *mem = tkv_scratch(a + b + (size_t)(M * (K / g)) * sizeof(float));
    if (!mem) return -1;
    int16_t *xq = (int16_t *)mem;
    float *sx = (float *)(mem + a), *xsum = (float *)(mem + a + b);
    quantize_rows(x, M, K, g, xq, sx, xsum);
#ifdef TKV_AVX512
    int16_t *xp = xq + M * K;
    const int wide = g == 32 && K >= 256;  /* at least one chunk of eight groups */
    if (wide)
        for (int64_t m = 0; m < M; m++) pair_order(xq + m * K, K / 32 / 8 * 8, xp + m * K);
#endif
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n += RB) {
        int rows = N - n < RB ? (int)(N - n) : RB;
        block_ahead(q, K / 2, n, N);
        int64_t m = 0;
#ifdef TKV_AVX512
        if (wide) {
            for (; m + 2 <= M; m += 2) q4_block512(xq, xp, sx, xsum, m, 2, K, q, d, mn, N, n, rows, bias, out);
            if (m < M) q4_block512(xq, xp, sx, xsum, m, 1, K, q, d, mn, N, n, rows, bias, out);
            continue;
        }
#endif
        for (; m + 2 <= M; m += 2) q4_rows_block(xq, sx, xsum, m, 2, K, q, d, mn, g, N, n, rows, bias, out);
        if (m < M) q4_rows_block(xq, sx, xsum, m, 1, K, q, d, mn, g, N, n, rows, bias, out);
    }
    return 0;
}

/* The row the i-th step of a one-row product's loop takes: rows of the first half and the second half in turn,
 * so that each thread's static share reads two streams from memory, half the weight apart. One stream alone
 * left the loads waiting (as the tiles' and the bf16 blocks' kernels found too): on an Intel Xeon (KVM guest,
 * 2 threads) the default model's 120 layers back to back 0.92x the time in int4, 0.77x in int8; batch-1
 * decode (the builds bound in turn, 9 rounds) int8 0.91x, the Q4_1 file 0.95x. */
INLINE int64_t two_streams(int64_t i, int64_t N) {
    return i % 2 == 0 ? i / 2 : (N + 1) / 2 + i / 2;
}

/* One activation row (a batch-1 decode step): each thread reads its weight rows whole, one after another (in
 * two streams: two_streams), which the hardware prefetcher follows, where the blocks above interleave four rows
 * to share activation loads. At batch 1 the weights come from memory or a far cache level (a model's layers
 * do not stay in L2 between tokens), and whole rows in order win. Measured on an AMD EPYC (Zen 1, AVX2, 2 threads) over 30 distinct
 * layers of the default model's shapes: int8 per-row 12.2 -> 7.7 ms, Q8_0 groups 13.9 -> 8.7, int4 groups of
 * 32 12.9 -> 9.1 (with the groups taken eight at a time, below); its 49152 x 576 int8 LM head 3.0 -> 1.55 ms.
 * Returns 0, or -1 without scratch memory. */
#ifdef TKV_AVX2
/* Inputs [s0, s1) of a q8 row times the activations: 8 lanes of int32 sums */
INLINE __m256i q8_span(const int8_t *qr, const int16_t *xq, int64_t s0, int64_t s1) {
    __m256i acc = _mm256_setzero_si256();
    for (int64_t k = s0; k < s1; k += 16) {
        __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qr + k)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(w, _mm256_loadu_si256((const __m256i *)(xq + k))));
    }
    return acc;
}

/* Group b of a q8 row (g <= SPAN inputs, scale ds) multiplied into the row's fp32 accumulator f */
INLINE __m256 q8_group(const int8_t *qr, const int16_t *xq, int64_t b, int64_t g, const float *ds, __m256 f) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8_span(qr, xq, b * g, (b + 1) * g)), _mm256_broadcast_ss(ds), f);
}

/* Groups [b0, G) of a q8 row in pieces of at most SPAN inputs (the groups past the chunks of eight, and groups longer
 * than SPAN: one scale per row) multiplied into f */
INLINE __m256 q8_rest(const int8_t *qr, const int16_t *xq, const uint16_t *dr, int64_t b0, int64_t G, int64_t g,
                      __m256 f) {
    for (int64_t b = b0; b < G; b++)
        for (int64_t s0 = b * g; s0 < (b + 1) * g; s0 += SPAN)
            f = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(q8_span(qr, xq, s0, s0 + SPAN < (b + 1) * g ? s0 + SPAN : (b + 1) * g)),
                _mm256_set1_ps(h2f(dr[b])), f);
    return f;
}

/* A q8 row's G groups times one activation row, in q8_block's order (see q4_row): each group's int32 sums, in
 * pieces of at most SPAN inputs, scaled into one fp32 accumulator (the scales of groups of g <= SPAN converted eight
 * at a time), its lanes summed at the end. Returns that sum. */
INLINE float q8_row(const int8_t *qr, const int16_t *xq, const uint16_t *dr, int64_t G, int64_t g) {
    __m256 f = _mm256_setzero_ps();
    int64_t b = 0;
    if (g <= SPAN)
        for (; b + 8 <= G; b += 8) {
            float ds[8];
            _mm256_storeu_ps(ds, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dr + b))));
            for (int i = 0; i < 8; i++) f = q8_group(qr, xq, b + i, g, ds + i, f);
        }
    return hsum(q8_rest(qr, xq, dr, b, G, g, f));
}

/* q8_row for two rows at once, each in its own order: one row's groups are a chain of dependent multiply-adds,
 * whose latency kept the default model's Q8_0 LM head waiting (one row at a time 1.4x the time of two on an AMD
 * EPYC Zen 4; an earlier order with two accumulators a row ran as fast, but the blocks of several rows did not
 * share it) */
INLINE void q8_row2(const int8_t *qa, const int8_t *qb, const int16_t *xq, const uint16_t *da, const uint16_t *db,
                    int64_t G, int64_t g, float *ta, float *tb) {
    __m256 fa = _mm256_setzero_ps(), fb = _mm256_setzero_ps();
    int64_t b = 0;
    if (g <= SPAN)
        for (; b + 8 <= G; b += 8) {
            float sa[8], sb[8];
            _mm256_storeu_ps(sa, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(da + b))));
            _mm256_storeu_ps(sb, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(db + b))));
            for (int i = 0; i < 8; i++) {
                fa = q8_group(qa, xq, b + i, g, sa + i, fa);
                fb = q8_group(qb, xq, b + i, g, sb + i, fb);
            }
        }
    *ta = hsum(q8_rest(qa, xq, da, b, G, g, fa));
    *tb = hsum(q8_rest(qb, xq, db, b, G, g, fb));
}
#endif

/* The prepared activations of a q4 or q8 one-row product (tkv_row_prepare): int16 codes [K], for q4 also in
 * pair order [K] (pair_order), the row's scale, each group's sum of x */
typedef struct { int16_t *xq, *xp; float *sx, *xsum; } int16_row;

static size_t int16_row_bytes(int64_t K, int64_t G) {
    return 2 * lines((size_t)K * sizeof(int16_t)) + 64 + (size_t)G * sizeof(float);
}

static int16_row int16_row_at(const char *mem, int64_t K) {
    const size_t a = lines((size_t)K * sizeof(int16_t));
    int16_row r = {(int16_t *)mem, (int16_t *)(mem + a), (float *)(mem + 2 * a), (float *)(mem + 2 * a + 64)};
    return r;
}


static void q8_share(const tkv_qw *w, const char *mem, float *out) {
    const int64_t K = w->K, g = w->g, N = w->N, G = K / g;
    const int8_t *q = (const int8_t *)w->q;
    const uint16_t *d = w->d, *mn = w->mn;
    const float *bias = w->bias;
    const int16_row a = int16_row_at(mem, K);
    const int16_t *xq = a.xq;
    const float sx = *a.sx;
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < N; i += 2) {  /* rows i and i + 1 of two_streams' order: one of each stream */
        const int R = i + 1 < N ? 2 : 1;
        int64_t n[2];
        const int8_t *qr[2];
        const uint16_t *dr[2];
        float total[2];
        for (int r = 0; r < R; r++) {
            n[r] = two_streams(i + r, N);
            qr[r] = q + n[r] * K;
            dr[r] = d + n[r] * G;
            if (n[r] + AHEAD_ROWS < N) ahead(qr[r] + AHEAD_ROWS * K, K);
        }
#ifdef TKV_AVX2
        if (R == 2) {
            if (g == 32)  /* GGUF's Q8_0 and Q5_0, and Q6_K's 16: inlined with constants */
                q8_row2(qr[0], qr[1], xq, dr[0], dr[1], G, 32, total, total + 1);
            else if (g == 16)
                q8_row2(qr[0], qr[1], xq, dr[0], dr[1], G, 16, total, total + 1);
            else
                q8_row2(qr[0], qr[1], xq, dr[0], dr[1], G, g, total, total + 1);
        } else {
            total[0] = q8_row(qr[0], xq, dr[0], G, g);
        }
#else
        for (int r = 0; r < R; r++) total[r] = q8_row_c(qr[r], xq, dr[r], K, g);
#endif
        for (int r = 0; r < R; r++)
            out[n[r]] = row_out(total[r], sx, bias ? bias[n[r]] : 0.f,
                                mn ? offset_sum(mn + n[r] * G, a.xsum, G) : 0.f);
    }
}

#ifdef TKV_AVX512
/* q4_share's row for groups of 32 on 512-bit registers (K >= 256: q4_wide), the operations q4_block512 does for
 * each of its rows, in its order (one 512-bit accumulator over the pairs of each chunk of eight groups, the groups
 * past the chunks on 256-bit registers, q4_out512), so that a row's product is the same bits alone or among
 * others; the output with its scale `sx` and bias. */
INLINE float q4_row512(const uint8_t *qr, const int16_t *xq, const int16_t *xp, const float *xsum,
                       const uint16_t *dr, const uint16_t *mr, int64_t G, float sx, float bias) {
    const int64_t G8 = G / 8 * 8;
    const __m512i two = _mm512_set1_epi32(2);
    __m512 acc = _mm512_setzero_ps();
    __m256 f = _mm256_setzero_ps(), zacc = _mm256_setzero_ps();
    for (int64_t b = 0; b < G8; b += 8) {
        const __m512 ds = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dr + b))));
        zacc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mr + b))), _mm256_loadu_ps(xsum + b),
                               zacc);
        __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        for (int64_t bb = b; bb < b + 8; bb += 2, idx = _mm512_add_epi32(idx, two))
            acc = q4_pair(qr, xp, bb, _mm512_permutexvar_ps(idx, ds), acc);
    }
    float ztail = 0.f;
    for (int64_t b = G8; b < G; b++) {
        f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_group(qr, xq, b, 32)), _mm256_set1_ps(h2f(dr[b])), f);
        ztail = fmaf(h2f(mr[b]), xsum[b], ztail);
    }
    return q4_out512(acc, f, zacc, ztail, sx, bias);
}
#endif

static void q4_share(const tkv_qw *w, const char *mem, float *out) {
    const int64_t K = w->K, g = w->g, N = w->N, G = K / g;
    const uint8_t *q = (const uint8_t *)w->q;
    const uint16_t *d = w->d, *mn = w->mn;
    const float *bias = w->bias;
    const int16_row a = int16_row_at(mem, K);
    const int16_t *xq = a.xq;
    const float sx = *a.sx, *xsum = a.xsum;
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < N; i++) {
        const int64_t n = two_streams(i, N);
        const uint8_t *qr = q + n * (K / 2);
        const uint16_t *dr = d + n * G, *mr = mn + n * G;
        const float b = bias ? bias[n] : 0.f;
        if (n + AHEAD_ROWS < N) ahead(qr + AHEAD_ROWS * (K / 2), K / 2);
#ifdef TKV_AVX512
        if (g == 32 && K >= 256) {  /* q4_wide: as the blocks of several rows take it */
            out[n] = q4_row512(qr, xq, a.xp, xsum, dr, mr, G, sx, b);
            continue;
        }
#endif
#ifdef TKV_AVX2
        const float total = g == 32 ? q4_row(qr, xq, dr, G, 32) : q4_row(qr, xq, dr, G, g);
        out[n] = row_out(total, sx, b, offset_sum(mr, xsum, G));
#else
        float z;
        const float total = q4_row_c(qr, xq, dr, mr, xsum, K, g, &z);
        out[n] = row_out(total, sx, b, z);
#endif
    }
}

/* Rows ids[0..count) of the weight (ids NULL: rows 0..count) dequantized to fp32 [count, K]. */
void tkv_q8_rows(const int8_t *q, const uint16_t *d, const uint16_t *mn, int64_t g, int64_t K, const int64_t *ids,
                 int64_t count, float *out) {
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; i++) {
        int64_t row = ids ? ids[i] : i;
        for (int64_t b = 0; b < K / g; b++) {
            float s = h2f(d[row * (K / g) + b]), z = mn ? h2f(mn[row * (K / g) + b]) : 0.f;
            for (int64_t j = 0; j < g; j++) out[i * K + b * g + j] = (float)q[row * K + b * g + j] * s + z;
        }
    }
}

void tkv_q4_rows(const uint8_t *q, const uint16_t *d, const uint16_t *mn, int64_t g, int64_t K, const int64_t *ids,
                 int64_t count, float *out) {
    const int64_t h = g / 2;
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; i++) {
        int64_t row = ids ? ids[i] : i;
        for (int64_t b = 0; b < K / g; b++) {
            float s = h2f(d[row * (K / g) + b]), z = h2f(mn[row * (K / g) + b]);
            const uint8_t *qb = q + row * (K / 2) + b * h;
            float *o = out + i * K + b * g;
            int64_t j = 0;
#ifdef TKV_AVX2
            /* 16 codes' low and high nibbles at a time (the scalar loop below left 4x slower than q8's) */
            const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
            const __m128i low = _mm_set1_epi8(15);
            for (; j + 16 <= h; j += 16) {
                __m128i v = _mm_loadu_si128((const __m128i *)(qb + j));
                __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
                _mm256_storeu_ps(o + j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), vs, vz));
                _mm256_storeu_ps(o + j + 8, _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), vs, vz));
                _mm256_storeu_ps(o + h + j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), vs, vz));
                _mm256_storeu_ps(o + h + j + 8, _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), vs, vz));
            }
#endif
            for (; j < h; j++) {
                o[j] = (float)(qb[j] & 15) * s + z;
                o[j + h] = (float)(qb[j] >> 4) * s + z;
            }
        }
    }
}

/* ---- q4 and q8 in tiles of 16 output rows ("q4t", "q8t": kernels/quant.py tiles the weights into them with
 * EngineConfig.int8_activations where the build has AVX-512 VNNI) ----------------------------------------------
 * The same weights as q4 (w = q d + m, q in 0..15) and q8 (w = q d [+ m], q a signed byte), a scale (and an
 * offset) per group of g inputs, g a multiple of 32, laid out so that one 64-byte load holds the codes of 16
 * output rows, and one vpdpbusd multiplies 4 inputs of all 16 rows, their sums side by side in one register (no
 * sum across a register's lanes):
 *   q4t codes [T][K/8][64]: tile t holds rows 16t..16t+15; in chunk c, byte 4r + j holds row r's input 8c + j in
 *     its low nibble and input 8c + 4 + j in its high one (j = 0..3);
 *   q8t codes [T][K/4][64]: in chunk c, byte 4r + j holds row r's code of input 4c + j plus 128 (vpdpbusd takes
 *     unsigned bytes on one side: sum (q + 128) x = sum q x + 128 sum x, the second term taken off per block);
 *   scales, offsets [T][K/g][16] fp16: each group's for the tile's 16 rows.
 * The activations are quantized to int8 per block of 32 inputs (scale max|x| / 127 of the block), as GGUF's
 * Q8_0 / Q8_1 blocks that llama.cpp multiplies its quantized blocks with; the offsets multiply each block's sum
 * as rounded (q8_blocks). Every block's int32 sums are scaled in fp32, block after block, then the offsets'
 * part added: the plain C below does the same operations in the same order, so every build gives the same bits.
 * Measured on an Intel Xeon (KVM guest, 2 threads), the default model's 120 int4 layers from its large L3:
 * 0.76-0.82x the time of the row-major one-row kernel (tkv_q4_gemv), 0.66-0.75x for 2 to 32 rows; the one-row
 * kernel reads two tiles at once, half the thread's share apart, each asked for TILE_AHEAD bytes ahead (one
 * stream alone: 1.0-1.3x). */
#define TILE_ROWS 16
#define TILE_AHEAD 2560

/* x's blocks of 32 as int8 codes, their scales, their codes' sums and those sums scaled: the block's sum as
 * rounded, which the offsets multiply, so that the rounding's error meets the weights w = q d + m themselves
 * (as in llama.cpp's Q8_1 products) rather than q d alone, up to twice as large. Measured through the decode
 * kernels on the default model's Q4_1 file: perplexity +0.47% from fp32 (KL 0.0030) where the fp32 sums gave
 * +1.41% (KL 0.0134); int4 +0.90% against +1.85%. */
static void q8_blocks(const float *x, int64_t K, int8_t *xq, float *sx, float *xs, int32_t *qs) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = x + b * 32;
        int8_t *qb = xq + b * 32;
#ifdef TKV_AVX512  /* the same operations on two registers (the max, and x * 0's sum for the finite test, exact) */
        const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16), zero = _mm512_setzero_ps();
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const int finite = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_mul_ps(v0, zero), _mm512_mul_ps(v1, zero))) == 0.f;
#elif defined(TKV_AVX2)  /* the same on four registers */
        __m256 v[4], vmax = _mm256_setzero_ps(), probe = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xb + 8 * j);
            vmax = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), v[j]), vmax);
            probe = _mm256_add_ps(probe, _mm256_mul_ps(v[j], _mm256_setzero_ps()));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        const int finite = hsum(probe) == 0.f;
#else
        float amax = 0.f;
        int finite = 1;
        for (int j = 0; j < 32; j++) {
            amax = fmaxf(amax, fabsf(xb[j]));
            finite &= isfinite(xb[j]) != 0;
        }
#endif
        /* a NaN or infinity makes the block's scale NaN (codes 0), so every output it reaches is NaN, as the
         * float product's would be: the sampler's test for bad rows sees it */
        const float s = !finite ? NAN : amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / s;
        int32_t codes = 0;
        if (!finite) {
            memset(qb, 0, 32);
        } else {
#ifdef TKV_AVX512  /* rounded to nearest even, as lrintf */
            const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
            const __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
            _mm_storeu_si128((__m128i *)qb, _mm512_cvtsepi32_epi8(c0));
            _mm_storeu_si128((__m128i *)(qb + 16), _mm512_cvtsepi32_epi8(c1));
            codes = _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
#elif defined(TKV_AVX2)
            __m256i c[4];
            for (int j = 0; j < 4; j++) c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));
            const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
            _mm256_storeu_si256((__m256i *)qb,  /* the packs interleave the halves: put the codes back in order */
                                _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
            const __m256i total = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
            codes = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1)));
#else
            for (int j = 0; j < 32; j++) {
                qb[j] = (int8_t)lrintf(xb[j] * inv);
                codes += qb[j];
            }
#endif
        }
        sx[b] = s;
        xs[b] = s * (float)codes;
        qs[b] = codes;
    }
}

/* Bytes of codes a block of 32 inputs takes in a tile (4 chunks of 8 inputs, or 8 of 4) */
#define TILE_BLOCK(bits) ((bits) == 4 ? 256 : 512)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TILE_VNNI 1
/* Block b (32 inputs) of one tile (codes tc) times one activation row: the 16 rows' int32 sums */
INLINE __m512i tile_block(const int bits, const uint8_t *tc, const int8_t *xq, const int32_t *qs, int64_t b) {
    const int32_t *xa = (const int32_t *)(xq + b * 32);
    const uint8_t *bc = tc + b * TILE_BLOCK(bits);
    __m512i acc = _mm512_setzero_si512();
    if (bits == 4) {
        const __m512i low = _mm512_set1_epi8(15);
        for (int c = 0; c < 4; c++) {
            __m512i v = _mm512_loadu_si512(bc + c * 64);
            acc = _mm512_dpbusd_epi32(acc, _mm512_and_si512(v, low), _mm512_set1_epi32(xa[2 * c]));
            acc = _mm512_dpbusd_epi32(acc, _mm512_and_si512(_mm512_srli_epi16(v, 4), low),
                                      _mm512_set1_epi32(xa[2 * c + 1]));
        }
        return acc;
    }
    for (int c = 0; c < 8; c++) acc = _mm512_dpbusd_epi32(acc, _mm512_loadu_si512(bc + c * 64), _mm512_set1_epi32(xa[c]));
    return _mm512_sub_epi32(acc, _mm512_set1_epi32(128 * qs[b]));
}
#else
/* The same sums in plain C */
static void tile_block_c(const int bits, const uint8_t *tc, const int8_t *xq, const int32_t *qs, int64_t b,
                         int32_t *acc) {
    const uint8_t *bc = tc + b * TILE_BLOCK(bits);
    const int8_t *xb = xq + b * 32;
    for (int r = 0; r < TILE_ROWS; r++) {
        int32_t sum = 0;
        for (int j = 0; j < 32; j++) {
            const uint8_t v = bc[(bits == 4 ? j / 8 : j / 4) * 64 + 4 * r + j % 4];  /* chunk, row r's byte */
            sum += (bits == 4 ? (j % 8 < 4 ? v & 15 : v >> 4) : v) * xb[j];
        }
        acc[r] = bits == 4 ? sum : sum - 128 * qs[b];
    }
}
#endif

/* One tile's 16 outputs for one activation row (xq, sx, xs, qs: q8_blocks's), with the tile's codes, scales
 * and offsets (NULL: none) at tc, td, tm; gb: blocks of 32 per group */
INLINE void tile_outputs(const int bits, const uint8_t *tc, const uint16_t *td, const uint16_t *tm, int64_t K,
                         int64_t gb, const int8_t *xq, const float *sx, const float *xs, const int32_t *qs,
                         float *out) {
#ifdef TILE_VNNI
    __m512 acc = _mm512_setzero_ps(), z = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / 32; b++) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(td + b / gb * 16)));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tile_block(bits, tc, xq, qs, b)),
                              _mm512_mul_ps(d, _mm512_set1_ps(sx[b])), acc);
        if (tm)
            z = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tm + b / gb * 16))),
                                _mm512_set1_ps(xs[b]), z);
    }
    _mm512_storeu_ps(out, _mm512_add_ps(acc, z));
#else
    float acc[TILE_ROWS] = {0.f}, z[TILE_ROWS] = {0.f};
    int32_t sums[TILE_ROWS];
    for (int64_t b = 0; b < K / 32; b++) {
        tile_block_c(bits, tc, xq, qs, b, sums);
        for (int r = 0; r < TILE_ROWS; r++) {
            acc[r] = fmaf((float)sums[r], h2f(td[b / gb * 16 + r]) * sx[b], acc[r]);
            if (tm) z[r] = fmaf(h2f(tm[b / gb * 16 + r]), xs[b], z[r]);
        }
    }
    for (int r = 0; r < TILE_ROWS; r++) out[r] = acc[r] + z[r];
#endif
}

/* Tile t's 16 outputs for up to TILE_GROUP activation rows i0.. at once (a batched or speculative step's rows),
 * into o [R][16]: for each row the operations of tile_outputs in its order, so that a row's outputs are the same
 * bits alone or among others, but each block's codes loaded (and for q4 split into nibbles) once for the R rows,
 * and each row's integer sums in two chains of vpdpbusd instead of one (integer sums are exact in any order).
 * Measured on an AMD EPYC (Zen 4, 2 threads), the default model's int4 shapes (1536x576, 576x1536, 960x576), both
 * builds loaded in one process and alternated: 4 to 16 rows 0.72-0.78x the time of one row at a time through
 * tile_outputs (its one chain of 8 dependent vpdpbusd a block), 16 rows at ~240 GMAC/s, the rate a loop of
 * independent 512-bit vpdpbusd alone reaches on these two cores. */
#define TILE_GROUP 4
INLINE void tile_group_outputs(const int bits, const uint8_t *tc, const uint16_t *td, const uint16_t *tm, int64_t K,
                               int64_t gb, const tkv_int8_rows *a, int64_t i0, int R, float *o) {
#ifdef TILE_VNNI
    __m512 acc[TILE_GROUP], z[TILE_GROUP];
    for (int r = 0; r < TILE_GROUP; r++) acc[r] = z[r] = _mm512_setzero_ps();
    const int64_t B = K / 32;
    for (int64_t b = 0; b < B; b++) {  /* (the group's scales read each block, as tile_outputs reads them) */
        const uint8_t *bc = tc + b * TILE_BLOCK(bits);
        __m512i c[8];
        if (bits == 4) {
            const __m512i low = _mm512_set1_epi8(15);
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512(bc + j * 64);
                c[2 * j] = _mm512_and_si512(v, low);
                c[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        } else {
            for (int j = 0; j < 8; j++) c[j] = _mm512_loadu_si512(bc + j * 64);
        }
        const int64_t s = (gb == 1 ? b : b / gb) * 16;  /* (no division where groups are blocks) */
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(td + s)));
        const __m512 m = tm ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tm + s))) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const int64_t i = i0 + r;
            const int32_t *xa = (const int32_t *)(a->xq + i * K + b * 32);
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int j = 0; j < 8; j += 2) {
                s0 = _mm512_dpbusd_epi32(s0, c[j], _mm512_set1_epi32(xa[j]));
                s1 = _mm512_dpbusd_epi32(s1, c[j + 1], _mm512_set1_epi32(xa[j + 1]));
            }
            __m512i sum = _mm512_add_epi32(s0, s1);
            if (bits == 8) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * a->qs[i * B + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(a->sx[i * B + b])),
                                     acc[r]);
            if (tm) z[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a->xs[i * B + b]), z[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(o + r * TILE_ROWS, _mm512_add_ps(acc[r], z[r]));
#else
    const int64_t B = K / 32;
    for (int r = 0; r < R; r++)
        tile_outputs(bits, tc, td, tm, K, gb, a->xq + (i0 + r) * K, a->sx + (i0 + r) * B, a->xs + (i0 + r) * B,
                     a->qs + (i0 + r) * B, o + r * TILE_ROWS);
#endif
}

/* The outputs of tile t (+ bias) for activation row i, into out's row i (rows N apart) */
INLINE void tile_store(const float *o, const float *bias, int64_t N, int64_t t, int64_t i, float *out) {
    for (int r = 0; r < TILE_ROWS; r++) out[i * N + t * TILE_ROWS + r] = o[r] + (bias ? bias[t * TILE_ROWS + r] : 0.f);
}

/* Tile t's outputs (+ bias) for all M activation rows, TILE_GROUP rows at a time, into out [M, ostride] */
INLINE void tile_all_rows(const int bits, const uint8_t *q, const uint16_t *d, const uint16_t *mn, int64_t K,
                          int64_t g, const tkv_int8_rows *a, int64_t M, int64_t t, const float *bias,
                          int64_t ostride, float *out) {
    const int64_t G = K / g, stride = K / 32 * TILE_BLOCK(bits);
    float o[TILE_GROUP * TILE_ROWS];
    const uint8_t *tc = q + t * stride;
    const uint16_t *td = d + t * G * 16, *tm = mn ? mn + t * G * 16 : NULL;
    for (int64_t i0 = 0; i0 < M; i0 += TILE_GROUP) {
        const int R = M - i0 < TILE_GROUP ? (int)(M - i0) : TILE_GROUP;
        if (bits == 4 && R == TILE_GROUP)  /* (the common cases with constant arguments, for the compiler) */
            tile_group_outputs(4, tc, td, tm, K, g / 32, a, i0, TILE_GROUP, o);
        else if (bits == 4)
            tile_group_outputs(4, tc, td, tm, K, g / 32, a, i0, R, o);
        else if (R == TILE_GROUP)
            tile_group_outputs(8, tc, td, tm, K, g / 32, a, i0, TILE_GROUP, o);
        else
            tile_group_outputs(8, tc, td, tm, K, g / 32, a, i0, R, o);
        for (int r = 0; r < R; r++) tile_store(o + r * TILE_ROWS, bias, ostride, t, i0 + r, out);
    }
}

/* The int8 blocks of M activation rows (q8_blocks) in `mem` (tkv_int8_blocks_bytes): codes [M, K], then the
 * blocks' scales, scaled sums and code sums [M, K/32] each (cpu_kernels.h: tkv_int8_rows) */
size_t tkv_int8_blocks_bytes(int64_t M, int64_t K) {
    return lines((size_t)(M * K)) + 3 * lines((size_t)(M * (K / 32)) * sizeof(float));
}

tkv_int8_rows tkv_int8_blocks_at(const char *mem, int64_t M, int64_t K) {
    const size_t a = lines((size_t)(M * K)), b = lines((size_t)(M * (K / 32)) * sizeof(float));
    tkv_int8_rows r = {(int8_t *)mem, (float *)(mem + a), (float *)(mem + a + b), (int32_t *)(mem + a + 2 * b)};
    return r;
}

void tkv_int8_blocks_row(const float *x, int64_t K, const tkv_int8_rows *a, int64_t i) {
    const int64_t B = K / 32;
    q8_blocks(x + i * K, K, a->xq + i * K, a->sx + i * B, a->xs + i * B, a->qs + i * B);
}

static void tile_prepare(const float *x, int64_t M, int64_t K, char *mem) {
    const tkv_int8_rows a = tkv_int8_blocks_at(mem, M, K);
    for (int64_t i = 0; i < M; i++) tkv_int8_blocks_row(x, K, &a, i);
}

static int tile_fits(int64_t K, int64_t g, int64_t N) {
    return K % 32 == 0 && g % 32 == 0 && K % g == 0 && N % TILE_ROWS == 0;
}

/* M activation rows x [M, K] times a tiled weight of N = 16 T outputs: out [M, N]. Returns 0, or -1 when
 * scratch memory could not be had or the shapes are not whole blocks and tiles. */
static int tile_linear(const int bits, const float *x, int64_t M, int64_t K, const uint8_t *q, const uint16_t *d,
                       const uint16_t *mn, int64_t g, int64_t N, const float *bias, float *out) {
    if (!tile_fits(K, g, N)) return -1;
    const int64_t T = N / TILE_ROWS;
    char *mem = tkv_scratch(tkv_int8_blocks_bytes(M, K));
    if (!mem) return -1;
    tile_prepare(x, M, K, mem);
    const tkv_int8_rows a = tkv_int8_blocks_at(mem, M, K);
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++)  /* each tile's codes read from memory once, then from L1 for the rows */
        tile_all_rows(bits, q, d, mn, K, g, &a, M, t, bias, N, out);
    return 0;
}

/* M activation rows (prepared by tile_prepare in mem) times a tiled weight, as a worksharing loop: out[m *
 * ostride + n]. One row: two tiles at once (tiles p and p + H: two streams a thread) with VNNI, else a tile at a
 * time; more rows: as tile_linear, each tile's codes from memory once, then from L1 for each group of rows */
static void tile_share(const int bits, const char *mem, int64_t M, int64_t ostride, int64_t K, const uint8_t *q,
                       const uint16_t *d, const uint16_t *mn, int64_t g, int64_t N, const float *bias, float *out) {
    const int64_t B = K / 32, G = K / g, T = N / TILE_ROWS, gb = g / 32, stride = B * TILE_BLOCK(bits);
    const tkv_int8_rows a = tkv_int8_blocks_at(mem, M, K);
    if (M > 1) {
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) tile_all_rows(bits, q, d, mn, K, g, &a, M, t, bias, ostride, out);
        return;
    }
    const int8_t *xq = a.xq;
    const float *sx = a.sx, *xs = a.xs;
    const int32_t *qs = a.qs;
#ifndef TILE_VNNI
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float o[TILE_ROWS];
        tile_outputs(bits, q + t * stride, d + t * G * 16, mn ? mn + t * G * 16 : NULL, K, gb, xq, sx, xs, qs, o);
        tile_store(o, bias, N, t, 0, out);
    }
#else
    const int64_t H = (T + 1) / 2;
    #pragma omp for schedule(static)
    for (int64_t p = 0; p < H; p++) {
        const int two = p + H < T;
        const int64_t t1 = two ? p + H : p;
        const uint8_t *c0 = q + p * stride, *c1 = q + t1 * stride;
        const uint16_t *d0 = d + p * G * 16, *d1 = d + t1 * G * 16;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), z0 = _mm512_setzero_ps(),
               z1 = _mm512_setzero_ps();
        for (int64_t blk = 0; blk < B; blk++) {
            for (int l = 0; l < TILE_BLOCK(bits) / 64; l++) {
                _mm_prefetch((const char *)(c0 + blk * TILE_BLOCK(bits)) + TILE_AHEAD + 64 * l, _MM_HINT_T0);
                _mm_prefetch((const char *)(c1 + blk * TILE_BLOCK(bits)) + TILE_AHEAD + 64 * l, _MM_HINT_T0);
            }
            const int64_t s = blk / gb * 16;
            const __m512 xscale = _mm512_set1_ps(sx[blk]);
            const __m512i i0 = tile_block(bits, c0, xq, qs, blk), i1 = tile_block(bits, c1, xq, qs, blk);
            acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0),
                                   _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d0 + s))), xscale), acc0);
            acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1),
                                   _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d1 + s))), xscale), acc1);
            if (mn) {
                const __m512 xsum = _mm512_set1_ps(xs[blk]);
                z0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + p * G * 16 + s))), xsum, z0);
                z1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + t1 * G * 16 + s))), xsum, z1);
            }
        }
        float o[TILE_ROWS];
        _mm512_storeu_ps(o, _mm512_add_ps(acc0, z0));
        tile_store(o, bias, N, p, 0, out);
        if (two) {
            _mm512_storeu_ps(o, _mm512_add_ps(acc1, z1));
            tile_store(o, bias, N, t1, 0, out);
        }
    }
#endif
}

/* Rows ids[0..count) of a tiled weight (ids NULL: rows 0..count) dequantized to fp32 [count, K] */
static void tile_rows(const int bits, const uint8_t *q, const uint16_t *d, const uint16_t *mn, int64_t g, int64_t K,
                      const int64_t *ids, int64_t count, float *out) {
    const int64_t G = K / g, per = bits == 4 ? 8 : 4, stride = K / 32 * TILE_BLOCK(bits);  /* inputs a chunk */
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; i++) {
        const int64_t row = ids ? ids[i] : i, t = row / TILE_ROWS, r = row % TILE_ROWS;
        const uint8_t *tc = q + t * stride + 4 * r;
        const uint16_t *td = d + t * G * 16 + r, *tm = mn ? mn + t * G * 16 + r : NULL;
        float *o = out + i * K;
        for (int64_t c = 0; c < K / per; c++) {
            const float s = h2f(td[(per * c / g) * 16]), z = tm ? h2f(tm[(per * c / g) * 16]) : 0.f;
            uint32_t v;
            memcpy(&v, tc + c * 64, 4);
            if (bits == 8) {
                for (int j = 0; j < 4; j++) o[4 * c + j] = (float)((int)((v >> (8 * j)) & 255) - 128) * s + z;
                continue;
            }
#ifdef TKV_AVX2  /* the row's 8 inputs of the chunk: the 4 low nibbles, then the 4 high ones */
            const uint64_t both = (uint64_t)(v & 0x0f0f0f0fu) | (uint64_t)((v >> 4) & 0x0f0f0f0fu) << 32;
            const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)both)));
            _mm256_storeu_ps(o + 8 * c, _mm256_fmadd_ps(w, _mm256_set1_ps(s), _mm256_set1_ps(z)));
#else
            for (int j = 0; j < 4; j++) {
                o[8 * c + j] = (float)((v >> (8 * j)) & 15) * s + z;
                o[8 * c + 4 + j] = (float)((v >> (8 * j + 4)) & 15) * s + z;
            }
#endif
        }
    }
}

/* ---- one-row products through one interface (cpu_kernels.h: prepare, then share) ------------------------ */
/* fp32 weights in oneDNN's packed layout (TKV_F32P): with the packed kernels below */
static int f32p_fits(const tkv_qw *w);
static void f32p_share(const tkv_qw *w, const float *x, int64_t M, int64_t ostride, float *out);
static void f32p_rows(const tkv_qw *w, const int64_t *ids, int64_t count, float *out);

int tkv_row_fits(const tkv_qw *w) {
    if (w->fmt == TKV_F32P) return f32p_fits(w);
    if (w->g <= 0 || w->K % w->g) return 0;
    switch (w->fmt) {
    case TKV_Q8: return w->g % 16 == 0;
    case TKV_Q4: return w->g % 32 == 0;
    case TKV_Q8T: case TKV_Q4T: return tile_fits(w->K, w->g, w->N);
    default: return 0;
    }
}

static int tiled(const tkv_qw *w) { return w->fmt == TKV_Q8T || w->fmt == TKV_Q4T; }

/* M > 1 prepared rows for the block kernels (q8_block, q4_block, q4_block512), as tkv_q4_linear lays them out:
 * int16 codes [M, K], the same in pair order [M, K], the rows' scales [M], each group's sum of x [M, K / g] */
typedef struct { int16_t *xq, *xp; float *sx, *xsum; } int16_rows;

static size_t int16_rows_bytes(int64_t M, int64_t K, int64_t G) {
    return 2 * lines((size_t)(M * K) * sizeof(int16_t)) + lines((size_t)M * sizeof(float)) +
           (size_t)(M * G) * sizeof(float);
}

static int16_rows int16_rows_at(const char *mem, int64_t M, int64_t K) {
    const size_t a = lines((size_t)(M * K) * sizeof(int16_t)), b = lines((size_t)M * sizeof(float));
    int16_rows r = {(int16_t *)mem, (int16_t *)(mem + a), (float *)(mem + 2 * a), (float *)(mem + 2 * a + b)};
    return r;
}

#ifdef TKV_AVX512
/* whether the q4 rows take the 512-bit blocks (groups of 32, at least one chunk of eight groups) */
static int q4_wide(const tkv_qw *w) { return w->g == 32 && w->K >= 256; }
#endif

size_t tkv_row_bytes(const tkv_qw *w) { return tkv_rows_bytes(w, 1); }

size_t tkv_rows_bytes(const tkv_qw *w, int64_t M) {
    if (w->fmt == TKV_F32P) return (size_t)(M * w->K) * sizeof(float);  /* the rows as they are */
    if (tiled(w)) return tkv_int8_blocks_bytes(M, w->K);
    return M == 1 ? int16_row_bytes(w->K, w->K / w->g) : int16_rows_bytes(M, w->K, w->K / w->g);
}

void tkv_row_prepare(const tkv_qw *w, const float *x, char *mem) { tkv_rows_prepare(w, x, 1, mem); }

void tkv_rows_prepare(const tkv_qw *w, const float *x, int64_t M, char *mem) {
    const int64_t K = w->K;
    if (w->fmt == TKV_F32P) {
        memcpy(mem, x, (size_t)(M * K) * sizeof(float));
        return;
    }
    if (tiled(w)) {
        tile_prepare(x, M, K, mem);
        return;
    }
    if (M > 1) {
        const int16_rows a = int16_rows_at(mem, M, K);
        quantize_rows(x, M, K, w->g, a.xq, a.sx, a.xsum);
#ifdef TKV_AVX512
        if (w->fmt == TKV_Q4 && q4_wide(w))
            for (int64_t m = 0; m < M; m++) pair_order(a.xq + m * K, K / 32 / 8 * 8, a.xp + m * K);
#endif
        return;
    }
    const int16_row a = int16_row_at(mem, K);
    quantize_rows(x, 1, K, w->g, a.xq, a.sx, w->fmt == TKV_Q4 || w->mn ? a.xsum : NULL);
#ifdef TKV_AVX512
    if (w->fmt == TKV_Q4 && q4_wide(w)) pair_order(a.xq, K / 32 / 8 * 8, a.xp);  /* as q4_row512 reads them */
#endif
}

void tkv_row_share(const tkv_qw *w, const char *mem, float *out) { tkv_rows_share(w, mem, 1, w->N, out); }

/* M > 1 rows: tkv_q8_linear's and tkv_q4_linear's blocks (RB weight rows unpacked once for two activation rows),
 * as a worksharing loop */
static void blocks_share(const tkv_qw *w, const char *mem, int64_t M, int64_t ostride, float *out) {
    const int64_t K = w->K, N = w->N, g = w->g;
    const int16_rows a = int16_rows_at(mem, M, K);
#ifdef TKV_AVX512
    const int wide = w->fmt == TKV_Q4 && q4_wide(w);
#endif
    #pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n += RB) {
        const int rows = N - n < RB ? (int)(N - n) : RB;
        block_ahead(w->q, w->fmt == TKV_Q8 ? K : K / 2, n, N);
        for (int64_t m = 0; m < M; m += 2) {
            const int mt = M - m >= 2 ? 2 : 1;
            if (w->fmt == TKV_Q8)
                q8_rows_block(a.xq, a.sx, w->mn ? a.xsum : NULL, m, mt, K, (const int8_t *)w->q, w->d, w->mn, g,
                              ostride, n, rows, w->bias, out);
#ifdef TKV_AVX512
            else if (wide)
                q4_block512(a.xq, a.xp, a.sx, a.xsum, m, mt, K, (const uint8_t *)w->q, w->d, w->mn, ostride, n,
                            rows, w->bias, out);
#endif
            else
                q4_rows_block(a.xq, a.sx, a.xsum, m, mt, K, (const uint8_t *)w->q, w->d, w->mn, g, ostride, n, rows,
                              w->bias, out);
        }
    }
}

void tkv_rows_share(const tkv_qw *w, const char *mem, int64_t M, int64_t ostride, float *out) {
    if (w->fmt == TKV_F32P)
        f32p_share(w, (const float *)mem, M, ostride, out);
    else if (tiled(w))
        tile_share(w->fmt == TKV_Q4T ? 4 : 8, mem, M, ostride, w->K, (const uint8_t *)w->q, w->d, w->mn, w->g, w->N,
                   w->bias, out);
    else if (M > 1)
        blocks_share(w, mem, M, ostride, out);
    else if (w->fmt == TKV_Q8)
        q8_share(w, mem, out);
    else
        q4_share(w, mem, out);
}

void tkv_row_dequantize(const tkv_qw *w, const int64_t *ids, int64_t count, float *out) {
    if (w->fmt == TKV_F32P)
        f32p_rows(w, ids, count, out);
    else if (w->fmt == TKV_Q8)
        tkv_q8_rows((const int8_t *)w->q, w->d, w->mn, w->g, w->K, ids, count, out);
    else if (w->fmt == TKV_Q4)
        tkv_q4_rows((const uint8_t *)w->q, w->d, w->mn, w->g, w->K, ids, count, out);
    else
        tile_rows(w->fmt == TKV_Q4T ? 4 : 8, (const uint8_t *)w->q, w->d, w->mn, w->g, w->K, ids, count, out);
}

/* One row through the interface, in a parallel region of its own. Returns 0, or -1 for a shape the kernels do
 * not take or no scratch memory. */
static int row_product(const tkv_qw *w, const float *x, float *out) {
    if (!tkv_row_fits(w)) return -1;
    char *mem = tkv_scratch(tkv_row_bytes(w));
    if (!mem) return -1;
    tkv_row_prepare(w, x, mem);
    #pragma omp parallel
    tkv_row_share(w, mem, out);
    return 0;
}

int tkv_q8_gemv(const float *x, int64_t K, const int8_t *q, const uint16_t *d, const uint16_t *mn, int64_t g,
                int64_t N, const float *bias, float *out) {
    const tkv_qw w = {TKV_Q8, q, d, mn, g, N, K, bias};
    return row_product(&w, x, out);
}

int tkv_q4_gemv(const float *x, int64_t K, const uint8_t *q, const uint16_t *d, const uint16_t *mn, int64_t g,
                int64_t N, const float *bias, float *out) {
    const tkv_qw w = {TKV_Q4, q, d, mn, g, N, K, bias};
    return row_product(&w, x, out);
}

/* The exported kernels of each tiled format: tkv_q4t_* (bits 4) and tkv_q8t_* (bits 8), with the signatures of
 * the untiled ones (kernels/quant_cpu.py) */
#define TILE_EXPORTS(fmt, bits)                                                                                    \
    int tkv_##fmt##_linear(const float *x, int64_t M, int64_t K, const uint8_t *q, const uint16_t *d,              \
                           const uint16_t *mn, int64_t g, int64_t N, const float *bias, float *out) {             \
        return tile_linear(bits, x, M, K, q, d, mn, g, N, bias, out);                                              \
    }                                                                                                              \
    int tkv_##fmt##_gemv(const float *x, int64_t K, const uint8_t *q, const uint16_t *d, const uint16_t *mn,       \
                         int64_t g, int64_t N, const float *bias, float *out) {                                    \
        const tkv_qw w = {(bits) == 4 ? TKV_Q4T : TKV_Q8T, q, d, mn, g, N, K, bias};                            \
        return row_product(&w, x, out);                                                                            \
    }                                                                                                              \
    void tkv_##fmt##_rows(const uint8_t *q, const uint16_t *d, const uint16_t *mn, int64_t g, int64_t K,           \
                          const int64_t *ids, int64_t count, float *out) {                                        \
        tile_rows(bits, q, d, mn, g, K, ids, count, out);                                                          \
    }
TILE_EXPORTS(q4t, 4)
TILE_EXPORTS(q8t, 8)

/* 1 where this build multiplies tiled weights with AVX-512 VNNI (kernels/quant.py tiles weights then) */
int tkv_tiles_native(void) {
#ifdef TILE_VNNI
    return 1;
#else
    return 0;
#endif
}

/* ---- one activation row times a full-precision weight in oneDNN's packed layout -------------------------
 * The dense layers' fp32 and bf16 weights are held packed by oneDNN (kernels/linear.py), which multiplies many
 * rows fastest that way. For one row (a batch-1 decode step) these kernels read the same buffer where its
 * layout is one they know, which kernels/linear.py checks weight by weight against the unpacked weight:
 *   fp32: blocks of B outputs, [ceil(N/B)][Kp][B]: input k's B weights side by side;
 *   bf16: [ceil(N/B)][Kp/2][B][2]: input pairs interleaved (the layout vdpbf16ps reads);
 * Kp >= K the inputs a block stores (oneDNN pads them, with zeros, to its own multiple).
 * Each block's B outputs are accumulated together, input after input, so the weight is read once, in order,
 * and no horizontal sum is needed. Measured on an AMD EPYC (Zen 5) over 30 layers of the default model's
 * shapes, one row, in six sittings (the machine's speed varied 1.5x between them): 0.55-1.0x oneDNN's time in
 * fp32 (never slower), 0.68-0.92x in bf16. Two accumulators per output vector (inputs taken two at a time)
 * measured 3-4% faster in fp32 and no faster in bf16: not kept.
 * B is at most 64 (the outputs' accumulators stay in registers); returns -1 for a larger B. */
#define PACKED_MAX_B 64

static uint16_t f2bf(float f) {  /* round to nearest even, as torch's conversion does (NaN stays NaN) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float bf2f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* One block's B = 16 v (AVX-512) or 8 v (AVX2) outputs, inlined with a constant v so that the accumulators
 * stay in registers (with v known only at run time they went through memory: 1.5x slower) */
#if defined(__AVX512F__)
#define ROWS_GROUP 6  /* the most rows f32_rows512 takes at once (tkv_f32_packed_rows) */

/* The block's B = 16 v outputs (wb: its weights, B apart per input) for R rows of x (K inputs each): acc [R][B],
 * each input's weights loaded once for the R rows. R and v constants. */
INLINE void f32_rows512(const float *x, const int R, int64_t K, const float *wb, int64_t B, const int v, float *acc) {
    __m512 a[ROWS_GROUP][PACKED_MAX_B / 16];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < v; i++) a[r][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m512 w[PACKED_MAX_B / 16];
        for (int i = 0; i < v; i++) w[i] = _mm512_loadu_ps(wb + k * B + 16 * i);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_set1_ps(x[r * K + k]);
            for (int i = 0; i < v; i++) a[r][i] = _mm512_fmadd_ps(w[i], xv, a[r][i]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < v; i++) _mm512_storeu_ps(acc + r * B + 16 * i, a[r][i]);
}

INLINE void f32_block512(const float *x, int64_t K, const float *wb, int64_t B, const int v, float *acc) {
    f32_rows512(x, 1, K, wb, B, v, acc);
}
#endif
#ifdef TKV_AVX2
INLINE void f32_block256(const float *x, int64_t K, const float *wb, int64_t B, const int v, float *acc) {
    __m256 a[PACKED_MAX_B / 8];
    for (int i = 0; i < v; i++) a[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m256 xv = _mm256_set1_ps(x[k]);
        for (int i = 0; i < v; i++) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(wb + k * B + 8 * i), xv, a[i]);
    }
    for (int i = 0; i < v; i++) _mm256_storeu_ps(acc + 8 * i, a[i]);
}
#endif
#if defined(__AVX512BF16__)
/* The bf16 blocks ask for their weights this many bytes ahead of the products. Measured on an Intel Xeon with
 * AMX (KVM guest, 2 threads, ~27 GB/s), the default model's 30 layers in bf16 (blocks of 32 outputs) read from
 * memory: 10.0-10.4 -> 8.1-8.5 ms (0.81x), the plain read's speed; 1-4 KB ahead gave less, 16 KB the same. Without
 * it the hardware prefetcher alone left bf16 at ~21 GB/s where fp32's blocks, read the same way, reach the
 * memory's speed (there the same prefetch made fp32 1.02-1.11x slower: not done). */
#define BF16_AHEAD 8192
/* Two blocks at once (w0, w1: each B outputs; acc: block 0's outputs, then block 1's at PACKED_MAX_B): two
 * streams from memory where one alone read bf16 weights below the memory's speed (packed_row) */
INLINE void bf16_pair512(const uint16_t *x, int64_t K, const uint16_t *w0, const uint16_t *w1, int64_t B, const int v,
                         float *acc) {
    const int64_t K2 = (K + 1) / 2;
    __m512 a[PACKED_MAX_B / 16], b[PACKED_MAX_B / 16];
    for (int i = 0; i < v; i++) a[i] = b[i] = _mm512_setzero_ps();
    for (int64_t k2 = 0; k2 < K2; k2++) {  /* one vdpbf16ps: 16 outputs' weight pairs times the input pair */
        for (int i = 0; i < v; i++) {
            _mm_prefetch((const char *)(w0 + (k2 * B + 16 * i) * 2) + BF16_AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + (k2 * B + 16 * i) * 2) + BF16_AHEAD, _MM_HINT_T0);
        }
        uint32_t pair = (uint32_t)x[2 * k2] | (2 * k2 + 1 < K ? (uint32_t)x[2 * k2 + 1] << 16 : 0u);
        __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
        for (int i = 0; i < v; i++) {
            a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_loadu_si512(w0 + (k2 * B + 16 * i) * 2), xv);
            b[i] = _mm512_dpbf16_ps(b[i], (__m512bh)_mm512_loadu_si512(w1 + (k2 * B + 16 * i) * 2), xv);
        }
    }
    for (int i = 0; i < v; i++) {
        _mm512_storeu_ps(acc + 16 * i, a[i]);
        _mm512_storeu_ps(acc + PACKED_MAX_B + 16 * i, b[i]);
    }
}

/* One block: the pair's kernel on the block twice, the twin's sums dropped (only a call's odd last block
 * comes here; the same operations, so the same bits) */
INLINE void bf16_block512(const uint16_t *x, int64_t K, const uint16_t *wb, int64_t B, const int v, float *acc) {
    float both[2 * PACKED_MAX_B];
    bf16_pair512(x, K, wb, wb, B, v, both);
    memcpy(acc, both, (size_t)B * sizeof(float));
}
#endif
#ifdef TKV_AVX2
INLINE void bf16_block256(const uint16_t *x, int64_t K, const uint16_t *wb, int64_t B, const int v, float *acc) {
    const int64_t K2 = (K + 1) / 2;
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    __m256 a[PACKED_MAX_B / 8];
    for (int i = 0; i < v; i++) a[i] = _mm256_setzero_ps();
    for (int64_t k2 = 0; k2 < K2; k2++) {  /* 8 outputs' pairs a load: the even inputs shifted up, the odd masked */
        __m256 x0 = _mm256_set1_ps(bf2f(x[2 * k2]));
        __m256 x1 = _mm256_set1_ps(2 * k2 + 1 < K ? bf2f(x[2 * k2 + 1]) : 0.f);
        for (int i = 0; i < v; i++) {
            __m256i p = _mm256_loadu_si256((const __m256i *)(wb + (k2 * B + 8 * i) * 2));
            a[i] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(p, 16)), x0, a[i]);
            a[i] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(p, high)), x1, a[i]);
        }
    }
    for (int i = 0; i < v; i++) _mm256_storeu_ps(acc + 8 * i, a[i]);
}
#endif

/* acc = the block's B outputs through `fn` with v = B / lanes as a constant (v 1..4 with 16 lanes, 1..8 with
 * 8: up to PACKED_MAX_B); 0 where B is none of those */
#define PACKED_V(fn, v, ...) (fn(__VA_ARGS__, v, acc), 1)
#define PACKED_DISPATCH16(fn, ...)                                                                   \
    (B == 64 ? PACKED_V(fn, 4, __VA_ARGS__) : B == 32 ? PACKED_V(fn, 2, __VA_ARGS__) :               \
     B == 16 ? PACKED_V(fn, 1, __VA_ARGS__) : B == 48 ? PACKED_V(fn, 3, __VA_ARGS__) : 0)
#define PACKED_DISPATCH8(fn, ...)                                                                    \
    (B == 64 ? PACKED_V(fn, 8, __VA_ARGS__) : B == 32 ? PACKED_V(fn, 4, __VA_ARGS__) :               \
     B == 16 ? PACKED_V(fn, 2, __VA_ARGS__) : B == 8 ? PACKED_V(fn, 1, __VA_ARGS__) :                \
     B == 48 ? PACKED_V(fn, 6, __VA_ARGS__) : B == 24 ? PACKED_V(fn, 3, __VA_ARGS__) : 0)

/* acc = one block's B outputs (wb: the block's weights): the vector branch for B where there is one, else
 * plain C over the layout (fp32 [Kp][B]; bf16 [Kp/2][B][2]) */
static void packed_block(int bf16, const void *x, int64_t K, const void *wb, int64_t B, float *acc) {
    int done = 0;
    const float *xf = (const float *)x, *wf = (const float *)wb;
    const uint16_t *xh = (const uint16_t *)x, *wh = (const uint16_t *)wb;
#if defined(__AVX512F__)
    if (!bf16) done = PACKED_DISPATCH16(f32_block512, xf, K, wf, B);
#endif
#if defined(__AVX512BF16__)
    if (bf16) done = PACKED_DISPATCH16(bf16_block512, xh, K, wh, B);
#endif
#ifdef TKV_AVX2
    if (!done)
        done = bf16 ? PACKED_DISPATCH8(bf16_block256, xh, K, wh, B) : PACKED_DISPATCH8(f32_block256, xf, K, wf, B);
#endif
    if (done) return;
    for (int64_t j = 0; j < B; j++) acc[j] = 0.f;
    for (int64_t k = 0; k < K; k++)
        for (int64_t j = 0; j < B; j++)
            acc[j] += bf16 ? bf2f(wh[((k / 2) * B + j) * 2 + k % 2]) * bf2f(xh[k]) : wf[k * B + j] * xf[k];
}

/* Block blk's outputs (+ bias) stored in the output's dtype */
static void packed_store(int bf16, const float *acc, const float *bias, int64_t N, int64_t B, int64_t blk, void *out) {
    const int64_t n0 = blk * B, cnt = N - n0 < B ? N - n0 : B;
    for (int64_t j = 0; j < cnt; j++) {
        float v = acc[j] + (bias ? bias[n0 + j] : 0.f);
        if (bf16)
            ((uint16_t *)out)[n0 + j] = f2bf(v);
        else
            ((float *)out)[n0 + j] = v;
    }
}

/* Both dtypes: blocks split among the threads, each block's outputs stored by packed_store. bf16 blocks go two
 * at a time where the build has AVX512_BF16 (blocks p and p + H: two streams a thread): on an Intel Xeon (KVM
 * guest, 2 threads) the default model's 30 bf16 layers from memory took 0.91x the time one stream took
 * (8.47 -> 7.73 ms, 25 -> 27.6 GB/s, the plain read's speed); the same for fp32 blocks was 1.02-1.07x slower
 * (not done). */
static int packed_row(int bf16, const void *x, int64_t K, const void *w, int64_t N, int64_t B, int64_t Kp,
                      const float *bias, void *out) {
    if (B <= 0 || B > PACKED_MAX_B || Kp < K || (bf16 && Kp % 2)) return -1;
    const int64_t nb = (N + B - 1) / B, bytes = Kp * B * (bf16 ? 2 : 4);
#if defined(__AVX512BF16__)
    if (bf16 && B % 16 == 0) {
        const int64_t H = (nb + 1) / 2;
        #pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < H; p++) {
            float acc[2 * PACKED_MAX_B];
            const uint16_t *w0 = (const uint16_t *)((const char *)w + p * bytes);
            if (p + H < nb) {
                const uint16_t *w1 = (const uint16_t *)((const char *)w + (p + H) * bytes);
                PACKED_DISPATCH16(bf16_pair512, (const uint16_t *)x, K, w0, w1, B);
                packed_store(1, acc + PACKED_MAX_B, bias, N, B, p + H, out);
            } else {
                packed_block(1, x, K, w0, B, acc);
            }
            packed_store(1, acc, bias, N, B, p, out);
        }
        return 0;
    }
#endif
    #pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < nb; blk++) {
        float acc[PACKED_MAX_B];
        packed_block(bf16, x, K, (const char *)w + blk * bytes, B, acc);
        packed_store(bf16, acc, bias, N, B, blk, out);
    }
    return 0;
}

int tkv_f32_packed_row(const float *x, int64_t K, const float *w, int64_t N, int64_t B, int64_t Kp,
                       const float *bias, float *out) {
    return packed_row(0, x, K, w, N, B, Kp, bias, out);
}

/* ---- a few activation rows times an fp32 weight in oneDNN's packed layout ---------------------------------
 * A batched decode step's rows or a speculative step's verification rows (kernels/linear.py: one_row_or_onednn;
 * the native decode step's products, decode_cpu.c, through f32p_share), on AVX-512 builds. Each output's sum is
 * the one-row kernel's (f32_block512: a fused multiply-add per input, in order, from zero, then the bias in
 * packed_store), so a row is the same bits alone or among others. A block's
 * weights are read from memory once for up to ROWS_GROUP rows: the B outputs of each row accumulated in registers
 * (6 rows of up to 4 vectors: 24), each input's weights loaded once for the rows, the next rows' pass over the
 * block reading it from L2. Measured on an AMD EPYC (Zen 4, 2 threads) over the default model's 121 fp32 products
 * (one sitting, alternated): 2 to 6 rows 0.48-0.69x oneDNN's time (the one-row kernel's time: the weights' read),
 * 9 rows 0.74x, 16 rows 0.85x, 32 rows 0.90x. AVX2 builds (16 registers: 3 rows of 4 vectors would spill) keep
 * oneDNN's product for several rows: not measured there. */
#if defined(__AVX512F__)
#define ROWS_CASE(n, vv) case n: f32_rows512(x, n, K, wb, B, vv, acc); return 1;
#define ROWS_SWITCH(vv) switch (R) { ROWS_CASE(1, vv) ROWS_CASE(2, vv) ROWS_CASE(3, vv) ROWS_CASE(4, vv) \
                                     ROWS_CASE(5, vv) ROWS_CASE(6, vv) }
/* f32_rows512 with R (1..ROWS_GROUP) and v = B / 16 (1..4) as constants; 0 where B is not one of those */
static int f32_rows_dispatch(const float *x, int R, int64_t K, const float *wb, int64_t B, float *acc) {
    switch (B % 16 == 0 ? B / 16 : 0) {
    case 1: ROWS_SWITCH(1) break;
    case 2: ROWS_SWITCH(2) break;
    case 3: ROWS_SWITCH(3) break;
    case 4: ROWS_SWITCH(4) break;
    }
    return 0;
}
#else
#define ROWS_GROUP 1
#endif

/* acc [R][B] = R rows of x (R <= ROWS_GROUP, K inputs each) times one block's B outputs, each as packed_block
 * computes it */
static void f32_rows_block(const float *x, int R, int64_t K, const float *wb, int64_t B, float *acc) {
#if defined(__AVX512F__)
    if (f32_rows_dispatch(x, R, K, wb, B, acc)) return;
#endif
    for (int r = 0; r < R; r++) packed_block(0, x + r * K, K, wb, B, acc + r * B);
}

/* 1 where this build multiplies several rows on packed fp32 weights in registers (AVX-512), else 0 (oneDNN then) */
int tkv_f32_packed_rows_native(void) { return ROWS_GROUP > 1; }

static int f32p_fits(const tkv_qw *w) { return w->g > 0 && w->g <= PACKED_MAX_B && w->kp >= w->K && w->K > 0; }

/* out[m * ostride + n] = x [M, K] times the packed fp32 weight w, each row as tkv_f32_packed_row computes it; the
 * blocks as a worksharing loop (decode_cpu.c's region, or tkv_f32_packed_rows' own) */
static void f32p_share(const tkv_qw *w, const float *x, int64_t M, int64_t ostride, float *out) {
    const int64_t K = w->K, N = w->N, B = w->g, nb = (N + B - 1) / B, bytes = w->kp * B * 4;
    #pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nb; blk++) {
        float acc[ROWS_GROUP * PACKED_MAX_B];
        const float *wb = (const float *)((const char *)w->q + blk * bytes);
        for (int64_t m0 = 0; m0 < M; m0 += ROWS_GROUP) {
            const int R = M - m0 < ROWS_GROUP ? (int)(M - m0) : ROWS_GROUP;
            f32_rows_block(x + m0 * K, R, K, wb, B, acc);
            for (int r = 0; r < R; r++) packed_store(0, acc + r * B, w->bias, N, B, blk, out + (m0 + r) * ostride);
        }
    }
}

/* weight rows ids[0..count) (ids NULL: 0..count) out of the packed layout, fp32 [count, K] */
static void f32p_rows(const tkv_qw *w, const int64_t *ids, int64_t count, float *out) {
    const int64_t B = w->g;
    for (int64_t i = 0; i < count; i++) {
        const int64_t n = ids ? ids[i] : i;
        const float *wb = (const float *)w->q + (n / B) * w->kp * B + n % B;
        for (int64_t k = 0; k < w->K; k++) out[i * w->K + k] = wb[k * B];
    }
}

/* x [M, K] times the packed fp32 weight (packed_row's layout) into out [M, N], each row as tkv_f32_packed_row
 * computes it. Returns 0, or -1 for a block width it does not take. */
int tkv_f32_packed_rows(const float *x, int64_t M, int64_t K, const float *w, int64_t N, int64_t B, int64_t Kp,
                        const float *bias, float *out) {
    const tkv_qw q = {TKV_F32P, w, NULL, NULL, B, N, K, bias, Kp};
    if (!f32p_fits(&q) || M < 1) return -1;
    #pragma omp parallel
    f32p_share(&q, x, M, N, out);
    return 0;
}

int tkv_bf16_packed_row(const uint16_t *x, int64_t K, const uint16_t *w, int64_t N, int64_t B, int64_t Kp,
                        const float *bias, uint16_t *out) {
    return packed_row(1, x, K, w, N, B, Kp, bias, out);
}
