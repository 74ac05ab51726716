// AVX-512 (F, BW, VL, DQ) with FMA and F16C, and VNNI where compiled with it: 16 floats a
// vector; 1-3 activation rows read each weight row whole, 4-5 rows take tiles of 4 columns.
#include <immintrin.h>

#include "products.h"

// kernel_avx512_vnni.cpp compiles this file again with VNNI under its own names.
#ifndef AVX512_NAME
#define AVX512_NAME avx512
#endif
#define KERNEL_NAMESPACE AVX512_NAME
#define AVX512_JOIN2(a, b) a##_##b
#define AVX512_JOIN(a, b) AVX512_JOIN2(a, b)
#include "kernel_impl.h"
#include "delta_rule_impl.h"

namespace mtpserve {
namespace {

struct Avx512 {
  using reg = __m512;
  static constexpr int W = 16;
  static constexpr int R = 5;
  static constexpr int J = 8;
  // weight rows a tile of 4-5 activation rows takes (fewer read whole rows: whole_float_rows):
  // four (RN + 1 + RN * JN registers), so that a verify's five rows stream the weights from
  // memory together rather than as a tile of three and a tile of two that reads them from cache
  static constexpr int tile_columns = J / 2;
  // affine tiles of more than one row: AR rows by AJ columns
  static constexpr int AR = 3;
  static constexpr int AJ = 4;
  // activation rows up to this many read each weight row whole (kernel_impl.h, float_rows), and
  // one row of 8-bit codes (code_row)
  static constexpr int whole_float_rows = 3;
  static constexpr bool whole_code_row = true;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static reg load_partial(const float* p, int n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
  }
  static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(reg v) { return _mm512_reduce_add_ps(v); }
  // out[i] = sum(v[i]) for eight vectors (J), each added in sum's order (lanes i and i + 8,
  // then i + 4, i + 2, i + 1: the same bits), the eight sums sharing their shuffles and adds
  // (one at a time they took a tenth of a 4-bit product of 1,024 columns)
  static void sums8(const reg* v, float* out) {
    reg h[4], q[2];
    for (int i = 0; i < 4; ++i)  // [v_2i lanes 0-7 + 8-15, v_2i+1 likewise]
      h[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                           _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
    for (int i = 0; i < 2; ++i)  // 128-bit lane k: output 4i + k's lanes 0-3 + 4-7
      q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0xdd));
    // lane k of 128: [q0 out k: 0+2, 1+3, q1 out 4+k: 0+2, 1+3]
    const reg e =
        _mm512_add_ps(_mm512_shuffle_ps(q[0], q[1], 0x44), _mm512_shuffle_ps(q[0], q[1], 0xee));
    const reg f = _mm512_add_ps(_mm512_shuffle_ps(e, e, 0x88), _mm512_shuffle_ps(e, e, 0xdd));
    // 128-bit lane k: [out k, out 4 + k, out k, out 4 + k]
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm256_storeu_ps(out, _mm512_castps512_ps256(_mm512_permutexvar_ps(order, f)));
  }
  // 16 bf16 at p, each as float_to_bf16 rounds it (nearest even; a NaN kept quiet), where
  // vcvtneps2bf16 would flush denormals
  static void store_bf16(uint16_t* p, reg v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i magnitude = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_set1_epi32(0x400000);
    const __m512i r = _mm512_mask_or_epi32(bf16_rounded_bits(v), nan, u, quiet);
    const __m256i halves = _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), halves);
  }
  static reg load_bf16(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static reg load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // -- integers: 64 bytes a vector, 16 int32 lanes --
  using ireg = __m512i;
  static ireg izero() { return _mm512_setzero_si512(); }
  static ireg bytes(const void* p) { return _mm512_loadu_si512(p); }
  static ireg bytes_partial(const void* p, int n) {
    return _mm512_maskz_loadu_epi8(_cvtu64_mask64((uint64_t{1} << n) - 1u), p);
  }
  static ireg low_nibbles(ireg v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
  static ireg high_nibbles(ireg v) {
    return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f));
  }
  // lane i += sum of bytes 4i..4i+3 of u (unsigned, below 16) times those of s (signed)
  static ireg dot_u4(ireg acc, ireg u, ireg s) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    // the pairs' 16-bit sums cannot saturate: 2 * 15 * 127 < 2^15
    return _mm512_add_epi32(
        acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
  }
#ifndef __AVX512VNNI__
  // both nibbles of a 4-bit block at once (kernel_impl.h's dot_u4_block): the two byte
  // products' 16-bit sums (each at most 2 * 15 * 127) add without overflow before one widening.
  // This and dot_u8's high nibbles widened times 16 instead of shifted, against the code before
  // them (an AMD EPYC Zen 4 VM running this build, MTPSERVE_PRODUCTS_ISA=avx512): a Qwen3.5-0.8B
  // token's 4-bit products at 5 / 9 / 24 rows 0.79-0.84x / 0.75-0.86x / 0.70-0.82x the time,
  // 8-bit 0.94-0.95x; one row level (scripts/bench_kernel.py, the two builds in turns)
  static ireg dot_u4_pair(ireg acc, ireg lo, ireg even, ireg hi, ireg odd) {
    const ireg pairs = _mm512_add_epi16(_mm512_maddubs_epi16(lo, even), _mm512_maddubs_epi16(hi, odd));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
  }
#endif
  // the same for any unsigned byte u
  static ireg dot_u8(ireg acc, ireg u, ireg s) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    // u = 16 * high + low (maddubs's pair sums of whole bytes would saturate: 2 * 255 * 127),
    // each nibble's sums exact in 16 bits, the high nibbles' widened times 16
    const ireg lo = _mm512_madd_epi16(_mm512_maddubs_epi16(low_nibbles(u), s), _mm512_set1_epi16(1));
    const ireg hi = _mm512_madd_epi16(_mm512_maddubs_epi16(high_nibbles(u), s), _mm512_set1_epi16(16));
    return _mm512_add_epi32(acc, _mm512_add_epi32(hi, lo));
#endif
  }
#ifndef __AVX512VNNI__
  // 8-bit codes as signed ones for the interleaved tile (kernel_impl.h): |u - 128| and where
  // u - 128 is negative. Against dot_u8 (a 0.8B token's 8-bit products, this build on a Zen 4
  // VM, two or three rounds in turns): 4 / 5 / 9 / 24 rows 0.81 / 0.77 / 0.75 / 0.72-0.76x the
  // time, 2 rows 0.92-0.97x, but 1 and 3 rows 1.3x and 1.12-1.15x (their codes streamed from
  // memory; one row in cache 0.90x), so from blocks of 4 rows
  static constexpr int signed_codes_rows = 4;
  struct SignedCodes {
    ireg magnitude;
    __mmask64 negative;
  };
  static SignedCodes to_signed(ireg u) {
    const ireg c = _mm512_xor_si512(u, _mm512_set1_epi8(static_cast<char>(0x80)));
    return {_mm512_abs_epi8(c), _mm512_movepi8_mask(c)};
  }
  // lane i += sum of bytes 4i..4i+3 of c times those of s (|s| <= 127)
  static ireg dot_signed(ireg acc, const SignedCodes& c, ireg s) {
    const ireg signed_s = _mm512_mask_sub_epi8(s, c.negative, _mm512_setzero_si512(), s);
    const ireg pairs = _mm512_maddubs_epi16(c.magnitude, signed_s);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
  }
#endif
  static reg to_float(ireg v) { return _mm512_cvtepi32_ps(v); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg splat(float v) { return _mm512_set1_ps(v); }
  static ireg splat_word(uint32_t w) { return _mm512_set1_epi32(static_cast<int32_t>(w)); }
  // lane i: (i * codes_per_lane) / group, the group of lane i from a block's first
  static ireg lane_groups(int codes_per_lane, int group) {
    alignas(64) int32_t idx[16];
    for (int i = 0; i < 16; ++i) idx[i] = i * codes_per_lane / group;
    return _mm512_load_si512(idx);
  }
  // lane i: s[idx[i]]
  static reg expand(const float* s, ireg idx) {
    return _mm512_permutexvar_ps(idx, _mm512_loadu_ps(s));
  }
};

}  // namespace

void AVX512_JOIN(columns, AVX512_NAME)(const ProductArgs& a, int64_t first, int64_t last) {
  AVX512_NAME::columns<Avx512>(a, first, last);
}

void AVX512_JOIN(delta, AVX512_NAME)(const DeltaArgs& a, int64_t first, int64_t last) {
  AVX512_NAME::rows<false>(a, first, last);
}

void AVX512_JOIN(replay, AVX512_NAME)(const DeltaArgs& a, int64_t first, int64_t last) {
  AVX512_NAME::rows<true>(a, first, last);
}

}  // namespace mtpserve
