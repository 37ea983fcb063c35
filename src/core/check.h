// CHECK: a broken invariant (a bug), never a user error. Prints the condition,
// the source location and an optional message, then aborts. User errors and
// run-time failures are Status instead (status.h).
#pragma once

#include <source_location>
#include <string>

#include <fmt/format.h>

namespace moe {

[[noreturn]] void check_failed(const char* condition, const std::string& message,
                               std::source_location where = std::source_location::current());

}  // namespace moe

// CHECK(cond) or CHECK(cond, "format {}", args...).
#define CHECK(cond, ...)                                                     \
  do {                                                                       \
    if (!(cond)) [[unlikely]]                                                \
      ::moe::check_failed(#cond, ::moe::detail::check_message(__VA_ARGS__)); \
  } while (0)

#define CHECK_EQ(a, b, ...) CHECK((a) == (b), __VA_ARGS__)
#define CHECK_LT(a, b, ...) CHECK((a) < (b), __VA_ARGS__)
#define CHECK_LE(a, b, ...) CHECK((a) <= (b), __VA_ARGS__)
#define CHECK_GE(a, b, ...) CHECK((a) >= (b), __VA_ARGS__)

#ifdef NDEBUG
#define DCHECK(cond, ...) \
  do {                    \
  } while (0)
#else
#define DCHECK(cond, ...) CHECK(cond, __VA_ARGS__)
#endif

namespace moe::detail {
inline std::string check_message() { return {}; }
template <typename... Args>
std::string check_message(fmt::format_string<Args...> format, Args&&... args) {
  return fmt::format(format, std::forward<Args>(args)...);
}
}  // namespace moe::detail
