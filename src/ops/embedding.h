// Token embedding lookup.
//
//   table [vocab_size, hidden] bf16|f32, ids [num_tokens] in [0, vocab_size),
//   out [num_tokens, hidden] f32.
#pragma once

#include <span>

#include "core/tensor.h"
#include "core/thread_pool.h"

namespace moe::ops::cpu {

void embedding(ThreadPool& pool, TensorView table, std::span<const int32_t> ids, TensorView out);

}  // namespace moe::ops::cpu
