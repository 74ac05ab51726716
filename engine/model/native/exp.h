// exp for the elementwise primitives (the conv's and the MLP's silu): Cephes' single-precision
// polynomial after rounding x / ln 2 to the nearest integer, within ~2 ulp of exp. Plain fp32
// multiplies and adds (the module builds without contraction) and integer bit operations, so
// it is the same bits whatever the instruction set, and loops over it vectorize; glibc's
// powf, which mlx's CPU power calls one element at a time, costs ~10 ns an element.
#pragma once

#include <cstdint>
#include <cstring>

#include "shared_lanes.h"

// A function built once per x86 vector width, the widest the CPU runs picked when the module
// loads (function multiversioning): the loops over 16-lane values become one AVX-512 register,
// two AVX2 ones or four SSE ones. The same IEEE operations in the same order, so the same bits.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define MTPSERVE_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MTPSERVE_VECTOR_CLONES
#endif

namespace mtpserve {

// Everything here works on lanes.h's `Lanes` and `LaneInts`, 16 lanes at once (GCC vector
// extensions, which the compiler splits into the registers of the instruction set it targets).
// A tail shorter than 16 runs the same lanes, padded, so every element gets the same floats
// wherever it falls.

__attribute__((always_inline)) inline Lanes exp_poly(Lanes x) {
  // |x| beyond these gives 0 or inf through 2^n; inside, n stays a normal exponent
  const Lanes lo = Lanes{} - 87.33654f, hi = Lanes{} + 88.37626f;
  x = x < lo ? lo : (x > hi ? hi : x);
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const Lanes n = (x * 1.44269504088896341f + magic) - magic;
  const Lanes r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  const Lanes z = r * r;
  Lanes p = Lanes{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const Lanes y = p * z + r + 1.0f;
  const LaneInts bits = (__builtin_convertvector(n, LaneInts) + 127) << 23;
  Lanes scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// The first n (at most 16) floats at p as lanes, zeros after them; p is 4-byte aligned only. A
// whole vector is one load: a copy of a length known only at run time became `rep movsq` and
// took a fifth of a 0.8B verify's conv.
__attribute__((always_inline)) inline Lanes lanes_from(const float* p, int64_t n) {
  Lanes x{};
  if (n == 16)
    std::memcpy(&x, p, sizeof x);
  else
    std::memcpy(&x, p, n * sizeof(float));
  return x;
}

// The first n (at most 16) lanes of x to p.
__attribute__((always_inline)) inline void lanes_to(float* p, Lanes x, int64_t n) {
  if (n == 16)
    std::memcpy(p, &x, sizeof x);
  else
    std::memcpy(p, &x, n * sizeof(float));
}

// silu of 16 lanes: x / (1 + exp(-x)).
__attribute__((always_inline)) inline Lanes silu_lanes(Lanes x) {
  return x / (1.0f + exp_poly(-x));
}

// silu of v[0..n) in place.
__attribute__((always_inline)) inline void silu_in_place(float* v, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t lanes = n - i < 16 ? n - i : 16;
    lanes_to(v + i, silu_lanes(lanes_from(v + i, lanes)), lanes);
  }
}

// v[i] * sigmoid(g[i]) for i in [0, n), in place: sigmoid(g) = 1 / (1 + exp(-g)).
__attribute__((always_inline)) inline void sigmoid_gate(float* v, const float* g, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t lanes = n - i < 16 ? n - i : 16;
    const Lanes sigmoid = 1.0f / (1.0f + exp_poly(-lanes_from(g + i, lanes)));
    lanes_to(v + i, lanes_from(v + i, lanes) * sigmoid, lanes);
  }
}

}  // namespace mtpserve
