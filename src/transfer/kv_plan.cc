// KV transfer plans: see kv_plan.h.
#include "transfer/kv_plan.h"

#include <algorithm>

namespace moe::transfer {

Expected<HeadRange> local_heads(const KvSideLayout& layout, int rank) {
  const int num_heads = layout.num_kv_heads;
  const int tp = layout.tp_size;
  if (num_heads <= 0 || tp <= 0) return invalid_argument("kv layout: num_kv_heads {} and tp_size {} must be positive", num_heads, tp);
  if (rank < 0 || rank >= tp) return invalid_argument("kv layout: rank {} outside tp_size {}", rank, tp);
  if (tp <= num_heads) {
    if (num_heads % tp != 0) return invalid_argument("kv layout: {} kv heads do not split over tp_size {}", num_heads, tp);
    const int count = num_heads / tp;
    return HeadRange{rank * count, count};
  }
  if (tp % num_heads != 0)
    return invalid_argument("kv layout: tp_size {} is not a multiple of {} kv heads", tp, num_heads);
  return HeadRange{rank / (tp / num_heads), 1};
}

bool is_writer_rank(const KvSideLayout& layout, int rank) {
  if (layout.tp_size <= layout.num_kv_heads) return true;
  return rank % (layout.tp_size / layout.num_kv_heads) == 0;
}

namespace {

Status check_pages(std::span<const int32_t> pages, int page_size, int32_t num_tokens, const char* side) {
  const int64_t needed = (static_cast<int64_t>(num_tokens) + page_size - 1) / page_size;
  if (static_cast<int64_t>(pages.size()) < needed)
    return invalid_argument("kv plan: {} has {} pages of {} tokens, {} tokens need {}", side, pages.size(), page_size,
                            num_tokens, needed);
  for (int64_t i = 0; i < needed; ++i) {
    if (pages[i] < 0) return invalid_argument("kv plan: {} page {} has negative id {}", side, i, pages[i]);
  }
  return Status::ok();
}

}  // namespace

Expected<KvTransferPlan> KvTransferPlan::build(const KvSideLayout& src, int src_rank, const KvSideLayout& dst,
                                               std::span<const int32_t> src_pages,
                                               std::span<const int32_t> dst_pages, int32_t num_tokens) {
  if (src.num_kv_heads != dst.num_kv_heads || src.head_dim != dst.head_dim || src.dtype != dst.dtype)
    return invalid_argument("kv plan: prefill ({} heads x {}, {}) and decode ({} heads x {}, {}) layouts differ",
                            src.num_kv_heads, src.head_dim, dtype_name(src.dtype), dst.num_kv_heads, dst.head_dim,
                            dtype_name(dst.dtype));
  if (src.head_dim <= 0 || src.page_size <= 0 || dst.page_size <= 0)
    return invalid_argument("kv plan: head_dim and page sizes must be positive");
  if (dst.tp_size != 1) return unimplemented("kv plan: the decode side must hold all kv heads (tp_size 1)");
  if (num_tokens < 0) return invalid_argument("kv plan: negative token count");
  if (dtype_bytes(src.dtype, 2 * static_cast<int64_t>(src.head_dim)) != 2 * dtype_bytes(src.dtype, src.head_dim))
    return invalid_argument("kv plan: head_dim {} is not a whole number of bytes in {}", src.head_dim, dtype_name(src.dtype));
  MOE_ASSIGN_OR_RETURN(HeadRange heads, local_heads(src, src_rank));
  MOE_RETURN_IF_ERROR(check_pages(src_pages, src.page_size, num_tokens, "prefill"));
  MOE_RETURN_IF_ERROR(check_pages(dst_pages, dst.page_size, num_tokens, "decode"));

  const uint64_t token_bytes = dtype_bytes(src.dtype, src.head_dim);  // one head, one token
  const uint64_t src_dense = token_bytes * src.page_size * heads.count;
  const uint64_t dst_dense = token_bytes * dst.page_size * dst.num_kv_heads;
  const uint64_t src_stride = src.page_stride_bytes == 0 ? src_dense : src.page_stride_bytes;
  const uint64_t dst_stride = dst.page_stride_bytes == 0 ? dst_dense : dst.page_stride_bytes;
  if (src_stride < src_dense || dst_stride < dst_dense)
    return invalid_argument("kv plan: page stride smaller than a page ({} < {} or {} < {})", src_stride, src_dense,
                            dst_stride, dst_dense);

  KvTransferPlan plan;
  plan.is_writer_ = is_writer_rank(src, src_rank);
  if (!plan.is_writer_) return plan;
  // Walk the tokens in chunks that stay inside one source page and one
  // destination page; each local head gives one run per chunk. Runs that
  // continue the previous one on both sides are merged (whole pages of all
  // heads with equal page sizes become one run, consecutive pages too).
  for (int32_t token = 0; token < num_tokens;) {
    const int src_slot = token % src.page_size;
    const int dst_slot = token % dst.page_size;
    const int32_t chunk = std::min({src.page_size - src_slot, dst.page_size - dst_slot, num_tokens - token});
    const uint64_t src_page_base = static_cast<uint64_t>(src_pages[token / src.page_size]) * src_stride;
    const uint64_t dst_page_base = static_cast<uint64_t>(dst_pages[token / dst.page_size]) * dst_stride;
    for (int h = 0; h < heads.count; ++h) {
      Run run{src_page_base + (static_cast<uint64_t>(h) * src.page_size + src_slot) * token_bytes,
              dst_page_base + (static_cast<uint64_t>(heads.first + h) * dst.page_size + dst_slot) * token_bytes,
              static_cast<uint64_t>(chunk) * token_bytes};
      if (!plan.runs_.empty()) {
        Run& last = plan.runs_.back();
        if (last.src_offset + last.length_bytes == run.src_offset && last.dst_offset + last.length_bytes == run.dst_offset) {
          last.length_bytes += run.length_bytes;
          continue;
        }
      }
      plan.runs_.push_back(run);
    }
    token += chunk;
  }
  plan.bytes_per_pool_ = static_cast<uint64_t>(num_tokens) * heads.count * token_bytes;
  return plan;
}

std::vector<RegionRuns> KvTransferPlan::layer_writes(const KvLayerRegions& src, const KvLayerRemote& dst) const {
  std::vector<RegionRuns> groups;
  if (!is_writer_ || runs_.empty()) return groups;
  auto shifted = [&](uint64_t src_base, uint64_t dst_base) {
    std::vector<Run> runs(runs_.begin(), runs_.end());
    for (Run& run : runs) {
      run.src_offset += src_base;
      run.dst_offset += dst_base;
    }
    return runs;
  };
  groups.push_back(RegionRuns{src.k_region, dst.k, shifted(src.k_base_offset, dst.k_base_offset)});
  groups.push_back(RegionRuns{src.v_region, dst.v, shifted(src.v_base_offset, dst.v_base_offset)});
  return groups;
}

}  // namespace moe::transfer
