/* Many activation rows times a 4-bit or 8-bit weight (prefill, long verification chunks, batched steps): the
 * products on int8 arithmetic, where the one-row kernels (quant_cpu.c) multiply int16 activations weight row by
 * weight row.
 *
 * The activations are quantized to int8 in blocks of 32 inputs, each with its scale and its codes' sum as rounded
 * (cpu_kernels.h: tkv_int8_rows, GGUF's Q8_1 blocks, as llama.cpp multiplies its quantized blocks with). The
 * weight's codes are unpacked, 16 output rows at a time, into a panel in the calling thread's cache, one byte a
 * code (q4: 0..15; q8: the signed code, plus 128 where VNNI multiplies):
 *   panel[b][c][r][j]: block b of 32 inputs, chunk c (0..7) of 4 inputs, output row r (0..15), input 4 c + j,
 * so that one 32-byte load holds 4 inputs of 8 rows and vpmaddubsw multiplies them by 4 activations broadcast to
 * every row, their sums side by side (no sum across a register's lanes). One panel serves every activation row
 * (its 16 x K bytes stay in L1/L2 while the rows stream past). vpmaddubsw takes one operand unsigned: q4's codes
 * are; for q8 it multiplies |w| by the activations with w's sign (vpsignb), exact for every code (-128 included).
 * q4's int16 sums of a block cannot overflow: a pair of products is at most 2 x 15 x 127 = 3810, eight chunks
 * 30480 < 32767; q8's pairs (up to 2 x 128 x 127) go to int32 at once (vpmaddwd). Each block's sums are scaled in
 * fp32 by the weight group's scale times the block's scale, and the group's offset multiplies the block's sum:
 *   out[i][n] = sum_b d[n][g(b)] sx[i][b] sum_k q[n][k] xq[i][k] + m[n][g(b)] xs[i][b]   (+ bias[n]).
 * Arithmetic for the 64 multiply-adds of a 4-input chunk of 16 rows (one activation row): q4 2 vpmaddubsw + 2
 * vpaddw, q8 2 vpsignb, 2 vpmaddubsw, 2 vpmaddwd and 2 vpaddd; fp32 takes 8 FMAs (AVX2), and the dequantized product
 * must first write the fp32 weight.
 *
 * Where the processor has AVX-512 VNNI (and BW) the same panel serves 512-bit registers: one 64-byte load holds 4
 * inputs of all 16 rows, and vpdpbusd multiplies them by 4 activations broadcast to every row and adds the products
 * to the rows' int32 sums in one instruction (those 64 multiply-adds: AVX2's 4 instructions, q8's 8). vpdpbusd
 * takes the weight's side unsigned: q4's codes are; q8's are held in the panel plus 128 (as q8t's tiles hold them
 * already), and 128 times the activation block's code sum (tkv_int8_rows.qs) starts each sum below zero, so the
 * int32 sums equal AVX2's exactly and the fp32 steps after them are the same: both builds give the same bits.
 *
 * Without AVX2 nothing here serves: tkv_quant_gemm_native returns 0 and kernels/quant.py dequantizes into the fp32
 * product instead (plain C int8 is slower than that). The same arithmetic in torch is kernels/quant.py's
 * as_int8_blocks times the dequantized weight, which the tests hold this kernel to. */

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_kernels.h"

#define PANEL_ROWS 16
#define BLOCK 32
#define PANEL_BLOCK (BLOCK * PANEL_ROWS)  /* bytes of one block of a panel */
#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define GEMM_VNNI 1
#define Q8_PANEL_BIAS 128  /* q8 codes as the panel holds them: plus 128, unsigned for vpdpbusd */
#else
#define Q8_PANEL_BIAS 0
#endif

/* What the products of many rows run on in this build: 0 nothing (dequantize instead), 1 AVX2, 2 AVX-512 VNNI */
int tkv_quant_gemm_native(void) {
#if defined(GEMM_VNNI)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

/* 8 registers of 8 dwords (row r's dwords 0..7 in v[r]) transposed in place: v[c] then holds dword c of rows 0..7 */
INLINE void transpose8(__m256i *v) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);      /* r_i d0, r_i+1 d0, r_i d1, r_i+1 d1 | d4, d5 */
        t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);  /* d2, d3 | d6, d7 */
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);          /* 4 rows' d0 | d4 */
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);      /* d1 | d5 */
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);  /* d2 | d6 */
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);  /* d3 | d7 */
    }
    for (int c = 0; c < 4; c++) {
        v[c] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x20);
        v[c + 4] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x31);
    }
}

/* The 32 codes (0..15, one a byte, in input order) of block b of a q4 row (quant_cpu.c's layout: in each group
 * of g inputs, byte j holds input j low and input j + g/2 high) */
INLINE __m256i row_block_codes(const uint8_t *qr, int64_t g, int64_t b) {
    const __m256i low = _mm256_set1_epi8(15);
    const int64_t start = b * BLOCK, h = g / 2, o = start % g;
    const uint8_t *grp = qr + start / g * h;
    if (g == BLOCK) {
        const __m128i v = _mm_loadu_si128((const __m128i *)grp);
        return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low);
    }
    const __m256i v = _mm256_loadu_si256((const __m256i *)(grp + (o < h ? o : o - h)));
    return _mm256_and_si256(o < h ? v : _mm256_srli_epi16(v, 4), low);
}

/* Output rows n0..n0+15 of a row-major q4 weight [N, K] into a panel (rows past N repeat row N - 1, their
 * outputs never stored), and their scales and offsets as fp32 [G][16] */
static void pack_rows(const int bits, const uint8_t *q, const uint16_t *d, const uint16_t *mn, int64_t g, int64_t N,
                      int64_t K, int64_t n0, uint8_t *panel, float *pd, float *pm) {
    const int64_t B = K / BLOCK, G = K / g;
    const uint8_t *rows[PANEL_ROWS];
    const __m256i bias = _mm256_set1_epi8((char)Q8_PANEL_BIAS);
    for (int r = 0; r < PANEL_ROWS; r++) rows[r] = q + (n0 + r < N ? n0 + r : N - 1) * (bits == 4 ? K / 2 : K);
    for (int64_t b = 0; b < B; b++)
        for (int half = 0; half < 2; half++) {
            __m256i v[8];
            for (int r = 0; r < 8; r++)
                v[r] = bits == 4 ? row_block_codes(rows[half * 8 + r], g, b)
                                 : _mm256_xor_si256(
                                       _mm256_loadu_si256((const __m256i *)(rows[half * 8 + r] + b * BLOCK)), bias);
            transpose8(v);
            for (int c = 0; c < 8; c++)
                _mm256_storeu_si256((__m256i *)(panel + b * PANEL_BLOCK + c * 64 + half * 32), v[c]);
        }
    for (int r = 0; r < PANEL_ROWS; r++) {
        const int64_t row = n0 + r < N ? n0 + r : N - 1;
        for (int64_t gi = 0; gi < G; gi++) {
            pd[gi * PANEL_ROWS + r] = tkv_h2f(d[row * G + gi]);
            pm[gi * PANEL_ROWS + r] = mn ? tkv_h2f(mn[row * G + gi]) : 0.f;
        }
    }
}

/* Tile t of a q4t or q8t weight into a panel. q4t (quant_cpu.c: byte 4r + j of chunk c holds row r's input
 * 8c + j low, 8c + 4 + j high): two chunks of the panel from each of the tile's; q8t (byte 4r + j of chunk c:
 * row r's code of input 4c + j plus 128): the panel's layout already, the codes back to signed bytes (AVX2) or
 * as they are (VNNI: the panel's plus 128) */
static void pack_tile(const int bits, const uint8_t *q, const uint16_t *d, const uint16_t *mn, int64_t g, int64_t K,
                      int64_t t, uint8_t *panel, float *pd, float *pm) {
    const __m256i low = _mm256_set1_epi8(15), flip = _mm256_set1_epi8((char)(0x80 ^ Q8_PANEL_BIAS));
    const int64_t G = K / g, chunks = bits == 4 ? K / 8 : K / 4;
    const uint8_t *tc = q + t * chunks * 64;
    for (int64_t c = 0; c < chunks; c++)
        for (int half = 0; half < 2; half++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(tc + c * 64 + half * 32));
            if (bits == 8) {
                _mm256_storeu_si256((__m256i *)(panel + c * 64 + half * 32), _mm256_xor_si256(v, flip));
                continue;
            }
            _mm256_storeu_si256((__m256i *)(panel + 2 * c * 64 + half * 32), _mm256_and_si256(v, low));
            _mm256_storeu_si256((__m256i *)(panel + (2 * c + 1) * 64 + half * 32),
                                _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
        }
    for (int64_t i = 0; i < G * PANEL_ROWS; i++) {
        pd[i] = tkv_h2f(d[t * G * PANEL_ROWS + i]);
        pm[i] = mn ? tkv_h2f(mn[t * G * PANEL_ROWS + i]) : 0.f;
    }
}

/* MR activation rows (int8 blocks xq [MR][K], their scales sx and scaled sums xs [MR][B]) times a panel: the 16
 * outputs of each row into o[MR][16]. The int16 sums of a block stay in registers (8 of the 16 for MR = 4; the
 * compiler keeps some fp32 sums on the stack, touched once a block). Four rows at a time: the panel's loads and
 * its scales shared by more rows; measured beside three and two (AMD EPYC Zen 3, 2 threads, the default model's
 * shapes): 1.0-1.15x their rate, within this machine's noise for some shapes. */
INLINE void panel_rows(const int bits, const int mr, const uint8_t *panel, const float *pd, const float *pm, int64_t K,
                       int64_t gb,
                       const int8_t *xq, const float *sx, const float *xs, float *o) {
    const int64_t B = K / BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 f[4][2];
    for (int i = 0; i < mr; i++) f[i][0] = f[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0, left = gb; b < B; b++) {  /* left: the blocks left in the weight's group (no division) */
        const uint8_t *pb = panel + b * PANEL_BLOCK;
        __m256i s[4][2];
        for (int i = 0; i < mr; i++) s[i][0] = s[i][1] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(pb + c * 64));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(pb + c * 64 + 32));
            const __m256i a0 = bits == 4 ? w0 : _mm256_abs_epi8(w0), a1 = bits == 4 ? w1 : _mm256_abs_epi8(w1);
            for (int i = 0; i < mr; i++) {
                int32_t four;
                memcpy(&four, xq + i * K + b * BLOCK + 4 * c, 4);
                const __m256i xb = _mm256_set1_epi32(four);
                if (bits == 4) {
                    s[i][0] = _mm256_add_epi16(s[i][0], _mm256_maddubs_epi16(w0, xb));
                    s[i][1] = _mm256_add_epi16(s[i][1], _mm256_maddubs_epi16(w1, xb));
                } else {  /* |w| x (x signed as w): pairs of at most 2 x 128 x 127, summed in 32 bits at once */
                    const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0));
                    const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1));
                    s[i][0] = _mm256_add_epi32(s[i][0], _mm256_madd_epi16(p0, ones));
                    s[i][1] = _mm256_add_epi32(s[i][1], _mm256_madd_epi16(p1, ones));
                }
            }
        }
        const __m256 d0 = _mm256_loadu_ps(pd), d1 = _mm256_loadu_ps(pd + 8);
        const __m256 m0 = _mm256_loadu_ps(pm), m1 = _mm256_loadu_ps(pm + 8);
        if (--left == 0) {
            pd += PANEL_ROWS, pm += PANEL_ROWS;
            left = gb;
        }
        for (int i = 0; i < mr; i++) {
            const __m256 scale = _mm256_set1_ps(sx[i * B + b]), sum = _mm256_set1_ps(xs[i * B + b]);
            const __m256i s0 = bits == 4 ? _mm256_madd_epi16(s[i][0], ones) : s[i][0];
            const __m256i s1 = bits == 4 ? _mm256_madd_epi16(s[i][1], ones) : s[i][1];
            f[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d0, scale),
                                      _mm256_fmadd_ps(m0, sum, f[i][0]));
            f[i][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d1, scale),
                                      _mm256_fmadd_ps(m1, sum, f[i][1]));
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_ps(o + i * PANEL_ROWS, f[i][0]);
        _mm256_storeu_ps(o + i * PANEL_ROWS + 8, f[i][1]);
    }
}

#define MR 4

/* panel_rows for each width of codes and each count of rows, each inlined with its constants */
#define ROWS_OF(name, bits)                                                                                       \
    static void name(int mr, const uint8_t *panel, const float *pd, const float *pm, int64_t K, int64_t gb,     \
                     const int8_t *xq, const float *sx, const float *xs, float *o) {                            \
        if (mr == 4) panel_rows(bits, 4, panel, pd, pm, K, gb, xq, sx, xs, o);                                 \
        else if (mr == 3) panel_rows(bits, 3, panel, pd, pm, K, gb, xq, sx, xs, o);                            \
        else if (mr == 2) panel_rows(bits, 2, panel, pd, pm, K, gb, xq, sx, xs, o);                            \
        else panel_rows(bits, 1, panel, pd, pm, K, gb, xq, sx, xs, o);                                         \
    }
#ifdef GEMM_VNNI
#define MR512 8

/* A group of MR512 activation rows' int8 blocks side by side (tkv_quant_gemm lays each group out once, from
 * tkv_int8_rows): per block of 32 inputs, its 8 chunks' 4-byte words of the MR512 rows ([B][8][MR512] int32), then
 * the rows' scales, scaled sums and code sums ([B][MR512] each); rows past the group's end are zeros. One pointer
 * and constant offsets reach every row (with a pointer a row, GCC kept some of the 8 in vector registers and moved
 * them back for every broadcast) */
typedef struct { const int32_t *x; const float *sx, *xs; const int32_t *qs; } rows512;

static size_t rows512_bytes(int64_t K) { return (size_t)(K / BLOCK) * MR512 * (8 + 3) * sizeof(int32_t); }

static rows512 rows512_at(const char *mem, int64_t K) {
    const int64_t B = K / BLOCK;
    const int32_t *x = (const int32_t *)mem;
    const float *sx = (const float *)(x + B * 8 * MR512), *xs = sx + B * MR512;
    rows512 r = {x, sx, xs, (const int32_t *)(xs + B * MR512)};
    return r;
}

static void lay_out_rows512(const tkv_int8_rows *a, int64_t M, int64_t K, int64_t i0, char *mem) {
    const int64_t B = K / BLOCK;
    int32_t *x = (int32_t *)mem;
    float *sx = (float *)(x + B * 8 * MR512), *xs = sx + B * MR512;
    int32_t *qs = (int32_t *)(xs + B * MR512);
    for (int i = 0; i < MR512; i++) {
        const int64_t row = i0 + i;
        for (int64_t b = 0; b < B; b++) {
            for (int c = 0; c < 8; c++) {
                int32_t four = 0;
                if (row < M) memcpy(&four, a->xq + row * K + b * BLOCK + 4 * c, 4);
                x[(b * 8 + c) * MR512 + i] = four;
            }
            sx[b * MR512 + i] = row < M ? a->sx[row * B + b] : 0.f;
            xs[b * MR512 + i] = row < M ? a->xs[row * B + b] : 0.f;
            qs[b * MR512 + i] = row < M ? a->qs[row * B + b] : 0;
        }
    }
}

/* MR activation rows (a group laid out by lay_out_rows512) times a panel on 512-bit registers: row i's 16 int32
 * sums of a block in one register, which vpdpbusd adds 4 inputs of all 16 rows to at a time (q8: from -128 x the
 * block's code sum, the panel holding codes plus 128). Eight rows at a time: eight independent chains of vpdpbusd,
 * each a block (8 deep) long. The fp32 steps are panel_rows' own, in its order; the outputs go to out (row stride
 * N) with the bias added, only the panel's first `keep` (the weight's last panel may be short). */
INLINE void panel_rows512(const int bits, const int mr, const uint8_t *panel, const float *pd, const float *pm,
                          int64_t K, int64_t gb, const rows512 a, const __m512 bias, const __mmask16 keep, int64_t N,
                          float *out) {
    const int64_t B = K / BLOCK;
    __m512 f[MR512];
    for (int i = 0; i < mr; i++) f[i] = _mm512_setzero_ps();
    for (int64_t b = 0, left = gb; b < B; b++) {  /* left: the blocks left in the weight's group (no division) */
        const uint8_t *pb = panel + b * PANEL_BLOCK;
        const int32_t *xb = a.x + b * 8 * MR512;
        __m512i s[MR512];
        for (int i = 0; i < mr; i++)
            s[i] = bits == 4 ? _mm512_setzero_si512() : _mm512_set1_epi32(-Q8_PANEL_BIAS * a.qs[b * MR512 + i]);
        for (int c = 0; c < 8; c++) {
            const __m512i w = _mm512_loadu_si512((const void *)(pb + c * 64));
            for (int i = 0; i < mr; i++) s[i] = _mm512_dpbusd_epi32(s[i], w, _mm512_set1_epi32(xb[c * MR512 + i]));
        }
        const __m512 d = _mm512_loadu_ps(pd), m = _mm512_loadu_ps(pm);
        for (int i = 0; i < mr; i++) {
            const __m512 scale = _mm512_set1_ps(a.sx[b * MR512 + i]), sum = _mm512_set1_ps(a.xs[b * MR512 + i]);
            f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(d, scale), _mm512_fmadd_ps(m, sum, f[i]));
        }
        if (--left == 0) {
            pd += PANEL_ROWS, pm += PANEL_ROWS;
            left = gb;
        }
    }
    for (int i = 0; i < mr; i++) _mm512_mask_storeu_ps(out + i * N, keep, _mm512_add_ps(f[i], bias));
}

#define ROWS512_OF(name, bits)                                                                                    \
    static void name(int mr, const uint8_t *panel, const float *pd, const float *pm, int64_t K, int64_t gb,     \
                     const rows512 a, __m512 bias, __mmask16 keep, int64_t N, float *out) {                    \
        switch (mr) {                                                                                          \
            case 8: panel_rows512(bits, 8, panel, pd, pm, K, gb, a, bias, keep, N, out); break;                \
            case 7: panel_rows512(bits, 7, panel, pd, pm, K, gb, a, bias, keep, N, out); break;                \
            case 6: panel_rows512(bits, 6, panel, pd, pm, K, gb, a, bias, keep, N, out); break;                \
            case 5: panel_rows512(bits, 5, panel, pd, pm, K, gb, a, bias, keep, N, out); break;                \
            case 4: panel_rows512(bits, 4, panel, pd, pm, K, gb, a, bias, keep, N, out); break;                \
            case 3: panel_rows512(bits, 3, panel, pd, pm, K, gb, a, bias, keep, N, out); break;                \
            case 2: panel_rows512(bits, 2, panel, pd, pm, K, gb, a, bias, keep, N, out); break;                \
            default: panel_rows512(bits, 1, panel, pd, pm, K, gb, a, bias, keep, N, out);                      \
        }                                                                                                      \
    }
ROWS512_OF(rows512_of_4bit, 4)
ROWS512_OF(rows512_of_8bit, 8)
#define ROWS_AT_ONCE MR512
#else
ROWS_OF(rows_of_4bit, 4)
ROWS_OF(rows_of_8bit, 8)
#define ROWS_AT_ONCE MR
#endif

/* The M activation rows times one panel (tile t of the weight), into out's columns of the tile (groups: the rows
 * laid out for the 512-bit kernel, rows512_bytes(K) a group of MR512) */
static void panel_times_rows(const int bits, const uint8_t *panel, const float *pd, const float *pm, int64_t K,
                             int64_t gb, const tkv_int8_rows *a, const char *groups, int64_t M, int64_t N, int64_t t,
                             const float *bias, float *out) {
    const int rows = N - t * PANEL_ROWS < PANEL_ROWS ? (int)(N - t * PANEL_ROWS) : PANEL_ROWS;
    const float *tb = bias ? bias + t * PANEL_ROWS : NULL;
#ifdef GEMM_VNNI
    const __mmask16 keep = (__mmask16)((1u << rows) - 1);
    const __m512 vb = tb ? _mm512_maskz_loadu_ps(keep, tb) : _mm512_setzero_ps();
    (void)a;
#else
    const int64_t B = K / BLOCK;
    float o[MR * PANEL_ROWS];
    (void)groups;
#endif
    for (int64_t i = 0; i < M; i += ROWS_AT_ONCE) {
        const int mr = M - i < ROWS_AT_ONCE ? (int)(M - i) : ROWS_AT_ONCE;
#ifdef GEMM_VNNI
        const rows512 group = rows512_at(groups + (size_t)(i / MR512) * rows512_bytes(K), K);
        (bits == 4 ? rows512_of_4bit : rows512_of_8bit)(mr, panel, pd, pm, K, gb, group, vb, keep, N,
                                                        out + i * N + t * PANEL_ROWS);
#else
        const int8_t *xq = a->xq + i * K;
        const float *sx = a->sx + i * B, *xs = a->xs + i * B;
        (bits == 4 ? rows_of_4bit : rows_of_8bit)(mr, panel, pd, pm, K, gb, xq, sx, xs, o);
        for (int j = 0; j < mr; j++)
            for (int r = 0; r < rows; r++)
                out[(i + j) * N + t * PANEL_ROWS + r] = o[j * PANEL_ROWS + r] + (tb ? tb[r] : 0.f);
#endif
    }
}
#endif

/* Bytes of scratch tkv_quant_gemm takes for M rows of K inputs with groups of g, `threads` threads (and, for the
 * 512-bit kernel, the rows laid out a group at a time after the panels: *groups_at) */
static size_t gemm_bytes(int64_t M, int64_t K, int64_t g, int threads, size_t *panel_bytes, size_t *groups_at) {
    *panel_bytes = ((size_t)K * PANEL_ROWS + 2 * (size_t)(K / g) * PANEL_ROWS * sizeof(float) + 63) & ~(size_t)63;
    *groups_at = tkv_int8_blocks_bytes(M, K) + (size_t)threads * *panel_bytes;
#ifdef GEMM_VNNI
    return *groups_at + (size_t)((M + MR512 - 1) / MR512) * rows512_bytes(K);
#else
    return *groups_at;
#endif
}

/* out [M, N] = x [M, K] @ W^T (+ bias) for a q4 (bits 4) or q8 (bits 8) weight (tiled: q4t / q8t tiles, else
 * row-major), groups of g inputs (a multiple of 32), offsets mn or NULL, on int8 activation blocks. Returns 0; -1
 * without AVX2, when the shapes do not fit (K or g not whole blocks of 32, a tiled N not whole tiles) or scratch
 * memory cannot be had. */
int tkv_quant_gemm(const float *x, int64_t M, int64_t K, const uint8_t *q, int bits, int tiled, const uint16_t *d,
                   const uint16_t *mn, int64_t g, int64_t N, const float *bias, float *out) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (K % BLOCK || g % BLOCK || K % g || M < 1 || (tiled && N % PANEL_ROWS)) return -1;
#ifdef _OPENMP
    const int threads = omp_get_max_threads();
#else
    const int threads = 1;
#endif
    size_t panel_bytes, groups_at;
    char *mem = tkv_scratch(gemm_bytes(M, K, g, threads, &panel_bytes, &groups_at));
    if (!mem) return -1;
    const tkv_int8_rows a = tkv_int8_blocks_at(mem, M, K);
    char *panels = mem + tkv_int8_blocks_bytes(M, K);
    const int64_t G = K / g, T = (N + PANEL_ROWS - 1) / PANEL_ROWS;
    #pragma omp parallel
    {
#ifdef _OPENMP
        uint8_t *panel = (uint8_t *)(panels + (size_t)omp_get_thread_num() * panel_bytes);
#else
        uint8_t *panel = (uint8_t *)panels;
#endif
        float *pd = (float *)(panel + (size_t)K * PANEL_ROWS), *pm = pd + G * PANEL_ROWS;
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i++) tkv_int8_blocks_row(x, K, &a, i);
#ifdef GEMM_VNNI
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i += MR512) lay_out_rows512(&a, M, K, i, mem + groups_at + (size_t)(i / MR512) *
                                                                           rows512_bytes(K));
#endif
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (tiled)
                pack_tile(bits, q, d, mn, g, K, t, panel, pd, pm);
            else
                pack_rows(bits, q, d, mn, g, N, K, t * PANEL_ROWS, panel, pd, pm);
            panel_times_rows(bits, panel, pd, pm, K, g / BLOCK, &a, mem + groups_at, M, N, t, bias, out);
        }
    }
    return 0;
#else
    (void)x; (void)M; (void)K; (void)q; (void)bits; (void)tiled; (void)d; (void)mn; (void)g; (void)N; (void)bias;
    (void)out;
    (void)gemm_bytes;
    return -1;
#endif
}
