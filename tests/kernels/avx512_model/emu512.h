/* A software model of the 512-bit intrinsics quant_cpu.c's int4 kernels for groups of 32 use (q4_pair, q4_block512,
 * q4_row512) and gemm_cpu.c's VNNI products of many rows (panel_rows512), each lane as the instruction defines it
 * (fma, int32 conversion to nearest even, wrapping int32 adds, vpdpbusd's unsigned x signed bytes), so that the
 * kernels' 512-bit paths run, and are checked, on a processor without AVX-512 (tests/kernels/test_quant.py). The
 * 256-bit intrinsics they also use are the real ones. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
typedef struct { float f[16]; } e512;
typedef struct { union { int8_t b[64]; uint8_t ub[64]; int16_t h[32]; int32_t w[16]; }; } e512i;
typedef struct { double d[8]; } e512d;
#define __m512 e512
#define __m512i e512i
#define __m512d e512d
static inline e512i e_cvtepu8_epi16(__m256i x) { uint8_t t[32]; e512i r; memcpy(t, &x, 32); for (int i = 0; i < 32; i++) r.h[i] = t[i]; return r; }
static inline e512i e_and(e512i a, e512i b) { e512i r; for (int i = 0; i < 16; i++) r.w[i] = a.w[i] & b.w[i]; return r; }
static inline e512i e_set1_epi16(int16_t v) { e512i r; for (int i = 0; i < 32; i++) r.h[i] = v; return r; }
static inline e512i e_srli_epi16(e512i a, int n) { e512i r; for (int i = 0; i < 32; i++) r.h[i] = (int16_t)((uint16_t)a.h[i] >> n); return r; }
static inline e512i e_madd_epi16(e512i a, e512i b) { e512i r; for (int i = 0; i < 16; i++) r.w[i] = (int32_t)((uint32_t)((int32_t)a.h[2*i] * b.h[2*i]) + (uint32_t)((int32_t)a.h[2*i+1] * b.h[2*i+1])); return r; }
static inline e512i e_add_epi32(e512i a, e512i b) { e512i r; for (int i = 0; i < 16; i++) r.w[i] = (int32_t)((uint32_t)a.w[i] + (uint32_t)b.w[i]); return r; }
static inline e512i e_setzero_si512(void) { e512i r; memset(&r, 0, 64); return r; }
static inline e512i e_loadu_si512(const void *p) { e512i r; memcpy(&r, p, 64); return r; }
static inline e512 e_fmadd_ps(e512 a, e512 b, e512 c) { e512 r; for (int i = 0; i < 16; i++) r.f[i] = fmaf(a.f[i], b.f[i], c.f[i]); return r; }
static inline e512 e_cvtepi32_ps(e512i a) { e512 r; for (int i = 0; i < 16; i++) r.f[i] = (float)a.w[i]; return r; }
static inline e512 e_setzero_ps(void) { e512 r; memset(&r, 0, 64); return r; }
static inline e512i e_set1_epi32(int32_t v) { e512i r; for (int i = 0; i < 16; i++) r.w[i] = v; return r; }
static inline e512i e_setr_epi32(int a0,int a1,int a2,int a3,int a4,int a5,int a6,int a7,int a8,int a9,int a10,int a11,int a12,int a13,int a14,int a15) {
    e512i r; int v[16] = {a0,a1,a2,a3,a4,a5,a6,a7,a8,a9,a10,a11,a12,a13,a14,a15}; for (int i = 0; i < 16; i++) r.w[i] = v[i]; return r; }
static inline e512 e_castps256_ps512(__m256 a) { e512 r; memset(&r, 0x7f, 64); memcpy(r.f, &a, 32); return r; }  /* upper lanes: garbage */
static inline e512 e_permutexvar_ps(e512i idx, e512 v) { e512 r; for (int i = 0; i < 16; i++) r.f[i] = v.f[idx.w[i] & 15]; return r; }
static inline __m256 e_castps512_ps256(e512 v) { __m256 r; memcpy(&r, v.f, 32); return r; }
static inline e512d e_castps_pd(e512 v) { e512d r; memcpy(&r, &v, 64); return r; }
static inline __m256d e_extractf64x4_pd(e512d v, int hi) { __m256d r; memcpy(&r, v.d + 4 * hi, 32); return r; }
#undef _mm512_cvtepu8_epi16
#define _mm512_cvtepu8_epi16 e_cvtepu8_epi16
#undef _mm512_and_si512
#define _mm512_and_si512 e_and
#undef _mm512_set1_epi16
#define _mm512_set1_epi16 e_set1_epi16
#undef _mm512_srli_epi16
#define _mm512_srli_epi16 e_srli_epi16
#undef _mm512_madd_epi16
#define _mm512_madd_epi16 e_madd_epi16
#undef _mm512_add_epi32
#define _mm512_add_epi32 e_add_epi32
#undef _mm512_setzero_si512
#define _mm512_setzero_si512 e_setzero_si512
#undef _mm512_loadu_si512
#define _mm512_loadu_si512 e_loadu_si512
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps e_fmadd_ps
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps e_cvtepi32_ps
#undef _mm512_setzero_ps
#define _mm512_setzero_ps e_setzero_ps
#undef _mm512_set1_epi32
#define _mm512_set1_epi32 e_set1_epi32
#undef _mm512_setr_epi32
#define _mm512_setr_epi32 e_setr_epi32
#undef _mm512_castps256_ps512
#define _mm512_castps256_ps512 e_castps256_ps512
#undef _mm512_permutexvar_ps
#define _mm512_permutexvar_ps e_permutexvar_ps
#undef _mm512_castps512_ps256
#define _mm512_castps512_ps256 e_castps512_ps256
#undef _mm512_castps_pd
#define _mm512_castps_pd e_castps_pd
#undef _mm512_extractf64x4_pd
#define _mm512_extractf64x4_pd e_extractf64x4_pd
#undef DPWSSD
static inline e512i e_dpbusd_epi32(e512i acc, e512i u, e512i v) {
    e512i r;
    for (int i = 0; i < 16; i++) {
        int32_t s = 0;
        for (int j = 0; j < 4; j++) s += (int32_t)u.ub[4 * i + j] * v.b[4 * i + j];
        r.w[i] = (int32_t)((uint32_t)acc.w[i] + (uint32_t)s);
    }
    return r;
}
static inline e512 e_mul_ps(e512 a, e512 b) { e512 r; for (int i = 0; i < 16; i++) r.f[i] = a.f[i] * b.f[i]; return r; }
static inline e512 e_add_ps(e512 a, e512 b) { e512 r; for (int i = 0; i < 16; i++) r.f[i] = a.f[i] + b.f[i]; return r; }
static inline e512 e_loadu_ps(const float *p) { e512 r; memcpy(r.f, p, 64); return r; }
static inline e512 e_set1_ps(float v) { e512 r; for (int i = 0; i < 16; i++) r.f[i] = v; return r; }
static inline e512 e_maskz_loadu_ps(__mmask16 k, const float *p) { e512 r; for (int i = 0; i < 16; i++) r.f[i] = k >> i & 1 ? p[i] : 0.f; return r; }
static inline void e_mask_storeu_ps(float *p, __mmask16 k, e512 v) { for (int i = 0; i < 16; i++) if (k >> i & 1) p[i] = v.f[i]; }

#define _mm512_dpbusd_epi32 e_dpbusd_epi32
#define _mm512_mul_ps e_mul_ps
#define _mm512_add_ps e_add_ps
#define _mm512_loadu_ps e_loadu_ps
#define _mm512_set1_ps e_set1_ps
#define _mm512_maskz_loadu_ps e_maskz_loadu_ps
#define _mm512_mask_storeu_ps e_mask_storeu_ps

#define DPWSSD(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
