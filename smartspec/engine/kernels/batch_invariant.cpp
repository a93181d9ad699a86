// Batch-invariant CPU kernels for SmartSpec.
//
// Why: BLAS picks a different blocking (and so a different summation order) for different row counts, so a
// token's logits depend on how many other tokens share its forward. Every kernel here computes each output
// element with one fixed sequence of float operations, whatever the batch, so a request's greedy output is
// bitwise the same alone, batched, or verified inside a speculative step. They also keep small-M linears on a
// weight-streaming path: the weight is read once per call for all rows, which is what makes verifying k
// tokens cost about what decoding one costs.
#include <limits>
#include <vector>

#include "panel_gemm.h"
#include "quant_linear.h"

namespace smartspec {
namespace {

#ifdef SMARTSPEC_AVX2
inline float hsum(__m256 v) {
  // Fixed pairwise order: (0+4,1+5,2+6,3+7) then (a+c, b+d) then (x+y).
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehl_ps(s, s);
  s = _mm_add_ps(s, sh);
  sh = _mm_shuffle_ps(s, s, 0x55);
  s = _mm_add_ss(s, sh);
  return _mm_cvtss_f32(s);
}
#endif

// Dot product of two length-k vectors in the one order every caller shares.
inline float dot(const float* a, const float* b, int64_t k) {
  int64_t i = 0;
  float out = 0.f;
#ifdef SMARTSPEC_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  out = hsum(acc);
#endif
  for (; i < k; ++i) out = std::fma(a[i], b[i], out);
  return out;
}

}  // namespace

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

// Attention for a packed, ragged batch of query tokens through a paged KV cache.
// q [T, H, D]; caches [num_blocks, block_size, KVH, D]; token t belongs to sequence seq_of[t], sees the keys at
// logical positions [start, kv_len[t]) of that sequence (start > 0 only under a sliding window), plus, when
// tree_mask is given, it sees position p >= tree_base[t] only if bit (p - tree_base[t]) of tree_mask[t] is set
// (a token-tree node sees its ancestors, not its siblings).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_of, torch::Tensor kv_len,
                              double scale, int64_t window, c10::optional<torch::Tensor> tree_base,
                              c10::optional<torch::Tensor> tree_mask) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32, "paged_attention is fp32 only");
  q = q.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(H % KVH == 0, "heads must be a multiple of kv heads");
  const int64_t group = H / KVH;
  auto out = torch::empty_like(q);
  auto bt = block_tables.contiguous(); auto so = seq_of.contiguous(); auto kl = kv_len.contiguous();
  const int32_t* btp = bt.data_ptr<int32_t>(); const int64_t max_blocks = bt.size(1);
  const int32_t* sop = so.data_ptr<int32_t>(); const int32_t* klp = kl.data_ptr<int32_t>();
  const int32_t* tbp = nullptr; const int64_t* tmp = nullptr;
  torch::Tensor tb, tm;
  if (tree_base.has_value() && tree_base->defined()) {
    tb = tree_base->contiguous(); tm = tree_mask->contiguous();
    tbp = tb.data_ptr<int32_t>(); tmp = tm.data_ptr<int64_t>();
  }
  const float* qp = q.data_ptr<float>(); const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>(); float* op = out.data_ptr<float>();
  const int64_t row = KVH * D, block_stride = bs * row;
  // Units of a few (token, head) pairs, handed out as threads free up (see dynamic_for).
  constexpr int64_t kPairs = 4;
  dynamic_for((T * H + kPairs - 1) / kPairs, [&](int64_t u) {
    std::vector<float> scores;
    std::vector<float> acc(D);
    for (int64_t i = u * kPairs; i < std::min(T * H, (u + 1) * kPairs); ++i) {
      const int64_t t = i / H, h = i % H, kvh = h / group;
      const int32_t* table = btp + sop[t] * max_blocks;
      const int64_t len = klp[t];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const float* qv = qp + (t * H + h) * D;
      scores.assign(len - start, 0.f);
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t p = start; p < len; ++p) {
        if (tbp && p >= tbp[t] && !((tmp[t] >> (p - tbp[t])) & 1)) { scores[p - start] = NAN; continue; }
        const float* kv = kp + table[p / bs] * block_stride + (p % bs) * row + kvh * D;
        const float s = dot(qv, kv, D) * static_cast<float>(scale);
        scores[p - start] = s;
        mx = std::max(mx, s);
      }
      float denom = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = start; p < len; ++p) {
        const float s = scores[p - start];
        if (std::isnan(s)) continue;
        const float e = std::exp(s - mx);
        denom += e;
        const float* vv = vp + table[p / bs] * block_stride + (p % bs) * row + kvh * D;
        for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(e, vv[d], acc[d]);
      }
      float* o = op + (t * H + h) * D;
      const float inv = 1.f / denom;
      for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
    }
  });
  return out;
}

}  // namespace smartspec

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace smartspec;
  m.def("pack_weight", &pack_weight, "repack [N, K] into panels");
  m.def("linear", &linear, "batch-invariant fp32 linear on a packed weight");
  m.def("quant_linear", &quant_linear, "batch-invariant linear on quantized panels, exact weight dequantization");
  m.def("q8_linear", &q8_linear, "batch-invariant linear on quantized panels, int8 activations (VNNI)");
  m.def("q8_linears", &q8_linears, "several int8-activation linears of one input in one pass (bias: empty = none)");
  m.def("q8_linear_available", &q8_linear_available, "whether this build has the int8 (VNNI) kernels");
  m.def("paged_attention", &paged_attention, "batch-invariant paged attention");
  m.def("rms_norm", &rms_norm, "RMSNorm per row, in one fixed order");
  m.def("rope_tables", &rope_tables, "cos and sin of rotary angles per position");
  m.def("q8_decoder_layer", &q8_decoder_layer, "one Llama-family decoder layer on int8-activation GGUF linears");
}
