// Linears computed straight from quantized weights, with outputs bitwise equal to the fp32 linear on the same
// weights dequantized the way GGUF readers (gguf-py, hence transformers) dequantize them.
//
// Every GGUF format the engine keeps quantized is, per group of G weights of one output row (G = 16 or 32):
//     w = s * q  (+ o)      s = d[superblock] (* sc[group]),   o = off[superblock] (* mn[group])
// with q a small integer, d and off fp32 (from f16), sc and mn small integers. Computed in that order, with one
// rounding per operation (the build sets -ffp-contract=off), these are the very floats gguf-py produces, so a
// panel of them fed to the fp32 panel GEMM gives the fp32 path's bits. Formats (see smartspec/models/gguf.py):
//   Q4_K  q 0..15 (nibbles), G 32, superblock 256, s = d * sc, o = (-dmin) * m
//   Q6_K  q -32..31,         G 16, superblock 256, s = d * sc
//   Q8_0  q -128..127,       G 32, s = d          Q5_0  q -16..15, G 32, s = d
//   Q4_1  q 0..15 (nibbles), G 32, s = d, o = m
//
// Layout (packed in smartspec/engine/quant_linear.py): panels of 16 output rows like the fp32 weight, q as
// [P, K, 16] int8, or [P, K/2, 16] bytes holding q[k] | q[k+1] << 4 for nibble formats; d and off [P, K/SB, 16];
// sc and mn [P, K/G, 16] int8. A work unit dequantizes a k-block of a few panels into a small fp32 tile (L2) and
// runs the shared panel GEMM on it for every row, so a weight is dequantized once per call whatever the rows.
#include <vector>

#include "panel_gemm.h"
#include "quant_linear.h"

namespace smartspec {
namespace {

constexpr int64_t kQuantKBlock = 512;  // a multiple of every superblock; 8 panels x 512 x 16 floats = 256 KiB

struct QuantPanels {
  const uint8_t* q;
  const float* d;
  const int8_t* sc;
  const float* off;
  const int8_t* mn;
  int64_t q_stride, d_stride, g_stride;  // per panel, in elements
  int64_t group, superblock;
  bool nibble;
};

// Panel p's weights for k in [k0, k0 + kb) as fp32, into out [kb, 16].
template <bool NIBBLE, bool GROUPS, bool OFFSET, bool OFF_GROUPS>
void dequant(const QuantPanels& w, int64_t p, int64_t k0, int64_t kb, float* out) {
  const uint8_t* q = w.q + p * w.q_stride;
  const float* d = w.d + p * w.d_stride;
  const float* off = OFFSET ? w.off + p * w.d_stride : nullptr;
  const int8_t* sc = GROUPS ? w.sc + p * w.g_stride : nullptr;
  const int8_t* mn = OFF_GROUPS ? w.mn + p * w.g_stride : nullptr;
  for (int64_t k = k0; k < k0 + kb; k += w.group) {
    const int64_t sb = k / w.superblock, g = k / w.group;
    float s[kPanel], o[kPanel];
#pragma GCC unroll 16
    for (int c = 0; c < kPanel; ++c) {
      s[c] = GROUPS ? d[sb * kPanel + c] * static_cast<float>(sc[g * kPanel + c]) : d[sb * kPanel + c];
      o[c] = OFFSET ? (OFF_GROUPS ? off[sb * kPanel + c] * static_cast<float>(mn[g * kPanel + c])
                                  : off[sb * kPanel + c])
                    : 0.f;
    }
    // nibble formats: one byte per lane holds k (low) and k + 1 (high), so two k at a time with fixed shifts
    constexpr int64_t kPer = NIBBLE ? 2 : 1;
    for (int64_t kk = k; kk < k + w.group; kk += kPer) {
      float* dst = out + (kk - k0) * kPanel;
      const uint8_t* src = q + (kk / kPer) * kPanel;
#pragma GCC unroll 16
      for (int c = 0; c < kPanel; ++c) {
        const uint8_t byte = src[c];
        const int lo = NIBBLE ? byte & 15 : static_cast<int8_t>(byte);
        float v = s[c] * static_cast<float>(lo);
        if (OFFSET) v = v + o[c];
        dst[c] = v;
        if (NIBBLE) {
          float h = s[c] * static_cast<float>(byte >> 4);
          if (OFFSET) h = h + o[c];
          dst[kPanel + c] = h;
        }
      }
    }
  }
}

using FusedRowsFn = void (*)(const QuantPanels&, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t);

#if defined(__AVX512F__)
// A few rows (decode, a verify step): dequantize in registers, panel by panel, straight into the FMA chains. The
// weight is computed by the same operations as dequant() above (multiply, then add the offset), and the chain is
// the fp32 panel GEMM's (one fused multiply-add per k, k increasing), so the bits are the tile path's.
template <int MR, int NP, bool NIBBLE, bool GROUPS, bool OFFSET, bool OFF_GROUPS>
void fused(const QuantPanels& w, int64_t p0, const float* x, int64_t ldx, int64_t k, float* y, int64_t ldy) {
  __m512 acc[MR][NP];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  const __m512i low_nibble = _mm512_set1_epi32(15);
  for (int64_t g0 = 0; g0 < k; g0 += w.group) {
    const int64_t sb = g0 / w.superblock, g = g0 / w.group;
    __m512 s[NP], o[NP];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      const int64_t pp = p0 + p;
      const __m512 d = _mm512_loadu_ps(w.d + pp * w.d_stride + sb * kPanel);
      s[p] = GROUPS ? _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                          reinterpret_cast<const __m128i*>(w.sc + pp * w.g_stride + g * kPanel)))))
                    : d;
      if (OFFSET) {
        const __m512 off = _mm512_loadu_ps(w.off + pp * w.d_stride + sb * kPanel);
        o[p] = OFF_GROUPS ? _mm512_mul_ps(off, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                reinterpret_cast<const __m128i*>(w.mn + pp * w.g_stride + g * kPanel)))))
                          : off;
      }
    }
    constexpr int64_t kPer = NIBBLE ? 2 : 1;
    for (int64_t kk = g0; kk < g0 + w.group; kk += kPer) {
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        const uint8_t* src = w.q + (p0 + p) * w.q_stride + (kk / kPer) * kPanel;
        _mm_prefetch(reinterpret_cast<const char*>(src + 16 * kPanel), _MM_HINT_T0);
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
        const __m512i codes = NIBBLE ? _mm512_cvtepu8_epi32(bytes) : _mm512_cvtepi8_epi32(bytes);
        __m512 lo = _mm512_mul_ps(s[p], _mm512_cvtepi32_ps(NIBBLE ? _mm512_and_si512(codes, low_nibble) : codes));
        if (OFFSET) lo = _mm512_add_ps(lo, o[p]);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) acc[r][p] = _mm512_fmadd_ps(lo, _mm512_set1_ps(x[r * ldx + kk]), acc[r][p]);
        if (NIBBLE) {
          __m512 hi = _mm512_mul_ps(s[p], _mm512_cvtepi32_ps(_mm512_srli_epi32(codes, 4)));
          if (OFFSET) hi = _mm512_add_ps(hi, o[p]);
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r)
            acc[r][p] = _mm512_fmadd_ps(hi, _mm512_set1_ps(x[r * ldx + kk + 1]), acc[r][p]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(y + r * ldy + (p0 + p) * kPanel, acc[r][p]);
}

using FusedFn = void (*)(const QuantPanels&, int64_t, const float*, int64_t, int64_t, float*, int64_t);

template <int MR, bool NIBBLE, bool GROUPS, bool OFFSET, bool OFF_GROUPS>
void fused_rows(const QuantPanels& w, int64_t c0, int64_t c1, const float* x, int64_t ldx, int64_t k, float* y,
                int64_t ldy) {
  constexpr int NP = MR <= 2 ? 4 : 2;
  int64_t p = c0;
  for (; p + NP <= c1; p += NP) fused<MR, NP, NIBBLE, GROUPS, OFFSET, OFF_GROUPS>(w, p, x, ldx, k, y, ldy);
  for (; p < c1; ++p) fused<MR, 1, NIBBLE, GROUPS, OFFSET, OFF_GROUPS>(w, p, x, ldx, k, y, ldy);
}

template <bool NIBBLE, bool GROUPS, bool OFFSET, bool OFF_GROUPS>
FusedRowsFn fused_for_rows(int64_t mr) {
  static const FusedRowsFn table[9] = {
      nullptr, fused_rows<1, NIBBLE, GROUPS, OFFSET, OFF_GROUPS>, fused_rows<2, NIBBLE, GROUPS, OFFSET, OFF_GROUPS>,
      fused_rows<3, NIBBLE, GROUPS, OFFSET, OFF_GROUPS>, fused_rows<4, NIBBLE, GROUPS, OFFSET, OFF_GROUPS>,
      fused_rows<5, NIBBLE, GROUPS, OFFSET, OFF_GROUPS>, fused_rows<6, NIBBLE, GROUPS, OFFSET, OFF_GROUPS>,
      fused_rows<7, NIBBLE, GROUPS, OFFSET, OFF_GROUPS>, fused_rows<8, NIBBLE, GROUPS, OFFSET, OFF_GROUPS>};
  return table[mr];
}

#endif

using DequantFn = void (*)(const QuantPanels&, int64_t, int64_t, int64_t, float*);

// The kernels of one format's flag combination (see the header comment): Q4_K, Q6_K, Q8_0 / Q5_0, Q4_1.
template <bool NIBBLE, bool GROUPS, bool OFFSET, bool OFF_GROUPS>
struct FormatKernels {
  static DequantFn tile() { return dequant<NIBBLE, GROUPS, OFFSET, OFF_GROUPS>; }
#if defined(__AVX512F__)
  static FusedRowsFn fused(int64_t mr) { return fused_for_rows<NIBBLE, GROUPS, OFFSET, OFF_GROUPS>(mr); }
#endif
};

// Calls pick with the FormatKernels of w's format; false if the flags name no format.
template <typename Pick>
bool with_format(const QuantPanels& w, bool groups, bool offset, bool off_groups, const Pick& pick) {
  if (w.nibble && groups && offset && off_groups) return pick(FormatKernels<true, true, true, true>{}), true;
  if (!w.nibble && groups && !offset && !off_groups) return pick(FormatKernels<false, true, false, false>{}), true;
  if (!w.nibble && !groups && !offset && !off_groups) return pick(FormatKernels<false, false, false, false>{}), true;
  if (w.nibble && !groups && offset && !off_groups) return pick(FormatKernels<true, false, true, false>{}), true;
  return false;
}

}  // namespace

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, c10::optional<torch::Tensor> sc,
                           c10::optional<torch::Tensor> off, c10::optional<torch::Tensor> mn, int64_t n,
                           int64_t group, int64_t superblock, bool nibble, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "quant_linear: x fp32 [M, K]");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kPanel && q.is_contiguous() && q.element_size() == 1,
              "quant_linear: q [P, K or K/2, 16] of bytes");
  const bool groups = sc.has_value() && sc->defined(), offset = off.has_value() && off->defined();
  const bool off_groups = mn.has_value() && mn->defined();
  TORCH_CHECK(superblock % group == 0 && kQuantKBlock % superblock == 0, "quant_linear: unsupported block sizes");
  x = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), panels = q.size(0), ldy = panels * kPanel;
  TORCH_CHECK(q.size(1) * (nibble ? 2 : 1) == k && k % superblock == 0, "quant_linear: K does not match q");
  TORCH_CHECK(d.dtype() == torch::kFloat32 && d.is_contiguous() && d.size(0) == panels && d.size(1) == k / superblock,
              "quant_linear: d [P, K/superblock, 16] fp32");
  QuantPanels w{static_cast<const uint8_t*>(q.data_ptr()), d.data_ptr<float>(),
                groups ? static_cast<const int8_t*>(sc->data_ptr()) : nullptr,
                offset ? off->data_ptr<float>() : nullptr,
                off_groups ? static_cast<const int8_t*>(mn->data_ptr()) : nullptr,
                q.size(1) * kPanel, d.size(1) * kPanel, (k / group) * kPanel, group, superblock, nibble};
  DequantFn deq = nullptr;
  FusedRowsFn rows = nullptr;
  const bool known = with_format(w, groups, offset, off_groups, [&](auto kernels) {
    deq = decltype(kernels)::tile();
#if defined(__AVX512F__)
    if (m <= kMaxRows) rows = decltype(kernels)::fused(m);
#endif
  });
  TORCH_CHECK(known, "quant_linear: no GGUF format has these scales and offsets");
  auto y = torch::empty({m, ldy}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t chunk = 8;
  if (rows != nullptr) {  // a few rows: dequantized in registers
    dynamic_for((panels + chunk - 1) / chunk, [&](int64_t u) {
      rows(w, u * chunk, std::min(panels, (u + 1) * chunk), xp, k, k, yp, ldy);
    });
    return finish_linear(y, n, bias);
  }
  dynamic_for((panels + chunk - 1) / chunk, [&](int64_t u) {
    thread_local std::vector<float> tile;
    tile.resize(chunk * kQuantKBlock * kPanel);
    const int64_t c0 = u * chunk, c1 = std::min(panels, c0 + chunk);
    for (int64_t k0 = 0; k0 < k; k0 += kQuantKBlock) {
      const int64_t kb = std::min(kQuantKBlock, k - k0);
      for (int64_t p = c0; p < c1; ++p) deq(w, p, k0, kb, tile.data() + (p - c0) * kb * kPanel);
      panel_gemm(xp + k0, m, k, kb, tile.data(), kb * kPanel, yp + c0 * kPanel, ldy, 0, c1 - c0, k0 > 0);
    }
  });
  return finish_linear(y, n, bias);
}

}  // namespace smartspec
