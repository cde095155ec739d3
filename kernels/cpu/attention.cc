// Document-masked causal softmax attention on CPU (the MLA core): a tiled online-softmax forward
// that saves the log-sum-exp, and a backward that recomputes probabilities from it.
//
// Tiles are kBlock queries x kBlock keys. Because positions ascend and document ids never
// decrease, the keys one query sees are a contiguous run of any key tile, and the keys a query
// tile can see lie in one contiguous key range found by binary search; tiles outside it are never
// touched. Forward: one work item per (head, query tile). Backward: one item per (head, key-tile
// class), owning dk and dv of its key tiles; dq is accumulated per item and, where several items
// share a head, reduced afterwards. No two threads ever write the same value.
#include "kernels/cpu/attention.h"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/thread_local_gemm.h"

namespace spindle::kernels::cpu {
namespace {

constexpr int64_t kBlock = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using internal::ThreadLocalGemm;

// exp(x) to a few ulp for x <= 88 (Cephes' expf polynomial, as internal::FastExp), but exactly 0
// for x < -87, so masked scores (-inf) get probability 0 exactly (FastExp gives ~1e-38 there).
// Branch-free so that loops over it vectorise.
inline float ExpF(float x) {
  const float xc = std::min(std::max(x, -87.5f), 88.0f);
  const float shifted = xc * 1.44269504088896341f + 12582912.0f;  // 1.5 * 2^23 rounds to integer
  const float n = shifted - 12582912.0f;
  const uint32_t n_bits = std::bit_cast<uint32_t>(shifted) - 0x4B400000u;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float y = std::bit_cast<float>(std::bit_cast<uint32_t>(p) + (n_bits << 23));
  return x < -87.0f ? 0.0f : y;
}

// The element-wise tile loops below (SPINDLE_SIMD_CLONES, fast_math.h) are compiled for several
// instruction sets and picked at load time; they are where the time goes besides the GEMMs.

// Online-softmax step for one tile of scores s [mb, nb] (row stride kBlock): row r sees columns
// [lo[r], hi[r]). Turns s into exp(s - m_new) (0 where masked), rescales acc [mb, dv] and l by
// exp(m_old - m_new) and updates the running max m and sum l.
SPINDLE_SIMD_CLONES
void OnlineSoftmaxTile(float* s, int64_t mb, int64_t nb, const int32_t* lo, const int32_t* hi,
                       float* m, float* l, float* acc, int64_t dv) {
  for (int64_t r = 0; r < mb; ++r) {
    float* row = s + r * kBlock;
    const int64_t b = lo[r], e = hi[r];
    std::fill(row, row + b, 0.0f);
    std::fill(row + std::max(b, e), row + nb, 0.0f);
    if (e <= b) continue;
    float row_max = kNegInf;
#pragma omp simd reduction(max : row_max)
    for (int64_t j = b; j < e; ++j) row_max = std::max(row_max, row[j]);
    const float m_new = std::max(m[r], row_max);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = b; j < e; ++j) {
      row[j] = ExpF(row[j] - m_new);
      sum += row[j];
    }
    if (m_new > m[r] && m[r] != kNegInf) {
      const float corr = ExpF(m[r] - m_new);
      l[r] *= corr;
      float* a = acc + r * dv;
#pragma omp simd
      for (int64_t j = 0; j < dv; ++j) a[j] *= corr;
    }
    m[r] = m_new;
    l[r] += sum;
  }
}

// Probabilities of one backward tile: s [mb, nb] scores become exp(s - lse) inside the visible
// columns and 0 elsewhere; rows with lse = -inf (no visible key at all) become 0.
SPINDLE_SIMD_CLONES
void ProbabilityTile(float* s, int64_t mb, int64_t nb, const int32_t* lo, const int32_t* hi,
                     const float* lse) {
  for (int64_t r = 0; r < mb; ++r) {
    float* row = s + r * kBlock;
    const int64_t b = lse[r] == kNegInf ? nb : lo[r], e = std::max(b, int64_t{hi[r]});
    std::fill(row, row + b, 0.0f);
    std::fill(row + e, row + nb, 0.0f);
    const float shift = lse[r];
#pragma omp simd
    for (int64_t j = b; j < e; ++j) row[j] = ExpF(row[j] - shift);
  }
}

// ds = p * (dp - delta_r), in place over dp (row stride kBlock).
SPINDLE_SIMD_CLONES
void SoftmaxGradTile(const float* p, float* dp, int64_t mb, int64_t nb, const float* delta) {
  for (int64_t r = 0; r < mb; ++r) {
    const float* pr = p + r * kBlock;
    float* dr = dp + r * kBlock;
    const float d = delta[r];
#pragma omp simd
    for (int64_t j = 0; j < nb; ++j) dr[j] = pr[j] * (dr[j] - d);
  }
}

// For query rows [i0, i0+mb) and keys [j0, j0+nb): row r sees keys [lo[r], hi[r]) of the tile.
// Returns whether any row sees any key.
bool TileMask(const AttentionMask& mask, int64_t i0, int64_t mb, int64_t j0, int64_t nb,
              int32_t* lo, int32_t* hi) {
  const int32_t* kd = mask.k_doc + j0;
  const int32_t* kp = mask.k_pos + j0;
  bool any = false;
  for (int64_t r = 0; r < mb; ++r) {
    const int32_t doc = mask.q_doc[i0 + r], pos = mask.q_pos[i0 + r];
    const int32_t* d0 = std::lower_bound(kd, kd + nb, doc);
    const int32_t* d1 = std::upper_bound(d0, kd + nb, doc);
    const int32_t* p1 = std::upper_bound(kp + (d0 - kd), kp + (d1 - kd), pos);
    lo[r] = static_cast<int32_t>(d0 - kd);
    hi[r] = static_cast<int32_t>(p1 - kp);
    if (hi[r] <= lo[r]) hi[r] = lo[r];
    any = any || hi[r] > lo[r];
  }
  return any;
}

struct TileScratch {
  explicit TileScratch(int64_t dv) : s(kBlock * kBlock), p(kBlock * kBlock), acc(kBlock * dv) {}
  std::vector<float> s, p, acc;
  int32_t lo[kBlock], hi[kBlock];
  float m[kBlock], l[kBlock];
  float row_lse[kBlock], row_delta[kBlock];
};

void ForwardTile(const float* q, const float* k, const float* v, const AttentionMask& mask,
                 float scale, const AttentionDims& d, int64_t h, int64_t i0, float* out, float* lse,
                 TileScratch& t) {
  const int64_t H = d.H, dqk = d.Dqk, dv = d.Dv;
  const int64_t mb = std::min(kBlock, d.Tq - i0);
  const float* qt = q + (i0 * H + h) * dqk;
  std::fill(t.acc.begin(), t.acc.begin() + mb * dv, 0.0f);
  std::fill(t.m, t.m + mb, kNegInf);
  std::fill(t.l, t.l + mb, 0.0f);
  // Keys of the first query's document onwards, up to the last query's position.
  const int64_t jlo = std::lower_bound(mask.k_doc, mask.k_doc + d.Tk, mask.q_doc[i0]) - mask.k_doc;
  const int64_t jhi =
      std::upper_bound(mask.k_pos, mask.k_pos + d.Tk, mask.q_pos[i0 + mb - 1]) - mask.k_pos;
  for (int64_t j0 = jlo; j0 < jhi; j0 += kBlock) {
    const int64_t nb = std::min(kBlock, jhi - j0);
    if (!TileMask(mask, i0, mb, j0, nb, t.lo, t.hi)) continue;
    ThreadLocalGemm(false, true, mb, nb, dqk, scale, qt, H * dqk, k + (j0 * H + h) * dqk, H * dqk,
                    0.0f, t.s.data(), kBlock);
    OnlineSoftmaxTile(t.s.data(), mb, nb, t.lo, t.hi, t.m, t.l, t.acc.data(), dv);
    ThreadLocalGemm(false, false, mb, dv, nb, 1.0f, t.s.data(), kBlock, v + (j0 * H + h) * dv,
                    H * dv, 1.0f, t.acc.data(), dv);
  }
  for (int64_t r = 0; r < mb; ++r) {
    float* o = out + ((i0 + r) * H + h) * dv;
    const float* a = t.acc.data() + r * dv;
    if (t.l[r] > 0.0f) {
      const float inv = 1.0f / t.l[r];
      for (int64_t j = 0; j < dv; ++j) o[j] = a[j] * inv;
      lse[(i0 + r) * H + h] = t.m[r] + std::log(t.l[r]);
    } else {
      std::fill(o, o + dv, 0.0f);
      lse[(i0 + r) * H + h] = kNegInf;
    }
  }
}

// dk, dv of key tile [j0, j0+nb) of head h, and its contribution to dq (accumulated into dq_acc,
// row stride ld_dq).
void BackwardKeyTile(const float* q, const float* k, const float* v, const float* lse,
                     const float* dout, const float* delta, const AttentionMask& mask, float scale,
                     const AttentionDims& d, int64_t h, int64_t j0, float* dq_acc, int64_t ld_dq,
                     float* dk, float* dv_out, TileScratch& t) {
  const int64_t H = d.H, dqk = d.Dqk, dv = d.Dv;
  const int64_t nb = std::min(kBlock, d.Tk - j0);
  const float* kt = k + (j0 * H + h) * dqk;
  const float* vt = v + (j0 * H + h) * dv;
  float* dkt = dk + (j0 * H + h) * dqk;
  float* dvt = dv_out + (j0 * H + h) * dv;
  for (int64_t j = 0; j < nb; ++j) {
    std::fill(dkt + j * H * dqk, dkt + j * H * dqk + dqk, 0.0f);
    std::fill(dvt + j * H * dv, dvt + j * H * dv + dv, 0.0f);
  }
  // Queries at or after the first key's position, up to the last key's document.
  const int64_t ilo = std::lower_bound(mask.q_pos, mask.q_pos + d.Tq, mask.k_pos[j0]) - mask.q_pos;
  const int64_t ihi =
      std::upper_bound(mask.q_doc, mask.q_doc + d.Tq, mask.k_doc[j0 + nb - 1]) - mask.q_doc;
  for (int64_t i0 = ilo; i0 < ihi; i0 += kBlock) {
    const int64_t mb = std::min(kBlock, ihi - i0);
    if (!TileMask(mask, i0, mb, j0, nb, t.lo, t.hi)) continue;
    const float* qt = q + (i0 * H + h) * dqk;
    const float* gt = dout + (i0 * H + h) * dv;
    float* p = t.p.data();
    float* ds = t.s.data();
    ThreadLocalGemm(false, true, mb, nb, dqk, scale, qt, H * dqk, kt, H * dqk, 0.0f, p, kBlock);
    for (int64_t r = 0; r < mb; ++r) {
      t.row_lse[r] = lse[(i0 + r) * H + h];
      t.row_delta[r] = delta[(i0 + r) * H + h];
    }
    ProbabilityTile(p, mb, nb, t.lo, t.hi, t.row_lse);
    // dv += P^T dO; dP = dO V^T; dS = P (dP - delta).
    ThreadLocalGemm(true, false, nb, dv, mb, 1.0f, p, kBlock, gt, H * dv, 1.0f, dvt, H * dv);
    ThreadLocalGemm(false, true, mb, nb, dv, 1.0f, gt, H * dv, vt, H * dv, 0.0f, ds, kBlock);
    SoftmaxGradTile(p, ds, mb, nb, t.row_delta);
    ThreadLocalGemm(true, false, nb, dqk, mb, scale, ds, kBlock, qt, H * dqk, 1.0f, dkt, H * dqk);
    ThreadLocalGemm(false, false, mb, dqk, nb, scale, ds, kBlock, kt, H * dqk, 1.0f,
                    dq_acc + i0 * ld_dq, ld_dq);
  }
}

}  // namespace

void AttentionForward(const float* q, const float* k, const float* v, const AttentionMask& mask,
                      float scale, const AttentionDims& dims, float* out, float* lse) {
  const int64_t n_qblocks = (dims.Tq + kBlock - 1) / kBlock;
  const int64_t n_items = dims.H * n_qblocks;
#pragma omp parallel
  {
    TileScratch scratch(dims.Dv);
    // Later query tiles see more keys: hand them out first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < n_items; ++item) {
      const int64_t qb = n_qblocks - 1 - item / dims.H, h = item % dims.H;
      ForwardTile(q, k, v, mask, scale, dims, h, qb * kBlock, out, lse, scratch);
    }
  }
}

void AttentionBackward(const float* q, const float* k, const float* v, const float* out,
                       const float* lse, const float* dout, const AttentionMask& mask, float scale,
                       const AttentionDims& dims, float* dq, float* dk, float* dv) {
  const int64_t Tq = dims.Tq, H = dims.H, dqk = dims.Dqk, dvd = dims.Dv;
  // delta[t, h] = rowsum(dout * out).
  std::vector<float> delta(Tq * H);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < Tq * H; ++i) {
    const float* o = out + i * dvd;
    const float* g = dout + i * dvd;
    float sum = 0.0f;
    for (int64_t j = 0; j < dvd; ++j) sum += o[j] * g[j];
    delta[i] = sum;
  }
  // Each head's key tiles are dealt round-robin to `split` items so that H * split is a multiple
  // of the thread count; with split > 1 each item gets its own dq accumulator.
  const int64_t n_threads = omp_get_max_threads();
  const int64_t split = n_threads / std::gcd(H, n_threads);
  const int64_t n_kblocks = (dims.Tk + kBlock - 1) / kBlock;
  std::vector<float> dq_parts(split > 1 ? H * split * Tq * dqk : 0);
  const int64_t n_items = H * split;
#pragma omp parallel
  {
    TileScratch scratch(dvd);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < n_items; ++item) {
      const int64_t h = item / split, part = item % split;
      float* dq_acc;
      int64_t ld_dq;
      if (split > 1) {
        dq_acc = dq_parts.data() + item * Tq * dqk;
        ld_dq = dqk;
        std::fill(dq_acc, dq_acc + Tq * dqk, 0.0f);
      } else {
        dq_acc = dq + h * dqk;
        ld_dq = H * dqk;
        for (int64_t i = 0; i < Tq; ++i)
          std::fill(dq_acc + i * ld_dq, dq_acc + i * ld_dq + dqk, 0.0f);
      }
      for (int64_t kb = part; kb < n_kblocks; kb += split) {
        BackwardKeyTile(q, k, v, lse, dout, delta.data(), mask, scale, dims, h, kb * kBlock, dq_acc,
                        ld_dq, dk, dv, scratch);
      }
    }
    if (split > 1) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < Tq * H; ++i) {
        const int64_t t = i / H, h = i % H;
        float* dst = dq + i * dqk;
        std::fill(dst, dst + dqk, 0.0f);
        for (int64_t part = 0; part < split; ++part) {
          const float* src = dq_parts.data() + ((h * split + part) * Tq + t) * dqk;
          for (int64_t j = 0; j < dqk; ++j) dst[j] += src[j];
        }
      }
    }
  }
}

}  // namespace spindle::kernels::cpu
