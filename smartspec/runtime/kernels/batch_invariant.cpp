// Batch-invariant CPU kernels for SmartSpec.
//
// Why: BLAS picks a different blocking (and so a different summation order) for different row counts, so a
// token's logits depend on how many other tokens share its forward. Every kernel here computes each output
// element with one fixed sequence of float operations, whatever the batch, so a request's greedy output is
// bitwise the same alone, batched, or verified inside a speculative step. They also keep small-M linears on a
// weight-streaming path: the weight is read once per call for all rows, which is what makes verifying k
// tokens cost about what decoding one costs.
#include "panel_gemm.h"
#include "quant_linear.h"

namespace smartspec {

// The weight of a linear layer, repacked once at load as panels [N/16, K, 16]: panel p holds columns
// 16p..16p+15, row k of the panel holds w[16p + c, k] for c in 0..15. Output element (m, n) is then one scalar
// FMA chain over k in increasing order (in lane n % 16), whatever the tiling, the row count or the vector
// width, so every code path below (and the scalar fallback) produces the same bits.
torch::Tensor pack_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.dtype() == torch::kFloat32, "pack_weight: fp32 [N, K]");
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

// y [M, N] = x [M, K] @ w.T + bias, with w given packed by pack_weight.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && packed.dtype() == torch::kFloat32, "batch-invariant linear is fp32 only");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kPanel && x.size(1) == packed.size(1),
              "linear: x [M, K], packed weight [N/16, K, 16]");
  TORCH_CHECK(packed.is_contiguous(), "linear: packed weight must be contiguous");
  x = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0), ldy = panels * kPanel;
  auto y = torch::empty({m, ldy}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ps = k * kPanel;
  // A work unit is a chunk of panels for every row, so each panel is streamed once and stays in L2 while every
  // row block uses it. With more rows than one block, k is cut into blocks so the chunk's slice (about 1 MiB)
  // fits L2 even for a long k (the 8960-wide down projection); a few rows stream the whole of k instead.
  const int64_t kblock = m > kMaxRows ? std::min<int64_t>(k, 2048) : k;
  const int64_t chunk = std::max<int64_t>(8, (int64_t(1) << 20) / (kblock * kPanel * int64_t(sizeof(float))) / 8 * 8);
  dynamic_for((panels + chunk - 1) / chunk, [&](int64_t u) {
    const int64_t c0 = u * chunk, c1 = std::min(panels, c0 + chunk);
    for (int64_t k0 = 0; k0 < k; k0 += kblock)
      panel_gemm(xp + k0, m, k, std::min(kblock, k - k0), wp + k0 * kPanel, ps, yp, ldy, c0, c1, k0 > 0);
  });
  return finish_linear(y, n, bias);
}

}  // namespace smartspec

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace smartspec;
  // The kernels touch no Python object: other Python threads (a server's event loop streaming the last step's
  // tokens) run while they compute, instead of stalling the step between two kernel calls.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("pack_weight", &pack_weight, "repack [N, K] into panels", nogil);
  m.def("linear", &linear, "batch-invariant fp32 linear on a packed weight", nogil);
  m.def("quant_linear", &quant_linear, "batch-invariant linear on quantized panels, exact weight dequantization", nogil);
  m.def("q8_linear", &q8_linear, "batch-invariant linear on quantized panels, int8 activations (VNNI)", nogil);
  m.def("q8_linears", &q8_linears, "several int8-activation linears of one input in one pass (bias: empty = none)", nogil);
  m.def("q8_linear_available", &q8_linear_available, "whether this build has the int8 (VNNI) kernels", nogil);
  m.def("paged_attention", &paged_attention, "batch-invariant paged attention", nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm per row, in one fixed order", nogil);
  m.def("rope_tables", &rope_tables, "cos and sin of rotary angles per position", nogil);
  m.def("q8_decoder_layer", &q8_decoder_layer, "one Llama-family decoder layer on int8-activation GGUF linears", nogil);
}
