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
  explicit ThreadPool(int threads, int spin_us);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs body(0) on the calling thread and body(1) .. body(threads() - 1) on the workers, and
  // returns when all have returned. A call made while another runs (a product on a second mlx
  // stream) runs every part on its own calling thread instead of waiting.
  void run(const std::function<void(int)>& body);

 private:
  void work(int index);

  std::vector<std::thread> workers_;
  std::mutex running_;
  std::atomic<uint32_t> epoch_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stopping_{false};
  const std::function<void(int)>* body_ = nullptr;
  int spin_us_;
};

}  // namespace mtpserve
