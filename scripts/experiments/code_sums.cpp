// The AVX2 kernel's 4- and 8-bit integer sums alone: one thread, one 256 x 1024 weight (groups of
// 64, bf16 scales) that stays in cache, 1-5 activation rows, the lowest of 400 timings of 20
// products each. What the loops' instructions cost, apart from memory and the pool: two builds
// from two checkouts, run in turns, compare two versions of kernel_avx2.cpp.
//
//   g++ -std=c++20 -O3 -fno-fast-math -ffp-contract=off -mavx2 -mfma -mf16c \
//     -Iengine/model/native scripts/experiments/code_sums.cpp \
//     engine/model/native/kernel_avx2.cpp -lpthread -o /tmp/code_sums
//   /tmp/code_sums BITS        e.g. /tmp/code_sums 4
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
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s BITS(4|8)\n", argv[0]);
    return 2;
  }
  const int bits = std::atoi(argv[1]);
  const int64_t out = 256, in = 1024;
  std::mt19937 rng(1);
  std::vector<uint8_t> codes(out * in * bits / 8);
  for (auto& c : codes) c = static_cast<uint8_t>(rng());
  std::vector<uint16_t> scales(out * in / 64, float_to_bf16(0.01f));
  std::vector<uint16_t> biases(out * in / 64, float_to_bf16(-0.02f));
  std::vector<float> x(5 * in);
  for (auto& v : x) v = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 1000.0f;
  std::vector<uint16_t> y(5 * out);
  for (int rows = 1; rows <= 5; ++rows) {
    double best = 1e9;
    for (int timing = 0; timing < 400; ++timing) {
      QuantizedRows quantized;
      SharedRows shared;
      const WeightView view{WeightKind::affine, codes.data(), scales.data(), biases.data(),
                            Real::bf16, bits, 64, out, in};
      const ProductArgs args{x.data(), in, rows, view, y.data(), Real::bf16, &quantized, &shared};
      columns_avx2(args, 0, out);  // quantizes the activation once
      const auto start = std::chrono::steady_clock::now();
      for (int k = 0; k < 20; ++k) columns_avx2(args, 0, out);
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / 20;
      best = std::min(best, s);
    }
    std::printf("q%d, %d rows: %.1f us a product\n", bits, rows, best * 1e6);
  }
  return 0;
}
