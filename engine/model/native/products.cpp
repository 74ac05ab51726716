// The mlx primitive `RowsProduct` (y = x @ W^T on the CPU by our own kernel), the choice of
// kernel and thread count, and the Python module.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
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
#include "kernels.h"
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
#endif

// Best first.
const Isa kIsas[] = {
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

// Microseconds a worker spins for the next product before it sleeps.
int spin_us() {
  return std::max(0, env_int("MTPSERVE_SPIN_US", 50));
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


void compute(
    const mx::array& x,
    const std::vector<mx::array>& weight,
    int bits,
    int group,
    mx::array& y) {
  const mx::array& w = weight[0];
  const int64_t in = x.shape(-1);
  const int64_t rows = in == 0 ? 0 : x.size() / in;
  const int64_t out = y.shape(-1);
  if (rows == 0 || out == 0) return;
  WeightView view{};
  if (bits > 0) {
    view.kind = WeightKind::affine;
    view.scales = weight[1].data<void>();
    view.biases = weight[2].data<void>();
    view.scale_type = real_of(weight[1].dtype());
    view.bits = bits;
    view.group = group;
  } else {
    view.kind = static_cast<WeightKind>(static_cast<int>(real_of(w.dtype())));
  }
  view.data = w.data<void>();
  view.out = out;
  view.in = in;
  const int64_t stride = (in + kPad - 1) / kPad * kPad;
  thread_local std::vector<float> widened;
  if (widened.size() < static_cast<size_t>(rows * stride)) widened.resize(rows * stride);
  widen_rows(x, rows, in, stride, widened.data());
  QuantizedRows quantized;
  ProductArgs args{widened.data(), stride, static_cast<int>(rows), view, y.data<void>(),
                   real_of(y.dtype()), &quantized};
  const Kernels kernels = current_kernels();
  const ColumnsKernel kernel = kernels.columns;
  const auto& pool = kernels.pool;
  const int threads = pool->threads();
  if (threads == 1 || static_cast<int64_t>(w.nbytes()) < kParallelBytes) {
    kernel(args, 0, out);
    return;
  }
  // columns in blocks handed out in turn: a thread that the OS delays takes fewer of them, and
  // one that has not started by the time the blocks run out takes none
  const int64_t per = (out + threads * 4 - 1) / (threads * 4);
  const int64_t block = std::min<int64_t>(4096, std::max<int64_t>(16, (per + 15) / 16 * 16));
  const int64_t blocks = (out + block - 1) / block;
  pool->share(blocks,
              [&](int64_t b) { kernel(args, b * block, std::min(out, (b + 1) * block)); });
}

// -- the primitive ------------------------------------------------------------------------------

class RowsProduct : public mx::UnaryPrimitive {
 public:
  RowsProduct(mx::Stream stream, int bits, int group)
      : mx::UnaryPrimitive(stream), bits_(bits), group_(group) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    for (size_t i = 1; i < inputs.size(); ++i)
      if (!inputs[i].flags().row_contiguous)
        throw std::invalid_argument("RowsProduct: weights must be row-contiguous");
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> weight;
    for (size_t i = 0; i < inputs.size(); ++i) {
      encoder.set_input_array(inputs[i]);
      if (i > 0) weight.push_back(mx::array::unsafe_weak_copy(inputs[i]));
    }
    encoder.set_output_array(out);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]),
                      weight = std::move(weight),
                      y = mx::array::unsafe_weak_copy(out),
                      bits = bits_,
                      group = group_]() mutable { compute(x, weight, bits, group, y); });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("RowsProduct runs on the CPU only");
  }

  const char* name() const override { return "RowsProduct"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RowsProduct&>(other);
    return bits_ == o.bits_ && group_ == o.group_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int bits_;
  int group_;
};

mx::array product(
    const mx::array& x,
    const mx::array& w,
    const std::optional<mx::array>& scales,
    const std::optional<mx::array>& biases,
    int bits,
    int group_size) {
  auto stream = cpu_stream("product");
  if (x.ndim() < 1 || w.ndim() != 2) throw std::invalid_argument("product: x [..., in], w [out, in]");
  real_of(x.dtype());
  const int64_t in = x.shape(-1);
  std::vector<mx::array> inputs{x, w};
  if (bits == 0) {
    real_of(w.dtype());
    if (w.shape(1) != in) throw std::invalid_argument("product: x and w disagree on `in`");
  } else {
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
    inputs.push_back(*scales);
    inputs.push_back(*biases);
  }
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(
      std::move(shape), x.dtype(), std::make_shared<RowsProduct>(stream, bits, group_size),
      std::move(inputs));
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
  m.def(
      "product",
      &product,
      "x"_a,
      "w"_a,
      "scales"_a = nb::none(),
      "biases"_a = nb::none(),
      "bits"_a = 0,
      "group_size"_a = 0,
      "x @ w.T for w [out, in] in float32/bfloat16/float16, or mlx's affine-quantized layout "
      "(packed uint32 codes with scales and biases, as mx.quantize writes); lazy, like any op.");
  m.def("isa", [] {
    std::lock_guard<std::mutex> guard(state_lock);
    ensure_state();
    return std::string(current_isa->name);
  }, "The instruction set the kernel runs.");
  m.def("read_seconds", &read_seconds, "a"_a,
        "Seconds to read every byte of `a` once on the kernel's threads (memory bandwidth).");
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
