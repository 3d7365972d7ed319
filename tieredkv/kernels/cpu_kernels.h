/* What the CPU kernels' sources (quant_cpu.c, attention_cpu.c, decode_cpu.c) share: one library,
 * built by kernels/quant_cpu.py. */
#ifndef TKV_CPU_KERNELS_H
#define TKV_CPU_KERNELS_H

#include <stddef.h>
#include <stdint.h>

void *tkv_scratch(size_t bytes);  /* the calling thread's scratch memory (quant_cpu.c) */

/* A quantized weight [N, K] as the one-row products read it, in one of quant_cpu.c's formats */
enum { TKV_Q8 = 0, TKV_Q4 = 1, TKV_Q8T = 2, TKV_Q4T = 3 };
typedef struct {
    int64_t fmt;           /* TKV_Q8, TKV_Q4, TKV_Q8T, TKV_Q4T */
    const void *q;         /* codes */
    const uint16_t *d;     /* fp16 scales */
    const uint16_t *mn;    /* fp16 offsets, or NULL */
    int64_t g, N, K;       /* group size, outputs, inputs */
    const float *bias;     /* [N] or NULL */
} tkv_qw;

/* One activation row x [K] times such a weight, in two steps, so that a caller's parallel region runs many
 * products without a region of its own for each (decode_cpu.c):
 *   tkv_row_prepare: x quantized as the format multiplies it, into `mem` (tkv_row_bytes(w) bytes); one thread;
 *   tkv_row_share:   out [N] = the product (+ bias); an OpenMP worksharing loop, so every thread of the
 *                    enclosing parallel region must call it (outside one, the calling thread does it all).
 * tkv_row_fits: 0 where the kernels do not take the weight's shape (tiles: groups not whole blocks of 32). */
int tkv_row_fits(const tkv_qw *w);
size_t tkv_row_bytes(const tkv_qw *w);
void tkv_row_prepare(const tkv_qw *w, const float *x, char *mem);
void tkv_row_share(const tkv_qw *w, const char *mem, float *out);
/* Rows ids[0..count) of such a weight (ids NULL: rows 0..count) dequantized to fp32 [count, K] */
void tkv_row_dequantize(const tkv_qw *w, const int64_t *ids, int64_t count, float *out);

/* Decode attention for one sequence inside a parallel region (attention_cpu.c: tkv_paged_decode's work):
 * tkv_attention_splits says how many items its positions are split into (the same for every layer of a
 * step), tkv_attention_share runs them, every thread calling it; `parts` holds splits * Hq * (D + 2) floats.
 * tkv_attention_fits: 0 for heads the kernel does not take (Hq not a multiple of Hkv, too many query heads a KV
 * head, too large a head). */
int tkv_attention_fits(int64_t Hq, int64_t D, int64_t bs, int64_t Hkv);
int64_t tkv_attention_splits(int64_t len, int threads);
void tkv_attention_share(const float *q, int64_t Hq, int64_t D, const void *kc, const void *vc, int bf16, int64_t bs,
                         int64_t Hkv, const int32_t *table, int32_t len, float scale, int64_t splits, float *parts,
                         float *out);

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* e^x for x <= 0 (scores less their maximum, -|x|): 2^n * e^r with |r| <= ln2/2, the polynomial to degree 7
 * (relative error below 1e-7); below -87 the result is e^-87, as good as 0 beside the maximum's e^0 = 1.
 * A NaN stays NaN (max_ps returns its second operand when either is NaN), so a NaN score spoils its head's
 * attention as softmax's does. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.f), x);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.f / 5040.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#endif
