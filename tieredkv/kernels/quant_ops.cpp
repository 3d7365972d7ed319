// tieredkv::quant_gemv: one activation row times a quantized weight (kernels/quant.py's q8 and q4 formats), a
// torch operator in C++ so that a call costs the dispatcher's few microseconds and no Python: a batch-1
// decode step of the default model makes 121 of them, and the compiled decode graph's C++ wrapper calls it
// directly. The arithmetic is quant_cpu.c's one-row kernels, from the build kernels/quant.py loaded
// (tkv_bind hands over their addresses), so this file holds no kernel of its own. Built by
// kernels/quant_cpu.py against the running torch's headers.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

namespace {

using Q8Gemv = int (*)(const float *, int64_t, const int8_t *, const uint16_t *, const uint16_t *, int64_t, int64_t,
                       const float *, float *);
using Q4Gemv = int (*)(const float *, int64_t, const uint8_t *, const uint16_t *, const uint16_t *, int64_t, int64_t,
                       const float *, float *);
Q8Gemv q8_gemv = nullptr;
Q4Gemv q4_gemv = nullptr;

const uint16_t *halves(const at::Tensor &t) {
    TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous(),
                "quant_gemv: scales and offsets are contiguous fp16");
    return static_cast<const uint16_t *>(t.data_ptr());
}

at::Tensor quant_gemv(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scales,
                      const std::optional<at::Tensor> &offsets, int64_t group_size,
                      const std::optional<at::Tensor> &bias) {
    TORCH_CHECK(q8_gemv != nullptr && q4_gemv != nullptr, "quant_gemv: the kernels are not bound (tkv_bind)");
    const int64_t k = x.size(-1), n = codes.size(0);
    const bool q8 = codes.scalar_type() == at::kChar;
    TORCH_CHECK(x.numel() == k, "quant_gemv: one row of activations, got ", x.sizes());
    TORCH_CHECK(codes.is_contiguous() && (q8 || codes.scalar_type() == at::kByte), "quant_gemv: int8 or uint8 codes");
    TORCH_CHECK(codes.dim() == 2 && scales.dim() == 2 && group_size > 0 && codes.size(1) * (q8 ? 1 : 2) == k &&
                    k % group_size == 0 && scales.size(0) == n && scales.size(1) * group_size == k,
                "quant_gemv: codes ", codes.sizes(), " and scales ", scales.sizes(), " do not take ", k, " inputs");
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
    const int status = q8 ? q8_gemv(xf.data_ptr<float>(), k, static_cast<const int8_t *>(codes.data_ptr()),
                                    halves(scales), mn, group_size, n, b, out.data_ptr<float>())
                          : q4_gemv(xf.data_ptr<float>(), k, static_cast<const uint8_t *>(codes.data_ptr()),
                                    halves(scales), mn, group_size, n, b, out.data_ptr<float>());
    TORCH_CHECK(status == 0, "quant_gemv: no memory for the activations' int16 copy");
    return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace

extern "C" void tkv_bind(void *q8, void *q4) {
    q8_gemv = reinterpret_cast<Q8Gemv>(q8);
    q4_gemv = reinterpret_cast<Q4Gemv>(q4);
}

TORCH_LIBRARY_FRAGMENT(tieredkv, m) {
    m.def("quant_gemv(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, int group_size, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tieredkv, CPU, m) { m.impl("quant_gemv", &quant_gemv); }
