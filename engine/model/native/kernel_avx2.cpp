// AVX2 with FMA and F16C: 8 floats a vector, tiles of 2 rows by 5 columns (13 of the 16
// registers).
#include <immintrin.h>

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
  // affine tiles of more than one row: AR rows by AJ columns
  static constexpr int AR = 2;
  static constexpr int AJ = 2;
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
  static reg broadcast(float v) { return _mm256_set1_ps(v); }
  // 8 8-bit codes as floats
  static reg codes8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // of the 16 4-bit codes in 8 bytes, the low nibbles (half 0) or the high ones (half 1)
  static reg codes4(const uint8_t* p, int half) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_cvtepi32_ps(half ? _mm256_srli_epi32(bytes, 4)
                                   : _mm256_and_si256(bytes, _mm256_set1_epi32(0xf)));
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
