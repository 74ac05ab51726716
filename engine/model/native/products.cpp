// The mlx primitive `RowsProduct` (y = x @ W^T on the CPU by our own kernel), the choice of
// kernel and thread count, and the Python module.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <sched.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#endif

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "exp.h"
#include "kernels.h"
#include "norms.h"
#include "primitive.h"

namespace mx = mlx::core;
namespace nb = nanobind;
using namespace nb::literals;

namespace mtpserve {

// -- scalar half conversions (the kernels' tails and the portable kernel) --------------------

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(man & 0x400u)) {
      man <<= 1;
      --exp;
    }
    u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_half(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to infinity
  if (abs < 0x38800000u) {  // subnormal or zero in half
    if (abs < 0x33000000u) return sign;
    const uint32_t exp = abs >> 23;
    const uint32_t man = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;
    uint32_t half = man >> (shift + 1);
    const uint32_t rest = man & ((1u << (shift + 1)) - 1u);
    const uint32_t mid = 1u << shift;
    if (rest > mid || (rest == mid && (half & 1u))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t r = abs - 0x38000000u;  // rebias the exponent
  r += 0xfffu + ((r >> 13) & 1u);
  return sign | static_cast<uint16_t>(r >> 13);
}

namespace {

// -- the kernel and the pool in use ---------------------------------------------------------

struct Isa {
  const char* name;
  ColumnsKernel kernel;
  DeltaKernel delta;
  DeltaKernel replay;
  bool (*supported)();
};

bool always() { return true; }
#if defined(__x86_64__) || defined(_M_X64)
bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c");
}
bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
bool has_avx512_vnni() {
  return has_avx512() && __builtin_cpu_supports("avx512vnni");
}
#ifdef MTPSERVE_AMX
bool has_amx() {
  return has_avx512_vnni() && amx_usable();
}
#endif
#endif

// Best first: the first one the CPU runs is the default.
const Isa kIsas[] = {
#ifdef MTPSERVE_AMX
    {"avx512-amx", columns_amx, delta_avx512_vnni, replay_avx512_vnni, has_amx},
#endif
#if defined(__x86_64__) || defined(_M_X64)
    {"avx512-vnni", columns_avx512_vnni, delta_avx512_vnni, replay_avx512_vnni, has_avx512_vnni},
    {"avx512", columns_avx512, delta_avx512, replay_avx512, has_avx512},
    {"avx2", columns_avx2, delta_avx2, replay_avx2, has_avx2},
#endif
#if defined(__aarch64__)
    {"neon", columns_neon, delta_neon, replay_neon, always},
#endif
    {"scalar", columns_scalar, delta_scalar, replay_scalar, always},
};

std::mutex state_lock;
const Isa* current_isa = nullptr;
std::shared_ptr<ThreadPool> current_pool;

int usable_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::atoi(v);
}

// Microseconds a worker spins for the next product before it sleeps. Short: between a step's
// products mlx's stream thread runs other ops, and a spinning worker holds a core that the
// Python thread building the next step needs (demo model, 2 cores, in-process alternations:
// 50 us cost plain greedy decoding 12-19% and K=3 8-12% against 5-20 us; at the 0.8B shape
// the spin made no difference).
int spin_us() {
  return std::max(0, env_int("MTPSERVE_SPIN_US", 10));
}

const Isa* find_isa(const std::string& name) {
  for (const auto& isa : kIsas)
    if (name == isa.name) return &isa;
  return nullptr;
}

void set_isa_locked(const std::string& name) {
  if (name.empty()) {
    for (const auto& isa : kIsas)
      if (isa.supported()) {
        current_isa = &isa;
        return;
      }
  }
  const Isa* isa = find_isa(name);
  if (isa == nullptr) throw std::invalid_argument("unknown instruction set: " + name);
  if (!isa->supported()) throw std::invalid_argument("this CPU lacks " + name);
  current_isa = isa;
}

void ensure_state() {
  if (current_isa != nullptr) return;
  const char* forced = std::getenv("MTPSERVE_PRODUCTS_ISA");
  set_isa_locked(forced ? forced : "");
  const int threads = env_int("MTPSERVE_THREADS", 0);
  current_pool = std::make_shared<ThreadPool>(threads > 0 ? threads : usable_cores(), spin_us());
}


}  // namespace

Real real_of(mx::Dtype t) {
  if (t == mx::float32) return Real::f32;
  if (t == mx::bfloat16) return Real::bf16;
  if (t == mx::float16) return Real::f16;
  throw std::invalid_argument("the kernels take float32, bfloat16 or float16 arrays");
}

Kernels current_kernels() {
  std::lock_guard<std::mutex> guard(state_lock);
  ensure_state();
  return {current_isa->kernel, current_isa->delta, current_isa->replay, current_pool};
}

namespace {

// Products over less weight than this run on the calling thread alone: waking a worker costs
// more than it gives.
constexpr int64_t kParallelBytes = 64 << 10;


// How one weight of a product is stored: dense (`bits` 0) or affine-quantized; `inputs` is
// how many of the primitive's inputs it takes (1, or 3 with its scales and biases).
struct WeightSpec {
  int bits;
  int group;
  bool interleaved = false;  // WeightView::interleaved
  int inputs() const { return bits > 0 ? 3 : 1; }
  bool operator==(const WeightSpec&) const = default;
};

WeightView view_of(const mx::array* weight, const WeightSpec& spec, int64_t in, int64_t out) {
  WeightView view{};
  const mx::array& w = weight[0];
  if (spec.bits > 0) {
    view.kind = WeightKind::affine;
    view.scales = weight[1].data<void>();
    view.biases = weight[2].data<void>();
    view.scale_type = real_of(weight[1].dtype());
    view.bits = spec.bits;
    view.group = spec.group;
    view.interleaved = spec.interleaved;
  } else {
    view.kind = static_cast<WeightKind>(static_cast<int>(real_of(w.dtype())));
  }
  view.data = w.data<void>();
  view.out = out;
  view.in = in;
  return view;
}

// What a product does around its multiplications: its input RMS-normed first (the norm's
// weight an input of the primitive), the residual (an input too) added to its one output.
struct ProductExtras {
  bool norm = false;
  float eps = 0.0f;
  bool residual = false;
  bool swiglu = false;  // the input is silu(x) * up (`up` an input): an MLP's down projection
  // the input is x * sigmoid(gate) (`gate` an input of x's size, any shape and strides, read in
  // row-major order): a gated attention's output projection
  bool gated = false;
  // the input is [norm(x) | norm2(x2)] along the last axis (x2 and its norm's weight inputs):
  // the MTP head's embedding and hidden state, each with its own norm, joined for its fc
  bool joined = false;
  float eps2 = 0.0f;
  bool prompt = false;  // ProductArgs::prompt
  bool operator==(const ProductExtras&) const = default;
};

// y_i = x @ W_i^T for every weight W_i of `weights` (laid out as `specs` say), x widened once
// and every product's column blocks shared out together on the pool: the outputs are bit for
// bit those of one product per weight. With `extras`, x is first RMS-normed row by row
// (`norm_weight`; rms_normalize, the RMSNorm primitive's arithmetic) and `residual` is added to
// the one output, column block by column block: bit for bit the norm, products and add as
// separate ops.
void compute(const mx::array& x, const std::vector<mx::array>& weights,
             const std::vector<WeightSpec>& specs, const ProductExtras& extras,
             const mx::array* norm_weight, const mx::array* residual, const mx::array* up,
             const mx::array* gate, const mx::array* x2, const mx::array* norm2_weight,
             std::vector<mx::array>& ys) {
  const int64_t in1 = x.shape(-1);
  const int64_t rows = in1 == 0 ? 0 : x.size() / in1;
  if (rows == 0) return;
  const int64_t in2 = extras.joined ? x2->shape(-1) : 0;
  const int64_t in = in1 + in2;
  const int64_t stride = (in + kPad - 1) / kPad * kPad;
  thread_local std::vector<float> widened, norm_scratch, residual_scratch;
  if (widened.size() < static_cast<size_t>(rows * stride)) widened.resize(rows * stride);
  if (extras.joined) {  // each part widened and normed on its own, then side by side
    thread_local std::vector<float> first, second, w1, w2;
    const int64_t s1 = (in1 + kPad - 1) / kPad * kPad, s2 = (in2 + kPad - 1) / kPad * kPad;
    first.resize(rows * s1);
    second.resize(rows * s2);
    widen_rows(x, rows, in1, s1, first.data());
    widen_rows(*x2, rows, in2, s2, second.data());
    const float* n1 = packed(*norm_weight, w1);
    const float* n2 = packed(*norm2_weight, w2);
    for (int64_t r = 0; r < rows; ++r) {
      float* row = widened.data() + r * stride;
      rms_normalize(first.data() + r * s1, n1, in1, extras.eps, row);
      rms_normalize(second.data() + r * s2, n2, in2, extras.eps2, row + in1);
      std::memset(row + in, 0, (stride - in) * sizeof(float));
    }
  } else {
    widen_rows(x, rows, in, stride, widened.data());
  }
  if (extras.swiglu) {  // the SwiGlu primitive's arithmetic, row by row
    thread_local std::vector<float> up_rows;
    if (up_rows.size() < static_cast<size_t>(rows * stride)) up_rows.resize(rows * stride);
    widen_rows(*up, rows, in, stride, up_rows.data());
    for (int64_t r = 0; r < rows; ++r) {
      float* row = widened.data() + r * stride;
      const float* u = up_rows.data() + r * stride;
      silu_in_place(row, in);
      for (int64_t j = 0; j < in; ++j) row[j] = row[j] * u[j];
    }
  }
  if (extras.gated) {  // sigmoid's exp as silu's (exp.h), row by row
    thread_local std::vector<float> gates;
    const float* g = packed(*gate, gates);
    for (int64_t r = 0; r < rows; ++r) sigmoid_gate(widened.data() + r * stride, g + r * in, in);
  }
  if (extras.norm && !extras.joined) {
    const float* w = packed(*norm_weight, norm_scratch);
    for (int64_t r = 0; r < rows; ++r) {
      float* row = widened.data() + r * stride;
      rms_normalize(row, w, in, extras.eps, row);
    }
  }
  const float* added = extras.residual ? packed(*residual, residual_scratch) : nullptr;
  // the residual's columns [first, last) of every row added to product i's output (fp32)
  const auto add_residual = [&](size_t i, int64_t first, int64_t last) {
    if (added == nullptr) return;
    const int64_t out = ys[i].shape(-1);
    float* y = ys[i].data<float>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = first; c < last; ++c) y[r * out + c] = y[r * out + c] + added[r * out + c];
  };
  const size_t n = specs.size();
  std::vector<QuantizedRows> quantized(n);
  SharedRows shared;
  std::vector<ProductArgs> args;
  args.reserve(n);
  int64_t bytes = 0;
  const mx::array* weight = weights.data();
  for (size_t i = 0; i < n; ++i) {
    const int64_t out = ys[i].shape(-1);
    // weights of one width and group take x quantized alike: once for all of them (a layer's
    // projections of one input)
    size_t alike = 0;
    while (!(specs[alike] == specs[i])) ++alike;
    args.push_back({widened.data(), stride, static_cast<int>(rows),
                    view_of(weight, specs[i], in, out), ys[i].data<void>(),
                    real_of(ys[i].dtype()), &quantized[alike], &shared, extras.prompt});
    bytes += static_cast<int64_t>(weight->nbytes());
    weight += specs[i].inputs();
  }
  const Kernels kernels = current_kernels();
  const ColumnsKernel kernel = kernels.columns;
  const auto& pool = kernels.pool;
  const int threads = pool->threads();
  if (threads == 1 || bytes < kParallelBytes) {
    for (size_t i = 0; i < n; ++i) {
      kernel(args[i], 0, args[i].w.out);
      add_residual(i, 0, args[i].w.out);
    }
    return;
  }
  // each product's columns in blocks, all products' blocks handed out in turn: a thread that
  // the OS delays takes fewer of them, and one that has not started by the time the blocks run
  // out takes none
  std::vector<int64_t> block(n), first_block(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    const int64_t out = args[i].w.out;
    const int64_t per = (out + threads * 4 - 1) / (threads * 4);
    block[i] = std::min<int64_t>(4096, std::max<int64_t>(16, (per + 15) / 16 * 16));
    first_block[i + 1] = first_block[i] + (out + block[i] - 1) / block[i];
  }
  pool->share(first_block[n], [&](int64_t b) {
    size_t i = 0;
    while (b >= first_block[i + 1]) ++i;
    const int64_t first = (b - first_block[i]) * block[i];
    const int64_t last = std::min(args[i].w.out, first + block[i]);
    kernel(args[i], first, last);
    add_residual(i, first, last);
  });
}

// -- the primitive ------------------------------------------------------------------------------

// x @ W_i^T for one or several weights W_i that share the input x (a layer's projections of
// one normed input): inputs x, then each weight as `specs` lays it out, then the norm's weight
// and the residual where `extras` has them; one output a weight.
class RowsProduct : public mx::Primitive {
 public:
  RowsProduct(mx::Stream stream, std::vector<WeightSpec> specs, ProductExtras extras)
      : mx::Primitive(stream), specs_(std::move(specs)), extras_(extras) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    size_t weight_inputs = 0;
    for (const auto& spec : specs_) weight_inputs += spec.inputs();
    for (size_t i = 1; i <= weight_inputs; ++i)
      if (!inputs[i].flags().row_contiguous)
        throw std::invalid_argument("RowsProduct: weights must be row-contiguous");
    dispatch(stream(), inputs, outputs,
             [specs = specs_, extras = extras_, weight_inputs](auto& in, auto& out) {
               std::vector<mx::array> weights(in.begin() + 1, in.begin() + 1 + weight_inputs);
               size_t next = 1 + weight_inputs;
               const mx::array* norm = extras.norm ? &in[next++] : nullptr;
               const mx::array* residual = extras.residual ? &in[next++] : nullptr;
               const mx::array* up = extras.swiglu ? &in[next++] : nullptr;
               const mx::array* gate = extras.gated ? &in[next++] : nullptr;
               const mx::array* x2 = extras.joined ? &in[next++] : nullptr;
               const mx::array* norm2 = extras.joined ? &in[next] : nullptr;
               compute(in[0], weights, specs, extras, norm, residual, up, gate, x2, norm2, out);
             });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("RowsProduct runs on the CPU only");
  }

  const char* name() const override { return "RowsProduct"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RowsProduct&>(other);
    return specs_ == o.specs_ && extras_ == o.extras_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    std::vector<mx::Shape> shapes;
    size_t w = 1;
    for (const auto& spec : specs_) {
      mx::Shape shape = inputs[0].shape();
      shape.back() = inputs[w].shape(0);
      shapes.push_back(std::move(shape));
      w += spec.inputs();
    }
    return shapes;
  }

 private:
  std::vector<WeightSpec> specs_;
  ProductExtras extras_;
};

// One weight's operands checked against `in`, appended to `inputs`; its spec.
WeightSpec add_weight(std::vector<mx::array>& inputs, int64_t in, const mx::array& w,
                      const std::optional<mx::array>& scales,
                      const std::optional<mx::array>& biases, int bits, int group_size,
                      bool interleaved = false) {
  if (w.ndim() != 2) throw std::invalid_argument("product: x [..., in], w [out, in]");
  inputs.push_back(w);
  if (bits == 0) {
    real_of(w.dtype());
    if (w.shape(1) != in) throw std::invalid_argument("product: x and w disagree on `in`");
    return {0, 0};
  }
  if (!(bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8))
    throw std::invalid_argument("product: bits must be 2, 3, 4, 5, 6 or 8");
  if (!scales || !biases) throw std::invalid_argument("product: quantized w needs scales and biases");
  if (w.dtype() != mx::uint32) throw std::invalid_argument("product: packed w must be uint32");
  if (group_size <= 0 || in % group_size != 0 || static_cast<int64_t>(w.shape(1)) * 32 != in * bits)
    throw std::invalid_argument("product: packed w does not match in, bits and group_size");
  const mx::Shape expected{w.shape(0), static_cast<int>(in / group_size)};
  if (scales->shape() != expected || biases->shape() != expected)
    throw std::invalid_argument("product: scales and biases must be [out, in / group_size]");
  real_of(scales->dtype());
  if (biases->dtype() != scales->dtype()) throw std::invalid_argument("product: biases' type");
  if (interleaved && ((bits != 8 && bits != 4) || w.shape(0) % kInterleave != 0 ||
                      group_size % kActivationRun))
    throw std::invalid_argument("product: an interleaved weight is 4- or 8-bit, of a multiple of "
                                "16 rows and of groups of a multiple of 32");
  inputs.push_back(*scales);
  inputs.push_back(*biases);
  return {bits, group_size, interleaved};
}

std::vector<mx::array> products_of(const mx::array& x, std::vector<mx::array> inputs,
                                   std::vector<WeightSpec> specs, ProductExtras extras = {}) {
  auto stream = cpu_stream("product");
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  size_t w = 1;
  for (const auto& spec : specs) {
    mx::Shape shape = x.shape();
    shape.back() = inputs[w].shape(0);
    shapes.push_back(std::move(shape));
    dtypes.push_back(x.dtype());
    w += spec.inputs();
  }
  return mx::array::make_arrays(std::move(shapes), dtypes,
                                std::make_shared<RowsProduct>(stream, std::move(specs), extras),
                                std::move(inputs));
}

mx::array product(
    const mx::array& x,
    const mx::array& w,
    const std::optional<mx::array>& scales,
    const std::optional<mx::array>& biases,
    int bits,
    int group_size,
    bool prompt,
    bool interleaved) {
  if (x.ndim() < 1) throw std::invalid_argument("product: x [..., in], w [out, in]");
  real_of(x.dtype());
  std::vector<mx::array> inputs{x};
  std::vector<WeightSpec> specs{
      add_weight(inputs, x.shape(-1), w, scales, biases, bits, group_size, interleaved)};
  ProductExtras extras;
  extras.prompt = prompt;
  return products_of(x, std::move(inputs), std::move(specs), extras)[0];
}

// A weight as Python hands it to `products`: (w, scales, biases, bits, group_size,
// interleaved).
using WeightArgs =
    std::tuple<mx::array, std::optional<mx::array>, std::optional<mx::array>, int, int, bool>;

std::vector<mx::array> products(const mx::array& x, const std::vector<WeightArgs>& weights,
                                const std::optional<mx::array>& norm_weight, float eps,
                                const std::optional<mx::array>& residual,
                                const std::optional<mx::array>& up,
                                const std::optional<mx::array>& gate,
                                const std::optional<mx::array>& joined,
                                const std::optional<mx::array>& joined_norm_weight,
                                float joined_eps, bool prompt) {
  if (x.ndim() < 1 || weights.empty())
    throw std::invalid_argument("products: x [..., in] and at least one weight");
  real_of(x.dtype());
  const int64_t in = x.shape(-1) + (joined ? joined->shape(-1) : 0);
  std::vector<mx::array> inputs{x};
  std::vector<WeightSpec> specs;
  for (const auto& [w, scales, biases, bits, group, interleaved] : weights)
    specs.push_back(add_weight(inputs, in, w, scales, biases, bits, group, interleaved));
  ProductExtras extras;
  extras.prompt = prompt;
  if (norm_weight) {
    if (x.dtype() != mx::float32 || norm_weight->ndim() != 1 || norm_weight->shape(0) != x.shape(-1))
      throw std::invalid_argument("products: a norm needs float32 x [..., in] and weight [in]");
    real_of(norm_weight->dtype());
    extras.norm = true;
    extras.eps = eps;
    inputs.push_back(*norm_weight);
  }
  if (residual) {
    mx::Shape shape = x.shape();
    shape.back() = std::get<0>(weights[0]).shape(0);
    if (weights.size() != 1 || x.dtype() != mx::float32 || residual->dtype() != mx::float32 ||
        residual->shape() != shape)
      throw std::invalid_argument("products: a residual needs one weight, float32 x and a "
                                  "float32 residual of the output's shape");
    extras.residual = true;
    inputs.push_back(*residual);
  }
  if (up) {
    if (norm_weight || x.dtype() != mx::float32 || up->dtype() != mx::float32 ||
        up->shape() != x.shape())
      throw std::invalid_argument("products: up needs float32 x and up of one shape, no norm");
    extras.swiglu = true;
    inputs.push_back(*up);
  }
  if (gate) {
    if (norm_weight || up || x.dtype() != mx::float32 || gate->dtype() != mx::float32 ||
        gate->size() != x.size())
      throw std::invalid_argument(
          "products: gate needs float32 x and a float32 gate of x's size, no norm, no up");
    extras.gated = true;
    inputs.push_back(*gate);
  }
  if (joined) {
    mx::Shape lead = x.shape(), lead2 = joined->shape();
    lead.pop_back();
    lead2.pop_back();
    if (!norm_weight || !joined_norm_weight || up || joined->dtype() != mx::float32 ||
        lead != lead2 || joined_norm_weight->ndim() != 1 ||
        joined_norm_weight->shape(0) != joined->shape(-1))
      throw std::invalid_argument(
          "products: joined needs float32 rows like x's, both norms' weights, no up");
    real_of(joined_norm_weight->dtype());
    extras.joined = true;
    extras.eps2 = joined_eps;
    inputs.push_back(*joined);
    inputs.push_back(*joined_norm_weight);
  }
  return products_of(x, std::move(inputs), std::move(specs), extras);
}

// Seconds to read every byte of `a` once on the pool's threads (each reading its own slices):
// the memory bandwidth the product kernel is measured against.
// Reads a block of words as the kernel reads an fp32 weight: tiles of kStreams rows of 4 KiB
// read side by side, the next tile prefetched, folded into independent accumulators (16-byte
// loads where every x86-64 CPU has them).
uint64_t read_block(const uint64_t* words, int64_t n) {
  constexpr int kStreams = 8;
  constexpr int64_t kRow = 512;  // words
  constexpr int64_t kTile = kStreams * kRow;
  const int64_t tiles = n / kTile;
  uint64_t folded = 0;
#if defined(__x86_64__) || defined(_M_X64)
  __m128i acc[kStreams][2] = {};
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t i = 0; i < kRow; i += 8)
      for (int s = 0; s < kStreams; ++s) {
        const uint64_t* p = words + t * kTile + s * kRow + i;
        __builtin_prefetch(p + kTile, 0, 2);
        const auto* v = reinterpret_cast<const __m128i*>(p);
        acc[s][0] = _mm_xor_si128(acc[s][0], _mm_xor_si128(_mm_loadu_si128(v), _mm_loadu_si128(v + 1)));
        acc[s][1] = _mm_xor_si128(acc[s][1], _mm_xor_si128(_mm_loadu_si128(v + 2), _mm_loadu_si128(v + 3)));
      }
  for (auto& stream : acc)
    for (const __m128i& v : stream)
      folded ^= static_cast<uint64_t>(_mm_cvtsi128_si64(v)) ^
          static_cast<uint64_t>(_mm_cvtsi128_si64(_mm_unpackhi_epi64(v, v)));
#else
  uint64_t acc[kStreams][8] = {};
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t i = 0; i < kRow; i += 8)
      for (int s = 0; s < kStreams; ++s) {
        const uint64_t* p = words + t * kTile + s * kRow + i;
        __builtin_prefetch(p + kTile, 0, 2);
        for (int w = 0; w < 8; ++w) acc[s][w] ^= p[w];
      }
  for (auto& stream : acc)
    for (uint64_t v : stream) folded ^= v;
#endif
  for (int64_t i = tiles * kTile; i < n; ++i) folded ^= words[i];
  return folded;
}

double read_seconds(const mx::array& a) {
  mx::eval(a);
  const auto* words = a.data<uint64_t>();
  const int64_t count = static_cast<int64_t>(a.nbytes() / 8);
  const auto pool = current_kernels().pool;
  constexpr int64_t kBlock = 1 << 16;  // words: 512 KiB a block
  const int64_t blocks = (count + kBlock - 1) / kBlock;
  std::atomic<uint64_t> sink{0};
  const auto start = std::chrono::steady_clock::now();
  pool->share(blocks, [&](int64_t b) {
    sink.fetch_xor(read_block(words + b * kBlock, std::min(count, (b + 1) * kBlock) - b * kBlock),
                   std::memory_order_relaxed);
  });
  const auto seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start);
  if (sink.load() == 0x5eed) std::abort();  // keeps the reads
  return seconds.count();
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (const auto& isa : kIsas)
    if (isa.supported()) names.emplace_back(isa.name);
  return names;
}

}  // namespace
}  // namespace mtpserve

NB_MODULE(_products, m) {
  using namespace mtpserve;
  m.doc() = "mtpserve's CPU kernels for the few rows of decoding: products and the gated delta rule";
  bind_delta_rule(m);
  bind_norms(m);
  bind_elementwise(m);
  bind_attention(m);
  bind_sampler(m);
  bind_tape(m);
  m.def(
      "product",
      &product,
      "x"_a,
      "w"_a,
      "scales"_a = nb::none(),
      "biases"_a = nb::none(),
      "bits"_a = 0,
      "group_size"_a = 0,
      "prompt"_a = false,
      "interleaved"_a = false,
      "x @ w.T for w [out, in] in float32/bfloat16/float16, or mlx's affine-quantized layout "
      "(packed uint32 codes with scales and biases, as mx.quantize writes); lazy, like any op. "
      "prompt: a prefill's product, whose path may differ from decoding's (the same for every "
      "row count). interleaved: a 4- or 8-bit weight laid out by "
      "engine.model.products.interleave.");
  m.def(
      "products",
      &products,
      "x"_a,
      "weights"_a,
      "norm_weight"_a = nb::none(),
      "eps"_a = 0.0f,
      "residual"_a = nb::none(),
      "up"_a = nb::none(),
      "gate"_a = nb::none(),
      "joined"_a = nb::none(),
      "joined_norm_weight"_a = nb::none(),
      "joined_eps"_a = 0.0f,
      "prompt"_a = false,
      "[x @ w.T for each weight] in one op: each weight a tuple (w, scales, biases, bits, "
      "group_size, interleaved) as `product` takes them (None, None, 0, 0, False for a float "
      "weight); the outputs "
      "are bit for bit `product`'s. With norm_weight, x is first RMS-normed as rms_norm(x, "
      "norm_weight, eps) does; with up, the input is swiglu(x, up); with gate, x * sigmoid(gate) "
      "(gate of x's size, read in row-major order); with joined (and its norm), "
      "the input is [rms_norm(x) | rms_norm(joined)] along the last axis; with residual (one "
      "weight), it is added to the output: bit for bit the separate ops.");
  m.def("isa", [] {
    std::lock_guard<std::mutex> guard(state_lock);
    ensure_state();
    return std::string(current_isa->name);
  }, "The instruction set the kernel runs.");
  m.def("read_seconds", &read_seconds, "a"_a,
        "Seconds to read every byte of `a` once on the kernel's threads (memory bandwidth).");
  m.def("wait_helping", [](const std::vector<mx::array>& arrays) {
    const auto pool = current_kernels().pool;
    mx::async_eval(arrays);  // an array not yet scheduled would never be computed
    nb::gil_scoped_release release;
    if (pool->threads() == 1) {  // no job is ever posted: spinning would only take a core
      mx::eval(arrays);
      return 0;
    }
    return pool->help_until([&] {
      for (const auto& a : arrays)
        if (!a.is_available()) return false;
      return true;
    });
  }, "arrays"_a,
        "Evaluates the arrays, the calling thread taking a share of the kernel's parallel work "
        "(products, attention, the delta rule) posted meanwhile where mx.eval would sleep; "
        "returns the number of jobs it joined.");
  m.def("supported_isas", &supported_isas, "The instruction sets this CPU runs, best first.");
  m.def("set_isa", [](const std::string& name) {
    std::lock_guard<std::mutex> guard(state_lock);
    ensure_state();
    set_isa_locked(name);
  }, "name"_a, "Run the kernel of instruction set `name` ('' for the best this CPU has).");
  m.def("threads", [] {
    std::lock_guard<std::mutex> guard(state_lock);
    ensure_state();
    return current_pool->threads();
  }, "Threads a product runs on (the calling thread included).");
  m.def("set_threads", [](int threads) {
    if (threads < 1) throw std::invalid_argument("threads must be at least 1");
    std::lock_guard<std::mutex> guard(state_lock);
    ensure_state();
    current_pool = std::make_shared<mtpserve::ThreadPool>(threads, spin_us());
  }, "threads"_a, "Run products on `threads` threads (the calling thread included).");
}
