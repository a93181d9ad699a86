// The panel GEMM shared by the fp32 and the quantized linears: weights as panels [N/16, K, 16], each output
// element one FMA chain over k in increasing order, whatever the number of rows, the tiling or the vector width.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SMARTSPEC_AVX2 1
#endif

namespace smartspec {

constexpr int64_t kPanel = 16;  // output columns per packed weight panel: two AVX2 vectors
constexpr int64_t kPrefetchRows = 32;

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

using RowsFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t, int64_t, int64_t);

// Every row of x [m, k-block kb] against panels [c0, c1) of a weight whose panel stride is ps; cont: the chains go
// on from y (a later k-block), else they start at zero.
inline void panel_gemm(const float* x, int64_t m, int64_t ldx, int64_t kb, const float* w, int64_t ps, float* y,
                       int64_t ldy, int64_t c0, int64_t c1, bool cont) {
  static const RowsFn by_rows[2][9] = {
      {nullptr, run_rows<1, false>, run_rows<2, false>, run_rows<3, false>, run_rows<4, false>, run_rows<5, false>,
       run_rows<6, false>, run_rows<(7 <= kMaxRows ? 7 : 1), false>, run_rows<(8 <= kMaxRows ? 8 : 1), false>},
      {nullptr, run_rows<1, true>, run_rows<2, true>, run_rows<3, true>, run_rows<4, true>, run_rows<5, true>,
       run_rows<6, true>, run_rows<(7 <= kMaxRows ? 7 : 1), true>, run_rows<(8 <= kMaxRows ? 8 : 1), true>}};
  for (int64_t r = 0; r < m; r += kMaxRows) {
    const int64_t mr = std::min<int64_t>(kMaxRows, m - r);
    by_rows[cont][mr](x + r * ldx, ldx, kb, w, ps, y + r * ldy, ldy, c0, c1);
  }
}

// The padded output [M, panels * 16] cut to n columns, plus the bias: how every panel linear ends.
inline torch::Tensor finish_linear(torch::Tensor y, int64_t n, const c10::optional<torch::Tensor>& bias) {
  if (y.size(1) != n) y = y.narrow(1, 0, n).contiguous();
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

}  // namespace smartspec
