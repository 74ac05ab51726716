// Two layouts of 8-bit codes times 8-bit activations on AVX-512 VNNI, one thread, the weights
// (256 x 2,048 codes, 512 KiB) in cache: what each layout's instructions cost once reading is
// not the limit (a verify's rows, a prompt's).
// - rowwise: each output's 16-lane accumulator over its own codes (the kernel's code_tile):
//   per 64 codes and activation row an integer sum, its conversion, the two scales' product
//   and a multiply-add;
// - interleaved: 16 outputs a vector, four codes of each per 32-bit lane (the layout of
//   engine.model.products.interleave), the activation's four codes broadcast to every lane:
//   eight integer sums per run of 32 codes, then the conversion, the product and the add.
//
//   g++ -O3 -march=native -std=c++17 scripts/experiments/interleaved_codes.cpp -o /tmp/ic
//   /tmp/ic
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
constexpr int IN = 2048, OUT = 256, RUN = 32, GROUP = 64;
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

template <int RN>
__attribute__((noinline)) void rowwise(const uint8_t* w, const float* ws, const int8_t* q, const float* xs, float* y) {
  for (int j0 = 0; j0 < OUT; j0 += 4) {
    __m512 c[RN][4];
    for (int r = 0; r < RN; ++r) for (int j = 0; j < 4; ++j) c[r][j] = _mm512_setzero_ps();
    for (int m = 0; m < IN / 64; ++m) {
      __m512i xq[RN]; __m512 xsc[RN];
      for (int r = 0; r < RN; ++r) {
        xq[r] = _mm512_loadu_si512(q + r * IN + m * 64);
        // two runs per block: lanes 0-7 run 2m, 8-15 run 2m+1
        __m256 a = _mm256_set1_ps(xs[r * (IN / RUN) + 2 * m]), b = _mm256_set1_ps(xs[r * (IN / RUN) + 2 * m + 1]);
        xsc[r] = _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
      }
      for (int j = 0; j < 4; ++j) {
        __m512i v = _mm512_loadu_si512(w + (j0 + j) * IN + m * 64);
        __m512 s = _mm512_set1_ps(ws[(j0 + j) * (IN / GROUP) + m]);
        for (int r = 0; r < RN; ++r) {
          __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, xq[r]);
          c[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s, xsc[r]), c[r][j]);
        }
      }
    }
    for (int r = 0; r < RN; ++r) for (int j = 0; j < 4; ++j) y[r * OUT + j0 + j] = _mm512_reduce_add_ps(c[r][j]);
  }
}

// interleaved: wi[(j0/16) * IN*16 + (k/4)*64 + (j%16)*4 + k%4]; scales wsi[(j0/16)*(IN/GROUP)*16 + g*16 + j%16]
template <int RN, int JN>
__attribute__((noinline)) void interleaved(const uint8_t* wi, const float* wsi, const int8_t* q, const float* xs, float* y) {
  for (int j0 = 0; j0 < OUT; j0 += 16 * JN) {
    __m512 c[RN][JN];
    for (int r = 0; r < RN; ++r) for (int j = 0; j < JN; ++j) c[r][j] = _mm512_setzero_ps();
    for (int run = 0; run < IN / RUN; ++run) {
      __m512i d[RN][JN];
      for (int r = 0; r < RN; ++r) for (int j = 0; j < JN; ++j) d[r][j] = _mm512_setzero_si512();
      for (int kk = 0; kk < RUN / 4; ++kk) {
        const int k4 = run * (RUN / 4) + kk;
        __m512i v[JN];
        for (int j = 0; j < JN; ++j) v[j] = _mm512_loadu_si512(wi + ((j0 / 16 + j) * (IN / 4) + k4) * 64);
        for (int r = 0; r < RN; ++r) {
          const __m512i b = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(q + r * IN + k4 * 4));
          for (int j = 0; j < JN; ++j) d[r][j] = _mm512_dpbusd_epi32(d[r][j], v[j], b);
        }
      }
      const int g = run * RUN / GROUP;
      for (int j = 0; j < JN; ++j) {
        const __m512 s = _mm512_loadu_ps(wsi + ((j0 / 16 + j) * (IN / GROUP) + g) * 16);
        for (int r = 0; r < RN; ++r)
          c[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r][j]), _mm512_mul_ps(s, _mm512_set1_ps(xs[r * (IN / RUN) + run])), c[r][j]);
      }
    }
    for (int r = 0; r < RN; ++r) for (int j = 0; j < JN; ++j) _mm512_storeu_ps(y + r * OUT + j0 + 16 * j, c[r][j]);
  }
}

int main() {
  std::vector<uint8_t> w(OUT * IN), wi(OUT * IN);
  std::vector<float> ws(OUT * IN / GROUP), wsi(OUT * IN / GROUP);
  std::vector<int8_t> q(8 * IN); std::vector<float> xs(8 * IN / RUN), y(8 * OUT), y2(8 * OUT);
  srand(1);
  for (auto& b : w) b = rand() & 255;
  for (auto& s : ws) s = (rand() % 1000) / 1000.0f;
  for (auto& b : q) b = (rand() % 255) - 127;
  for (auto& s : xs) s = (rand() % 1000) / 1000.0f;
  for (int j = 0; j < OUT; ++j) for (int k = 0; k < IN; ++k) wi[((j / 16) * (IN / 4) + k / 4) * 64 + (j % 16) * 4 + k % 4] = w[j * IN + k];
  for (int j = 0; j < OUT; ++j) for (int g = 0; g < IN / GROUP; ++g) wsi[((j / 16) * (IN / GROUP) + g) * 16 + j % 16] = ws[j * (IN / GROUP) + g];
  auto bench = [&](const char* name, int rn, auto f) {
    double best = 1e9;
    for (int rep = 0; rep < 7; ++rep) { double t = now(); for (int i = 0; i < 200; ++i) f(); best = std::min(best, (now() - t) / 200); }
    printf("%-12s T=%d %7.1f us  %6.1f GMAC/s\n", name, rn, best * 1e6, rn * double(IN) * OUT / best / 1e9);
  };
#define RUNT(RN) \
  bench("rowwise", RN, [&] { rowwise<RN>(w.data(), ws.data(), q.data(), xs.data(), y.data()); }); \
  bench("interleaved", RN, [&] { interleaved<RN, (RN <= 2 ? 4 : 2)>(wi.data(), wsi.data(), q.data(), xs.data(), y2.data()); }); \
  { double e = 0; for (int i = 0; i < RN * OUT; ++i) e = std::max(e, (double)std::abs(y[i] - y2[i]) / (1e-3 + std::abs(y[i]))); printf("  rel diff %.2e\n", e); }
  RUNT(1) RUNT(2) RUNT(3) RUNT(4) RUNT(5)
}
