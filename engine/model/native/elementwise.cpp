// Elementwise mlx primitives of a decode step, on the CPU: `CausalConvSilu` (a Gated-DeltaNet
// layer's depthwise causal conv over the window of its last K - 1 inputs and the T new ones,
// then silu), `SwiGlu` (an MLP's silu(gate) * up) and `Rope` (an attention layer's rotary
// embedding of its queries or keys). mlx runs each of the first two as one compiled
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
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
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

// y[b, t] = silu(sum_j window[b, t + j] * taps[j] (+ bias)) over a packed window [B, L, C]:
// 16 channels at a time through every tap, the bias and silu, in registers.
MTPSERVE_VECTOR_CLONES void convolve_window(const float* window, int64_t B, int64_t L, int64_t C,
                                            const float* taps, int64_t K, const float* bias,
                                            float* y) {
  const int64_t T = L - K + 1;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      float* dst = y + (b * T + t) * C;
      const float* x = window + (b * L + t) * C;
      for (int64_t c = 0; c < C; c += 16) {
        const int64_t lanes = C - c < 16 ? C - c : 16;
        Lanes sum = lanes_from(x + c, lanes) * lanes_from(taps + c, lanes);
        for (int64_t j = 1; j < K; ++j)
          sum = sum + lanes_from(x + j * C + c, lanes) * lanes_from(taps + j * C + c, lanes);
        if (bias != nullptr) sum = sum + lanes_from(bias + c, lanes);
        lanes_to(dst + c, silu_lanes(sum), lanes);
      }
    }
}

void convolve(std::vector<mx::array>& in, mx::array& out, bool has_bias) {
  thread_local std::vector<float> window_scratch, taps_scratch, bias_scratch;
  const float* window = packed(in[0], window_scratch);  // [B, T + K - 1, C]
  const float* taps = packed(in[1], taps_scratch);      // [K, C]: tap j of every channel
  const float* bias = has_bias ? packed(in[2], bias_scratch) : nullptr;
  convolve_window(window, in[0].shape(0), in[0].shape(1), in[0].shape(2), taps, in[1].shape(0),
                  bias, out.data<float>());
}

// The window [state | new] (out[0]) and the conv over it (out[1]): inputs state [B, K - 1, C],
// new [B, T, C], taps, bias.
void convolve_joined(std::vector<mx::array>& in, std::vector<mx::array>& out, bool has_bias) {
  thread_local std::vector<float> taps_scratch, bias_scratch;
  const int64_t B = in[0].shape(0), kept = in[0].shape(1), T = in[1].shape(1);
  const int64_t C = in[0].shape(2), L = kept + T;
  thread_local std::vector<float> state_rows, new_rows;
  const float* state = packed(in[0], state_rows);
  const float* fresh = packed(in[1], new_rows);
  float* window = out[0].data<float>();
  for (int64_t b = 0; b < B; ++b) {
    std::memcpy(window + b * L * C, state + b * kept * C, kept * C * sizeof(float));
    std::memcpy(window + (b * L + kept) * C, fresh + b * T * C, T * C * sizeof(float));
  }
  const float* taps = packed(in[2], taps_scratch);
  const float* bias = has_bias ? packed(in[3], bias_scratch) : nullptr;
  convolve_window(window, B, L, C, taps, in[2].shape(0), bias, out[1].data<float>());
}

// The conv over a window (`joined` false: inputs window, taps, bias; one output) or over the
// window it writes of [state | new] (`joined`: inputs state, new, taps, bias; outputs the
// window and the conv).
class CausalConvSilu : public mx::Primitive {
 public:
  CausalConvSilu(mx::Stream stream, bool has_bias, bool joined)
      : mx::Primitive(stream), has_bias_(has_bias), joined_(joined) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch(stream(), inputs, outputs,
             [has_bias = has_bias_, joined = joined_](auto& in, auto& out) {
               if (joined)
                 convolve_joined(in, out, has_bias);
               else
                 convolve(in, out[0], has_bias);
             });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("CausalConvSilu runs on the CPU only");
  }
  const char* name() const override { return "CausalConvSilu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const CausalConvSilu&>(other);
    return has_bias_ == o.has_bias_ && joined_ == o.joined_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& first = inputs[0];
    if (joined_) {
      const auto& fresh = inputs[1];
      return {{first.shape(0), first.shape(1) + fresh.shape(1), first.shape(2)}, fresh.shape()};
    }
    return {{first.shape(0), first.shape(1) - inputs[1].shape(0) + 1, first.shape(2)}};
  }

 private:
  bool has_bias_;
  bool joined_;
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
                   std::make_shared<CausalConvSilu>(stream, bias.has_value(), false),
                   std::move(inputs));
}

std::vector<mx::array> causal_conv_silu_window(const mx::array& state, const mx::array& fresh,
                                               const mx::array& taps,
                                               const std::optional<mx::array>& bias) {
  auto stream = cpu_stream("causal_conv_silu");
  if (state.dtype() != mx::float32 || fresh.dtype() != mx::float32 || state.ndim() != 3 ||
      fresh.ndim() != 3 || state.shape(0) != fresh.shape(0) || state.shape(2) != fresh.shape(2))
    throw std::invalid_argument(
        "causal_conv_silu: state [B, K - 1, C] and new [B, T, C] must be float32");
  if (taps.ndim() != 2 || taps.shape(1) != state.shape(2) || taps.shape(0) != state.shape(1) + 1)
    throw std::invalid_argument("causal_conv_silu: taps must be [K, C], the state K - 1 long");
  real_of(taps.dtype());
  std::vector<mx::array> inputs{state, fresh, taps};
  if (bias) {
    if (bias->ndim() != 1 || bias->shape(0) != state.shape(2))
      throw std::invalid_argument("causal_conv_silu: bias must be [C]");
    real_of(bias->dtype());
    inputs.push_back(*bias);
  }
  mx::Shape window{state.shape(0), state.shape(1) + fresh.shape(1), state.shape(2)};
  return mx::array::make_arrays({window, fresh.shape()}, {mx::float32, mx::float32},
                                std::make_shared<CausalConvSilu>(stream, bias.has_value(), true),
                                std::move(inputs));
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

// Rows of `width` that hold -inf but at columns ids[j], which hold values[..., j]: the MTP head's
// draft logits over its draft vocabulary, placed in the full vocabulary (mlx's full and
// put_along_axis: three ops of its own).
class ScatterColumns : public mx::UnaryPrimitive {
 public:
  ScatterColumns(mx::Stream stream, int width) : mx::UnaryPrimitive(stream), width_(width) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    std::vector<mx::array> outputs{output};
    dispatch(stream(), inputs, outputs, [width = width_](auto& in, auto& out) {
      thread_local std::vector<float> value_scratch;
      thread_local std::vector<int32_t> id_scratch;
      const float* values = packed(in[0], value_scratch);
      const int32_t* ids = packed_ints(in[1], id_scratch);
      const int64_t n = in[0].shape(-1), rows = n == 0 ? 0 : in[0].size() / n;
      float* y = out[0].template data<float>();
      std::fill(y, y + rows * width, -std::numeric_limits<float>::infinity());
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < n; ++j)
          if (ids[j] >= 0 && ids[j] < width) y[r * width + ids[j]] = values[r * n + j];
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("ScatterColumns runs on the CPU only");
  }
  const char* name() const override { return "ScatterColumns"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return width_ == static_cast<const ScatterColumns&>(other).width_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = width_;
    return {shape};
  }

 private:
  int width_;
};

mx::array scatter_columns(const mx::array& values, const mx::array& ids, int width) {
  auto stream = cpu_stream("scatter_columns");
  if (values.dtype() != mx::float32 || values.ndim() < 1 || ids.ndim() != 1 ||
      ids.dtype() != mx::int32 || ids.shape(0) != values.shape(-1))
    throw std::invalid_argument(
        "scatter_columns: float32 values [..., n] and int32 ids [n] (each below width)");
  mx::Shape shape = values.shape();
  shape.back() = width;
  return mx::array(shape, mx::float32, std::make_shared<ScatterColumns>(stream, width),
                   {values, ids});
}

// Rows ids[...] of a float table [V, H] (fp32, bf16 or fp16, each row contiguous), widened to
// fp32 [..., H]: a token embedding and its cast to the activations' type in one op (mlx: a
// gather between two views, then a cast). Widening is exact, so the bits are mlx's; an id
// outside [0, V) gives a row of zeros (the server refuses such ids before a step).
class EmbedRows : public mx::UnaryPrimitive {
 public:
  explicit EmbedRows(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    std::vector<mx::array> outputs{output};
    dispatch(stream(), inputs, outputs, [](auto& in, auto& out) {
      thread_local std::vector<int32_t> id_scratch;
      const mx::array& table = in[0];
      const int32_t* ids = packed_ints(in[1], id_scratch);
      const int64_t rows = in[1].size(), vocab = table.shape(0), width = table.shape(1);
      const Real type = real_of(table.dtype());
      const auto* base = table.template data<char>();
      const int64_t row_bytes = table.strides()[0] * static_cast<int64_t>(table.itemsize());
      float* y = out[0].template data<float>();
      for (int64_t r = 0; r < rows; ++r) {
        float* dst = y + r * width;
        if (ids[r] < 0 || ids[r] >= vocab) {
          std::fill(dst, dst + width, 0.0f);
          continue;
        }
        const char* src = base + ids[r] * row_bytes;
        if (type == Real::f32) {
          std::memcpy(dst, src, width * sizeof(float));
        } else {
          for (int64_t k = 0; k < width; ++k) dst[k] = real_at(src, type, k);
        }
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("EmbedRows runs on the CPU only");
  }
  const char* name() const override { return "EmbedRows"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[1].shape();
    shape.push_back(inputs[0].shape(1));
    return {shape};
  }
};

mx::array embed_rows(const mx::array& table, const mx::array& ids) {
  auto stream = cpu_stream("embed_rows");
  const bool float_table = table.dtype() == mx::float32 || table.dtype() == mx::bfloat16 ||
                           table.dtype() == mx::float16;
  if (!float_table || table.ndim() != 2 || table.strides()[1] != 1 || ids.dtype() != mx::int32)
    throw std::invalid_argument(
        "embed_rows: a float table [V, H] with contiguous rows and int32 ids");
  mx::Shape shape = ids.shape();
  shape.push_back(table.shape(1));
  return mx::array(shape, mx::float32, std::make_shared<EmbedRows>(stream), {table, ids});
}

// Rows ids[...] of an affine-quantized table (mlx's packed uint32 codes [V, W] of 2, 4 or 8 bits,
// scales and biases [V, groups]; with `interleaved`, every 16 rows side by side as
// products.interleave lays them out), dequantized and widened to fp32 [..., W * 32 / bits]: a
// quantized token embedding in one op, where mlx's gather and dequantize take ~70 on a CPU
// (shifts, casts and broadcasts for each code's place in its word: 70 of an 8-bit demo plain
// step's 102 ops, and as many again in each head step of a draft). The arithmetic is mx.dequantize's: the code in the
// scales' type (exact), times the scale and plus the bias, each rounded to that type, then
// widened (exact): the same bits. An id outside [0, V) gives a row of zeros.
class EmbedQuantizedRows : public mx::UnaryPrimitive {
 public:
  EmbedQuantizedRows(mx::Stream stream, int bits, int group_size, bool interleaved)
      : mx::UnaryPrimitive(stream), bits_(bits), group_(group_size), interleaved_(interleaved) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    std::vector<mx::array> outputs{output};
    dispatch(stream(), inputs, outputs,
             [bits = bits_, group = group_, interleaved = interleaved_](auto& in, auto& out) {
               thread_local std::vector<int32_t> id_scratch;
               const mx::array &codes = in[0], &scales = in[1], &biases = in[2];
               const int32_t* ids = packed_ints(in[3], id_scratch);
               const int64_t rows = in[3].size(), vocab = codes.shape(0);
               const int64_t words = codes.shape(1), groups = scales.shape(1);
               const int64_t width = words * 32 / bits;
               const Real type = real_of(scales.dtype());
               const uint32_t* w = codes.template data<uint32_t>();
               const void* s = scales.template data<void>();
               const void* b = biases.template data<void>();
               const uint32_t mask = (1u << bits) - 1u;
               float* y = out[0].template data<float>();
               for (int64_t r = 0; r < rows; ++r) {
                 float* dst = y + r * width;
                 const int64_t id = ids[r];
                 if (id < 0 || id >= vocab) {
                   std::fill(dst, dst + width, 0.0f);
                   continue;
                 }
                 // element i of the row's words / groups: row-major, or 16 rows side by side
                 const int64_t tile = interleaved ? id / 16 : id, lane = interleaved ? id % 16 : 0;
                 const int64_t step = interleaved ? 16 : 1;
                 const uint32_t* row_words = w + tile * words * step + lane;
                 const int64_t group_base = tile * groups * step + lane;
                 for (int64_t g = 0; g * group < width; ++g) {
                   const float scale = real_at(s, type, group_base + g * step);
                   const float bias = real_at(b, type, group_base + g * step);
                   const int64_t end = std::min<int64_t>(width, (g + 1) * group);
                   for (int64_t j = g * group; j < end; ++j) {
                     const int64_t bit = j * bits;
                     const uint32_t word = row_words[(bit / 32) * step];
                     const float code = static_cast<float>((word >> (bit % 32)) & mask);
                     dst[j] = rounded(type, rounded(type, scale * code) + bias);
                   }
                 }
               }
             });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("EmbedQuantizedRows runs on the CPU only");
  }
  const char* name() const override { return "EmbedQuantizedRows"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const EmbedQuantizedRows&>(other);
    return bits_ == o.bits_ && group_ == o.group_ && interleaved_ == o.interleaved_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[3].shape();
    shape.push_back(static_cast<int>(inputs[0].shape(1) * 32 / bits_));
    return {shape};
  }

 private:
  // v rounded to the scales' type (nearest, ties to even, as mlx rounds), back as fp32
  static float rounded(Real type, float v) {
    if (type == Real::f32) return v;
    return type == Real::bf16 ? bf16_to_float(float_to_bf16(v)) : half_to_float(float_to_half(v));
  }
  int bits_;
  int group_;
  bool interleaved_;
};

mx::array embed_quantized_rows(const mx::array& codes, const mx::array& scales,
                               const mx::array& biases, const mx::array& ids, int bits,
                               int group_size, bool interleaved) {
  auto stream = cpu_stream("embed_quantized_rows");
  const bool packs = bits == 2 || bits == 4 || bits == 8;
  const bool contiguous = codes.flags().row_contiguous && scales.flags().row_contiguous &&
                          biases.flags().row_contiguous;
  const bool float_scales = scales.dtype() == mx::float32 || scales.dtype() == mx::bfloat16 ||
                            scales.dtype() == mx::float16;
  if (!packs || codes.dtype() != mx::uint32 || codes.ndim() != 2 || scales.ndim() != 2 ||
      !float_scales || biases.dtype() != scales.dtype() || biases.shape() != scales.shape() ||
      scales.shape(0) != codes.shape(0) || group_size <= 0 ||
      scales.shape(1) * group_size != codes.shape(1) * 32 / bits ||
      (interleaved && codes.shape(0) % 16 != 0) || !contiguous || ids.dtype() != mx::int32)
    throw std::invalid_argument(
        "embed_quantized_rows: contiguous uint32 codes [V, W] of 2, 4 or 8 bits, float scales "
        "and biases [V, W * 32 / bits / group_size] of one type, int32 ids");
  mx::Shape shape = ids.shape();
  shape.push_back(static_cast<int>(codes.shape(1) * 32 / bits));
  return mx::array(shape, mx::float32,
                   std::make_shared<EmbedQuantizedRows>(stream, bits, group_size, interleaved),
                   {codes, scales, biases, ids});
}

// The rotary embedding of x [B, L, H, D] at positions offset_b + l, written as [B, H, L, D]
// (the layout attention takes) and times `factor`: what mlx's mx.fast.rope computes on a CPU,
// where it has no kernel and runs as ~13 ops of its own (positions, frequencies, cos, sin, the
// two rotated halves and their concatenation) plus the transpose and the scale around it. The
// same formulas in float32: frequency i is exp(-i * (log(base) / (dims / 2))), the angle
// ((l + offset) * scale) * frequency, each rotated half x1 cos - x2 sin and x1 sin + x2 cos with
// every product rounded; element by element, so a position's output does not depend on how
// many positions share the op.
void rotate(std::vector<mx::array>& in, mx::array& out, int dims, float base, float scale,
            bool traditional, float factor, bool norm, float eps) {
  thread_local std::vector<float> x_scratch, w_scratch, normed;
  const float* x = packed(in[0], x_scratch);
  const float* w = norm ? packed(in[2], w_scratch) : nullptr;
  const int64_t B = in[0].shape(0), L = in[0].shape(1), H = in[0].shape(2), D = in[0].shape(3);
  const mx::array& offsets = in[1];
  const int64_t half = dims / 2;
  const float step = static_cast<float>(std::log(base) / static_cast<double>(half));
  std::vector<float> frequency(half), cosine(half), sine(half);
  for (int64_t i = 0; i < half; ++i) frequency[i] = std::exp(static_cast<float>(-i) * step);
  float* y = out.data<float>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t at = offsets.size() == 1 ? 0 : b * offsets.strides()[0];
    const float offset = static_cast<float>(offsets.data<int32_t>()[at]);
    for (int64_t l = 0; l < L; ++l) {
      const float position = (static_cast<float>(l) + offset) * scale;
      for (int64_t i = 0; i < half; ++i) {
        const float theta = position * frequency[i];
        cosine[i] = std::cos(theta);
        sine[i] = std::sin(theta);
      }
      for (int64_t h = 0; h < H; ++h) {
        const float* src = x + ((b * L + l) * H + h) * D;
        if (norm) {  // the head's RMS norm first: the RMSNorm primitive's arithmetic
          normed.resize(D);
          rms_normalize(src, w, D, eps, normed.data());
          src = normed.data();
        }
        float* dst = y + ((b * H + h) * L + l) * D;
        for (int64_t i = 0; i < half; ++i) {
          const int64_t first = traditional ? 2 * i : i;
          const int64_t second = traditional ? 2 * i + 1 : i + half;
          const float x1 = src[first], x2 = src[second];
          dst[first] = (x1 * cosine[i] - x2 * sine[i]) * factor;
          dst[second] = (x1 * sine[i] + x2 * cosine[i]) * factor;
        }
        for (int64_t j = 2 * half; j < D; ++j) dst[j] = src[j] * factor;
      }
    }
  }
}

class Rope : public mx::UnaryPrimitive {
 public:
  Rope(mx::Stream stream, int dims, float base, float scale, bool traditional, float factor,
       bool norm, float eps)
      : mx::UnaryPrimitive(stream),
        dims_(dims),
        base_(base),
        scale_(scale),
        traditional_(traditional),
        factor_(factor),
        norm_(norm),
        eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    std::vector<mx::array> outputs{output};
    dispatch(stream(), inputs, outputs,
             [dims = dims_, base = base_, scale = scale_, traditional = traditional_,
              factor = factor_, norm = norm_, eps = eps_](auto& in, auto& out) {
               rotate(in, out[0], dims, base, scale, traditional, factor, norm, eps);
             });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("Rope runs on the CPU only");
  }
  const char* name() const override { return "Rope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Rope&>(other);
    return dims_ == o.dims_ && base_ == o.base_ && scale_ == o.scale_ &&
        traditional_ == o.traditional_ && factor_ == o.factor_ && norm_ == o.norm_ &&
        eps_ == o.eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& x = inputs[0];
    return {{x.shape(0), x.shape(2), x.shape(1), x.shape(3)}};
  }

 private:
  int dims_;
  float base_;
  float scale_;
  bool traditional_;
  float factor_;
  bool norm_;
  float eps_;
};

mx::array rope(const mx::array& x, const mx::array& offset, int dims, float base, float scale,
               bool traditional, float factor, const std::optional<mx::array>& norm_weight,
               float eps) {
  auto stream = cpu_stream("rope");
  if (x.dtype() != mx::float32 || x.ndim() != 4)
    throw std::invalid_argument("rope: x must be float32 [B, L, H, D]");
  if (dims <= 0 || dims % 2 != 0 || dims > x.shape(3))
    throw std::invalid_argument("rope: dims must be even and at most the head's size");
  if (offset.dtype() != mx::int32 || offset.ndim() > 1 ||
      (offset.size() != 1 && static_cast<int64_t>(offset.size()) != x.shape(0)))
    throw std::invalid_argument("rope: offset must be int32, one or one a row");
  std::vector<mx::array> inputs{x, offset};
  if (norm_weight) {
    if (norm_weight->ndim() != 1 || norm_weight->shape(0) != x.shape(3))
      throw std::invalid_argument("rope: the norm's weight must be [D]");
    real_of(norm_weight->dtype());
    inputs.push_back(*norm_weight);
  }
  mx::Shape shape{x.shape(0), x.shape(2), x.shape(1), x.shape(3)};
  return mx::array(std::move(shape), mx::float32,
                   std::make_shared<Rope>(stream, dims, base, scale, traditional, factor,
                                          norm_weight.has_value(), eps),
                   std::move(inputs));
}

}  // namespace

void bind_elementwise(nb::module_& m) {
  m.def("rope", &rope, "x"_a, "offset"_a, "dims"_a, "base"_a, "scale"_a, "traditional"_a,
        "factor"_a = 1.0f, "norm_weight"_a = nb::none(), "eps"_a = 0.0f,
        "mx.fast.rope(x.transpose(0, 2, 1, 3), dims, ...) * factor in one op: x float32 "
        "[B, L, H, D], offset int32 (one, or one a row); float32 [B, H, L, D], lazy. With "
        "norm_weight [D], each head vector is first rms_norm(x, norm_weight, eps)'d.");
  m.def("causal_conv_silu", &causal_conv_silu, "window"_a, "taps"_a, "bias"_a = nb::none(),
        "silu(sum_j window[:, t + j] * taps[j] (+ bias)) for t in 0..T-1: a depthwise causal "
        "conv over window [B, T + K - 1, C] float32 with taps [K, C] (any float type); "
        "float32 [B, T, C], lazy, like any op.");
  m.def("causal_conv_silu_window", &causal_conv_silu_window, "state"_a, "new"_a, "taps"_a,
        "bias"_a = nb::none(),
        "(window, causal_conv_silu(window, taps, bias)) with window = [state | new] along the "
        "positions, in one op: state [B, K - 1, C] and new [B, T, C] float32.");
  m.def("scatter_columns", &scatter_columns, "values"_a, "ids"_a, "width"_a,
        "Rows of `width` columns, -inf but at ids[j], which holds values[..., j]: float32 "
        "values [..., n], int32 ids [n] (distinct; one outside [0, width) places nothing); lazy, "
        "like any op.");
  m.def("embed_rows", &embed_rows, "table"_a, "ids"_a,
        "Rows ids[...] of a float table [V, H] (float32, bfloat16 or float16, rows contiguous) "
        "as float32 [..., H]: table[ids].astype(float32) in one op (an id outside [0, V) gives "
        "zeros); ids int32, lazy, like any op.");
  m.def("embed_quantized_rows", &embed_quantized_rows, "codes"_a, "scales"_a, "biases"_a,
        "ids"_a, "bits"_a, "group_size"_a, "interleaved"_a = false,
        "Rows ids[...] of an affine-quantized table (uint32 codes [V, W] of 2, 4 or 8 bits, "
        "scales and biases [V, groups]; interleaved: 16 rows side by side, products.interleave) "
        "as float32 [..., W * 32 / bits]: mx.dequantize of the rows, then astype(float32), bit "
        "for bit, in one op (an id outside [0, V) gives zeros); lazy, like any op.");
  m.def("swiglu", &swiglu, "gate"_a, "up"_a,
        "silu(gate) * up for float32 arrays of one shape; lazy, like any op.");
}

}  // namespace mtpserve
