// TensorFetcher: looks checkpoint tensors up for a loader, checks their shape
// and dtype, and records which were used, so that a tensor the model does not
// read is reported instead of silently ignored. Internal to src/model; one
// loader thread uses a fetcher.
#pragma once

#include <algorithm>
#include <functional>
#include <set>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "core/status.h"
#include "model/safetensors.h"

namespace moe::model {

class TensorFetcher {
 public:
  explicit TensorFetcher(const SafetensorsCheckpoint& checkpoint) : checkpoint_(checkpoint) {}

  bool has(const std::string& name) const { return checkpoint_.find(name) != nullptr; }
  // The header entry of `name`, or nullptr (does not mark it used).
  const TensorInfo* find(const std::string& name) const { return checkpoint_.find(name); }

  // A float tensor (bf16, f16 or f32) of exactly `expected` shape.
  Expected<TensorView> get(const std::string& name, Shape expected) {
    auto view = checkpoint_.view(name);
    if (!view) return view.status();
    if (!(view->shape() == expected))
      return invalid_argument("tensor '{}' has shape {}, the config implies {}", name, view->shape().to_string(),
                              expected.to_string());
    const DType dtype = view->dtype();
    if (dtype != DType::kBF16 && dtype != DType::kF32 && dtype != DType::kF16)
      return unimplemented("tensor '{}' has dtype {}; bf16, f16 and f32 weights are supported", name,
                           dtype_name(dtype));
    used_.insert(name);
    return view;
  }

  // A tensor of exactly `dtype` (or `alt_dtype`) and `expected` shape.
  Expected<TensorView> get_exact(const std::string& name, DType dtype, DType alt_dtype, Shape expected) {
    auto view = checkpoint_.view(name);
    if (!view) return view.status();
    if (view->dtype() != dtype && view->dtype() != alt_dtype)
      return invalid_argument("tensor '{}' has dtype {}, expected {}", name, safetensors_dtype_name(view->dtype()),
                              safetensors_dtype_name(dtype));
    if (!(view->shape() == expected))
      return invalid_argument("tensor '{}' has shape {}, expected {}", name, view->shape().to_string(),
                              expected.to_string());
    used_.insert(name);
    return view;
  }

  // Every tensor of the checkpoint that `owned` says is this loader's (all of
  // them when empty) must have been used; the others belong to another loader
  // of the same directory (the target's and the MTP layer's, model/mtp.h).
  Status check_all_used(const std::function<bool(std::string_view)>& owned = {}) const {
    std::vector<std::string> unused;
    for (const auto& name : checkpoint_.tensor_names())
      if ((!owned || owned(name)) && !used_.count(name)) unused.push_back(name);
    if (unused.empty()) return Status::ok();
    const size_t shown = std::min<size_t>(unused.size(), 5);
    return invalid_argument("{} tensor(s) in the checkpoint are not used by the config's model: {}{}", unused.size(),
                            fmt::join(unused.begin(), unused.begin() + static_cast<long>(shown), ", "),
                            unused.size() > shown ? ", ..." : "");
  }

 private:
  const SafetensorsCheckpoint& checkpoint_;
  std::set<std::string> used_;
};

}  // namespace moe::model
