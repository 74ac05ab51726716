// The mlx primitives `TopKTruncate` and `RowsArgmax`.
//
// `TopKTruncate`: each row's truncated distribution (temperature, then top_k,
// top_p and min_p, each renormalised) over its k candidates, and optionally one inverse-CDF
// draw from it, in one op on the CPU. mlx's formulation of the same (sampling/distribution.py)
// is ~45 primitives — a blocked top-k, sorts, softmax, cumulative sums, scatters — and every
// primitive is a task on mlx's one stream thread: a sampled plain step spent ~0.2 ms of a
// ~1.2 ms step on them with the demo model.
//
// The rules are sampling/distribution.py's, row by row and independent of the other rows:
//   candidates  the k largest logits (ties: the lower token id), in increasing token order;
//   softmax     of candidate / temperature, less its largest, summed in token order;
//   top_p       in decreasing probability (ties: the lower column first), keep a candidate
//               while the mass before it (running sum less itself) is below top_p;
//   min_p       keep a candidate of at least min_p times the largest probability;
//   draw        column i at uniform u iff cdf[i-1] <= u * cdf[-1] < cdf[i] (cdf the running
//               sum in column order), never past the last column with mass.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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

struct Truncation {
  float temperature;
  int top_k;
  float top_p;
  float min_p;
  bool draw;
  bool operator==(const Truncation&) const = default;
};

// Rows this wide and more are shared out over the pool's threads (a vocabulary); narrower
// ones run on the stream's thread.
constexpr int64_t kShareColumns = 32768;

// A block of candidates' logits: scanned as vectors of 16 (GCC's vector extensions, lowered to
// the instruction set of each clone), where a loop over elements stayed scalar.
constexpr int kBlock = 128;
typedef float Floats16 __attribute__((vector_size(64)));
typedef int32_t Ints16 __attribute__((vector_size(64)));

// Whether any of x[0..kBlock) exceeds `threshold` (one comparison per block, not per element).
inline bool any_above(const float* x, float threshold) {
  Floats16 top, v;
  for (int j = 0; j < 16; ++j) top[j] = threshold;  // NaNs never replace it
  for (int b = 0; b < kBlock; b += 16) {
    std::memcpy(&v, x + b, sizeof v);
    top = v > top ? v : top;
  }
  const Ints16 above = top > threshold;
  int32_t any = 0;
  for (int j = 0; j < 16; ++j) any |= above[j];
  return any != 0;
}

// The k largest of x[0..n) (ties: the lower index) into ids and values, in no order. A NaN
// counts as -inf. One pass: a value enters only if it beats the smallest of the k so far, and
// blocks in which none does are skipped whole.
MTPSERVE_VECTOR_CLONES void select_top_k(const float* x, int64_t n, int k, int32_t* ids, float* values) {
  auto key = [](float v) { return std::isnan(v) ? -std::numeric_limits<float>::infinity() : v; };
  for (int j = 0; j < k; ++j) {
    ids[j] = j;
    values[j] = key(x[j]);
  }
  // the candidate to evict: the smallest, and of equal ones the later token
  auto smallest = [&] {
    int m = 0;
    for (int j = 1; j < k; ++j)
      if (values[j] < values[m] || (values[j] == values[m] && ids[j] > ids[m])) m = j;
    return m;
  };
  int m = smallest();
  // later tokens enter only by a strictly larger value: a tie keeps the earlier token
  auto consider = [&](int64_t i) {
    if (x[i] > values[m]) {
      values[m] = x[i];
      ids[m] = static_cast<int32_t>(i);
      m = smallest();
    }
  };
  int64_t i = k;
  for (; i < n && i % kBlock; ++i) consider(i);
  for (; i + kBlock <= n; i += kBlock)
    if (any_above(x + i, values[m]))
      for (int b = 0; b < kBlock; ++b) consider(i + b);
  for (; i < n; ++i) consider(i);
}

// p[0..k) /= its sum (in column order)
void renormalise(float* p, int k) {
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) sum += p[j];
  for (int j = 0; j < k; ++j) p[j] = p[j] / sum;
}

// One row: probs and ids [k], and the drawn token when `uniform` is given.
void truncate_row(const float* logits, int64_t vocab, const Truncation& t, float* probs,
                  int32_t* ids, const float* uniform, int32_t* token) {
  const int k = t.top_k;
  thread_local std::vector<float> values;
  thread_local std::vector<int32_t> picked, order;
  values.resize(k);
  picked.resize(k);
  order.resize(k);
  select_top_k(logits, vocab, k, picked.data(), values.data());
  for (int j = 0; j < k; ++j) order[j] = j;
  std::sort(order.begin(), order.end(), [&](int a, int b) { return picked[a] < picked[b]; });
  float largest = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < k; ++j) {
    ids[j] = picked[order[j]];
    probs[j] = values[order[j]] / t.temperature;
    largest = std::max(largest, probs[j]);
  }
  for (int j = 0; j < k; ++j) probs[j] = std::exp(probs[j] - largest);
  renormalise(probs, k);
  if (t.top_p < 1.0f) {
    for (int j = 0; j < k; ++j) order[j] = j;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return probs[a] > probs[b]; });
    float running = 0.0f;
    thread_local std::vector<char> keep;
    keep.assign(k, 0);
    for (int j = 0; j < k; ++j) {
      const float p = probs[order[j]];
      running = running + p;
      keep[order[j]] = (running - p) < t.top_p;
    }
    for (int j = 0; j < k; ++j)
      if (!keep[j]) probs[j] = 0.0f;
    renormalise(probs, k);
  }
  if (t.min_p > 0.0f) {
    float top = probs[0];
    for (int j = 1; j < k; ++j) top = std::max(top, probs[j]);
    const float threshold = t.min_p * top;
    for (int j = 0; j < k; ++j)
      if (!(probs[j] >= threshold)) probs[j] = 0.0f;
    renormalise(probs, k);
  }
  if (uniform == nullptr) return;
  thread_local std::vector<float> cdf;
  cdf.resize(k);
  float running = 0.0f;
  for (int j = 0; j < k; ++j) cdf[j] = running = running + probs[j];
  const float target = *uniform * cdf[k - 1];
  int index = 0;
  for (int j = 0; j < k; ++j) index += cdf[j] <= target;
  int last = k - 1;  // the last column with mass (the last column if none has any)
  while (last > 0 && !(probs[last] > 0.0f)) --last;
  if (!(probs[last] > 0.0f)) last = k - 1;
  *token = ids[std::min(index, last)];
}

void truncate_rows(std::vector<mx::array>& in, std::vector<mx::array>& out, const Truncation& t) {
  thread_local std::vector<float> scratch, uniforms;
  const mx::array& logits = in[0];
  const int64_t rows = logits.shape(0);
  const int64_t vocab = logits.shape(1);
  const float* x = packed(logits, scratch);
  const float* u = t.draw ? packed(in[1], uniforms) : nullptr;
  float* probs = out[0].data<float>();
  int32_t* ids = out[1].data<int32_t>();
  int32_t* tokens = t.draw ? out[2].data<int32_t>() : nullptr;
  auto row = [&](int64_t r) {
    truncate_row(x + r * vocab, vocab, t, probs + r * t.top_k, ids + r * t.top_k,
                 u ? u + r : nullptr, tokens ? tokens + r : nullptr);
  };
  if (rows > 1 && vocab >= kShareColumns)
    current_kernels().pool->share(rows, row);
  else
    for (int64_t r = 0; r < rows; ++r) row(r);
}

class TopKTruncate : public mx::Primitive {
 public:
  TopKTruncate(mx::Stream stream, Truncation t) : mx::Primitive(stream), t_(t) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch(stream(), inputs, outputs, [t = t_](auto& in, auto& out) { truncate_rows(in, out, t); });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("TopKTruncate runs on the CPU only");
  }
  const char* name() const override { return "TopKTruncate"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return t_ == static_cast<const TopKTruncate&>(other).t_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const int rows = inputs[0].shape(0);
    if (t_.draw) return {{rows, t_.top_k}, {rows, t_.top_k}, {rows}};
    return {{rows, t_.top_k}, {rows, t_.top_k}};
  }

 private:
  Truncation t_;
};

std::vector<mx::array> top_k_truncate(const mx::array& logits, float temperature, int top_k,
                                      float top_p, float min_p,
                                      const std::optional<mx::array>& uniforms) {
  auto stream = cpu_stream("top_k_truncate");
  if (logits.ndim() != 2) throw std::invalid_argument("top_k_truncate: logits must be [T, V]");
  real_of(logits.dtype());
  const int rows = logits.shape(0);
  if (top_k < 1 || top_k >= logits.shape(1))
    throw std::invalid_argument("top_k_truncate: top_k must lie in [1, V)");
  if (!(temperature > 0.0f)) throw std::invalid_argument("top_k_truncate: temperature must be > 0");
  std::vector<mx::array> inputs{logits};
  const Truncation t{temperature, top_k, top_p, min_p, uniforms.has_value()};
  std::vector<mx::Shape> shapes{{rows, top_k}, {rows, top_k}};
  std::vector<mx::Dtype> types{mx::float32, mx::int32};
  if (uniforms) {
    if (uniforms->ndim() != 1 || uniforms->shape(0) != rows)
      throw std::invalid_argument("top_k_truncate: uniforms must be [T]");
    real_of(uniforms->dtype());
    inputs.push_back(*uniforms);
    shapes.push_back({rows});
    types.push_back(mx::int32);
  }
  return mx::array::make_arrays(std::move(shapes), std::move(types),
                                std::make_shared<TopKTruncate>(stream, t), std::move(inputs));
}

// The index of each row's largest value along the last axis (ties: the first; NaN counts as
// -inf), int32: mlx's CPU argmax walks a row one element at a time (~0.23 ms a 248,320-token
// row, 1.2 ms for a verify's five), this scans it in blocks as the top-k selection does.
class RowsArgmax : public mx::UnaryPrimitive {
 public:
  explicit RowsArgmax(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    std::vector<mx::array> outputs{output};
    dispatch(stream(), inputs, outputs, [](std::vector<mx::array>& in, std::vector<mx::array>& out) {
      thread_local std::vector<float> scratch;
      const int64_t width = in[0].shape(-1);
      const int64_t rows = width == 0 ? 0 : static_cast<int64_t>(in[0].size()) / width;
      const float* x = packed(in[0], scratch);
      int32_t* ids = out[0].data<int32_t>();
      auto row = [&](int64_t r) {
        float value;
        select_top_k(x + r * width, width, 1, ids + r, &value);
      };
      if (rows > 1 && width >= kShareColumns)
        current_kernels().pool->share(rows, row);
      else
        for (int64_t r = 0; r < rows; ++r) row(r);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("RowsArgmax runs on the CPU only");
  }
  const char* name() const override { return "RowsArgmax"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& shape = inputs[0].shape();
    return {mx::Shape(shape.begin(), shape.end() - 1)};
  }
};

mx::array argmax(const mx::array& x) {
  auto stream = cpu_stream("argmax");
  if (x.ndim() < 1 || x.shape(-1) < 1) throw std::invalid_argument("argmax: x must be [..., V]");
  real_of(x.dtype());
  const auto& shape = x.shape();
  return mx::array(mx::Shape(shape.begin(), shape.end() - 1), mx::int32,
                   std::make_shared<RowsArgmax>(stream), {x});
}

}  // namespace

void bind_sampler(nb::module_& m) {
  m.def("top_k_truncate", &top_k_truncate, "logits"_a, "temperature"_a, "top_k"_a, "top_p"_a,
        "min_p"_a, "uniforms"_a = nb::none(),
        "Each row of logits [T, V] (any float type) truncated as sampling/distribution.py "
        "truncates it with top_k in [1, V): [probs [T, k] float32, ids [T, k] int32 in "
        "increasing order], and with uniforms [T] also [tokens [T] int32], row t's inverse-CDF "
        "draw at uniforms[t]. Lazy, like any op; rows independent of each other.");
  m.def("argmax", &argmax, "x"_a,
        "The index of the largest value along the last axis of x [..., V] (any float type; "
        "ties: the first, NaN counted as -inf): int32 [...]. Lazy, like any op.");
}

}  // namespace mtpserve
