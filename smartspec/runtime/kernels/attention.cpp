// Batch-invariant paged attention: a packed, ragged batch of query tokens through a paged KV cache.
//
// A query's result is one fixed sequence of float operations over the keys it sees, listed in position order,
// whatever else shares the call and wherever its visible keys sit: a token-tree node (which skips its siblings)
// gets the bits the same token gets in plain decoding. Work is vectorised over that list, never over raw
// positions, so a masked position in between shifts nothing. The heads that share a KV head are computed together
// (each key and value row is loaded once for all of them); how heads are grouped never changes a head's bits.
#include <limits>
#include <vector>

#include "panel_gemm.h"
#include "vec_math.h"

namespace smartspec {
namespace {

constexpr int64_t kAhead = 4;  // rows prefetched this many keys ahead (the lists carry kAhead spare entries)

#if defined(SMARTSPEC_AVX2) && defined(__AVX512F__) && defined(__AVX512DQ__)
#define SMARTSPEC_AVX512 1  // 16-lane forms of the loops below, with the same bits
#endif

#ifdef SMARTSPEC_AVX2
// scores[h][j] = (q_h . key_j) * scale for NH heads and keys [j0, j0 + NK): each dot one FMA chain over 8-lane
// slices in increasing order, then hsum, then the scalar tail, as for any other NK or NH.
template <int NH, int NK>
inline void score_keys(const float* const* q, const float* const* keys, int64_t j0, int64_t d, float scale,
                       float* const* scores) {
  __m256 acc[NK][NH];
  for (int k = 0; k < NK; ++k)
    for (int h = 0; h < NH; ++h) acc[k][h] = _mm256_setzero_ps();
  int64_t i = 0;
  for (int k = 0; k < NK; ++k)  // the rows a few keys ahead: each key row is a miss of its own otherwise
    for (int64_t b = 0; b < d; b += 16) _mm_prefetch(reinterpret_cast<const char*>(keys[j0 + k + kAhead] + b), _MM_HINT_T0);
  for (; i + 8 <= d; i += 8)
    for (int k = 0; k < NK; ++k) {
      const __m256 kv = _mm256_loadu_ps(keys[j0 + k] + i);
      for (int h = 0; h < NH; ++h) acc[k][h] = _mm256_fmadd_ps(_mm256_loadu_ps(q[h] + i), kv, acc[k][h]);
    }
  for (int k = 0; k < NK; ++k)
    for (int h = 0; h < NH; ++h) {
      float s = hsum(acc[k][h]);
      for (int64_t t = i; t < d; ++t) s = std::fma(q[h][t], keys[j0 + k][t], s);
      scores[h][j0 + k] = s * scale;
    }
}

#ifdef SMARTSPEC_AVX512
// score_keys for 4 keys, two a 16-lane vector (key j in lanes 0-7, key j + 1 in lanes 8-15): each lane runs the
// 8-lane chain of score_keys, and hsum's tree is taken four keys at a time, so these are score_keys' bits with
// half the FMAs, twice the chains and fewer shuffles. d a multiple of 8.
template <int NH>
inline void score_keys4(const float* const* q, const float* const* keys, int64_t j0, int64_t d, float scale,
                        float* const* scores) {
  __m512 acc[2][NH];
  for (int k = 0; k < 2; ++k)
    for (int h = 0; h < NH; ++h) acc[k][h] = _mm512_setzero_ps();
  for (int k = 0; k < 4; ++k)
    for (int64_t b = 0; b < d; b += 16) _mm_prefetch(reinterpret_cast<const char*>(keys[j0 + k + kAhead] + b), _MM_HINT_T0);
  for (int64_t i = 0; i < d; i += 8) {
    const __m512 k01 = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(keys[j0] + i)),
                                          _mm256_loadu_ps(keys[j0 + 1] + i), 1);
    const __m512 k23 = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(keys[j0 + 2] + i)),
                                          _mm256_loadu_ps(keys[j0 + 3] + i), 1);
    for (int h = 0; h < NH; ++h) {
      const __m512 qh = _mm512_broadcast_f32x8(_mm256_loadu_ps(q[h] + i));
      acc[0][h] = _mm512_fmadd_ps(qh, k01, acc[0][h]);
      acc[1][h] = _mm512_fmadd_ps(qh, k23, acc[1][h]);
    }
  }
  const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int h = 0; h < NH; ++h) {
    // 128-bit quarters: acc[0] = (key 0 lanes 0-3, 4-7, key 1 lanes 0-3, 4-7), acc[1] the same for keys 2, 3
    const __m512 lo = _mm512_shuffle_f32x4(acc[0][h], acc[1][h], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 hi = _mm512_shuffle_f32x4(acc[0][h], acc[1][h], _MM_SHUFFLE(3, 1, 3, 1));
    __m512 s = _mm512_add_ps(lo, hi);                                   // (0+4, 1+5, 2+6, 3+7) a key
    s = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(3, 2, 3, 2)));  // (a+c, b+d)
    s = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(1, 1, 1, 1)));  // x+y
    s = _mm512_mul_ps(s, _mm512_set1_ps(scale));
    _mm_storeu_ps(scores[h] + j0, _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, s)));
  }
}
#endif

template <int NH>
void score_all(const float* const* q, const float* const* keys, int64_t n, int64_t d, float scale,
               float* const* scores) {
  constexpr int NK = NH == 1 ? 4 : NH <= 4 ? 2 : 1;  // independent chains enough to keep both FMA ports busy
  int64_t j = 0;
#ifdef SMARTSPEC_AVX512
  if (d % 8 == 0)
    for (; j + 4 <= n; j += 4) score_keys4<NH>(q, keys, j, d, scale, scores);
#endif
  for (; j + NK <= n; j += NK) score_keys<NH, NK>(q, keys, j, d, scale, scores);
  for (; j < n; ++j) score_keys<NH, 1>(q, keys, j, d, scale, scores);
}

using ScoreFn = void (*)(const float* const*, const float* const*, int64_t, int64_t, float, float* const*);
constexpr int kMaxHeads = 8;  // heads scored together (a unit of work holds at most this many)

// out[c] = sum_j w[j] * vals[j][c] for NV 8-lane slices from column c0, each a chain over j in order.
template <int NV>
inline void weigh_values(const float* w, const float* const* vals, int64_t n, int64_t c0, float* out) {
  __m256 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    for (int v = 0; v < NV; v += 2) _mm_prefetch(reinterpret_cast<const char*>(vals[j + kAhead] + c0 + 8 * v), _MM_HINT_T0);
    const __m256 e = _mm256_set1_ps(w[j]);
    for (int v = 0; v < NV; ++v) acc[v] = _mm256_fmadd_ps(e, _mm256_loadu_ps(vals[j] + c0 + 8 * v), acc[v]);
  }
  for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + c0 + 8 * v, acc[v]);
}

// Softmax of one head's n scores in place (padded to a multiple of 8 with room to spare): their exponentials, and
// the reciprocal of the exponentials' sum.
float softmax_weights(float* s, int64_t n) {
  const int64_t padded = (n + 7) / 8 * 8;
  for (int64_t j = n; j < padded; ++j) s[j] = -std::numeric_limits<float>::infinity();
  __m256 mx8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < padded; j += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(s + j));
  float mx = -std::numeric_limits<float>::infinity();
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx8);
  for (float l : lanes) mx = std::max(mx, l);
  const __m256 m = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < padded; j += 8) {
    const __m256 valid = _mm256_cmp_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(-std::numeric_limits<float>::infinity()),
                                       _CMP_NEQ_OQ);  // padding weighs exactly nothing
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m)), valid);
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  return 1.f / hsum(sum);
}

// out[c] = sum_j w[j] * vals[j][c] over columns [c, d) of one head: 8-lane chains, then scalar ones.
void weigh_rest(const float* w, const float* const* vals, int64_t n, int64_t c, int64_t d, float* out) {
  for (; c + 64 <= d; c += 64) weigh_values<8>(w, vals, n, c, out);
  for (; c + 8 <= d; c += 8) weigh_values<1>(w, vals, n, c, out);
  for (; c < d; ++c) {
    float a = 0.f;
    for (int64_t j = 0; j < n; ++j) a = std::fma(w[j], vals[j][c], a);
    out[c] = a;
  }
}

#ifdef SMARTSPEC_AVX512
// The weighted sums of NH heads over the same value rows, CB 16-lane column vectors at a time. Each column of each
// head is still one chain over j in order (the bits of weigh_values), but a value row is read once for all the
// heads: read once a head, the rows of a 200-token context came from L2 six times over, and that was the bound.
template <int NH, int CB>
inline void weigh_block(const float* const* w, const float* const* vals, int64_t n, int64_t c0, float* const* out) {
  __m512 acc[NH][CB];
  for (int h = 0; h < NH; ++h)
    for (int v = 0; v < CB; ++v) acc[h][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m512 row[CB];
    for (int v = 0; v < CB; ++v) {
      _mm_prefetch(reinterpret_cast<const char*>(vals[j + kAhead] + c0 + 16 * v), _MM_HINT_T0);
      row[v] = _mm512_loadu_ps(vals[j] + c0 + 16 * v);
    }
    for (int h = 0; h < NH; ++h) {
      const __m512 e = _mm512_set1_ps(w[h][j]);
      for (int v = 0; v < CB; ++v) acc[h][v] = _mm512_fmadd_ps(e, row[v], acc[h][v]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int v = 0; v < CB; ++v) _mm512_storeu_ps(out[h] + c0 + 16 * v, acc[h][v]);
}

template <int NH>
void weigh_heads(const float* const* w, const float* const* vals, int64_t n, int64_t d, float* const* out) {
  constexpr int CB = NH <= 2 ? 4 : 2;  // at most 16 accumulators, enough chains to hide the FMA latency
  int64_t c = 0;
  for (; c + 16 * CB <= d; c += 16 * CB) weigh_block<NH, CB>(w, vals, n, c, out);
  for (; c + 16 <= d; c += 16) weigh_block<NH, 1>(w, vals, n, c, out);
  for (int h = 0; h < NH; ++h) weigh_rest(w[h], vals, n, c, d, out[h]);
}
#endif

// The attention outputs of nh heads from their scores (ss, padded as softmax_weights needs) and the value rows.
void softmax_values(float* const* ss, int64_t nh, const float* const* vals, int64_t n, int64_t d, float* const* out) {
  float inv[kMaxHeads];
  for (int64_t h = 0; h < nh; ++h) inv[h] = softmax_weights(ss[h], n);
#ifdef SMARTSPEC_AVX512
  using WeighFn = void (*)(const float* const*, const float* const*, int64_t, int64_t, float* const*);
  static const WeighFn by_heads[kMaxHeads + 1] = {nullptr, weigh_heads<1>, weigh_heads<2>, weigh_heads<3>,
                                                  weigh_heads<4>, weigh_heads<5>, weigh_heads<6>, weigh_heads<7>,
                                                  weigh_heads<8>};
  by_heads[nh](ss, vals, n, d, out);
#else
  for (int64_t h = 0; h < nh; ++h) weigh_rest(ss[h], vals, n, 0, d, out[h]);
#endif
  for (int64_t h = 0; h < nh; ++h)
    for (int64_t i = 0; i < d; ++i) out[h][i] *= inv[h];
}
#endif

}  // namespace

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
  const float sc = static_cast<float>(scale);
  // A unit: one token's heads of one KV head, or a part of them: enough units to share out, at most kMaxHeads each.
  const int64_t threads = at::get_num_threads();
  int64_t parts = std::max<int64_t>((group + 7) / 8, std::min<int64_t>(group, (threads + T * KVH - 1) / (T * KVH)));
  const int64_t per_part = (group + parts - 1) / parts;
  parts = (group + per_part - 1) / per_part;
  dynamic_for(T * KVH * parts, [&](int64_t u) {
    const int64_t t = u / (KVH * parts), kvh = u / parts % KVH;
    const int64_t h0 = kvh * group + u % parts * per_part, nh = std::min(per_part, kvh * group + group - h0);
    const int32_t* table = btp + sop[t] * max_blocks;
    const int64_t len = klp[t];
    const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    // the keys this token sees, in position order
    std::vector<const float*> keys, vals;
    keys.reserve(len - start); vals.reserve(len - start);
    for (int64_t p = start; p < len; ++p) {
      if (tbp && p >= tbp[t] && !((tmp[t] >> (p - tbp[t])) & 1)) continue;
      const int64_t offset = table[p / bs] * block_stride + (p % bs) * row + kvh * D;
      keys.push_back(kp + offset); vals.push_back(vp + offset);
    }
    const int64_t n = keys.size();
    if (n == 0) {  // nothing visible (a mask that hides the token itself): no keys, no output
      std::fill(op + (t * H + h0) * D, op + (t * H + h0 + nh) * D, 0.f);
      return;
    }
    for (int64_t i = 0; i < kAhead; ++i) { keys.push_back(keys.back()); vals.push_back(vals.back()); }
#ifdef SMARTSPEC_AVX2
    const int64_t padded = (n + 7) / 8 * 8;
    std::vector<float> scores(nh * padded);
    const float* qs[kMaxHeads]; float* ss[kMaxHeads];
    for (int64_t h = 0; h < nh; ++h) { qs[h] = qp + (t * H + h0 + h) * D; ss[h] = scores.data() + h * padded; }
    static const ScoreFn by_heads[kMaxHeads + 1] = {nullptr, score_all<1>, score_all<2>, score_all<3>, score_all<4>,
                                                   score_all<5>, score_all<6>, score_all<7>, score_all<8>};
    by_heads[nh](qs, keys.data(), n, D, sc, ss);
    float* outs[kMaxHeads];
    for (int64_t h = 0; h < nh; ++h) outs[h] = op + (t * H + h0 + h) * D;
    softmax_values(ss, nh, vals.data(), n, D, outs);
#else
    std::vector<float> scores(n), acc(D);
    for (int64_t h = h0; h < h0 + nh; ++h) {
      const float* qv = qp + (t * H + h) * D;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        float s = 0.f;
        for (int64_t i = 0; i < D; ++i) s = std::fma(qv[i], keys[j][i], s);
        scores[j] = s * sc;
        mx = std::max(mx, scores[j]);
      }
      float denom = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const float e = std::exp(scores[j] - mx);
        denom += e;
        for (int64_t i = 0; i < D; ++i) acc[i] = std::fma(e, vals[j][i], acc[i]);
      }
      float* o = op + (t * H + h) * D;
      for (int64_t i = 0; i < D; ++i) o[i] = acc[i] * (1.f / denom);
    }
#endif
  });
  return out;
}

}  // namespace smartspec
