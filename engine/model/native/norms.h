// An RMS norm's row arithmetic, shared by the `RMSNorm` primitive (norms.cpp) and the products
// that normalize their input themselves (products.cpp): the same operations in the same order,
// so a row normed by either is the same bits. Its lane dot product is attention's too.
#pragma once

#include <cmath>
#include <cstdint>

namespace mtpserve {

// A dot product in 16 lanes: lane l takes elements l, l + kNormLanes, ..., then a fixed tree.
// The order depends on the length alone, never on how many rows or keys share an op (an RMS
// norm's sum of squares; attention's scores).
constexpr int kNormLanes = 16;

// The lanes' sum by a fixed tree: lane l += lane l + w for w = 8, 4, 2, 1 (`lanes` is spent).
__attribute__((always_inline)) inline float lane_sum(float* lanes) {
  for (int width = kNormLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return lanes[0];
}

__attribute__((always_inline)) inline float lane_dot(const float* a, const float* b, int64_t n) {
  float lanes[kNormLanes] = {};
  int64_t i = 0;
  for (; i + kNormLanes <= n; i += kNormLanes)
    for (int l = 0; l < kNormLanes; ++l) lanes[l] += a[i + l] * b[i + l];
  for (int l = 0; i < n; ++i, ++l) lanes[l] += a[i] * b[i];
  return lane_sum(lanes);
}

inline float sum_of_squares(const float* x, int64_t n) { return lane_dot(x, x, n); }

// dst = row / sqrt(mean(row^2) + eps) * w over `dim` elements (dst may be row).
inline void rms_normalize(const float* row, const float* w, int64_t dim, float eps, float* dst) {
  const float scale = 1.0f / std::sqrt(sum_of_squares(row, dim) / static_cast<float>(dim) + eps);
  for (int64_t j = 0; j < dim; ++j) dst[j] = row[j] * scale * w[j];
}

}  // namespace mtpserve
