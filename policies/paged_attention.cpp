// Attention read straight from SGLang's paged KV pool, for decode and for extend (prefill after a cached prefix);
// policies/cpu_attention.py builds and loads it.
//
// Sequence b holds seq_lens[b] tokens, of which its last extend_lens[b] are the queries (one at decode). The query
// at position p = seq_lens[b] - extend_lens[b] + i attends causally to positions 0..p. For KV head h_kv and each
// of its G = H / H_kv query heads g (query head h = h_kv * G + g):
//
//     slot_t = req_to_token[req_pool_indices[b], t]               t <= p
//     s_t    = scale * q[row, h] . k_cache[slot_t, h_kv]           pass 1: G dot products per key row
//     p_t    = exp(s_t - max_t s_t) / sum_t exp(s_t - max_t s_t)   pass 2
//     out    = sum_t p_t v_cache[slot_t, h_kv]                     pass 3: G axpys per value row
//
// Each key and value row is read in place in the pool, once for the G heads that share it: no gathered copy, no
// padding to the longest sequence, no GQA expansion, and at extend no square over the cached prefix (SGLang's
// torch-native extend attends from every position of the sequence, the prefix's included, then keeps the new
// rows). Work items are (query row, h_kv), sequence-major, so the forks of one prompt, adjacent in the batch,
// find their shared prefix's rows in cache.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace

void paged_attention(const torch::Tensor& query, torch::Tensor& output, const torch::Tensor& k_cache,
                     const torch::Tensor& v_cache, const torch::Tensor& req_to_token,
                     const torch::Tensor& req_pool_indices, const torch::Tensor& seq_lens,
                     const torch::Tensor& extend_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && output.sizes() == query.sizes(), "query and output: [tokens, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "caches: [slots, kv_heads, head_dim]");
  TORCH_CHECK(query.scalar_type() == torch::kFloat && output.scalar_type() == torch::kFloat &&
                  k_cache.scalar_type() == torch::kFloat && v_cache.scalar_type() == torch::kFloat,
              "float32 only");
  TORCH_CHECK(query.stride(2) == 1 && output.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1,
              "head_dim must be contiguous");
  TORCH_CHECK(req_to_token.scalar_type() == torch::kInt && req_to_token.dim() == 2 && req_to_token.stride(1) == 1,
              "req_to_token: int32 [requests, context]");
  const auto pools = req_pool_indices.to(torch::kLong).contiguous();
  const auto lengths = seq_lens.to(torch::kLong).contiguous();
  const auto extends = extend_lens.to(torch::kLong).contiguous();
  const int64_t batch = pools.numel(), rows = query.size(0), heads = query.size(1), head_dim = query.size(2);
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads;
  TORCH_CHECK(k_cache.size(2) == head_dim && group * kv_heads == heads, "heads must be a multiple of kv_heads");
  TORCH_CHECK(lengths.numel() == batch && extends.numel() == batch, "one length and extend length per sequence");

  const int64_t* pool_of = pools.data_ptr<int64_t>();
  const int64_t* length_of = lengths.data_ptr<int64_t>();
  const int64_t* extend_of = extends.data_ptr<int64_t>();
  std::vector<int64_t> sequence_of(rows), position_of(rows);  // each query row's sequence and position
  int64_t row = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(extend_of[b] >= 0 && extend_of[b] <= length_of[b], "extend_lens[b] must be within seq_lens[b]");
    for (int64_t i = 0; i < extend_of[b]; ++i, ++row) {
      TORCH_CHECK(row < rows, "more extend tokens than query rows");
      sequence_of[row] = b;
      position_of[row] = length_of[b] - extend_of[b] + i;
    }
  }
  TORCH_CHECK(row == rows, "the extend lengths must add up to the query rows");

  const float* q = query.data_ptr<float>();
  float* out = output.data_ptr<float>();
  const float* keys = k_cache.data_ptr<float>();
  const float* values = v_cache.data_ptr<float>();
  const int32_t* table = req_to_token.data_ptr<int32_t>();
  const int64_t q_r = query.stride(0), q_h = query.stride(1), o_r = output.stride(0), o_h = output.stride(1);
  const int64_t k_s = k_cache.stride(0), k_h = k_cache.stride(1), v_s = v_cache.stride(0), v_h = v_cache.stride(1);
  const int64_t table_row = req_to_token.stride(0);
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(group * head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, kv = item % kv_heads, attended = position_of[r] + 1;
      const int32_t* slots = table + pool_of[sequence_of[r]] * table_row;
      const float* q_group = q + r * q_r + kv * group * q_h;
      scores.resize(group * attended);
      for (int64_t t = 0; t < attended; ++t) {  // pass 1
        const float* k = keys + slots[t] * k_s + kv * k_h;
        for (int64_t g = 0; g < group; ++g) scores[g * attended + t] = fscale * dot(q_group + g * q_h, k, head_dim);
      }
      for (int64_t g = 0; g < group; ++g) {  // pass 2
        float* s = scores.data() + g * attended;
        const float top = *std::max_element(s, s + attended);
        float sum = 0.f;
        for (int64_t t = 0; t < attended; ++t) sum += (s[t] = std::exp(s[t] - top));
        const float inverse = 1.f / sum;
        for (int64_t t = 0; t < attended; ++t) s[t] *= inverse;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < attended; ++t) {  // pass 3
        const float* v = values + slots[t] * v_s + kv * v_h;
        for (int64_t g = 0; g < group; ++g) axpy(scores[g * attended + t], v, acc.data() + g * head_dim, head_dim);
      }
      for (int64_t g = 0; g < group; ++g)
        std::copy(acc.begin() + g * head_dim, acc.begin() + (g + 1) * head_dim, out + r * o_r + (kv * group + g) * o_h);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "causal attention of the last extend_lens tokens of each sequence, read "
        "from the paged KV pool (float32)");
}
