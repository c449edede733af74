// A Llama decode step (or extend: each request's new tokens after its cached prefix) whose every projection reads its
// weight from a 4- or 8-bit grid, as one call: the loop of policies/lean_decode.py (its docstring has the arithmetic)
// over the same kernels, without a Python call between them but a layer's capture (the probe's residual,
// policies/probe_readout.py). At the 1-32 rows of a search's step the lean step's ~14 Python calls a layer (the
// kernels' and torch's dispatch, tensor views, attribute reads) cost about as much as its arithmetic; here they are C++
// calls, and the step's buffers are allocated once a step and written in place: the residual and norms a row at a time
// (rms_norm_row), q and k rotated in place (rotate_head), K and V copied to their pool slots, the products into their
// outputs (grid_product), attention over the pool (attend_cached), silu(gate) * up as two ATen calls on views (torch's
// own arithmetic for them).
//
// Above `grid_rows` rows (a search's 128-row batches) each product runs on AMX's tiles where the step was built for
// them, its weight unpacked from the same grid into bf16 a chunk at a time (policies/amx_linear.cpp, the decoder
// layers' product of the Python loop too), so a step of any size is one call on a CPU with AMX.
//
// policies/lean_decode.py compiles this file after policies/cpu_layers.cpp, policies/paged_attention.cpp,
// policies/grid_linear.cpp and policies/amx_linear.cpp in one translation unit (their modules left out by
// SGLTTS_ONE_UNIT), with OpenMP: the row functions are theirs, in the Python loop's order, on the same inputs, so
// one sequence at a time the tiny model's logprobs are the Python loop's to the bit (tests/test_lean_decode.py).

#include <pybind11/functional.h>

#include <algorithm>
#include <functional>
#include <optional>

namespace {

// y = x W^T (+ bias) for a weight kept on its grid (cpu_linear.grid_tiles), into y's rows; above `grid_rows` rows
// on AMX's tiles where `on_amx`.
struct GridProduct {
  torch::Tensor packed, scales, bias;  // bias: undefined when the layer has none
  int64_t bits, columns, outputs;
  bool on_amx;  // false: the grid kernel at every row count

  void operator()(const float* x, int64_t rows, float* y, int64_t grid_rows) const {
    if (on_amx && rows > grid_rows) {
      amx_grid_into(x, rows, columns, packed, scales, y);
    } else if (bits == 4) {
      grid_product<4>(x, rows, columns, packed.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), packed.size(0), y);
    } else {
      grid_product<8>(x, rows, columns, packed.data_ptr<int8_t>(), scales.data_ptr<at::Half>(), packed.size(0), y);
    }
    if (bias.defined()) {
      const float* b = bias.data_ptr<float>();
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < outputs; ++i) y[r * outputs + i] += b[i];
    }
  }
};

GridProduct grid_product_of(torch::Tensor packed, torch::Tensor scales, std::optional<torch::Tensor> bias,
                            bool on_amx, int64_t columns) {
  const int64_t bits = scales.dim() == 4 ? 4 : 8;  // the 4-bit grid keeps d and m a group, the 8-bit one d
  TORCH_CHECK(packed.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == torch::kHalf &&
                  columns % kGroup == 0 && scales.size(1) == columns / kGroup,
              "a grid's tiles: contiguous, float16 scales, K a multiple of 32");
  if (bits == 4) check_grid<4>(packed, scales, columns); else check_grid<8>(packed, scales, columns);
  const int64_t outputs = packed.size(0) * kLanes;
  auto b = bias.value_or(torch::Tensor());
  TORCH_CHECK(!b.defined() || (b.scalar_type() == torch::kFloat && b.is_contiguous() && b.numel() == outputs),
              "a bias: float32 [N]");
  TORCH_CHECK(!on_amx || amx_usable(), "products on AMX's tiles in a build or process without them");
  return GridProduct{std::move(packed), std::move(scales), b, bits, columns, outputs, on_amx};
}

struct Layer {
  torch::Tensor norm_in, norm_post;
  float eps_in, eps_post;
  GridProduct qkv, o, gate_up, down;
  torch::Tensor cos_sin_cache;
  int64_t head_size;
  bool neox;
  torch::Tensor k_cache, v_cache;  // the layer's slots in the paged KV pool [slots, kv_heads, head_dim]
  int64_t q_heads, kv_heads, head_dim;
  float scaling;
  std::vector<torch::Tensor> weights;  // the projections' own weights, whose identity `current` checks
  std::vector<std::pair<const void*, int64_t>> identity;
};

std::vector<std::pair<const void*, int64_t>> identity_of(const std::vector<torch::Tensor>& weights) {
  std::vector<std::pair<const void*, int64_t>> identity;
  for (const auto& weight : weights) identity.emplace_back(weight.data_ptr(), weight._version());
  return identity;
}

// The new K or V of each row, [kv_heads * head_dim] floats from `from` (row stride `stride`), to the pool's slot.
template <typename T>
void write_slots(const float* from, int64_t stride, const int64_t* slots, int64_t rows, T* pool, int64_t slot_stride,
                 int64_t width) {
  for (int64_t r = 0; r < rows; ++r) {
    T* to = pool + slots[r] * slot_stride;
    for (int64_t i = 0; i < width; ++i) to[i] = static_cast<T>(from[r * stride + i]);  // bf16: nearest, ties even
  }
}

void write_kv(const float* from, int64_t stride, const int64_t* slots, int64_t rows, const torch::Tensor& cache,
              int64_t width) {
  if (cache.scalar_type() == torch::kFloat) {
    write_slots(from, stride, slots, rows, cache.data_ptr<float>(), cache.stride(0), width);
  } else {
    write_slots(from, stride, slots, rows, cache.data_ptr<at::BFloat16>(), cache.stride(0), width);
  }
}

}  // namespace

class DecodeStep {
 public:
  DecodeStep(torch::Tensor final_norm, double final_eps)
      : final_norm_(std::move(final_norm)), final_eps_(static_cast<float>(final_eps)) {}

  // One decoder layer, in order: its norms, its four products' tiles (and biases), whether they run on AMX above
  // the grids' rows, their weights, its rotary embedding and its KV pool buffers.
  void add_layer(torch::Tensor norm_in, double eps_in, torch::Tensor norm_post, double eps_post,
                 std::vector<torch::Tensor> packed, std::vector<torch::Tensor> scales,
                 std::vector<std::optional<torch::Tensor>> biases, bool on_amx,
                 std::vector<torch::Tensor> weights,
                 torch::Tensor cos_sin_cache, int64_t head_size, bool neox, torch::Tensor k_cache,
                 torch::Tensor v_cache, int64_t q_heads, int64_t kv_heads, int64_t head_dim, double scaling) {
    TORCH_CHECK(packed.size() == 4 && scales.size() == 4 && biases.size() == 4,
                "a layer has four products: qkv, o, gate_up, down");
    TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.dim() == 3 && k_cache.stride(2) == 1 &&
                    k_cache.stride(1) == head_dim && v_cache.stride(1) == head_dim && k_cache.size(1) == kv_heads &&
                    (k_cache.scalar_type() == torch::kFloat || k_cache.scalar_type() == torch::kBFloat16),
                "the key and value caches: float32 or bfloat16 [slots, kv_heads, head_dim], a slot's heads in a row");
    check_norm(norm_in);
    check_norm(norm_post);
    TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.scalar_type() == torch::kFloat &&
                    cos_sin_cache.is_contiguous() && cos_sin_cache.size(1) % 2 == 0 &&
                    cos_sin_cache.size(1) <= head_size && head_size == head_dim,
                "cos_sin_cache: float32 [max_position, rotary_dim], rotary_dim even and at most head_dim");
    const int64_t hidden = norm_in.size(0), q_size = q_heads * head_dim, kv_size = kv_heads * head_dim;
    auto qkv = grid_product_of(packed[0], scales[0], biases[0], on_amx, hidden);
    auto o = grid_product_of(packed[1], scales[1], biases[1], on_amx, q_size);
    auto gate_up = grid_product_of(packed[2], scales[2], biases[2], on_amx, hidden);
    auto down = grid_product_of(packed[3], scales[3], biases[3], on_amx, gate_up.outputs / 2);
    TORCH_CHECK(qkv.outputs == q_size + 2 * kv_size && o.outputs == hidden && down.outputs == hidden &&
                    gate_up.outputs % 2 == 0 && q_heads % kv_heads == 0,
                "the products' shapes: qkv [q + 2 kv, H], o [H, q], gate_up [2 I, H], down [H, I]");
    TORCH_CHECK(layers_.empty() || hidden == layers_[0].norm_in.size(0), "every layer has the same hidden size");
    auto identity = identity_of(weights);
    layers_.push_back(Layer{std::move(norm_in), std::move(norm_post), static_cast<float>(eps_in),
                            static_cast<float>(eps_post), std::move(qkv), std::move(o), std::move(gate_up),
                            std::move(down), std::move(cos_sin_cache), head_size, neox, std::move(k_cache),
                            std::move(v_cache), q_heads, kv_heads, head_dim, static_cast<float>(scaling),
                            std::move(weights), std::move(identity)});
  }

  // Whether every projection's weight is the one the step was built from (same storage, not changed in place).
  bool current() const {
    for (const auto& layer : layers_)
      for (size_t i = 0; i < layer.weights.size(); ++i)
        if (layer.weights[i].data_ptr() != layer.identity[i].first ||
            layer.weights[i]._version() != layer.identity[i].second)
          return false;
    return true;
  }

  // hidden [T, H]: the embedded tokens, at positions [T]; their K and V written to the pool's slots out_cache_loc
  // [T]. A decode step (extend_lens none): one token a request, its last position; an extend: request b's last
  // extend_lens[b] positions, its new tokens, in order. capture(i, residual) is called at the entry of each layer i
  // in capture_layers (with the Python interpreter's lock, which the step otherwise leaves to other threads; the
  // residual is a copy). Returns the final norm's output [T, H]. The step's buffers are allocated once a call and
  // written in place; the arithmetic is the kernels' of the Python loop (policies/lean_decode.py), in its order.
  torch::Tensor forward(torch::Tensor hidden, const torch::Tensor& positions, const torch::Tensor& out_cache_loc,
                        const torch::Tensor& req_to_token, const torch::Tensor& req_pool_indices,
                        const torch::Tensor& seq_lens, const std::optional<torch::Tensor>& extend_lens,
                        const std::vector<int64_t>& capture_layers,
                        const std::function<void(int64_t, torch::Tensor)>& capture, int64_t grid_rows) const {
    TORCH_CHECK(!layers_.empty(), "a step without layers");
    const Layer& first = layers_[0];
    const int64_t rows = hidden.size(0), width = first.norm_in.size(0);
    TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == torch::kFloat && hidden.size(1) == width,
                "hidden: float32 [B, H]");
    check_token_table(req_to_token);
    const auto at_positions = positions.to(torch::kLong).contiguous();
    const auto slots = out_cache_loc.to(torch::kLong).contiguous();
    const auto pools = req_pool_indices.to(torch::kLong).contiguous();
    const auto lengths = seq_lens.to(torch::kLong).contiguous();
    const auto extends = extend_lens.has_value() ? extend_lens->to(torch::kLong).contiguous() : torch::Tensor();
    const int64_t batch = pools.numel();
    TORCH_CHECK(at_positions.numel() == rows && slots.numel() == rows, "one position and slot a row");
    TORCH_CHECK(lengths.numel() == batch && (extends.defined() ? extends.numel() == batch : batch == rows),
                "one length (and extend length) a request; a decode step's request a row");
    const int64_t* position = at_positions.data_ptr<int64_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    std::vector<int64_t> sequence_of, position_of;
    place_rows(lengths.data_ptr<int64_t>(), extends.defined() ? extends.data_ptr<int64_t>() : nullptr, batch, rows,
               sequence_of, position_of);
    for (const auto& layer : layers_)
      for (int64_t r = 0; r < rows; ++r)
        TORCH_CHECK(position[r] >= 0 && position[r] < layer.cos_sin_cache.size(0), "a position past the cos_sin_cache");

    const auto options = hidden.options();
    const int64_t q_size = first.q_heads * first.head_dim, kv_size = first.kv_heads * first.head_dim;
    const int64_t qkv_width = first.qkv.outputs, mlp = first.gate_up.outputs / 2;
    auto residual = torch::empty({rows, width}, options), normed = torch::empty({rows, width}, options);
    auto qkv = torch::empty({rows, qkv_width}, options), attended = torch::empty({rows, q_size}, options);
    auto projected = torch::empty({rows, width}, options), gate_up = torch::empty({rows, 2 * mlp}, options);
    auto activated = torch::empty({rows, mlp}, options);
    float* r_ = residual.data_ptr<float>();
    float* x_ = normed.data_ptr<float>();
    float* qkv_ = qkv.data_ptr<float>();
    float* att_ = attended.data_ptr<float>();
    float* h_ = projected.data_ptr<float>();
    const auto input = hidden.contiguous();
    std::copy(input.data_ptr<float>(), input.data_ptr<float>() + rows * width, r_);
    const auto gate = gate_up.narrow(1, 0, mlp), up = gate_up.narrow(1, mlp, mlp);

    for (int64_t index = 0; index < static_cast<int64_t>(layers_.size()); ++index) {
      const Layer& layer = layers_[index];
      // x = norm_in(h + r), r = h + r (at the first layer r is the embedding and there is nothing to add)
      for (int64_t r = 0; r < rows; ++r) {
        float* row = r_ + r * width;
        if (index > 0) add_row(h_ + r * width, row, width);
        rms_norm_row(row, layer.norm_in.data_ptr<float>(), x_ + r * width, width, layer.eps_in);
      }
      if (std::find(capture_layers.begin(), capture_layers.end(), index) != capture_layers.end()) {
        capture(index, residual.clone());  // pybind11's wrapper of a Python callable takes the lock for the call
      }
      layer.qkv(x_, rows, qkv_, grid_rows);
      const int64_t rotary_dim = layer.cos_sin_cache.size(1);
      const float* angles = layer.cos_sin_cache.data_ptr<float>();
      for (int64_t r = 0; r < rows; ++r) {  // q and k rotated in place (rotate_head reads a pair, then writes it)
        const float* cos = angles + position[r] * rotary_dim;
        const float* sin = cos + rotary_dim / 2;
        float* row = qkv_ + r * qkv_width;
        for (int64_t h = 0; h < layer.q_heads + layer.kv_heads; ++h)
          rotate_head(row + h * layer.head_size, row + h * layer.head_size, cos, sin, layer.head_size, rotary_dim,
                      layer.neox);
      }
      write_kv(qkv_ + q_size, qkv_width, slot, rows, layer.k_cache, kv_size);
      write_kv(qkv_ + q_size + kv_size, qkv_width, slot, rows, layer.v_cache, kv_size);
      attend_cached(qkv_, att_, layer.k_cache, layer.v_cache, req_to_token.data_ptr<int32_t>(),
                    req_to_token.stride(0), pools.data_ptr<int64_t>(), sequence_of, position_of, rows,
                    layer.q_heads / layer.kv_heads, layer.head_dim, qkv_width, layer.head_dim, q_size,
                    layer.head_dim, layer.scaling);
      layer.o(att_, rows, h_, grid_rows);
      for (int64_t r = 0; r < rows; ++r) {  // x = norm_post(h + r), r = h + r
        float* row = r_ + r * width;
        add_row(h_ + r * width, row, width);
        rms_norm_row(row, layer.norm_post.data_ptr<float>(), x_ + r * width, width, layer.eps_post);
      }
      layer.gate_up(x_, rows, gate_up.data_ptr<float>(), grid_rows);
      at::silu_out(activated, gate);
      activated.mul_(up);
      layer.down(activated.data_ptr<float>(), rows, h_, grid_rows);
    }
    auto out = torch::empty({rows, width}, options);
    for (int64_t r = 0; r < rows; ++r) {
      float* row = r_ + r * width;
      add_row(h_ + r * width, row, width);
      rms_norm_row(row, final_norm_.data_ptr<float>(), out.data_ptr<float>() + r * width, width, final_eps_);
    }
    return out;
  }

 private:
  // row = h + row: the sum add_rms_norm forms (x + residual), in place.
  static void add_row(const float* h, float* row, int64_t width) {
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) row[i] = h[i] + row[i];
  }

  static void check_norm(const torch::Tensor& weight) {
    TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == torch::kFloat && weight.is_contiguous(),
                "a norm's weight: float32 [H] contiguous");
  }

  std::vector<Layer> layers_;
  torch::Tensor final_norm_;
  float final_eps_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodeStep>(m, "DecodeStep")
      .def(pybind11::init<torch::Tensor, double>())
      .def("add_layer", &DecodeStep::add_layer)
      .def("current", &DecodeStep::current)
      .def("forward", &DecodeStep::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
