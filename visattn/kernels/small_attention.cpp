// Softmax attention for small heads (float32, inference): rows of queries in vector registers against the
// (image, key/value head)'s keys and values packed once into L1-sized buffers, written in the merged
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
VISATTN_INLINE void rows_scores(const float* q, int64_t d, const float* kt, float* s) {
  lanes8_t acc[RQ][NB];
  UNROLL for (int r = 0; r < RQ; ++r)
    UNROLL for (int j = 0; j < NB; ++j) acc[r][j] = lanes8_t{};
  for (int64_t c = 0; c < d; ++c) {
    float qc[RQ];
    UNROLL for (int r = 0; r < RQ; ++r) qc[r] = q[r * d + c];
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
};

constexpr int kRows = 4;  // query rows per step

// Rows i0 .. i0 + 4 of qg, the attended queries of head h (scaled, [rows rounded up to 4, d]; rows past `count`
// are 0 and not written out), row i being query token idx[i], into the image's output ob [N, H, d]. Scores of
// RQS rows at a time, values of RQV rows at a time. A row's arithmetic does not depend on the rows beside it.
template <int NB, int DB>
VISATTN_INLINE void attend_rows(const Args& a, int64_t h, int64_t i0, int64_t count, const int64_t* idx,
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
    float* dst = ob + (idx[i0 + r] * a.H + h) * d;
    for (int64_t c = 0; c < d; ++c) dst[c] = o[r * DB * W + c] * norm[r];
  }
}

// A thread's buffers, sized (and zeroed) on its first image only: every image overwrites the keys' and values'
// first M rows and d columns, so their padding stays 0.
struct Scratch {
  std::vector<float> f;
  std::vector<int64_t> rows;
};

// Every head of image b. Its query, key and value rows are read in memory order (in a layer's packed projection
// token by token, a token's heads side by side; head by head where each head's tokens are contiguous), which the
// hardware prefetchers follow. On an AMD EPYC (Zen 3), reading the packed projection head by head, a token's row
// apart, stalled on the caches for about a third of the kernel's time (perf), and [B, H, N, d] tensors read token
// by token took 1.4x the packed projection's time, head by head 0.9x. Then per head: the query rows whose gate is
// not 0 attended four at a time, into the image's [N, H, d] output, copied out whole.
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
    if (a.ks[1] <= a.ks[2]) {  // a token's heads side by side: token by token
      for (int64_t n = 0; n < M; ++n)
        for (int64_t g = 0; g < Hkv; ++g) pack(n, g);
    } else {  // each head's tokens contiguous ([B, H, N, d] tensors): head by head
      for (int64_t g = 0; g < Hkv; ++g)
        for (int64_t n = 0; n < M; ++n) pack(n, g);
    }
    if (a.qs[1] <= a.qs[2]) {
      for (int64_t i = 0; i < N; ++i)
        for (int64_t h = 0; h < H; ++h) {
          int64_t& row = filled[h];
          if (row < counts[h] && idx[h * N + row] == i) gather(h, row++);
        }
    } else {
      for (int64_t h = 0; h < H; ++h)
        for (int64_t row = 0; row < counts[h]; ++row) gather(h, row);
    }
    for (int64_t h = 0; h < H; ++h) {
      const int64_t count = counts[h], count4 = (count + kRows - 1) / kRows * kRows;
      float* qh = qg + h * N4 * d;
      std::fill(qh + count * d, qh + count4 * d, 0.f);
      const float *kth = kt + (h / group) * kt_size, *vph = vp + (h / group) * vp_size;
      for (int64_t i0 = 0; i0 < count; i0 += kRows)
        attend_rows<NB, DB>(a, h, i0, count, idx + h * N, qh, kth, vph, keep, below, s, o, ob);
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

// softmax(q k^T * scale) v per (image, head). q: [B, H, N, d], k / v: [B, Hkv, M, d] (H a multiple of Hkv; any
// strides with the width contiguous), float32, M <= 64, d <= 32; gates: [B, N, H] float32 (any strides) or none:
// where a gate is 0 the query row is not attended and its output is 0 (MoH's unselected heads, whose output the
// gate zeroes anyway). -> [B, H, N, d], a view of a [B, N, H, d] tensor (the merged heads). The other rows are
// equal bit for bit to what they are without gates.
at::Tensor small_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                           const std::optional<at::Tensor>& gates) {
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
  const bool gated = gates.has_value();
  if (gated)
    TORCH_CHECK(gates->dim() == 3 && gates->size(0) == B && gates->size(1) == N && gates->size(2) == H &&
                    gates->scalar_type() == at::kFloat,
                "small_attention: gates must be float32 [B, N, H] = [", B, ", ", N, ", ", H, "], got ",
                gates->scalar_type(), " ", gates->sizes());
  at::Tensor out = at::empty({B, N, H, d}, q.options());
  const Args a{H, Hkv, N, M, d, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
               {q.stride(0), q.stride(1), q.stride(2)},
               {k.stride(0), k.stride(1), k.stride(2)}, {v.stride(0), v.stride(1), v.stride(2)},
               static_cast<float>(scale), out.data_ptr<float>(), gated ? gates->data_ptr<float>() : nullptr,
               {gated ? gates->stride(0) : 0, gated ? gates->stride(1) : 0, gated ? gates->stride(2) : 0}};
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    Scratch scratch;
    for (int64_t b = b0; b < b1; ++b) attend_one_image(a, b, scratch);
  });
  return out.transpose(1, 2);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(visattn, m) {
  m.def("small_attention(Tensor q, Tensor k, Tensor v, float scale, Tensor? gates=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(visattn, CPU, m) { m.impl("small_attention", &small_attention); }
