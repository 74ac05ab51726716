// The VNNI kernel's own loop over interleaved 4- or 8-bit codes (as the engine lays them out for
// AVX-512) with the weight in cache, on one thread: nanoseconds and cycles a `vpdpbusd`, what a
// token's arithmetic would take were its bytes free. Against the same token's time from memory
// (scripts/experiments/kernel_token.cpp) it shows whether the two overlap:
//
//   g++ -std=c++20 -O3 -fno-fast-math -ffp-contract=off -mavx512f -mavx512bw -mavx512vl \
//     -mavx512dq -mavx512vnni -mavx2 -mfma -mf16c -Iengine/model/native \
//     scripts/experiments/loop_cost.cpp engine/model/native/kernel_avx512_vnni.cpp -o /tmp/loop_cost
//   /tmp/loop_cost BITS ROWS OUT IN REPEATS GHZ     e.g. /tmp/loop_cost 4 5 2048 1024 20 3.64
//
// GHZ is the clock the cycles are counted at. Random codes, constant bf16 scales and biases.
// Built with -DLOOP_AVX2 from engine/model/native/kernel_avx2.cpp instead (-mavx2 -mfma -mf16c),
// it times the AVX2 kernel's loop, "a vpdpbusd" then standing for every 4 codes of 16 outputs
// and a row as there; with -DLOOP_AVX512 from kernel_avx512.cpp (the flags above without
// -mavx512vnni), the AVX-512 kernel's without VNNI. Every build reads the codes interleaved, as
// the engine lays them out for these kernels: two builds from two checkouts, run in turns,
// compare two versions of a loop.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "products.h"

namespace mtpserve {
// products.cpp's conversions; bf16 scales and outputs never call them
float half_to_float(uint16_t) { std::abort(); }
uint16_t float_to_half(float) { std::abort(); }
}  // namespace mtpserve

using namespace mtpserve;

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s BITS ROWS OUT IN REPEATS GHZ\n", argv[0]);
    return 2;
  }
  const int bits = std::atoi(argv[1]), rows = std::atoi(argv[2]);
  const int64_t out = std::atoll(argv[3]), in = std::atoll(argv[4]);
  const int repeats = std::atoi(argv[5]);
  const double ghz = std::atof(argv[6]);
  std::mt19937 rng(1);
  std::vector<uint8_t> codes(out * in * bits / 8);
  for (auto& c : codes) c = static_cast<uint8_t>(rng());
  std::vector<uint16_t> scales(out * in / 64, float_to_bf16(0.01f));
  std::vector<uint16_t> biases(out * in / 64, float_to_bf16(-0.02f));
  std::vector<float> x(rows * in);
  for (auto& v : x) v = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 1000.0f;
  std::vector<uint16_t> y(rows * out);
  SharedRows shared;
  WeightView view{WeightKind::affine, codes.data(), scales.data(), biases.data(),
                  Real::bf16, bits, 64, out, in};
#if defined(LOOP_AVX2)
  const auto kernel = columns_avx2;
#elif defined(LOOP_AVX512)
  const auto kernel = columns_avx512;
#else
  const auto kernel = columns_avx512_vnni;
#endif
  view.interleaved = true;
  double best = 1e9;
  for (int round = 0; round < 7; ++round) {
    QuantizedRows quantized;  // the activation quantized once, by the first call
    const ProductArgs args{x.data(), in, rows, view, y.data(), Real::bf16, &quantized, &shared};
    kernel(args, 0, out);
    const auto start = std::chrono::steady_clock::now();
    for (int r = 0; r < repeats; ++r) kernel(args, 0, out);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  const double dots = static_cast<double>(out) * in / 64 * rows * repeats;
  std::printf("q%d, %d rows, %ld x %ld: %.3f ns a vpdpbusd, %.2f cycles at %.2f GHz\n", bits, rows,
              out, in, best / dots * 1e9, best / dots * ghz * 1e9, ghz);
  return 0;
}
