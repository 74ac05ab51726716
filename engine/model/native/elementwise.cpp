// Elementwise mlx primitives of a decode step, on the CPU: `CausalConvSilu` (a Gated-DeltaNet
// layer's depthwise causal conv over the window of its last K - 1 inputs and the T new ones,
// then silu) and `SwiGlu` (an MLP's silu(gate) * up). mlx runs each as one compiled
// elementwise kernel that evaluates exp through glibc's powf one element at a time (~10 ns an
// element: ~55 us a 0.8B layer's conv for one position, ~255 us for five); here silu is
// exp.h's 16-lane polynomial.
//
// The conv sums per channel ((x_0 w_0 + x_1 w_1) + x_2 w_2) + ... (+ bias), each product
// rounded (no fused multiply-add), as engine/model/gated_deltanet.causal_conv does in mlx; every
// position on its own, so a position's output is the same bits in a plain step, a verify and
// a prefill.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <vector>

#include "exp.h"
#include "kernels.h"
#include "mlx/primitives.h"
#include "primitive.h"

namespace mx = mlx::core;
namespace nb = nanobind;
using namespace nb::literals;

namespace mtpserve {
namespace {

MTPSERVE_VECTOR_CLONES void convolve(std::vector<mx::array>& in, mx::array& out, bool has_bias) {
  thread_local std::vector<float> window_scratch, taps_scratch, bias_scratch;
  const float* window = packed(in[0], window_scratch);  // [B, T + K - 1, C]
  const float* taps = packed(in[1], taps_scratch);      // [K, C]: tap j of every channel
  const float* bias = has_bias ? packed(in[2], bias_scratch) : nullptr;
  const int64_t B = in[0].shape(0), L = in[0].shape(1), C = in[0].shape(2);
  const int64_t K = in[1].shape(0);
  const int64_t T = L - K + 1;
  float* y = out.data<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      float* dst = y + (b * T + t) * C;
      const float* x = window + (b * L + t) * C;
      for (int64_t c = 0; c < C; ++c) dst[c] = x[c] * taps[c];
      for (int64_t j = 1; j < K; ++j) {
        const float* xj = x + j * C;
        const float* wj = taps + j * C;
        for (int64_t c = 0; c < C; ++c) dst[c] = dst[c] + xj[c] * wj[c];
      }
      if (has_bias)
        for (int64_t c = 0; c < C; ++c) dst[c] = dst[c] + bias[c];
      silu_in_place(dst, C);
    }
}

class CausalConvSilu : public mx::UnaryPrimitive {
 public:
  CausalConvSilu(mx::Stream stream, bool has_bias)
      : mx::UnaryPrimitive(stream), has_bias_(has_bias) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    std::vector<mx::array> outputs{output};
    dispatch(stream(), inputs, outputs,
             [has_bias = has_bias_](auto& in, auto& out) { convolve(in, out[0], has_bias); });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("CausalConvSilu runs on the CPU only");
  }
  const char* name() const override { return "CausalConvSilu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return has_bias_ == static_cast<const CausalConvSilu&>(other).has_bias_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& w = inputs[0];
    return {{w.shape(0), w.shape(1) - inputs[1].shape(0) + 1, w.shape(2)}};
  }

 private:
  bool has_bias_;
};

mx::array causal_conv_silu(const mx::array& window, const mx::array& taps,
                           const std::optional<mx::array>& bias) {
  auto stream = cpu_stream("causal_conv_silu");
  if (window.dtype() != mx::float32 || window.ndim() != 3)
    throw std::invalid_argument("causal_conv_silu: window must be float32 [B, T + K - 1, C]");
  if (taps.ndim() != 2 || taps.shape(1) != window.shape(2) || taps.shape(0) < 1 ||
      taps.shape(0) > window.shape(1))
    throw std::invalid_argument("causal_conv_silu: taps must be [K, C], K <= the window's length");
  real_of(taps.dtype());
  std::vector<mx::array> inputs{window, taps};
  if (bias) {
    if (bias->ndim() != 1 || bias->shape(0) != window.shape(2))
      throw std::invalid_argument("causal_conv_silu: bias must be [C]");
    real_of(bias->dtype());
    inputs.push_back(*bias);
  }
  mx::Shape shape{window.shape(0), window.shape(1) - taps.shape(0) + 1, window.shape(2)};
  return mx::array(std::move(shape), mx::float32,
                   std::make_shared<CausalConvSilu>(stream, bias.has_value()), std::move(inputs));
}

// silu(gate) * up over packed rows.
MTPSERVE_VECTOR_CLONES void swiglu_rows(std::vector<mx::array>& in, mx::array& out) {
  thread_local std::vector<float> gate_scratch, up_scratch;
  const float* gate = packed(in[0], gate_scratch);
  const float* up = packed(in[1], up_scratch);
  float* y = out.data<float>();
  const int64_t n = static_cast<int64_t>(in[0].size());
  std::memcpy(y, gate, n * sizeof(float));
  silu_in_place(y, n);
  for (int64_t i = 0; i < n; ++i) y[i] = y[i] * up[i];
}

class SwiGlu : public mx::UnaryPrimitive {
 public:
  explicit SwiGlu(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    std::vector<mx::array> outputs{output};
    dispatch(stream(), inputs, outputs, [](auto& in, auto& out) { swiglu_rows(in, out[0]); });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("SwiGlu runs on the CPU only");
  }
  const char* name() const override { return "SwiGlu"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

mx::array swiglu(const mx::array& gate, const mx::array& up) {
  auto stream = cpu_stream("swiglu");
  if (gate.dtype() != mx::float32 || up.dtype() != mx::float32 || gate.shape() != up.shape() ||
      gate.ndim() < 1)
    throw std::invalid_argument("swiglu: gate and up must be float32 arrays of one shape");
  return mx::array(gate.shape(), mx::float32, std::make_shared<SwiGlu>(stream), {gate, up});
}

}  // namespace

void bind_elementwise(nb::module_& m) {
  m.def("causal_conv_silu", &causal_conv_silu, "window"_a, "taps"_a, "bias"_a = nb::none(),
        "silu(sum_j window[:, t + j] * taps[j] (+ bias)) for t in 0..T-1: a depthwise causal "
        "conv over window [B, T + K - 1, C] float32 with taps [K, C] (any float type); "
        "float32 [B, T, C], lazy, like any op.");
  m.def("swiglu", &swiglu, "gate"_a, "up"_a,
        "silu(gate) * up for float32 arrays of one shape; lazy, like any op.");
}

}  // namespace mtpserve
