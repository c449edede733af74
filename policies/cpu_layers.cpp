// RMSNorm (with the residual added first) and rotary position embedding in one call each, for the CPU runtime's
// decode step (policies/cpu_layers.py has the arithmetic and the hooks). SGLang's torch-native versions of these
// are 6-10 small torch calls per layer each; at the 1-8 rows of a search's step their dispatch, not their
// arithmetic, is the cost. Rows are independent: threads split them (at::parallel_for), the inner loops are
// vectorized by the compiler (-march of the CPU, `#pragma omp simd`).
#include <torch/extension.h>

#include <cmath>

namespace {

// out = x / sqrt(mean(x^2) + eps) * weight, one row of `hidden` floats.
inline void rms_norm_row(const float* x, const float* weight, float* out, int64_t hidden, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < hidden; ++i) sum += x[i] * x[i];
  const float inverse = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) out[i] = x[i] * inverse * weight[i];
}

void check_rows(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1,
              "x: float32 [tokens, hidden], hidden contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == torch::kFloat && weight.is_contiguous() &&
                  weight.size(0) == x.size(1),
              "weight: float32 [hidden]");
}

}  // namespace

// RMSNorm of every row of x [tokens, hidden]: a new contiguous tensor.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, weight);
  const int64_t rows = x.size(0), hidden = x.size(1), x_r = x.stride(0);
  auto out = torch::empty({rows, hidden}, x.options());
  const float* in = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(in + r * x_r, w, o + r * hidden, hidden, (float)eps);
  });
  return out;
}

// s = x + residual; returns (RMSNorm(s), s), both new contiguous tensors.
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                        const torch::Tensor& weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == torch::kFloat && residual.stride(1) == 1,
              "residual: float32, the shape of x");
  const int64_t rows = x.size(0), hidden = x.size(1), x_r = x.stride(0), res_r = residual.stride(0);
  auto out = torch::empty({rows, hidden}, x.options());
  auto sum = torch::empty({rows, hidden}, x.options());
  const float* in = x.data_ptr<float>();
  const float* res = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  float* s = sum.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = s + r * hidden;
      const float* a = in + r * x_r;
      const float* b = res + r * res_r;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) row[i] = a[i] + b[i];
      rms_norm_row(row, w, o + r * hidden, hidden, (float)eps);
    }
  });
  return {out, sum};
}

namespace {

// One head of `head_size` floats at position p, into `out`: the first rotary_dim dimensions rotated by the
// angles in cos_sin (cos then sin, rotary_dim / 2 each), the rest copied.
inline void rotate_head(const float* x, float* out, const float* cos, const float* sin, int64_t head_size,
                        int64_t rotary_dim, bool neox) {
  const int64_t half = rotary_dim / 2;
  if (neox) {  // pairs (i, i + half)
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = x[i + half];
      out[i] = x1 * cos[i] - x2 * sin[i];
      out[i + half] = x2 * cos[i] + x1 * sin[i];
    }
  } else {  // pairs (2i, 2i + 1)
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[2 * i], x2 = x[2 * i + 1];
      out[2 * i] = x1 * cos[i] - x2 * sin[i];
      out[2 * i + 1] = x2 * cos[i] + x1 * sin[i];
    }
  }
  for (int64_t i = rotary_dim; i < head_size; ++i) out[i] = x[i];
}

torch::Tensor rotate(const torch::Tensor& x, const int64_t* position, const float* cache, int64_t head_size,
                     int64_t rotary_dim, bool neox) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1 && x.size(1) % head_size == 0,
              "query and key: float32 [tokens, heads * head_size], contiguous rows");
  const int64_t rows = x.size(0), width = x.size(1), heads = width / head_size, x_r = x.stride(0);
  auto out = torch::empty({rows, width}, x.options());
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* cos = cache + position[r] * rotary_dim;  // a cache row is cos | sin, rotary_dim / 2 each
      const float* sin = cos + rotary_dim / 2;
      for (int64_t h = 0; h < heads; ++h)
        rotate_head(in + r * x_r + h * head_size, o + r * width + h * head_size, cos, sin, head_size, rotary_dim,
                    neox);
    }
  });
  return out;
}

}  // namespace

// Rotary embedding of query [tokens, q_heads * head_size] and key [tokens, kv_heads * head_size] at `positions`
// [tokens] (int64), angles from cos_sin_cache [max_position, rotary_dim] (cos | sin): new contiguous tensors.
std::vector<torch::Tensor> rotary(const torch::Tensor& positions, const torch::Tensor& query, const torch::Tensor& key,
                                  const torch::Tensor& cos_sin_cache, int64_t head_size, bool neox) {
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == torch::kLong && positions.is_contiguous(),
              "positions: int64 [tokens]");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.scalar_type() == torch::kFloat &&
                  cos_sin_cache.is_contiguous(),
              "cos_sin_cache: float32 [max_position, rotary_dim]");
  const int64_t rotary_dim = cos_sin_cache.size(1), tokens = positions.size(0);
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim <= head_size, "rotary_dim must be even and at most head_size");
  TORCH_CHECK(query.size(0) == tokens && key.size(0) == tokens, "one position per token");
  const int64_t* position = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(position[t] >= 0 && position[t] < cos_sin_cache.size(0), "a position past the cos_sin_cache");
  const float* cache = cos_sin_cache.data_ptr<float>();
  return {rotate(query, position, cache, head_size, rotary_dim, neox),
          rotate(key, position, cache, head_size, rotary_dim, neox)};
}

#ifndef SGLTTS_ONE_UNIT  // policies/decode_step.cpp is compiled after this file, with a module of its own
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (float32)");
  m.def("add_rms_norm", &add_rms_norm, "(RMSNorm(x + residual), x + residual) (float32)");
  m.def("rotary", &rotary, "rotary embedding of query and key at positions (float32), new tensors");
}
#endif
