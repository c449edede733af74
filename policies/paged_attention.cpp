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
// find their shared prefix's rows in cache. The pool holds fp32 or bf16 (`--kv-cache-dtype bf16`: half the
// bytes to read per key and value row, each widened to fp32 as it is loaded); the arithmetic is fp32. Where
// G <= 8 and head_dim is 64 or 128 (SmolLM2's and Qwen2.5's), an item runs in vector registers
// (`attend_group_fixed`); any other shape runs the plain loops (`attend_group`).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace {

// A key or value element as the pool stores it: float, or bf16 (the upper 16 bits of a float, kept as uint16_t).
inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * to_float(b[i]);
  return sum;
}

template <typename T>
inline void axpy(float alpha, const T* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * to_float(x[i]);
}

// The G heads of one KV head for one query row, any head_dim: scores [G * attended] is scratch. T is the pool's
// element type.
template <typename T>
void attend_group(const float* q_group, int64_t q_h, float* out_group, int64_t o_h, const T* k_head,
                  const T* v_head, int64_t k_s, int64_t v_s, const int32_t* slots, int64_t attended,
                  int64_t group, int64_t head_dim, float scale, float* scores, float* acc) {
  for (int64_t t = 0; t < attended; ++t) {  // pass 1
    const T* k = k_head + slots[t] * k_s;
    for (int64_t g = 0; g < group; ++g) scores[g * attended + t] = scale * dot(q_group + g * q_h, k, head_dim);
  }
  for (int64_t g = 0; g < group; ++g) {  // pass 2
    float* s = scores + g * attended;
    const float top = *std::max_element(s, s + attended);
    float sum = 0.f;
    for (int64_t t = 0; t < attended; ++t) sum += (s[t] = std::exp(s[t] - top));
    const float inverse = 1.f / sum;
    for (int64_t t = 0; t < attended; ++t) s[t] *= inverse;
  }
  std::fill(acc, acc + group * head_dim, 0.f);
  for (int64_t t = 0; t < attended; ++t) {  // pass 3
    const T* v = v_head + slots[t] * v_s;
    for (int64_t g = 0; g < group; ++g) axpy(scores[g * attended + t], v, acc + g * head_dim, head_dim);
  }
  for (int64_t g = 0; g < group; ++g) std::copy(acc + g * head_dim, acc + (g + 1) * head_dim, out_group + g * o_h);
}

// The same in registers, for G and head_dim D known at compile time. A row of D floats is D / W vector registers
// (W floats each: 16 with AVX-512, 8 with AVX2); the G query rows and the G output accumulators stay in registers
// while the key and value rows stream past once. Pass 1 sums W keys' dot products at once (`transpose_sum`), pass
// 2's exponentials run W at a time (`exp_lanes`), and key and value rows are asked into cache ahead of their use.
#ifdef __AVX512F__
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float floats __attribute__((vector_size(4 * W), aligned(4)));  // aligned(4): loads from any float
typedef int32_t ints __attribute__((vector_size(4 * W)));
typedef float floats8 __attribute__((vector_size(32)));
typedef float floats4 __attribute__((vector_size(16)));

inline floats load(const float* p) { return *reinterpret_cast<const floats*>(p); }

inline float lane_sum(floats x) {  // halve to 8 lanes (AVX-512), then to 4, then add the four
#ifdef __AVX512F__
  const floats8 h = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const floats8 h = x;
#endif
  const floats4 f = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (f[0] + f[2]) + (f[1] + f[3]);
}

// W vectors v[0..W) to one whose lane i is the sum of v[i]'s lanes, in log2(W) levels of folds: at a level of N
// vectors each holds its keys' partial sums in segments of N lanes, and v[m] and v[m + N / 2] fold into one with
// segments of N / 2 (segment j becomes v[m]'s segment j halved and added, then v[m + N / 2]'s), so after the last
// level key i sits in lane i. W - 1 folds of two shuffles and an add, where lane_sum would halve each vector on its
// own (about 3 shuffles and a scalar store a key); the additions are lane_sum's, in its order, so the sums are the
// same to the bit.
constexpr int fold_lane(int lane, int n, bool upper) {
  const int segment = lane / n, offset = lane % n, half = n / 2;
  return (offset < half ? segment * n + offset : W + segment * n + offset - half) + (upper ? half : 0);
}

template <int N, int... Lane>
inline floats fold(floats a, floats b, std::integer_sequence<int, Lane...>) {
  return __builtin_shufflevector(a, b, fold_lane(Lane, N, false)...) +
         __builtin_shufflevector(a, b, fold_lane(Lane, N, true)...);
}

template <int N = W>
inline floats transpose_sum(floats* v) {  // overwrites v
  if constexpr (N == 1) {
    return v[0];
  } else {
    for (int m = 0; m < N / 2; ++m) v[m] = fold<N>(v[m], v[m + N / 2], std::make_integer_sequence<int, W>());
    return transpose_sum<N / 2>(v);
  }
}

// A pool row of D elements asked into cache ahead of its use: a sequence's own tokens lie a batch's worth of slots
// apart (each decode step takes one slot per running request), too far apart for the hardware's prefetcher.
constexpr int64_t kRowsAhead = 16;  // rows ahead

template <typename T, int D>
inline void prefetch_row(const T* row) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int byte = 0; byte < D * int(sizeof(T)); byte += 64) __builtin_prefetch(bytes + byte);
}

// A row of D pool elements in P registers. fp32: in order. bf16: each 4W bytes loaded as W 32-bit lanes, each
// holding an even element in its low half and the next odd one in its high half: the even ones widened by a
// shift, the odd ones by a mask, no shuffle; register 2c holds elements 2Wc + 2i, register 2c + 1 the odd ones.
// The query is loaded and the output stored in the same order (`element_of`), so the sums are over the same pairs.
template <typename T, int P>
inline void load_row(const T* row, floats* out) {
  static_assert(sizeof(T) == 4 || P % 2 == 0, "a bf16 row fills registers in pairs");
  if constexpr (sizeof(T) == 4) {
    for (int j = 0; j < P; ++j) out[j] = load(row + W * j);
  } else {
    for (int c = 0; c < P / 2; ++c) {
      ints bits;
      __builtin_memcpy(&bits, row + 2 * W * c, sizeof bits);
      const ints even = bits << 16, odd = bits & int32_t(0xFFFF0000u);
      __builtin_memcpy(&out[2 * c], &even, sizeof even);
      __builtin_memcpy(&out[2 * c + 1], &odd, sizeof odd);
    }
  }
}

template <typename T>
constexpr int element_of(int j, int lane) {  // the row element in register j, lane `lane`
  return sizeof(T) == 4 ? W * j + lane : 2 * W * (j / 2) + 2 * lane + j % 2;
}

template <int P>
inline floats row_product(const floats* q, const floats* key) {  // q . k in W lanes, to be summed
  floats product = q[0] * key[0];
  for (int j = 1; j < P; ++j) product += q[j] * key[j];
  return product;
}

// e^x for x <= 0 in every lane, Cephes' expf: x = n ln2 + r with n = round(x / ln2) and |r| <= ln2 / 2 (ln2 in two
// parts, so r is exact), e^r = 1 + r + r^2 p(r) with p of degree 5, and 2^n written into the exponent bits.
// Relative error about 2e-7. Below -87, e^-87 (1.6e-38) instead of a denormal or 0: against a softmax's top term
// of 1 that is nothing.
inline floats exp_lanes(floats x) {
  const floats lowest = x - x - 87.f;
  x = x < lowest ? lowest : x;
  const floats n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f - 0.5f, ints), floats);
  const floats r = x - n * 0.693359375f + n * 2.12194440e-4f;
  floats p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const ints bits = (__builtin_convertvector(n, ints) + 127) << 23;
  floats two_to_n;
  __builtin_memcpy(&two_to_n, &bits, sizeof two_to_n);
  return p * two_to_n;
}

template <typename T, int G, int D>
void attend_group_fixed(const float* q_group, int64_t q_h, float* out_group, int64_t o_h, const T* k_head,
                        const T* v_head, int64_t k_s, int64_t v_s, const int32_t* slots, int64_t attended,
                        int64_t, int64_t, float scale, float* scores, float*) {
  constexpr int P = D / W;  // registers per head row
  floats q[G][P];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < P; ++j)
      for (int lane = 0; lane < W; ++lane) q[g][j][lane] = q_group[g * q_h + element_of<T>(j, lane)];
  floats tops[G];  // pass 1: s_t = scale q . k_t, W keys at a time, and the running max
  for (int g = 0; g < G; ++g) tops[g] = q[g][0] - q[g][0] - INFINITY;
  floats key[P];
  int64_t t = 0;
  for (; t + W <= attended; t += W) {
    floats products[G][W];
    for (int i = 0; i < W; ++i) {
      if (t + kRowsAhead + i < attended) prefetch_row<T, D>(k_head + slots[t + kRowsAhead + i] * k_s);
      load_row<T, P>(k_head + slots[t + i] * k_s, key);
      for (int g = 0; g < G; ++g) products[g][i] = row_product<P>(q[g], key);
    }
    for (int g = 0; g < G; ++g) {
      const floats score = scale * transpose_sum(products[g]);
      __builtin_memcpy(scores + g * attended + t, &score, sizeof score);
      tops[g] = tops[g] > score ? tops[g] : score;
    }
  }
  float top[G];
  for (int g = 0; g < G; ++g) top[g] = *std::max_element(&tops[g][0], &tops[g][0] + W);
  for (; t < attended; ++t) {  // the last keys, one at a time
    load_row<T, P>(k_head + slots[t] * k_s, key);
    for (int g = 0; g < G; ++g) {
      const float score = scale * lane_sum(row_product<P>(q[g], key));
      scores[g * attended + t] = score;
      top[g] = std::max(top[g], score);
    }
  }
  float inverse[G];
  for (int g = 0; g < G; ++g) {  // pass 2: e^(s_t - max), unnormalized; 1 / their sum
    float* s = scores + g * attended;
    floats sums = {};
    int64_t t = 0;
    for (; t + W <= attended; t += W) {
      const floats e = exp_lanes(load(s + t) - top[g]);
      __builtin_memcpy(s + t, &e, sizeof e);
      sums += e;
    }
    float sum = lane_sum(sums);
    for (; t < attended; ++t) sum += (s[t] = std::exp(s[t] - top[g]));
    inverse[g] = 1.f / sum;
  }
  floats acc[G][P] = {};
  for (int64_t t = 0; t < attended; ++t) {  // pass 3: sum_t e_t v_t, then scaled by 1 / sum
    if (t + kRowsAhead < attended) prefetch_row<T, D>(v_head + slots[t + kRowsAhead] * v_s);
    floats value[P];
    load_row<T, P>(v_head + slots[t] * v_s, value);
    for (int g = 0; g < G; ++g) {
      const float e = scores[g * attended + t];
      for (int j = 0; j < P; ++j) acc[g][j] += e * value[j];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < P; ++j) {
      const floats o = acc[g][j] * inverse[g];
      for (int lane = 0; lane < W; ++lane) out_group[g * o_h + element_of<T>(j, lane)] = o[lane];
    }
}

template <typename T>
using GroupKernel = decltype(&attend_group<T>);

template <typename T, int D>
GroupKernel<T> fixed_for_group(int64_t group) {
  switch (group) {
    case 1: return attend_group_fixed<T, 1, D>;
    case 2: return attend_group_fixed<T, 2, D>;
    case 3: return attend_group_fixed<T, 3, D>;
    case 4: return attend_group_fixed<T, 4, D>;
    case 5: return attend_group_fixed<T, 5, D>;
    case 6: return attend_group_fixed<T, 6, D>;
    case 7: return attend_group_fixed<T, 7, D>;
    case 8: return attend_group_fixed<T, 8, D>;
    default: return attend_group<T>;
  }
}

// The register version where one is compiled for (group, head_dim), else the generic one.
template <typename T>
GroupKernel<T> kernel_for(int64_t group, int64_t head_dim) {
  if (head_dim == 64) return fixed_for_group<T, 64>(group);
  if (head_dim == 128) return fixed_for_group<T, 128>(group);
  return attend_group<T>;
}

// A parallel region's start and join cost a few microseconds, about 2^17 multiply-adds of attention on one core
// (one row at 100 positions of SmolLM2-135M's 9 heads of 64: 115k, ~5 us on an AVX-512 core).
constexpr int64_t kSerialWork = int64_t{1} << 17;

// Every (query row, KV head) item of the batch, over threads (one thread for a batch of little work).
template <typename T>
void attend_items(const float* q, float* out, const T* keys, const T* values, const int32_t* table,
                  const int64_t* pool_of, const std::vector<int64_t>& sequence_of,
                  const std::vector<int64_t>& position_of, int64_t rows, int64_t kv_heads, int64_t group,
                  int64_t head_dim, int64_t q_r, int64_t q_h, int64_t o_r, int64_t o_h, int64_t k_s, int64_t k_h,
                  int64_t v_s, int64_t v_h, int64_t table_row, float scale) {
  const GroupKernel<T> attend = kernel_for<T>(group, head_dim);
  int64_t work = 0;  // multiply-adds of the batch: keys and values of every position a row attends, every head
  for (int64_t r = 0; r < rows; ++r) work += 2 * (position_of[r] + 1) * kv_heads * group * head_dim;
  // Below kSerialWork the threads' start and join cost more than they save: one thread does every item.
  const int64_t grain = work < kSerialWork ? std::max<int64_t>(1, rows * kv_heads) : 1;
  at::parallel_for(0, rows * kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(group * head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, kv = item % kv_heads, attended = position_of[r] + 1;
      scores.resize(group * attended);
      attend(q + r * q_r + kv * group * q_h, q_h, out + r * o_r + kv * group * o_h, o_h, keys + kv * k_h,
             values + kv * v_h, k_s, v_s, table + pool_of[sequence_of[r]] * table_row, attended, group, head_dim,
             scale, scores.data(), acc.data());
    }
  });
}

// attend_items over the caches as they are stored (float32 or bfloat16; checked by the caller).
void attend_cached(const float* q, float* out, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const int32_t* table, int64_t table_row, const int64_t* pool_of,
                   const std::vector<int64_t>& sequence_of, const std::vector<int64_t>& position_of, int64_t rows,
                   int64_t group, int64_t head_dim, int64_t q_r, int64_t q_h, int64_t o_r, int64_t o_h, float scale) {
  const int64_t kv_heads = k_cache.size(1);
  const int64_t k_s = k_cache.stride(0), k_h = k_cache.stride(1), v_s = v_cache.stride(0), v_h = v_cache.stride(1);
  if (k_cache.scalar_type() == torch::kFloat) {
    attend_items(q, out, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), table, pool_of, sequence_of,
                 position_of, rows, kv_heads, group, head_dim, q_r, q_h, o_r, o_h, k_s, k_h, v_s, v_h, table_row,
                 scale);
  } else {
    attend_items(q, out, reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
                 reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()), table, pool_of, sequence_of,
                 position_of, rows, kv_heads, group, head_dim, q_r, q_h, o_r, o_h, k_s, k_h, v_s, v_h, table_row,
                 scale);
  }
}

void check_token_table(const torch::Tensor& req_to_token) {
  TORCH_CHECK(req_to_token.scalar_type() == torch::kInt && req_to_token.dim() == 2 && req_to_token.stride(1) == 1,
              "req_to_token: int32 [requests, context]");
}

// Each query row's sequence and position: sequence b's rows are the last extend_of[b] of its length_of[b] positions
// (extend_of null: one row a sequence, a decode step's last position), in order.
void place_rows(const int64_t* length_of, const int64_t* extend_of, int64_t batch, int64_t rows,
                std::vector<int64_t>& sequence_of, std::vector<int64_t>& position_of) {
  sequence_of.resize(rows);
  position_of.resize(rows);
  int64_t row = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t extend = extend_of != nullptr ? extend_of[b] : 1;
    TORCH_CHECK(extend >= 0 && extend <= length_of[b], "extend_lens[b] must be within seq_lens[b]");
    for (int64_t i = 0; i < extend; ++i, ++row) {
      TORCH_CHECK(row < rows, "more extend tokens than query rows");
      sequence_of[row] = b;
      position_of[row] = length_of[b] - extend + i;
    }
  }
  TORCH_CHECK(row == rows, "the extend lengths must add up to the query rows");
}

}  // namespace

void paged_attention(const torch::Tensor& query, torch::Tensor& output, const torch::Tensor& k_cache,
                     const torch::Tensor& v_cache, const torch::Tensor& req_to_token,
                     const torch::Tensor& req_pool_indices, const torch::Tensor& seq_lens,
                     const torch::Tensor& extend_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && output.sizes() == query.sizes(), "query and output: [tokens, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "caches: [slots, kv_heads, head_dim]");
  TORCH_CHECK(query.scalar_type() == torch::kFloat && output.scalar_type() == torch::kFloat,
              "query and output: float32");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == torch::kFloat || k_cache.scalar_type() == torch::kBFloat16),
              "caches: both float32 or both bfloat16");
  TORCH_CHECK(query.stride(2) == 1 && output.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1,
              "head_dim must be contiguous");
  check_token_table(req_to_token);
  const auto pools = req_pool_indices.to(torch::kLong).contiguous();
  const auto lengths = seq_lens.to(torch::kLong).contiguous();
  const auto extends = extend_lens.to(torch::kLong).contiguous();
  const int64_t batch = pools.numel(), rows = query.size(0), heads = query.size(1), head_dim = query.size(2);
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads;
  TORCH_CHECK(k_cache.size(2) == head_dim && group * kv_heads == heads, "heads must be a multiple of kv_heads");
  TORCH_CHECK(lengths.numel() == batch && extends.numel() == batch, "one length and extend length per sequence");

  const int64_t* pool_of = pools.data_ptr<int64_t>();
  std::vector<int64_t> sequence_of, position_of;
  place_rows(lengths.data_ptr<int64_t>(), extends.data_ptr<int64_t>(), batch, rows, sequence_of, position_of);

  attend_cached(query.data_ptr<float>(), output.data_ptr<float>(), k_cache, v_cache, req_to_token.data_ptr<int32_t>(),
                req_to_token.stride(0), pool_of, sequence_of, position_of, rows, group, head_dim, query.stride(0),
                query.stride(1), output.stride(0), output.stride(1), static_cast<float>(scale));
}

#ifndef SGLTTS_ONE_UNIT  // policies/decode_step.cpp is compiled after this file, with a module of its own
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "causal attention of the last extend_lens tokens of each sequence, read "
        "from the paged KV pool (float32 queries; float32 or bfloat16 keys and values)");
}
#endif
