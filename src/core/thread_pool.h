// A fixed pool of worker threads for data-parallel CPU loops.
//
// parallel_for splits [begin, end) into chunks of at least `grain` items and
// runs fn(chunk_begin, chunk_end) on the workers and the calling thread; it
// returns when every chunk is done. One parallel_for at a time per pool: the
// pool is owned by one engine thread, which is the only caller. A nested call
// from inside fn runs serially on the calling worker.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moe {

class ThreadPool {
 public:
  // num_threads <= 0: one per hardware thread (the caller counts as one).
  explicit ThreadPool(int num_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  void parallel_for(int64_t begin, int64_t end, int64_t grain,
                    const std::function<void(int64_t, int64_t)>& fn);

 private:
  void worker_loop();
  void run_chunks();

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable work_done_;
  // The current job, guarded by mutex_ (next_chunk_ also read under it).
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 1, next_chunk_ = 0, num_chunks_ = 0;
  int64_t chunks_done_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

}  // namespace moe
