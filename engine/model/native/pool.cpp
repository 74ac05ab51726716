#include "pool.h"

#include <chrono>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MTPSERVE_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define MTPSERVE_PAUSE() asm volatile("yield")
#else
#define MTPSERVE_PAUSE() ((void)0)
#endif

namespace mtpserve {

ThreadPool::ThreadPool(int threads, int spin_us) : spin_us_(spin_us) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { work(i); });
}

ThreadPool::~ThreadPool() {
  stopping_.store(true);
  epoch_.fetch_add(1, std::memory_order_release);
  epoch_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run(const std::function<void(int)>& body) {
  std::unique_lock<std::mutex> lock(running_, std::try_to_lock);
  if (!lock.owns_lock() || workers_.empty()) {
    for (int part = 0; part < threads(); ++part) body(part);
    return;
  }
  body_ = &body;
  pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
  epoch_.fetch_add(1, std::memory_order_release);
  epoch_.notify_all();
  body(0);
  while (pending_.load(std::memory_order_acquire) != 0) MTPSERVE_PAUSE();
  body_ = nullptr;
}

void ThreadPool::work(int index) {
  uint32_t seen = 0;  // the epoch at construction: a job posted before this thread ran is still seen
  for (;;) {
    uint32_t now = epoch_.load(std::memory_order_acquire);
    if (now == seen) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
      for (int i = 0; (now = epoch_.load(std::memory_order_acquire)) == seen; ++i) {
        MTPSERVE_PAUSE();
        if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) {
          epoch_.wait(seen, std::memory_order_acquire);
        }
      }
    }
    seen = now;
    if (stopping_.load()) return;
    (*body_)(index);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace mtpserve
