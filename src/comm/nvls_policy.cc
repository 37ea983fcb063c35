#include "comm/nvls_policy.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>

namespace moe::comm {
namespace {

std::string lower(const char* text) {
  std::string s(text);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

bool is_false(const std::string& v) { return v == "0" || v == "false" || v == "no" || v == "off"; }
bool is_true(const std::string& v) { return v == "1" || v == "true" || v == "yes" || v == "on"; }

}  // namespace

Status check_nvls_allowed() {
  if (const char* v = std::getenv("NCCL_NVLS_ENABLE"); v != nullptr && is_false(lower(v)))
    return unavailable("NVLS multicast all-reduce refused: NCCL_NVLS_ENABLE={} says this host must not use NVLS", v);
  for (const char* name : {"TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"})
    if (const char* v = std::getenv(name); v != nullptr && is_true(lower(v)))
      return unavailable("NVLS multicast all-reduce refused: {}={} says this host must not use multicast", name, v);
  return Status::ok();
}

Status nvls_preflight(bool requested) {
  if (!requested)
    return invalid_argument("the NVLS all-reduce is off by default; it runs only when asked for (--all-reduce nvls)");
  return check_nvls_allowed();
}

Expected<AllReduceAlgorithm> parse_all_reduce_algorithm(std::string_view name) {
  if (name == "auto") return AllReduceAlgorithm::kAuto;
  if (name == "oneshot") return AllReduceAlgorithm::kOneShot;
  if (name == "twoshot") return AllReduceAlgorithm::kTwoShot;
  if (name == "nvls") return AllReduceAlgorithm::kNvls;
  if (name == "nccl") return AllReduceAlgorithm::kNccl;
  return invalid_argument("--all-reduce '{}': expected auto, oneshot, twoshot, nvls or nccl", name);
}

}  // namespace moe::comm
