// Status and Expected<T>: how run-time failures travel (files, network, peers,
// memory, bad requests). Broken invariants are CHECKs instead (check.h).
//
// Any thread may use these types; they hold no shared state.
#pragma once

#include <cassert>
#include <string>
#include <utility>
#include <variant>

#include <fmt/format.h>

namespace moe {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // the caller's input is wrong (bad flag, bad request, bad file)
  kNotFound,         // a file, tensor, model or key does not exist
  kOutOfRange,       // an index or size past a limit
  kDataLoss,         // a file is truncated or corrupted
  kResourceExhausted,// out of memory, pages, queue slots
  kUnavailable,      // a peer or device cannot be reached right now
  kDeadlineExceeded, // a timeout
  kAborted,          // cancelled by a client or a peer
  kUnimplemented,    // a valid request we do not support
  kInternal,         // a bug or an unexpected failure of a dependency
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return {}; }

  bool is_ok() const { return code_ == StatusCode::kOk; }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "InvalidArgument: config.json: field 'hidden_size' is missing"
  std::string to_string() const;

  // Prefixes context to the message: status.with_context("loading model.safetensors").
  Status with_context(const std::string& context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Short constructors that format their message: invalid_argument("bad dtype '{}'", name).
#define MOE_DEFINE_STATUS_MAKER(fn, code)                                             \
  template <typename... Args>                                                         \
  Status fn(fmt::format_string<Args...> format, Args&&... args) {                     \
    return Status(StatusCode::code, fmt::format(format, std::forward<Args>(args)...)); \
  }
MOE_DEFINE_STATUS_MAKER(invalid_argument, kInvalidArgument)
MOE_DEFINE_STATUS_MAKER(not_found, kNotFound)
MOE_DEFINE_STATUS_MAKER(out_of_range, kOutOfRange)
MOE_DEFINE_STATUS_MAKER(data_loss, kDataLoss)
MOE_DEFINE_STATUS_MAKER(resource_exhausted, kResourceExhausted)
MOE_DEFINE_STATUS_MAKER(unavailable, kUnavailable)
MOE_DEFINE_STATUS_MAKER(deadline_exceeded, kDeadlineExceeded)
MOE_DEFINE_STATUS_MAKER(aborted, kAborted)
MOE_DEFINE_STATUS_MAKER(unimplemented, kUnimplemented)
MOE_DEFINE_STATUS_MAKER(internal_error, kInternal)
#undef MOE_DEFINE_STATUS_MAKER

// A value or the Status saying why there is none. Constructed from either.
template <typename T>
class [[nodiscard]] Expected {
 public:
  Expected(T value) : storage_(std::move(value)) {}  // NOLINT: implicit by design
  Expected(Status status) : storage_(std::move(status)) {  // NOLINT
    assert(!std::get<Status>(storage_).is_ok() && "Expected built from an ok Status");
  }

  bool has_value() const { return std::holds_alternative<T>(storage_); }
  explicit operator bool() const { return has_value(); }

  // Accessing the value of an error, or the error of a value, is a bug.
  T& value() & { return std::get<T>(storage_); }
  const T& value() const& { return std::get<T>(storage_); }
  T&& value() && { return std::get<T>(std::move(storage_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  Status status() const { return has_value() ? Status::ok() : std::get<Status>(storage_); }

 private:
  std::variant<T, Status> storage_;
};

}  // namespace moe

// Returns early from a function returning Status or Expected<U> when `expr` fails.
#define MOE_RETURN_IF_ERROR(expr)          \
  do {                                     \
    ::moe::Status moe_status_ = (expr);    \
    if (!moe_status_.is_ok()) return moe_status_; \
  } while (0)

#define MOE_CONCAT_INNER_(a, b) a##b
#define MOE_CONCAT_(a, b) MOE_CONCAT_INNER_(a, b)

// MOE_ASSIGN_OR_RETURN(auto file, open_file(path)); declares `file` or returns the error.
#define MOE_ASSIGN_OR_RETURN(decl, expr) \
  MOE_ASSIGN_OR_RETURN_IMPL_(MOE_CONCAT_(moe_expected_, __LINE__), decl, expr)
#define MOE_ASSIGN_OR_RETURN_IMPL_(tmp, decl, expr) \
  auto tmp = (expr);                                \
  if (!tmp.has_value()) return tmp.status();        \
  decl = std::move(tmp).value()
