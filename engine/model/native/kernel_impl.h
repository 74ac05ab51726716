// The product kernel, written once over a vector type `V` and compiled once per instruction
// set (kernel_*.cpp include this file inside their own namespace, with their own compiler
// flags).
//
// Layout of the work, for output columns [first, last):
// - tiles of V::J weight rows (output columns) by V::R activation rows, every (row, column)
//   sum in one vector accumulator of its own;
// - fp32, bf16 and fp16 weight rows are read where they lie (half precision widened in
//   registers: a tile's first row tile reads them from memory, the next ones from cache, and
//   prefetches the next tile's); 4- and 8-bit affine rows are read in registers too, their
//   codes summed per group and then scaled (affine_tile); other affine widths are dequantized
//   per tile into a per-thread fp32 scratch that every row tile reads from cache;
// - rows wider than kWholeRow go in chunks, the accumulators kept in a small buffer between
//   chunks (stored and loaded exactly).
// One output element's sum is the same sequence of vector FMAs over the same fp32 weight
// values (a weight widened in registers is the same number as read in place; the one partial
// vector at the end of a row is zero-filled either way) followed by the same horizontal sum,
// whatever the number of rows, the tile it sits in or the thread that runs it.

#include <algorithm>
#include <cstring>
#include <vector>

namespace mtpserve {
namespace KERNEL_NAMESPACE {

// Rows up to this wide are taken whole; wider ones in chunks of kChunk, a multiple of every
// vector width and of every group size mlx writes (32, 64, 128).
constexpr int64_t kWholeRow = 8192;
constexpr int64_t kChunk = 2048;
// Activation rows whose accumulators are kept at once; more rows run in blocks of this many.
constexpr int kBlockRows = 64;

inline int64_t round_up(int64_t n, int64_t m) {
  return (n + m - 1) / m * m;
}

// -- weight rows as fp32 vectors: where they lie, or widened in registers --------------------

template <class V>
struct F32Rows {  // fp32 rows in memory (the weight itself, or the scratch)
  const float* row[V::J];
  int64_t ahead = 0;  // bytes from a row to the same row of the next tile (0: no prefetch)
  void prefetch(int j, int64_t k) const {
    if (ahead) __builtin_prefetch(reinterpret_cast<const char*>(row[j] + k) + ahead, 0, 2);
  }
  typename V::reg load(int j, int64_t k) const { return V::load(row[j] + k); }
  typename V::reg load_tail(int j, int64_t k, int n) const {
    return V::load_partial(row[j] + k, n);
  }
};

template <class V, bool Bf16>
struct HalfRows {  // bf16 or fp16 rows, widened in registers
  const uint16_t* row[V::J];
  int64_t ahead = 0;
  void prefetch(int j, int64_t k) const {
    if (ahead && (k * 2) % 64 == 0)
      __builtin_prefetch(reinterpret_cast<const char*>(row[j] + k) + ahead, 0, 2);
  }
  typename V::reg load(int j, int64_t k) const {
    return Bf16 ? V::load_bf16(row[j] + k) : V::load_f16(row[j] + k);
  }
  typename V::reg load_tail(int j, int64_t k, int n) const {
    alignas(64) float part[V::W] = {};
    for (int i = 0; i < n; ++i)
      part[i] = Bf16 ? bf16_to_float(row[j][k + i]) : half_to_float(row[j][k + i]);
    return V::load(part);
  }
};

// 4- or 8-bit affine codes of one J-row tile, read in registers.
template <class V, int Bits>
struct AffineRows {
  const uint8_t* codes[V::J];  // each row's codes from the chunk's first element
  // the tile's scales and biases as fp32, group by group: J scales then J biases (one pointer
  // for all rows, so that the row pointers and it fit the general registers)
  const float* scale_bias;
  int64_t ahead = 0;  // bytes from a row to the same row of the next tile
  void prefetch(int j, int64_t k) const {
    if ((k * Bits / 8) % 64 == 0) __builtin_prefetch(codes[j] + k * Bits / 8 + ahead, 0, 2);
  }
};

template <class V, int RN, int JN, class Rows>
inline void tile(
    const Rows& w,
    int64_t steps,
    int tail,
    const float* x,
    int64_t x_stride,
    typename V::reg (*acc)[V::J]) {
  using reg = typename V::reg;
  constexpr int W = V::W;
  reg c[RN][JN];
  for (int r = 0; r < RN; ++r)
    for (int j = 0; j < JN; ++j) c[r][j] = acc[r][j];
  // the RN activation vectors stay in registers while each weight vector is loaded and used
  // once: RN + 1 + RN * JN registers
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t k = s * W;
    reg xv[RN];
    for (int r = 0; r < RN; ++r) xv[r] = V::load(x + r * x_stride + k);
    for (int j = 0; j < JN; ++j) {
      w.prefetch(j, k);
      const reg wj = w.load(j, k);
      for (int r = 0; r < RN; ++r) c[r][j] = V::fma(wj, xv[r], c[r][j]);
    }
  }
  if (tail) {
    const int64_t k = steps * W;
    reg xv[RN];
    for (int r = 0; r < RN; ++r) xv[r] = V::load(x + r * x_stride + k);  // zero past the end
    for (int j = 0; j < JN; ++j) {
      const reg wj = w.load_tail(j, k, tail);
      for (int r = 0; r < RN; ++r) c[r][j] = V::fma(wj, xv[r], c[r][j]);
    }
  }
  for (int r = 0; r < RN; ++r)
    for (int j = 0; j < JN; ++j) acc[r][j] = c[r][j];
}

template <class V, int RN, int JN = V::J, class Rows>
inline void tile_jn(int jn, const Rows& w, int64_t steps, int tail, const float* x, int64_t xs,
                    typename V::reg (*acc)[V::J]) {
  if constexpr (JN > 1) {
    if (jn < JN) return tile_jn<V, RN, JN - 1>(jn, w, steps, tail, x, xs, acc);
  }
  tile<V, RN, JN>(w, steps, tail, x, xs, acc);
}

template <class V, int RN = V::R, class Rows>
inline void tile_rn(int rn, int jn, const Rows& w, int64_t steps, int tail, const float* x,
                    int64_t xs, typename V::reg (*acc)[V::J]) {
  if constexpr (RN > 1) {
    if (rn < RN) return tile_rn<V, RN - 1>(rn, jn, w, steps, tail, x, xs, acc);
  }
  tile_jn<V, RN>(jn, w, steps, tail, x, xs, acc);
}

// Decodes codes [k0, k0 + n) of one affine-quantized row to fp32 in `dst` (k0 a multiple of
// the group size).
template <class V>
inline void decode_affine(const WeightView& wv, int64_t row, int64_t k0, int64_t n, float* dst) {
  const int bits = wv.bits;
  const int group = wv.group;
  const int64_t groups_per_row = wv.in / group;
  const auto* codes = static_cast<const uint8_t*>(wv.data) + row * (wv.in * bits / 8);
  for (int64_t g0 = 0; g0 < n; g0 += group) {
    const int64_t gi = row * groups_per_row + (k0 + g0) / group;
    const float scale = real_at(wv.scales, wv.scale_type, gi);
    const float bias = real_at(wv.biases, wv.scale_type, gi);
    const int64_t len = std::min<int64_t>(group, n - g0);
    const int64_t first = k0 + g0;
    for (int64_t i = 0; i < len; ++i)
      dst[g0 + i] = scale * static_cast<float>(code_at(codes, bits, first + i)) + bias;
  }
}

// Decodes elements [k0, k0 + n) of affine row `row` to fp32 in `dst`, zero up to a whole
// vector (the widths read through the scratch).
template <class V>
inline void decode_row(const WeightView& wv, int64_t row, int64_t k0, int64_t n, float* dst) {
  decode_affine<V>(wv, row, k0, n, dst);
  for (int64_t i = n, e = round_up(n, V::W); i < e; ++i) dst[i] = 0.0f;
}

// Runs every row tile of one J-row weight tile over [k0, k0 + kn).
template <class V, class Rows>
inline void row_tiles(const Rows& w, int jn, int tn, int64_t kn, const float* x, int64_t xs,
                      typename V::reg (*acc)[V::J]) {
  const int64_t steps = kn / V::W;
  const int tail = static_cast<int>(kn % V::W);
  tile_rn<V>(std::min(V::R, tn), jn, w, steps, tail, x, xs, acc);
  if (tn <= V::R) return;
  Rows cached = w;  // the first row tile brought these rows in: no more prefetching
  cached.ahead = 0;
  for (int t0 = V::R; t0 < tn; t0 += V::R)
    tile_rn<V>(std::min(V::R, tn - t0), jn, cached, steps, tail, x + t0 * xs, xs, acc + t0);
}

// n reals of `type` from element `first` of `src` as fp32 at dst[0], dst[stride], ...
inline void widen_strided(const void* src, Real type, int64_t first, int64_t n, float* dst,
                          int64_t stride) {
  switch (type) {
    case Real::f32: {
      const float* p = static_cast<const float*>(src) + first;
      for (int64_t i = 0; i < n; ++i) dst[i * stride] = p[i];
      break;
    }
    case Real::bf16: {
      const uint16_t* p = static_cast<const uint16_t*>(src) + first;
      for (int64_t i = 0; i < n; ++i) dst[i * stride] = bf16_to_float(p[i]);
      break;
    }
    default: {
      const uint16_t* p = static_cast<const uint16_t*>(src) + first;
      for (int64_t i = 0; i < n; ++i) dst[i * stride] = half_to_float(p[i]);
    }
  }
}

// One tile of RN activation rows by JN affine weight rows (from column `jb` of the J-row tile)
// over [0, groups) groups of the chunk. Per group, the codes (as floats) times x are summed
// from zero, then scaled: c += a * scale (the biases are added apart, by affine_biases). One
// output's sum is that sequence whatever the tile.
template <class V, int Bits, int RN, int JN>
inline void affine_tile(const AffineRows<V, Bits>& w, int jb, int64_t groups, int group_steps,
                        const float* x, int64_t xs, typename V::reg (*acc)[V::J]) {
  using reg = typename V::reg;
  constexpr int W = V::W;
  constexpr int J = V::J;
  reg c[RN][JN];
  for (int r = 0; r < RN; ++r)
    for (int j = 0; j < JN; ++j) c[r][j] = acc[r][jb + j];
  for (int64_t g = 0; g < groups; ++g) {
    reg a[RN][JN];
    for (int r = 0; r < RN; ++r)
      for (int j = 0; j < JN; ++j) a[r][j] = V::zero();
    if constexpr (Bits == 8) {
      for (int u = 0; u < group_steps; ++u) {
        const int64_t k = (g * group_steps + u) * W;
        reg xv[RN];
        for (int r = 0; r < RN; ++r) xv[r] = V::load(x + r * xs + k);
        for (int j = 0; j < JN; ++j) {
          w.prefetch(jb + j, k);
          const reg q = V::codes8(w.codes[jb + j] + k);
          for (int r = 0; r < RN; ++r) a[r][j] = V::fma(q, xv[r], a[r][j]);
        }
      }
    } else {
      // 2W codes at a time: the low nibbles (codes 0, 2, ...) then the high ones, against x
      // laid out to match (x_for_nibbles)
      for (int u = 0; u < group_steps; u += 2) {
        const int64_t k = (g * group_steps + u) * W;
        for (int half = 0; half < 2; ++half) {
          reg xv[RN];
          for (int r = 0; r < RN; ++r) xv[r] = V::load(x + r * xs + k + half * W);
          for (int j = 0; j < JN; ++j) {
            if (half == 0) w.prefetch(jb + j, k);
            const reg q = V::codes4(w.codes[jb + j] + k / 2, half);
            for (int r = 0; r < RN; ++r) a[r][j] = V::fma(q, xv[r], a[r][j]);
          }
        }
      }
    }
    const float* sb = w.scale_bias + g * 2 * J;
    for (int j = 0; j < JN; ++j) {
      const reg scale = V::broadcast(sb[jb + j]);
      for (int r = 0; r < RN; ++r) c[r][j] = V::fma(a[r][j], scale, c[r][j]);
    }
  }
  for (int r = 0; r < RN; ++r)
    for (int j = 0; j < JN; ++j) acc[r][jb + j] = c[r][j];
}

template <class V, int Bits, int RN, int JN>
inline void affine_tile_jn(int jn, const AffineRows<V, Bits>& w, int jb, int64_t groups,
                           int group_steps, const float* x, int64_t xs,
                           typename V::reg (*acc)[V::J]) {
  if constexpr (JN > 1) {
    if (jn < JN)
      return affine_tile_jn<V, Bits, RN, JN - 1>(jn, w, jb, groups, group_steps, x, xs, acc);
  }
  affine_tile<V, Bits, RN, JN>(w, jb, groups, group_steps, x, xs, acc);
}

// RN rows of one J-row tile: one row takes the J columns at once; more rows take them
// V::AJ at a time (each row's and column's accumulators twice over must fit the registers).
template <class V, int Bits, int RN = V::AR>
inline void affine_rows(int rn, int jn, const AffineRows<V, Bits>& w, int64_t groups,
                        int group_steps, const float* x, int64_t xs, typename V::reg (*acc)[V::J]) {
  if constexpr (RN > 1) {
    if (rn < RN)
      return affine_rows<V, Bits, RN - 1>(rn, jn, w, groups, group_steps, x, xs, acc);
    for (int jb = 0; jb < jn; jb += V::AJ)
      affine_tile_jn<V, Bits, RN, V::AJ>(std::min(V::AJ, jn - jb), w, jb, groups, group_steps,
                                          x, xs, acc);
  } else {
    affine_tile_jn<V, Bits, 1, V::J>(jn, w, 0, groups, group_steps, x, xs, acc);
  }
}

// Every row tile of one J-row tile of affine weights over [k0, k0 + kn).
template <class V, int Bits>
inline void affine_tiles(const WeightView& wv, int64_t j0, int jn, int64_t k0, int64_t kn,
                         int tn, const float* x, int64_t xs, const float* group_sums,
                         int64_t gs_stride, float* scale_bias, typename V::reg (*acc)[V::J],
                         float (*bias_acc)[V::J]) {
  const int64_t groups_per_row = wv.in / wv.group;
  const int64_t groups = kn / wv.group;
  AffineRows<V, Bits> rows{};
  rows.ahead = V::J * wv.in * Bits / 8;
  rows.scale_bias = scale_bias;
  for (int j = 0; j < jn; ++j) {
    const int64_t row = j0 + j;
    rows.codes[j] = static_cast<const uint8_t*>(wv.data) + row * (wv.in * Bits / 8) + k0 * Bits / 8;
    const int64_t g0 = row * groups_per_row + k0 / wv.group;
    widen_strided(wv.scales, wv.scale_type, g0, groups, scale_bias + j, 2 * V::J);
    widen_strided(wv.biases, wv.scale_type, g0, groups, scale_bias + V::J + j, 2 * V::J);
  }
  const int group_steps = static_cast<int>(wv.group / V::W);
  for (int t0 = 0; t0 < tn; t0 += V::AR)
    affine_rows<V, Bits>(std::min(V::AR, tn - t0), jn, rows, groups, group_steps, x + t0 * xs,
                         xs, acc + t0);
  // the biases: sum over groups of (group's sum of x) * bias, every column of the tile at once
  const float* gs = group_sums + k0 / wv.group;
  for (int t = 0; t < tn; ++t)
    for (int64_t g = 0; g < groups; ++g) {
      const float sum = gs[t * gs_stride + g];
      const float* bias = scale_bias + g * 2 * V::J + V::J;
      for (int j = 0; j < V::J; ++j) bias_acc[t][j] = __builtin_fmaf(sum, bias[j], bias_acc[t][j]);
    }
}

// x laid out for 4-bit codes: in each block of 2W elements, the even ones then the odd ones
// (the order in which a vector's low and high nibbles hold them).
template <class V>
inline void x_for_nibbles(const float* x, int64_t xs, int rows, int64_t in, float* dst) {
  constexpr int W = V::W;
  for (int t = 0; t < rows; ++t)
    for (int64_t b = 0; b < in; b += 2 * W)
      for (int l = 0; l < W; ++l) {
        dst[t * xs + b + l] = x[t * xs + b + 2 * l];
        dst[t * xs + b + W + l] = x[t * xs + b + 2 * l + 1];
      }
}

// Each row's sum of x over each group, in order: sums[t * (in / group) + g].
inline void group_sums(const float* x, int64_t xs, int rows, int64_t in, int group, float* sums) {
  const int64_t groups = in / group;
  for (int t = 0; t < rows; ++t)
    for (int64_t g = 0; g < groups; ++g) {
      float v = 0.0f;
      for (int i = 0; i < group; ++i) v += x[t * xs + g * group + i];
      sums[t * groups + g] = v;
    }
}

template <class V>
void columns(const ProductArgs& a, int64_t first, int64_t last) {
  using reg = typename V::reg;
  constexpr int R = V::R;
  constexpr int J = V::J;
  const WeightView& wv = a.w;
  const int64_t in = wv.in;
  const int64_t out = wv.out;
  const int64_t chunk = in <= kWholeRow ? in : kChunk;
  // Every row count reads the weights the same way (so rows stay bit-identical across counts):
  // floats in place or widened in registers (widening once per tile into a scratch instead
  // made bf16 products of 24 rows 3x slower), 4- and 8-bit affine codes in whole vectors per
  // group in registers, other affine widths through the scratch.
  const bool affine_in_registers = wv.kind == WeightKind::affine &&
      (wv.bits == 4 || wv.bits == 8) && wv.group % V::W == 0;
  const bool in_registers = wv.kind != WeightKind::affine || affine_in_registers;
  thread_local std::vector<float> scratch;  // J rows of one chunk, widened
  const int64_t scratch_stride = round_up(chunk, 16);
  if (!in_registers && scratch.size() < static_cast<size_t>(J * scratch_stride))
    scratch.resize(J * scratch_stride);
  thread_local std::vector<float> scale_bias;  // a tile's scales and biases of one chunk
  thread_local std::vector<float> sums;        // every row's sums of x over each group
  int64_t gs_stride = 0;
  if (affine_in_registers) {
    const size_t sb = 2 * J * (chunk / wv.group);
    if (scale_bias.size() < sb) scale_bias.resize(sb);
    gs_stride = in / wv.group;
    if (sums.size() < static_cast<size_t>(a.rows * gs_stride)) sums.resize(a.rows * gs_stride);
    group_sums(a.x, a.x_stride, a.rows, in, wv.group, sums.data());
  }
  const float* x = a.x;
  thread_local std::vector<float> nibble_x;
  if (affine_in_registers && wv.bits == 4) {
    if (nibble_x.size() < static_cast<size_t>(a.rows * a.x_stride)) nibble_x.resize(a.rows * a.x_stride);
    x_for_nibbles<V>(a.x, a.x_stride, a.rows, in, nibble_x.data());
    x = nibble_x.data();
  }
  alignas(64) reg acc[kBlockRows][J];
  float bias_acc[kBlockRows][J];  // affine: each output's sum of group sums times biases
  for (int t_begin = 0; t_begin < a.rows; t_begin += kBlockRows) {
    const int tn = std::min(kBlockRows, a.rows - t_begin);
    const float* xb = a.x + t_begin * a.x_stride;
    for (int64_t j0 = first; j0 < last; j0 += J) {
      const int jn = static_cast<int>(std::min<int64_t>(J, last - j0));
      for (int t = 0; t < tn; ++t)
        for (int j = 0; j < J; ++j) {
          acc[t][j] = V::zero();
          bias_acc[t][j] = 0.0f;
        }
      for (int64_t k0 = 0; k0 < in; k0 += chunk) {
        const int64_t kn = std::min(chunk, in - k0);
        const float* xk = xb + k0;
        if (!in_registers) {
          F32Rows<V> rows{};
          for (int j = 0; j < jn; ++j) {
            float* row = scratch.data() + j * scratch_stride;
            decode_row<V>(wv, j0 + j, k0, kn, row);
            rows.row[j] = row;
          }
          row_tiles<V>(rows, jn, tn, kn, xk, a.x_stride, acc);
        } else if (affine_in_registers) {
          const float* gs = sums.data() + t_begin * gs_stride;
          const float* xa = x + t_begin * a.x_stride + k0;
          if (wv.bits == 8)
            affine_tiles<V, 8>(wv, j0, jn, k0, kn, tn, xa, a.x_stride, gs, gs_stride,
                               scale_bias.data(), acc, bias_acc);
          else
            affine_tiles<V, 4>(wv, j0, jn, k0, kn, tn, xa, a.x_stride, gs, gs_stride,
                               scale_bias.data(), acc, bias_acc);
        } else if (wv.kind == WeightKind::f32) {
          F32Rows<V> rows{};
          rows.ahead = J * in * 4;
          for (int j = 0; j < jn; ++j)
            rows.row[j] = static_cast<const float*>(wv.data) + (j0 + j) * in + k0;
          row_tiles<V>(rows, jn, tn, kn, xk, a.x_stride, acc);
        } else {
          const auto* base = static_cast<const uint16_t*>(wv.data);
          if (wv.kind == WeightKind::bf16) {
            HalfRows<V, true> rows{};
            rows.ahead = J * in * 2;
            for (int j = 0; j < jn; ++j) rows.row[j] = base + (j0 + j) * in + k0;
            row_tiles<V>(rows, jn, tn, kn, xk, a.x_stride, acc);
          } else {
            HalfRows<V, false> rows{};
            rows.ahead = J * in * 2;
            for (int j = 0; j < jn; ++j) rows.row[j] = base + (j0 + j) * in + k0;
            row_tiles<V>(rows, jn, tn, kn, xk, a.x_stride, acc);
          }
        }
      }
      for (int t = 0; t < tn; ++t)
        for (int j = 0; j < jn; ++j)
          store_real(a.y, a.y_type, (t_begin + t) * out + j0 + j,
                     V::sum(acc[t][j]) + bias_acc[t][j]);
    }
  }
}

}  // namespace KERNEL_NAMESPACE
}  // namespace mtpserve
