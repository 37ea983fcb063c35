// One thread running posted tasks in order, plus delayed tasks (timers) and
// a periodic tick. Used by the disaggregated roles to keep blocking work
// (HTTP calls to peers, TransferEngine waits) off the engine and I/O threads.
//
// Threads: post(), post_after() from any thread (tasks posted after stop()
// are dropped); the tasks and the tick run on the worker thread.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

namespace moe::server {

class TaskWorker {
 public:
  // `tick` (may be empty) runs every `tick_s` seconds.
  explicit TaskWorker(std::function<void()> tick = {}, double tick_s = 0.1);
  ~TaskWorker();  // stop()
  TaskWorker(const TaskWorker&) = delete;
  TaskWorker& operator=(const TaskWorker&) = delete;

  void post(std::function<void()> task);
  void post_after(double delay_s, std::function<void()> task);
  // Runs what is queued now (not the delayed tasks), then joins. Idempotent.
  void stop();

 private:
  void loop();

  std::function<void()> tick_;
  double tick_s_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::function<void()>> tasks_;
  std::multimap<double, std::function<void()>> delayed_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace moe::server
