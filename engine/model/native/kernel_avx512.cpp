// AVX-512 (F, BW, VL, DQ) with FMA and F16C: 16 floats a vector, tiles of 3 rows by 8 columns
// (28 of the 32 registers; eight weight rows streamed at once read memory faster than four).
#include <immintrin.h>

#include "products.h"

#define KERNEL_NAMESPACE avx512
#include "kernel_impl.h"
#include "delta_rule_impl.h"

namespace mtpserve {
namespace {

struct Avx512 {
  using reg = __m512;
  static constexpr int W = 16;
  static constexpr int R = 3;
  static constexpr int J = 8;
  // affine tiles of more than one row: AR rows by AJ columns
  static constexpr int AR = 3;
  static constexpr int AJ = 4;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static reg load_partial(const float* p, int n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
  }
  static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(reg v) { return _mm512_reduce_add_ps(v); }
  static reg load_bf16(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static reg load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static reg broadcast(float v) { return _mm512_set1_ps(v); }
  // 16 8-bit codes as floats
  static reg codes8(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // of the 32 4-bit codes in 16 bytes, the low nibbles (codes 0, 2, ..., 30: half 0) or the high
  // ones (half 1), as floats
  static reg codes4(const uint8_t* p, int half) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtepi32_ps(half ? _mm512_srli_epi32(bytes, 4)
                                   : _mm512_and_si512(bytes, _mm512_set1_epi32(0xf)));
  }
};

}  // namespace

void columns_avx512(const ProductArgs& a, int64_t first, int64_t last) {
  avx512::columns<Avx512>(a, first, last);
}

void delta_avx512(const DeltaArgs& a, int64_t first, int64_t last) {
  avx512::rows<false>(a, first, last);
}

void replay_avx512(const DeltaArgs& a, int64_t first, int64_t last) {
  avx512::rows<true>(a, first, last);
}

}  // namespace mtpserve
