// The mlx primitive `RMSNorm`: each vector along the last axis scaled to unit root mean square
// and by the norm's weight, optionally times silu(gate) (Qwen3.5's gated norm of a
// Gated-DeltaNet layer's output), in one pass on the CPU. mlx's own CPU norm is three
// primitives (square, sum, the rest fused) and the gated one four; a decode step has a few of
// them a layer, and each primitive is a task on mlx's one stream thread.
#include <nanobind/nanobind.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "exp.h"
#include "kernels.h"
#include "mlx/primitives.h"
#include "norms.h"
#include "primitive.h"

namespace mx = mlx::core;
namespace nb = nanobind;
using namespace nb::literals;

namespace mtpserve {
namespace {

// y = x / sqrt(mean(x^2) + eps) * w [* silu(gate)], row by row, in fp32 (silu: exp.h's).
MTPSERVE_VECTOR_CLONES void normalize(std::vector<mx::array>& in, mx::array& out, float eps,
                                      bool gated) {
  thread_local std::vector<float> x, w, gate, act;
  const mx::array& xs = in[0];
  const int64_t dim = xs.shape(-1);
  const int64_t rows = dim == 0 ? 0 : static_cast<int64_t>(xs.size()) / dim;
  const float* xp = packed(xs, x);
  const float* wp = packed(in[1], w);
  const float* gp = gated ? packed(in[2], gate) : nullptr;
  if (gated) act.resize(dim);
  float* y = out.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = y + r * dim;
    rms_normalize(xp + r * dim, wp, dim, eps, dst);
    if (gated) {
      std::memcpy(act.data(), gp + r * dim, dim * sizeof(float));
      silu_in_place(act.data(), dim);
      for (int64_t j = 0; j < dim; ++j) dst[j] = dst[j] * act[j];
    }
  }
}

class RMSNorm : public mx::UnaryPrimitive {
 public:
  RMSNorm(mx::Stream stream, float eps, bool gated)
      : mx::UnaryPrimitive(stream), eps_(eps), gated_(gated) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    std::vector<mx::array> outputs{output};
    dispatch(stream(), inputs, outputs, [eps = eps_, gated = gated_](auto& in, auto& out) {
      normalize(in, out[0], eps, gated);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("RMSNorm runs on the CPU only");
  }
  const char* name() const override { return gated_ ? "GatedRMSNorm" : "RMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RMSNorm&>(other);
    return eps_ == o.eps_ && gated_ == o.gated_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[gated_ ? 2 : 0].shape()};
  }

 private:
  float eps_;
  bool gated_;
};

mx::array make_norm(const mx::array& x, const mx::array& weight, const mx::array* gate,
                    float eps) {
  auto stream = cpu_stream("rms_norm");
  if (x.dtype() != mx::float32) throw std::invalid_argument("rms_norm: x must be float32");
  if (x.ndim() < 1 || weight.ndim() != 1 || weight.shape(0) != x.shape(-1))
    throw std::invalid_argument("rms_norm: x [..., D] and weight [D]");
  real_of(weight.dtype());
  std::vector<mx::array> inputs{x, weight};
  if (gate != nullptr) {
    if (gate->size() != x.size() || gate->ndim() < 1 || gate->shape(-1) % x.shape(-1) != 0)
      throw std::invalid_argument("rms_norm: gate must hold x's elements, rows of whole vectors");
    real_of(gate->dtype());
    inputs.push_back(*gate);
  }
  // gated: the output takes the gate's shape (an output projection's input, the heads joined)
  return mx::array(gate != nullptr ? gate->shape() : x.shape(), mx::float32,
                   std::make_shared<RMSNorm>(stream, eps, gate != nullptr), std::move(inputs));
}

}  // namespace

void bind_norms(nb::module_& m) {
  m.def(
      "rms_norm",
      [](const mx::array& x, const mx::array& weight, float eps) {
        return make_norm(x, weight, nullptr, eps);
      },
      "x"_a, "weight"_a, "eps"_a,
      "x / sqrt(mean(x^2, -1) + eps) * weight for x [..., D] float32, weight [D] (any float "
      "type); float32, lazy, like any op. Each row's sum in an order fixed by D alone.");
  m.def(
      "gated_rms_norm",
      [](const mx::array& x, const mx::array& weight, const mx::array& gate, float eps) {
        return make_norm(x, weight, &gate, eps);
      },
      "x"_a, "weight"_a, "gate"_a, "eps"_a,
      "rms_norm(x, weight, eps) * silu(gate) in float32, gate (any float type) holding x's "
      "elements in rows of whole vectors (x's heads joined): the output takes the gate's shape.");
}

}  // namespace mtpserve
