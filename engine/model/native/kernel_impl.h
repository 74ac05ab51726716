// The product kernel, written once over a vector type `V` and compiled once per instruction
// set (kernel_*.cpp include this file inside their own namespace, with their own compiler
// flags).
//
// Layout of the work, for output columns [first, last):
// - tiles of V::J weight rows (output columns) by V::R activation rows, every (row, column)
//   sum in one vector accumulator of its own;
// - the input dimension in chunks of kChunk: a chunk of J weight rows (decoded to fp32 in an
//   L1-sized scratch when the weight is not fp32) is read from memory once and then multiplied
//   by every activation row from cache. Accumulators are kept in a small buffer between chunks
//   (stored and loaded exactly), so a product of many rows reads its weights once.
// One element's accumulation is the same sequence of vector FMAs (chunk boundaries at multiples
// of the vector width, the one partial vector at the end of the row, zero-filled) followed by
// the same horizontal sum, whatever the number of rows, the tile it sits in or the thread.

#include <algorithm>
#include <cstring>

namespace mtpserve {
namespace KERNEL_NAMESPACE {

// Weight columns per chunk: a multiple of every vector width and of every group size mlx
// writes (32, 64, 128), small enough that J decoded rows stay in L1.
constexpr int64_t kChunk = 512;
// Activation rows whose accumulators are kept at once; more rows run in blocks of this many.
constexpr int kBlockRows = 64;

inline int64_t round_up(int64_t n, int64_t m) {
  return (n + m - 1) / m * m;
}

template <class V, int RN, int JN>
inline void tile(
    const float* const* w,
    int64_t steps,
    int tail,
    bool masked_tail,
    const float* x,
    int64_t x_stride,
    typename V::reg (*acc)[V::J]) {
  using reg = typename V::reg;
  constexpr int W = V::W;
  reg c[RN][JN];
  for (int r = 0; r < RN; ++r)
    for (int j = 0; j < JN; ++j) c[r][j] = acc[r][j];
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t k = s * W;
    reg wv[JN];
    for (int j = 0; j < JN; ++j) wv[j] = V::load(w[j] + k);
    for (int r = 0; r < RN; ++r) {
      const reg xv = V::load(x + r * x_stride + k);
      for (int j = 0; j < JN; ++j) c[r][j] = V::fma(wv[j], xv, c[r][j]);
    }
  }
  if (tail) {
    const int64_t k = steps * W;
    reg wv[JN];
    for (int j = 0; j < JN; ++j)
      wv[j] = masked_tail ? V::load_partial(w[j] + k, tail) : V::load(w[j] + k);
    for (int r = 0; r < RN; ++r) {
      const reg xv = V::load(x + r * x_stride + k);  // zero past the row's end
      for (int j = 0; j < JN; ++j) c[r][j] = V::fma(wv[j], xv, c[r][j]);
    }
  }
  for (int r = 0; r < RN; ++r)
    for (int j = 0; j < JN; ++j) acc[r][j] = c[r][j];
}

template <class V, int RN, int JN = V::J>
inline void tile_jn(
    int jn,
    const float* const* w,
    int64_t steps,
    int tail,
    bool masked,
    const float* x,
    int64_t xs,
    typename V::reg (*acc)[V::J]) {
  if constexpr (JN > 1) {
    if (jn < JN) return tile_jn<V, RN, JN - 1>(jn, w, steps, tail, masked, x, xs, acc);
  }
  tile<V, RN, JN>(w, steps, tail, masked, x, xs, acc);
}

template <class V, int RN = V::R>
inline void tile_rn(
    int rn,
    int jn,
    const float* const* w,
    int64_t steps,
    int tail,
    bool masked,
    const float* x,
    int64_t xs,
    typename V::reg (*acc)[V::J]) {
  if constexpr (RN > 1) {
    if (rn < RN) return tile_rn<V, RN - 1>(rn, jn, w, steps, tail, masked, x, xs, acc);
  }
  tile_jn<V, RN>(jn, w, steps, tail, masked, x, xs, acc);
}

// Decodes codes [k0, k0 + n) of one affine-quantized row to fp32 in `dst` (k0 and n multiples of
// the group size, except n at the row's end).
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
    int64_t i = 0;
    if (group % V::W == 0 && (bits == 4 || bits == 8)) {
      for (; i + V::W <= len; i += V::W)
        V::store(dst + g0 + i, V::dequantize(codes, bits, first + i, scale, bias));
    }
    for (; i < len; ++i)
      dst[g0 + i] = scale * static_cast<float>(code_at(codes, bits, first + i)) + bias;
  }
}

// Decodes elements [k0, k0 + n) of weight row `row` to fp32 in `dst`, zero up to a whole vector.
template <class V>
inline void decode_row(const WeightView& wv, int64_t row, int64_t k0, int64_t n, float* dst) {
  const int64_t base = row * wv.in + k0;
  int64_t i = 0;
  switch (wv.kind) {
    case WeightKind::bf16: {
      const auto* p = static_cast<const uint16_t*>(wv.data) + base;
      for (; i + V::W <= n; i += V::W) V::store(dst + i, V::load_bf16(p + i));
      for (; i < n; ++i) dst[i] = bf16_to_float(p[i]);
      break;
    }
    case WeightKind::f16: {
      const auto* p = static_cast<const uint16_t*>(wv.data) + base;
      for (; i + V::W <= n; i += V::W) V::store(dst + i, V::load_f16(p + i));
      for (; i < n; ++i) dst[i] = half_to_float(p[i]);
      break;
    }
    case WeightKind::affine:
      decode_affine<V>(wv, row, k0, n, dst);
      i = n;
      break;
    default: {
      const auto* p = static_cast<const float*>(wv.data) + base;
      std::memcpy(dst, p, n * sizeof(float));
      i = n;
    }
  }
  for (int64_t e = round_up(n, V::W); i < e; ++i) dst[i] = 0.0f;
  (void)i;
}

template <class V>
void columns(const ProductArgs& a, int64_t first, int64_t last) {
  using reg = typename V::reg;
  constexpr int R = V::R;
  constexpr int J = V::J;
  constexpr int W = V::W;
  const WeightView& wv = a.w;
  const int64_t in = wv.in;
  const int64_t out = wv.out;
  const bool direct = wv.kind == WeightKind::f32;
  // fp32 weights are read in place; a product of one tile of rows needs no accumulator buffer
  // round trips, so it takes the whole row as one chunk
  const int64_t chunk = (direct && a.rows <= R) ? round_up(in, W) : kChunk;
  alignas(64) float scratch[J][kChunk + 16];
  alignas(64) reg acc[kBlockRows][J];
  for (int t_begin = 0; t_begin < a.rows; t_begin += kBlockRows) {
    const int tn = std::min(kBlockRows, a.rows - t_begin);
    const float* xb = a.x + t_begin * a.x_stride;
    for (int64_t j0 = first; j0 < last; j0 += J) {
      const int jn = static_cast<int>(std::min<int64_t>(J, last - j0));
      for (int t = 0; t < tn; ++t)
        for (int j = 0; j < J; ++j) acc[t][j] = V::zero();
      for (int64_t k0 = 0; k0 < in; k0 += chunk) {
        const int64_t kn = std::min(chunk, in - k0);
        const float* w[J];
        for (int j = 0; j < jn; ++j) {
          if (direct) {
            w[j] = static_cast<const float*>(wv.data) + (j0 + j) * in + k0;
          } else {
            decode_row<V>(wv, j0 + j, k0, kn, scratch[j]);
            w[j] = scratch[j];
          }
        }
        const int64_t steps = kn / W;
        const int tail = static_cast<int>(kn % W);
        for (int t0 = 0; t0 < tn; t0 += R) {
          const int rn = std::min(R, tn - t0);
          tile_rn<V>(rn, jn, w, steps, tail, direct, xb + t0 * a.x_stride + k0, a.x_stride, acc + t0);
        }
      }
      for (int t = 0; t < tn; ++t)
        for (int j = 0; j < jn; ++j)
          store_real(a.y, a.y_type, (t_begin + t) * out + j0 + j, V::sum(acc[t][j]));
    }
  }
}

}  // namespace KERNEL_NAMESPACE
}  // namespace mtpserve
