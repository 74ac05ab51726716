// The mlx primitive `Attend`: a decode step's or verify's attention of T queries of each row
// over its KV cache, on the CPU in one op, its output in the layout the output projection
// takes. mlx runs it as ~14 (the grouped queries' reshape, the keys' transpose, the scores'
// product, the mask, the softmax, the values' product block by block, the sum of the blocks,
// the heads' transpose and join), each a task on its one stream thread.
//
// Query t of row b sees keys [0, ends[b] - T + t] of its cache; everything a query computes
// runs over those keys alone, in key order: its scores (norms.h's lane dot products over the
// head dimension), their maximum, the exponentials and their sum (16 lanes by key index, then
// a fixed tree), the weighted sum of the values (each dimension its own sum in key order). So
// a query's output does not depend on the keys past its own (a cache's padding), on the other
// queries of the op (a verify's positions against T plain steps) or on the other rows (a batch
// against each row alone): bit for bit.
#include <nanobind/nanobind.h>

#include <algorithm>
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


// Strides (in floats) of a [B, H, P, D] array whose last axis is contiguous.
struct Strided {
  const float* data;
  int64_t b, h, p;
  const float* at(int64_t row, int64_t head, int64_t position) const {
    return data + row * b + head * h + position * p;
  }
};

Strided strided(const mx::array& a) {
  return {a.data<float>(), a.strides()[0], a.strides()[1], a.strides()[2]};
}

// Scores (floats) a thread keeps allocated between calls: a decode step's or a chat-sized
// prompt chunk's (512 queries over 8,192 keys) stay, longer contexts' are freed after use.
constexpr size_t kKeptScores = size_t{1} << 22;

// Keys a block of the value pass takes (their values read while in cache for every query and
// every part of the head dimension), and the dimensions a query's sums keep in registers.
constexpr int64_t kKeyBlock = 128;
constexpr int64_t kDimBlock = 2 * kLanes;

// out_i += p_ij v_j for j in [first, last) of four queries' probabilities (rows of `p`, `width`
// apart) over dimensions [d0, d0 + kDimBlock): each sum in key order, as the one-query loop.
__attribute__((always_inline)) inline void weigh4(const float* p, int64_t width,
                                                  const Strided& values, int64_t row,
                                                  int64_t kv_head, int64_t first, int64_t last,
                                                  int64_t d0, float* out, int64_t dim) {
  Lanes acc[4][2];
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 2; ++c) std::memcpy(&acc[r][c], out + r * dim + d0 + c * kLanes, 64);
  for (int64_t j = first; j < last; ++j) {
    const float* v = values.at(row, kv_head, j) + d0;
    Lanes v0, v1;
    std::memcpy(&v0, v, 64);
    std::memcpy(&v1, v + kLanes, 64);
    for (int r = 0; r < 4; ++r) {
      const float pr = p[r * width + j];
      acc[r][0] = acc[r][0] + pr * v0;
      acc[r][1] = acc[r][1] + pr * v1;
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 2; ++c) std::memcpy(out + r * dim + d0 + c * kLanes, &acc[r][c], 64);
}

// o += p v over dim elements, element by element (each a sum in key order across calls).
__attribute__((always_inline)) inline void add_weighted(float* o, float p, const float* v,
                                                        int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) o[d] = o[d] + p * v[d];
}

// o += p_j v_j for j in [first, last) of one query, each dimension's sum in key order.
__attribute__((always_inline)) inline void weigh1(const float* p, const Strided& values,
                                                  int64_t row, int64_t kv_head, int64_t first,
                                                  int64_t last, float* o, int64_t dim) {
  for (int64_t j = first; j < last; ++j) add_weighted(o, p[j], values.at(row, kv_head, j), dim);
}

// weigh1 of four queries (rows of `p`, `width` apart) key by key: each value row read once,
// whole, in the order memory lies, the sums in `out` (L1) rather than in registers. The first
// four queries of a KV head take their values this way: the values come from memory, and
// weigh4's strips of a few lines from every row of a block kept a 0.8B head's values (6,000
// positions, out of every cache) at ~8 GB/s a thread.
__attribute__((always_inline)) inline void weigh4_rows(const float* p, int64_t width,
                                                       const Strided& values, int64_t row,
                                                       int64_t kv_head, int64_t first,
                                                       int64_t last, float* out, int64_t dim) {
  for (int64_t j = first; j < last; ++j) {
    const float* v = values.at(row, kv_head, j);
    for (int r = 0; r < 4; ++r) add_weighted(out + r * dim, p[r * width + j], v, dim);
  }
}

// Scores of keys [j, j + C) against the first `fours` queries, four queries at a time
// (dots_by: the queries read once for C keys, one shuffle tree a key as for one); a score past a
// query's limit is written and never read.
template <int C>
__attribute__((always_inline)) inline void score_fours(const float* q, int64_t fours,
                                                       const Strided& keys, int64_t row,
                                                       int64_t kv_head, int64_t j, int64_t dim,
                                                       float* scores, int64_t width) {
  const float* k[C];
  for (int c = 0; c < C; ++c) k[c] = keys.at(row, kv_head, j + c);
  for (int64_t i = 0; i < fours; i += 4) {
    const float* rows[4] = {q + i * dim, q + (i + 1) * dim, q + (i + 2) * dim, q + (i + 3) * dim};
    float s[C][4];
    dots_by<4, C>(rows, k, dim, s);
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < 4; ++r) scores[(i + r) * width + j + c] = s[c][r];
  }
}

// The queries of one row that share a KV head (`count` of them, query i at q + i * dim, seeing
// keys j < limits[i], writing out + i * dim): out_i = softmax(q_i . k_j) . v_j. Each key and
// value vector is read once for all of them; every query's own sums run in key order. Four
// queries go together where they can (a decode step's grouped heads, a verify's positions):
// the same operations on the same values, interleaved.
MTPSERVE_VECTOR_CLONES void attend_group(const float* q, const int64_t* limits, int64_t count,
                                         const Strided& keys, const Strided& values,
                                         int64_t row, int64_t kv_head, int64_t dim,
                                         std::vector<float>& scores, float* out) {
  int64_t most = 0;
  for (int64_t i = 0; i < count; ++i) most = std::max(most, limits[i]);
  const int64_t width = (most + kLanes - 1) / kLanes * kLanes;
  scores.resize(count * width);
  std::fill(out, out + count * dim, 0.0f);
  const int64_t fours = count / 4 * 4;  // queries taken four at a time
  // and keys four at a time where several fours of queries read them (a verify's positions, a
  // prompt's): four keys' rows side by side slowed a decode step's four queries, whose scores
  // wait on reading the cache, over 8,000 positions from 1.3-1.8 to 2.2-2.4 ms
  const int64_t key_fours = fours >= 8 ? most / 4 * 4 : 0;
  for (int64_t j = 0; j < most; ++j) {
    if (j >= key_fours)
      score_fours<1>(q, fours, keys, row, kv_head, j, dim, scores.data(), width);
    else if (j % 4 == 0)
      score_fours<4>(q, fours, keys, row, kv_head, j, dim, scores.data(), width);
    const float* k = keys.at(row, kv_head, j);
    for (int64_t i = fours; i < count; ++i)
      if (j < limits[i]) scores[i * width + j] = lane_dot(q + i * dim, k, dim);
  }
  for (int64_t i = 0; i < count; ++i) {
    const int64_t limit = limits[i];
    if (limit <= 0) continue;
    float* s = scores.data() + i * width;
    float top = -INFINITY;
    for (int64_t j = 0; j < limit; ++j) top = std::max(top, s[j]);
    Lanes sums{};
    for (int64_t j = 0; j < limit; j += kLanes) {
      const int64_t lanes = std::min<int64_t>(kLanes, limit - j);
      Lanes e = exp_poly(lanes_from(s + j, lanes) - top);
      for (int64_t l = lanes; l < kLanes; ++l) e[l] = 0.0f;
      sums += e;
      lanes_to(s + j, e, lanes);
    }
    const float inverse = 1.0f / reduce(sums);
    for (int64_t j = 0; j < limit; ++j) s[j] = s[j] * inverse;
  }
  // the values: four queries' sums over the keys they all see. The first four take each value
  // row whole, key by key, from memory (weigh4_rows); the others (a verify's positions, a
  // prompt's) keep their sums in registers over the same block of keys, now in cache, before
  // the next block (one pass of every four over all the keys streamed a verify's values five
  // times). Then each query's own last keys (a verify's later positions see a few more) and
  // the queries left over, one at a time, continuing the same sums in key order.
  int64_t i = 0;
  if (dim % kDimBlock == 0) {
    thread_local std::vector<int64_t> common;
    common.resize(fours / 4);
    int64_t widest = 0;
    for (int64_t f = 0; f < fours; f += 4) {
      common[f / 4] = std::min({limits[f], limits[f + 1], limits[f + 2], limits[f + 3]});
      widest = std::max(widest, common[f / 4]);
    }
    for (int64_t j0 = 0; j0 < widest; j0 += kKeyBlock)
      for (int64_t f = 0; f < fours; f += 4) {
        const int64_t last = std::min(common[f / 4], j0 + kKeyBlock);
        if (j0 >= last) continue;
        if (f == 0) {
          weigh4_rows(scores.data(), width, values, row, kv_head, j0, last, out, dim);
          continue;
        }
        for (int64_t d0 = 0; d0 < dim; d0 += kDimBlock)
          weigh4(scores.data() + f * width, width, values, row, kv_head, j0, last, d0,
                 out + f * dim, dim);
      }
    for (; i < fours; i += 4)
      for (int r = 0; r < 4; ++r)
        weigh1(scores.data() + (i + r) * width, values, row, kv_head,
               std::max<int64_t>(common[i / 4], 0), limits[i + r], out + (i + r) * dim, dim);
  }
  for (; i < count; ++i)
    weigh1(scores.data() + i * width, values, row, kv_head, 0, limits[i], out + i * dim, dim);
}

void attend_all(std::vector<mx::array>& in, mx::array& out) {
  thread_local std::vector<float> q_scratch;
  const float* q = packed(in[0], q_scratch);  // [B, Hq, T, D]: a KV head's queries adjacent
  const Strided keys = strided(in[1]), values = strided(in[2]);
  const mx::array& ends = in[3];
  const int64_t B = in[0].shape(0), Hq = in[0].shape(1), T = in[0].shape(2), D = in[0].shape(3);
  const int64_t Hkv = in[1].shape(1), P = in[1].shape(2);
  const int64_t group = Hq / Hkv, count = group * T;
  float* y = out.data<float>();
  const auto unit = [&](int64_t u) {  // (row, KV head)
    thread_local std::vector<float> scores;
    thread_local std::vector<int64_t> limits;
    const int64_t row = u / Hkv, kv_head = u % Hkv;
    const int64_t end = ends.data<int32_t>()[row * ends.strides()[0]];
    limits.resize(count);
    for (int64_t i = 0; i < count; ++i)  // query i: head kv_head * group + i / T, position i % T
      limits[i] = std::clamp<int64_t>(end - T + i % T + 1, 0, P);
    thread_local std::vector<float> outs;
    outs.resize(count * D);
    const int64_t at = (row * Hq + kv_head * group) * T * D;
    attend_group(q + at, limits.data(), count, keys, values, row, kv_head, D, scores,
                 outs.data());
    // a prompt chunk's scores over a long context (a 128-position chunk's 512 queries of a
    // 0.8B KV head over 32,768 keys: 64 MiB) are not kept by the thread between calls
    if (scores.capacity() > kKeptScores) std::vector<float>().swap(scores);
    for (int64_t i = 0; i < count; ++i) {  // to [B, T, Hq * D]: the heads of a position joined
      const int64_t head = kv_head * group + i / T, t = i % T;
      std::memcpy(y + ((row * T + t) * Hq + head) * D, outs.data() + i * D, D * sizeof(float));
    }
  };
  const int64_t units = B * Hkv;
  const Kernels kernels = current_kernels();
  // a unit's work: two passes over its keys (scores, values) for each of its queries
  if (kernels.pool->threads() == 1 || units * count * P * D < (1 << 16)) {
    for (int64_t u = 0; u < units; ++u) unit(u);
    return;
  }
  kernels.pool->share(units, unit);
}

class Attend : public mx::UnaryPrimitive {
 public:
  explicit Attend(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    std::vector<mx::array> outputs{output};
    dispatch(stream(), inputs, outputs, [](auto& in, auto& out) { attend_all(in, out[0]); });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("Attend runs on the CPU only");
  }
  const char* name() const override { return "Attend"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& q = inputs[0];
    return {{q.shape(0), q.shape(2), q.shape(1) * q.shape(3)}};
  }
};

mx::array attend(const mx::array& queries, const mx::array& keys, const mx::array& values,
                 const mx::array& ends) {
  auto stream = cpu_stream("attend");
  if (queries.dtype() != mx::float32 || keys.dtype() != mx::float32 ||
      values.dtype() != mx::float32 || queries.ndim() != 4 || keys.ndim() != 4 ||
      values.shape() != keys.shape())
    throw std::invalid_argument(
        "attend: float32 queries [B, Hq, T, D], keys and values [B, Hkv, P, D]");
  if (keys.shape(0) != queries.shape(0) || keys.shape(3) != queries.shape(3) ||
      keys.shape(1) == 0 || queries.shape(1) % keys.shape(1) != 0)
    throw std::invalid_argument("attend: the operands' shapes disagree");
  if (ends.dtype() != mx::int32 || ends.shape() != mx::Shape{queries.shape(0)})
    throw std::invalid_argument("attend: ends must be int32 [B]");
  // the kernel reads keys and values through their strides, each position's vector in place
  const mx::array k = keys.strides()[3] == 1 ? keys : mx::contiguous(keys, false, stream);
  const mx::array v = values.strides()[3] == 1 ? values : mx::contiguous(values, false, stream);
  mx::Shape shape{queries.shape(0), queries.shape(2), queries.shape(1) * queries.shape(3)};
  return mx::array(std::move(shape), mx::float32, std::make_shared<Attend>(stream),
                   {queries, k, v, ends});
}

// The primitive `WritePositions`: a KV cache's new positions written into its buffer where it
// lies. mlx's own slice update copies the whole buffer unless nothing else holds it, and in a
// decode loop that evaluates step n + 1 while step n runs, step n's tasks still hold it: every
// step copied every attention layer's cache, a cost that grew with the context (the demo model
// at 3,000 positions: 1.8 against 1.1 ms a token at 30). The output shares the input's memory
// and the write runs as a task on the stream's one thread: tasks run in the order they were
// handed out, so every op handed out before it has read the buffer by then, and every op after
// it reads the write. The caller owns that the buffer is its cache's alone (no view of it kept
// elsewhere that a later write would change), and that a write lands past every position
// something not yet handed out still reads (engine/model/attention.py, `RowKVCache`).
void write_into(mx::array& buffer, const mx::array& update, const mx::array& positions) {
  thread_local std::vector<int32_t> scratch;
  const int32_t* at = packed_ints(positions, scratch);  // [B, T]
  const int64_t B = buffer.shape(0), H = buffer.shape(1), P = buffer.shape(2), D = buffer.shape(3);
  const int64_t T = update.shape(2);
  const auto& s = update.strides();
  const float* src = update.data<float>();
  float* dst = buffer.data<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p = at[b * T + t];
      if (p < 0 || p >= P) continue;  // never asked for: the caller reserves every position
      for (int64_t h = 0; h < H; ++h) {
        const float* from = src + b * s[0] + h * s[1] + t * s[2];
        float* to = dst + ((b * H + h) * P + p) * D;
        if (s[3] == 1) {
          std::memcpy(to, from, D * sizeof(float));
        } else {
          for (int64_t d = 0; d < D; ++d) to[d] = from[d * s[3]];
        }
      }
    }
}

class WritePositions : public mx::UnaryPrimitive {
 public:
  explicit WritePositions(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    const mx::array& buffer = inputs[0];
    // a buffer that is a view (not row-contiguous) is copied first, into a buffer of its own
    const bool in_place = buffer.flags().row_contiguous;
    if (in_place)
      output.copy_shared_buffer(buffer);
    else
      output.set_data(mx::allocator::malloc(output.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(output);
    hand_out(stream(), [out = mx::array::unsafe_weak_copy(output),
                      from = mx::array::unsafe_weak_copy(buffer),
                      update = mx::array::unsafe_weak_copy(inputs[1]),
                      positions = mx::array::unsafe_weak_copy(inputs[2]), in_place]() mutable {
      if (!in_place) {
        const int64_t dim = from.shape(3);
        widen_rows(from, static_cast<int64_t>(from.size()) / dim, dim, dim, out.data<float>());
      }
      write_into(out, update, positions);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("WritePositions runs on the CPU only");
  }
  const char* name() const override { return "WritePositions"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

mx::array write_positions(const mx::array& buffer, const mx::array& update,
                          const mx::array& positions) {
  auto stream = cpu_stream("write_positions");
  if (buffer.dtype() != mx::float32 || update.dtype() != mx::float32 || buffer.ndim() != 4 ||
      update.ndim() != 4)
    throw std::invalid_argument(
        "write_positions: float32 buffer [B, H, P, D] and update [B, H, T, D]");
  if (update.shape(0) != buffer.shape(0) || update.shape(1) != buffer.shape(1) ||
      update.shape(3) != buffer.shape(3))
    throw std::invalid_argument("write_positions: the update's shape disagrees with the buffer's");
  if (positions.dtype() != mx::int32 ||
      positions.shape() != mx::Shape{update.shape(0), update.shape(2)})
    throw std::invalid_argument("write_positions: positions must be int32 [B, T]");
  return mx::array(buffer.shape(), mx::float32, std::make_shared<WritePositions>(stream),
                   {buffer, update, positions});
}

}  // namespace

void bind_attention(nb::module_& m) {
  m.def("write_positions", &write_positions, "buffer"_a, "update"_a, "positions"_a,
        "buffer [B, H, P, D] (float32, row-contiguous) with update[b, :, t] at position "
        "positions[b, t] (int32 [B, T]), written where the buffer lies: the result shares its "
        "memory. The caller owns that nothing else reads the positions it writes after the "
        "write (the module's notes), lazy, like any op.");
  m.def("attend", &attend, "queries"_a, "keys"_a, "values"_a, "ends"_a,
        "softmax(q . k) . v for queries [B, Hq, T, D] (scaled) over keys and values "
        "[B, Hkv, P, D] (grouped-query heads), query t of row b seeing keys up to position "
        "ends[b] - T + t; float32 [B, T, Hq * D] (each position's heads joined, as the output "
        "projection takes them), lazy, like any op.");
}

}  // namespace mtpserve
