#include "ops/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/linear.h"

namespace moe::ops::cpu {
namespace {

// Address of (page, head, slot) in a [num_pages, heads, page_size, head_dim] pool.
int64_t kv_offset(const PagedKv& kv, int64_t page, int64_t head, int64_t slot) {
  return ((page * kv.num_kv_heads() + head) * kv.page_size() + slot) * kv.head_dim();
}

int64_t page_of(const AttentionBatch& batch, int seq, int32_t position, int page_size) {
  const int logical = position / page_size;
  CHECK(logical < batch.max_pages_per_seq, "position {} beyond the page table ({} pages of {})", position,
        batch.max_pages_per_seq, page_size);
  const int32_t page = batch.page_table[static_cast<size_t>(seq) * batch.max_pages_per_seq + logical];
  CHECK(page >= 0, "seq {} has no page for position {}", seq, position);
  return page;
}

void check_batch(const AttentionBatch& batch, int64_t num_tokens, const PagedKv& kv) {
  CHECK(batch.num_seqs() >= 0 && batch.query_start.front() == 0 && batch.query_start.back() == num_tokens,
        "attention batch covers {} tokens, tensors have {}", batch.query_start.back(), num_tokens);
  CHECK(static_cast<int64_t>(batch.positions.size()) == num_tokens, "positions size");
  CHECK(batch.page_table.size() >= static_cast<size_t>(batch.num_seqs()) * batch.max_pages_per_seq,
        "page table too small");
  CHECK(kv.k_pages.rank() == 4 && kv.v_pages.shape() == kv.k_pages.shape(), "kv pages {}",
        kv.k_pages.shape().to_string());
  CHECK(kv.k_pages.dtype() == DType::kF32 || kv.k_pages.dtype() == DType::kBF16, "kv dtype {}",
        dtype_name(kv.k_pages.dtype()));
}

void load_row(const TensorView& pages, int64_t offset, int64_t n, float* dst) {
  const size_t byte_offset = dtype_bytes(pages.dtype(), offset);
  to_f32(pages.dtype(), static_cast<const char*>(pages.data()) + byte_offset, dst, n);
}

void store_row(const TensorView& pages, int64_t offset, const float* src, int64_t n) {
  if (pages.dtype() == DType::kF32) {
    std::copy_n(src, n, pages.data_as<float>() + offset);
  } else {
    uint16_t* dst = pages.data_as<uint16_t>() + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
  }
}

}  // namespace

void write_kv(ThreadPool& pool, TensorView k, TensorView v, const AttentionBatch& batch, const PagedKv& kv) {
  const int64_t num_tokens = k.dim(0);
  check_batch(batch, num_tokens, kv);
  CHECK(k.rank() == 3 && k.dim(1) == kv.num_kv_heads() && k.dim(2) == kv.head_dim() && v.shape() == k.shape(),
        "write_kv: k {} for pages {}", k.shape().to_string(), kv.k_pages.shape().to_string());
  const int64_t heads = kv.num_kv_heads(), head_dim = kv.head_dim();
  pool.parallel_for(0, batch.num_seqs(), 1, [&](int64_t seq_begin, int64_t seq_end) {
    for (int64_t s = seq_begin; s < seq_end; ++s) {
      for (int32_t t = batch.query_start[s]; t < batch.query_start[s + 1]; ++t) {
        const int32_t pos = batch.positions[t];
        const int64_t page = page_of(batch, static_cast<int>(s), pos, kv.page_size());
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t dst = kv_offset(kv, page, h, pos % kv.page_size());
          store_row(kv.k_pages, dst, k.data_as<float>() + (t * heads + h) * head_dim, head_dim);
          store_row(kv.v_pages, dst, v.data_as<float>() + (t * heads + h) * head_dim, head_dim);
        }
      }
    }
  });
}

void paged_attention(ThreadPool& pool, TensorView q, const AttentionBatch& batch, const PagedKv& kv,
                     float scale, TensorView out) {
  const int64_t num_tokens = q.dim(0);
  check_batch(batch, num_tokens, kv);
  const int64_t num_q_heads = q.dim(1), head_dim = q.dim(2), num_kv_heads = kv.num_kv_heads();
  CHECK(q.rank() == 3 && head_dim == kv.head_dim() && num_q_heads % num_kv_heads == 0,
        "paged_attention: q {} with kv {}", q.shape().to_string(), kv.k_pages.shape().to_string());
  CHECK(out.rank() == 2 && out.dim(0) == num_tokens && out.dim(1) == num_q_heads * head_dim,
        "paged_attention: out {}", out.shape().to_string());
  const int64_t group = num_q_heads / num_kv_heads;
  // Which sequence each token belongs to.
  std::vector<int> seq_of_token(static_cast<size_t>(num_tokens));
  for (int s = 0; s < batch.num_seqs(); ++s)
    for (int32_t t = batch.query_start[s]; t < batch.query_start[s + 1]; ++t) seq_of_token[t] = s;

  // One task per (token, kv head): scores over the visible positions, softmax,
  // then the weighted sum of values, for the q heads of the group.
  pool.parallel_for(0, num_tokens * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> key(static_cast<size_t>(head_dim)), value(static_cast<size_t>(head_dim));
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int seq = seq_of_token[t];
      const int32_t num_visible = batch.positions[t] + 1;
      scores.assign(static_cast<size_t>(group * num_visible), 0.0f);
      for (int32_t j = 0; j < num_visible; ++j) {
        load_row(kv.k_pages, kv_offset(kv, page_of(batch, seq, j, kv.page_size()), kv_head, j % kv.page_size()),
                 head_dim, key.data());
        for (int64_t g = 0; g < group; ++g) {
          const float* qh = q.data_as<float>() + (t * num_q_heads + kv_head * group + g) * head_dim;
          scores[g * num_visible + j] = dot(qh, key.data(), head_dim) * scale;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* row = &scores[g * num_visible];
        const float max_score = *std::max_element(row, row + num_visible);
        float sum = 0.0f;
        for (int32_t j = 0; j < num_visible; ++j) sum += (row[j] = std::exp(row[j] - max_score));
        for (int32_t j = 0; j < num_visible; ++j) row[j] /= sum;
        float* o = out.data_as<float>() + t * num_q_heads * head_dim + (kv_head * group + g) * head_dim;
        std::fill(o, o + head_dim, 0.0f);
      }
      for (int32_t j = 0; j < num_visible; ++j) {
        load_row(kv.v_pages, kv_offset(kv, page_of(batch, seq, j, kv.page_size()), kv_head, j % kv.page_size()),
                 head_dim, value.data());
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * num_visible + j];
          float* o = out.data_as<float>() + t * num_q_heads * head_dim + (kv_head * group + g) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) o[d] += p * value[d];
        }
      }
    }
  });
}

}  // namespace moe::ops::cpu
