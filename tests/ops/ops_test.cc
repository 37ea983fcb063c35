// The CPU ops against naive formulas written here, on random inputs: paged
// attention (any page table, page size, GQA group, cached prefix) against
// dense causal attention; MoE experts against the per-token weighted sum;
// routing against a sort; RoPE tables against transformers' (golden.json).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "ops/attention.h"
#include "ops/linear.h"
#include "ops/moe.h"
#include "ops/norm.h"
#include "ops/rope.h"

namespace moe::ops {
namespace {

Tensor random_tensor(Shape shape, std::mt19937& rng, float scale = 1.0f, DType dtype = DType::kF32) {
  Tensor t(dtype, shape);
  std::uniform_real_distribution<float> u(-scale, scale);
  for (int64_t i = 0; i < t.num_elements(); ++i) store_from_float(dtype, t.data(), i, u(rng));
  return t;
}

float max_abs_diff(const float* a, const float* b, int64_t n) {
  float m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

TEST(Linear, MatchesNaiveProductForBf16AndF32Weights) {
  std::mt19937 rng(1);
  ThreadPool pool(2);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    Tensor x = random_tensor({5, 37}, rng);
    Tensor w = random_tensor({19, 37}, rng, 1.0f, dtype);
    Tensor out(DType::kF32, {5, 19});
    cpu::linear(pool, x, w, out);
    for (int t = 0; t < 5; ++t)
      for (int n = 0; n < 19; ++n) {
        double ref = 0;
        for (int k = 0; k < 37; ++k) ref += double(x.data_as<float>()[t * 37 + k]) * load_as_float(dtype, w.data(), n * 37 + k);
        EXPECT_NEAR(out.data_as<float>()[t * 19 + n], ref, 1e-4);
      }
  }
}

TEST(RmsNorm, FusedAddEqualsAddThenNorm) {
  std::mt19937 rng(2);
  ThreadPool pool(2);
  Tensor residual = random_tensor({7, 64}, rng), delta = random_tensor({7, 64}, rng);
  Tensor weight = random_tensor({64}, rng, 1.0f, DType::kBF16);
  Tensor expected_residual = Tensor::copy_of(residual);
  for (int64_t i = 0; i < residual.num_elements(); ++i)
    expected_residual.data_as<float>()[i] += delta.data_as<float>()[i];
  Tensor expected(DType::kF32, {7, 64}), fused(DType::kF32, {7, 64});
  cpu::rms_norm(pool, expected_residual, weight, 1e-6f, expected);
  cpu::add_rms_norm(pool, residual, delta, weight, 1e-6f, fused);
  EXPECT_EQ(max_abs_diff(residual.data_as<float>(), expected_residual.data_as<float>(), 7 * 64), 0.0f);
  EXPECT_EQ(max_abs_diff(fused.data_as<float>(), expected.data_as<float>(), 7 * 64), 0.0f);
  // And against the formula.
  for (int r = 0; r < 7; ++r) {
    double ss = 0;
    for (int i = 0; i < 64; ++i) ss += double(expected_residual.data_as<float>()[r * 64 + i]) * expected_residual.data_as<float>()[r * 64 + i];
    const double inv = 1.0 / std::sqrt(ss / 64 + 1e-6);
    for (int i = 0; i < 64; ++i)
      EXPECT_NEAR(fused.data_as<float>()[r * 64 + i],
                  bf16_to_float(weight.data_as<uint16_t>()[i]) * expected_residual.data_as<float>()[r * 64 + i] * inv, 1e-5);
  }
}

TEST(Rope, TablesMatchTransformers) {
  // golden.json records transformers' inv_freq and attention scaling.
  for (const char* name : {"moe_basic", "moe_yarn"}) {
    std::ifstream in(std::string(MOE_SOURCE_DIR) + "/tests/data/golden/" + name + "/golden.json");
    auto golden = nlohmann::json::parse(in);
    std::ifstream config_in(std::string(MOE_SOURCE_DIR) + "/tests/data/golden/" + name + "/config.json");
    auto config = nlohmann::json::parse(config_in);
    RopeSpec spec;
    spec.head_dim = config["head_dim"];
    const auto& params = config["rope_parameters"];
    spec.theta = params["rope_theta"];
    spec.type = params["rope_type"];
    if (spec.type == "yarn") {
      spec.factor = params["factor"];
      spec.original_max_position_embeddings = params["original_max_position_embeddings"];
    }
    RopeTable table = make_rope_table(spec);
    auto expected = golden["rope"]["inv_freq"].get<std::vector<float>>();
    ASSERT_EQ(table.inv_freq.size(), expected.size()) << name;
    for (size_t i = 0; i < expected.size(); ++i) EXPECT_FLOAT_EQ(table.inv_freq[i], expected[i]) << name << " " << i;
    EXPECT_FLOAT_EQ(table.attention_factor, golden["rope"]["attention_scaling"].get<float>()) << name;
  }
}

// Dense causal GQA attention over contiguous k/v [seq_len, kv_heads, dim].
std::vector<float> naive_attention(const float* q, const float* k, const float* v, int num_new, int seq_len, int q_heads,
                                   int kv_heads, int dim, float scale) {
  std::vector<float> out(static_cast<size_t>(num_new) * q_heads * dim, 0.0f);
  const int group = q_heads / kv_heads;
  for (int t = 0; t < num_new; ++t) {
    const int pos = seq_len - num_new + t;
    for (int h = 0; h < q_heads; ++h) {
      std::vector<double> s(pos + 1);
      for (int j = 0; j <= pos; ++j) {
        double d = 0;
        for (int i = 0; i < dim; ++i) d += double(q[(t * q_heads + h) * dim + i]) * k[(j * kv_heads + h / group) * dim + i];
        s[j] = d * scale;
      }
      const double m = *std::max_element(s.begin(), s.end());
      double z = 0;
      for (auto& x : s) z += x = std::exp(x - m);
      for (int j = 0; j <= pos; ++j)
        for (int i = 0; i < dim; ++i) out[(t * q_heads + h) * dim + i] += float(s[j] / z * v[(j * kv_heads + h / group) * dim + i]);
    }
  }
  return out;
}

TEST(PagedAttention, MatchesDenseCausalAttention) {
  std::mt19937 rng(3);
  ThreadPool pool(2);
  struct Case { int q_heads, kv_heads, dim, page_size; std::vector<int> seq_lens, new_tokens; };
  const std::vector<Case> cases = {
      {4, 2, 32, 4, {9, 1, 17}, {9, 1, 3}},    // prefill, tiny decode, prefill after a cached prefix
      {8, 1, 16, 16, {40, 33}, {1, 33}},       // MQA decode + full prefill
      {4, 4, 8, 1, {5}, {2}},                  // page size 1, no GQA
      {64, 4, 128, 16, {70, 3}, {4, 3}},       // Qwen3-235B head layout
  };
  for (const Case& c : cases) {
    const int num_seqs = static_cast<int>(c.seq_lens.size());
    int max_pages = 0, total_pages = 0, num_tokens = 0;
    for (int s = 0; s < num_seqs; ++s) {
      const int pages = (c.seq_lens[s] + c.page_size - 1) / c.page_size;
      max_pages = std::max(max_pages, pages);
      total_pages += pages;
      num_tokens += c.new_tokens[s];
    }
    Tensor k_pages(DType::kF32, {total_pages, c.kv_heads, c.page_size, c.dim});
    Tensor v_pages(DType::kF32, {total_pages, c.kv_heads, c.page_size, c.dim});
    PagedKv kv{k_pages, v_pages};
    // A shuffled page assignment.
    std::vector<int32_t> free_pages(total_pages);
    std::iota(free_pages.begin(), free_pages.end(), 0);
    std::shuffle(free_pages.begin(), free_pages.end(), rng);
    std::vector<int32_t> page_table(static_cast<size_t>(num_seqs) * max_pages, -1), query_start = {0}, positions;
    std::vector<Tensor> seq_k, seq_v;
    for (int s = 0, next = 0; s < num_seqs; ++s) {
      for (int p = 0; p < (c.seq_lens[s] + c.page_size - 1) / c.page_size; ++p) page_table[s * max_pages + p] = free_pages[next++];
      seq_k.push_back(random_tensor({c.seq_lens[s], c.kv_heads, c.dim}, rng));
      seq_v.push_back(random_tensor({c.seq_lens[s], c.kv_heads, c.dim}, rng));
    }
    // Write each sequence's cached prefix as one batch, then the new tokens as another.
    for (int phase = 0; phase < 2; ++phase) {
      std::vector<int32_t> qs = {0}, pos;
      std::vector<float> kk, vv;
      for (int s = 0; s < num_seqs; ++s) {
        const int prefix = c.seq_lens[s] - c.new_tokens[s];
        const int begin = phase == 0 ? 0 : prefix, end = phase == 0 ? prefix : c.seq_lens[s];
        for (int p = begin; p < end; ++p) {
          pos.push_back(p);
          const float* kp = seq_k[s].data_as<float>() + p * c.kv_heads * c.dim;
          const float* vp = seq_v[s].data_as<float>() + p * c.kv_heads * c.dim;
          kk.insert(kk.end(), kp, kp + c.kv_heads * c.dim);
          vv.insert(vv.end(), vp, vp + c.kv_heads * c.dim);
        }
        qs.push_back(static_cast<int32_t>(pos.size()));
      }
      const auto n = static_cast<int64_t>(pos.size());
      TensorView kt(kk.data(), DType::kF32, {n, c.kv_heads, c.dim}), vt(vv.data(), DType::kF32, {n, c.kv_heads, c.dim});
      AttentionBatch batch{qs, pos, page_table, max_pages};
      cpu::write_kv(pool, kt, vt, batch, kv);
      if (phase == 1) query_start = qs, positions = pos;
    }
    Tensor q = random_tensor({num_tokens, c.q_heads, c.dim}, rng);
    Tensor out(DType::kF32, {num_tokens, c.q_heads * c.dim});
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.dim));
    cpu::paged_attention(pool, q, AttentionBatch{query_start, positions, page_table, max_pages}, kv, scale, out);
    for (int s = 0; s < num_seqs; ++s) {
      const float* qs = q.data_as<float>() + query_start[s] * c.q_heads * c.dim;
      auto ref = naive_attention(qs, seq_k[s].data_as<float>(), seq_v[s].data_as<float>(), c.new_tokens[s], c.seq_lens[s],
                                 c.q_heads, c.kv_heads, c.dim, scale);
      EXPECT_LT(max_abs_diff(out.data_as<float>() + query_start[s] * c.q_heads * c.dim, ref.data(), static_cast<int64_t>(ref.size())), 1e-5)
          << "seq " << s << " of case with " << c.q_heads << " heads";
    }
  }
}

TEST(Moe, RouteTopkSortsAndRenormalises) {
  ThreadPool pool(2);
  std::vector<float> logits = {0.1f, 2.0f, -1.0f, 2.0f, 0.5f, 1.5f};  // one token, six experts; a tie at 2.0
  TensorView lv(logits.data(), DType::kF32, {1, 6});
  Tensor ids(DType::kI32, {1, 3}), w(DType::kF32, {1, 3});
  cpu::route_topk(pool, lv, 3, false, ids, w);
  EXPECT_EQ(std::vector<int32_t>(ids.data_as<int32_t>(), ids.data_as<int32_t>() + 3), (std::vector<int32_t>{1, 3, 5}));
  double z = 0;
  for (float l : logits) z += std::exp(double(l));
  EXPECT_NEAR(w.data_as<float>()[0], std::exp(2.0) / z, 1e-6);
  EXPECT_NEAR(w.data_as<float>()[2], std::exp(1.5) / z, 1e-6);
  cpu::route_topk(pool, lv, 3, true, ids, w);
  const double chosen = 2 * std::exp(2.0) + std::exp(1.5);
  EXPECT_NEAR(w.data_as<float>()[0], std::exp(2.0) / chosen, 1e-6);
  EXPECT_NEAR(w.data_as<float>()[0] + w.data_as<float>()[1] + w.data_as<float>()[2], 1.0, 1e-6);
}

TEST(Moe, ExpertsEqualPerTokenWeightedSum) {
  std::mt19937 rng(4);
  ThreadPool pool(2);
  const int tokens = 13, hidden = 24, inter = 10, experts = 5, k = 2;
  Tensor x = random_tensor({tokens, hidden}, rng);
  Tensor w13 = random_tensor({experts, 2 * inter, hidden}, rng, 0.3f, DType::kBF16);
  Tensor w2 = random_tensor({experts, hidden, inter}, rng, 0.3f, DType::kBF16);
  Tensor ids(DType::kI32, {tokens, k}), weights = random_tensor({tokens, k}, rng);
  for (int t = 0; t < tokens; ++t) {  // two distinct experts per token; expert 4 gets no token
    ids.data_as<int32_t>()[t * k] = t % 4;
    ids.data_as<int32_t>()[t * k + 1] = (t % 4 + 1 + t % 3) % 4;
  }
  Tensor out(DType::kF32, {tokens, hidden});
  cpu::moe_experts(pool, x, ids, weights, w13, w2, out);
  for (int t = 0; t < tokens; ++t) {
    std::vector<double> ref(hidden, 0.0);
    for (int j = 0; j < k; ++j) {
      const int e = ids.data_as<int32_t>()[t * k + j];
      std::vector<double> act(inter);
      for (int i = 0; i < inter; ++i) {
        double g = 0, u = 0;
        for (int d = 0; d < hidden; ++d) {
          g += double(x.data_as<float>()[t * hidden + d]) * load_as_float(DType::kBF16, w13.data(), (e * 2 * inter + i) * hidden + d);
          u += double(x.data_as<float>()[t * hidden + d]) * load_as_float(DType::kBF16, w13.data(), (e * 2 * inter + inter + i) * hidden + d);
        }
        act[i] = g / (1 + std::exp(-g)) * u;
      }
      for (int d = 0; d < hidden; ++d) {
        double y = 0;
        for (int i = 0; i < inter; ++i) y += act[i] * load_as_float(DType::kBF16, w2.data(), (e * hidden + d) * inter + i);
        ref[d] += weights.data_as<float>()[t * k + j] * y;
      }
    }
    for (int d = 0; d < hidden; ++d) EXPECT_NEAR(out.data_as<float>()[t * hidden + d], ref[d], 1e-4) << t << "," << d;
  }
}

}  // namespace
}  // namespace moe::ops
