// Softmax attention for small heads (float32), forward and backward: rows of queries in vector registers against
// the (image, key/value head)'s keys and values packed once into L1-sized buffers, written in the merged
// [B, N, H, d] layout the output projection reads.
//
// Why not SDPA: at the study's sizes (8-12 wide heads, 17-49 tokens, a few thousand (image, head) pairs) its
// CPU kernel works in blocks meant for long sequences and wide heads and ran at 4.6-6.6 GFLOP/s on an AMD
// EPYC core (28th November 2026), 5-7% of the core's FMA peak: most of a study layer's time. Here a row
// of scores is a few vector registers. Larger heads and sequences stay on SDPA, and where SDPA is the faster
// on the running machine, a probe says so (visattn.attention.small_heads). Built by visattn.kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "simd.h"

namespace {

using visattn::lanes8_t;
constexpr int W = 8;                // floats per vector
constexpr int64_t kMaxKeys = 64;    // keys per (image, head): NB <= 8 vectors of scores
constexpr int64_t kMaxWidth = 32;   // head width: DB <= 4 vectors of output

inline int64_t blocks(int64_t n) { return (n + W - 1) / W; }

// Loops over a template constant (rows, vectors): unrolled, so their arrays of vectors live in registers.
#define UNROLL _Pragma("GCC unroll 16")

// Scores of RQ query rows q[r] (d values each, rows d apart) against the packed keys kt [d][8 NB] (columns
// past the keys 0): s[r][0 .. 8 NB) = q[r] . kt[:, j]. RQ * NB independent multiply-add chains; the keys are
// loaded as they are used, so the accumulators, the key and the queries fit AVX2's 16 registers.
template <int NB, int RQ>
VISATTN_INLINE void rows_scores_ld(const float* q, int64_t ldq, int64_t d, const float* kt, float* s) {
  lanes8_t acc[RQ][NB];
  UNROLL for (int r = 0; r < RQ; ++r)
    UNROLL for (int j = 0; j < NB; ++j) acc[r][j] = lanes8_t{};
  for (int64_t c = 0; c < d; ++c) {
    float qc[RQ];
    UNROLL for (int r = 0; r < RQ; ++r) qc[r] = q[r * ldq + c];
    UNROLL for (int j = 0; j < NB; ++j) {
      lanes8_t kv;
      std::memcpy(&kv, kt + c * NB * W + j * W, sizeof(lanes8_t));
      UNROLL for (int r = 0; r < RQ; ++r) acc[r][j] += qc[r] * kv;
    }
  }
  UNROLL for (int r = 0; r < RQ; ++r)
    UNROLL for (int j = 0; j < NB; ++j)
      std::memcpy(s + (r * NB + j) * W, &acc[r][j], sizeof(lanes8_t));
}
template <int NB, int RQ>
VISATTN_INLINE void rows_scores(const float* q, int64_t d, const float* kt, float* s) {
  rows_scores_ld<NB, RQ>(q, d, d, kt, s);
}

// o[r][0 .. 8 DB) = sum_{n < M} p[r][n] * vp[n] for RQ rows of probabilities p (8 NB apart) and the packed
// values vp [M][8 DB]. With few accumulators (RQ * DB < 8) the keys are summed in P interleaved partial sums,
// so the chains still overlap.
template <int NB, int DB, int RQ>
VISATTN_INLINE void rows_values(const float* p, int64_t M, const float* vp, float* o) {
  constexpr int P = RQ * DB >= 8 ? 1 : 2;
  lanes8_t acc[P][RQ][DB];
  UNROLL for (int u = 0; u < P; ++u)
    UNROLL for (int r = 0; r < RQ; ++r)
      UNROLL for (int j = 0; j < DB; ++j) acc[u][r][j] = lanes8_t{};
  int64_t n = 0;
  for (; n + P <= M; n += P)
    UNROLL for (int u = 0; u < P; ++u)
      UNROLL for (int j = 0; j < DB; ++j) {
        lanes8_t vv;
        std::memcpy(&vv, vp + (n + u) * DB * W + j * W, sizeof(lanes8_t));
        UNROLL for (int r = 0; r < RQ; ++r) acc[u][r][j] += p[r * NB * W + n + u] * vv;
      }
  for (; n < M; ++n)
    UNROLL for (int j = 0; j < DB; ++j) {
      lanes8_t vv;
      std::memcpy(&vv, vp + n * DB * W + j * W, sizeof(lanes8_t));
      UNROLL for (int r = 0; r < RQ; ++r) acc[0][r][j] += p[r * NB * W + n] * vv;
    }
  UNROLL for (int r = 0; r < RQ; ++r)
    UNROLL for (int j = 0; j < DB; ++j) {
      lanes8_t total = acc[0][r][j];
      UNROLL for (int u = 1; u < P; ++u) total += acc[u][r][j];
      std::memcpy(o + (r * DB + j) * W, &total, sizeof(lanes8_t));
    }
}

// The maximum / the sum of v's lanes, in every lane (three shuffles, not a pass over the lanes in memory).
VISATTN_INLINE lanes8_t lane_max(lanes8_t v) {
  const visattn::int_lanes8_t half{4, 5, 6, 7, 0, 1, 2, 3}, pair{2, 3, 0, 1, 6, 7, 4, 5}, one{1, 0, 3, 2, 5, 4, 7, 6};
  lanes8_t w = __builtin_shuffle(v, half);
  v = v < w ? w : v;
  w = __builtin_shuffle(v, pair);
  v = v < w ? w : v;
  w = __builtin_shuffle(v, one);
  return v < w ? w : v;
}
VISATTN_INLINE lanes8_t lane_sum(lanes8_t v) {
  const visattn::int_lanes8_t half{4, 5, 6, 7, 0, 1, 2, 3}, pair{2, 3, 0, 1, 6, 7, 4, 5}, one{1, 0, 3, 2, 5, 4, 7, 6};
  v += __builtin_shuffle(v, half);
  v += __builtin_shuffle(v, pair);
  return v + __builtin_shuffle(v, one);
}

// The row of scores s (8 NB, the M first are the keys') -> exp(s - max) there and 0 past the keys; returns
// 1 / their sum. keep: 1 in the lanes of the keys, 0 past them; below: 0 there, -3e38 past them.
template <int NB>
VISATTN_INLINE float row_softmax(float* s, const float* keep, const float* below) {
  lanes8_t v[NB], mx;
  UNROLL for (int j = 0; j < NB; ++j) std::memcpy(&v[j], s + j * W, sizeof(lanes8_t));
  std::memcpy(&mx, below, sizeof(lanes8_t));
  mx += v[0];
  UNROLL for (int j = 1; j < NB; ++j) {
    lanes8_t b;
    std::memcpy(&b, below + j * W, sizeof(lanes8_t));
    b += v[j];
    mx = mx < b ? b : mx;
  }
  mx = lane_max(mx);
  const float m = mx[0];
  lanes8_t sum{};
  UNROLL for (int j = 0; j < NB; ++j) {
    lanes8_t k;
    std::memcpy(&k, keep + j * W, sizeof(lanes8_t));
    v[j] = visattn::exp_le0(v[j] - m) * k;
    sum += v[j];
    std::memcpy(s + j * W, &v[j], sizeof(lanes8_t));
  }
  return 1.f / lane_sum(sum)[0];
}

struct Args {
  int64_t H, Hkv, N, M, d;
  const float *q, *k, *v;
  int64_t qs[3], ks[3], vs[3];     // strides over (image, head, token); 1 over the width
  float scale;
  float* out;                      // [B, N, H, d]
  const float* gates;              // [B, N, H] or null: a query row whose gate is 0 is skipped (written 0)
  int64_t gs[3];                   // gates' strides over (image, token, head)
  bool scale_rows;                 // each output row multiplied by its gate (MoH's gated heads)
};

// The gate each output row of image b is multiplied by: 1 (exact, so ungated rows are unchanged bit for bit) unless
// the rows are scaled.
VISATTN_INLINE float row_scale(const Args& a, int64_t b, int64_t i, int64_t h) {
  return a.scale_rows ? a.gates[b * a.gs[0] + i * a.gs[1] + h * a.gs[2]] : 1.f;
}

constexpr int kRows = 4;  // query rows per step

// Rows i0 .. i0 + 4 of qg, the attended queries of head h (scaled, [rows rounded up to 4, d]; rows past `count`
// are 0 and not written out), row i being query token idx[i], into the image's output ob [N, H, d]. Scores of
// RQS rows at a time, values of RQV rows at a time. A row's arithmetic does not depend on the rows beside it.
template <int NB, int DB>
VISATTN_INLINE void attend_rows(const Args& a, int64_t b, int64_t h, int64_t i0, int64_t count, const int64_t* idx,
                                const float* qg, const float* kt, const float* vp, const float* keep,
                                const float* below, float* s, float* o, float* ob) {
  constexpr int RQS = NB <= 2 ? 4 : (NB <= 6 ? 2 : 1), RQV = DB <= 2 ? 4 : 2;
  const int64_t d = a.d;
  UNROLL for (int r = 0; r < kRows; r += RQS)
    rows_scores<NB, RQS>(qg + (i0 + r) * d, d, kt, s + r * NB * W);
  float norm[kRows];
  UNROLL for (int r = 0; r < kRows; ++r) norm[r] = row_softmax<NB>(s + r * NB * W, keep, below);
  UNROLL for (int r = 0; r < kRows; r += RQV)
    rows_values<NB, DB, RQV>(s + r * NB * W, a.M, vp, o + r * DB * W);
  const int rows = static_cast<int>(std::min<int64_t>(kRows, count - i0));
  for (int r = 0; r < rows; ++r) {
    const int64_t i = idx[i0 + r];
    const float g = row_scale(a, b, i, h);  // after the normalisation: the product a gated merge would compute
    float* dst = ob + (i * a.H + h) * d;
    for (int64_t c = 0; c < d; ++c) dst[c] = o[r * DB * W + c] * norm[r] * g;
  }
}

// An image's queries, keys and values read in the order they lie in memory: gather(h, row) for every attended row of
// every head (row `row` of head h is query token idx[h N + row], rows in token order, counts[h] of them) and pack(n, g)
// for every key token n and key/value head g. Where a token's heads lie side by side in q and k and the keys are the
// queries' tokens (a layer's packed projection), in one pass token by token: the token's query rows, then its keys
// and values. Else the keys and values, then the queries, each token by token where a token's heads lie side by side,
// else head by head. On an AMD EPYC (Zen 3) at the study classifier's layer, the two passes over a packed projection
// (each skipping part of every row) took 1.06-1.10x the one pass's time in the forward and 1.09-1.12x in the
// backward, and 1.20-1.34x in the forward where the rows carry the router's 16 logit columns, a cache line that no
// pass reads; at the study DiT's 49 tokens 1.02-1.05x (docs/benchmarks.md, 26th session). filled: scratch of H.
template <typename Gather, typename Pack>
VISATTN_INLINE void read_image(const Args& a, int64_t N, int64_t M, int64_t H, int64_t Hkv, const int64_t* idx,
                               const int64_t* counts, int64_t* filled, Gather&& gather, Pack&& pack) {
  const bool q_by_token = a.qs[1] <= a.qs[2], k_by_token = a.ks[1] <= a.ks[2];
  std::fill(filled, filled + H, 0);
  const auto token_rows = [&](int64_t i) {
    for (int64_t h = 0; h < H; ++h) {
      int64_t& row = filled[h];
      if (row < counts[h] && idx[h * N + row] == i) gather(h, row++);
    }
  };
  if (q_by_token && k_by_token && M == N) {
    for (int64_t n = 0; n < N; ++n) {
      token_rows(n);
      for (int64_t g = 0; g < Hkv; ++g) pack(n, g);
    }
    return;
  }
  if (k_by_token) {
    for (int64_t n = 0; n < M; ++n)
      for (int64_t g = 0; g < Hkv; ++g) pack(n, g);
  } else {
    for (int64_t g = 0; g < Hkv; ++g)
      for (int64_t n = 0; n < M; ++n) pack(n, g);
  }
  if (q_by_token) {
    for (int64_t i = 0; i < N; ++i) token_rows(i);
  } else {
    for (int64_t h = 0; h < H; ++h)
      for (int64_t row = 0; row < counts[h]; ++row) gather(h, row);
  }
}

// A thread's buffers, sized (and zeroed) on its first image only: every image overwrites the keys' and values'
// first M rows and d columns, so their padding stays 0.
struct Scratch {
  std::vector<float> f;
  std::vector<int64_t> rows;
};

// Every head of image b. Its query, key and value rows are read in memory order (read_image: in a layer's packed
// projection in one pass token by token, a token's heads side by side; head by head where each head's tokens are
// contiguous), which the hardware prefetchers follow. On an AMD EPYC (Zen 3), reading the packed projection head by
// head, a token's row apart, stalled on the caches for about a third of the kernel's time (perf), and [B, H, N, d]
// tensors read token by token took 1.4x the packed projection's time, head by head 0.9x. Then per head: the query
// rows whose gate is not 0 attended four at a time, into the image's [N, H, d] output, copied out whole.
template <int NB, int DB>
VISATTN_INLINE void attend_image(const Args& a, int64_t b, Scratch& scratch) {
  const int64_t d = a.d, M = a.M, N = a.N, H = a.H, Hkv = a.Hkv, group = H / Hkv;
  const int64_t N4 = (N + kRows - 1) / kRows * kRows;
  const int64_t kt_size = d * NB * W, vp_size = M * DB * W;
  const size_t size = Hkv * (kt_size + vp_size) + H * N4 * d + 2 * NB * W + kRows * (NB + DB) * W + N * H * d;
  const bool fresh = scratch.f.size() != size;
  if (fresh) {
    scratch.f.assign(size, 0.f);
    scratch.rows.assign(H * (N + 2), 0);
  }
  float *kt = scratch.f.data(), *vp = kt + Hkv * kt_size, *qg = vp + Hkv * vp_size, *keep = qg + H * N4 * d;
  float *below = keep + NB * W, *s = below + NB * W, *o = s + kRows * NB * W, *ob = o + kRows * DB * W;
  if (fresh)
    for (int64_t n = 0; n < NB * W; ++n) {
      keep[n] = n < M ? 1.f : 0.f;
      below[n] = n < M ? 0.f : -3.0e38f;
    }
  int64_t *idx = scratch.rows.data(), *counts = idx + H * N, *filled = counts + H;  // per head: its rows, count
  std::fill(counts, counts + 2 * H, 0);
  int64_t any = 0;
  for (int64_t i = 0; i < N; ++i)
    for (int64_t h = 0; h < H; ++h) {
      if (a.gates != nullptr && a.gates[b * a.gs[0] + i * a.gs[1] + h * a.gs[2]] == 0.f) {
        std::fill(ob + (i * H + h) * d, ob + (i * H + h + 1) * d, 0.f);
      } else {
        idx[h * N + counts[h]++] = i;
        ++any;
      }
    }
  if (any > 0) {
    const float *kb = a.k + b * a.ks[0], *vb = a.v + b * a.vs[0], *qb = a.q + b * a.qs[0];
    const auto pack = [&](int64_t n, int64_t g) {
      const float *kr = kb + n * a.ks[2] + g * a.ks[1], *vr = vb + n * a.vs[2] + g * a.vs[1];
      float *ktg = kt + g * kt_size, *vpg = vp + g * vp_size + n * DB * W;
      for (int64_t c = 0; c < d; ++c) {
        ktg[c * NB * W + n] = kr[c];
        vpg[c] = vr[c];
      }
    };
    const auto gather = [&](int64_t h, int64_t row) {
      const float* qr = qb + idx[h * N + row] * a.qs[2] + h * a.qs[1];
      float* dst = qg + (h * N4 + row) * d;
      for (int64_t c = 0; c < d; ++c) dst[c] = qr[c] * a.scale;
    };
    read_image(a, N, M, H, Hkv, idx, counts, filled, gather, pack);
    for (int64_t h = 0; h < H; ++h) {
      const int64_t count = counts[h], count4 = (count + kRows - 1) / kRows * kRows;
      float* qh = qg + h * N4 * d;
      std::fill(qh + count * d, qh + count4 * d, 0.f);
      const float *kth = kt + (h / group) * kt_size, *vph = vp + (h / group) * vp_size;
      for (int64_t i0 = 0; i0 < count; i0 += kRows)
        attend_rows<NB, DB>(a, b, h, i0, count, idx + h * N, qh, kth, vph, keep, below, s, o, ob);
    }
  }
  std::memcpy(a.out + b * N * H * d, ob, N * H * d * sizeof(float));
}

template <int NB>
VISATTN_INLINE void attend_image_db(const Args& a, int64_t b, Scratch& scratch) {
  switch (blocks(a.d)) {
    case 1: return attend_image<NB, 1>(a, b, scratch);
    case 2: return attend_image<NB, 2>(a, b, scratch);
    case 3: return attend_image<NB, 3>(a, b, scratch);
    default: return attend_image<NB, 4>(a, b, scratch);
  }
}

// Compiled per instruction set (the templates above are inlined into each clone).
VISATTN_SIMD_CLONES void attend_one_image(const Args& a, int64_t b, Scratch& scratch) {
  switch (blocks(a.M)) {
    case 1: return attend_image_db<1>(a, b, scratch);
    case 2: return attend_image_db<2>(a, b, scratch);
    case 3: return attend_image_db<3>(a, b, scratch);
    case 4: return attend_image_db<4>(a, b, scratch);
    case 5: return attend_image_db<5>(a, b, scratch);
    case 6: return attend_image_db<6>(a, b, scratch);
    case 7: return attend_image_db<7>(a, b, scratch);
    default: return attend_image_db<8>(a, b, scratch);
  }
}

// The arguments of small_attention and its backward, checked.
void check_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& gates) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "small_attention: q, k, v must be [B, H, N, d]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "small_attention: float32 only");
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), d = q.size(3), Hkv = k.size(1), M = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == M && k.size(3) == d &&
                  v.size(3) == d && Hkv > 0 && H % Hkv == 0,
              "small_attention: k and v must be [B, Hkv, M, d] with H a multiple of Hkv");
  TORCH_CHECK(M >= 1 && M <= kMaxKeys && d >= 1 && d <= kMaxWidth, "small_attention: needs 1 <= keys <= ",
              kMaxKeys, " and 1 <= head width <= ", kMaxWidth, ", got ", M, " and ", d);
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "small_attention: the head width must be contiguous in q, k and v");
  if (gates.has_value())
    TORCH_CHECK(gates->dim() == 3 && gates->size(0) == B && gates->size(1) == N && gates->size(2) == H &&
                    gates->scalar_type() == at::kFloat,
                "small_attention: gates must be float32 [B, N, H] = [", B, ", ", N, ", ", H, "], got ",
                gates->scalar_type(), " ", gates->sizes());
}

Args forward_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                  const std::optional<at::Tensor>& gates, bool scale_rows, float* out) {
  TORCH_CHECK(gates.has_value() || !scale_rows, "small_attention: scale_rows needs the gates");
  const bool gated = gates.has_value();
  return Args{q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), q.data_ptr<float>(), k.data_ptr<float>(),
              v.data_ptr<float>(), {q.stride(0), q.stride(1), q.stride(2)},
              {k.stride(0), k.stride(1), k.stride(2)}, {v.stride(0), v.stride(1), v.stride(2)},
              static_cast<float>(scale), out, gated ? gates->data_ptr<float>() : nullptr,
              {gated ? gates->stride(0) : 0, gated ? gates->stride(1) : 0, gated ? gates->stride(2) : 0}, scale_rows};
}

// softmax(q k^T * scale) v per (image, head). q: [B, H, N, d], k / v: [B, Hkv, M, d] (H a multiple of Hkv; any
// strides with the width contiguous), float32, M <= 64, d <= 32; gates: [B, N, H] float32 (any strides) or none:
// where a gate is 0 the query row is not attended and its output is 0 (MoH's unselected heads, whose output the
// gate zeroes anyway). -> [B, H, N, d], a view of a [B, N, H, d] tensor (the merged heads). The other rows are
// equal bit for bit to what they are without gates; with scale_rows each is multiplied by its gate as it is written
// (the gated heads MoH merges, equal bit for bit to that product taken after), so the merge is a view.
at::Tensor small_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                           const std::optional<at::Tensor>& gates, bool scale_rows) {
  check_args(q, k, v, gates);
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), d = q.size(3);
  at::Tensor out = at::empty({B, N, H, d}, q.options());
  const Args a = forward_args(q, k, v, scale, gates, scale_rows, out.data_ptr<float>());
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    Scratch scratch;
    for (int64_t b = b0; b < b1; ++b) attend_one_image(a, b, scratch);
  });
  return out.transpose(1, 2);
}

// ---- The backward (training) ----
// Per (image, head), for the rows attended in the forward: the scores and probabilities p recomputed, dp = dO V^T,
// ds = p (dp - sum_j p_j dp_j) (sum_j p_j dp_j = dO . O, without reading O), dq = scale ds K, dK += ds^T (q scale),
// dV += p^T dO. A row gated 0 was written 0 in the forward and has no gradient (its dO is 0 too where the gates
// multiplied the heads, so skipping it changes nothing). With scale_rows (the forward wrote g O, g the row's gate)
// the dO read is the gated output's: the gate's gradient is dO . O = sum_j p_j dp_j, the D above, and the row's
// ds and its share of dV are g times what they are ungated.

struct BackArgs {
  Args f;                          // the forward's arguments (out unused)
  const float* go;                 // dO: [B, H, N, d] with strides gos over (image, head, token)
  int64_t gos[3];
  float *dq, *dk, *dv;             // [B, N, H, d], [B, M, Hkv, d], [B, M, Hkv, d]
  float* dgates;                   // [B, N, H] with scale_rows (rows gated 0 left as they are), else null
};

// acc[r][0 .. 8 DB) += sum_{i < count} a[i][j0 + r] * x[i] (r < RK) and likewise for b and y: two sums of outer
// products over the rows, the rows of a / b lda apart, of x / y 8 DB apart (padded rows).
template <int DB, int RK>
VISATTN_INLINE void outer_sums(int64_t j0, int64_t count, const float* a, const float* b, int64_t lda,
                               const float* x, const float* y, float* da, float* db) {
  lanes8_t acc_a[RK][DB], acc_b[RK][DB];
  UNROLL for (int r = 0; r < RK; ++r)
    UNROLL for (int c = 0; c < DB; ++c) {
      std::memcpy(&acc_a[r][c], da + (j0 + r) * DB * W + c * W, sizeof(lanes8_t));
      std::memcpy(&acc_b[r][c], db + (j0 + r) * DB * W + c * W, sizeof(lanes8_t));
    }
  for (int64_t i = 0; i < count; ++i) {
    lanes8_t xv[DB], yv[DB];
    UNROLL for (int c = 0; c < DB; ++c) {
      std::memcpy(&xv[c], x + i * DB * W + c * W, sizeof(lanes8_t));
      std::memcpy(&yv[c], y + i * DB * W + c * W, sizeof(lanes8_t));
    }
    UNROLL for (int r = 0; r < RK; ++r) {
      const float ar = a[i * lda + j0 + r], br = b[i * lda + j0 + r];
      UNROLL for (int c = 0; c < DB; ++c) {
        acc_a[r][c] += ar * xv[c];
        acc_b[r][c] += br * yv[c];
      }
    }
  }
  UNROLL for (int r = 0; r < RK; ++r)
    UNROLL for (int c = 0; c < DB; ++c) {
      std::memcpy(da + (j0 + r) * DB * W + c * W, &acc_a[r][c], sizeof(lanes8_t));
      std::memcpy(db + (j0 + r) * DB * W + c * W, &acc_b[r][c], sizeof(lanes8_t));
    }
}

struct BackScratch {
  std::vector<float> f;
  std::vector<int64_t> rows;
};

template <int NB, int DB>
VISATTN_INLINE void backward_image(const BackArgs& ba, int64_t b, BackScratch& scratch) {
  const Args& a = ba.f;
  const int64_t d = a.d, M = a.M, N = a.N, H = a.H, Hkv = a.Hkv, group = H / Hkv;
  const int64_t N4 = (N + kRows - 1) / kRows * kRows, L = NB * W, R = DB * W;
  const int64_t kv_size = 2 * d * L + M * R;  // per key/value head: K^T [d][L], V^T [d][L], K [M][R]
  const size_t size = Hkv * kv_size + 2 * Hkv * M * R + 2 * H * N4 * R + 2 * N4 * L + 2 * L + kRows * (L + R) +
                      N * H * d;
  const bool fresh = scratch.f.size() != size;
  if (fresh) {
    scratch.f.assign(size, 0.f);
    scratch.rows.assign(H * (N + 2), 0);
  }
  float *kv = scratch.f.data(), *dkv = kv + Hkv * kv_size, *qg = dkv + 2 * Hkv * M * R, *gg = qg + H * N4 * R;
  float *P = gg + H * N4 * R, *DS = P + N4 * L, *keep = DS + N4 * L, *below = keep + L, *dp = below + L;
  float *o = dp + kRows * L, *dqb = o + kRows * R;
  if (fresh)
    for (int64_t n = 0; n < L; ++n) {
      keep[n] = n < M ? 1.f : 0.f;
      below[n] = n < M ? 0.f : -3.0e38f;
    }
  int64_t *idx = scratch.rows.data(), *counts = idx + H * N, *filled = counts + H;
  std::fill(counts, counts + 2 * H, 0);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t h = 0; h < H; ++h) {
      if (a.gates != nullptr && a.gates[b * a.gs[0] + i * a.gs[1] + h * a.gs[2]] == 0.f)
        std::fill(dqb + (i * H + h) * d, dqb + (i * H + h + 1) * d, 0.f);
      else
        idx[h * N + counts[h]++] = i;
    }
  std::fill(dkv, dkv + 2 * Hkv * M * R, 0.f);
  const float *kb = a.k + b * a.ks[0], *vb = a.v + b * a.vs[0], *qb = a.q + b * a.qs[0], *gb = ba.go + b * ba.gos[0];
  // per key/value head its keys and values packed as K^T, V^T and K, and every head's attended query rows (scaled)
  // with their dO rows [H][N4][R], read in memory order as the forward reads them (gathered head by head from a packed
  // projection, the queries' and dO's loads took a fifth of the backward's time)
  const auto pack = [&](int64_t n, int64_t g) {
    float *kt = kv + g * kv_size, *vt = kt + d * L, *kp = vt + d * L;
    const float *kr = kb + n * a.ks[2] + g * a.ks[1], *vr = vb + n * a.vs[2] + g * a.vs[1];
    for (int64_t c = 0; c < d; ++c) {
      kt[c * L + n] = kr[c];
      vt[c * L + n] = vr[c];
      kp[n * R + c] = kr[c];
    }
  };
  const auto gather = [&](int64_t h, int64_t row) {
    const int64_t i = idx[h * N + row];
    const float *qr = qb + i * a.qs[2] + h * a.qs[1], *gr = gb + i * ba.gos[2] + h * ba.gos[1];
    float *qd = qg + (h * N4 + row) * R, *gd = gg + (h * N4 + row) * R;
    for (int64_t c = 0; c < d; ++c) {
      qd[c] = qr[c] * a.scale;
      gd[c] = gr[c];
    }
  };
  read_image(a, N, M, H, Hkv, idx, counts, filled, gather, pack);
  constexpr int RQS = NB <= 2 ? 4 : (NB <= 6 ? 2 : 1), RQV = DB <= 2 ? 4 : 2;
  constexpr int RK = DB == 1 ? 4 : (DB == 2 ? 2 : 1);
  for (int64_t h = 0; h < H; ++h) {
    const int64_t count = counts[h], count4 = (count + kRows - 1) / kRows * kRows;
    if (count == 0) continue;
    const int64_t g = h / group;
    const float *kt = kv + g * kv_size, *vt = kt + d * L, *kp = vt + d * L;
    float *dk = dkv + g * M * R, *dv = dkv + (Hkv + g) * M * R, *qh = qg + h * N4 * R, *gh = gg + h * N4 * R;
    std::fill(qh + count * R, qh + count4 * R, 0.f);
    std::fill(gh + count * R, gh + count4 * R, 0.f);
    for (int64_t i0 = 0; i0 < count; i0 += kRows) {
      float *s = P + i0 * L, *ds = DS + i0 * L;
      UNROLL for (int r = 0; r < kRows; r += RQS) {
        rows_scores_ld<NB, RQS>(qh + (i0 + r) * R, R, d, kt, s + r * L);
        rows_scores_ld<NB, RQS>(gh + (i0 + r) * R, R, d, vt, dp + r * L);
      }
      UNROLL for (int r = 0; r < kRows; ++r) {
        const float norm = row_softmax<NB>(s + r * L, keep, below);
        const bool real = i0 + r < count;  // not a padding row
        const float g = real ? row_scale(a, b, idx[h * N + i0 + r], h) : 1.f;
        lanes8_t pv[NB], dpv[NB], dot{};
        UNROLL for (int j = 0; j < NB; ++j) {
          std::memcpy(&pv[j], s + r * L + j * W, sizeof(lanes8_t));
          std::memcpy(&dpv[j], dp + r * L + j * W, sizeof(lanes8_t));
          pv[j] *= norm;
          dot += pv[j] * dpv[j];
        }
        const float D = lane_sum(dot)[0];
        if (ba.dgates != nullptr && real) ba.dgates[(b * N + idx[h * N + i0 + r]) * H + h] = D;
        UNROLL for (int j = 0; j < NB; ++j) {
          const lanes8_t dsv = pv[j] * ((dpv[j] - D) * g), pg = pv[j] * g;  // g = 1 ungated: exact
          std::memcpy(s + r * L + j * W, &pg, sizeof(lanes8_t));
          std::memcpy(ds + r * L + j * W, &dsv, sizeof(lanes8_t));
        }
      }
      UNROLL for (int r = 0; r < kRows; r += RQV) rows_values<NB, DB, RQV>(ds + r * L, M, kp, o + r * R);
      const int rows = static_cast<int>(std::min<int64_t>(kRows, count - i0));
      for (int r = 0; r < rows; ++r) {
        float* dst = dqb + (idx[h * N + i0 + r] * H + h) * d;
        for (int64_t c = 0; c < d; ++c) dst[c] = o[r * R + c] * a.scale;
      }
    }
    int64_t j0 = 0;
    for (; j0 + RK <= M; j0 += RK) outer_sums<DB, RK>(j0, count, DS, P, L, qh, gh, dk, dv);
    for (; j0 < M; ++j0) outer_sums<DB, 1>(j0, count, DS, P, L, qh, gh, dk, dv);
  }
  std::memcpy(ba.dq + b * N * H * d, dqb, N * H * d * sizeof(float));
  float *dko = ba.dk + b * M * Hkv * d, *dvo = ba.dv + b * M * Hkv * d;
  for (int64_t n = 0; n < M; ++n)
    for (int64_t g = 0; g < Hkv; ++g) {
      std::memcpy(dko + (n * Hkv + g) * d, dkv + (g * M + n) * R, d * sizeof(float));
      std::memcpy(dvo + (n * Hkv + g) * d, dkv + ((Hkv + g) * M + n) * R, d * sizeof(float));
    }
}

// The backward's templates are fewer than the forward's (the build's time): the width in 1, 2 or 4 vectors and the
// keys in 1-4, 6 or 8 (padded lanes are masked as past the keys), and two clones.
template <int NB>
VISATTN_INLINE void backward_image_db(const BackArgs& a, int64_t b, BackScratch& scratch) {
  switch (blocks(a.f.d)) {
    case 1: return backward_image<NB, 1>(a, b, scratch);
    case 2: return backward_image<NB, 2>(a, b, scratch);
    default: return backward_image<NB, 4>(a, b, scratch);
  }
}

VISATTN_SIMD_CLONES_V3 void backward_one_image(const BackArgs& a, int64_t b, BackScratch& scratch) {
  switch (blocks(a.f.M)) {
    case 1: return backward_image_db<1>(a, b, scratch);
    case 2: return backward_image_db<2>(a, b, scratch);
    case 3: return backward_image_db<3>(a, b, scratch);
    case 4: return backward_image_db<4>(a, b, scratch);
    case 5:
    case 6: return backward_image_db<6>(a, b, scratch);
    default: return backward_image_db<8>(a, b, scratch);
  }
}

// small_attention's backward: grad_out [B, H, N, d] (any strides, the width contiguous) and the forward's q, k, v,
// scale, gates and scale_rows -> (dq [B, H, N, d] (a view of [B, N, H, d]), dk and dv [B, Hkv, M, d] (views of
// [B, M, Hkv, d]), d gates [B, N, H] with scale_rows, else empty). Rows whose gate is 0 get dq = 0, add nothing to
// dk and dv, and get a gate gradient of 0, not dO . O: pass gates only where that is the gradient through them (MoH's
// soft gates, 0 wherever a head is unselected), not for straight-through ones.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> small_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
    const std::optional<at::Tensor>& gates, bool scale_rows) {
  check_args(q, k, v, gates);
  TORCH_CHECK(grad_out.sizes() == q.sizes() && grad_out.scalar_type() == at::kFloat && grad_out.stride(3) == 1,
              "small_attention_backward: grad_out must be float32 shaped as q, the width contiguous");
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), d = q.size(3), Hkv = k.size(1), M = k.size(2);
  at::Tensor dq = at::empty({B, N, H, d}, q.options()), dk = at::empty({B, M, Hkv, d}, q.options());
  at::Tensor dv = at::empty({B, M, Hkv, d}, q.options());
  at::Tensor dgates = scale_rows ? at::zeros({B, N, H}, q.options()) : at::empty({0}, q.options());
  const BackArgs ba{forward_args(q, k, v, scale, gates, scale_rows, nullptr), grad_out.data_ptr<float>(),
                    {grad_out.stride(0), grad_out.stride(1), grad_out.stride(2)}, dq.data_ptr<float>(),
                    dk.data_ptr<float>(), dv.data_ptr<float>(), scale_rows ? dgates.data_ptr<float>() : nullptr};
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    BackScratch scratch;
    for (int64_t b = b0; b < b1; ++b) backward_one_image(ba, b, scratch);
  });
  return {dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), dgates};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(visattn, m) {
  m.def("small_attention(Tensor q, Tensor k, Tensor v, float scale, Tensor? gates=None, bool scale_rows=False) "
        "-> Tensor");
  m.def("small_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, float scale, Tensor? gates=None, "
        "bool scale_rows=False) -> (Tensor, Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(visattn, CPU, m) {
  m.impl("small_attention", &small_attention);
  m.impl("small_attention_backward", &small_attention_backward);
}
