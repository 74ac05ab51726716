// The NEON product kernel against the portable one, built for arm64 and run under qemu-aarch64
// on an x86 machine (tests/unit/test_neon_kernel.py): every weight kind, odd widths, 1-64 rows,
// and each row of a many-row product the same bits as that row alone.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#include "products.h"

namespace mtpserve {
float half_to_float(uint16_t h) { __fp16 f; std::memcpy(&f, &h, 2); return static_cast<float>(f); }
uint16_t float_to_half(float v) { __fp16 f = static_cast<__fp16>(v); uint16_t h; std::memcpy(&h, &f, 2); return h; }
}
using namespace mtpserve;

static std::mt19937 rng(1);
static float rnd() { return std::normal_distribution<float>(0.f, 1.f)(rng); }
int failures = 0;

void run(ColumnsKernel k, WeightView w, const std::vector<float>& x, int rows, int64_t stride, std::vector<float>& y) {
  y.assign(rows * w.out, 0.f);
  QuantizedRows quantized;
  ProductArgs a{x.data(), stride, rows, w, y.data(), Real::f32, &quantized};
  k(a, 0, w.out);
}

void check(const char* what, WeightView w, int rows, double tol) {
  const int64_t stride = (w.in + kPad - 1) / kPad * kPad;
  std::vector<float> x(rows * stride, 0.f);
  for (int t = 0; t < rows; ++t) for (int64_t i = 0; i < w.in; ++i) x[t * stride + i] = rnd();
  std::vector<float> yn, ys;
  run(columns_neon, w, x, rows, stride, yn);
  run(columns_scalar, w, x, rows, stride, ys);
  double worst = 0, scale = 1e-30;
  for (size_t i = 0; i < ys.size(); ++i) { worst = std::max(worst, (double)std::fabs(yn[i] - ys[i])); scale = std::max(scale, (double)std::fabs(ys[i])); }
  // a row alone: the same bits
  bool same = true;
  for (int t = 0; t < rows; ++t) {
    std::vector<float> x1(x.begin() + t * stride, x.begin() + (t + 1) * stride), y1;
    run(columns_neon, w, x1, 1, stride, y1);
    if (std::memcmp(y1.data(), yn.data() + t * w.out, w.out * 4)) same = false;
  }
  const bool ok = worst / scale < tol && same;
  if (!ok) ++failures;
  std::printf("%-4s %s in=%lld out=%lld rows=%d rel=%.2e row-exact=%d\n", ok ? "ok" : "FAIL", what, (long long)w.in, (long long)w.out, rows, worst / scale, same);
}

int main() {
  for (int64_t in : {1, 50, 129, 1000, 9000}) for (int rows : {1, 2, 5, 9, 24, 64}) {
    const int64_t out = 37;
    std::vector<float> f(out * in); for (auto& v : f) v = rnd();
    std::vector<uint16_t> b(out * in), h(out * in);
    for (size_t i = 0; i < f.size(); ++i) { b[i] = float_to_bf16(f[i]); h[i] = float_to_half(f[i]); }
    check("f32", WeightView{WeightKind::f32, f.data(), nullptr, nullptr, Real::f32, 0, 0, out, in}, rows, 1e-5);
    check("bf16", WeightView{WeightKind::bf16, b.data(), nullptr, nullptr, Real::f32, 0, 0, out, in}, rows, 1e-5);
    check("f16", WeightView{WeightKind::f16, h.data(), nullptr, nullptr, Real::f32, 0, 0, out, in}, rows, 1e-5);
  }
  for (int bits : {3, 4, 8}) for (int group : {32, 64, 128}) for (int64_t mult : {3, 17, 72}) for (int rows : {1, 5, 24}) {
    const int64_t in = group * mult, out = 45;
    std::vector<uint8_t> codes(out * in * bits / 8); for (auto& c : codes) c = rng() & 0xff;
    std::vector<float> scales(out * in / group), biases(out * in / group);
    for (auto& v : scales) v = 0.05f * rnd(); for (auto& v : biases) v = 0.2f * rnd();
    WeightView w{WeightKind::affine, codes.data(), scales.data(), biases.data(), Real::f32, bits, group, out, in};
    char name[32]; std::snprintf(name, sizeof name, "q%d/g%d", bits, group);
    check(name, w, rows, 1e-5);
  }
  std::printf("%d failures\n", failures);
  return failures != 0;
}
