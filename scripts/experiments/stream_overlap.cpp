// Two threads streaming 800 MB of 8-bit codes with the interleaved tile's operations (AVX-512
// VNNI; one or five activation rows: per 64 bytes an integer sum a row, per run of 8 words the
// conversion, the scales' product and the multiply-add), against reading the same bytes alone,
// with and without software prefetches into L1 and L2 at several distances: whether a verify's
// arithmetic hides behind the memory stream, and whether prefetching helps it to.
//
//   g++ -O3 -march=native -pthread scripts/experiments/stream_overlap.cpp -o /tmp/so && /tmp/so
#include <immintrin.h>
#include <pthread.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

constexpr int kRunWords = 8;        // 64-byte words of codes a run of 32 activation codes takes
constexpr size_t kTileWords = 256;  // a tile over 1,024 codes: where the activation restarts

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Setting {
  const char* name;
  bool read_only;
  int rows;      // 1 or 5
  int ahead_l1;  // bytes ahead prefetched into L1 (0: none)
  int ahead_l2;  // and into L2
};

static size_t words_a_thread;
static __m512i* codes;
static int activation[5][kTileWords] __attribute__((aligned(64)));
static float activation_scale[5][kTileWords / kRunWords];
static float weight_scale[16];
static Setting setting;
static volatile float sink[2];

static void* stream(void* arg) {
  const int id = *static_cast<int*>(arg);
  const __m512i* w = codes + id * words_a_thread;
  if (setting.read_only) {
    __m512i sum = _mm512_setzero_si512();
    for (size_t i = 0; i < words_a_thread; ++i)
      sum = _mm512_add_epi32(sum, _mm512_loadu_si512(w + i));
    sink[id] = static_cast<float>(_mm512_reduce_add_epi32(sum));
    return nullptr;
  }
  const __m512 scale = _mm512_loadu_ps(weight_scale);
  __m512 c[5];
  for (auto& v : c) v = _mm512_setzero_ps();
  for (size_t run = 0; run < words_a_thread / kRunWords; ++run) {
    const __m512i* p = w + run * kRunWords;
    const char* at = reinterpret_cast<const char*>(p);
    if (setting.ahead_l1) __builtin_prefetch(at + setting.ahead_l1, 0, 3);
    if (setting.ahead_l2) __builtin_prefetch(at + setting.ahead_l2, 0, 2);
    const size_t first = run * kRunWords % kTileWords;
    __m512i d[5];
    for (auto& v : d) v = _mm512_setzero_si512();
    for (int k = 0; k < kRunWords; ++k) {
      const __m512i v = _mm512_loadu_si512(p + k);
      for (int r = 0; r < setting.rows; ++r)
        d[r] = _mm512_dpbusd_epi32(d[r], v, _mm512_set1_epi32(activation[r][first + k]));
    }
    for (int r = 0; r < setting.rows; ++r) {
      const __m512 run_scale = _mm512_set1_ps(activation_scale[r][first / kRunWords]);
      c[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r]), _mm512_mul_ps(scale, run_scale), c[r]);
    }
  }
  float total = 0;
  for (const auto& v : c) total += _mm512_reduce_add_ps(v);
  sink[id] = total;
  return nullptr;
}

int main() {
  const size_t bytes = size_t{800} << 20;
  words_a_thread = bytes / 64 / 2;
  codes = static_cast<__m512i*>(aligned_alloc(64, bytes));
  std::memset(codes, 1, bytes);
  for (int i = 0; i < 16; ++i) weight_scale[i] = 0.01f * i;
  for (int r = 0; r < 5; ++r) {
    for (size_t i = 0; i < kTileWords; ++i) activation[r][i] = static_cast<int>(i) * r;
    for (size_t i = 0; i < kTileWords / kRunWords; ++i) activation_scale[r][i] = 1.0f / (i + 1);
  }
  const Setting settings[] = {
      {"read", true, 1, 0, 0},         {"1 row, L1 2K L2 4K", false, 1, 2048, 4096},
      {"1 row, none", false, 1, 0, 0}, {"5 rows, L1 2K L2 4K", false, 5, 2048, 4096},
      {"5 rows, none", false, 5, 0, 0}, {"5 rows, L1 4K", false, 5, 4096, 0},
      {"5 rows, L1 4K L2 8K", false, 5, 4096, 8192},
      {"5 rows, L1 8K L2 16K", false, 5, 8192, 16384},
      {"5 rows, L1 1K L2 4K", false, 5, 1024, 4096},
  };
  for (int round = 0; round < 3; ++round)
    for (const Setting& s : settings) {
      setting = s;
      pthread_t threads[2];
      int ids[2] = {0, 1};
      const double start = now();
      for (int i = 0; i < 2; ++i) pthread_create(&threads[i], nullptr, stream, &ids[i]);
      for (auto& t : threads) pthread_join(t, nullptr);
      const double seconds = now() - start;
      std::printf("%-22s %6.2f ms  %5.1f GB/s\n", s.name, seconds * 1e3, bytes / seconds / 1e9);
    }
}
