// Running a step of CudaQwen3MoeModel (cuda_model.h): the step's metadata
// upload, decode steps as CUDA graphs, the layer kernels in order (attention,
// MoE or dense MLP, the layer boundary and its collective on GPU ranks), the
// forward variants (logits, sampled, greedy, with hidden states). Creation
// lives in cuda_model.cc, the MTP passes in cuda_model_mtp.cc; the state they
// share in cuda_model_state.h.
#include <algorithm>
#include <cmath>
#include <utility>

#include "core/logging.h"
#include "model/cuda/cuda_model.h"
#include "model/cuda/cuda_model_state.h"
#include "ops/cuda/kernels.h"

namespace moe::model {

namespace {
namespace k = moe::ops::cuda;
using bf16 = __nv_bfloat16;
}  // namespace

// The end of a step on the host: its kernels done, and (GPU ranks) its
// collectives not abandoned for a lost rank.
Status CudaQwen3MoeModel::finish_step() {
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(state_->stream));
  if (state_->options.experts != nullptr) MOE_RETURN_IF_ERROR(state_->options.experts->health());
  return state_->options.comm != nullptr ? state_->options.comm->health() : Status::ok();
}

// Uploads the step's metadata. A CUDA-graph step (graph.seqs > 0) pads the
// batch to graph.seqs sequences of graph.query tokens each, the padding
// reading and writing the scratch KV page (positions 0 .. query - 1), with the
// page table at the fixed stride the graph was captured with.
Expected<StepShape> CudaQwen3MoeModel::upload_step(const ForwardBatch& batch, GraphShape graph,
                                                   const LayerBuffers* heads) {
  State& s = *state_;
  const int T = batch.num_tokens(), num_seqs = static_cast<int>(batch.query_start.size()) - 1;
  const int padded_tokens = graph.seqs * graph.query;
  StepShape shape;
  shape.num_tokens = padded_tokens > 0 ? padded_tokens : T;
  shape.num_rows = padded_tokens > 0 ? padded_tokens : static_cast<int>(batch.logits_rows.size());
  shape.stride = padded_tokens > 0 ? graph_stride(batch.max_pages_per_seq) : batch.max_pages_per_seq;
  shape.max_position = padded_tokens > 0 ? shape.stride * s.options.page_size - 1
                                         : (batch.positions.empty() ? 0 : *std::max_element(batch.positions.begin(),
                                                                                               batch.positions.end()));
  std::vector<int32_t> token_ids = batch.token_ids, positions = batch.positions, token_seq(static_cast<size_t>(T));
  for (int seq = 0; seq < num_seqs; ++seq)
    for (int t = batch.query_start[seq]; t < batch.query_start[seq + 1]; ++t) token_seq[t] = seq;
  std::vector<int32_t> page_table = batch.page_table, logits_rows = batch.logits_rows;
  std::vector<int32_t> query_start = batch.query_start;
  if (padded_tokens > 0) {
    const int32_t scratch = s.options.num_pages;  // the extra page past the scheduler's pool
    token_ids.resize(padded_tokens, 0);
    if (graph.rows > 0) {  // the batch's rows, then row 0 again
      logits_rows.resize(graph.rows, 0);
      shape.num_rows = graph.rows;
    } else {
      logits_rows.resize(padded_tokens);
      for (int t = 0; t < padded_tokens; ++t) logits_rows[t] = t;
    }
    for (int t = T; t < padded_tokens; ++t) {
      positions.push_back((t - T) % graph.query);
      token_seq.push_back(num_seqs + (t - T) / graph.query);
    }
    for (int seq = num_seqs; seq < graph.seqs; ++seq) query_start.push_back((seq + 1) * graph.query);
    page_table.assign(static_cast<size_t>(graph.seqs) * shape.stride, scratch);
    for (int seq = 0; seq < num_seqs; ++seq)
      for (int p = 0; p < batch.max_pages_per_seq; ++p) {
        const int32_t page = batch.page_table[static_cast<size_t>(seq) * batch.max_pages_per_seq + p];
        if (page >= 0) page_table[static_cast<size_t>(seq) * shape.stride + p] = page;
      }
  }
  if (s.page_table.data() == nullptr || s.page_table.num_bytes() < page_table.size() * sizeof(int32_t)) {
    // The captured decode graphs read the old buffer: drop them (each is
    // captured again on its next use). Without this a graph replayed after a
    // larger batch grew the table read freed memory (compute-sanitizer, two
    // requests of different page counts on an engine with a fixed pool).
    for (auto& [key, exec] : s.graphs) cudaGraphExecDestroy(exec);
    s.graphs.clear();
    MOE_ASSIGN_OR_RETURN(s.page_table, DeviceTensor::allocate(DType::kI32, {static_cast<int64_t>(page_table.size())}));
  }
  auto copy_in = [&](const DeviceTensor& dst, const std::vector<int32_t>& src) {
    return cuda_status(cudaMemcpyAsync(dst.data(), src.data(), src.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                                       s.stream), "metadata upload");
  };
  MOE_RETURN_IF_ERROR(copy_in(s.token_ids, token_ids));
  MOE_RETURN_IF_ERROR(copy_in(s.positions, positions));
  MOE_RETURN_IF_ERROR(copy_in(s.token_seq, token_seq));
  MOE_RETURN_IF_ERROR(copy_in(s.page_table, page_table));
  MOE_RETURN_IF_ERROR(copy_in(s.logits_rows, logits_rows));
  if (s.fp8_attention) {  // the attention projections' grouped GEMMs: one group of every token
    const int tokens = shape.num_tokens, tile = dense_tile_rows(tokens);
    MOE_RETURN_IF_ERROR(copy_in(s.dense_offsets, {0, tokens}));
    MOE_RETURN_IF_ERROR(copy_in(s.dense_tile_offsets, {0, (tokens + tile - 1) / tile}));
  }
  // Prefill (any sequence with several new tokens: a prompt chunk, or a
  // verification of drafts) shares K/V chunks between a sequence's tokens.
  for (size_t seq = 0; seq + 1 < query_start.size(); ++seq)
    shape.prefill |= query_start[seq + 1] - query_start[seq] > 1;
  if (shape.prefill) {
    const std::vector<int32_t> groups = k::prefill_token_groups(
        query_start, heads != nullptr ? k::prefill_group_tokens(heads->num_q_heads, heads->num_kv_heads)
                                      : k::prefill_group_tokens(config().num_q_heads, config().num_kv_heads));
    shape.num_groups = static_cast<int>(groups.size()) - 1;
    MOE_RETURN_IF_ERROR(copy_in(s.attention_groups, groups));
  }
  return shape;
}

// Row tiles of the FP8 attention projections' grouped GEMMs (one group):
// the memory-bound 64-row kernel for decode steps (every CUDA-graph bucket,
// <= 512 tokens), the compute-bound 128-row one above; mxfp8 has 64-row tiles only.
int CudaQwen3MoeModel::dense_tile_rows(int num_tokens) const {
  return !state_->mx_experts && num_tokens > 512 ? k::kPrefillGemmTileRows : k::kGroupedGemmTileRows;
}

// The page-table stride of a graph: the batch's, rounded up to a power of two
// (so few graphs cover all context lengths), at most max_pages_per_seq.
int CudaQwen3MoeModel::graph_stride(int max_pages_per_seq) const {
  int stride = 1;
  while (stride < max_pages_per_seq) stride *= 2;
  return std::min(stride, state_->max_pages_per_seq);
}

// Decode steps replay a CUDA graph captured once per (bucket of sequence
// counts, new tokens per sequence, page-table stride): plain decode (one token
// per sequence) and speculative verification (1 + drafts tokens per sequence,
// the same for every sequence), logits for every token, at most kMaxGraphTokens
// tokens after padding (the MoE layers' 64-row kernels, moe_tile_rows).
CudaQwen3MoeModel::GraphShape CudaQwen3MoeModel::graph_bucket(const ForwardBatch& batch,
                                                              bool any_rows) const {
  constexpr int kMaxQuery = 8;
  const State& s = *state_;
  const int T = batch.num_tokens(), num_seqs = static_cast<int>(batch.query_start.size()) - 1;
  if (!s.options.use_cuda_graphs || s.layer_hook || T == 0 || num_seqs <= 0 ||
      batch.max_pages_per_seq > s.max_pages_per_seq)
    return {};
  const int query = T / num_seqs, rows = static_cast<int>(batch.logits_rows.size());
  if (query > kMaxQuery || query * num_seqs != T || (!any_rows && rows != T)) return {};
  for (int seq = 0; seq <= num_seqs; ++seq)
    if (batch.query_start[seq] != seq * query) return {};
  for (int t = 0; !any_rows && t < T; ++t)
    if (batch.logits_rows[t] != t) return {};
  constexpr int kBuckets[] = {1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512};
  for (int bucket : kBuckets) {
    if (bucket < num_seqs || bucket * query > std::min(kMaxGraphTokens, s.options.max_num_tokens)) continue;
    if (!any_rows) return {bucket, query};
    for (int row_bucket : kBuckets)
      if (row_bucket >= rows) return {bucket, query, std::min(row_bucket, bucket * query)};
  }
  return {};
}

Status CudaQwen3MoeModel::run(const ForwardBatch& batch) {
  State& s = *state_;
  // The engine thread is not the one that created the model: make its device current.
  MOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(s.options.device));
  const int T = batch.num_tokens();
  if (T > s.options.max_num_tokens)
    return invalid_argument("batch of {} tokens exceeds max_num_tokens {}", T, s.options.max_num_tokens);
  MOE_RETURN_IF_ERROR(check_logits_rows(static_cast<int>(batch.logits_rows.size()), T));
  s.mtp_rows = 0;       // logit_rows and greedy are this forward's now
  s.target_tokens = 0;  // until sync_and_fetch_hidden keeps this forward's rows
  const GraphShape bucket = graph_bucket(batch);
  MOE_ASSIGN_OR_RETURN(const StepShape shape, upload_step(batch, bucket));
  if (bucket.seqs == 0) return launch_step(shape);
  return replay_or_capture(bucket, shape.stride, false, [&] { return launch_step(shape); });
}

// Replays the graph of (graph, stride, mtp); the first time, runs `launch`
// eagerly (warming every lazy initialisation), then captures it.
Status CudaQwen3MoeModel::replay_or_capture(GraphShape graph, int stride, bool mtp,
                                            const std::function<Status()>& launch) {
  // seqs, query <= 512 and rows <= 512 (graph_bucket); stride < 2^24 pages.
  const int64_t key = int64_t{mtp} << 62 | static_cast<int64_t>(graph.seqs) << 48 |
                      static_cast<int64_t>(graph.query) << 40 | static_cast<int64_t>(graph.rows) << 24 |
                      stride;
  State& s = *state_;
  if (auto it = s.graphs.find(key); it != s.graphs.end())
    return cuda_status(cudaGraphLaunch(it->second, s.stream), "cudaGraphLaunch");
  MOE_RETURN_IF_ERROR(launch());
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(s.stream, cudaStreamCaptureModeThreadLocal));
  const Status launched = launch();
  cudaGraph_t captured = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(s.stream, &captured);
  MOE_RETURN_IF_ERROR(launched);
  MOE_CUDA_RETURN_IF_ERROR(ended);
  cudaGraphExec_t exec = nullptr;
  const cudaError_t instantiated = cudaGraphInstantiate(&exec, captured, 0);
  cudaGraphDestroy(captured);
  MOE_CUDA_RETURN_IF_ERROR(instantiated);
  s.graphs[key] = exec;
  log_debug("captured a CUDA graph: {} sequences of {} tokens, {} output rows, page-table stride {}{}",
            graph.seqs, graph.query, graph.rows > 0 ? graph.rows : graph.seqs * graph.query, stride,
            mtp ? " (MTP pass)" : "");
  return Status::ok();
}

Status CudaQwen3MoeModel::launch_step(const StepShape& shape) {
  State& s = *state_;
  const ModelConfig& c = config();
  const int T = shape.num_tokens, H = static_cast<int>(c.hidden_size);
#define MOE_LAUNCH(call) MOE_RETURN_IF_ERROR(cuda_status((call), #call))
  MOE_LAUNCH(k::embedding({s.embed.data_as<bf16>(), s.token_ids.data_as<int32_t>(), s.residual.data_as<float>(), T, H,
                           static_cast<int>(c.vocab_size)}, s.stream));
  MOE_RETURN_IF_ERROR(add_rms_norm(s.layers[0].input_norm.data(), nullptr, T, qkv_input_fp8(s.layers[0], T), false));
  if (s.layer_hook && s.kv_written == nullptr)
    MOE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&s.kv_written, cudaEventDisableTiming));
  for (int l = 0; l < c.num_layers; ++l) {
    const bool last = l + 1 == c.num_layers;
    const bf16* next_norm = last ? s.final_norm.data_as<bf16>() : s.layers[l + 1].input_norm.data_as<bf16>();
    const Fp8Layout next_fp8 = last ? Fp8Layout::kNone : qkv_input_fp8(s.layers[l + 1], T);
    MOE_RETURN_IF_ERROR(launch_layer(s.layers[l], shape, next_norm, l, next_fp8));
    if (s.layer_hook) {
      // The rest of this layer is queued behind the KV store, so the GPU keeps
      // working while the hook hands the layer's pages to the transfer engine
      // (whose copies run on streams of their own and see the stored KV).
      MOE_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(s.kv_written));
      s.layer_hook(l);
    }
  }
  const int rows = shape.num_rows;
  MOE_LAUNCH(k::gather_rows(
      {s.normed.data(), s.logit_rows.data(), s.logits_rows.data_as<int32_t>(), rows, int64_t{H} * 2},
      s.stream));
  MOE_RETURN_IF_ERROR(s.gemm->matmul(s.logit_rows.data_as<bf16>(), s.lm_head.data_as<bf16>(), s.logits.data(),
                                     DType::kF32, rows, static_cast<int>(c.vocab_size), H, s.stream));
#undef MOE_LAUNCH
  return Status::ok();
}

Status CudaQwen3MoeModel::launch_layer(const LayerBuffers& b, const StepShape& shape, const void* next_norm, int layer,
                                        Fp8Layout next_fp8) {
  State& s = *state_;
  const ModelConfig& c = config();
  const int T = shape.num_tokens, H = static_cast<int>(c.hidden_size);
  // The layer's own heads (a target layer's the rank's share, the MTP layer's all).
  const int q_size = b.num_q_heads * c.head_dim, kv_size = b.num_kv_heads * c.head_dim;
  const int max_position = shape.max_position, qkv_width = q_size + 2 * kv_size;
  const bool prefill = shape.prefill;
#define MOE_LAUNCH(call) MOE_RETURN_IF_ERROR(cuda_status((call), #call))
  // In place: x [T, cols] bf16 -> bf16(e4m3(x / s) * s) per 1 x 128 group (mxfp8: per 1 x 32, E8M0 s).
  auto fake_quantize = [&](DeviceTensor& x, int cols) -> Status {
    if (s.mx_experts) {
      MOE_LAUNCH(k::quantize_mxfp8({x.data_as<bf16>(), s.x_fp8.data_as<uint8_t>(), nullptr, T, cols,
                                    x.data_as<bf16>()}, s.stream));
    } else {
      MOE_LAUNCH(k::quantize_fp8_groups({x.data_as<bf16>(), s.x_fp8.data_as<uint8_t>(), nullptr, T, cols,
                                         x.data_as<bf16>()}, s.stream));
    }
    return Status::ok();
  };
  // FP8 experts: activations quantized per 1 x 128 (mxfp8: per 1 x 32), scaled grouped GEMMs.
  // Prefill-sized batches (experts average >= 64 rows) take the compute-bound
  // kernels with 128-row tiles; decode steps, CUDA graphs and mxfp8 the 64-row ones.
  const int moe_tile_rows = c.num_experts > 0 && !b.mx_experts
                                ? k::moe_tile_rows(int64_t{T} * c.num_experts_per_tok, c.num_experts)
                                : k::kGroupedGemmTileRows;
  const bool prefill_gemm = moe_tile_rows == k::kPrefillGemmTileRows;
  auto fp8_experts_step = [&](int max_tiles) -> Status {
    const int E = s.num_local_experts, topk = c.num_experts_per_tok, inter = static_cast<int>(c.moe_intermediate_size);
    // fp8-block's gate_up quantizes its own output rows (out_scales) into
    // act_fp8 and act_scales, the down GEMM's input.
    const bool gate_up_quantizes = !b.mx_experts;
    // One expert GEMM: quantize `in` [rows, K] (unless gate_up did), then gate_up
    // (gathered by sorted_token) or down (bf16 rows).
    auto gemm = [&](const DeviceTensor& in, DeviceTensor& in_q, DeviceTensor& in_s, int rows, int K,
                    const int32_t* gather, const DeviceTensor& w, const DeviceTensor& w_scales, void* out,
                    int N, bool gate_up) -> Status {
      if (b.mx_experts) {  // 64-row tiles only (moe_tile_rows)
        MOE_LAUNCH(k::quantize_mxfp8({in.data_as<bf16>(), in_q.data_as<uint8_t>(), in_s.data_as<uint8_t>(), rows, K},
                                     s.stream));
        MOE_LAUNCH(k::mxfp8_grouped_gemm(
            {in_q.data_as<uint8_t>(), in_s.data_as<uint8_t>(), gather, w.data_as<uint8_t>(),
             w_scales.data_as<uint8_t>(), s.expert_offsets.data_as<int32_t>(),
             s.tile_offsets.data_as<int32_t>(), out, N, K, E, max_tiles, gate_up, 1, !gate_up},
            s.stream));
        return Status::ok();
      }
      if ((gate_up && !take_x_fp8(s.normed.data(), Fp8Layout::kRows)) || !gate_up_quantizes)
        MOE_LAUNCH(k::quantize_fp8_groups(
            {in.data_as<bf16>(), in_q.data_as<uint8_t>(), in_s.data_as<float>(), rows, K}, s.stream));
      const uint8_t* a = in_q.data_as<uint8_t>();
      const int32_t* scale_rows = nullptr;
      if (prefill_gemm && gather != nullptr) {  // the prefill kernel reads its rows permuted, contiguous
        const int64_t pairs = int64_t{T} * topk;
        auto* rows_out = static_cast<uint8_t*>(s.expert_rows.data());  // until down writes it
        MOE_LAUNCH(k::gather_rows({a, rows_out, gather, pairs, K, s.expert_offsets.data_as<int32_t>() + E}, s.stream));
        a = rows_out, scale_rows = gather, gather = nullptr, rows = static_cast<int>(pairs);  // scales by token
      }
      k::Fp8GroupedGemmParams params{a, in_s.data_as<float>(), gather, w.data_as<uint8_t>(), w_scales.data_as<float>(),
                                     s.expert_offsets.data_as<int32_t>(), s.tile_offsets.data_as<int32_t>(), out, N,
                                     K, E, max_tiles, gate_up, 1, rows, !gate_up,
                                     gate_up && gate_up_quantizes ? s.act_scales.data_as<float>() : nullptr};
      params.a_scale_rows = scale_rows;
      params.early_weights = !gate_up && !prefill_gemm;  // right after gate_up, which wrote its rows
      MOE_LAUNCH((prefill_gemm ? k::fp8_grouped_gemm_prefill : k::fp8_grouped_gemm)(params, s.stream));
      return Status::ok();
    };
    MOE_RETURN_IF_ERROR(gemm(s.normed, s.x_fp8, s.x_scales, T, H, s.sorted_token.data_as<int32_t>(), b.w13,
                             b.w13_scales, gate_up_quantizes ? s.act_fp8.data() : s.act.data(), inter, true));
    return gemm(s.act, s.act_fp8, s.act_scales, T * topk, inter, nullptr, b.w2, b.w2_scales, s.expert_rows.data(), H,
                false);
  };
  // An attention projection in FP8: `in` [T, K] quantized as the experts'
  // inputs are (unless the kernel that wrote `in` quantized it too),
  // into bf16_out [T, N] (qkv) or else the f32 `out`. fp8-block
  // goes through cuBLASLt's block-scaled GEMM where it has an algorithm for
  // the shape (the activation scales laid out by group for it). Otherwise the
  // grouped GEMM with one group writes f32 rows (cast to bf16_out after): at
  // decode sizes its few tiles are split along K (fp8_gemm_k_splits) so the
  // whole GPU streams the weights, adding into `out` zeroed first.
  auto fp8_projection = [&](const DeviceTensor& in, int K, const DeviceTensor& w,
                            const DeviceTensor& w_scales, void* out, bf16* bf16_out, int N) -> Status {
    const DType out_dtype = bf16_out != nullptr ? DType::kBF16 : DType::kF32;
    if (cublas_fp8_projection(T, N, K, out_dtype)) {
      if (!take_x_fp8(in.data(), Fp8Layout::kGroups))
        MOE_LAUNCH(k::quantize_fp8_groups({in.data_as<bf16>(), s.x_fp8.data_as<uint8_t>(),
                                           s.x_scales.data_as<float>(), T, K, nullptr, nullptr, true},
                                          s.stream));
      return s.gemm->matmul_fp8_block(s.x_fp8.data_as<uint8_t>(), s.x_scales.data_as<float>(),
                                      w.data_as<uint8_t>(), w_scales.data_as<float>(),
                                      bf16_out != nullptr ? bf16_out : out, out_dtype, T, N, K, s.stream);
    }
    const int tile = dense_tile_rows(T), tiles = (T + tile - 1) / tile + 1;
    const int k_splits = tile == k::kPrefillGemmTileRows ? 1 : k::fp8_gemm_k_splits(N, K, (T + tile - 1) / tile);
    if (k_splits > 1) MOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(out, 0, sizeof(float) * T * N, s.stream));
    if (s.mx_experts) {
      MOE_LAUNCH(k::quantize_mxfp8({in.data_as<bf16>(), s.x_fp8.data_as<uint8_t>(), s.x_scales.data_as<uint8_t>(), T,
                                    K}, s.stream));
      MOE_LAUNCH(k::mxfp8_grouped_gemm({s.x_fp8.data_as<uint8_t>(), s.x_scales.data_as<uint8_t>(), nullptr,
                                        w.data_as<uint8_t>(), w_scales.data_as<uint8_t>(),
                                        s.dense_offsets.data_as<int32_t>(), s.dense_tile_offsets.data_as<int32_t>(),
                                        out, N, K, 1, tiles, false, k_splits}, s.stream));
    } else {
      if (!take_x_fp8(in.data(), Fp8Layout::kRows))
        MOE_LAUNCH(k::quantize_fp8_groups(
            {in.data_as<bf16>(), s.x_fp8.data_as<uint8_t>(), s.x_scales.data_as<float>(), T, K}, s.stream));
      MOE_LAUNCH((tile == k::kPrefillGemmTileRows ? k::fp8_grouped_gemm_prefill : k::fp8_grouped_gemm)(
          {s.x_fp8.data_as<uint8_t>(), s.x_scales.data_as<float>(), nullptr, w.data_as<uint8_t>(),
           w_scales.data_as<float>(), s.dense_offsets.data_as<int32_t>(),
           s.dense_tile_offsets.data_as<int32_t>(), out, N, K, 1, tiles, false, k_splits, T},
          s.stream));
    }
    if (bf16_out != nullptr)
      MOE_LAUNCH(k::cast_to_bf16({static_cast<const float*>(out), bf16_out, int64_t{T} * N}, s.stream));
    return Status::ok();
  };
  // Attention.
  if (b.fp8_attention) {
    MOE_RETURN_IF_ERROR(fp8_projection(s.normed, H, b.qkv_proj, b.qkv_scales, s.qkv_f32.data(),
                                       s.qkv.data_as<bf16>(), qkv_width));
  } else {
    if (b.fake_quant_attention) MOE_RETURN_IF_ERROR(fake_quantize(s.normed, H));
    MOE_RETURN_IF_ERROR(s.gemm->matmul(s.normed.data_as<bf16>(), b.qkv_proj.data_as<bf16>(), s.qkv.data(),
                                       DType::kBF16, T, qkv_width, H, s.stream));
  }
  MOE_LAUNCH(k::qk_norm_rope_kv(
      {s.qkv.data_as<bf16>(), b.q_norm.data_as<bf16>(), b.k_norm.data_as<bf16>(), s.inv_freq.data_as<float>(),
       s.attention_factor, s.positions.data_as<int32_t>(), s.token_seq.data_as<int32_t>(),
       s.page_table.data_as<int32_t>(), s.q.data_as<bf16>(), b.k_pages.data_as<bf16>(),
       b.v_pages.data_as<bf16>(), T, b.num_q_heads, b.num_kv_heads, c.head_dim, s.options.page_size,
       shape.stride, c.rms_norm_eps},
      s.stream));
  // The layer hook's event: once this layer's KV is stored; with heads split
  // over ranks, once the attention all-reduce is through (every rank has
  // stored its heads by then, and the prefill leader sends them all).
  const bool tp = layer >= 0 && s.options.plan.tp_size > 1;
  if (s.layer_hook && layer >= 0 && !tp) MOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.kv_written, s.stream));
  k::PagedAttentionParams attention{s.q.data_as<bf16>(),
                                    b.k_pages.data_as<bf16>(),
                                    b.v_pages.data_as<bf16>(),
                                    s.positions.data_as<int32_t>(),
                                    s.token_seq.data_as<int32_t>(),
                                    s.page_table.data_as<int32_t>(),
                                    s.attended.data_as<bf16>(),
                                    T,
                                    b.num_q_heads,
                                    b.num_kv_heads,
                                    c.head_dim,
                                    s.options.page_size,
                                    shape.stride,
                                    1.0f / std::sqrt(static_cast<float>(c.head_dim))};
  attention.num_pages = static_cast<int>(b.k_pages.shape()[0]);
  if (k::mma_attention_supported(attention) && prefill) {
    // FP8 o projection: the prefill kernel writes its input in E4M3 straight away.
    const Fp8Layout o_fp8 = k::prefill_attention_quantizes() ? o_input_fp8(b, T) : Fp8Layout::kNone;
    if (o_fp8 != Fp8Layout::kNone) {
      attention.out_fp8 = s.x_fp8.data_as<uint8_t>(), attention.out_scales = s.x_scales.data_as<float>();
      attention.scales_by_group = o_fp8 == Fp8Layout::kGroups;
    }
    MOE_LAUNCH(k::prefill_attention(attention, s.attention_groups.data_as<int32_t>(), shape.num_groups, s.stream));
    s.x_fp8_holds = {s.attended.data(), o_fp8};
  } else if (k::mma_attention_supported(attention)) {
    const Fp8Layout o_fp8 = o_input_fp8(b, T);  // as at prefill, the kernel quantizes its rows
    if (o_fp8 != Fp8Layout::kNone) {
      attention.out_fp8 = s.x_fp8.data_as<uint8_t>(), attention.out_scales = s.x_scales.data_as<float>();
      attention.scales_by_group = o_fp8 == Fp8Layout::kGroups;
    }
    MOE_LAUNCH(k::mma_paged_attention(attention, max_position, s.attention_workspace.data_as<float>(),
                                      s.attention_workspace.num_bytes(), s.stream));
    s.x_fp8_holds = {s.attended.data(), o_fp8};
  } else {
    MOE_LAUNCH(k::paged_attention(attention, s.stream));
  }
  if (b.fp8_attention) {
    MOE_RETURN_IF_ERROR(fp8_projection(s.attended, q_size, b.o_proj, b.o_scales, s.delta.data(), nullptr, H));
  } else {
    if (b.fake_quant_attention) MOE_RETURN_IF_ERROR(fake_quantize(s.attended, q_size));
    MOE_RETURN_IF_ERROR(s.gemm->matmul(s.attended.data_as<bf16>(), b.o_proj.data_as<bf16>(), s.delta.data(),
                                       DType::kF32, T, H, q_size, s.stream));
  }
  // fp8-block experts read the MoE input in E4M3, a row's scales together.
  const bool fp8_block_experts = b.is_moe && b.fp8_experts && !b.mx_experts;
  MOE_RETURN_IF_ERROR(layer_boundary(b.post_attention_norm.data_as<bf16>(), T, tp,
                                     fp8_block_experts ? Fp8Layout::kRows : Fp8Layout::kNone));
  if (s.layer_hook && tp) MOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.kv_written, s.stream));
  // MLP. Partial sums to reduce: a MoE layer's under expert parallelism (on
  // replicated tokens), a dense one's under tensor parallelism.
  const bool reduce = layer >= 0 && (b.is_moe ? s.options.plan.ep_size > 1 && !s.options.plan.dp_attention
                                              : s.options.plan.tp_size > 1);
  const bool moe_delta = b.is_moe && !reduce && k::add_rms_norm_fuses(H);  // layer_boundary's
  if (b.is_moe) {
    const int E = c.num_experts, topk = c.num_experts_per_tok, inter = static_cast<int>(c.moe_intermediate_size);
    MOE_RETURN_IF_ERROR(s.gemm->matmul(s.normed.data_as<bf16>(), b.router.data_as<bf16>(), s.router_logits.data(),
                                       DType::kF32, T, E, H, s.stream));
    MOE_LAUNCH(k::route_topk({s.router_logits.data_as<float>(), s.expert_ids.data_as<int32_t>(),
                              s.expert_weights.data_as<float>(), T, E, topk, c.norm_topk_prob}, s.stream));
    // A data-parallel rank's target layers exchange their tokens; its MTP
    // layer (layer < 0) holds every expert and runs here, on its own requests.
    if (s.options.experts != nullptr && layer >= 0) return exchange_experts(b, T, next_norm, next_fp8);
    // This rank's experts only (all of them without expert parallelism, and
    // in the MTP layer): the grouped GEMMs below run E_local experts; the
    // other ranks' pairs get no row.
    const int E_local = layer >= 0 ? s.num_local_experts : E;
    const int first_expert = layer >= 0 ? s.first_expert : 0;
    MOE_LAUNCH(k::moe_permute({s.expert_ids.data_as<int32_t>(), s.expert_offsets.data_as<int32_t>(),
                               s.tile_offsets.data_as<int32_t>(), s.sorted_token.data_as<int32_t>(),
                               s.row_of.data_as<int32_t>(), T, topk, E_local, moe_tile_rows, first_expert,
                               s.permute_counts.data_as<int32_t>()},
                              s.stream));
    const int max_tiles = (T * topk + moe_tile_rows - 1) / moe_tile_rows + E_local;
    const auto gemm = prefill_gemm ? k::wgmma_grouped_gemm_prefill : k::grouped_gemm;
    if (b.fp8_experts) {
      MOE_RETURN_IF_ERROR(fp8_experts_step(max_tiles));
    } else {
      const int pairs = T * topk;
      const bf16* x = s.normed.data_as<bf16>();
      const int32_t* gather = s.sorted_token.data_as<int32_t>();
      if (prefill_gemm) {  // the prefill kernel reads its rows permuted, contiguous (in expert_rows until
                           // down writes it)
        auto* rows = static_cast<bf16*>(s.expert_rows.data());
        MOE_LAUNCH(k::gather_rows(
            {x, rows, gather, pairs, int64_t{H} * 2, s.expert_offsets.data_as<int32_t>() + E_local},
            s.stream));
        x = rows, gather = nullptr;
      }
      MOE_LAUNCH(
          gemm({x, gather, b.w13.data_as<bf16>(), s.expert_offsets.data_as<int32_t>(),
                s.tile_offsets.data_as<int32_t>(), s.act.data(), inter, H, E_local, max_tiles, true, pairs},
               s.stream));
      MOE_LAUNCH(gemm({s.act.data_as<bf16>(), nullptr, b.w2.data_as<bf16>(),
                       s.expert_offsets.data_as<int32_t>(), s.tile_offsets.data_as<int32_t>(),
                       s.expert_rows.data(), H, inter, E_local, max_tiles, false, pairs, true},
                      s.stream));
    }
    // The down GEMMs above write bf16 rows (each expert's output rounded once,
    // as transformers' Qwen3-MoE does): half the bytes of f32 both ways. With
    // nothing to reduce, the layer boundary's RMSNorm sums them itself.
    if (!moe_delta)
      MOE_LAUNCH(
          k::moe_unpermute({s.expert_rows.data(), s.row_of.data_as<int32_t>(),
                            s.expert_weights.data_as<float>(), s.delta.data_as<float>(), T, topk, H, true},
                           s.stream));
  } else {
    const int inter = b.mlp_columns;
    if (b.fake_quant_mlp) MOE_RETURN_IF_ERROR(fake_quantize(s.normed, H));
    MOE_RETURN_IF_ERROR(s.gemm->matmul(s.normed.data_as<bf16>(), b.w13.data_as<bf16>(), s.gate_up.data(), DType::kBF16,
                                       T, 2 * inter, H, s.stream));
    MOE_LAUNCH(k::silu_mul({s.gate_up.data_as<bf16>(), s.act.data_as<bf16>(), T, inter}, s.stream));
    if (b.fake_quant_mlp) MOE_RETURN_IF_ERROR(fake_quantize(s.act, inter));
    MOE_RETURN_IF_ERROR(s.gemm->matmul(s.act.data_as<bf16>(), b.w2.data_as<bf16>(), s.delta.data(), DType::kF32, T, H,
                                       inter, s.stream));
  }
  MOE_RETURN_IF_ERROR(layer_boundary(static_cast<const bf16*>(next_norm), T, reduce, next_fp8, moe_delta));
#undef MOE_LAUNCH
  return Status::ok();
}

// A data-parallel rank's MoE layer, its tokens routed (expert_ids, expert_weights):
// the rows go to their experts' ranks, this rank's experts run over what came
// (the grouped GEMMs over the exchange's groups), the outputs go back and are
// summed per token into delta; then the layer boundary, with nothing to reduce.
// num_tokens 0: an idle rank's share of its peers' exchange.
Status CudaQwen3MoeModel::exchange_experts(const LayerBuffers& b, int num_tokens, const void* next_norm,
                                            Fp8Layout next_fp8) {
  State& s = *state_;
  const ModelConfig& c = config();
  const int H = static_cast<int>(c.hidden_size), inter = static_cast<int>(c.moe_intermediate_size);
  const int E_local = s.num_local_experts;
#define MOE_LAUNCH(call) MOE_RETURN_IF_ERROR(cuda_status((call), #call))
  // FP8 experts: the rows travel quantized (1 x 128 groups, as the one-GPU
  // path quantizes them before its GEMM), so the expert inputs are the same.
  if (b.fp8_experts && num_tokens > 0 && !take_x_fp8(s.normed.data(), Fp8Layout::kRows))
    MOE_LAUNCH(k::quantize_fp8_groups(
        {s.normed.data_as<bf16>(), s.x_fp8.data_as<uint8_t>(), s.x_scales.data_as<float>(), num_tokens, H},
        s.stream));
  const void* x = b.fp8_experts ? s.x_fp8.data() : s.normed.data();
  const float* x_scales = b.fp8_experts ? s.x_scales.data_as<float>() : nullptr;
  MOE_ASSIGN_OR_RETURN(
      const ReceivedRows r,
      s.options.experts->dispatch(x, x_scales, s.expert_ids.data_as<int32_t>(), num_tokens, s.stream));
  if (r.max_rows > s.expert_rows.shape()[0])
    return internal_error("the expert exchange may bring {} rows; this model holds {}", r.max_rows,
                          s.expert_rows.shape()[0]);
  if (b.fp8_experts) {
    // gate_up quantizes its rows for down (the received rows' count stays on the device).
    k::Fp8GroupedGemmParams gate_up{static_cast<const uint8_t*>(r.rows), r.row_scales, r.gather,
                                    b.w13.data_as<uint8_t>(), b.w13_scales.data_as<float>(), r.expert_offsets,
                                    r.tile_offsets, s.act_fp8.data(), inter, H, E_local, r.max_tiles, true};
    gate_up.out_scales = s.act_scales.data_as<float>();
    k::Fp8GroupedGemmParams down{s.act_fp8.data_as<uint8_t>(), s.act_scales.data_as<float>(), nullptr,
                                 b.w2.data_as<uint8_t>(), b.w2_scales.data_as<float>(), r.expert_offsets,
                                 r.tile_offsets, s.expert_rows.data(), H, inter, E_local, r.max_tiles, false};
    down.a_rows = static_cast<int>(s.act_fp8.shape()[0]);  // (its rows by tensor copies)
    down.early_weights = true;  // right after gate_up, which wrote its rows
    MOE_LAUNCH(k::fp8_grouped_gemm(gate_up, s.stream));
    MOE_LAUNCH(k::fp8_grouped_gemm(down, s.stream));
  } else {
    MOE_LAUNCH(
        k::grouped_gemm({static_cast<const bf16*>(r.rows), r.gather, b.w13.data_as<bf16>(), r.expert_offsets,
                         r.tile_offsets, s.act.data(), inter, H, E_local, r.max_tiles, true},
                        s.stream));
    MOE_LAUNCH(k::grouped_gemm({s.act.data_as<bf16>(), nullptr, b.w2.data_as<bf16>(), r.expert_offsets,
                                r.tile_offsets, s.expert_rows.data(), H, inter, E_local, r.max_tiles, false},
                               s.stream));
  }
#undef MOE_LAUNCH
  MOE_RETURN_IF_ERROR(s.options.experts->combine(s.expert_rows.data_as<float>(),
                                                 s.expert_weights.data_as<float>(), s.delta.data_as<float>(),
                                                 num_tokens, s.stream));
  if (num_tokens == 0) return Status::ok();
  return layer_boundary(next_norm, num_tokens, false, next_fp8);
}

Status CudaQwen3MoeModel::exchange_idle() {
  State& s = *state_;
  if (s.options.experts == nullptr)
    return invalid_argument("exchange_idle: this model has no expert exchange");
  MOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(s.options.device));
  for (const LayerBuffers& b : s.layers)
    if (b.is_moe) MOE_RETURN_IF_ERROR(exchange_experts(b, 0, nullptr, Fp8Layout::kNone));
  return finish_step();
}

Status CudaQwen3MoeModel::layer_boundary(const void* norm_weight, int num_tokens, bool reduce, Fp8Layout fp8,
                                         bool moe_delta) {
  State& s = *state_;
  const ModelConfig& c = config();
  const int H = static_cast<int>(c.hidden_size);
  if (!reduce) return add_rms_norm(norm_weight, s.delta.data_as<float>(), num_tokens, fp8, moe_delta);
  s.x_fp8_holds = {};
  const auto* weight = static_cast<const bf16*>(norm_weight);
  MOE_RETURN_IF_ERROR(cuda_status(k::cast_to_bf16({s.delta.data_as<float>(), s.delta_bf16.data_as<bf16>(),
                                                   int64_t{num_tokens} * H}, s.stream), "cast_to_bf16"));
  return s.options.comm->all_reduce_add_rms_norm(s.delta_bf16.data_as<bf16>(), s.residual.data_as<float>(), weight,
                                                 s.normed.data_as<bf16>(), num_tokens, H, c.rms_norm_eps, s.stream);
}

Status CudaQwen3MoeModel::add_rms_norm(const void* norm_weight, const float* delta, int num_tokens, Fp8Layout fp8,
                                       bool moe_delta) {
  State& s = *state_;
  const ModelConfig& c = config();
  const int H = static_cast<int>(c.hidden_size);
  k::AddRmsNormParams norm{s.residual.data_as<float>(), delta, static_cast<const bf16*>(norm_weight),
                           s.normed.data_as<bf16>(), num_tokens, H, c.rms_norm_eps};
  if (moe_delta) {  // the expert rows' weighted sum is the delta
    norm.expert_rows = s.expert_rows.data_as<bf16>(), norm.row_of = s.row_of.data_as<int32_t>();
    norm.expert_weights = s.expert_weights.data_as<float>(), norm.k = c.num_experts_per_tok;
  }
  s.x_fp8_holds = {};
  if (fp8 != Fp8Layout::kNone && k::add_rms_norm_fuses(H)) {
    norm.out_fp8 = s.x_fp8.data_as<uint8_t>(), norm.out_scales = s.x_scales.data_as<float>();
    norm.scales_by_group = fp8 == Fp8Layout::kGroups;
    s.x_fp8_holds = {s.normed.data(), fp8};
  }
  return cuda_status(k::add_rms_norm(norm, s.stream), "add_rms_norm");
}

bool CudaQwen3MoeModel::cublas_fp8_projection(int num_tokens, int n, int k, DType out) const {
  const State& s = *state_;
  return !s.mx_experts && s.cublas_fp8_projections && s.gemm->has_fp8_block(num_tokens, n, k, out);
}

CudaQwen3MoeModel::Fp8Layout CudaQwen3MoeModel::qkv_input_fp8(const LayerBuffers& b, int num_tokens) const {
  const ModelConfig& c = config();
  if (!b.fp8_attention || state_->mx_experts) return Fp8Layout::kNone;
  const int qkv_width = (b.num_q_heads + 2 * b.num_kv_heads) * c.head_dim;
  return cublas_fp8_projection(num_tokens, qkv_width, static_cast<int>(c.hidden_size), DType::kBF16)
             ? Fp8Layout::kGroups
             : Fp8Layout::kRows;
}

CudaQwen3MoeModel::Fp8Layout CudaQwen3MoeModel::o_input_fp8(const LayerBuffers& b, int num_tokens) const {
  const ModelConfig& c = config();
  if (!b.fp8_attention || state_->mx_experts) return Fp8Layout::kNone;
  return cublas_fp8_projection(num_tokens, static_cast<int>(c.hidden_size), b.num_q_heads * c.head_dim, DType::kF32)
             ? Fp8Layout::kGroups
             : Fp8Layout::kRows;
}

bool CudaQwen3MoeModel::take_x_fp8(const void* source, Fp8Layout layout) {
  const State::Fp8Copy held = std::exchange(state_->x_fp8_holds, {});
  return layout != Fp8Layout::kNone && held.source == source && held.layout == layout;
}

Status CudaQwen3MoeModel::fill_kv_random(uint64_t seed) {
  uint64_t id = 0;
  for (auto& layer : state_->layers)
    for (TensorView* t : {&layer.k_pages, &layer.v_pages})
      MOE_RETURN_IF_ERROR(cuda_status(k::fill_random({t->data_as<bf16>(), t->shape().num_elements(), seed + ++id, 0.0f,
                                                      1.0f}, state_->stream), "fill_random"));
  return cuda_status(cudaStreamSynchronize(state_->stream), "fill_kv_random");
}

Expected<Tensor> CudaQwen3MoeModel::forward(const ForwardBatch& batch) {
  Tensor unused;
  return forward_with_hidden(batch, {}, unused);
}

Expected<Tensor> CudaQwen3MoeModel::forward_with_hidden(const ForwardBatch& batch, std::span<const int32_t> hidden_rows,
                                                        Tensor& hidden) {
  State& s = *state_;
  MOE_RETURN_IF_ERROR(check_batch(batch, hidden_rows));
  MOE_RETURN_IF_ERROR(run(batch));
  const auto rows = static_cast<int64_t>(batch.logits_rows.size());
  Tensor logits(DType::kF32, {rows, config().vocab_size});
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(logits.data(), s.logits.data(), logits.num_bytes(), cudaMemcpyDeviceToHost,
                                           s.stream));
  MOE_RETURN_IF_ERROR(sync_and_fetch_hidden(batch.num_tokens(), hidden_rows, hidden));
  return logits;
}

Expected<std::vector<int32_t>> CudaQwen3MoeModel::forward_greedy(const ForwardBatch& batch) {
  State& s = *state_;
  MOE_RETURN_IF_ERROR(check_batch(batch));
  MOE_RETURN_IF_ERROR(run(batch));
  const int rows = static_cast<int>(batch.logits_rows.size());
  MOE_CUDA_RETURN_IF_ERROR(ops::cuda::argmax({s.logits.data_as<float>(), s.greedy.data_as<int32_t>(), rows,
                                              static_cast<int>(config().vocab_size)}, s.stream));
  std::vector<int32_t> ids(static_cast<size_t>(rows));
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ids.data(), s.greedy.data(), ids.size() * sizeof(int32_t),
                                           cudaMemcpyDeviceToHost, s.stream));
  MOE_RETURN_IF_ERROR(finish_step());
  return ids;
}

Status CudaQwen3MoeModel::check_logits_rows(int rows, int num_tokens) const {
  if (rows > num_tokens) return invalid_argument("{} logits rows for {} tokens", rows, num_tokens);
  if (rows > state_->max_logits_rows)
    return invalid_argument("{} logits rows in one forward; this model holds {} (max_logits_rows)", rows,
                            state_->max_logits_rows);
  return Status::ok();
}

Status CudaQwen3MoeModel::check_batch(const ForwardBatch& batch, std::span<const int32_t> hidden_rows) const {
  const int T = batch.num_tokens();
  if (T > state_->options.max_num_tokens)
    return invalid_argument("batch of {} tokens exceeds max_num_tokens {}", T, state_->options.max_num_tokens);
  MOE_RETURN_IF_ERROR(check_logits_rows(static_cast<int>(batch.logits_rows.size()), T));
  for (int32_t row : hidden_rows)
    if (row < 0 || row >= T) return invalid_argument("hidden state row {} of a {}-token batch", row, T);
  return Status::ok();
}

// After a forward pass, `normed` holds every token's final-normed state:
// copies `hidden_rows` of it behind the copies already queued (and, with an
// MTP layer, all of it into target_hidden for the MTP's first pass,
// MtpBatch::target_rows), waits for the stream, and widens them to f32.
Status CudaQwen3MoeModel::sync_and_fetch_hidden(int num_tokens, std::span<const int32_t> hidden_rows, Tensor& hidden) {
  State& s = *state_;
  const int64_t H = config().hidden_size;
  std::vector<uint16_t> normed(hidden_rows.empty() ? 0 : static_cast<size_t>(num_tokens) * H);
  if (!normed.empty())
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(normed.data(), s.normed.data(), normed.size() * sizeof(uint16_t),
                                             cudaMemcpyDeviceToHost, s.stream));
  if (s.mtp_layer && num_tokens > 0) {
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.target_hidden.data(), s.normed.data(),
                                             static_cast<size_t>(num_tokens) * H * sizeof(uint16_t),
                                             cudaMemcpyDeviceToDevice, s.stream));
  }
  s.target_tokens = s.mtp_layer ? num_tokens : 0;
  MOE_RETURN_IF_ERROR(finish_step());
  if (hidden_rows.empty()) return Status::ok();
  hidden = Tensor(DType::kF32, {static_cast<int64_t>(hidden_rows.size()), H});
  float* out = hidden.data_as<float>();
  for (size_t i = 0; i < hidden_rows.size(); ++i)
    for (int64_t j = 0; j < H; ++j) out[i * H + j] = bf16_to_float(normed[hidden_rows[i] * H + j]);
  return Status::ok();
}

Expected<CudaQwen3MoeModel::DeviceSamples> CudaQwen3MoeModel::forward_sample(
    const ForwardBatch& batch, const DeviceSampling& sampling, std::span<const int32_t> hidden_rows,
    Tensor& hidden) {
  State& s = *state_;
  const int64_t vocab = config().vocab_size;
  const auto num_logits_rows = static_cast<int32_t>(batch.logits_rows.size());
  const auto num_rows = static_cast<int32_t>(sampling.rows.size());
  if (num_rows > num_logits_rows)
    return invalid_argument("{} sampled rows of {} logits rows", num_rows, num_logits_rows);
  for (int32_t r : sampling.fetch_rows)
    if (r < 0 || r >= num_logits_rows)
      return invalid_argument("fetched row {} of {} logits rows", r, num_logits_rows);
  for (const ops::LogitAdjustment& a : sampling.adjustments)
    if (a.row < 0 || a.row >= num_rows || a.token < 0 || a.token >= vocab)
      return invalid_argument("logit adjustment of row {}, token {} ({} rows, vocabulary {})", a.row, a.token,
                              num_rows, vocab);
  const int64_t mask_words = (vocab + 31) / 32;
  if (static_cast<int64_t>(sampling.mask_words.size()) != static_cast<int64_t>(sampling.mask_rows.size()) * mask_words)
    return invalid_argument("{} mask words for {} masked rows of {} tokens", sampling.mask_words.size(),
                            sampling.mask_rows.size(), vocab);
  if (sampling.mask_rows.size() > 65535) return invalid_argument("{} masked rows", sampling.mask_rows.size());
  {
    std::vector<uint8_t> masked(static_cast<size_t>(num_rows), 0);
    for (int32_t r : sampling.mask_rows)
      if (r < 0 || r >= num_rows || std::exchange(masked[static_cast<size_t>(r)], 1) != 0)
        return invalid_argument("masked row {} ({} sampled rows; each row once)", r, num_rows);
  }
  MOE_RETURN_IF_ERROR(check_batch(batch, hidden_rows));
  MOE_RETURN_IF_ERROR(run(batch));  // first: it makes the model's device current for the allocations below
  auto grow = [](DeviceTensor& t, size_t bytes) -> Status {
    if (t.data() != nullptr && t.num_bytes() >= bytes) return Status::ok();
    MOE_ASSIGN_OR_RETURN(
        t, DeviceTensor::allocate(DType::kU8, {static_cast<int64_t>(std::max<size_t>(bytes, 1))}));
    return Status::ok();
  };
  DeviceSamples out;
  out.fetched = Tensor(DType::kF32, {static_cast<int64_t>(sampling.fetch_rows.size()), vocab});
  const size_t row_bytes = static_cast<size_t>(vocab) * sizeof(float);
  const std::span<const int32_t> fetch = sampling.fetch_rows;
  for (size_t i = 0; i < fetch.size();) {  // before the adjustments; a run of consecutive rows in one copy
    size_t n = 1;
    while (i + n < fetch.size() && fetch[i + n] == fetch[i] + static_cast<int32_t>(n)) ++n;
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out.fetched.data_as<uint8_t>() + i * row_bytes,
                                             s.logits.data_as<uint8_t>() + fetch[i] * row_bytes,
                                             n * row_bytes, cudaMemcpyDeviceToHost, s.stream));
    i += n;
  }
  if (!sampling.adjustments.empty()) {
    MOE_RETURN_IF_ERROR(grow(s.logit_adjustments, sampling.adjustments.size_bytes()));
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.logit_adjustments.data(), sampling.adjustments.data(),
                                             sampling.adjustments.size_bytes(), cudaMemcpyHostToDevice,
                                             s.stream));
    MOE_CUDA_RETURN_IF_ERROR(ops::cuda::adjust_logits(
        {s.logits.data_as<float>(), s.logit_adjustments.data_as<ops::LogitAdjustment>(),
         static_cast<int>(sampling.adjustments.size()), static_cast<int>(vocab)},
        s.stream));
  }
  if (!sampling.mask_rows.empty()) {
    MOE_RETURN_IF_ERROR(grow(s.mask_rows, sampling.mask_rows.size_bytes()));
    MOE_RETURN_IF_ERROR(grow(s.mask_words, sampling.mask_words.size_bytes()));
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.mask_rows.data(), sampling.mask_rows.data(),
                                             sampling.mask_rows.size_bytes(), cudaMemcpyHostToDevice, s.stream));
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.mask_words.data(), sampling.mask_words.data(),
                                             sampling.mask_words.size_bytes(), cudaMemcpyHostToDevice, s.stream));
    MOE_CUDA_RETURN_IF_ERROR(ops::cuda::mask_logits(
        {s.logits.data_as<float>(), s.mask_rows.data_as<int32_t>(), s.mask_words.data_as<uint32_t>(),
         static_cast<int>(sampling.mask_rows.size()), static_cast<int>(vocab)},
        s.stream));
  }
  out.tokens.resize(sampling.rows.size());
  out.accepted.resize(sampling.rows.size());
  if (num_rows > 0) {
    MOE_RETURN_IF_ERROR(grow(s.sample_rows, sampling.rows.size_bytes()));
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.sample_rows.data(), sampling.rows.data(),
                                             sampling.rows.size_bytes(), cudaMemcpyHostToDevice, s.stream));
    MOE_CUDA_RETURN_IF_ERROR(
        ops::cuda::sample({s.logits.data_as<float>(), s.sample_rows.data_as<ops::cuda::SampleRow>(),
                           s.greedy.data_as<int32_t>(), s.sample_accepted.data_as<uint8_t>(), num_rows,
                           static_cast<int>(vocab)},
                          s.stream));
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out.tokens.data(), s.greedy.data(),
                                             out.tokens.size() * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                             s.stream));
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out.accepted.data(), s.sample_accepted.data(),
                                             out.accepted.size(), cudaMemcpyDeviceToHost, s.stream));
  }
  MOE_RETURN_IF_ERROR(sync_and_fetch_hidden(batch.num_tokens(), hidden_rows, hidden));
  return out;
}

}  // namespace moe::model
