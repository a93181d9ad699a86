// Linears on quantized weights (GGUF block formats), declared for the module definition in batch_invariant.cpp:
// quant_linear (fp32 activations, exact) and q8_linear (int8 activations).
#pragma once
#include <torch/extension.h>

namespace smartspec {

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, c10::optional<torch::Tensor> sc,
                           c10::optional<torch::Tensor> off, c10::optional<torch::Tensor> mn, int64_t n,
                           int64_t group, int64_t superblock, bool nibble, c10::optional<torch::Tensor> bias);

bool q8_linear_available();

torch::Tensor q8_linear(torch::Tensor x, const std::string& kind, torch::Tensor blob, int64_t n,
                        c10::optional<torch::Tensor> bias);

}  // namespace smartspec
