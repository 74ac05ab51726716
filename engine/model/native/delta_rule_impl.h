// The gated delta rule's row kernels (delta_rule.h), written once over 16-float lanes and
// compiled once per instruction set (kernel_*.cpp include this file inside their own
// namespace, with their own compiler flags). The build turns floating-point contraction off, so
// the lanes' multiplies and adds stay separate IEEE operations and every set computes the same
// bits.

#include <cstring>

#include "delta_rule.h"

namespace mtpserve {
namespace KERNEL_NAMESPACE {

constexpr int kLanes = 16;

// 16 floats as one value: GCC and clang lower each operation on it to the instruction set's own
// vectors (one AVX-512 register, two AVX2 ones, four SSE ones), lane by lane.
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef float LanesUnaligned __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

inline Lanes load(const float* p) {
  return *reinterpret_cast<const LanesUnaligned*>(p);
}
inline void store(float* p, Lanes v) {
  *reinterpret_cast<LanesUnaligned*>(p) = v;
}

// The lanes' sum by a fixed tree: lane l += lane l + w for w = 8, 4, 2, 1 (each step one
// shuffle and one add of the whole vector: the same adds a scalar loop would make).
inline float reduce(Lanes v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  v += __builtin_shufflevector(v, v, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  return v[0];
}

// out[r] = reduce(v[r]) for R rows: four rows' sums in one tree, each pairing its lanes exactly
// as reduce() does (l with l + 8, then + 4, + 2, + 1), so the same bits in fewer operations.
template <int R>
inline void reduce_rows(const Lanes* v, float* out) {
  if constexpr (R == 4) {
    // lanes 0-7: a's l + (l + 8); lanes 8-15: b's
    const auto eighths = [](Lanes a, Lanes b) -> Lanes {
      return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
             __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                     30, 31);
    };
    const Lanes ab = eighths(v[0], v[1]);
    const Lanes cd = eighths(v[2], v[3]);
    // blocks of 4: a's, b's, c's, d's l + (l + 4)
    const Lanes q = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24,
                                            25, 26, 27) +
                    __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28,
                                            29, 30, 31);
    // pairs: each row's l + (l + 2) in lanes 2r, 2r + 1
    const Lanes h = __builtin_shufflevector(q, q, 0, 1, 4, 5, 8, 9, 12, 13, 0, 0, 0, 0, 0, 0, 0, 0) +
                    __builtin_shufflevector(q, q, 2, 3, 6, 7, 10, 11, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0);
    const Lanes s = __builtin_shufflevector(h, h, 0, 2, 4, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0) +
                    __builtin_shufflevector(h, h, 1, 3, 5, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int r = 0; r < 4; ++r) out[r] = s[r];
  } else {
    for (int r = 0; r < R; ++r) out[r] = reduce(v[r]);
  }
}

// Rows of the state computed side by side: their dot products are independent chains, so the
// latency of one chain's adds hides behind the others' (one row alone waits on its own).
constexpr int kRowGroup = 4;

// out[r] = s[r] . x for R rows
template <int R>
inline void dots(float* const* s, const float* x, int64_t n, float* out) {
  Lanes acc[R] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const Lanes xv = load(x + j);
    for (int r = 0; r < R; ++r) acc[r] += load(s[r] + j) * xv;
  }
  for (int r = 0; r < R; ++r)
    for (int l = 0; j + l < n; ++l) acc[r][l] += s[r][j + l] * x[j + l];
  reduce_rows<R>(acc, out);
}

// s[r] = g s[r] + u[r] k (one position's update of R rows), then (Read) out[r] = s[r] . q
template <int R, bool Read>
inline void update(float* const* s, float g, const float* u, const float* k, const float* q,
                   int64_t n, float* out) {
  Lanes acc[R] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const Lanes kv = load(k + j);
    for (int r = 0; r < R; ++r) {
      const Lanes v = load(s[r] + j) * g + u[r] * kv;
      store(s[r] + j, v);
      if constexpr (Read) acc[r] += v * load(q + j);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int l = 0; j + l < n; ++l) {
      const float v = s[r][j + l] * g + u[r] * k[j + l];
      s[r][j + l] = v;
      if constexpr (Read) acc[r][l] += v * q[j + l];
    }
  }
  if constexpr (Read) reduce_rows<R>(acc, out);
}

// Rows [i, i + R) of head h of batch row b, through every position.
template <bool Replay, int R>
inline void row_group(const DeltaArgs& a, int64_t b, int64_t h, int64_t i) {
  const int64_t hk = h / (a.Hv / a.Hk);
  const int64_t bh = b * a.Hv + h;
  float* s[R];
  for (int r = 0; r < R; ++r) {
    s[r] = a.final + (bh * a.Dv + i + r) * a.Dk;
    std::memcpy(s[r], a.state + (bh * a.Dv + i + r) * a.Dk, a.Dk * sizeof(float));
  }
  const int64_t positions = Replay ? a.keep[b] : a.T;
  for (int64_t t = 0; t < positions; ++t) {
    const int64_t pos = b * a.T + t;
    const int64_t head = pos * a.Hv + h;
    const float* kt = a.k + (pos * a.Hk + hk) * a.Dk;
    const float g = a.g[head];
    if constexpr (Replay) {
      update<R, false>(s, g, a.u + head * a.Dv + i, kt, nullptr, a.Dk, nullptr);
    } else {
      float sk[R], u[R];
      dots<R>(s, kt, a.Dk, sk);
      for (int r = 0; r < R; ++r) u[r] = a.beta[head] * (a.v[head * a.Dv + i + r] - g * sk[r]);
      update<R, true>(s, g, u, kt, a.q + (pos * a.Hk + hk) * a.Dk, a.Dk, a.y + head * a.Dv + i);
      for (int r = 0; r < R; ++r) a.u_out[head * a.Dv + i + r] = u[r];
    }
  }
}

template <bool Replay>
inline void rows(const DeltaArgs& a, int64_t first, int64_t last) {
  const int64_t blocks = (a.Dv + kDeltaRowsPerUnit - 1) / kDeltaRowsPerUnit;
  for (int64_t unit = first; unit < last; ++unit) {
    const int64_t bh = unit / blocks;
    const int64_t i1 = std::min(a.Dv, (unit % blocks + 1) * kDeltaRowsPerUnit);
    int64_t i = (unit % blocks) * kDeltaRowsPerUnit;
    for (; i + kRowGroup <= i1; i += kRowGroup)
      row_group<Replay, kRowGroup>(a, bh / a.Hv, bh % a.Hv, i);
    for (; i < i1; ++i) row_group<Replay, 1>(a, bh / a.Hv, bh % a.Hv, i);
  }
}

}  // namespace KERNEL_NAMESPACE
}  // namespace mtpserve
