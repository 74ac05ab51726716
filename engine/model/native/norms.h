// An RMS norm's row arithmetic, shared by the `RMSNorm` primitive (norms.cpp) and the products
// that normalize their input themselves (products.cpp): the same operations in the same order,
// so a row normed by either is the same bits.
#pragma once

#include <cmath>
#include <cstdint>

#include "shared_lanes.h"

namespace mtpserve {

// A dot product by lanes.h's order: the same bits as a row of `dots` (attention's scores).
__attribute__((always_inline)) inline float lane_dot(const float* a, const float* b, int64_t n) {
  float out;
  dots<1>(&a, b, n, &out);
  return out;
}

inline float sum_of_squares(const float* x, int64_t n) { return lane_dot(x, x, n); }

// dst = row / sqrt(mean(row^2) + eps) * w over `dim` elements (dst may be row).
inline void rms_normalize(const float* row, const float* w, int64_t dim, float eps, float* dst) {
  const float scale = 1.0f / std::sqrt(sum_of_squares(row, dim) / static_cast<float>(dim) + eps);
  for (int64_t j = 0; j < dim; ++j) dst[j] = row[j] * scale * w[j];
}

}  // namespace mtpserve
