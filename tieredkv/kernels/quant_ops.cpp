// The project's CPU kernels as torch operators in C++, so that a call costs the dispatcher's few microseconds and
// no Python, and the compiled decode graph's C++ wrapper calls them directly:
//   tieredkv::quant_gemv: one activation row times a quantized weight (kernels/quant.py's q8, q4, q4t, q8t formats);
//     a batch-1 decode step of the default model makes 121 of them;
//   tieredkv::paged_decode: decode attention over the paged KV cache (attention_cpu.c), one call a layer;
//   tieredkv::packed_gemv: one activation row times an fp32 or bf16 weight in oneDNN's packed layout, read
//     where it lies (kernels/linear.py: packed_handle), a batch-1 fp32/bf16 decode step's dense layers.
// The arithmetic is the library kernels/quant_cpu.py built and loaded (tkv_bind hands over the kernels'
// addresses), so this file holds no kernel of its own. Built by kernels/quant_cpu.py against the running
// torch's headers.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace {

using Q8Gemv = int (*)(const float *, int64_t, const int8_t *, const uint16_t *, const uint16_t *, int64_t, int64_t,
                       const float *, float *);
using Q4Gemv = int (*)(const float *, int64_t, const uint8_t *, const uint16_t *, const uint16_t *, int64_t, int64_t,
                       const float *, float *);
using PagedDecode = int (*)(const float *, int64_t, int64_t, int64_t, const void *, const void *, int, int64_t,
                            int64_t, int64_t, const int32_t *, int64_t, const int32_t *, float, float *);
using PackedRow = int (*)(const void *, int64_t, const void *, int64_t, int64_t, int64_t, const float *, void *);
using StoreTokens = void (*)(const float *, const float *, int64_t, int64_t, int64_t, int64_t, int64_t,
                             const int64_t *, uint8_t *, uint8_t *, int64_t, int);
using KVValues = void (*)(const uint8_t *, int64_t, int64_t, int, int64_t, float *);
using RowBytes = int64_t (*)(int, int64_t);
StoreTokens store_tokens = nullptr;
KVValues kv_values_kernel = nullptr;
RowBytes kv_row_bytes = nullptr;  // kv_cpu.c: tkv_kv_row_bytes, the one statement of each format's row
Q8Gemv q8_gemv = nullptr;
Q4Gemv q4_gemv = nullptr, q4t_gemv = nullptr, q8t_gemv = nullptr;  // q8t codes are bytes too (quant_cpu.c)
PagedDecode paged_decode_kernel = nullptr;
PackedRow f32_packed_row = nullptr, bf16_packed_row = nullptr;

const uint16_t *halves(const at::Tensor &t) {
    TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous(),
                "quant_gemv: scales and offsets are contiguous fp16");
    return static_cast<const uint16_t *>(t.data_ptr());
}

at::Tensor quant_gemv(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scales,
                      const std::optional<at::Tensor> &offsets, int64_t group_size,
                      const std::optional<at::Tensor> &bias) {
    TORCH_CHECK(q8_gemv != nullptr && q4_gemv != nullptr && q4t_gemv != nullptr && q8t_gemv != nullptr,
                "quant_gemv: the kernels are not bound (tkv_bind)");
    // tiled: q4t [T, K/8, 64] (uint8), q8t [T, K/4, 64] (int8), 16 T rows
    const bool q8 = codes.scalar_type() == at::kChar, tiled = codes.dim() == 3;
    const int64_t k = x.size(-1), n = codes.size(0) * (tiled ? 16 : 1);
    TORCH_CHECK(x.numel() == k, "quant_gemv: one row of activations, got ", x.sizes());
    TORCH_CHECK(codes.is_contiguous() && (q8 || codes.scalar_type() == at::kByte), "quant_gemv: int8 or uint8 codes");
    if (tiled) {
        TORCH_CHECK(codes.size(1) * (q8 ? 4 : 8) == k && codes.size(2) == 64 && scales.dim() == 3 && group_size > 0 &&
                        group_size % 32 == 0 && k % group_size == 0 && scales.size(0) == codes.size(0) &&
                        scales.size(1) * group_size == k && scales.size(2) == 16,
                    "quant_gemv: tiled codes ", codes.sizes(), " and scales ", scales.sizes(), " do not take ", k,
                    " inputs");
    } else {
        TORCH_CHECK(codes.dim() == 2 && scales.dim() == 2 && group_size > 0 && codes.size(1) * (q8 ? 1 : 2) == k &&
                        k % group_size == 0 && scales.size(0) == n && scales.size(1) * group_size == k,
                    "quant_gemv: codes ", codes.sizes(), " and scales ", scales.sizes(), " do not take ", k, " inputs");
    }
    TORCH_CHECK(q8 || offsets.has_value(), "quant_gemv: 4-bit codes need offsets");
    TORCH_CHECK(!offsets.has_value() || offsets->sizes() == scales.sizes(),
                "quant_gemv: offsets are not shaped as the scales ", scales.sizes());
    TORCH_CHECK(!bias.has_value() || bias->numel() == n, "quant_gemv: a bias of ", n, " outputs");
    const at::Tensor xf = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
    std::optional<at::Tensor> bf;
    if (bias.has_value())
        bf = bias->scalar_type() == at::kFloat ? bias->contiguous() : bias->to(at::kFloat).contiguous();
    auto sizes = x.sizes().vec();
    sizes.back() = n;
    at::Tensor out = at::empty(sizes, x.options().dtype(at::kFloat));
    const uint16_t *mn = offsets.has_value() ? halves(*offsets) : nullptr;
    const float *b = bf.has_value() ? bf->data_ptr<float>() : nullptr;
    const int status = q8 && !tiled ? q8_gemv(xf.data_ptr<float>(), k, static_cast<const int8_t *>(codes.data_ptr()),
                                              halves(scales), mn, group_size, n, b, out.data_ptr<float>())
                                    : (tiled ? (q8 ? q8t_gemv : q4t_gemv) : q4_gemv)(
                                          xf.data_ptr<float>(), k, static_cast<const uint8_t *>(codes.data_ptr()),
                                          halves(scales), mn, group_size, n, b, out.data_ptr<float>());
    TORCH_CHECK(status == 0, "quant_gemv: no memory for the activations' integer copy");
    return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// True where rows of `row` bytes hold D values in K's format and in V's (formats the kernels know, D they take)
bool rows_fit(int64_t k_format, int64_t v_format, int64_t D, int64_t row) {
    if (k_format < 0 || v_format < 0 || kv_row_bytes == nullptr) return false;
    const int64_t k = kv_row_bytes(static_cast<int>(k_format), D), v = kv_row_bytes(static_cast<int>(v_format), D);
    return k > 0 && v > 0 && std::max(k, v) <= row;
}

// A float cache's format from its dtype (fp32, bf16, fp16), -1 for another dtype
int64_t float_format(const at::Tensor &cache) {
    switch (cache.scalar_type()) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: return -1;
    }
}

// query [B, Hq, D]; key_cache, value_cache [num_blocks, block_size, Hkv, row], contiguous: fp32, bf16 or fp16
// values (row = D; the formats -1: from the dtype), or uint8 rows in k_format / v_format (kv_format.py's codes);
// block_tables [B, W] and context_lens [B] (int32; int64 is converted). Every context length must be at
// least 1 and within its table, and every block id it reaches within the cache: checked here, as the kernel
// reads where they point. Returns [B, Hq, D] in the query's dtype.
at::Tensor paged_decode(const at::Tensor &query, const at::Tensor &key_cache, const at::Tensor &value_cache,
                        const at::Tensor &block_tables, const at::Tensor &context_lens, double scale,
                        int64_t k_format, int64_t v_format) {
    TORCH_CHECK(paged_decode_kernel != nullptr, "paged_decode: the kernel is not bound (tkv_bind)");
    TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes() &&
                    value_cache.scalar_type() == key_cache.scalar_type(),
                "paged_decode: query ", query.sizes(), " and caches ", key_cache.sizes(), " ",
                key_cache.scalar_type(), ", ", value_cache.sizes(), " ", value_cache.scalar_type());
    TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "paged_decode: contiguous caches");
    const int64_t B = query.size(0), Hq = query.size(1), D = query.size(2);
    const bool bytes = key_cache.scalar_type() == at::kByte;
    if (!bytes) k_format = v_format = float_format(key_cache);
    const int64_t rb = key_cache.size(3) * key_cache.element_size();
    TORCH_CHECK(rows_fit(k_format, v_format, D, rb) && (bytes || key_cache.size(3) == D),
                "paged_decode: caches ", key_cache.sizes(), " ", key_cache.scalar_type(), " in formats ", k_format,
                " / ", v_format, " do not hold rows of ", D, " values");
    const int64_t blocks = key_cache.size(0), bs = key_cache.size(1), Hkv = key_cache.size(2);
    const at::Tensor tables = block_tables.to(at::kInt).contiguous(), lens = context_lens.to(at::kInt).contiguous();
    TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && lens.numel() == B,
                "paged_decode: tables ", block_tables.sizes(), " and lengths ", context_lens.sizes(), " for ", B,
                " queries");
    const int32_t *t = tables.data_ptr<int32_t>(), *l = lens.data_ptr<int32_t>();
    const int64_t width = tables.size(1);
    for (int64_t b = 0; b < B; b++) {
        TORCH_CHECK(l[b] >= 1 && l[b] <= width * bs, "paged_decode: context length ", l[b], " of row ", b,
                    " outside 1..", width * bs);
        for (int64_t j = 0; j < (l[b] + bs - 1) / bs; j++)
            TORCH_CHECK(t[b * width + j] >= 0 && t[b * width + j] < blocks, "paged_decode: block id ",
                        t[b * width + j], " outside the cache's ", blocks);
    }
    const at::Tensor q = query.to(at::kFloat).contiguous();
    at::Tensor out = at::empty({B, Hq, D}, query.options().dtype(at::kFloat));
    const int status = paged_decode_kernel(q.data_ptr<float>(), B, Hq, D, key_cache.data_ptr(), value_cache.data_ptr(),
                                           static_cast<int>(k_format | (v_format << 4)), rb, bs, Hkv, t, width, l,
                                           static_cast<float>(scale), out.data_ptr<float>());
    TORCH_CHECK(status == 0, "paged_decode: ", Hq, " query heads over ", Hkv, " KV heads of ", D,
                " is not a shape the kernel takes");
    return query.scalar_type() == at::kFloat ? out : out.to(query.scalar_type());
}

// key, value [T, H, D] fp32 (heads contiguous, tokens at any stride); kv_cache [2, blocks, block_size, H, row]
// uint8 rows in k_format / v_format; slot_mapping [T] (int64; -1: not stored). Each token's rows are encoded as
// kv_format.py's encode does, into their slots (checked within the cache before anything is written).
void store_kv_rows(const at::Tensor &key, const at::Tensor &value, at::Tensor &kv_cache, const at::Tensor &slot_mapping,
                   int64_t k_format, int64_t v_format) {
    TORCH_CHECK(store_tokens != nullptr, "store_kv_rows: the kernel is not bound (tkv_bind)");
    TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.scalar_type() == at::kFloat &&
                    value.scalar_type() == at::kFloat && key.stride(2) == 1 && value.stride(2) == 1 &&
                    key.stride(1) == key.size(2) && value.stride(1) == value.size(2),
                "store_kv_rows: fp32 key and value [T, H, D] with contiguous heads, got ", key.sizes(), " and ",
                value.sizes());
    const int64_t T = key.size(0), H = key.size(1), D = key.size(2);
    TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(3) == H && kv_cache.is_contiguous() &&
                    kv_cache.scalar_type() == at::kByte && rows_fit(k_format, v_format, D, kv_cache.size(4)),
                "store_kv_rows: cache ", kv_cache.sizes(), " ", kv_cache.scalar_type(), " in formats ", k_format, " / ",
                v_format, " does not hold rows of ", D, " values");
    const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
    TORCH_CHECK(slots.numel() == T, "store_kv_rows: ", slots.numel(), " slots for ", T, " tokens");
    const int64_t *s = slots.data_ptr<int64_t>(), limit = kv_cache.size(1) * kv_cache.size(2);
    for (int64_t t = 0; t < T; t++)
        TORCH_CHECK(s[t] < limit, "store_kv_rows: slot ", s[t], " outside the cache's ", limit);
    uint8_t *kc = kv_cache.data_ptr<uint8_t>();
    store_tokens(key.data_ptr<float>(), value.data_ptr<float>(), T, H, D, key.stride(0), value.stride(0), s, kc,
                 kc + kv_cache.stride(0), kv_cache.size(4), static_cast<int>(k_format | (v_format << 4)));
}

// rows [..., row] uint8 in `format` -> [..., head_dim] fp32 values (int4 turned back): what the references read
at::Tensor kv_values(const at::Tensor &rows, int64_t format, int64_t head_dim) {
    TORCH_CHECK(kv_values_kernel != nullptr, "kv_values: the kernel is not bound (tkv_bind)");
    TORCH_CHECK(rows.scalar_type() == at::kByte && rows.dim() >= 1 &&
                    rows_fit(format, format, head_dim, rows.size(-1)),
                "kv_values: rows ", rows.sizes(), " ", rows.scalar_type(), " in format ", format, " do not hold ",
                head_dim, " values");
    const at::Tensor r = rows.contiguous();
    auto sizes = rows.sizes().vec();
    sizes.back() = head_dim;
    at::Tensor out = at::empty(sizes, rows.options().dtype(at::kFloat));
    kv_values_kernel(r.data_ptr<uint8_t>(), r.numel() / r.size(-1), r.size(-1), static_cast<int>(format), head_dim,
                     out.data_ptr<float>());
    return out;
}

// x: one row [..., K], fp32 or bf16; packed: the weight's packed buffer in x's dtype, viewed as fp32 [blocks, Kp, B]
// or bf16 [blocks, Kp / 2, 2 B] (B outputs a block, Kp >= K inputs stored, bf16 inputs in pairs: the layouts
// linear.py's packed_row_layout recognizes); bias: [blocks * B] or none. Returns [..., blocks * B] in x's dtype.
at::Tensor packed_gemv(const at::Tensor &x, const at::Tensor &packed, const std::optional<at::Tensor> &bias) {
    TORCH_CHECK(f32_packed_row != nullptr && bf16_packed_row != nullptr,
                "packed_gemv: the kernels are not bound (tkv_bind)");
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    TORCH_CHECK((bf16 || x.scalar_type() == at::kFloat) && packed.scalar_type() == x.scalar_type(),
                "packed_gemv: fp32 or bf16 activations and weight alike, got ", x.scalar_type(), " and ",
                packed.scalar_type());
    TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && (!bf16 || packed.size(2) % 2 == 0),
                "packed_gemv: a packed buffer viewed as [blocks, rows, B], got ", packed.sizes());
    const int64_t k = x.size(-1), block = bf16 ? packed.size(2) / 2 : packed.size(2);
    const int64_t stored = bf16 ? 2 * packed.size(1) : packed.size(1), n = packed.size(0) * block;
    TORCH_CHECK(x.numel() == k, "packed_gemv: one row of activations, got ", x.sizes());
    TORCH_CHECK(k <= stored, "packed_gemv: ", k, " inputs for a weight of ", stored);
    TORCH_CHECK(!bias.has_value() || bias->numel() == n, "packed_gemv: a bias of ", n, " outputs");
    std::optional<at::Tensor> bf;
    if (bias.has_value())
        bf = bias->scalar_type() == at::kFloat ? bias->contiguous() : bias->to(at::kFloat).contiguous();
    const at::Tensor xc = x.contiguous();
    auto sizes = x.sizes().vec();
    sizes.back() = n;
    at::Tensor out = at::empty(sizes, x.options());
    const int status = (bf16 ? bf16_packed_row : f32_packed_row)(
        xc.data_ptr(), k, packed.data_ptr(), n, block, stored, bf.has_value() ? bf->data_ptr<float>() : nullptr,
        out.data_ptr());
    TORCH_CHECK(status == 0, "packed_gemv: blocks of ", block, " x ", stored, " not taken by the kernel");
    return out;
}

}  // namespace

extern "C" void tkv_bind(void *q8, void *q4, void *paged, void *f32_row, void *bf16_row, void *q4t, void *q8t,
                         void *store, void *values, void *row_bytes) {
    kv_row_bytes = reinterpret_cast<RowBytes>(row_bytes);
    store_tokens = reinterpret_cast<StoreTokens>(store);
    kv_values_kernel = reinterpret_cast<KVValues>(values);
    q8_gemv = reinterpret_cast<Q8Gemv>(q8);
    q4_gemv = reinterpret_cast<Q4Gemv>(q4);
    q4t_gemv = reinterpret_cast<Q4Gemv>(q4t);
    q8t_gemv = reinterpret_cast<Q4Gemv>(q8t);
    paged_decode_kernel = reinterpret_cast<PagedDecode>(paged);
    f32_packed_row = reinterpret_cast<PackedRow>(f32_row);
    bf16_packed_row = reinterpret_cast<PackedRow>(bf16_row);
}

TORCH_LIBRARY_FRAGMENT(tieredkv, m) {
    m.def("quant_gemv(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, int group_size, Tensor? bias) -> Tensor");
    m.def("paged_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor context_lens, "
          "float scale, int k_format=-1, int v_format=-1) -> Tensor");
    m.def("packed_gemv(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
    m.def("store_kv_rows(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, int k_format, "
          "int v_format) -> ()");
    m.def("kv_values(Tensor rows, int format, int head_dim) -> Tensor");
}

TORCH_LIBRARY_IMPL(tieredkv, CPU, m) {
    m.impl("quant_gemv", &quant_gemv);
    m.impl("paged_decode", &paged_decode);
    m.impl("packed_gemv", &packed_gemv);
    m.impl("store_kv_rows", &store_kv_rows);
    m.impl("kv_values", &kv_values);
}
