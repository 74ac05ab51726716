// AVX2 with FMA and F16C: 8 floats a vector, tiles of 2 rows by 5 columns (13 of the 16
// registers).
#include <immintrin.h>

#include <cstring>

#include "products.h"

#define KERNEL_NAMESPACE avx2
#include "kernel_impl.h"
#include "delta_rule_impl.h"

namespace mtpserve {
namespace {

struct Avx2 {
  using reg = __m256;
  static constexpr int W = 8;
  static constexpr int R = 2;
  static constexpr int J = 5;
  // weight rows a tile of activation rows takes at a time
  static constexpr int tile_columns = J;
  // affine tiles of more than one row: AR rows by AJ columns
  static constexpr int AR = 2;
  static constexpr int AJ = 2;
  // kernel_impl.h, float_rows and code_row: none. A weight row read whole is one chain of
  // multiply-adds a row, 8 lanes each waiting on the one before; the tile's J rows are J
  // chains. On a Zen 3 VM (AVX2 only) each 0.8B token's fp32 and bf16 products, the two builds
  // in turns (scripts/bench_kernel.py --dtypes f32,bf16 --rows 1,2,3,5, three rounds): bf16
  // 1 / 2 / 3 / 5 rows 92-109 / 100-107 / 173-179 / 262-290 ms whole against 77-83 / 79-87 /
  // 95-139 / 135-180 on the tile (3 and 5 rows end in one row of their own), fp32 at 5 rows
  // 249-311 against 180-207.
  static constexpr int whole_float_rows = 0;
  static constexpr bool whole_code_row = false;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static reg load_partial(const float* p, int n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
  }
  static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(reg v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static reg load_bf16(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static reg load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // -- integers: 32 bytes a vector, 8 int32 lanes --
  using ireg = __m256i;
  static ireg izero() { return _mm256_setzero_si256(); }
  static ireg bytes(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static ireg bytes_partial(const void* p, int n) {
    alignas(32) uint8_t part[32] = {};
    std::memcpy(part, p, static_cast<size_t>(n));
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(part));
  }
  static ireg low_nibbles(ireg v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
  static ireg high_nibbles(ireg v) {
    return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f));
  }
  // lane i += sum of bytes 4i..4i+3 of u (unsigned, below 16) times those of s (signed); the
  // pairs' 16-bit sums cannot saturate: 2 * 15 * 127 < 2^15
  static ireg dot_u4(ireg acc, ireg u, ireg s) {
    return _mm256_add_epi32(
        acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
  // both nibbles of a 4-bit block at once: the two byte products' 16-bit sums (each at most
  // 2 * 15 * 127) add without overflow before one widening to 32 bits. This and dot_u8's high
  // nibbles widened times 16 instead of shifted, against the code before them (one thread of a
  // Zen 3 VM, a 256 x 1024 weight in cache, lowest of several runs each,
  // scripts/experiments/loop_cost.cpp with -DLOOP_AVX2): 2-5 rows 0.93-0.95x the time (4-bit)
  // and 0.96-0.98x (8-bit), one row level
  static ireg dot_u4_pair(ireg acc, ireg lo, ireg even, ireg hi, ireg odd) {
    const ireg pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, even), _mm256_maddubs_epi16(hi, odd));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  // the same for any unsigned byte u = 16 * high + low (maddubs's pair sums of whole bytes
  // would saturate: 2 * 255 * 127), the high nibbles' pairs widened times 16
  static ireg dot_u8(ireg acc, ireg u, ireg s) {
    const ireg lo = _mm256_madd_epi16(_mm256_maddubs_epi16(low_nibbles(u), s), _mm256_set1_epi16(1));
    const ireg hi = _mm256_madd_epi16(_mm256_maddubs_epi16(high_nibbles(u), s), _mm256_set1_epi16(16));
    return _mm256_add_epi32(acc, _mm256_add_epi32(hi, lo));
  }
  // 8-bit codes as signed ones for the interleaved tile (kernel_impl.h): |u - 128| and u - 128.
  // Against dot_u8 (this build on a Zen 4 VM): one thread, weights in cache, 1 / 2 / 3 / 5 rows
  // 0.76 / 0.81 / 0.79 / 0.79x the time; a 0.8B token's 8-bit products 1-3 rows level (memory),
  // 5 / 9 / 24 rows 0.93 / 0.91 / 0.90x
  static constexpr int signed_codes_rows = 1;
  struct SignedCodes {
    ireg magnitude, sign;
  };
  static SignedCodes to_signed(ireg u) {
    const ireg c = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
    return {_mm256_abs_epi8(c), c};
  }
  // lane i += sum of bytes 4i..4i+3 of c times those of s (|s| <= 127)
  static ireg dot_signed(ireg acc, const SignedCodes& c, ireg s) {
    const ireg pairs = _mm256_maddubs_epi16(c.magnitude, _mm256_sign_epi8(s, c.sign));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static reg to_float(ireg v) { return _mm256_cvtepi32_ps(v); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg splat(float v) { return _mm256_set1_ps(v); }
  static ireg splat_word(uint32_t w) { return _mm256_set1_epi32(static_cast<int32_t>(w)); }
  // lane i: (i * codes_per_lane) / group, the group of lane i from a block's first
  static ireg lane_groups(int codes_per_lane, int group) {
    alignas(32) int32_t idx[8];
    for (int i = 0; i < 8; ++i) idx[i] = i * codes_per_lane / group;
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(idx));
  }
  // lane i: s[idx[i]]
  static reg expand(const float* s, ireg idx) {
    return _mm256_permutevar8x32_ps(_mm256_loadu_ps(s), idx);
  }
};

}  // namespace

void columns_avx2(const ProductArgs& a, int64_t first, int64_t last) {
  avx2::columns<Avx2>(a, first, last);
}

void delta_avx2(const DeltaArgs& a, int64_t first, int64_t last) {
  avx2::rows<false>(a, first, last);
}

void replay_avx2(const DeltaArgs& a, int64_t first, int64_t last) {
  avx2::rows<true>(a, first, last);
}

}  // namespace mtpserve
