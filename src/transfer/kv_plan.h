// KV transfer plans: which bytes of a prefill rank's KV pages go where in a
// decode rank's pages (DESIGN section 4), as coalesced (src, dst, len) runs.
//
// Page layout on both sides is HND, K and V in separate pools per layer
// (kv::KvCacheLayout, ops::PagedKv):
//   k_pool, v_pool [num_pages][num_heads][page_size][head_dim]
// where the prefill rank's pool holds only its local heads and the decode
// rank's pool holds all heads. A pool may also be embedded in a bigger buffer:
// offsets are base + page * page_stride_bytes (default: dense pages).
//
// Head sharding of a prefill instance with tp_size ranks and H kv heads:
// - tp_size <= H (H % tp_size == 0): rank r holds heads [r*H/tp, (r+1)*H/tp).
// - tp_size >  H (tp_size % H == 0): rank r holds head r / (tp_size/H), replicated
//   on tp_size/H ranks; only the first rank of each group (r % (tp_size/H) == 0)
//   writes, the others get an empty plan.
//
// The runs of a plan are the same for every layer (offsets are relative to the
// layer's pools); layer_writes() turns one layer's runs into the groups of one
// TransferEngine batch, so the prefill side can send each layer as soon as its
// KV is written (layer-by-layer streaming).
//
// Plain values: building a plan allocates; a built plan is immutable, and any
// thread may read it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "transfer/transfer_engine.h"

namespace moe::transfer {

struct KvSideLayout {
  int num_kv_heads = 0;  // all kv heads of the model
  int head_dim = 0;
  int page_size = 16;    // tokens per page
  DType dtype = DType::kBF16;
  int tp_size = 1;       // ranks the heads are sharded over (decode side: 1)
  // Distance between pages in a pool; 0 = dense (local heads * page_size * head_dim * dtype bytes).
  uint64_t page_stride_bytes = 0;
};

// Heads held by one rank: [first, first + count).
struct HeadRange {
  int first = 0;
  int count = 0;
};
// Which heads `rank` holds, and whether it is the rank that writes them.
Expected<HeadRange> local_heads(const KvSideLayout& layout, int rank);
bool is_writer_rank(const KvSideLayout& layout, int rank);

enum class KvPart : uint8_t { kK = 0, kV = 1 };

// Where one layer's K and V pools are, on one side.
struct KvLayerRegions {
  RegionId k_region = 0;          // local side: region ids
  uint64_t k_base_offset = 0;
  RegionId v_region = 0;
  uint64_t v_base_offset = 0;
};
struct KvLayerRemote {
  RegionDescriptor k;             // remote side: descriptors
  uint64_t k_base_offset = 0;
  RegionDescriptor v;
  uint64_t v_base_offset = 0;
};

class KvTransferPlan {
 public:
  // Plan for prefill rank `src_rank` sending one sequence's first `num_tokens`
  // tokens: its pages src_pages (in position order) into the decode pages
  // dst_pages. Errors: inconsistent layouts (head counts, head_dim, dtype),
  // unsupported sharding, too few pages for num_tokens.
  static Expected<KvTransferPlan> build(const KvSideLayout& src, int src_rank, const KvSideLayout& dst,
                                        std::span<const int32_t> src_pages, std::span<const int32_t> dst_pages,
                                        int32_t num_tokens);

  bool is_writer() const { return is_writer_; }
  // The runs of one pool (K and V have the same runs), relative to that layer's
  // pool bases; identical for every layer. Empty when !is_writer().
  std::span<const Run> runs() const { return runs_; }
  std::span<const Run> layer_runs(int /*layer*/) const { return runs_; }
  uint64_t bytes_per_layer() const { return 2 * bytes_per_pool_; }  // K + V

  // One layer's K and V runs as the groups of one batch (submit_scattered).
  std::vector<RegionRuns> layer_writes(const KvLayerRegions& src, const KvLayerRemote& dst) const;

 private:
  bool is_writer_ = false;
  std::vector<Run> runs_;
  uint64_t bytes_per_pool_ = 0;
};

}  // namespace moe::transfer
