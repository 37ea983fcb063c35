#include "core/thread_pool.h"

#include <algorithm>

namespace moe {
namespace {
thread_local bool in_pool_task = false;
}

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  work_ready_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void ThreadPool::parallel_for(int64_t begin, int64_t end, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (end <= begin) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t n = end - begin;
  // At most n / grain chunks, so that every chunk holds at least `grain` items.
  const int64_t max_chunks = std::min<int64_t>(n / grain, 4 * num_threads());
  if (max_chunks <= 1 || workers_.empty() || in_pool_task) {
    fn(begin, end);
    return;
  }
  {
    std::lock_guard lock(mutex_);
    fn_ = &fn;
    begin_ = begin;
    end_ = end;
    // Balanced split: every chunk has n / max_chunks items, and the first
    // n % max_chunks chunks one more.
    num_chunks_ = max_chunks;
    chunk_ = n / max_chunks;
    next_chunk_ = 0;
    chunks_done_ = 0;
    ++generation_;
  }
  work_ready_.notify_all();
  run_chunks();
  std::unique_lock lock(mutex_);
  work_done_.wait(lock, [this] { return chunks_done_ == num_chunks_; });
  fn_ = nullptr;
}

void ThreadPool::run_chunks() {
  in_pool_task = true;
  for (;;) {
    int64_t chunk_begin, chunk_end;
    const std::function<void(int64_t, int64_t)>* fn;
    {
      std::lock_guard lock(mutex_);
      if (fn_ == nullptr || next_chunk_ >= num_chunks_) break;
      const int64_t num_long_chunks = (end_ - begin_) % num_chunks_;
      chunk_begin = begin_ + next_chunk_ * chunk_ + std::min(next_chunk_, num_long_chunks);
      chunk_end = chunk_begin + chunk_ + (next_chunk_ < num_long_chunks ? 1 : 0);
      ++next_chunk_;
      fn = fn_;
    }
    (*fn)(chunk_begin, chunk_end);
    bool last;
    {
      std::lock_guard lock(mutex_);
      last = ++chunks_done_ == num_chunks_;
    }
    if (last) work_done_.notify_all();
  }
  in_pool_task = false;
}

void ThreadPool::worker_loop() {
  uint64_t seen_generation = 0;
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      work_ready_.wait(lock, [&] { return stop_ || generation_ != seen_generation; });
      if (stop_) return;
      seen_generation = generation_;
    }
    run_chunks();
  }
}

}  // namespace moe
