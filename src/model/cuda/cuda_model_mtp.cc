// The MTP (multi-token prediction) passes of CudaQwen3MoeModel (cuda_model.h):
// the draft layer's inputs queued from the target's hidden rows or the last
// pass's outputs, its kernels (norms, fc, one decoder layer over the MTP's KV
// pages, lm_head and argmax), and chains of passes for speculative decoding.
// The target's step lives in cuda_model_step.cc.
#include <utility>
#include <vector>

#include "core/logging.h"
#include "model/cuda/cuda_model.h"
#include "model/cuda/cuda_model_state.h"
#include "ops/cuda/kernels.h"

namespace moe::model {

namespace {
namespace k = moe::ops::cuda;
using bf16 = __nv_bfloat16;
}  // namespace

// The MTP forward of model/mtp.h: e = rms_norm(embed(x)), g = rms_norm(h),
// u = [e ; g] fc^T (f32, the block's residual stream), the decoder block over
// the MTP's KV pages, its last norm being mtp.norm, then lm_head on the output
// rows and their argmax. h comes from the host, from the target's kept rows
// (target_rows) or from the last MTP pass's output rows (previous_rows, whose
// greedy tokens are then the tokens).
Status CudaQwen3MoeModel::queue_mtp(const MtpBatch& mb, TensorView hidden) {
  State& s = *state_;
  if (!s.mtp_layer) return invalid_argument("this CUDA model was created without an MTP layer");
  const ModelConfig& c = config();
  const int T = mb.num_tokens(), H = static_cast<int>(c.hidden_size);
  const auto rows = static_cast<int>(mb.output_rows.size());
  if (T > s.options.max_num_tokens)
    return invalid_argument("MTP batch of {} tokens exceeds max_num_tokens {}", T, s.options.max_num_tokens);
  const bool from_target = !mb.target_rows.empty(), from_previous = !mb.previous_rows.empty();
  auto check_rows = [T](std::span<const int32_t> index, int available, const char* what) -> Status {
    if (static_cast<int>(index.size()) != T)
      return invalid_argument("{} {} rows for an MTP batch of {} tokens", index.size(), what, T);
    for (int32_t row : index)
      if (row < 0 || row >= available)
        return invalid_argument("{} row {} of the {} rows kept", what, row, available);
    return Status::ok();
  };
  if (from_target && from_previous)
    return invalid_argument("an MTP batch reads the target's rows or its own, not both");
  if (from_target) {
    MOE_RETURN_IF_ERROR(check_rows(mb.target_rows, s.target_tokens, "target"));
  } else if (from_previous) {
    MOE_RETURN_IF_ERROR(check_rows(mb.previous_rows, s.mtp_rows, "previous MTP"));
  } else if (hidden.dtype() != DType::kF32 || hidden.rank() != 2 || hidden.dim(0) != T ||
             hidden.dim(1) != H) {
    return invalid_argument("MTP hidden states must be [{}, {}] f32", T, H);
  }
  MOE_RETURN_IF_ERROR(check_logits_rows(rows, T));
  for (int32_t row : mb.output_rows)
    if (row < 0 || row >= T) return invalid_argument("MTP output row {} of a {}-token batch", row, T);
  s.mtp_rows = 0;
  if (T == 0) return Status::ok();
  MOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(s.options.device));
  ForwardBatch batch;
  batch.token_ids = mb.token_ids;
  batch.positions = mb.positions;
  batch.query_start = mb.query_start;
  batch.page_table = mb.page_table;
  batch.max_pages_per_seq = mb.max_pages_per_seq;
  batch.logits_rows = mb.output_rows;
  // A pass whose inputs are on the device replays a CUDA graph, padded as
  // decode steps are: a chained pass has one token per sequence; the first
  // pass's rows (1 .. k + 1 per sequence) go as one-token sequences, each
  // with its sequence's pages (a row sees the positions before it, which
  // this pass writes first, as in one multi-token sequence), and only its
  // output rows reach lm_head.
  GraphShape graph;
  if (from_previous) {
    graph = graph_bucket(batch);
  } else if (from_target) {
    ForwardBatch rows_as_seqs = batch;
    rows_as_seqs.query_start.resize(static_cast<size_t>(T) + 1);
    rows_as_seqs.page_table.clear();
    const size_t stride = static_cast<size_t>(batch.max_pages_per_seq);
    for (int seq = 0; seq + 1 < static_cast<int>(batch.query_start.size()); ++seq)
      for (int t = batch.query_start[seq]; t < batch.query_start[seq + 1]; ++t)
        rows_as_seqs.page_table.insert(rows_as_seqs.page_table.end(), batch.page_table.begin() + seq * stride,
                                       batch.page_table.begin() + (seq + 1) * stride);
    for (int t = 0; t <= T; ++t) rows_as_seqs.query_start[t] = t;
    graph = graph_bucket(rows_as_seqs, true);
    if (graph.seqs > 0) batch = std::move(rows_as_seqs);
  }
  MOE_ASSIGN_OR_RETURN(const StepShape shape, upload_step(batch, graph, s.mtp_layer.get()));
  const MtpInput input = from_target     ? MtpInput::kTargetRows
                         : from_previous ? MtpInput::kPreviousRows
                                         : MtpInput::kHost;
  if (input == MtpInput::kHost) {
    MOE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(s.mtp_h.data(), hidden.data(), hidden.num_bytes(), cudaMemcpyHostToDevice, s.stream));
  } else {
    std::vector<int32_t> index = from_target ? mb.target_rows : mb.previous_rows;
    index.resize(static_cast<size_t>(shape.num_tokens), 0);  // graph padding reads row 0
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.target_rows.data(), index.data(),
                                             index.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                                             s.stream));
  }
  if (graph.seqs == 0) {
    MOE_RETURN_IF_ERROR(launch_mtp(shape, input));
  } else {
    MOE_RETURN_IF_ERROR(
        replay_or_capture(graph, shape.stride, true, [&] { return launch_mtp(shape, input); }));
  }
  s.mtp_rows = rows;
  return Status::ok();
}

// The kernels of an MTP pass whose metadata (and input rows or index) are
// uploaded: shape.num_tokens rows in, shape.num_rows out.
Status CudaQwen3MoeModel::launch_mtp(const StepShape& shape, MtpInput input) {
  State& s = *state_;
  const ModelConfig& c = config();
  const int T = shape.num_tokens, H = static_cast<int>(c.hidden_size), rows = shape.num_rows;
#define MOE_LAUNCH(call) MOE_RETURN_IF_ERROR(cuda_status((call), #call))
  const size_t row_bytes = static_cast<size_t>(H) * sizeof(bf16);
  if (input != MtpInput::kHost) {  // rows still on the device: no round trip through the host
    const DeviceTensor& source = input == MtpInput::kTargetRows ? s.target_hidden : s.logit_rows;
    MOE_LAUNCH(k::widen_rows(
        {source.data_as<bf16>(), s.target_rows.data_as<int32_t>(), s.mtp_h.data_as<float>(), T, H},
        s.stream));
    if (input == MtpInput::kPreviousRows)  // the previous pass's drafts are this pass's tokens
      MOE_LAUNCH(k::gather_rows({s.greedy.data(), s.token_ids.data(), s.target_rows.data_as<int32_t>(), T,
                                 int64_t{sizeof(int32_t)}},
                                s.stream));
  }
  MOE_LAUNCH(k::embedding({s.embed.data_as<bf16>(), s.token_ids.data_as<int32_t>(), s.residual.data_as<float>(), T, H,
                           static_cast<int>(c.vocab_size)}, s.stream));
  MOE_LAUNCH(k::add_rms_norm({s.residual.data_as<float>(), nullptr, s.mtp_embed_norm.data_as<bf16>(),
                              s.normed.data_as<bf16>(), T, H, c.rms_norm_eps}, s.stream));
  MOE_LAUNCH(k::add_rms_norm({s.mtp_h.data_as<float>(), nullptr, s.mtp_hidden_norm.data_as<bf16>(),
                              s.mtp_g.data_as<bf16>(), T, H, c.rms_norm_eps}, s.stream));
  // [e ; g]: the two halves of each row of mtp_concat.
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(s.mtp_concat.data(), 2 * row_bytes, s.normed.data(), row_bytes, row_bytes, T,
                                             cudaMemcpyDeviceToDevice, s.stream));
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(s.mtp_concat.data_as<uint8_t>() + row_bytes, 2 * row_bytes, s.mtp_g.data(),
                                             row_bytes, row_bytes, T, cudaMemcpyDeviceToDevice, s.stream));
  MOE_RETURN_IF_ERROR(s.gemm->matmul(s.mtp_concat.data_as<bf16>(), s.mtp_fc.data_as<bf16>(), s.residual.data(),
                                     DType::kF32, T, H, 2 * H, s.stream));
  MOE_LAUNCH(k::add_rms_norm({s.residual.data_as<float>(), nullptr, s.mtp_layer->input_norm.data_as<bf16>(),
                              s.normed.data_as<bf16>(), T, H, c.rms_norm_eps}, s.stream));
  s.x_fp8_holds = {};
  MOE_RETURN_IF_ERROR(launch_layer(*s.mtp_layer, shape, s.mtp_final_norm.data(), -1));
  if (rows > 0) {
    MOE_LAUNCH(k::gather_rows(
        {s.normed.data(), s.logit_rows.data(), s.logits_rows.data_as<int32_t>(), rows, int64_t{H} * 2},
        s.stream));
    MOE_RETURN_IF_ERROR(s.gemm->matmul(s.logit_rows.data_as<bf16>(), s.lm_head.data_as<bf16>(), s.logits.data(),
                                       DType::kF32, rows, static_cast<int>(c.vocab_size), H, s.stream));
    MOE_LAUNCH(ops::cuda::argmax(
        {s.logits.data_as<float>(), s.greedy.data_as<int32_t>(), rows, static_cast<int>(c.vocab_size)},
        s.stream));
  }
#undef MOE_LAUNCH
  return Status::ok();
}

Expected<MtpOutput> CudaQwen3MoeModel::forward_mtp(const MtpBatch& mb, TensorView hidden) {
  MOE_RETURN_IF_ERROR(queue_mtp(mb, hidden));
  State& s = *state_;
  const ModelConfig& c = config();
  const auto rows = static_cast<int>(mb.output_rows.size());
  const int64_t H = c.hidden_size;
  MtpOutput out{Tensor(DType::kF32, {mb.want_hidden ? rows : 0, H}),
                Tensor(DType::kF32, {mb.want_logits ? rows : 0, c.vocab_size}), std::vector<int32_t>(rows)};
  if (mb.num_tokens() == 0) return out;
  std::vector<uint16_t> normed(mb.want_hidden ? static_cast<size_t>(rows) * H : 0);
  if (rows > 0) {
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out.greedy.data(), s.greedy.data(),
                                             out.greedy.size() * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                             s.stream));
    if (mb.want_logits)
      MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out.logits.data(), s.logits.data(), out.logits.num_bytes(),
                                               cudaMemcpyDeviceToHost, s.stream));
    if (!normed.empty())
      MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(normed.data(), s.logit_rows.data(),
                                               normed.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost,
                                               s.stream));
  }
  MOE_RETURN_IF_ERROR(finish_step());
  float* h = out.hidden.data_as<float>();
  for (size_t i = 0; i < normed.size(); ++i) h[i] = bf16_to_float(normed[i]);
  return out;
}

Expected<std::vector<std::vector<int32_t>>> CudaQwen3MoeModel::forward_mtp_chain(
    std::span<const MtpBatch> passes) {
  State& s = *state_;
  size_t total = 0;
  for (const MtpBatch& pass : passes) {
    if (pass.previous_rows.empty() && pass.num_tokens() > 0)
      return invalid_argument("a chained MTP pass reads the pass before it (previous_rows)");
    total += pass.output_rows.size();
  }
  std::vector<std::vector<int32_t>> greedy(passes.size());
  if (total == 0) return greedy;
  if (s.chain_greedy.data() == nullptr || s.chain_greedy.num_bytes() < total * sizeof(int32_t)) {
    MOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(s.options.device));
    MOE_ASSIGN_OR_RETURN(s.chain_greedy, DeviceTensor::allocate(DType::kI32, {static_cast<int64_t>(total)}));
  }
  size_t offset = 0;
  for (const MtpBatch& pass : passes) {
    MOE_RETURN_IF_ERROR(queue_mtp(pass, TensorView()));
    const size_t rows = pass.output_rows.size();
    if (rows > 0)
      MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.chain_greedy.data_as<int32_t>() + offset, s.greedy.data(),
                                               rows * sizeof(int32_t), cudaMemcpyDeviceToDevice, s.stream));
    offset += rows;
  }
  std::vector<int32_t> all(total);
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(all.data(), s.chain_greedy.data(), total * sizeof(int32_t),
                                           cudaMemcpyDeviceToHost, s.stream));
  MOE_RETURN_IF_ERROR(finish_step());
  offset = 0;
  for (size_t j = 0; j < passes.size(); ++j) {
    greedy[j].assign(all.begin() + static_cast<ptrdiff_t>(offset),
                     all.begin() + static_cast<ptrdiff_t>(offset + passes[j].output_rows.size()));
    offset += passes[j].output_rows.size();
  }
  return greedy;
}

}  // namespace moe::model
