// A persistent pool of worker threads for the product kernel: no thread is created per call.
// Workers spin briefly after each job (a decode step runs hundreds of products back to back)
// and then sleep on a futex until the next one.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mtpserve {

class ThreadPool {
 public:
  // `threads` counts the calling thread: a pool of 1 has no workers.
  ThreadPool(int threads, int spin_us);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs body(0) on the calling thread and body(i) on each worker that joins while body(0)
  // runs; returns when every joined body has returned. `body` must share its work out
  // dynamically (each call takes parts until none are left): a worker that the OS has not
  // scheduled in time never joins, and the calling thread does its share instead of waiting
  // for it. A call made while another runs (a product on a second mlx stream) runs on its
  // calling thread alone.
  void run(const std::function<void(int)>& body);

  // Spins on the calling thread until done() holds, joining every job posted meanwhile as a
  // worker does, with no wake to wait for (it is already running); returns the jobs it joined.
  // While a thread helps, a posted job wakes no sleeping worker: the helper takes its part.
  int help_until(const std::function<bool()>& done);

  // Runs part(p) for every p in [0, parts), handed out in turn to the calling thread and the
  // workers that join (`run`: a late worker takes fewer or none).
  template <class Part>
  void share(int64_t parts, const Part& part) {
    std::atomic<int64_t> next{0};
    run([&](int) {
      for (int64_t p; (p = next.fetch_add(1, std::memory_order_relaxed)) < parts;) part(p);
    });
  }

 private:
  void work(int index);

  // job state: epoch << 32 | open << 31 | workers joined
  static constexpr uint64_t kOpen = 1ull << 31;
  std::vector<std::thread> workers_;
  std::mutex running_;
  std::atomic<uint64_t> state_{0};
  std::atomic<uint32_t> wake_{0};  // the epoch, as a futex word for sleeping workers
  std::atomic<int> finished_{0};
  std::atomic<bool> stopping_{false};
  std::atomic<int> helpers_{0};
  std::atomic<const std::function<void(int)>*> body_{nullptr};
  int spin_us_;
};

}  // namespace mtpserve
