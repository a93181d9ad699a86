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

template <int NH>
void score_all(const float* const* q, const float* const* keys, int64_t n, int64_t d, float scale,
               float* const* scores) {
  constexpr int NK = NH == 1 ? 4 : NH <= 4 ? 2 : 1;  // independent chains enough to keep both FMA ports busy
  int64_t j = 0;
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

// Softmax of one head's n scores in place (padded to a multiple of 8 with room to spare), then the weighted sum
// of the values into out [d].
void softmax_values(float* s, int64_t n, const float* const* vals, int64_t d, float* out) {
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
  const float inv = 1.f / hsum(sum);
  int64_t c = 0;
  for (; c + 64 <= d; c += 64) weigh_values<8>(s, vals, n, c, out);
  for (; c + 8 <= d; c += 8) weigh_values<1>(s, vals, n, c, out);
  for (; c < d; ++c) {
    float a = 0.f;
    for (int64_t j = 0; j < n; ++j) a = std::fma(s[j], vals[j][c], a);
    out[c] = a;
  }
  for (int64_t i = 0; i < d; ++i) out[i] *= inv;
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
    for (int64_t h = 0; h < nh; ++h) softmax_values(ss[h], n, vals.data(), D, op + (t * H + h0 + h) * D);
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
