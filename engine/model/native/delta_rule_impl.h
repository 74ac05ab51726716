// The gated delta rule's row kernels (delta_rule.h), written once over 16-float lanes and
// compiled once per instruction set (kernel_*.cpp include this file inside their own
// namespace, with their own compiler flags). The build turns floating-point contraction off, so
// the lanes' multiplies and adds stay separate IEEE operations and every set computes the same
// bits.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "delta_rule.h"

namespace mtpserve {
namespace KERNEL_NAMESPACE {

#include "lanes.h"

// Rows of the state computed side by side: their dot products are independent chains, so the
// latency of one chain's adds hides behind the others' (one row alone waits on its own). Each
// position waits on its dots' sums before its update, so eight rows, not four: 18 layers of the
// 0.8B shape 0.92x the time at T=1 and 0.93-0.95x at T=5, a 0.8B step outside its products
// 0.91x / 0.95x; sixteen rows were level with four (docs/CPU_CHOICES.md).
constexpr int kRowGroup = 8;

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

// Keys up to this many elements (Qwen3.5's 128) run through a buffer of R rows on the stack.
constexpr int64_t kBufferedKeys = 256;

// n floats from src to dst, each whole cache line of dst written past the caches where the
// instruction set can (a plain store first reads the line it fills: a third of the state's
// traffic, read 1 MiB and written 1 MiB a layer at the 0.8B shape, where the next step reads it
// back after the trunk's weights have streamed through every cache); fenced by `fence_written`.
inline void write_span(float* dst, const float* src, int64_t n) {
#if defined(__AVX512F__) || defined(__AVX__)
  // the first whole line of dst (mlx's buffers start 8 bytes into one)
  int64_t j = std::min<int64_t>(n, (64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64 / 4);
  std::memcpy(dst, src, j * sizeof(float));
  for (; j + 16 <= n; j += 16) {
#if defined(__AVX512F__)
    _mm512_stream_ps(dst + j, _mm512_loadu_ps(src + j));
#else
    _mm256_stream_ps(dst + j, _mm256_loadu_ps(src + j));
    _mm256_stream_ps(dst + j + 8, _mm256_loadu_ps(src + j + 8));
#endif
  }
  std::memcpy(dst + j, src + j, (n - j) * sizeof(float));
#else
  std::memcpy(dst, src, n * sizeof(float));
#endif
}

// Orders write_span's stores before the pool reports the work done.
inline void fence_written() {
#if defined(__AVX512F__) || defined(__AVX__)
  _mm_sfence();
#endif
}

// Rows [i, i + R) of head h of batch row b, through every position: in a buffer on the stack
// (written to `final` once, after the last position) when the keys fit, else in `final`.
template <bool Replay, int R>
inline void row_group(const DeltaArgs& a, int64_t b, int64_t h, int64_t i) {
  const int64_t hk = h / (a.Hv / a.Hk);
  const int64_t bh = b * a.Hv + h;
  alignas(64) float buffer[R * kBufferedKeys];
  const bool buffered = a.Dk <= kBufferedKeys;
  float* const out = a.final + (bh * a.Dv + i) * a.Dk;  // R rows side by side
  float* s[R];
  for (int r = 0; r < R; ++r) s[r] = (buffered ? buffer : out) + r * a.Dk;
  std::memcpy(s[0], a.state + (bh * a.Dv + i) * a.Dk, R * a.Dk * sizeof(float));
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
  if (buffered) write_span(out, buffer, R * a.Dk);
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
  fence_written();
}

}  // namespace KERNEL_NAMESPACE
}  // namespace mtpserve
