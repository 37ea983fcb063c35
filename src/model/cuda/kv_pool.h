// Where the CUDA model keeps its KV pages: one device allocation holding,
// layer after layer, the layer's K pool then its V pool, each
//   [num_pages, num_kv_heads, page_size, head_dim] bf16
// which is the byte layout of kv::KvCacheLayout{num_layers, num_kv_heads,
// head_dim, page_size, num_pages, kBF16} over external memory (kv/kv_cache.h).
// So the engine can describe the pool as a kv::KvCache and the disaggregated
// roles can register it with the TransferEngine like a host cache; the model
// (which does not depend on kv/) and kv::KvCache must agree on these offsets,
// and kv_pool_layout_test checks that they do.
//
// num_pages counts every page of a pool, the scratch page of CUDA-graph
// padding (the last one) included. Plain arithmetic, no CUDA: any thread.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moe::model {

struct CudaKvPoolLayout {
  static constexpr size_t kElementBytes = 2;  // bf16
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int page_size = 16;
  int32_t num_pages = 0;  // per pool, the scratch page included

  size_t page_bytes() const {  // one page of one pool (K or V)
    return kElementBytes * static_cast<size_t>(num_kv_heads) * page_size * head_dim;
  }
  size_t pool_bytes() const { return page_bytes() * static_cast<size_t>(num_pages); }
  size_t k_offset(int layer) const { return 2 * pool_bytes() * static_cast<size_t>(layer); }
  size_t v_offset(int layer) const { return k_offset(layer) + pool_bytes(); }
  size_t num_bytes() const { return 2 * pool_bytes() * static_cast<size_t>(num_layers); }
};

}  // namespace moe::model
