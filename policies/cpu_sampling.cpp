// The inverse-CDF draw of policies/cpu_sampling.py in one pass over each row, on the rows it is given, in place:
// no prefix sums written, no copy of the rows. Per row r of probs [B, V] and its uniform u in [0, 1):
//
//   S_b   = p_{16b} + ... + p_{16b+15}          block sums, in double
//   T     = S_0 + ... + S_{V/16}                the row's total
//   b*    = the first block with S_0 + ... + S_b > u T
//   token = the first i in block b* with S_0 + ... + S_{b*-1} + p_{16b*} + ... + p_i > u T
//
// which is min { i : C_i > u T } for the prefix sums C in double. Where rounding leaves no element of block b*
// over the threshold (its elements summed one by one against its sum by vector lanes), the block's last token of
// non-zero probability is taken; a row of total zero gives V - 1, as searchsorted's clamp does. A token of zero
// probability is never drawn: the running sum does not grow at it.
#include <torch/extension.h>

#include <vector>

namespace {

constexpr int64_t kBlock = 16;

int64_t draw_row(const float* p, int64_t vocab, double u, std::vector<double>& blocks) {
  const int64_t count = (vocab + kBlock - 1) / kBlock;
  blocks.resize(count);
  double total = 0.0;
  for (int64_t b = 0; b < count; ++b) {
    const float* block = p + b * kBlock;
    const int64_t width = std::min(kBlock, vocab - b * kBlock);
    double sum = 0.0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < width; ++i) sum += static_cast<double>(block[i]);
    blocks[b] = sum;
    total += sum;
  }
  if (!(total > 0.0)) return vocab - 1;
  const double threshold = u * total;
  double running = 0.0;
  int64_t b = 0;
  while (b < count - 1 && running + blocks[b] <= threshold) running += blocks[b++];
  const int64_t begin = b * kBlock, end = std::min(vocab, begin + kBlock);
  int64_t last_positive = -1;
  for (int64_t i = begin; i < end; ++i) {
    if (p[i] <= 0.f) continue;
    running += static_cast<double>(p[i]);
    last_positive = i;
    if (running > threshold) return i;
  }
  if (last_positive >= 0) return last_positive;
  for (int64_t i = begin - 1; i >= 0; --i)  // a block of zeros reached by rounding: the last token before it
    if (p[i] > 0.f) return i;
  return vocab - 1;
}

}  // namespace

// The token (int32) each row `rows[j]` of probs [B, V] (fp32, rows contiguous) draws with uniform[j] (fp32).
torch::Tensor inverse_cdf_rows(const torch::Tensor& probs, const torch::Tensor& rows, const torch::Tensor& uniform) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == torch::kFloat && probs.stride(1) == 1,
              "probs: float32 [batch, vocab], vocab contiguous");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kLong && rows.is_contiguous(), "rows: int64 [n]");
  TORCH_CHECK(uniform.dim() == 1 && uniform.scalar_type() == torch::kFloat && uniform.is_contiguous() &&
                  uniform.size(0) == rows.size(0),
              "uniform: float32 [n], one per row");
  const int64_t n = rows.size(0), batch = probs.size(0), vocab = probs.size(1), stride = probs.stride(0);
  auto tokens = torch::empty({n}, probs.options().dtype(torch::kInt));
  const float* p = probs.data_ptr<float>();
  const int64_t* r = rows.data_ptr<int64_t>();
  const float* u = uniform.data_ptr<float>();
  int32_t* out = tokens.data_ptr<int32_t>();
  for (int64_t j = 0; j < n; ++j) TORCH_CHECK(0 <= r[j] && r[j] < batch, "rows: an index outside the batch");
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> blocks;
    for (int64_t j = begin; j < end; ++j)
      out[j] = static_cast<int32_t>(draw_row(p + r[j] * stride, vocab, static_cast<double>(u[j]), blocks));
  });
  return tokens;
}

#ifndef SGLTTS_ONE_UNIT
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("inverse_cdf_rows", &inverse_cdf_rows, "the inverse-CDF draw of the listed rows, in place");
}
#endif
