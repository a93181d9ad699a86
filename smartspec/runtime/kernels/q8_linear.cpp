// Linears on GGUF blocks with int8 activations, as llama.cpp computes them: each activation row is quantized to
// int8 in blocks (one fp32 scale per block, chosen from that row alone), and the products of weight codes and
// activation codes are summed exactly in int32 with AVX-512 VNNI. Per output element and superblock of SB weights
//     acc = acc + float(sum_g sc_g * (dot_g - bias * xsum_g)) * (d * dx)          (sc_g = 1 without group scales)
//     acc = acc + float(sum_g mn_g * xsum_g) * (off * dx)                         (formats with an offset)
// dot_g: codes (stored unsigned: q + bias) times activation codes over group g; xsum_g: the activation codes' sum;
// dx: the activation block's scale. Integer sums are exact, and the float operations above are the same for
// every element whatever the rows, panels or threads of the call: the output is batch-invariant. The numpy
// reference in tests/q8_reference.py computes these very bits.
//
// Formats (see smartspec/models/gguf_blocks.py for the codes): kind, group G, superblock SB, bias, high bits
//   Q4_K 32/256, bias 0, offset (-dmin) * mn    Q6_K 16/256, bias 32, 2 high bits
//   Q8_0 32/32, bias 128, whole bytes           Q5_0 32/32, bias 16, 1 high bit      Q4_1 32/32, offset m
// Layout (packed by smartspec/engine/quant_linear.py): per panel of 16 output rows, superblock after superblock,
// one contiguous run of bytes (a single memory stream per panel):
//   codes   low nibbles as [SB/8, 16, 4] bytes holding k = 8j + i (low nibble) and 8j + 4 + i (high), one 64-byte
//           vector per 8 k whose 32-bit lanes are the 16 columns; or whole bytes as [SB/4, 16, 4]
//   high    per 32 k, HIGH vectors of 64 bytes: the bits of k = 32t + 8s + 4h + i at bit (s * 2 + h) * HIGH mod 8
//           of vector (s * 2 + h) * HIGH / 8
//   sc, mn  [SB/G, 16] int8       d, off  [16] fp16      zeros up to a multiple of 64 bytes (cache lines)
#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "panel_gemm.h"
#include "quant_linear.h"

namespace smartspec {
namespace {

struct Q8Weights {
  const uint8_t* blob;
  int64_t panel_stride;  // bytes
};

// Activations quantized per row, stored k-major so that a tile's rows sit side by side (one pointer, constant
// offsets): codes as int32 [K/4, M] (4 codes each), scales [K/SB, M], code sums [K/G, M], and those sums as
// int16 pairs (groups 2i, 2i + 1) in int32 [K/G/2, M] for formats of several groups a superblock.
struct Q8Rows {
  const int32_t* q;
  const float* d;
  const int32_t* sum;
  const int32_t* pairs;
  int64_t m, k;
};

template <int G, int SB, int BIAS, int HIGH, bool BYTES, bool SCALES, bool OFFSET, bool OFF_SCALES>
struct Format {
  static constexpr int kGroup = G, kSuper = SB, kBias = BIAS, kHigh = HIGH;
  static constexpr bool kBytes = BYTES, kScales = SCALES, kOffset = OFFSET, kOffScales = OFF_SCALES;
  // byte offsets of a superblock's parts, and its size
  static constexpr int64_t kHighAt = BYTES ? SB * 16 : SB * 8;
  static constexpr int64_t kScAt = kHighAt + SB / 32 * 64 * HIGH;
  static constexpr int64_t kMnAt = kScAt + (SCALES ? SB / G * 16 : 0);
  static constexpr int64_t kDAt = kMnAt + (OFF_SCALES ? SB / G * 16 : 0);
  static constexpr int64_t kOffAt = kDAt + 32;
  static constexpr int64_t kBytesPerSuper = (kOffAt + (OFFSET ? 32 : 0) + 63) / 64 * 64;  // whole cache lines
};
using Q4K = Format<32, 256, 0, 0, false, true, true, true>;
using Q6K = Format<16, 256, 32, 2, false, true, false, false>;
using Q8_0 = Format<32, 32, 128, 0, true, false, false, false>;
using Q5_0 = Format<32, 32, 16, 1, false, false, false, false>;
using Q4_1 = Format<32, 32, 0, 0, false, false, true, false>;

#if defined(__AVX512VNNI__)
// Row r of x [M, K] as int8 blocks of SB: dx = max|x| / 127, codes round(x / dx) (ties to even), sums per group
// (|sum| <= 127 * G, so a pair of them fits one int32 as two int16). 16 values a vector: the maximum is exact in
// any order and each code is one multiply and one rounding, so these are the bits of the scalar definition
// (tests/q8_reference.py). A verify step quantizes 8 rows of every linear's input: value by value on one thread,
// the other waiting, that costs a tenth of the step.
void quantize_rows(const float* x, int64_t m, int64_t k, int64_t sb, int64_t g, int32_t* q, float* d, int32_t* sum,
                   int32_t* pairs) {
  TORCH_CHECK(sb % 16 == 0 && g % 16 == 0 && sb % g == 0, "quantize_rows: blocks and groups of 16 values");
  // the four words of a 16-code vector land m words apart (codes are k-major: a tile's rows side by side)
  const int32_t mw = static_cast<int32_t>(m);
  const __m128i spread = _mm_setr_epi32(0, mw, 2 * mw, 3 * mw);
  // a unit is one block of one row, block-major as the outputs are (threads write apart); a verify step's few rows
  // are shared out too, in units of some 4096 values
  at::parallel_for(0, m * (k / sb), std::max<int64_t>(1, 4096 / sb), [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / m, r = u % m;
      const float* src = x + r * k + b * sb;
      __m512 amax = _mm512_setzero_ps();
      for (int64_t i = 0; i < sb; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(src + i)));
      const float top = _mm512_reduce_max_ps(amax);
      const float scale = top / 127.f, inv = top > 0.f ? 1.f / scale : 0.f;
      d[b * m + r] = scale;
      const __m512 invv = _mm512_set1_ps(inv);
      __m512i group = _mm512_setzero_si512();
      for (int64_t i = 0; i < sb; i += 16) {
        const __m512i c = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(src + i), invv),
                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_i32scatter_epi32(q + (b * sb + i) / 4 * m + r, spread, _mm512_cvtepi32_epi8(c), 4);
        group = _mm512_add_epi32(group, c);
        if ((i + 16) % g == 0) {
          const int64_t j = (b * sb + i) / g;
          const int32_t total = _mm512_reduce_add_epi32(group);
          sum[j * m + r] = total;
          if (pairs != nullptr) {  // int16 halves of a little-endian int32: group 2i low, 2i + 1 high
            const int16_t half = static_cast<int16_t>(total);
            std::memcpy(reinterpret_cast<char*>(pairs + j / 2 * m + r) + 2 * (j % 2), &half, sizeof half);
          }
          group = _mm512_setzero_si512();
        }
      }
    }
  });
}

// The codes (unsigned) of k = 32t + 8S + (0..3) and 32t + 8S + (4..7) of a superblock: a 32-bit lane per column.
template <typename F, int S>
inline void codes8(const uint8_t* super, int64_t t, __m512i& lo, __m512i& hi) {
  const int64_t kk = t * 32 + S * 8;
  if constexpr (F::kBytes) {
    lo = _mm512_loadu_si512(super + kk * 16);
    hi = _mm512_loadu_si512(super + kk * 16 + 64);
  } else {
    const __m512i nib = _mm512_loadu_si512(super + kk * 8);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    lo = _mm512_and_si512(nib, low4);
    hi = _mm512_and_si512(_mm512_srli_epi16(nib, 4), low4);
    if constexpr (F::kHigh > 0) {
      constexpr int slot = S * 2 * F::kHigh, e = slot % 8, eh = e + F::kHigh;  // bit positions of h = 0 and 1
      const __m512i bits = _mm512_loadu_si512(super + F::kHighAt + t * 64 * F::kHigh + (slot / 8) * 64);
      const __m512i top = _mm512_set1_epi8(F::kHigh == 2 ? 0x30 : 0x10);
      // bits (e, e + HIGH) of each byte moved to bit 4 (the code's high part), neighbours masked off
      const __m512i lo_bits = e <= 4 ? _mm512_slli_epi16(bits, 4 - e) : _mm512_srli_epi16(bits, e - 4);
      const __m512i hi_bits = eh <= 4 ? _mm512_slli_epi16(bits, 4 - eh) : _mm512_srli_epi16(bits, eh - 4);
      lo = _mm512_ternarylogic_epi32(lo, lo_bits, top, 0xF8);  // lo | (lo_bits & top)
      hi = _mm512_ternarylogic_epi32(hi, hi_bits, top, 0xF8);
    }
  }
}

inline __m512i small_ints(const uint8_t* at) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
}

inline __m512 halves(const uint8_t* at) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
}

// (v_g, v_g+1) of each column as an int16 pair in its 32-bit lane, from the 16 int8 values of group g at `at`
// followed by those of g + 1: vpdpwssd's operand for two groups at once.
template <bool SIGNED>
inline __m512i column_pairs(const uint8_t* at) {
  const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
  const __m512i words = SIGNED ? _mm512_cvtepi8_epi16(both) : _mm512_cvtepu8_epi16(both);
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, words);
}

// Rows r0 .. r0 + MR of x against panels p0 .. p0 + NP, over all of K. The float accumulators live in y (stored
// and loaded back between superblocks, which changes no bit), leaving the registers to the integer sums.
// The integer sums are exact, so they may be formed in any order; this one keeps the vector ports on vpdpbusd:
// - Q4_K's codes (0..15) times 16 activation codes (|x| <= 127) stay within int16, so each 16-k dot is scaled and
//   added in one vpdpwssd (scale in the low half of the lane, zero above) instead of a multiply and an add;
// - bias and offset terms are per group, sum_g v_g * xsum_g, summed two groups a vpdpwssd once a superblock
//   (x.pairs holds each row's group sums as int16 pairs; |xsum| <= 127 * 32, |bias * sc| <= 32 * 128).
template <typename F, int MR, int NP>
void q8_tile(const Q8Weights& w, int64_t p0, const Q8Rows& x, int64_t r0, float* y, int64_t ldy) {
  constexpr int G = F::kGroup, SB = F::kSuper, NG = SB / G;
  constexpr bool kHalfDots = F::kScales && F::kBias == 0 && F::kHigh == 0;  // 15 * 127 * 16 < 2^15
  constexpr int D = kHalfDots ? 16 : G;  // k a dot sums before it is scaled
  for (int64_t s0 = 0; s0 < x.k; s0 += SB) {
    const int64_t sb = s0 / SB;
    const uint8_t* super[NP];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) super[p] = w.blob + (p0 + p) * w.panel_stride + sb * F::kBytesPerSuper;
    __m512i sumi[MR][NP], dot[MR][NP];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) sumi[r][p] = _mm512_setzero_si512();
    for (int64_t t = 0; t < SB / 32; ++t) {
      // the four 8-k steps of a 32-k span, unrolled at compile time (the high bits' shifts depend on the step)
      [&]<int... S>(std::integer_sequence<int, S...>) {
        ([&] {
          if constexpr (F::kScales && S * 8 % D == 0) {
#pragma GCC unroll 8
            for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
              for (int p = 0; p < NP; ++p) dot[r][p] = _mm512_setzero_si512();
          }
          __m512i lo[NP], hi[NP];
#pragma GCC unroll 8
          for (int p = 0; p < NP; ++p) {
            // one sequential stream per panel, fetched 4 KiB ahead into L2: a core's L1 tracks too few misses to
            // keep memory busy (prefetching into L1, at any distance, did no better than none at all)
            _mm_prefetch(reinterpret_cast<const char*>(super[p] + (t * 32 + S * 8) * (F::kBytes ? 16 : 8) + 4096),
                         _MM_HINT_T1);
            codes8<F, S>(super[p], t, lo[p], hi[p]);
          }
          const int32_t* xa_row = x.q + ((s0 + t * 32 + S * 8) / 4) * x.m + r0;
          const int32_t* xb_row = xa_row + x.m;
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r) {
            const __m512i xa = _mm512_set1_epi32(xa_row[r]);
            const __m512i xb = _mm512_set1_epi32(xb_row[r]);
#pragma GCC unroll 8
            for (int p = 0; p < NP; ++p) {
              __m512i& acc = F::kScales ? dot[r][p] : sumi[r][p];  // no group scales: straight into the sum
              acc = _mm512_dpbusd_epi32(acc, lo[p], xa);
              acc = _mm512_dpbusd_epi32(acc, hi[p], xb);
            }
          }
          if constexpr (F::kScales && (S + 1) * 8 % D == 0) {  // a dot ends: scaled into the superblock's sum
            const int64_t g = (t * 32 + S * 8) / G;
            __m512i scale[NP];
#pragma GCC unroll 8
            for (int p = 0; p < NP; ++p) scale[p] = small_ints(super[p] + F::kScAt + g * 16);
#pragma GCC unroll 8
            for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
              for (int p = 0; p < NP; ++p)
                sumi[r][p] = kHalfDots ? _mm512_dpwssd_epi32(sumi[r][p], dot[r][p], scale[p])
                                       : _mm512_add_epi32(sumi[r][p], _mm512_mullo_epi32(dot[r][p], scale[p]));
          }
        }(), ...);
      }(std::make_integer_sequence<int, 4>{});
    }
    const int32_t* pairs = NG > 1 ? x.pairs + (s0 / G / 2) * x.m + r0 : nullptr;
    const int32_t* sums = x.sum + (s0 / G) * x.m + r0;
    if constexpr (F::kBias && F::kScales) {  // sumi -= sum_g bias * sc_g * xsum_g
#pragma GCC unroll 8
      for (int i = 0; i < NG / 2; ++i) {
        __m512i neg[NP];
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p)
          neg[p] = _mm512_mullo_epi16(column_pairs<true>(super[p] + F::kScAt + i * 32), _mm512_set1_epi16(-F::kBias));
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const __m512i xs = _mm512_set1_epi32(pairs[i * x.m + r]);
#pragma GCC unroll 8
          for (int p = 0; p < NP; ++p) sumi[r][p] = _mm512_dpwssd_epi32(sumi[r][p], neg[p], xs);
        }
      }
    } else if constexpr (F::kBias) {  // one group a superblock
      static_assert(NG == 1, "a bias without group scales is subtracted once a superblock");
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512i bias = _mm512_set1_epi32(F::kBias * sums[r]);
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) sumi[r][p] = _mm512_sub_epi32(sumi[r][p], bias);
      }
    }
    __m512i (&summ)[MR][NP] = dot;  // the dots are done with: their registers take the offset sums
    if constexpr (F::kOffScales) {  // summ = sum_g mn_g * xsum_g
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) summ[r][p] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int i = 0; i < NG / 2; ++i) {
        __m512i mn[NP];
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) mn[p] = column_pairs<false>(super[p] + F::kMnAt + i * 32);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const __m512i xs = _mm512_set1_epi32(pairs[i * x.m + r]);
#pragma GCC unroll 8
          for (int p = 0; p < NP; ++p) summ[r][p] = _mm512_dpwssd_epi32(summ[r][p], mn[p], xs);
        }
      }
    } else if constexpr (F::kOffset) {  // one group a superblock, its offset times the codes' sum
      static_assert(NG == 1, "an offset without group scales is added once a superblock");
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) summ[r][p] = _mm512_set1_epi32(sums[r]);
    }
    // the float steps, the same for every element whatever the tile: acc + sumi * (d * dx), then + summ * (off * dx)
    const float* dx = x.d + sb * x.m + r0;
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      const __m512 dv = halves(super[p] + F::kDAt);
      const __m512 ov = F::kOffset ? halves(super[p] + F::kOffAt) : _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        float* out = y + (r0 + r) * ldy + (p0 + p) * kPanel;
        const __m512 dxr = _mm512_set1_ps(dx[r]);
        const __m512 part = _mm512_mul_ps(_mm512_cvtepi32_ps(sumi[r][p]), _mm512_mul_ps(dv, dxr));
        __m512 acc = sb == 0 ? _mm512_add_ps(_mm512_setzero_ps(), part) : _mm512_add_ps(_mm512_loadu_ps(out), part);
        if constexpr (F::kOffset)
          acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(summ[r][p]), _mm512_mul_ps(ov, dxr)));
        _mm512_storeu_ps(out, acc);
      }
    }
  }
}

// Up to 8 rows share a pass over the weights (a verify step of k = 7 streams them once), and a tile of rows reads
// several panels. Where a call has more rows (a prefill chunk), each chunk of panels is passed over again and again
// from cache, the arithmetic bounds, and fewer panels as rows grow keep the integer sums in registers. A call of up to
// 8 rows streams the weights from memory once: on AMD Zen 4 a few rows already keep the VNNI ports busy, and a tile's
// panels are the memory streams in flight while they do, so more panels pay for the spilled sums there (the 1.5B's
// linears: 3-5 rows 0.76-0.89x the time, 6-8 rows 0.85-0.88x; docs/benchmarks.md, "Step cost").
constexpr int kQ8MaxRows = 8;
template <int MR> constexpr int q8_panels_cached() { return MR <= 2 ? 4 : MR <= 4 ? 2 : 1; }
#if defined(__znver3__) || defined(__znver4__) || defined(__znver5__)  // -march=native on Zen 4: znver3 (GCC 12)
template <int MR> constexpr int q8_panels_streamed() { return MR <= 5 ? 4 : 2; }
#else
template <int MR> constexpr int q8_panels_streamed() { return q8_panels_cached<MR>(); }
#endif

// All rows of x against panels [c0, c1) in tiles of NP panels: row tiles outside, so the panels' codes are reused
// from cache.
template <typename F, int MR, int NP>
void q8_rows(const Q8Weights& w, int64_t c0, int64_t c1, const Q8Rows& x, int64_t r0, float* y, int64_t ldy) {
  int64_t p = c0;
  for (; p + NP <= c1; p += NP) q8_tile<F, MR, NP>(w, p, x, r0, y, ldy);
  for (; p < c1; ++p) q8_tile<F, MR, 1>(w, p, x, r0, y, ldy);
}

using Q8RowsFn = void (*)(const Q8Weights&, int64_t, int64_t, const Q8Rows&, int64_t, float*, int64_t);

// q8_rows of 1..8 rows, tiled by PANELS (q8_panels_streamed or q8_panels_cached).
template <typename F, template <int> class PANELS, int... MR>
constexpr std::array<Q8RowsFn, sizeof...(MR) + 1> q8_rows_by_count(std::integer_sequence<int, MR...>) {
  return {nullptr, q8_rows<F, MR + 1, PANELS<MR + 1>::value>...};
}
template <int MR> struct Streamed { static constexpr int value = q8_panels_streamed<MR>(); };
template <int MR> struct Cached { static constexpr int value = q8_panels_cached<MR>(); };

template <typename F>
void q8_panels_all_rows(const Q8Weights& w, int64_t c0, int64_t c1, const Q8Rows& x, int64_t m, float* y,
                        int64_t ldy) {
  static constexpr auto streamed = q8_rows_by_count<F, Streamed>(std::make_integer_sequence<int, kQ8MaxRows>{});
  static constexpr auto cached = q8_rows_by_count<F, Cached>(std::make_integer_sequence<int, kQ8MaxRows>{});
  const auto& by_rows = m <= kQ8MaxRows ? streamed : cached;
  for (int64_t r = 0; r < m; r += kQ8MaxRows) by_rows[std::min<int64_t>(kQ8MaxRows, m - r)](w, c0, c1, x, r, y, ldy);
}
#endif

}  // namespace

bool q8_linear_available() {
#if defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}

namespace {
#if defined(__AVX512VNNI__)
// Calls fn with the Format of a GGUF kind.
template <typename Fn>
void with_format(const std::string& kind, Fn&& fn) {
  if (kind == "Q4_K") return fn(Q4K{});
  if (kind == "Q6_K") return fn(Q6K{});
  if (kind == "Q8_0") return fn(Q8_0{});
  if (kind == "Q5_0") return fn(Q5_0{});
  if (kind == "Q4_1") return fn(Q4_1{});
  TORCH_CHECK(false, "q8_linear: no int8 kernel for GGUF type ", kind);
}

// x quantized for one block shape (superblock SB, group G); formats of equal shape share it.
struct QuantizedInput {
  int64_t sb, g;
  torch::Tensor q, d, sum, pairs;
  Q8Rows rows;
};

// One linear of a call: its weight, its input's quantized rows, its padded output.
struct Q8Job {
  Q8RowsFn run;  // q8_panels_all_rows of its format
  Q8Weights w;
  const Q8Rows* x;
  float* y;
  int64_t ldy, panels;
};
#endif
}  // namespace

std::vector<torch::Tensor> q8_linears(torch::Tensor x, const std::vector<std::string>& kinds,
                                      const std::vector<torch::Tensor>& blobs, const std::vector<int64_t>& outs,
                                      const std::vector<torch::Tensor>& biases) {
#if defined(__AVX512VNNI__)
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "q8_linear: x fp32 [M, K]");
  TORCH_CHECK(blobs.size() == kinds.size() && outs.size() == kinds.size() && biases.size() == kinds.size(),
              "q8_linears: one kind, blob, output size and bias (empty: none) per linear");
  x = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  constexpr int64_t chunk = 4;  // panels a unit of work
  std::vector<QuantizedInput> inputs;
  inputs.reserve(kinds.size());  // jobs point into it
  std::vector<Q8Job> jobs;
  std::vector<torch::Tensor> ys;
  for (size_t i = 0; i < kinds.size(); ++i) {
    const torch::Tensor& blob = blobs[i];
    TORCH_CHECK(blob.dim() == 2 && blob.is_contiguous() && blob.element_size() == 1, "q8_linear: blob [P, bytes]");
    with_format(kinds[i], [&](auto format) {
      using F = decltype(format);
      const std::string& kind = kinds[i];
      TORCH_CHECK(k % F::kSuper == 0, "q8_linear: K must be a multiple of ", F::kSuper, " for ", kind);
      TORCH_CHECK(blob.size(1) == k / F::kSuper * F::kBytesPerSuper, "q8_linear: ", kind, " panels of ",
                  k / F::kSuper * F::kBytesPerSuper, " bytes expected for K = ", k, ", got ", blob.size(1));
      QuantizedInput* in = nullptr;
      for (auto& have : inputs)
        if (have.sb == F::kSuper && have.g == F::kGroup) in = &have;
      if (in == nullptr) {
        const int64_t pairs = F::kSuper > F::kGroup ? k / F::kGroup / 2 : 0;
        const auto ints = x.options().dtype(torch::kInt32);
        inputs.push_back({F::kSuper, F::kGroup, torch::empty({k / 4, m}, ints), torch::empty({k / F::kSuper, m}, x.options()),
                          torch::empty({k / F::kGroup, m}, ints), torch::empty({pairs, m}, ints), {}});
        in = &inputs.back();
        int32_t* pair_sums = pairs ? in->pairs.data_ptr<int32_t>() : nullptr;
        quantize_rows(x.data_ptr<float>(), m, k, F::kSuper, F::kGroup, in->q.data_ptr<int32_t>(),
                      in->d.data_ptr<float>(), in->sum.data_ptr<int32_t>(), pair_sums);
        in->rows = {in->q.data_ptr<int32_t>(), in->d.data_ptr<float>(), in->sum.data_ptr<int32_t>(), pair_sums, m, k};
      }
      const int64_t panels = blob.size(0);
      ys.push_back(torch::empty({m, panels * kPanel}, x.options()));
      jobs.push_back({q8_panels_all_rows<F>, {static_cast<const uint8_t*>(blob.data_ptr()), blob.size(1)},
                      &in->rows, ys.back().data_ptr<float>(), panels * kPanel, panels});
    });
  }
  // the units of all the linears in one pool: the threads meet once a call, not once a linear
  std::vector<int64_t> first(jobs.size() + 1, 0);
  for (size_t j = 0; j < jobs.size(); ++j) first[j + 1] = first[j] + (jobs[j].panels + chunk - 1) / chunk;
  dynamic_for(first.back(), [&](int64_t u) {
    const size_t j = std::upper_bound(first.begin(), first.end(), u) - first.begin() - 1;
    const Q8Job& job = jobs[j];
    const int64_t c0 = (u - first[j]) * chunk;
    job.run(job.w, c0, std::min(job.panels, c0 + chunk), *job.x, m, job.y, job.ldy);
  });
  for (size_t i = 0; i < ys.size(); ++i) {
    const bool has_bias = biases[i].defined() && biases[i].numel();
    ys[i] = finish_linear(ys[i], outs[i], has_bias ? c10::optional<torch::Tensor>(biases[i]) : c10::nullopt);
  }
  return ys;
#else
  TORCH_CHECK(false, "q8_linear needs AVX-512 VNNI");
#endif
}

torch::Tensor q8_linear(torch::Tensor x, const std::string& kind, torch::Tensor blob, int64_t n,
                        c10::optional<torch::Tensor> bias) {
  return q8_linears(x, {kind}, {blob}, {n}, {bias.has_value() ? *bias : torch::Tensor()})[0];
}

}  // namespace smartspec
