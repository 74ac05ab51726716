#include "pool.h"

#include <chrono>

#include <sched.h>

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
  wake_.fetch_add(1);
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run(const std::function<void(int)>& body) {
  std::unique_lock<std::mutex> lock(running_, std::try_to_lock);
  if (!lock.owns_lock() || workers_.empty()) {
    body(0);
    return;
  }
  const uint64_t epoch = (state_.load() >> 32) + 1;
  body_.store(&body);
  finished_.store(0);
  state_.store(epoch << 32 | kOpen);
  wake_.store(static_cast<uint32_t>(epoch));
  if (helpers_.load() == 0) wake_.notify_all();
  body(0);
  // close the job to late workers; wait only for those that joined
  const uint64_t joined = state_.fetch_and(~kOpen) & (kOpen - 1);
  while (static_cast<uint64_t>(finished_.load()) != joined) MTPSERVE_PAUSE();
}

int ThreadPool::help_until(const std::function<bool()>& done) {
  const int index = threads();
  int joined = 0;
  helpers_.fetch_add(1);
  uint32_t joined_epoch = 0;
  for (int i = 0;; ++i) {
    uint64_t s = state_.load();
    if ((s & kOpen) && static_cast<uint32_t>(s >> 32) != joined_epoch) {
      if (state_.compare_exchange_weak(s, s + 1)) {
        joined_epoch = static_cast<uint32_t>(s >> 32);
        // as on a worker, a job that throws ends the process: the product it was part of
        // would be incomplete, and the posting thread waits for every part it handed out
        [&]() noexcept { (*body_.load())(index); }();
        finished_.fetch_add(1);
        ++joined;
      }
      continue;
    }
    if ((i & 15) == 15 && done()) break;
    // between jobs, a thread the OS has waiting (the server's event loop) gets the core
    if ((i & 255) == 255) sched_yield();
    MTPSERVE_PAUSE();
  }
  helpers_.fetch_sub(1);
  return joined;
}

void ThreadPool::work(int index) {
  uint32_t seen = 0;  // the epoch at construction: a job posted before this thread ran is seen
  for (;;) {
    uint32_t now = wake_.load();
    if (now == seen) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
      for (int i = 0; (now = wake_.load()) == seen; ++i) {
        MTPSERVE_PAUSE();
        if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) wake_.wait(seen);
      }
    }
    seen = now;
    if (stopping_.load()) return;
    uint64_t s = state_.load();
    while ((s & kOpen) && static_cast<uint32_t>(s >> 32) == now) {
      if (state_.compare_exchange_weak(s, s + 1)) {
        (*body_.load())(index);
        finished_.fetch_add(1);
        break;
      }
    }
  }
}

}  // namespace mtpserve
