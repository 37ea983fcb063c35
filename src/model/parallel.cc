#include "model/parallel.h"

#include <cstring>

#include "comm/communicator.h"

namespace moe::model {

namespace {

bool has_dense_layers(const ModelConfig& c) {
  for (int l = 0; l < c.num_layers; ++l)
    if (!c.layer_is_moe(l)) return true;
  return false;
}

bool has_moe_layers(const ModelConfig& c) {
  for (int l = 0; l < c.num_layers; ++l)
    if (c.layer_is_moe(l)) return true;
  return false;
}

// Columns [first, first + count) of a row-major matrix [rows, cols], copied.
Tensor copy_columns(TensorView m, int64_t first, int64_t count) {
  CHECK(m.rank() == 2 && first >= 0 && first + count <= m.dim(1), "columns [{}, {}) of {}", first, first + count,
        m.shape().to_string());
  Tensor out(m.dtype(), {m.dim(0), count});
  const size_t elem = dtype_bytes(m.dtype(), 1), row_in = elem * m.dim(1), row_out = elem * count;
  for (int64_t r = 0; r < m.dim(0); ++r)
    std::memcpy(static_cast<char*>(out.data()) + r * row_out, static_cast<const char*>(m.data()) + r * row_in + first * elem,
                row_out);
  return out;
}

// Rows [a, a + n) and [b, b + n) of a matrix, stacked.
Tensor copy_two_row_ranges(TensorView m, int64_t a, int64_t b, int64_t n) {
  Tensor out(m.dtype(), {2 * n, m.dim(1)});
  const size_t bytes = m.rows(a, a + n).num_bytes();
  std::memcpy(out.data(), m.rows(a, a + n).data(), bytes);
  std::memcpy(static_cast<char*>(out.data()) + bytes, m.rows(b, b + n).data(), bytes);
  return out;
}

}  // namespace

Status check_parallel_plan(const ModelConfig& c, const ModelWeights& weights, const ParallelPlan& p) {
  MOE_RETURN_IF_ERROR(check_parallel_layout(c, p));
  if (p.tp_size > 1 && weights.quant_format() != ops::QuantFormat::kNone)
    return invalid_argument("tensor parallelism over quantized ({}) projections is not supported yet; use "
                            "--tp 1 with --ep, or bf16 weights", ops::quant_format_name(weights.quant_format()));
  return Status::ok();
}

Status check_parallel_layout(const ModelConfig& c, const ParallelPlan& p) {
  if (p.tp_size < 1 || p.ep_size < 1 || p.tp_rank < 0 || p.tp_rank >= p.tp_size || p.ep_rank < 0 ||
      p.ep_rank >= p.ep_size)
    return invalid_argument("parallel plan: tp rank {} of {}, ep rank {} of {}", p.tp_rank, p.tp_size, p.ep_rank,
                            p.ep_size);
  if (p.tp_size > 1 && p.ep_size > 1 && (p.tp_size != p.ep_size || p.tp_rank != p.ep_rank))
    return invalid_argument("tensor parallel size {} and expert parallel size {} must be equal (the same ranks) "
                            "when both exceed 1", p.tp_size, p.ep_size);
  if (p.dp_attention && p.tp_size != 1)
    return invalid_argument("data-parallel attention runs whole heads on each rank: tensor parallel size must be 1, "
                            "not {}", p.tp_size);
  if (p.tp_size > 1) {
    if (c.num_q_heads % p.tp_size != 0)
      return invalid_argument("{} attention heads do not split over tensor parallel size {}", c.num_q_heads,
                              p.tp_size);
    const bool split = p.tp_size <= c.num_kv_heads;
    if ((split && c.num_kv_heads % p.tp_size != 0) || (!split && p.tp_size % c.num_kv_heads != 0))
      return invalid_argument("{} key/value heads neither split over nor replicate evenly on tensor parallel size {}",
                              c.num_kv_heads, p.tp_size);
    if (has_dense_layers(c) && c.intermediate_size % p.tp_size != 0)
      return invalid_argument("dense MLP width {} does not split over tensor parallel size {}", c.intermediate_size,
                              p.tp_size);
  }
  if (p.ep_size > 1 && has_moe_layers(c) && c.num_experts % p.ep_size != 0)
    return invalid_argument("{} experts do not split over expert parallel size {}", c.num_experts, p.ep_size);
  return Status::ok();
}

Status check_communicator(const ParallelPlan& p) {
  const int world = std::max(p.tp_size, p.ep_size);
  if (world > 1) {
    if (p.comm == nullptr) return invalid_argument("a parallel plan of {} ranks needs a communicator", world);
    const int rank = p.tp_size > 1 ? p.tp_rank : p.ep_rank;
    if (p.comm->world_size() != world || p.comm->rank() != rank)
      return invalid_argument("communicator is rank {} of {}, the plan rank {} of {}", p.comm->rank(),
                              p.comm->world_size(), rank, world);
  }
  return Status::ok();
}

RankShard rank_shard(const ModelConfig& c, const ParallelPlan& p) {
  RankShard s;
  s.num_q_heads = c.num_q_heads / p.tp_size;
  s.first_q_head = p.tp_rank * s.num_q_heads;
  if (p.tp_size <= c.num_kv_heads) {
    s.num_kv_heads = c.num_kv_heads / p.tp_size;
    s.first_kv_head = p.tp_rank * s.num_kv_heads;
  } else {  // replicated: the one head this rank's q heads read
    s.num_kv_heads = 1;
    s.first_kv_head = p.tp_rank / (p.tp_size / c.num_kv_heads);
  }
  s.num_experts = c.num_experts / p.ep_size;
  s.first_expert = p.ep_rank * s.num_experts;
  // Decode (dp_attention) ranks run dense layers whole; so does a single rank.
  s.num_mlp_columns = c.intermediate_size / p.tp_size;
  s.first_mlp_column = p.tp_rank * s.num_mlp_columns;
  return s;
}

RankWeights::RankWeights(const ModelWeights& full, const ParallelPlan& plan)
    : shard_(rank_shard(full.config(), plan)) {
  const ModelConfig& c = full.config();
  const int64_t hd = c.head_dim;
  for (int l = 0; l < full.num_layers(); ++l) {
    LayerWeights w = full.layer(l);
    if (plan.tp_size > 1) {
      const RankShard& s = shard_;
      w.q_proj = w.q_proj.rows(s.first_q_head * hd, (s.first_q_head + s.num_q_heads) * hd);
      w.k_proj = w.k_proj.rows(s.first_kv_head * hd, (s.first_kv_head + s.num_kv_heads) * hd);
      w.v_proj = w.v_proj.rows(s.first_kv_head * hd, (s.first_kv_head + s.num_kv_heads) * hd);
      owned_.push_back(copy_columns(w.o_proj, s.first_q_head * hd, s.num_q_heads * hd));
      w.o_proj = owned_.back();
      if (!w.is_moe) {
        owned_.push_back(copy_two_row_ranges(w.w13, s.first_mlp_column, c.intermediate_size + s.first_mlp_column,
                                             s.num_mlp_columns));
        w.w13 = owned_.back();
        owned_.push_back(copy_columns(w.w2, s.first_mlp_column, s.num_mlp_columns));
        w.w2 = owned_.back();
      }
    }
    layers_.push_back(w);
  }
}

}  // namespace moe::model
