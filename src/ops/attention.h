// Causal grouped-query attention over a paged KV cache.
//
// KV pages of one layer are HND: k_pages, v_pages [num_pages, num_kv_heads,
// page_size, head_dim], f32 or bf16. A sequence's token at position p lives in
// page page_table[seq][p / page_size], slot p % page_size.
//
// A batch is ragged: sequence s owns new tokens [query_start[s],
// query_start[s+1]) of the token-major tensors, and each new token at
// position p attends to the cached positions 0..p of its sequence (the cached
// prefix and the new tokens up to itself). The same op serves prefill (many new
// tokens, possibly after a cached prefix, possibly one chunk of a long prompt)
// and decode (one or a few new tokens).
#pragma once

#include <span>

#include "core/tensor.h"
#include "core/thread_pool.h"

namespace moe::ops {

struct PagedKv {
  TensorView k_pages;  // [num_pages, num_kv_heads, page_size, head_dim]
  TensorView v_pages;  // same
  int num_kv_heads() const { return static_cast<int>(k_pages.dim(1)); }
  int page_size() const { return static_cast<int>(k_pages.dim(2)); }
  int head_dim() const { return static_cast<int>(k_pages.dim(3)); }
};

struct AttentionBatch {
  std::span<const int32_t> query_start;  // [num_seqs + 1], query_start[0] = 0
  std::span<const int32_t> positions;    // [num_tokens]
  std::span<const int32_t> page_table;   // [num_seqs, max_pages_per_seq]
  int max_pages_per_seq = 0;
  int num_seqs() const { return static_cast<int>(query_start.size()) - 1; }
};

namespace cpu {

// Stores the new tokens' k and v ([num_tokens, num_kv_heads, head_dim] f32) at
// their positions in the cache, converting to the cache dtype.
void write_kv(ThreadPool& pool, TensorView k, TensorView v, const AttentionBatch& batch, const PagedKv& kv);

// out [num_tokens, num_q_heads * head_dim] f32 = softmax(q k^T * scale) v, with
// q [num_tokens, num_q_heads, head_dim] f32 and q head h reading kv head
// h / (num_q_heads / num_kv_heads).
void paged_attention(ThreadPool& pool, TensorView q, const AttentionBatch& batch, const PagedKv& kv,
                     float scale, TensorView out);

}  // namespace cpu
}  // namespace moe::ops
