// A Llama decode step whose every projection reads its weight from a 4- or 8-bit grid, as one call: the loop of
// policies/lean_decode.py (its docstring has the arithmetic) over the same kernels, without a Python call between
// them but a layer's capture (the probe's residual, policies/probe_readout.py). At the 1-32 rows of a search's step
// the lean step's ~14 Python calls a layer (the kernels' and torch's dispatch, tensor views, attribute reads) cost
// about as much as its arithmetic; here they are C++ calls.
//
// policies/lean_decode.py compiles this file after policies/cpu_layers.cpp, policies/paged_attention.cpp and
// policies/grid_linear.cpp in one translation unit (their modules left out by SGLTTS_ONE_UNIT), with OpenMP, and
// calls the same functions they export, in the same order, on the same inputs: the same hidden states (one sequence
// at a time, the tiny model's logprobs are the Python loop's to the bit: tests/test_lean_decode.py).

#include <pybind11/functional.h>

#include <algorithm>
#include <functional>

namespace {

// y = x W^T (+ bias) for a weight kept on its grid (cpu_linear.grid_tiles).
struct GridProduct {
  torch::Tensor packed, scales, bias;  // bias: undefined when the layer has none
  int64_t bits;

  torch::Tensor operator()(const torch::Tensor& x) const {
    const auto rows = x.contiguous();
    auto y = bits == 4 ? grid_linear<4>(rows, packed, scales) : grid_linear<8>(rows, packed, scales);
    return bias.defined() ? y + bias : y;
  }
};

struct Layer {
  torch::Tensor norm_in, norm_post;
  double eps_in, eps_post;
  GridProduct qkv, o, gate_up, down;
  torch::Tensor cos_sin_cache;
  int64_t head_size;
  bool neox;
  torch::Tensor k_cache, v_cache;  // the layer's slots in the paged KV pool [slots, kv_heads, head_dim]
  int64_t q_heads, kv_heads, head_dim;
  double scaling;
};

GridProduct grid_product(torch::Tensor packed, torch::Tensor scales, std::optional<torch::Tensor> bias) {
  const int64_t bits = scales.dim() == 4 ? 4 : 8;  // the 4-bit grid keeps d and m a group, the 8-bit one d
  return GridProduct{std::move(packed), std::move(scales), bias.value_or(torch::Tensor()), bits};
}

}  // namespace

class DecodeStep {
 public:
  DecodeStep(torch::Tensor final_norm, double final_eps) : final_norm_(std::move(final_norm)), final_eps_(final_eps) {}

  // One decoder layer, in order: its norms, its four products' tiles (and biases), its rotary embedding and its
  // KV pool buffers.
  void add_layer(torch::Tensor norm_in, double eps_in, torch::Tensor norm_post, double eps_post,
                 std::vector<torch::Tensor> packed, std::vector<torch::Tensor> scales,
                 std::vector<std::optional<torch::Tensor>> biases, torch::Tensor cos_sin_cache, int64_t head_size,
                 bool neox, torch::Tensor k_cache, torch::Tensor v_cache, int64_t q_heads, int64_t kv_heads,
                 int64_t head_dim, double scaling) {
    TORCH_CHECK(packed.size() == 4 && scales.size() == 4 && biases.size() == 4,
                "a layer has four products: qkv, o, gate_up, down");
    TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "the key and value caches share a dtype");
    layers_.push_back(Layer{std::move(norm_in), std::move(norm_post), eps_in, eps_post,
                            grid_product(packed[0], scales[0], biases[0]),
                            grid_product(packed[1], scales[1], biases[1]),
                            grid_product(packed[2], scales[2], biases[2]),
                            grid_product(packed[3], scales[3], biases[3]),
                            std::move(cos_sin_cache), head_size, neox, std::move(k_cache), std::move(v_cache), q_heads,
                            kv_heads, head_dim, scaling});
  }

  // hidden [B, H]: the embedded tokens; one token a sequence at positions [B]; its K and V written to the pool's
  // slots out_cache_loc [B]; capture(i, residual) called at the entry of each layer i in capture_layers (with the
  // Python interpreter's lock, which the step otherwise leaves to other threads). Returns the final norm's output
  // [B, H].
  torch::Tensor forward(torch::Tensor hidden, const torch::Tensor& positions, const torch::Tensor& out_cache_loc,
                        const torch::Tensor& req_to_token, const torch::Tensor& req_pool_indices,
                        const torch::Tensor& seq_lens, const std::vector<int64_t>& capture_layers,
                        const std::function<void(int64_t, torch::Tensor)>& capture) const {
    const auto one_token_each = torch::ones_like(seq_lens);
    const auto slots = out_cache_loc.to(torch::kLong);
    torch::Tensor residual, x;
    for (int64_t index = 0; index < static_cast<int64_t>(layers_.size()); ++index) {
      const Layer& layer = layers_[index];
      if (!residual.defined()) {
        residual = hidden;
        x = rms_norm(hidden, layer.norm_in, layer.eps_in);
      } else {
        auto normed = add_rms_norm(hidden, residual, layer.norm_in, layer.eps_in);
        x = normed[0];
        residual = normed[1];
      }
      if (std::find(capture_layers.begin(), capture_layers.end(), index) != capture_layers.end()) {
        capture(index, residual);  // pybind11's wrapper of a Python callable takes the lock for the call
      }
      const int64_t q_size = layer.q_heads * layer.head_dim, kv_size = layer.kv_heads * layer.head_dim;
      auto qkv = layer.qkv(x).split_with_sizes({q_size, kv_size, kv_size}, -1);
      auto rotated = rotary(positions, qkv[0], qkv[1], layer.cos_sin_cache, layer.head_size, layer.neox);
      auto k = rotated[1].view({-1, layer.kv_heads, layer.head_dim});
      auto v = qkv[2].reshape({-1, layer.kv_heads, layer.head_dim});
      layer.k_cache.index_put_({slots}, k.to(layer.k_cache.scalar_type()));
      layer.v_cache.index_put_({slots}, v.to(layer.v_cache.scalar_type()));
      auto q = rotated[0].view({-1, layer.q_heads, layer.head_dim});
      auto attended = torch::empty_like(q);
      paged_attention(q, attended, layer.k_cache, layer.v_cache, req_to_token, req_pool_indices, seq_lens,
                      one_token_each, layer.scaling);
      hidden = layer.o(attended.view({q.size(0), -1}));
      auto normed = add_rms_norm(hidden, residual, layer.norm_post, layer.eps_post);
      residual = normed[1];
      auto gate_up = layer.gate_up(normed[0]).chunk(2, -1);
      hidden = layer.down(torch::silu(gate_up[0]) * gate_up[1]);
    }
    return add_rms_norm(hidden, residual, final_norm_, final_eps_)[0];
  }

 private:
  std::vector<Layer> layers_;
  torch::Tensor final_norm_;
  double final_eps_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodeStep>(m, "DecodeStep")
      .def(pybind11::init<torch::Tensor, double>())
      .def("add_layer", &DecodeStep::add_layer)
      .def("forward", &DecodeStep::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
