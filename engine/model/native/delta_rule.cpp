// The mlx primitives `DeltaRule` (a Gated-DeltaNet layer's recurrence over the T positions of a
// decode step or a verify, on the CPU by the row kernels of delta_rule_impl.h) and
// `DeltaReplay` (the state after each row's kept positions, from what the forward pass left).
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "kernels.h"
#include "mlx/primitives.h"
#include "primitive.h"

namespace mx = mlx::core;
namespace nb = nanobind;
using namespace nb::literals;

namespace mtpserve {
namespace {

// A recurrence of fewer multiply-adds a position than this runs on the calling thread alone:
// waking a worker costs more than it gives.
constexpr int64_t kParallelWork = 1 << 17;

// `a` as packed fp32 with std::exp applied (the decay from its log).
void pack_exp(const mx::array& a, std::vector<float>& dst) {
  pack(a, dst);
  for (float& x : dst) x = std::exp(x);
}

// Each `dim`-vector of `x` scaled to unit length, x / sqrt(sum x^2 + eps), then times `scale`
// (the layer's l2 norm of its query and key heads; the sum in a fixed order).
void l2_normalize(std::vector<float>& x, int64_t dim, float eps, float scale) {
  for (size_t first = 0; first < x.size(); first += dim) {
    float* v = x.data() + first;
    float sum = 0.0f;
    for (int64_t i = 0; i < dim; ++i) sum += v[i] * v[i];
    const float factor = scale / std::sqrt(sum + eps);
    for (int64_t i = 0; i < dim; ++i) v[i] *= factor;
  }
}

void run_units(DeltaKernel kernel, const Kernels& kernels, const DeltaArgs& args) {
  const int64_t units = delta_units(args);
  const int64_t work = args.B * args.Hv * args.Dv * args.Dk;
  if (kernels.pool->threads() == 1 || work < kParallelWork) {
    kernel(args, 0, units);
    return;
  }
  kernels.pool->share(units, [&](int64_t unit) { kernel(args, unit, unit + 1); });
}

// k [B, T, Hk, Dk], or [B, T, Hk * Dk] with its heads joined (Dk from the state [B, Hv, Dv, Dk]).
DeltaArgs shape_of(const mx::array& k, const mx::array& state) {
  DeltaArgs args{};
  args.B = k.shape(0);
  args.T = k.shape(1);
  args.Dk = k.ndim() == 4 ? k.shape(3) : state.shape(3);
  args.Hk = k.ndim() == 4 ? k.shape(2) : k.shape(2) / state.shape(3);
  args.Hv = state.shape(1);
  args.Dv = state.shape(2);
  return args;
}

void forward(std::vector<mx::array>& in, std::vector<mx::array>& out, float eps) {
  thread_local std::vector<float> q, k, v, g, beta, state;
  DeltaArgs args = shape_of(in[1], in[5]);
  pack(in[0], q);
  pack(in[1], k);
  l2_normalize(q, args.Dk, eps, 1.0f / std::sqrt(static_cast<float>(args.Dk)));
  l2_normalize(k, args.Dk, eps, 1.0f);
  pack(in[2], v);
  pack_exp(in[3], g);
  pack(in[4], beta);
  args.q = q.data();
  args.k = k.data();
  args.v = v.data();
  args.g = g.data();
  args.beta = beta.data();
  args.state = packed(in[5], state);
  args.y = out[0].data<float>();
  args.u_out = out[1].data<float>();
  args.final = out[2].data<float>();
  const Kernels kernels = current_kernels();
  run_units(kernels.delta, kernels, args);
}

// `forward` from what a Gated-DeltaNet layer has before its recurrence: its conv's output
// [B, T, q | k | v] (key heads Hk of Dk, then the value heads), the projections a and b
// [B, T, Hv], the layer's A_log and dt_bias [Hv]; beta = sigmoid(b) and the log-decay
// log g = -exp(A_log) * softplus(a + dt_bias) here (written out: the replay takes it), so the
// layer needs no ops of its own to split, shape and gate them.
void forward_layer(std::vector<mx::array>& in, std::vector<mx::array>& out, float eps,
                   int key_heads) {
  thread_local std::vector<float> conv, q, k, v, a, b, a_log, dt_bias, g, beta, state;
  const mx::array& s = in[5];
  DeltaArgs args{};
  args.B = in[0].shape(0);
  args.T = in[0].shape(1);
  args.Hk = key_heads;
  args.Hv = s.shape(1);
  args.Dv = s.shape(2);
  args.Dk = s.shape(3);
  const int64_t rows = args.B * args.T, key = args.Hk * args.Dk, value = args.Hv * args.Dv;
  const float* c = packed(in[0], conv);
  q.resize(rows * key);
  k.resize(rows * key);
  v.resize(rows * value);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = c + r * (2 * key + value);
    std::memcpy(q.data() + r * key, row, key * sizeof(float));
    std::memcpy(k.data() + r * key, row + key, key * sizeof(float));
    std::memcpy(v.data() + r * value, row + 2 * key, value * sizeof(float));
  }
  l2_normalize(q, args.Dk, eps, 1.0f / std::sqrt(static_cast<float>(args.Dk)));
  l2_normalize(k, args.Dk, eps, 1.0f);
  const float* ap = packed(in[1], a);
  const float* bp = packed(in[2], b);
  const float* decay_log = packed(in[3], a_log);
  const float* bias = packed(in[4], dt_bias);
  float* log_g = out[3].data<float>();
  g.resize(rows * args.Hv);
  beta.resize(rows * args.Hv);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < args.Hv; ++h) {
      const int64_t i = r * args.Hv + h;
      const float x = ap[i] + bias[h];
      const float softplus = std::max(x, 0.0f) + std::log1p(std::exp(-std::fabs(x)));
      log_g[i] = -std::exp(decay_log[h]) * softplus;
      g[i] = std::exp(log_g[i]);  // as pack_exp makes it of log_g: the replay's decay
      beta[i] = 1.0f / (1.0f + std::exp(-bp[i]));
    }
  args.q = q.data();
  args.k = k.data();
  args.v = v.data();
  args.g = g.data();
  args.beta = beta.data();
  args.state = packed(s, state);
  args.y = out[0].data<float>();
  args.u_out = out[1].data<float>();
  args.final = out[2].data<float>();
  const Kernels kernels = current_kernels();
  run_units(kernels.delta, kernels, args);
}

void replay(std::vector<mx::array>& in, mx::array& out, float eps) {
  thread_local std::vector<float> k, u, g, state;
  thread_local std::vector<int32_t> keep;
  DeltaArgs args = shape_of(in[1], in[0]);
  pack(in[1], k);
  l2_normalize(k, args.Dk, eps, 1.0f);
  pack(in[2], u);
  pack_exp(in[3], g);
  const mx::array& kept = in[4];
  keep.resize(args.B);
  for (int64_t b = 0; b < args.B; ++b)  // clamped: a count out of range keeps what exists
    keep[b] = std::clamp<int32_t>(kept.data<int32_t>()[b * kept.strides()[0]], 0,
                                  static_cast<int32_t>(args.T));
  args.k = k.data();
  args.u = u.data();
  args.g = g.data();
  args.keep = keep.data();
  args.state = packed(in[0], state);
  args.final = out.data<float>();
  const Kernels kernels = current_kernels();
  run_units(kernels.replay, kernels, args);
}

// y and u [B, T, Hv, Dv], the final state, log g [B, T, Hv]: the layer form of DeltaRule.
std::vector<mx::Shape> layer_output_shapes(const mx::array& conv, const mx::array& a,
                                           const mx::array& state) {
  const mx::Shape values{conv.shape(0), conv.shape(1), state.shape(1), state.shape(2)};
  return {values, values, state.shape(), a.shape()};
}

// The recurrence over T positions: from q, k, v, log g, beta and the state (`key_heads` 0:
// `forward`; outputs y, u, the final state), or from a layer's conv output, a, b, A_log,
// dt_bias and the state (`key_heads` its key heads: `forward_layer`; log g a fourth output).
class DeltaRule : public mx::Primitive {
 public:
  DeltaRule(mx::Stream stream, float eps, int key_heads)
      : mx::Primitive(stream), eps_(eps), key_heads_(key_heads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch(stream(), inputs, outputs, [eps = eps_, heads = key_heads_](auto& in, auto& out) {
      if (heads > 0)
        forward_layer(in, out, eps, heads);
      else
        forward(in, out, eps);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("DeltaRule runs on the CPU only");
  }
  const char* name() const override { return "DeltaRule"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DeltaRule&>(other);
    return eps_ == o.eps_ && key_heads_ == o.key_heads_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    if (key_heads_ > 0) return layer_output_shapes(inputs[0], inputs[1], inputs[5]);
    return {inputs[2].shape(), inputs[2].shape(), inputs[5].shape()};
  }

 private:
  float eps_;
  int key_heads_;
};

class DeltaReplay : public mx::UnaryPrimitive {
 public:
  DeltaReplay(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    std::vector<mx::array> outputs{output};
    dispatch(stream(), inputs, outputs,
             [eps = eps_](auto& in, auto& out) { replay(in, out[0], eps); });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("DeltaReplay runs on the CPU only");
  }
  const char* name() const override { return "DeltaReplay"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const DeltaReplay&>(other).eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float eps_;
};

void check_float(const mx::array& a, const char* name) {
  try {
    real_of(a.dtype());
  } catch (const std::invalid_argument&) {
    throw std::invalid_argument(std::string(name) + " must be float32, bfloat16 or float16");
  }
}

// The shapes both primitives share: k [B, T, Hk, Dk], per-value-head [B, T, Hv, Dv] (v or u),
// log_g [B, T, Hv], state [B, Hv, Dv, Dk] float32.
void check_shapes(const mx::array& k, const mx::array& values, const mx::array& log_g,
                  const mx::array& state) {
  if (k.ndim() != 4 || values.ndim() != 4 || log_g.ndim() != 3 || state.ndim() != 4)
    throw std::invalid_argument(
        "delta rule: k [B, T, Hk, Dk], v [B, T, Hv, Dv], log_g [B, T, Hv], state [B, Hv, Dv, Dk]");
  const int B = k.shape(0), T = k.shape(1), Hk = k.shape(2), Dk = k.shape(3);
  const int Hv = values.shape(2), Dv = values.shape(3);
  if (values.shape(0) != B || values.shape(1) != T || log_g.shape() != mx::Shape{B, T, Hv} ||
      state.shape() != mx::Shape{B, Hv, Dv, Dk})
    throw std::invalid_argument("delta rule: the operands' shapes disagree");
  if (Hk == 0 || Hv % Hk != 0)
    throw std::invalid_argument("delta rule: value heads must be a multiple of key heads");
  if (state.dtype() != mx::float32) throw std::invalid_argument("delta rule: state must be float32");
  check_float(k, "k");
  check_float(values, "v");
  check_float(log_g, "log_g");
}

std::vector<mx::array> delta_rule(const mx::array& q, const mx::array& k, const mx::array& v,
                                  const mx::array& log_g, const mx::array& beta,
                                  const mx::array& state, float eps) {
  auto stream = cpu_stream("the gated delta rule kernel");
  check_shapes(k, v, log_g, state);
  if (q.shape() != k.shape()) throw std::invalid_argument("delta rule: q and k disagree");
  if (beta.shape() != log_g.shape()) throw std::invalid_argument("delta rule: beta [B, T, Hv]");
  check_float(q, "q");
  check_float(beta, "beta");
  return mx::array::make_arrays({v.shape(), v.shape(), state.shape()},
                                {mx::float32, mx::float32, mx::float32},
                                std::make_shared<DeltaRule>(stream, eps, 0),
                                {q, k, v, log_g, beta, state});
}

std::vector<mx::array> delta_rule_layer(const mx::array& conv, const mx::array& a,
                                        const mx::array& b, const mx::array& a_log,
                                        const mx::array& dt_bias, const mx::array& state,
                                        int key_heads, float eps) {
  auto stream = cpu_stream("the gated delta rule kernel");
  if (conv.ndim() != 3 || a.ndim() != 3 || state.ndim() != 4 || key_heads <= 0)
    throw std::invalid_argument(
        "delta rule: conv [B, T, C], a and b [B, T, Hv], state [B, Hv, Dv, Dk], key_heads > 0");
  const int B = conv.shape(0), T = conv.shape(1);
  const int Hv = state.shape(1), Dv = state.shape(2), Dk = state.shape(3);
  if (conv.shape(2) != 2 * key_heads * Dk + Hv * Dv || a.shape() != mx::Shape{B, T, Hv} ||
      b.shape() != a.shape() || a_log.shape() != mx::Shape{Hv} ||
      dt_bias.shape() != mx::Shape{Hv} || state.shape(0) != B)
    throw std::invalid_argument("delta rule: the operands' shapes disagree");
  if (Hv % key_heads != 0)
    throw std::invalid_argument("delta rule: value heads must be a multiple of key heads");
  if (state.dtype() != mx::float32) throw std::invalid_argument("delta rule: state must be float32");
  check_float(conv, "conv");
  check_float(a, "a");
  check_float(b, "b");
  check_float(a_log, "A_log");
  check_float(dt_bias, "dt_bias");
  auto shapes = layer_output_shapes(conv, a, state);
  return mx::array::make_arrays(std::move(shapes),
                                {mx::float32, mx::float32, mx::float32, mx::float32},
                                std::make_shared<DeltaRule>(stream, eps, key_heads),
                                {conv, a, b, a_log, dt_bias, state});
}

mx::array delta_rule_replay(const mx::array& state, const mx::array& k, const mx::array& u,
                            const mx::array& log_g, const mx::array& keep, float eps) {
  auto stream = cpu_stream("the gated delta rule kernel");
  // the keys as a verify's conv left them, their heads joined: split here, not by a copy
  const bool joined = k.ndim() == 3 && state.ndim() == 4 && state.shape(3) > 0 &&
                      k.shape(2) % state.shape(3) == 0;
  check_shapes(joined ? mx::reshape(k, {k.shape(0), k.shape(1), k.shape(2) / state.shape(3),
                                        state.shape(3)})
                      : k,
               u, log_g, state);
  if (keep.dtype() != mx::int32 || keep.shape() != mx::Shape{k.shape(0)})
    throw std::invalid_argument("delta rule replay: keep must be int32 [B]");
  return mx::array(state.shape(), mx::float32, std::make_shared<DeltaReplay>(stream, eps),
                   {state, k, u, log_g, keep});
}

}  // namespace

void bind_delta_rule(nb::module_& m) {
  m.def("delta_rule", &delta_rule, "q"_a, "k"_a, "v"_a, "log_g"_a, "beta"_a, "state"_a,
        "eps"_a = 1e-6f,
        "A Gated-DeltaNet layer's recurrence over T positions, row by row of the state: "
        "q, k [B, T, Hk, Dk] as the layer's conv emits them (each head vector is scaled to "
        "x / sqrt(sum x^2 + eps), q also by Dk^-0.5), v [B, T, Hv, Dv], log_g, beta [B, T, Hv], "
        "state [B, Hv, Dv, Dk] float32. Returns y and u [B, T, Hv, Dv] and the state after the "
        "last position (float32); lazy, like any op.");
  m.def("delta_rule_layer", &delta_rule_layer, "conv"_a, "a"_a, "b"_a, "a_log"_a, "dt_bias"_a,
        "state"_a, "key_heads"_a, "eps"_a = 1e-6f,
        "delta_rule from a Gated-DeltaNet layer's own tensors: its conv's output conv "
        "[B, T, q | k | v] (key_heads heads of Dk = state's last size, then the value heads), "
        "a and b [B, T, Hv], A_log and dt_bias [Hv], state [B, Hv, Dv, Dk] float32; beta = "
        "sigmoid(b), log_g = -exp(A_log) * softplus(a + dt_bias). Returns y, u, the final state "
        "and log_g (what delta_rule_replay takes, with k the conv's slice); lazy.");
  m.def("delta_rule_replay", &delta_rule_replay, "state"_a, "k"_a, "u"_a, "log_g"_a, "keep"_a,
        "eps"_a = 1e-6f,
        "The state after each row's first keep[b] positions, from the state before them and "
        "delta_rule's k (as given to it, or [B, T, Hk * Dk] with its heads joined), u and "
        "log_g: bit for bit the state delta_rule computed there.");
}

}  // namespace mtpserve
