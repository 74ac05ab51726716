// AVX-512 (F, BW, VL, DQ) with FMA and F16C: 16 floats a vector, tiles of 3 rows by 8 columns
// (28 of the 32 registers; eight weight rows streamed at once read memory faster than four).
#include <immintrin.h>

#include "products.h"

#define KERNEL_NAMESPACE avx512
#include "kernel_impl.h"

namespace mtpserve {
namespace {

struct Avx512 {
  using reg = __m512;
  static constexpr int W = 16;
  static constexpr int R = 3;
  static constexpr int J = 8;
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
  // 16 codes from `i` (a multiple of 16) of a 4- or 8-bit row, as scale * code + bias
  static reg dequantize(const uint8_t* codes, int bits, int64_t i, float scale, float bias) {
    __m512i c;
    if (bits == 8) {
      c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    } else {
      uint64_t packed;
      std::memcpy(&packed, codes + i / 2, 8);
      // dword lanes 0-7 take the low word, 8-15 the high word; lane l keeps code l % 8
      const __m512i words = _mm512_permutexvar_epi32(
          _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
          _mm512_set1_epi64(static_cast<long long>(packed)));
      const __m512i shifts =
          _mm512_set_epi32(28, 24, 20, 16, 12, 8, 4, 0, 28, 24, 20, 16, 12, 8, 4, 0);
      c = _mm512_and_si512(_mm512_srlv_epi32(words, shifts), _mm512_set1_epi32(0xf));
    }
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(scale), _mm512_set1_ps(bias));
  }
};

}  // namespace

void columns_avx512(const ProductArgs& a, int64_t first, int64_t last) {
  avx512::columns<Avx512>(a, first, last);
}

}  // namespace mtpserve
