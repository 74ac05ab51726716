// y[T, out] = x[T, in] @ W^T for the few rows of decoding: the types shared by the kernels of
// every instruction set, the thread pool and the mlx primitive.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

#include "shared_lanes.h"

namespace mtpserve {

// How a weight is stored: dense [out, in] elements, or mlx's affine quantization (packed
// unsigned codes, `bits` each, little-endian within each uint32 word; per `group` codes of a
// row one scale and one bias: w = scale * code + bias).
enum class WeightKind : int { f32 = 0, bf16 = 1, f16 = 2, affine = 3 };

// Element types of activations, outputs, scales and biases.
enum class Real : int { f32 = 0, bf16 = 1, f16 = 2 };

struct WeightView {
  WeightKind kind;
  const void* data;  // dense elements, or the packed codes (row stride in * bits / 8 bytes)
  const void* scales = nullptr;  // affine: [out, in / group] of `scale_type`
  const void* biases = nullptr;
  Real scale_type = Real::f32;
  int bits = 0;
  int group = 0;
  int64_t out;
  int64_t in;
  // 4- and 8-bit affine only: the codes, scales and biases of every kInterleave output rows
  // laid side by side (kernel_impl.h, interleaved_columns): word (tile, w, row % kInterleave)
  // of the codes holds row tile * kInterleave + row % kInterleave's word w (its codes
  // 32 / bits * w on); scale and bias (tile, group, row % kInterleave) that row's of the group
  bool interleaved = false;
};

// Runs a function once among the threads that call `run` (a product's column blocks making
// their shared activation layout), the others spinning until it has returned. The work takes
// microseconds; std::call_once put a thread that found it under way to sleep on a futex and
// woke it after (its slow path): with the decoding thread helping while it waits
// (products.wait), a demo-sized 8-bit drafting cycle spent ~5% of its samples in those
// sleeps and wakes and ran 0.74-0.77x as fast as with that thread asleep. A function that throws
// leaves it to the next caller, as call_once does.
class SpinOnce {
 public:
  template <class F>
  void run(F&& f) {
    for (int spins = 0;; ++spins) {
      int state = state_.load(std::memory_order_acquire);
      if (state == kDone) return;
      if (state == kIdle && state_.compare_exchange_strong(state, kRunning,
                                                            std::memory_order_acquire)) {
        try {
          f();
        } catch (...) {
          state_.store(kIdle, std::memory_order_release);
          throw;
        }
        state_.store(kDone, std::memory_order_release);
        return;
      }
      pause();
      // a runner the OS has descheduled needs a core more than this spin does
      if ((spins & 1023) == 1023) std::this_thread::yield();
    }
  }

 private:
  static void pause() {
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
  static constexpr int kIdle = 0, kRunning = 1, kDone = 2;
  std::atomic<int> state_{kIdle};
};

// Output rows an interleaved weight lays side by side: one AVX-512 vector of int32 lanes.
constexpr int kInterleave = 16;

// The activation rows as the 4- and 8-bit path multiplies them (kernel_impl.h,
// quantize_rows): 8-bit integers laid out for the codes, one fp32 scale per run of 32 (then
// zero scales a vector wide) and each group's sum of the quantized x. One product's column
// blocks share them: the first block to start fills them (`once`).
struct QuantizedRows {
  SpinOnce once;
  std::vector<int8_t> q;
  std::vector<float> scales;
  std::vector<float> group_sums;
  std::vector<int32_t> run_sums;  // each run's sum of q, laid out as the scales
  int64_t q_stride = 0;
  int64_t scale_stride = 0;
};

// The activation as every weight of one op may take it whatever the weight (an instruction
// set's own layout of x, made once an op by whichever product needs it first): a prompt's bf16
// products on AMX tiles take x in three bf16 parts (kernel_amx.cpp).
struct SharedRows {
  SpinOnce once;
  std::vector<uint16_t> bf16_parts;
};

// One product's operands, as every kernel sees them. `x` is the activation widened to fp32,
// `rows` rows of `x_stride` floats each, zero from column `in` to the end of the row (so that
// a kernel may read whole vectors past the end of a row).
struct ProductArgs {
  const float* x;
  int64_t x_stride;
  int rows;
  WeightView w;
  void* y;  // [rows, out] of `y_type`, row-major
  Real y_type;
  QuantizedRows* quantized;  // filled once, where its weight is 4- or 8-bit (shared by an op's
                             // weights of one width and group)
  SharedRows* shared;  // filled once an op, where a weight's path needs it
  // a prompt's product (prefill): an instruction set may take another path for it than for
  // decoding's, the same one for every row count (kernel_amx.cpp: 4-bit and bf16 weights on
  // tiles)
  bool prompt = false;
};

// Rows of x are padded to a multiple of this many floats (the widest vector).
constexpr int64_t kPad = 16;

// Computes the output columns [first, last) of every row. The order in which one output
// element's sum is accumulated depends only on `in` and the weight's kind: never on `rows`, on
// which columns share the call, or on the thread that runs it. So row t of a T-row product is
// bit for bit the one-row product of that row, whatever the thread count.
using ColumnsKernel = void (*)(const ProductArgs&, int64_t first, int64_t last);

// The kernels, one per instruction set (each compiled in its own translation unit).
void columns_scalar(const ProductArgs&, int64_t first, int64_t last);
#if defined(__x86_64__) || defined(_M_X64)
void columns_avx2(const ProductArgs&, int64_t first, int64_t last);
void columns_avx512(const ProductArgs&, int64_t first, int64_t last);
void columns_avx512_vnni(const ProductArgs&, int64_t first, int64_t last);
#endif
#ifdef MTPSERVE_AMX
// AVX-512 VNNI with AMX-INT8 tiles for 8-bit weights (kernel_amx.cpp); usable where the
// CPU has the tiles and the OS grants this process their state.
void columns_amx(const ProductArgs&, int64_t first, int64_t last);
bool amx_usable();
#endif
#if defined(__aarch64__)
void columns_neon(const ProductArgs&, int64_t first, int64_t last);
#endif

// Scalar conversions shared by every kernel.
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
static inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t float_to_bf16(float f) {  // round to nearest even, as mlx does
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
#ifdef __AVX512F__
#include <immintrin.h>
// 16 floats' bits with each rounded to bf16 in its high half (nearest, ties to even, as
// float_to_bf16 rounds a number); the low halves are what that rounding leaves.
static inline __m512i bf16_rounded_bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
}
#endif
static inline float real_at(const void* p, Real type, int64_t i) {
  switch (type) {
    case Real::f32:
      return static_cast<const float*>(p)[i];
    case Real::bf16:
      return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    default:
      return half_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}
static inline void store_real(void* p, Real type, int64_t i, float v) {
  switch (type) {
    case Real::f32:
      static_cast<float*>(p)[i] = v;
      break;
    case Real::bf16:
      static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
      break;
    default:
      static_cast<uint16_t*>(p)[i] = float_to_half(v);
  }
}

// Activation elements that share one 8-bit scale on the 4- and 8-bit integer paths: the
// smallest group mlx writes, so that a group of any size holds whole runs and an outlier
// coarsens only its own 32 neighbours.
constexpr int kActivationRun = 32;

// lane i of v moved to lane i ^ K (K = 8, 4, 2)
template <int K>
static inline LaneInts lanes_xor(LaneInts v) {
  if constexpr (K == 8)
    return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  else if constexpr (K == 4)
    return __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  else
    return __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
}
// lane by lane the larger of a and b (masks and selects, not ?:, which not every compiler takes)
static inline LaneInts larger_of(LaneInts a, LaneInts b) {
  const LaneInts first = a > b;
  return (a & first) | (b & ~first);
}

// One run of activations as the integer paths multiply it: q[i] the nearest integer (ties to
// even) of x[i] * 127 / max|x|, within [-127, 127], added to `sum`; returns the run's scale
// max|x| / 127, NaN where an element is not finite (its outputs become NaN, as a float
// product's would; its q are zeros). In 16-lane vectors (GCC's vector extensions, as wide as
// the file's instruction set allows): element by element, a 4-bit 0.8B token of one row took
// ~5% longer. Adding and subtracting 1.5 * 2^23
// rounds a float below 2^22 to the nearest integer, ties to even (nearbyint's bits).
static inline float quantize_run(const float* x, int8_t* q, int32_t& sum) {
  typedef float floats __attribute__((vector_size(64)));
  typedef LaneInts ints;
  typedef int8_t bytes __attribute__((vector_size(16)));
  static_assert(kActivationRun == 32, "a run is two 16-lane vectors");
  floats v[2];
  __builtin_memcpy(v, x, sizeof v);
  // magnitudes' bits: a float is finite when they are below infinity's, and finite
  // magnitudes order as their bits do
  const ints m0 = (ints)v[0] & 0x7fffffff, m1 = (ints)v[1] & 0x7fffffff;
  const ints finite_lanes = (m0 < 0x7f800000) & (m1 < 0x7f800000);
  // the largest magnitude and whether every lane is finite, halving the lanes each step (the
  // maximum is exact in any order; lane by lane it took ~200 cycles a run with the sum below)
  ints larger = larger_of(m0, m1);
  ints all_finite = finite_lanes;
  larger = larger_of(larger, lanes_xor<8>(larger));
  all_finite &= lanes_xor<8>(all_finite);
  larger = larger_of(larger, lanes_xor<4>(larger));
  all_finite &= lanes_xor<4>(all_finite);
  larger = larger_of(larger, lanes_xor<2>(larger));
  all_finite &= lanes_xor<2>(all_finite);
  const int32_t amax_bits = std::max(larger[0], larger[1]);
  const bool finite = all_finite[0] && all_finite[1];
  if (!finite) {
    __builtin_memset(q, 0, kActivationRun);
    return std::nanf("");
  }
  float amax;
  __builtin_memcpy(&amax, &amax_bits, 4);
  const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  const float shift = 12582912.0f;  // 1.5 * 2^23
  ints total = {};
  for (int h = 0; h < 2; ++h) {
    const floats r = (v[h] * inverse + shift) - shift;  // |r| <= 127 but for rounding
    ints codes = __builtin_convertvector(r, ints);
    const ints low = codes < -127, high = codes > 127;
    codes = (codes & ~(low | high)) | (-127 & low) | (127 & high);
    const bytes narrow = __builtin_convertvector(codes, bytes);
    __builtin_memcpy(q + 16 * h, &narrow, 16);
    total += codes;
  }
  // integer sums: exact in any order
  total += lanes_xor<8>(total);
  total += lanes_xor<4>(total);
  total += lanes_xor<2>(total);
  sum += total[0] + total[1];
  return amax / 127.0f;
}

// One code of an affine-quantized row: codes are a little-endian bit stream.
static inline uint32_t code_at(const uint8_t* row, int bits, int64_t i) {
  int64_t bit = i * bits;
  const uint8_t* p = row + (bit >> 3);
  uint32_t shift = static_cast<uint32_t>(bit & 7);
  uint32_t v = p[0];
  if (shift + bits > 8) v |= static_cast<uint32_t>(p[1]) << 8;
  return (v >> shift) & ((1u << bits) - 1u);
}

}  // namespace mtpserve
