// Batch-invariant CPU kernels for SmartSpec.
//
// Why: BLAS picks a different blocking (and so a different summation order) for different row counts, so a
// token's logits depend on how many other tokens share its forward. Every kernel here computes each output
// element with one fixed sequence of float operations, whatever the batch, so a request's greedy output is
// bitwise the same alone, batched, or verified inside a speculative step. They also keep small-M linears on a
// weight-streaming path: the weight is read once per call for all rows, which is what makes verifying k
// tokens cost about what decoding one costs.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SMARTSPEC_AVX2 1
#endif

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

constexpr int64_t kPanel = 16;  // output columns per packed weight panel: two AVX2 vectors
constexpr int64_t kPrefetchRows = 32;

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

// ACC: continue the chains stored in y (a later block of k) instead of starting them at zero. Storing a float
// accumulator and loading it back changes no bit, so a chain split into k-blocks is the same chain.
template <int MR, int NP, bool ACC>
inline void micro(const float* x, int64_t ldx, int64_t k, const float* panel0, int64_t panel_stride, float* y,
                  int64_t ldy) {
#if defined(__AVX512F__)
  __m512 acc[MR][NP];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[r][p] = ACC ? _mm512_loadu_ps(y + r * ldy + p * kPanel) : _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    __m512 w[NP];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      const float* src = panel0 + p * panel_stride + i * kPanel;
      // One sequential stream per core does not saturate memory; fetching ~2 KiB ahead does.
      _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchRows * kPanel), _MM_HINT_T0);
      w[p] = _mm512_loadu_ps(src);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + i]);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ps(w[p], xv, acc[r][p]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(y + r * ldy + p * kPanel, acc[r][p]);
#elif defined(SMARTSPEC_AVX2)
  __m256 acc[MR][NP][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      acc[r][p][0] = ACC ? _mm256_loadu_ps(y + r * ldy + p * kPanel) : _mm256_setzero_ps();
      acc[r][p][1] = ACC ? _mm256_loadu_ps(y + r * ldy + p * kPanel + 8) : _mm256_setzero_ps();
    }
  for (int64_t i = 0; i < k; ++i) {
    __m256 w[NP][2];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      const float* src = panel0 + p * panel_stride + i * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchRows * kPanel), _MM_HINT_T0);
      w[p][0] = _mm256_loadu_ps(src);
      w[p][1] = _mm256_loadu_ps(src + 8);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + i);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        acc[r][p][0] = _mm256_fmadd_ps(w[p][0], xv, acc[r][p][0]);
        acc[r][p][1] = _mm256_fmadd_ps(w[p][1], xv, acc[r][p][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      _mm256_storeu_ps(y + r * ldy + p * kPanel, acc[r][p][0]);
      _mm256_storeu_ps(y + r * ldy + p * kPanel + 8, acc[r][p][1]);
    }
#else
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p)
      for (int c = 0; c < kPanel; ++c) {
        float a = ACC ? y[r * ldy + p * kPanel + c] : 0.f;
        for (int64_t i = 0; i < k; ++i) a = std::fma(panel0[p * panel_stride + i * kPanel + c], x[r * ldx + i], a);
        y[r * ldy + p * kPanel + c] = a;
      }
#endif
}

using MicroFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t);

// Tiles fill the vector registers with accumulators (AVX-512: 24 of 32, AVX2: 12 of 16 ymm pairs). Few rows
// take many panels at once, which also gives a single-token decode several independent weight streams.
#if defined(__AVX512F__)
constexpr int kMaxRows = 8;
template <int MR> constexpr int panels_for() { return MR == 1 ? 8 : (MR == 2 ? 6 : (MR <= 4 ? 4 : (MR <= 6 ? 4 : 3))); }
#else
constexpr int kMaxRows = 6;
template <int MR> constexpr int panels_for() { return MR == 1 ? 6 : (MR == 2 ? 3 : (MR == 3 ? 2 : 1)); }
#endif

template <int MR, bool ACC>
void run_rows(const float* x, int64_t ldx, int64_t k, const float* packed, int64_t panel_stride, float* y,
              int64_t ldy, int64_t p0, int64_t p1) {
  constexpr int NP = panels_for<MR>();
  static const MicroFn tail[8] = {micro<MR, 1, ACC>, micro<MR, 1, ACC>, micro<MR, (2 <= NP ? 2 : 1), ACC>,
                                  micro<MR, (3 <= NP ? 3 : 1), ACC>, micro<MR, (4 <= NP ? 4 : 1), ACC>,
                                  micro<MR, (5 <= NP ? 5 : 1), ACC>, micro<MR, (6 <= NP ? 6 : 1), ACC>,
                                  micro<MR, (7 <= NP ? 7 : 1), ACC>};
  int64_t p = p0;
  for (; p + NP <= p1; p += NP)
    micro<MR, NP, ACC>(x, ldx, k, packed + p * panel_stride, panel_stride, y + p * kPanel, ldy);
  for (; p < p1;) {
    const int64_t np = std::min<int64_t>(p1 - p, NP > 7 ? 7 : NP);
    tail[np](x, ldx, k, packed + p * panel_stride, panel_stride, y + p * kPanel, ldy);
    p += np;
  }
}

// Runs fn(u) for u in [0, units) on torch's threads, handing units out one at a time: a thread the OS preempts
// (two cores shared with Ray's processes) holds back only the unit it is in, not a fixed half of the work.
// Which thread computes a unit never changes its bits.
template <typename Fn>
void dynamic_for(int64_t units, const Fn& fn) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(units, at::get_num_threads()));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t u = next.fetch_add(1, std::memory_order_relaxed); u < units;
         u = next.fetch_add(1, std::memory_order_relaxed))
      fn(u);
  });
}

}  // namespace

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
  using RowsFn = decltype(&run_rows<1, false>);
  static const RowsFn by_rows[2][9] = {
      {nullptr, run_rows<1, false>, run_rows<2, false>, run_rows<3, false>, run_rows<4, false>, run_rows<5, false>,
       run_rows<6, false>, run_rows<(7 <= kMaxRows ? 7 : 1), false>, run_rows<(8 <= kMaxRows ? 8 : 1), false>},
      {nullptr, run_rows<1, true>, run_rows<2, true>, run_rows<3, true>, run_rows<4, true>, run_rows<5, true>,
       run_rows<6, true>, run_rows<(7 <= kMaxRows ? 7 : 1), true>, run_rows<(8 <= kMaxRows ? 8 : 1), true>}};
  // A work unit is a chunk of panels for every row, so each panel is streamed once and stays in L2 while every
  // row block uses it. With more rows than one block, k is cut into blocks so the chunk's slice (about 1 MiB)
  // fits L2 even for a long k (the 8960-wide down projection); a few rows stream the whole of k instead.
  const int64_t kblock = m > kMaxRows ? std::min<int64_t>(k, 2048) : k;
  const int64_t chunk = std::max<int64_t>(8, (int64_t(1) << 20) / (kblock * kPanel * int64_t(sizeof(float))) / 8 * 8);
  dynamic_for((panels + chunk - 1) / chunk, [&](int64_t u) {
    const int64_t c0 = u * chunk, c1 = std::min(panels, c0 + chunk);
    for (int64_t k0 = 0; k0 < k; k0 += kblock) {
      const int64_t kb = std::min(kblock, k - k0);
      for (int64_t r = 0; r < m; r += kMaxRows) {
        const int64_t mr = std::min<int64_t>(kMaxRows, m - r);
        by_rows[k0 > 0][mr](xp + r * k + k0, k, kb, wp + k0 * kPanel, ps, yp + r * ldy, ldy, c0, c1);
      }
    }
  });
  if (ldy != n) y = y.narrow(1, 0, n).contiguous();
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, "repack [N, K] into panels");
  m.def("linear", &linear, "batch-invariant fp32 linear on a packed weight");
  m.def("paged_attention", &paged_attention, "batch-invariant paged attention");
}
