#include "core/check.h"

#include <cstdio>
#include <cstdlib>

namespace moe {

void check_failed(const char* condition, const std::string& message, std::source_location where) {
  std::fprintf(stderr, "CHECK failed: %s at %s:%u (%s)%s%s\n", condition, where.file_name(),
               static_cast<unsigned>(where.line()), where.function_name(),
               message.empty() ? "" : ": ", message.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace moe
