/* A batch-1 decode step of a Llama-family model whose projections are quantized (or fp32 in oneDNN's packed
 * layout: cpu_kernels.h TKV_F32P), whole in C: the embedding
 * row, every layer (norms, the q/k/v product, per-head q/k norms where the model has them, the rotary
 * embedding, the new K/V row into the paged cache, decode attention, the output product and residual, the MLP)
 * and the final norm and LM head, in one OpenMP parallel region.
 *
 * Why: at batch 1 the default model's Q4_1 products take ~2.6 ms of a 6.8 ms step on an Intel Xeon (2 cores);
 * the rest went to ~150 kernel calls a token through inductor's wrapper and torch's dispatcher (a parallel
 * region, an allocation and a dispatch each), the fused loops between them and Python, each slowed again by
 * the weights' stream evicting its working set. Here each product is a worksharing loop of the one region
 * (cpu_kernels.h: tkv_row_share), the steps between them run on one thread while the other waits at the
 * loop's barrier, and nothing is allocated: the step's buffers come from the calling thread's scratch.
 *
 * The arithmetic is the eager forward's (models/llama.py) in fp32, with the same product kernels: RMSNorm as
 * x * rsqrt(mean(x^2) + eps) times the weight, the rotary embedding's halves rotated by cos/sin of position x
 * inverse frequency, silu(gate) * up. Driven by runner/native_decode.py, which lays out the structures below. */

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_kernels.h"

#define TKV_MAX_PARTS 3  /* a fused projection whose pieces a GGUF file stores in different formats */

/* A projection: its parts' outputs side by side (one part, unless the pieces' formats differ) */
typedef struct {
    int64_t parts;
    tkv_qw part[TKV_MAX_PARTS];
} tkv_proj;

typedef struct {
    const float *attn_norm, *mlp_norm;  /* [hidden] */
    const float *q_norm, *k_norm;       /* [head_dim] each, or NULL: no per-head norms */
    const float *k_shift;               /* [kv_heads, head_dim] taken from the keys before they are stored, or NULL */
    tkv_proj qkv, o, gate_up, down;     /* q, k, v outputs side by side; gate then up */
    uint8_t *k_cache, *v_cache;         /* the layer's [blocks, block_size, kv_heads, kv_row bytes] */
} tkv_layer;

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, block_size;
    float eps, scale;                   /* the norms' epsilon, attention's 1/sqrt(head_dim) */
    const float *inv_freq;              /* [head_dim / 2] */
    const tkv_layer *layer;             /* [layers] */
    const float *final_norm;            /* [hidden] */
    tkv_proj head;                      /* the LM head, one part */
    const float *embed;                 /* [vocab, hidden] fp32, or NULL: the head's rows are the embeddings */
    int64_t kv_fmt, kv_row;             /* K's format | V's format << 4 (cpu_kernels.h: TKV_KV_*); a row's bytes */
} tkv_model;

static int proj_fits(const tkv_proj *p, int64_t in, int64_t out) {
    int64_t n = 0;
    if (p->parts < 1 || p->parts > TKV_MAX_PARTS) return 0;
    for (int64_t i = 0; i < p->parts; i++) {
        if (!tkv_row_fits(&p->part[i]) || p->part[i].K != in) return 0;
        n += p->part[i].N;
    }
    return n == out;
}

/* 1 where the kernels take every projection's shape and format, and the attention's heads */
int tkv_decode_fits(const tkv_model *m) {
    const int64_t H = m->hidden, D = m->head_dim, Hq = m->heads, Hkv = m->kv_heads, I = m->inter;
    if (m->layers < 1 || D % 2 || !tkv_attention_fits(Hq, D, m->block_size, Hkv) || m->head.parts != 1 ||
        !proj_fits(&m->head, H, m->head.part[0].N) || !tkv_kv_row_bytes((int)(m->kv_fmt & 15), D) ||
        !tkv_kv_row_bytes((int)(m->kv_fmt >> 4), D) || m->kv_row < tkv_kv_row_bytes((int)(m->kv_fmt & 15), D) ||
        m->kv_row < tkv_kv_row_bytes((int)(m->kv_fmt >> 4), D))
        return 0;
    for (int64_t l = 0; l < m->layers; l++) {
        const tkv_layer *L = m->layer + l;
        if (!proj_fits(&L->qkv, H, (Hq + 2 * Hkv) * D) || !proj_fits(&L->o, Hq * D, H) ||
            !proj_fits(&L->gate_up, H, 2 * I) || !proj_fits(&L->down, I, H))
            return 0;
    }
    return 1;
}

static size_t proj_bytes(const tkv_proj *p, int64_t R) {
    size_t most = 0;
    for (int64_t i = 0; i < p->parts; i++) {
        const size_t b = tkv_rows_bytes(&p->part[i], R);
        most = b > most ? b : most;
    }
    return most;
}

static size_t lines64(size_t bytes) { return (bytes + 63) & ~(size_t)63; }

static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    float ss = 0.f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* for each of R rows of n: x += add (add NULL: nothing), then h = x's RMSNorm by weight w; then the R rows of h
 * prepared for the next product's weight into prep */
static void add_norm_prepare(float *x, const float *add, const float *w, int64_t n, float eps, float *h,
                             const tkv_qw *next, char *prep, int64_t R) {
    for (int64_t r = 0; r < R; r++) {
        if (add)
            for (int64_t i = 0; i < n; i++) x[r * n + i] += add[r * n + i];
        rms_norm(x + r * n, w, n, eps, h + r * n);
    }
    tkv_rows_prepare(next, h, R, prep);
}

/* each head's halves rotated: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) */
static void rotate(float *x, int64_t heads, int64_t D, const float *cs, const float *sn) {
    const int64_t h = D / 2;
    for (int64_t j = 0; j < heads; j++) {
        float *v = x + j * D;
        for (int64_t i = 0; i < h; i++) {
            const float a = v[i], b = v[i + h];
            v[i] = a * cs[i] - b * sn[i];
            v[i + h] = b * cs[i] + a * sn[i];
        }
    }
}

/* out [T, H, D] (contiguous) = the rows of x [T, H, D] (row t at x + t * xs, its heads contiguous) rotated by the
 * positions' cos and sin [T, D], as the model's forward writes it in torch (kernels/rotary.py: x cos +
 * rotate_half(x) sin): each product rounded, then their sum, never contracted into an fma, so the bits are torch's */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
void tkv_rotary(const float *x, int64_t T, int64_t xs, int64_t H, int64_t D, const float *cs, const float *sn,
                float *out) {
#ifdef __clang__
#pragma clang fp contract(off)
#endif
    const int64_t h = D / 2;
    #pragma omp parallel for schedule(static) if (T * H * D >= (1 << 15))
    for (int64_t t = 0; t < T; t++) {
        const float *c = cs + t * D, *s = sn + t * D;
        for (int64_t j = 0; j < H; j++) {
            const float *v = x + t * xs + j * D;
            float *o = out + (t * H + j) * D;
            for (int64_t i = 0; i < h; i++) o[i] = v[i] * c[i] - v[i + h] * s[i];
            for (int64_t i = h; i < D; i++) o[i] = v[i] * c[i] + v[i - h] * s[i];
        }
    }
}

/* out = silu(gate) * up, silu(g) = g / (1 + e^-g), from e^-|g| (exp256 takes x <= 0) */
static void silu_mul(const float *gate, const float *up, int64_t n, float *out) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 t = exp256(_mm256_or_ps(g, sign));  /* e^-|g| */
        const __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
        const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, t, neg), _mm256_add_ps(one, t));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) out[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
}

/* out [R, the parts' outputs] = p(x [R, K]), every thread calling it; part 0 was prepared (tkv_rows_prepare into
 * prep) by the caller */
static void project(const tkv_proj *p, const float *x, char *prep, float *out, int64_t R) {
    int64_t at = 0, N = 0;
    for (int64_t i = 0; i < p->parts; i++) N += p->part[i].N;
    for (int64_t i = 0; i < p->parts; i++) {
        if (i > 0) {
            #pragma omp single
            tkv_rows_prepare(&p->part[i], x, R, prep);
        }
        tkv_rows_share(&p->part[i], prep, R, N, out + at);
        at += p->part[i].N;
    }
}

/* R rows in one pass: R tokens of one sequence (R = 1: a decode step; more: a step verifying R - 1 drafts), or
 * one token of each of R sequences (a batch of decodes). Row r: token tokens[r] at position positions[r], its K/V
 * rows into cache slot slots[r] (block slot / block_size, row slot % block_size), attending to positions
 * 0..positions[r] through the block table at tables + r * table_stride (stride 0: every row's is the same); rows of
 * one sequence see the rows before them (every row's K/V is stored before any attends). logits [R, vocab] fp32.
 * Every product reads its weight once for all R rows. Returns 0, or -1 without scratch memory. */
int tkv_decode_rows(const tkv_model *m, int64_t R, const int64_t *tokens, const int64_t *positions,
                    const int64_t *slots, const int32_t *tables, int64_t table_stride, float *logits) {
    const int64_t H = m->hidden, Hq = m->heads, Hkv = m->kv_heads, D = m->head_dim, I = m->inter;
    const int64_t qn = Hq * D, kn = Hkv * D, qkvn = qn + 2 * kn;
    const int threads = tkv_split_threads();  /* what attention's splits are chosen for */
    int64_t most_splits = 1;
    for (int64_t r = 0; r < R; r++) {
        const int64_t sp = tkv_attention_splits(positions[r] + 1, threads);
        most_splits = sp > most_splits ? sp : most_splits;
    }
    size_t prep_bytes = proj_bytes(&m->head, R);
    for (int64_t l = 0; l < m->layers; l++) {
        const tkv_layer *L = m->layer + l;
        const size_t b[4] = {proj_bytes(&L->qkv, R), proj_bytes(&L->o, R), proj_bytes(&L->gate_up, R),
                             proj_bytes(&L->down, R)};
        for (int i = 0; i < 4; i++) prep_bytes = b[i] > prep_bytes ? b[i] : prep_bytes;
    }
    /* after the prepared activations, R rows of each: x, h, qkv, att, o, gate_up, act, down, cos, sin; then
     * attention's partial results (a group of rows at a time), each row's positions and its group's rows (int32) */
    const size_t sizes[12] = {R * H, R * H, R * qkvn, R * qn, R * H, R * 2 * I, R * I, R * H, R * (D / 2),
                              R * (D / 2), (size_t)tkv_attention_parts(R, most_splits, Hq, D), 2 * R};
    size_t total = lines64(prep_bytes), at[12];
    for (int i = 0; i < 12; i++) {
        at[i] = total;
        total += lines64(sizes[i] * sizeof(float));
    }
    char *mem = tkv_scratch(total);
    if (!mem) return -1;
    char *prep = mem;
    float *x = (float *)(mem + at[0]), *h = (float *)(mem + at[1]), *qkv = (float *)(mem + at[2]);
    float *att = (float *)(mem + at[3]), *o = (float *)(mem + at[4]), *gu = (float *)(mem + at[5]);
    float *act = (float *)(mem + at[6]), *dn = (float *)(mem + at[7]), *cs = (float *)(mem + at[8]);
    float *sn = (float *)(mem + at[9]), *parts = (float *)(mem + at[10]);
    int32_t *lens = (int32_t *)(mem + at[11]), *together = lens + R;
    for (int64_t r = 0; r < R; r++) lens[r] = (int32_t)(positions[r] + 1);
    for (int64_t r = 0; r < R;) {  /* rows of one table whose splits agree attend together (a verification's) */
        const int64_t n = tkv_attention_together(lens + r, R - r, m->block_size, threads);
        int64_t k = 1;
        while (k < n && (table_stride == 0 || !memcmp(tables + (r + k) * table_stride, tables + r * table_stride,
                                                      (size_t)table_stride * sizeof(int32_t))))
            k++;
        together[r] = (int32_t)k;
        r += k;
    }

    for (int64_t r = 0; r < R; r++) {
        if (m->embed)
            memcpy(x + r * H, m->embed + tokens[r] * H, H * sizeof(float));
        else
            tkv_row_dequantize(&m->head.part[0], tokens + r, 1, x + r * H);
        for (int64_t i = 0; i < D / 2; i++) {
            const float f = (float)positions[r] * m->inv_freq[i];
            cs[r * (D / 2) + i] = cosf(f);
            sn[r * (D / 2) + i] = sinf(f);
        }
    }
    const int kf = (int)(m->kv_fmt & 15), vf = (int)(m->kv_fmt >> 4);

    #pragma omp parallel
    {
        for (int64_t l = 0; l < m->layers; l++) {
            const tkv_layer *L = m->layer + l;
            #pragma omp single
            add_norm_prepare(x, l > 0 ? dn : NULL, L->attn_norm, H, m->eps, h, &L->qkv.part[0], prep, R);
            project(&L->qkv, h, prep, qkv, R);
            #pragma omp single
            for (int64_t r = 0; r < R; r++) {
                float *q = qkv + r * qkvn, *k = q + qn, *v = q + qn + kn;
                if (L->q_norm)
                    for (int64_t j = 0; j < Hq; j++) rms_norm(q + j * D, L->q_norm, D, m->eps, q + j * D);
                if (L->k_norm)
                    for (int64_t j = 0; j < Hkv; j++) rms_norm(k + j * D, L->k_norm, D, m->eps, k + j * D);
                rotate(q, Hq, D, cs + r * (D / 2), sn + r * (D / 2));
                rotate(k, Hkv, D, cs + r * (D / 2), sn + r * (D / 2));
                if (L->k_shift)  /* runner/key_shift.py: the keys are stored less the model's key mean */
                    for (int64_t j = 0; j < kn; j++) k[j] -= L->k_shift[j];
                const int64_t row = slots[r] * Hkv * m->kv_row;  /* the new K/V rows' first byte in the caches */
                for (int64_t j = 0; j < Hkv; j++) {
                    tkv_kv_store(k + j * D, kf, D, L->k_cache + row + j * m->kv_row);
                    tkv_kv_store(v + j * D, vf, D, L->v_cache + row + j * m->kv_row);
                }
            }
            for (int64_t r = 0; r < R; r += together[r])  /* row r sees the rows before it and itself (stored) */
                tkv_attention_share(qkv + r * qkvn, qkvn, together[r], Hq, D, L->k_cache, L->v_cache,
                                    (int)m->kv_fmt, m->kv_row, m->block_size, Hkv, tables + r * table_stride,
                                    lens + r, m->scale, tkv_attention_splits(lens[r], threads), parts, att + r * qn);
            #pragma omp single
            tkv_rows_prepare(&L->o.part[0], att, R, prep);
            project(&L->o, att, prep, o, R);
            #pragma omp single
            add_norm_prepare(x, o, L->mlp_norm, H, m->eps, h, &L->gate_up.part[0], prep, R);
            project(&L->gate_up, h, prep, gu, R);
            #pragma omp single
            {
                for (int64_t r = 0; r < R; r++) silu_mul(gu + r * 2 * I, gu + r * 2 * I + I, I, act + r * I);
                tkv_rows_prepare(&L->down.part[0], act, R, prep);
            }
            project(&L->down, act, prep, dn, R);
        }
        #pragma omp single
        add_norm_prepare(x, dn, m->final_norm, H, m->eps, h, &m->head.part[0], prep, R);
        project(&m->head, h, prep, logits, R);
    }
    return 0;
}
