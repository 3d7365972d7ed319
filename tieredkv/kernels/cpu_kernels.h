/* What the CPU kernels' sources (quant_cpu.c, attention_cpu.c, decode_cpu.c) share: one library,
 * built by kernels/quant_cpu.py. */
#ifndef TKV_CPU_KERNELS_H
#define TKV_CPU_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

void *tkv_scratch(size_t bytes);  /* the calling thread's scratch memory (quant_cpu.c) */

/* A weight [N, K] as the one-row products read it, in one of quant_cpu.c's formats: quantized, or fp32 in oneDNN's
 * packed layout (TKV_F32P: blocks of g outputs, kp inputs stored for each, as tkv_f32_packed_row reads them) */
enum { TKV_Q8 = 0, TKV_Q4 = 1, TKV_Q8T = 2, TKV_Q4T = 3, TKV_F32P = 4 };
typedef struct {
    int64_t fmt;           /* TKV_Q8, TKV_Q4, TKV_Q8T, TKV_Q4T, TKV_F32P */
    const void *q;         /* codes (TKV_F32P: the packed weights) */
    const uint16_t *d;     /* fp16 scales (TKV_F32P: NULL) */
    const uint16_t *mn;    /* fp16 offsets, or NULL */
    int64_t g, N, K;       /* group size (TKV_F32P: a block's outputs), outputs, inputs */
    const float *bias;     /* [N] or NULL */
    int64_t kp;            /* TKV_F32P: inputs stored for each block (>= K); else unused */
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
/* The same for M rows x [M, K] at once (a step verifying drafts): each weight row is read from memory once for
 * all of them; out[m * ostride + n]. tkv_rows_bytes(w, 1) == tkv_row_bytes(w). */
size_t tkv_rows_bytes(const tkv_qw *w, int64_t M);
void tkv_rows_prepare(const tkv_qw *w, const float *x, int64_t M, char *mem);
void tkv_rows_share(const tkv_qw *w, const char *mem, int64_t M, int64_t ostride, float *out);
/* Rows ids[0..count) of such a weight (ids NULL: rows 0..count) dequantized to fp32 [count, K] */
void tkv_row_dequantize(const tkv_qw *w, const int64_t *ids, int64_t count, float *out);

/* Activation rows as int8 blocks of 32 inputs (GGUF's Q8_1: codes, each block's scale max|x| / 127, its codes'
 * sum times the scale, and the codes' sum), as the tiled and many-row products multiply them (quant_cpu.c):
 * tkv_int8_blocks_bytes(M, K) bytes of `mem` hold M rows, tkv_int8_blocks_at finds the pieces, and
 * tkv_int8_blocks_row quantizes row i of x [M, K] into them (K a multiple of 32). */
typedef struct { int8_t *xq; float *sx, *xs; int32_t *qs; } tkv_int8_rows;
size_t tkv_int8_blocks_bytes(int64_t M, int64_t K);
tkv_int8_rows tkv_int8_blocks_at(const char *mem, int64_t M, int64_t K);
void tkv_int8_blocks_row(const float *x, int64_t K, const tkv_int8_rows *a, int64_t i);

/* fp16 <-> fp32, rounding to nearest even (F16C's instructions where the processor has them) */
static inline float tkv_h2f(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (e == 0) {
        if (man == 0) {
            bits = sign;
        } else {
            e = 113;
            while (!(man & 0x400u)) { man <<= 1; e--; }
            bits = sign | (e << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (e == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((e + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t tkv_f2h(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, 0);  /* 0: round to nearest even */
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));  /* inf, NaN */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  /* rounds past 65504: inf */
    if (ax < 0x38800000u) {  /* below fp16's smallest normal: a subnormal (or 0) */
        if (ax < 0x33000000u) return (uint16_t)sign;
        const uint32_t e = ax >> 23, man = (ax & 0x7fffffu) | 0x800000u, shift = 126 - e;
        uint32_t h = man >> shift;
        const uint32_t rest = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((ax - 0x38000000u) >> 13);
    const uint32_t rest = ax & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1))) h++;
    return (uint16_t)(sign | h);
#endif
}

/* The fp16 at p (any alignment) as fp32 */
static inline float tkv_h2f_at(const void *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return tkv_h2f(h);
}

/* GGUF's IQ4_NL levels, int4 rows' 16 values before their group's scale (kv_format.py: IQ4_NL): integers, so both
 * a float table (kv_cpu.c) and a byte table for shuffles (attention_cpu.c) take them */
#define TKV_IQ4_LEVELS {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113}

/* The KV cache's formats (kernels/kv_format.py: KVFormat.code). A row is one token's D values of one KV head:
 * fp32, bf16, fp16 values; int8: D codes, then an fp16 scale; int4: the row turned (tkv_kv_rotates), then D / 2
 * bytes (byte j: value j in its low nibble, value j + D/2 in its high one) and an fp16 scale per group of 32
 * values (or one for the row where 32 does not divide D), x = TKV_IQ4_LEVELS[code] * scale (kv_cpu.c). */
enum { TKV_KV_F32 = 0, TKV_KV_BF16 = 1, TKV_KV_F16 = 2, TKV_KV_I8 = 3, TKV_KV_I4 = 4 };
int64_t tkv_kv_row_bytes(int fmt, int64_t D);  /* a row's bytes in format fmt, 0 where it cannot hold D values */
#define TKV_KV_MAX_D 256                          /* the longest row the store takes (attention's ATT_MAX_D) */
/* Whether format fmt stores rows of D values turned by the orthonormal Walsh-Hadamard transform (int4, D a power
 * of two), and the transform itself, in place (its own inverse; the same bits as kv_format.py's hadamard) */
int tkv_kv_rotates(int fmt, int64_t D);
void tkv_hadamard(float *x, int64_t D);
/* n stored rows (row i at src + i * stride bytes) as fp32 rows D apart in dst */
void tkv_kv_rows(const uint8_t *src, int fmt, int64_t stride, int64_t n, int64_t D, float *dst);
/* one row of D values stored in format fmt at dst, as kv_format.py's encode writes it, bit for bit */
void tkv_kv_store(const float *x, int fmt, int64_t D, uint8_t *dst);
/* T tokens' K and V [T, H, D] (tokens k_stride / v_stride floats apart, heads D) stored at their slots (slot < 0:
 * not stored) into caches of rows of rb bytes (slot * H + h), K in format fmt & 15, V in fmt >> 4: the eager
 * forward's store on CPU (quant_ops.cpp: store_kv_rows) */
void tkv_kv_store_tokens(const float *k, const float *v, int64_t T, int64_t H, int64_t D, int64_t k_stride,
                         int64_t v_stride, const int64_t *slots, uint8_t *kc, uint8_t *vc, int64_t rb, int fmt);
/* n rows of rb bytes in format fmt as their D values (int4 turned back): what the torch references read */
void tkv_kv_values(const uint8_t *rows, int64_t n, int64_t rb, int fmt, int64_t D, float *out);

/* Decode attention for rows of one sequence inside a parallel region (attention_cpu.c: tkv_paged_decode's work):
 * tkv_attention_splits says how many items a row's positions are split into (the same for every layer of a
 * step); tkv_attention_together how many of R rows (lens[r] positions each, one table), from the first, can go
 * together: the same splits, each split's chunks of positions read once for all of them, every row's arithmetic
 * what it would be alone (at most TKV_ATT_MAX_ROWS); tkv_attention_share runs them, every thread calling it, row r's
 * query at q + r * qs and its output at out + r * Hq * D; `parts` holds tkv_attention_parts floats.
 * tkv_attention_fits: 0 for heads the kernel does not take (Hq not a multiple of Hkv, too many query heads a KV
 * head, too large a head). */
#define TKV_ATT_MAX_ROWS 64
int tkv_attention_fits(int64_t Hq, int64_t D, int64_t bs, int64_t Hkv);
int64_t tkv_attention_splits(int64_t len, int threads);
/* The thread count splits are chosen for: the one set (tkv_set_split_threads, > 0), else the running team's */
int tkv_split_threads(void);
void tkv_set_split_threads(int threads);
int64_t tkv_attention_together(const int32_t *lens, int64_t R, int64_t bs, int threads);
int64_t tkv_attention_parts(int64_t rows, int64_t splits, int64_t Hq, int64_t D);  /* the floats `parts` holds */
/* kc, vc: the caches' bytes, rows of rb bytes (kv_heads rows a token); fmt: K's format | V's format << 4 */
void tkv_attention_share(const float *q, int64_t qs, int64_t R, int64_t Hq, int64_t D, const void *kc, const void *vc,
                         int fmt, int64_t rb, int64_t bs, int64_t Hkv, const int32_t *table, const int32_t *lens,
                         float scale, int64_t splits, float *parts, float *out);

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
