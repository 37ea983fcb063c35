#include "server/task_worker.h"

#include <chrono>
#include <exception>

#include "core/logging.h"
#include "engine/engine.h"

namespace moe::server {

TaskWorker::TaskWorker(std::function<void()> tick, double tick_s) : tick_(std::move(tick)), tick_s_(tick_s) {
  thread_ = std::thread([this] { loop(); });
}

TaskWorker::~TaskWorker() {
  stop();
}

void TaskWorker::post(std::function<void()> task) {
  {
    std::lock_guard lock(mutex_);
    if (stop_) return;
    tasks_.push_back(std::move(task));
  }
  wake_.notify_one();
}

void TaskWorker::post_after(double delay_s, std::function<void()> task) {
  {
    std::lock_guard lock(mutex_);
    if (stop_) return;
    delayed_.emplace(engine::monotonic_seconds() + delay_s, std::move(task));
  }
  wake_.notify_one();
}

void TaskWorker::stop() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void TaskWorker::loop() {
  double next_tick = engine::monotonic_seconds() + tick_s_;
  while (true) {
    std::vector<std::function<void()>> run;
    bool tick = false;
    {
      std::unique_lock lock(mutex_);
      const auto until = [&] {
        double t = tick_ ? next_tick : 1e18;
        if (!delayed_.empty()) t = std::min(t, delayed_.begin()->first);
        return t;
      };
      while (!stop_ && tasks_.empty() && engine::monotonic_seconds() < until()) {
        const double wait_s = std::min(1.0, until() - engine::monotonic_seconds());
        wake_.wait_for(lock, std::chrono::duration<double>(std::max(wait_s, 0.0)));
      }
      run.swap(tasks_);
      const double now = engine::monotonic_seconds();
      while (!stop_ && !delayed_.empty() && delayed_.begin()->first <= now) {
        run.push_back(std::move(delayed_.begin()->second));
        delayed_.erase(delayed_.begin());
      }
      if (tick_ && now >= next_tick) tick = true, next_tick = now + tick_s_;
      if (stop_ && run.empty()) return;
    }
    for (auto& task : run) {
      try {
        task();
      } catch (const std::exception& e) {
        log_error("worker: a task threw: {}", e.what());
      }
    }
    if (tick && tick_) tick_();
  }
}

}  // namespace moe::server
