#include "ops/embedding.h"

#include "ops/linear.h"

namespace moe::ops::cpu {

void embedding(ThreadPool& pool, TensorView table, std::span<const int32_t> ids, TensorView out) {
  CHECK(table.rank() == 2 && out.rank() == 2 && out.dim(1) == table.dim(1) &&
            out.dim(0) == static_cast<int64_t>(ids.size()) && out.dtype() == DType::kF32,
        "embedding: table {} ids {} out {}", table.shape().to_string(), ids.size(), out.shape().to_string());
  const int64_t hidden = table.dim(1);
  const size_t row_bytes = dtype_bytes(table.dtype(), hidden);
  pool.parallel_for(0, static_cast<int64_t>(ids.size()), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      CHECK(ids[t] >= 0 && ids[t] < table.dim(0), "token id {} outside vocab {}", ids[t], table.dim(0));
      to_f32(table.dtype(), static_cast<const char*>(table.data()) + ids[t] * row_bytes,
             out.data_as<float>() + t * hidden, hidden);
    }
  });
}

}  // namespace moe::ops::cpu
