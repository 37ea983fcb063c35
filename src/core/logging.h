// Logging to stderr: "2026-11-30 07:45:01.123 I message". Thread-safe: any
// thread may log; each line is written with one call.
// The level comes from set_log_level() or the MOESERVE_LOG environment variable
// (debug, info, warn, error).
#pragma once

#include <string_view>

#include <fmt/format.h>

namespace moe {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

void set_log_level(LogLevel level);
LogLevel log_level();
void log_line(LogLevel level, std::string_view message);

template <typename... Args>
void log(LogLevel level, fmt::format_string<Args...> format, Args&&... args) {
  if (level < log_level()) return;
  log_line(level, fmt::format(format, std::forward<Args>(args)...));
}

#define MOE_LOG_FN(name, level)                                      \
  template <typename... Args>                                        \
  void name(fmt::format_string<Args...> format, Args&&... args) {    \
    log(level, format, std::forward<Args>(args)...);                 \
  }
MOE_LOG_FN(log_debug, LogLevel::kDebug)
MOE_LOG_FN(log_info, LogLevel::kInfo)
MOE_LOG_FN(log_warn, LogLevel::kWarn)
MOE_LOG_FN(log_error, LogLevel::kError)
#undef MOE_LOG_FN

}  // namespace moe
