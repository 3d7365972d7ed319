/* The KV cache's rows in their stored formats (cpu_kernels.h: TKV_KV_*; kernels/kv_format.py is the torch
 * reference): read a few rows at a time into fp32 where attention takes them (attention_cpu.c widens a chunk of at
 * most 32 rows of one KV head into a buffer that stays in L1; int8 and int4 rows on AVX2 it reads from their
 * codes), and written one row at a time by the native decode step (decode_cpu.c). The store rounds as torch does
 * (scale to fp16 first, codes from the rounded scale, ties to even), so a row written here is the row the torch
 * store writes. Built into the library of quant_cpu.c. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KV_AVX2 1
#if defined(__AVX512F__)
#define KV_AVX512 1
#endif
#endif

/* Values one int4 scale covers: 32, or the whole row where 32 does not divide D (kv_format.py: int4_group) */
static inline int64_t i4_group(int64_t D) {
    return D % 32 == 0 ? 32 : D;
}

/* GGUF's IQ4_NL levels: a 4-bit code's value, times its group's scale (kv_format.py: IQ4_NL) */
static const float iq4_levels[16] = TKV_IQ4_LEVELS;

int64_t tkv_kv_row_bytes(int fmt, int64_t D) {
    switch (fmt) {
    case TKV_KV_F32: return 4 * D;
    case TKV_KV_BF16: case TKV_KV_F16: return 2 * D;
    case TKV_KV_I8: return D + 2;
    case TKV_KV_I4: return D % 4 == 0 ? D / 2 + 2 * (D / i4_group(D)) : 0;
    default: return 0;
    }
}

int tkv_kv_rotates(int fmt, int64_t D) {
    return fmt == TKV_KV_I4 && D > 0 && (D & (D - 1)) == 0;
}

void tkv_hadamard(float *x, int64_t D) {
    for (int64_t h = 1; h < D; h *= 2)
        for (int64_t i = 0; i < D; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    const float scale = (float)(1.0 / sqrt((double)D));
    for (int64_t d = 0; d < D; d++) x[d] *= scale;
}

static inline uint16_t load16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

static void bf16_row(const uint8_t *src, int64_t D, float *dst) {
    int64_t d = 0;
#ifdef KV_AVX512
    for (; d + 16 <= D; d += 16) {
        const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + 2 * d)));
        _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    }
#endif
#ifdef KV_AVX2
    for (; d + 8 <= D; d += 8) {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 2 * d)));
        _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
#endif
    for (; d < D; d++) {
        const uint32_t u = (uint32_t)load16(src + 2 * d) << 16;
        memcpy(dst + d, &u, 4);
    }
}

static void f16_row(const uint8_t *src, int64_t D, float *dst) {
    int64_t d = 0;
#ifdef KV_AVX512
    for (; d + 16 <= D; d += 16)
        _mm512_storeu_ps(dst + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 2 * d))));
#endif
#ifdef KV_AVX2
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * d))));
#endif
    for (; d < D; d++) dst[d] = tkv_h2f_at(src + 2 * d);
}

static void i8_row(const uint8_t *src, int64_t D, float *dst) {
    const float s = tkv_h2f_at(src + D);
    int64_t d = 0;
#ifdef KV_AVX512
    const __m512 ws = _mm512_set1_ps(s);
    for (; d + 16 <= D; d += 16) {
        const __m512i c = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + d)));
        _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_cvtepi32_ps(c), ws));
    }
#endif
#ifdef KV_AVX2
    const __m256 vs = _mm256_set1_ps(s);
    for (; d + 8 <= D; d += 8) {
        const __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + d)));
        _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtepi32_ps(c), vs));
    }
#endif
    for (; d < D; d++) dst[d] = (float)(int8_t)src[d] * s;
}

/* An int4 row, still turned (attention turns the query instead): IQ4_NL's level of the code times the scale of the
 * code's group. The row's few scales are converted once, and a value's group found by a shift (its groups are 32
 * values, or the whole row): a conversion, then a division, for every 16 values made int4 rows 1.3-1.5x int8's
 * time to read. The levels are a table in a register: one permute of 16 (AVX-512), two of 8 and a blend (AVX2). */
static void i4_row(const uint8_t *src, int64_t D, float *dst) {
    const int64_t half = D / 2, whole = i4_group(D) == D;
    float sc[TKV_KV_MAX_D / 32 + 1];
    for (int64_t k = 0; k < (whole ? 1 : D / 32) && k <= TKV_KV_MAX_D / 32; k++)
        sc[k] = tkv_h2f_at(src + half + 2 * k);
#define I4_SCALE(i) sc[whole ? 0 : (i) >> 5]
    int64_t j = 0;
#ifdef KV_AVX512
    const __m512i low16 = _mm512_set1_epi32(15);
    const __m512 lut16 = _mm512_loadu_ps(iq4_levels);
    if (whole || half % 16 == 0)
        for (; j + 16 <= half; j += 16) {  /* 16 values of one group in each half */
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + j)));
            const __m512 lo = _mm512_set1_ps(I4_SCALE(j)), hi = _mm512_set1_ps(I4_SCALE(half + j));
            _mm512_storeu_ps(dst + j, _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(b, low16), lut16), lo));
            _mm512_storeu_ps(dst + half + j,
                             _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut16), hi));
        }
#endif
#ifdef KV_AVX2
    const __m256i low = _mm256_set1_epi32(15);
    const __m256 lut_lo = _mm256_loadu_ps(iq4_levels), lut_hi = _mm256_loadu_ps(iq4_levels + 8);
    if (whole || half % 8 == 0)
        for (; j + 8 <= half; j += 8) {
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + j)));
            const __m256i cl = _mm256_and_si256(b, low), ch = _mm256_srli_epi32(b, 4);
            /* codes 8..15 from the upper table: bit 3 of the code moved to the sign bit picks it */
            const __m256 vl = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut_lo, cl),
                                               _mm256_permutevar8x32_ps(lut_hi, cl),
                                               _mm256_castsi256_ps(_mm256_slli_epi32(cl, 28)));
            const __m256 vh = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut_lo, ch),
                                               _mm256_permutevar8x32_ps(lut_hi, ch),
                                               _mm256_castsi256_ps(_mm256_slli_epi32(ch, 28)));
            _mm256_storeu_ps(dst + j, _mm256_mul_ps(vl, _mm256_set1_ps(I4_SCALE(j))));
            _mm256_storeu_ps(dst + half + j, _mm256_mul_ps(vh, _mm256_set1_ps(I4_SCALE(half + j))));
        }
#endif
    for (; j < half; j++) {
        dst[j] = iq4_levels[src[j] & 15] * I4_SCALE(j);
        dst[half + j] = iq4_levels[src[j] >> 4] * I4_SCALE(half + j);
    }
#undef I4_SCALE
}

void tkv_kv_rows(const uint8_t *src, int fmt, int64_t stride, int64_t n, int64_t D, float *dst) {
    for (int64_t i = 0; i < n; i++, src += stride, dst += D) {
        switch (fmt) {
        case TKV_KV_F32: memcpy(dst, src, D * sizeof(float)); break;
        case TKV_KV_BF16: bf16_row(src, D, dst); break;
        case TKV_KV_F16: f16_row(src, D, dst); break;
        case TKV_KV_I8: i8_row(src, D, dst); break;
        default: i4_row(src, D, dst); break;
        }
    }
}

/* fp32 -> bf16 rounding to nearest even, as torch converts (a NaN stays a NaN) */
static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static inline void store16(uint8_t *p, uint16_t h) {
    memcpy(p, &h, 2);
}

/* Each value's nearest IQ4_NL level at scale s: the count of midpoints between neighbouring levels below x / s */
static void iq4_codes(const float *x, int64_t n, float s, uint8_t *codes) {
    const float inv = s != 0.f ? 1.f / s : 0.f;
    for (int64_t d = 0; d < n; d++) {
        const float v = x[d] * inv;
        uint8_t c = 0;
        for (int i = 0; i < 15; i++) c += v > 0.5f * (iq4_levels[i] + iq4_levels[i + 1]);
        codes[d] = c;
    }
}

/* A group's fp16 scale and codes, as kv_format.py's _iq4_fit: the value of most magnitude (the first, with its
 * sign) on level -127, then IQ4_FITS = 2 least-squares refits of the scale (sums in fp64, in order), the codes
 * taken again after each */
static uint16_t iq4_fit(const float *x, int64_t n, uint8_t *codes) {
    float extreme = x[0], top = fabsf(x[0]);
    for (int64_t d = 1; d < n; d++)
        if (fabsf(x[d]) > top) top = fabsf(x[d]), extreme = x[d];
    uint16_t h = tkv_f2h(extreme / -127.f + 0.f);
    for (int fit = 0; fit < 2; fit++) {
        iq4_codes(x, n, tkv_h2f(h), codes);
        double num = 0.0, den = 0.0;
        for (int64_t d = 0; d < n; d++) {
            const double level = iq4_levels[codes[d]];
            num += (double)x[d] * level;
            den += level * level;
        }
        h = tkv_f2h((float)(num / den) + 0.f);
    }
    iq4_codes(x, n, tkv_h2f(h), codes);
    return h;
}

void tkv_kv_store(const float *x, int fmt, int64_t D, uint8_t *dst) {
    if (fmt == TKV_KV_F32) {
        memcpy(dst, x, D * sizeof(float));
    } else if (fmt == TKV_KV_BF16 || fmt == TKV_KV_F16) {
        for (int64_t d = 0; d < D; d++) store16(dst + 2 * d, fmt == TKV_KV_BF16 ? f2bf(x[d]) : tkv_f2h(x[d]));
    } else if (fmt == TKV_KV_I8) {
        float top = 0.f;
        for (int64_t d = 0; d < D; d++) top = fabsf(x[d]) > top ? fabsf(x[d]) : top;
        const uint16_t h = tkv_f2h(top / 127.f);
        const float s = tkv_h2f(h), inv = s != 0.f ? 1.f / s : 0.f;
        for (int64_t d = 0; d < D; d++) {
            float c = nearbyintf(x[d] * inv);
            c = c > 127.f ? 127.f : (c < -127.f ? -127.f : c);
            dst[d] = (uint8_t)(int8_t)c;
        }
        store16(dst + D, h);
    } else {  /* int4: turned where D is a power of two, then GGUF's IQ4_NL in groups of i4_group(D) */
        const int64_t half = D / 2, g = i4_group(D);
        float t[TKV_KV_MAX_D];
        if (D > TKV_KV_MAX_D) return;
        memcpy(t, x, D * sizeof(float));
        if (tkv_kv_rotates(fmt, D)) tkv_hadamard(t, D);
        uint8_t codes[TKV_KV_MAX_D];
        for (int64_t g0 = 0; g0 < D; g0 += g) {
            const uint16_t h = iq4_fit(t + g0, g, codes + g0);
            store16(dst + half + 2 * (g0 / g), h);
        }
        for (int64_t j = 0; j < half; j++) dst[j] = (uint8_t)(codes[j] | (codes[half + j] << 4));
    }
}

void tkv_kv_store_tokens(const float *k, const float *v, int64_t T, int64_t H, int64_t D, int64_t k_stride,
                         int64_t v_stride, const int64_t *slots, uint8_t *kc, uint8_t *vc, int64_t rb, int fmt) {
    #pragma omp parallel for schedule(static) if (T * H >= 64)
    for (int64_t th = 0; th < T * H; th++) {
        const int64_t t = th / H, h = th % H;
        if (slots[t] < 0) continue;  /* a padding token */
        const int64_t at = (slots[t] * H + h) * rb;
        tkv_kv_store(k + t * k_stride + h * D, fmt & 15, D, kc + at);
        tkv_kv_store(v + t * v_stride + h * D, fmt >> 4, D, vc + at);
    }
}

void tkv_kv_values(const uint8_t *rows, int64_t n, int64_t rb, int fmt, int64_t D, float *out) {
    #pragma omp parallel for schedule(static) if (n >= 256)
    for (int64_t i = 0; i < n; i++) {
        tkv_kv_rows(rows + i * rb, fmt, rb, 1, D, out + i * D);
        if (tkv_kv_rotates(fmt, D)) tkv_hadamard(out + i * D, D);
    }
}
