// Linears on quantized weights (GGUF block formats), declared for the module definition in batch_invariant.cpp:
// quant_linear (fp32 activations, exact) and q8_linear (int8 activations); paged attention (attention.cpp); and a
// whole decoder layer on the latter (decoder_layer.cpp).
#pragma once
#include <torch/extension.h>

namespace smartspec {

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, c10::optional<torch::Tensor> sc,
                           c10::optional<torch::Tensor> off, c10::optional<torch::Tensor> mn, int64_t n,
                           int64_t group, int64_t superblock, bool nibble, c10::optional<torch::Tensor> bias);

bool q8_linear_available();

torch::Tensor q8_linear(torch::Tensor x, const std::string& kind, torch::Tensor blob, int64_t n,
                        c10::optional<torch::Tensor> bias);

// Several linears of one input in one call (q, k and v; gate and up): each output bitwise q8_linear's.
std::vector<torch::Tensor> q8_linears(torch::Tensor x, const std::vector<std::string>& kinds,
                                      const std::vector<torch::Tensor>& blobs, const std::vector<int64_t>& outs,
                                      const std::vector<torch::Tensor>& biases);

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_of, torch::Tensor kv_len,
                              double scale, int64_t window, c10::optional<torch::Tensor> tree_base,
                              c10::optional<torch::Tensor> tree_mask);

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);

std::vector<torch::Tensor> rope_tables(torch::Tensor positions, torch::Tensor inv_freq, double scale);

void q8_decoder_layer(torch::Tensor h, torch::Tensor attn_norm, torch::Tensor mlp_norm, double eps,
                      std::vector<torch::Tensor> blobs, std::vector<std::string> kinds, std::vector<int64_t> outs,
                      std::vector<torch::Tensor> biases, int64_t heads, int64_t kv_heads, int64_t head_dim,
                      torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                      torch::Tensor slots, torch::Tensor block_tables, torch::Tensor seq_of, torch::Tensor kv_len,
                      c10::optional<torch::Tensor> tree_base, c10::optional<torch::Tensor> tree_mask);

}  // namespace smartspec
