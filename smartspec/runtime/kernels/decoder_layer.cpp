// One decoder layer of a Llama-family model (Llama, Qwen2: RMSNorm, rotary attention with grouped KV heads,
// SiLU-gated MLP) on GGUF weights with int8 activations, as one call.
//
// Why: run through transformers' modules, a decode step of the 1.5B spends about a third of its time in
// per-op dispatch (some 40 small aten ops per layer). Here the glue between the seven linears is plain loops.
// Every operation below works on one token row at a time in a fixed order (the linears and the attention are
// batch-invariant themselves), so a token's result is the same bits whatever else shares its step.
#include <cstring>
#include <vector>

#include "panel_gemm.h"
#include "quant_linear.h"
#include "vec_math.h"

namespace smartspec {
namespace {

// Rows of at least this many elements in all are shared out among threads (any split gives the same bits).
constexpr int64_t kParallelElems = 1 << 15;

template <typename Fn>
void for_rows(int64_t rows, int64_t width, const Fn& fn) {
  const int64_t grain = std::max<int64_t>(1, kParallelElems / std::max<int64_t>(1, width));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) fn(r);
  });
}

}  // namespace

// out = w * (x * rsqrt(mean(x^2) + eps)), per row, as transformers' RMSNorm orders it.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1),
              "rms_norm: x fp32 [T, D], weight [D]");
  x = x.contiguous();
  const int64_t t = x.size(0), d = x.size(1);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>(); const float* wp = w.data_ptr<float>(); float* op = out.data_ptr<float>();
  // rows 4 at a time: each row's sum of squares is one chain of adds in order, and four interleaved chains keep
  // the adder busy where one waits on each add (a verify step's 8 rows, one thread)
  constexpr int64_t kRows = 4;
  for_rows((t + kRows - 1) / kRows, kRows * d, [&](int64_t group) {
    const int64_t r0 = group * kRows, rows = std::min(kRows, t - r0);
    float sq[kRows] = {};
    for (int64_t i = 0; i < d; ++i)
      for (int64_t j = 0; j < rows; ++j) sq[j] += xp[(r0 + j) * d + i] * xp[(r0 + j) * d + i];
    for (int64_t j = 0; j < rows; ++j) {
      const float* row = xp + (r0 + j) * d;
      const float inv = 1.f / std::sqrt(sq[j] / static_cast<float>(d) + static_cast<float>(eps));
      for (int64_t i = 0; i < d; ++i) op[(r0 + j) * d + i] = wp[i] * (row[i] * inv);
    }
  });
  return out;
}

// cos and sin [T, dim/2] of each position's rotary angles position * inv_freq, times scale (transformers'
// attention_scaling); scalar math, so a position's values never depend on where its row sits.
std::vector<torch::Tensor> rope_tables(torch::Tensor positions, torch::Tensor inv_freq, double scale) {
  positions = positions.to(torch::kInt64).contiguous();
  inv_freq = inv_freq.to(torch::kFloat32).contiguous();
  const int64_t t = positions.size(0), half = inv_freq.size(0);
  auto cos = torch::empty({t, half}, inv_freq.options()), sin = torch::empty({t, half}, inv_freq.options());
  const int64_t* pp = positions.data_ptr<int64_t>(); const float* fp = inv_freq.data_ptr<float>();
  float* cp = cos.data_ptr<float>(); float* sp = sin.data_ptr<float>();
  const float s = static_cast<float>(scale);
  for (int64_t r = 0; r < t; ++r)
    for (int64_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(pp[r]) * fp[i];
      cp[r * half + i] = std::cos(angle) * s;
      sp[r * half + i] = std::sin(angle) * s;
    }
  return {cos, sin};
}

namespace {

// Rotary embedding in place on x [T, heads * dim], half-split layout (dims i and i + dim/2 rotate together);
// cos, sin [T, dim/2].
void rotate(torch::Tensor& x, int64_t heads, int64_t dim, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t t = x.size(0), half = dim / 2;
  float* xp = x.data_ptr<float>(); const float* cp = cos.data_ptr<float>(); const float* sp = sin.data_ptr<float>();
  for_rows(t, heads * dim, [&](int64_t r) {
    const float* c = cp + r * half; const float* s = sp + r * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = xp + (r * heads + h) * dim;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i] + a * s[i];
      }
    }
  });
}

// gate <- silu(gate) * up, elementwise. The width is the down projection's input, a whole number of GGUF blocks
// (32 or 256 values), so 8-lane steps cover it.
void silu_mul(torch::Tensor& gate, const torch::Tensor& up) {
  const int64_t t = gate.size(0), n = gate.size(1);
  TORCH_CHECK(n % 8 == 0, "silu_mul: width a multiple of 8");
  float* gp = gate.data_ptr<float>(); const float* up_ = up.data_ptr<float>();
  for_rows(t, n, [&](int64_t r) {
    float* g = gp + r * n; const float* u = up_ + r * n;
#ifdef SMARTSPEC_AVX2
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(g + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
#else
    for (int64_t i = 0; i < n; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
#endif
  });
}

void add_into(torch::Tensor& h, const torch::Tensor& x) {
  float* hp = h.data_ptr<float>(); const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < h.numel(); ++i) hp[i] = hp[i] + xp[i];
}

}  // namespace

// h [T, D] (updated in place) through one layer. Linears in the order q, k, v, o, gate, up, down, each a q8 blob
// with its GGUF kind, output size and bias (an empty tensor: none). The step's k/v go to the cache at `slots`;
// attention sees what paged_attention's arguments say.
void q8_decoder_layer(torch::Tensor h, torch::Tensor attn_norm, torch::Tensor mlp_norm, double eps,
                      std::vector<torch::Tensor> blobs, std::vector<std::string> kinds, std::vector<int64_t> outs,
                      std::vector<torch::Tensor> biases, int64_t heads, int64_t kv_heads, int64_t head_dim,
                      torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                      torch::Tensor slots, torch::Tensor block_tables, torch::Tensor seq_of, torch::Tensor kv_len,
                      c10::optional<torch::Tensor> tree_base, c10::optional<torch::Tensor> tree_mask) {
  TORCH_CHECK(h.dtype() == torch::kFloat32 && h.dim() == 2 && h.is_contiguous(), "q8_decoder_layer: h fp32 [T, D]");
  TORCH_CHECK(blobs.size() == 7 && kinds.size() == 7 && outs.size() == 7 && biases.size() == 7,
              "q8_decoder_layer: seven linears (q, k, v, o, gate, up, down)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(2) == kv_heads &&
              k_cache.size(3) == head_dim, "q8_decoder_layer: caches [blocks, block_size, kv_heads, head_dim]");
  // linears [i0, i1) of one input, in one pass over their weights
  auto linears = [&](const torch::Tensor& x, size_t i0, size_t i1) {
    return q8_linears(x, {kinds.begin() + i0, kinds.begin() + i1}, {blobs.begin() + i0, blobs.begin() + i1},
                      {outs.begin() + i0, outs.begin() + i1}, {biases.begin() + i0, biases.begin() + i1});
  };
  const int64_t t = h.size(0), kv_width = kv_heads * head_dim;
  torch::Tensor x = rms_norm(h, attn_norm, eps);
  auto qkv = linears(x, 0, 3);
  torch::Tensor q = qkv[0], k = qkv[1], v = qkv[2];
  rotate(q, heads, head_dim, cos, sin);
  rotate(k, kv_heads, head_dim, cos, sin);
  const int64_t* sp = slots.data_ptr<int64_t>();
  float* kc = k_cache.data_ptr<float>(); float* vc = v_cache.data_ptr<float>();
  for (int64_t r = 0; r < t; ++r) {
    std::memcpy(kc + sp[r] * kv_width, k.data_ptr<float>() + r * kv_width, kv_width * sizeof(float));
    std::memcpy(vc + sp[r] * kv_width, v.data_ptr<float>() + r * kv_width, kv_width * sizeof(float));
  }
  torch::Tensor attended = paged_attention(q.view({t, heads, head_dim}), k_cache, v_cache, block_tables, seq_of,
                                           kv_len, 1.0 / std::sqrt(static_cast<double>(head_dim)), 0, tree_base,
                                           tree_mask);
  add_into(h, linears(attended.view({t, heads * head_dim}), 3, 4)[0]);
  x = rms_norm(h, mlp_norm, eps);
  auto gate_up = linears(x, 4, 6);
  silu_mul(gate_up[0], gate_up[1]);
  add_into(h, linears(gate_up[0], 6, 7)[0]);
}

}  // namespace smartspec
