// The mlx primitives `TopKTruncate`, `RowsArgmax` and `AcceptCandidates` (the sampler's
// work on CPUs, each one op where mlx's formulation is dozens).
//
// `TopKTruncate`: each row's truncated distribution (temperature, then top_k,
// top_p and min_p, each renormalised) over its k candidates, and optionally one inverse-CDF
// draw from it, in one op on the CPU. mlx's formulation of the same (sampling/distribution.py)
// is ~45 primitives — a blocked top-k, sorts, softmax, cumulative sums, scatters — and every
// primitive is a task on mlx's one stream thread: a sampled plain step spent ~0.2 ms of a
// ~1.2 ms step on them with the demo model.
//
// The rules are sampling/distribution.py's, row by row and independent of the other rows:
//   candidates  the k largest logits (ties: the lower token id; a NaN counts as -inf), in
//               increasing token order. Here alone the two formulations part: mlx's
//               argpartition may keep either of logits tied at the k-th place and gives a NaN
//               no defined place; a process runs one formulation for every draw, so such a
//               row is resolved one way throughout;
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

// row(r) for each of `rows` rows `width` wide: over the pool's threads when there are several
// rows of at least kShareColumns, else one after another on the calling thread.
template <class Row>
void for_each_row(int64_t rows, int64_t width, const Row& row) {
  if (rows > 1 && width >= kShareColumns)
    current_kernels().pool->share(rows, row);
  else
    for (int64_t r = 0; r < rows; ++r) row(r);
}

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
// counts as -inf. One pass over a heap of the k so far whose top is the one to evict (the
// smallest, of equal ones the later token): a value enters only if it beats that one, in
// O(log k), and blocks in which none does are skipped whole. (Re-finding the smallest by a
// scan after each entry made a request's large top_k cost O(V k): seconds a row.)
MTPSERVE_VECTOR_CLONES void select_top_k(const float* x, int64_t n, int k, int32_t* ids, float* values) {
  struct Candidate {
    float value;
    int32_t id;
  };
  // a "less than" b when a is the better candidate, so that the heap's top is the worst
  const auto better = [](const Candidate& a, const Candidate& b) {
    return a.value > b.value || (a.value == b.value && a.id < b.id);
  };
  thread_local std::vector<Candidate> heap;
  heap.resize(k);
  for (int j = 0; j < k; ++j)
    heap[j] = {std::isnan(x[j]) ? -std::numeric_limits<float>::infinity() : x[j], j};
  std::make_heap(heap.begin(), heap.end(), better);
  // later tokens enter only by a strictly larger value: a tie keeps the earlier token
  auto consider = [&](int64_t i) {
    if (x[i] > heap.front().value) {
      std::pop_heap(heap.begin(), heap.end(), better);
      heap.back() = {x[i], static_cast<int32_t>(i)};
      std::push_heap(heap.begin(), heap.end(), better);
    }
  };
  int64_t i = k;
  for (; i < n && i % kBlock; ++i) consider(i);
  for (; i + kBlock <= n; i += kBlock)
    if (any_above(x + i, heap.front().value))
      for (int b = 0; b < kBlock; ++b) consider(i + b);
  for (; i < n; ++i) consider(i);
  for (int j = 0; j < k; ++j) {
    ids[j] = heap[j].id;
    values[j] = heap[j].value;
  }
}

// p[0..k) /= its sum (in column order)
void renormalise(float* p, int k) {
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) sum += p[j];
  for (int j = 0; j < k; ++j) p[j] = p[j] / sum;
}

// Column of `row` [W] at `uniform` by the inverse CDF, never past the last column with mass
// (sampling/distribution.py's `inverse_cdf_index`): a truncated row's draw and the acceptance
// rule's emitted token both take it, so the two draw alike.
int inverse_cdf_column(const float* row, int width, float uniform) {
  thread_local std::vector<float> cdf;
  cdf.resize(width);
  float running = 0.0f;
  for (int j = 0; j < width; ++j) cdf[j] = running = running + row[j];
  const float target = uniform * cdf[width - 1];
  int index = 0;
  for (int j = 0; j < width; ++j) index += cdf[j] <= target;
  int last = width - 1;  // the last column with mass (the last column if none has any)
  while (last > 0 && !(row[last] > 0.0f)) --last;
  if (!(row[last] > 0.0f)) last = width - 1;
  return std::min(index, last);
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
  if (uniform != nullptr) *token = ids[inverse_cdf_column(probs, k, *uniform)];
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
  for_each_row(rows, vocab, row);
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
// -inf, where mx.argmax may return a NaN's index: a process takes one of the two for every
// argmax), int32: mlx's CPU argmax walks a row one element at a time (~0.23 ms a
// 248,320-token row, 1.2 ms for a verify's five), this scans it in blocks as the top-k
// selection does.
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
      for_each_row(rows, width, row);
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

// sampling/acceptance.py's rule on top_k candidate rows, for one row of a batch: drafts [K],
// q and q_ids [K, W], p and p_ids [K + 1, W], uniforms [K] and [K + 1]. Accept draft i iff
// u_i q_i(d_i) < p_i(d_i), stop at the first rejection m, and draw the emitted token from the
// residual max(p_m - q_m, 0) renormalised (p_m itself where it has no mass), or from p_K after
// K acceptances. A token's probability in a row is its candidate's, or 0 outside them.
void accept_row(const int32_t* drafts, int k, int width, const float* q, const int32_t* q_ids,
                const float* p, const int32_t* p_ids, const float* u_accept, const float* u_emit,
                int32_t* n_out, int32_t* token_out) {
  // A row's ids come in increasing order (`top_k_truncate` writes them so): lookups search
  // them and the residual walks p's and q's ids side by side, O(W) where a search per
  // candidate was O(W^2) (a request's top_k of 100,000 over a large vocabulary: seconds a
  // cycle). Rows in another order are looked up one by one.
  auto sorted = [width](const int32_t* ids) {
    for (int j = 1; j < width; ++j)
      if (ids[j] <= ids[j - 1]) return false;
    return true;
  };
  auto at = [width](const float* probs, const int32_t* ids, bool in_order, int32_t token) {
    if (in_order) {
      const int32_t* found = std::lower_bound(ids, ids + width, token);
      return found != ids + width && *found == token ? probs[found - ids] : 0.0f;
    }
    for (int j = 0; j < width; ++j)
      if (ids[j] == token) return probs[j];
    return 0.0f;
  };
  int m = 0;
  for (; m < k; ++m) {
    const int64_t row = static_cast<int64_t>(m) * width;
    const float p_at = at(p + row, p_ids + row, sorted(p_ids + row), drafts[m]);
    const float q_at = at(q + row, q_ids + row, sorted(q_ids + row), drafts[m]);
    if (!(u_accept[m] * q_at < p_at)) break;
  }
  const int64_t row = static_cast<int64_t>(m) * width;
  thread_local std::vector<float> chosen;
  chosen.assign(p + row, p + row + width);
  if (m < k) {
    const int32_t* pi = p_ids + row;
    const int32_t* qi = q_ids + row;
    const bool merge = sorted(pi) && sorted(qi);
    float mass = 0.0f;
    int l = 0;  // the merge's place in q's ids
    for (int j = 0; j < width; ++j) {
      float q_here;
      if (merge) {
        while (l < width && qi[l] < pi[j]) ++l;
        q_here = l < width && qi[l] == pi[j] ? q[row + l] : 0.0f;
      } else {
        q_here = at(q + row, qi, false, pi[j]);
      }
      chosen[j] = std::max(p[row + j] - q_here, 0.0f);
      mass += chosen[j];
    }
    if (mass > 0.0f)
      for (int j = 0; j < width; ++j) chosen[j] = chosen[j] / mass;
    else
      chosen.assign(p + row, p + row + width);
  }
  *n_out = m;
  *token_out = p_ids[row + inverse_cdf_column(chosen.data(), width, u_emit[m])];
}

std::vector<mx::array> accept_candidates(const mx::array& drafts, const mx::array& q,
                                         const mx::array& q_ids, const mx::array& p,
                                         const mx::array& p_ids, const mx::array& u_accept,
                                         const mx::array& u_emit);

class AcceptCandidates : public mx::Primitive {
 public:
  explicit AcceptCandidates(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch(stream(), inputs, outputs,
             [](std::vector<mx::array>& in, std::vector<mx::array>& out) {
               thread_local std::vector<int32_t> drafts_s, q_ids_s, p_ids_s;
               thread_local std::vector<float> q_s, p_s, ua_s, ue_s;
               const int k = in[0].shape(-1);
               const int64_t rows = static_cast<int64_t>(in[0].size()) / k;
               const int width = in[1].shape(-1);
               const int32_t* drafts = packed_ints(in[0], drafts_s);
               const float* q = packed(in[1], q_s);
               const int32_t* q_ids = packed_ints(in[2], q_ids_s);
               const float* p = packed(in[3], p_s);
               const int32_t* p_ids = packed_ints(in[4], p_ids_s);
               const float* ua = packed(in[5], ua_s);
               const float* ue = packed(in[6], ue_s);
               const int64_t qs = static_cast<int64_t>(k) * width, ps = qs + width;
               for (int64_t b = 0; b < rows; ++b)
                 accept_row(drafts + b * k, k, width, q + b * qs, q_ids + b * qs, p + b * ps,
                            p_ids + b * ps, ua + b * k, ue + b * (k + 1),
                            out[0].data<int32_t>() + b, out[1].data<int32_t>() + b);
             });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("AcceptCandidates runs on the CPU only");
  }
  const char* name() const override { return "AcceptCandidates"; }
  std::pair<std::vector<mx::array>, std::vector<int>> vmap(const std::vector<mx::array>& inputs,
                                                           const std::vector<int>& axes) override;
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& drafts = inputs[0].shape();
    const mx::Shape out(drafts.begin(), drafts.end() - 1);
    return {out, out};
  }
};

std::vector<mx::array> accept_candidates(const mx::array& drafts, const mx::array& q,
                                         const mx::array& q_ids, const mx::array& p,
                                         const mx::array& p_ids, const mx::array& u_accept,
                                         const mx::array& u_emit) {
  auto stream = cpu_stream("accept_candidates");
  if (drafts.ndim() < 1 || drafts.dtype() != mx::int32)
    throw std::invalid_argument("accept_candidates: drafts must be int32 [..., K]");
  // any leading axes: the rows of a batch (or none: one row, scalar outputs)
  const mx::Shape lead(drafts.shape().begin(), drafts.shape().end() - 1);
  const int k = drafts.shape(-1);
  const int width = q.ndim() == drafts.ndim() + 1 ? q.shape(-1) : 0;
  auto with = [&lead](std::initializer_list<int> tail) {
    mx::Shape shape = lead;
    shape.insert(shape.end(), tail.begin(), tail.end());
    return shape;
  };
  if (k < 1 || width < 1 || q.shape() != with({k, width}))
    throw std::invalid_argument("accept_candidates: q must be [..., K, W], K >= 1");
  if (q_ids.shape() != q.shape() || p.shape() != with({k + 1, width}) ||
      p_ids.shape() != p.shape())
    throw std::invalid_argument(
        "accept_candidates: q_ids [..., K, W], p and p_ids [..., K + 1, W] (the same W)");
  if (u_accept.shape() != with({k}) || u_emit.shape() != with({k + 1}))
    throw std::invalid_argument("accept_candidates: uniforms [..., K] and [..., K + 1]");
  for (const auto* a : {&q, &p, &u_accept, &u_emit}) real_of(a->dtype());
  if (q_ids.dtype() != mx::int32 || p_ids.dtype() != mx::int32)
    throw std::invalid_argument("accept_candidates: ids must be int32");
  return mx::array::make_arrays({lead, lead}, {mx::int32, mx::int32},
                                std::make_shared<AcceptCandidates>(stream),
                                {drafts, q, q_ids, p, p_ids, u_accept, u_emit});
}

std::pair<std::vector<mx::array>, std::vector<int>> AcceptCandidates::vmap(
    const std::vector<mx::array>& inputs, const std::vector<int>& axes) {
  // the mapped axis first in every operand (broadcast where an operand is not mapped): the
  // op takes any leading axes as rows
  int size = 1;
  for (size_t i = 0; i < inputs.size(); ++i)
    if (axes[i] >= 0) size = inputs[i].shape(axes[i]);
  std::vector<mx::array> moved;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (axes[i] >= 0) {
      moved.push_back(mx::moveaxis(inputs[i], axes[i], 0, stream()));
    } else {
      mx::Shape shape = inputs[i].shape();
      shape.insert(shape.begin(), size);
      moved.push_back(mx::broadcast_to(mx::expand_dims(inputs[i], 0, stream()), shape, stream()));
    }
  }
  return {accept_candidates(moved[0], moved[1], moved[2], moved[3], moved[4], moved[5], moved[6]),
          {0, 0}};
}

}  // namespace

void bind_sampler(nb::module_& m) {
  m.def("top_k_truncate", &top_k_truncate, "logits"_a, "temperature"_a, "top_k"_a, "top_p"_a,
        "min_p"_a, "uniforms"_a = nb::none(),
        "Each row of logits [T, V] (any float type) truncated as sampling/distribution.py "
        "truncates it with top_k in [1, V) (logits tied at the k-th place: the lower ids "
        "kept; NaN counted as -inf): [probs [T, k] float32, ids [T, k] int32 in "
        "increasing order], and with uniforms [T] also [tokens [T] int32], row t's inverse-CDF "
        "draw at uniforms[t]. Lazy, like any op; rows independent of each other.");
  m.def("argmax", &argmax, "x"_a,
        "The index of the largest value along the last axis of x [..., V] (any float type; "
        "ties: the first, NaN counted as -inf where mx.argmax may return a NaN's index): "
        "int32 [...]. Lazy, like any op.");
  m.def("accept_candidates", &accept_candidates, "drafts"_a, "q"_a, "q_ids"_a, "p"_a, "p_ids"_a,
        "u_accept"_a, "u_emit"_a,
        "sampling/acceptance.py's rejection-sampling rule on top_k candidate rows, for B rows: "
        "drafts [B, K] int32, q and q_ids [B, K, W], p and p_ids [B, K + 1, W], uniforms [B, K] "
        "and [B, K + 1] -> [accepted counts [B], emitted tokens [B]] (int32), for any leading "
        "axes B (none: one row, scalars). Lazy, like any op, and mapped by mx.vmap.");
}

}  // namespace mtpserve
