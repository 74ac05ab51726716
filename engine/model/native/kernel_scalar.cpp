// The portable kernel: one float a "vector", four independent column sums per row. Used where
// no vector kernel fits the CPU (and on arm64, which has no NEON kernel yet).
#include <cmath>

#include "products.h"

#define KERNEL_NAMESPACE scalar
#include "kernel_impl.h"
#include "delta_rule_impl.h"

namespace mtpserve {
namespace {

struct Scalar {
  using reg = float;
  static constexpr int W = 1;
  static constexpr int R = 1;
  static constexpr int J = 4;
  static constexpr int AR = 1;
  static constexpr int AJ = 4;
  static reg zero() { return 0.0f; }
  static reg load(const float* p) { return *p; }
  static reg load_partial(const float* p, int) { return *p; }
  static void store(float* p, reg v) { *p = v; }
  static reg fma(reg a, reg b, reg c) { return std::fma(a, b, c); }
  static float sum(reg v) { return v; }
  static reg load_bf16(const uint16_t* p) { return bf16_to_float(*p); }
  static reg load_f16(const uint16_t* p) { return half_to_float(*p); }
  static reg broadcast(float v) { return v; }
  static reg codes8(const uint8_t* p) { return static_cast<float>(*p); }
  static reg codes4(const uint8_t* p, int half) {
    return static_cast<float>(half ? *p >> 4 : *p & 0xf);
  }
};

}  // namespace

void columns_scalar(const ProductArgs& a, int64_t first, int64_t last) {
  scalar::columns<Scalar>(a, first, last);
}

void delta_scalar(const DeltaArgs& a, int64_t first, int64_t last) {
  scalar::rows<false>(a, first, last);
}

void replay_scalar(const DeltaArgs& a, int64_t first, int64_t last) {
  scalar::rows<true>(a, first, last);
}

}  // namespace mtpserve
