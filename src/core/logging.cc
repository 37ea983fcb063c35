#include "core/logging.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

namespace moe {
namespace {

LogLevel level_from_env() {
  const char* env = std::getenv("MOESERVE_LOG");
  if (env == nullptr) return LogLevel::kInfo;
  if (std::strcmp(env, "debug") == 0) return LogLevel::kDebug;
  if (std::strcmp(env, "warn") == 0) return LogLevel::kWarn;
  if (std::strcmp(env, "error") == 0) return LogLevel::kError;
  return LogLevel::kInfo;
}

std::atomic<LogLevel>& current_level() {
  static std::atomic<LogLevel> level{level_from_env()};
  return level;
}

}  // namespace

void set_log_level(LogLevel level) { current_level().store(level); }
LogLevel log_level() { return current_level().load(std::memory_order_relaxed); }

void log_line(LogLevel level, std::string_view message) {
  static constexpr char kLetters[] = {'D', 'I', 'W', 'E'};
  auto now = std::chrono::system_clock::now();
  std::time_t seconds = std::chrono::system_clock::to_time_t(now);
  auto millis = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm utc{};
  gmtime_r(&seconds, &utc);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%d %H:%M:%S", &utc);
  std::string line = fmt::format("{}.{:03d} {} {}\n", stamp, static_cast<int>(millis),
                                 kLetters[static_cast<int>(level)], message);
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace moe
