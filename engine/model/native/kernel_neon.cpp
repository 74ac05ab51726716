// NEON (arm64's baseline Advanced SIMD): 4 floats a vector, tiles of 3 rows by 8 columns (28
// of the 32 registers). Integer sums widen the bytes to 16 bits (baseline arm64 has no
// unsigned-by-signed byte dot product), exact like every other path's.
#include <arm_neon.h>

#include <cstring>

#include "products.h"

#define KERNEL_NAMESPACE neon
#include "kernel_impl.h"
#include "delta_rule_impl.h"

namespace mtpserve {
namespace {

struct Neon {
  using reg = float32x4_t;
  static constexpr int W = 4;
  static constexpr int R = 3;
  static constexpr int J = 8;
  // weight rows a tile of activation rows takes at a time
  static constexpr int tile_columns = J;
  // affine tiles of more than one row: AR rows by AJ columns
  static constexpr int AR = 3;
  static constexpr int AJ = 4;
  static constexpr int whole_float_rows = 0;  // kernel_impl.h, float_rows and code_row
  static constexpr bool whole_code_row = false;
  static reg zero() { return vdupq_n_f32(0.0f); }
  static reg load(const float* p) { return vld1q_f32(p); }
  static reg load_partial(const float* p, int n) {
    float part[4] = {};
    std::memcpy(part, p, static_cast<size_t>(n) * 4);
    return vld1q_f32(part);
  }
  static void store(float* p, reg v) { vst1q_f32(p, v); }
  static reg fma(reg a, reg b, reg c) { return vfmaq_f32(c, a, b); }
  static float sum(reg v) { return vaddvq_f32(v); }
  static reg load_bf16(const uint16_t* p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
  }
  static reg load_f16(const uint16_t* p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
  }
  // -- integers: 16 bytes a vector, 4 int32 lanes --
  using ireg = int32x4_t;
  static ireg izero() { return vdupq_n_s32(0); }
  static ireg bytes(const void* p) {
    return vreinterpretq_s32_u8(vld1q_u8(static_cast<const uint8_t*>(p)));
  }
  static ireg bytes_partial(const void* p, int n) {
    uint8_t part[16] = {};
    std::memcpy(part, p, static_cast<size_t>(n));
    return vreinterpretq_s32_u8(vld1q_u8(part));
  }
  static ireg low_nibbles(ireg v) {
    return vreinterpretq_s32_u8(vandq_u8(vreinterpretq_u8_s32(v), vdupq_n_u8(0x0f)));
  }
  static ireg high_nibbles(ireg v) {
    return vreinterpretq_s32_u8(vshrq_n_u8(vreinterpretq_u8_s32(v), 4));
  }
  // lane i += sum of bytes 4i..4i+3 of u (unsigned) times those of s (signed): each product
  // fits 16 bits (255 * 128 < 2^15), pairs and quads summed in 32
  static ireg dot_u8(ireg acc, ireg u, ireg s) {
    const uint8x16_t ub = vreinterpretq_u8_s32(u);
    const int8x16_t sb = vreinterpretq_s8_s32(s);
    const int16x8_t lo = vmulq_s16(vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(ub))),
                                   vmovl_s8(vget_low_s8(sb)));
    const int16x8_t hi = vmulq_s16(vreinterpretq_s16_u16(vmovl_u8(vget_high_u8(ub))),
                                   vmovl_s8(vget_high_s8(sb)));
    return vaddq_s32(acc, vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)));
  }
  static ireg dot_u4(ireg acc, ireg u, ireg s) { return dot_u8(acc, u, s); }
  static reg to_float(ireg v) { return vcvtq_f32_s32(v); }
  static reg mul(reg a, reg b) { return vmulq_f32(a, b); }
  static reg splat(float v) { return vdupq_n_f32(v); }
  static ireg splat_word(uint32_t w) { return vreinterpretq_s32_u32(vdupq_n_u32(w)); }
  // the bytes of lane i's float: 4 * ((i * codes_per_lane) / group) + 0..3 (for expand's
  // table lookup)
  static ireg lane_groups(int codes_per_lane, int group) {
    uint8_t idx[16];
    for (int i = 0; i < 4; ++i)
      for (int b = 0; b < 4; ++b) idx[4 * i + b] = static_cast<uint8_t>(4 * (i * codes_per_lane / group) + b);
    return vreinterpretq_s32_u8(vld1q_u8(idx));
  }
  // lane i: s[i's group]
  static reg expand(const float* s, ireg idx) {
    const uint8x16_t table = vld1q_u8(reinterpret_cast<const uint8_t*>(s));
    return vreinterpretq_f32_u8(vqtbl1q_u8(table, vreinterpretq_u8_s32(idx)));
  }
};

}  // namespace

void columns_neon(const ProductArgs& a, int64_t first, int64_t last) {
  neon::columns<Neon>(a, first, last);
}

void delta_neon(const DeltaArgs& a, int64_t first, int64_t last) {
  neon::rows<false>(a, first, last);
}

void replay_neon(const DeltaArgs& a, int64_t first, int64_t last) {
  neon::rows<true>(a, first, last);
}

}  // namespace mtpserve
