// Every 4- or 8-bit projection of a Qwen3.5-0.8B-shaped decoding step (scripts/bench_kernel.py's
// "token") on the native kernel's x86 code alone — no mlx, no Python, no pool — on two threads
// that split each product's columns in halves and meet after it, against the same bytes read
// once on the same threads; then each shape's share of the time against its bytes at that read
// speed. What the kernel's own loops cost, apart from the per-op dispatch the primitive adds:
//
//   g++ -std=c++20 -O3 -fno-fast-math -ffp-contract=off -mavx512f -mavx512bw -mavx512vl \
//     -mavx512dq -mavx512vnni -mamx-tile -mamx-int8 -mamx-bf16 -mavx2 -mfma -mf16c -DMTPSERVE_AMX \
//     -Iengine/model/native scripts/experiments/kernel_token.cpp \
//     engine/model/native/kernel_avx512_vnni.cpp engine/model/native/kernel_amx.cpp \
//     -lpthread -o /tmp/kernel_token
//   /tmp/kernel_token BITS ISA ROWS ROUNDS     e.g. /tmp/kernel_token 4 vnni 1 6
//
// ISA is `vnni` (AVX-512 VNNI) or `amx` (AMX tiles for 8 bits, else VNNI). Two builds from two
// checkouts, run in turns, compare two versions of the kernel. The codes are random bytes, the
// scales and biases constants: the time does not depend on them. The weights lie in transparent
// huge pages, as the server's do under jemalloc (engine/allocator.py); SMALL_PAGES=1 in the
// environment keeps them in 4 KiB pages. `vnni` lays the codes out 16 outputs to a vector as the
// engine does (products.interleave); ROW_MAJOR=1 keeps them a row after another.
#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include <sys/mman.h>

#include "products.h"

namespace mtpserve {
// products.cpp's conversions; bf16 scales and outputs never call them
float half_to_float(uint16_t) { std::abort(); }
uint16_t float_to_half(float) { std::abort(); }
}  // namespace mtpserve

using namespace mtpserve;
using Shape = std::pair<int64_t, int64_t>;  // [out, in]

namespace {

// Whole 2 MiB pages, advised for transparent huge pages unless SMALL_PAGES is set.
template <class T>
struct PageAllocator {
  using value_type = T;
  PageAllocator() = default;
  template <class U>
  PageAllocator(const PageAllocator<U>&) {}
  T* allocate(size_t n) {
    constexpr size_t kPage = 2u << 20;
    const size_t bytes = (n * sizeof(T) + kPage - 1) / kPage * kPage;
    void* p = std::aligned_alloc(kPage, bytes);
    if (p == nullptr) throw std::bad_alloc();
    if (std::getenv("SMALL_PAGES") == nullptr) madvise(p, bytes, MADV_HUGEPAGE);
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  bool operator==(const PageAllocator&) const { return true; }
};

struct Weight {
  Shape shape;
  std::vector<uint8_t, PageAllocator<uint8_t>> codes;
  std::vector<uint16_t, PageAllocator<uint16_t>> scales, biases;  // bf16
  double bytes() const { return codes.size() + 2.0 * (scales.size() + biases.size()); }
};

// bench_kernel.py's shapes: three Gated-DeltaNet layers then one attention layer, each with
// its MLP, 24 layers, then the vocabulary
std::vector<Shape> token_shapes() {
  const std::vector<Shape> gdn = {{6144, 1024}, {2048, 1024}, {16, 1024}, {16, 1024}, {1024, 2048}};
  const std::vector<Shape> attention = {{4096, 1024}, {512, 1024}, {512, 1024}, {1024, 2048}};
  const std::vector<Shape> mlp = {{3584, 1024}, {3584, 1024}, {1024, 3584}};
  std::vector<Shape> shapes;
  for (int layer = 0; layer < 24; ++layer) {
    for (const Shape& s : (layer + 1) % 4 ? gdn : attention) shapes.push_back(s);
    for (const Shape& s : mlp) shapes.push_back(s);
  }
  shapes.push_back({248320, 1024});
  return shapes;
}

// Two threads meeting after each product: the caller and one spinning helper.
class Pair {
 public:
  explicit Pair(const std::function<void(int)>& body) : body_(body), helper_([this] { serve(); }) {}
  ~Pair() {
    stop_ = true;
    helper_.join();
  }
  void run() {
    const int done = done_.load();
    go_.fetch_add(1);
    body_(0);
    while (done_.load() == done) _mm_pause();
  }
  // each thread calls this after its half of a product
  void meet() {
    const int generation = generation_.load();
    if (arrived_.fetch_add(1) == 1) {
      arrived_ = 0;
      generation_.fetch_add(1);
    } else {
      while (generation_.load() == generation) _mm_pause();
    }
  }

 private:
  void serve() {
    int seen = 0;
    while (!stop_) {
      if (go_.load() > seen) {
        seen = go_.load();
        body_(1);
        done_.fetch_add(1);
      } else {
        _mm_pause();
      }
    }
  }
  const std::function<void(int)>& body_;
  std::atomic<int> go_{0}, done_{0}, arrived_{0}, generation_{0};
  std::atomic<bool> stop_{false};
  std::thread helper_;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s BITS(4|8) ISA(vnni|amx) ROWS ROUNDS\n", argv[0]);
    return 2;
  }
  const int bits = std::atoi(argv[1]);
  const bool amx = std::strcmp(argv[2], "amx") == 0;
  const int rows = std::atoi(argv[3]);
  const int rounds = std::atoi(argv[4]);
  if (amx && !amx_usable()) {
    std::fprintf(stderr, "this CPU or kernel gives no AMX tiles\n");
    return 1;
  }
  const ColumnsKernel kernel = amx ? columns_amx : columns_avx512_vnni;
  // the engine's layout of 4/8-bit weights for the VNNI kernel (products.interleave); random
  // codes and constant scales, so the same arrays serve either layout
  const bool interleaved = !amx && std::getenv("ROW_MAJOR") == nullptr;
  std::mt19937 rng(1);
  std::vector<Weight> weights;
  double bytes = 0;
  for (const Shape& s : token_shapes()) {
    Weight w{s};
    w.codes.resize(s.first * s.second * bits / 8);
    for (auto& c : w.codes) c = static_cast<uint8_t>(rng());
    w.scales.assign(s.first * s.second / 64, float_to_bf16(0.01f));
    w.biases.assign(s.first * s.second / 64, float_to_bf16(-0.02f));
    bytes += w.bytes();
    weights.push_back(std::move(w));
  }
  std::vector<float> x(rows * 3584);
  for (auto& v : x) v = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 1000.0f;
  std::vector<uint16_t> y(rows * 248320);
  std::vector<QuantizedRows> quantized(weights.size());
  SharedRows shared;  // the bf16 path's; unused by these 4- and 8-bit weights
  std::vector<double> product_s(weights.size(), 1e9);  // each product's best, thread 0's clock
  bool reading = false;
  std::atomic<int64_t> sink{0};
  Pair* pair = nullptr;

  const auto read_half = [](const void* data, double n_bytes, int half) {
    const auto* p = static_cast<const uint8_t*>(data);
    const int64_t n = static_cast<int64_t>(n_bytes) / 64 * 64, mid = n / 2 / 64 * 64;
    __m512i acc = _mm512_setzero_si512();
    for (int64_t i = half ? mid : 0; i < (half ? n : mid); i += 64)
      acc = _mm512_add_epi32(acc, _mm512_loadu_si512(p + i));
    return static_cast<int64_t>(_mm512_reduce_add_epi32(acc));
  };
  const std::function<void(int)> body = [&](int half) {
    if (reading) {
      int64_t acc = 0;
      for (const Weight& w : weights) {
        acc += read_half(w.codes.data(), w.codes.size(), half);
        acc += read_half(w.scales.data(), 2.0 * w.scales.size(), half);
        acc += read_half(w.biases.data(), 2.0 * w.biases.size(), half);
      }
      sink += acc;
      return;
    }
    for (size_t i = 0; i < weights.size(); ++i) {
      const auto start = std::chrono::steady_clock::now();
      const Weight& w = weights[i];
      const auto [out, in] = w.shape;
      WeightView view{WeightKind::affine, w.codes.data(), w.scales.data(), w.biases.data(),
                      Real::bf16, bits, 64, out, in};
      view.interleaved = interleaved;
      const ProductArgs args{x.data(), in, rows, view, y.data(), Real::bf16, &quantized[i], &shared};
      const int64_t middle = (out / 2 + 15) / 16 * 16;
      const int64_t first = half ? middle : 0, last = half ? out : middle;
      if (first < last) kernel(args, first, last);
      pair->meet();
      if (half == 0) {
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        product_s[i] = std::min(product_s[i], s);
      }
    }
  };
  Pair threads(body);
  pair = &threads;
  const auto timed = [&](bool read) {
    reading = read;
    for (auto& q : quantized) {  // a fresh activation each round, as a new step's
      q.~QuantizedRows();
      new (&q) QuantizedRows();
    }
    const auto start = std::chrono::steady_clock::now();
    threads.run();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  double product = 1e9, read = 1e9;
  for (int r = 0; r < rounds; ++r) {  // the read and the products in turns, best of each
    read = std::min(read, timed(true));
    product = std::min(product, timed(false));
  }
  const double read_rate = bytes / read;
  std::vector<std::pair<Shape, std::pair<double, double>>> by_shape;  // shape: (s, bytes)
  for (size_t i = 0; i < weights.size(); ++i) {
    auto it = by_shape.begin();
    while (it != by_shape.end() && it->first != weights[i].shape) ++it;
    if (it == by_shape.end()) {
      by_shape.push_back({weights[i].shape, {0.0, 0.0}});
      it = by_shape.end() - 1;
    }
    it->second.first += product_s[i];
    it->second.second += weights[i].bytes();
  }
  for (const auto& [shape, cost] : by_shape)
    std::printf("  %6ld x %-5ld %8.3f ms, at the read speed %7.3f ms: %.2fx\n", shape.first,
                shape.second, cost.first * 1e3, cost.second / read_rate * 1e3,
                cost.first / (cost.second / read_rate));
  std::printf("q%d %s, %d rows: %.2f ms a token, the read %.2f ms (%.1f GB/s): %.2f of the read\n",
              bits, amx ? "amx" : "vnni", rows, product * 1e3, read * 1e3, read_rate / 1e9,
              read / product);
  return sink.load() == 42 ? 3 : 0;  // keeps the reads
}
