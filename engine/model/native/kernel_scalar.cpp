// The portable kernel: one float a "vector", four independent column sums per row. Used where
// no vector kernel fits the CPU (arm64 runs kernel_neon.cpp).
#include <cmath>
#include <cstring>

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
  // weight rows a tile of activation rows takes at a time
  static constexpr int tile_columns = J;
  static constexpr int AR = 1;
  static constexpr int AJ = 4;
  static constexpr int whole_float_rows = 0;  // kernel_impl.h, float_rows and code_row
  static constexpr bool whole_code_row = false;
  static reg zero() { return 0.0f; }
  static reg load(const float* p) { return *p; }
  static reg load_partial(const float* p, int) { return *p; }
  static void store(float* p, reg v) { *p = v; }
  static reg fma(reg a, reg b, reg c) { return std::fma(a, b, c); }
  static float sum(reg v) { return v; }
  static reg load_bf16(const uint16_t* p) { return bf16_to_float(*p); }
  static reg load_f16(const uint16_t* p) { return half_to_float(*p); }
  // -- integers: a "vector" of 4 bytes, one int32 lane (the sum kept in the same 32 bits) --
  using ireg = uint32_t;
  static ireg izero() { return 0; }
  static ireg bytes(const void* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }
  static ireg bytes_partial(const void* p, int n) {
    uint32_t v = 0;
    std::memcpy(&v, p, static_cast<size_t>(n));
    return v;
  }
  static ireg low_nibbles(ireg v) { return v & 0x0f0f0f0fu; }
  static ireg high_nibbles(ireg v) { return (v >> 4) & 0x0f0f0f0fu; }
  // acc + the sum of u's bytes (unsigned) times s's (signed), in memory order
  static ireg dot_u8(ireg acc, ireg u, ireg s) {
    uint8_t ub[4];
    int8_t sb[4];
    std::memcpy(ub, &u, 4);
    std::memcpy(sb, &s, 4);
    int32_t sum = static_cast<int32_t>(acc);
    for (int b = 0; b < 4; ++b) sum += static_cast<int32_t>(ub[b]) * sb[b];
    return static_cast<uint32_t>(sum);
  }
  static ireg dot_u4(ireg acc, ireg u, ireg s) { return dot_u8(acc, u, s); }
  static reg to_float(ireg v) { return static_cast<float>(static_cast<int32_t>(v)); }
  static reg mul(reg a, reg b) { return a * b; }
  static reg splat(float v) { return v; }
  static ireg splat_word(uint32_t w) { return w; }
  static ireg lane_groups(int, int) { return 0; }
  static reg expand(const float* s, ireg idx) { return s[idx]; }
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
