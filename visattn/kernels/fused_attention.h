// The attention of one (image, head)'s chosen queries against the image's keys and values, float32, in
// AVX-512 registers: per tile of up to 32 queries, the scores [N, 32] (queries in the lanes, so the keys
// are read where they are, untransposed), a softmax down each column, and P @ V with the queries as rows.
// The tile's scores stay in L1, and the next (image, head)'s queries, keys, values and output rows are
// prefetched into L2 while this one computes.
//
// Why not MKL: at ViT-S / DiT-B/2 sizes (197-256 tokens, 64-wide heads) the two SGEMM calls per image and
// head, with the scores written out between them, ran the attention at 80-95 GFLOP/s, as SDPA does; this
// runs it 12-20% faster on the same machine (docs/results/benchmarks.md, 11th session). It needs AVX-512
// and a head width that is a multiple of 16 up to 64; elsewhere callers keep the SGEMM version
// (fused_attention_runs).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

namespace visattn {

// Whether fused_attend serves heads `d` wide on this CPU.
inline bool fused_attention_runs(int64_t d) { return avx512_runs() && d > 0 && d <= 64 && d % kLanes == 0; }

// One (image, head): query i (i < m) is row q_rows[i] of q (row i without q_rows), d values, to which
// q_bias (nullptr: none) is added; keys and values [N, d] with row strides k_ld / v_ld. Output row i,
// out + out_rows[i] * out_ld (row i without out_rows), gets (attention_i + v_bias) * gates[gate_rows[i] *
// gate_ld]: v_bias (nullptr: none) is the values' bias where v was computed without it (each row of
// probabilities sums to 1).
struct AttendRows {
  int64_t m, N, d;
  const float* q;
  int64_t q_ld;
  const int32_t* q_rows;
  const float* q_bias;
  const float *k, *v;
  int64_t k_ld, v_ld;
  const float* v_bias;
  const float* gates;
  int64_t gate_ld;
  const int32_t* gate_rows;
  float* out;
  int64_t out_ld;
  const int32_t* out_rows;
};

// Rows of the next (image, head)'s operands (its queries, keys, values and output rows) to bring into L2
// while this one computes: up to four streams of `rows` rows, `bytes` bytes each (base[s] + r * ld[s]
// bytes). Without it the attention waited on memory for 10-15% of its time at DiT-B/2 (11th session).
struct NextRows {
  int streams = 0;
  const char* base[4];
  int64_t ld[4];
  int64_t rows = 0, bytes = 0;

  void add(const float* p, int64_t ld_floats) {
    base[streams] = reinterpret_cast<const char*>(p);
    ld[streams++] = ld_floats * static_cast<int64_t>(sizeof(float));
  }
};

// A thread's buffers for fused_attend.
struct AttendScratch {
  std::vector<float> qt, st, o;
};

#if VISATTN_HAS_AVX512_CODE
namespace fused {

constexpr int kMaxQueries = 2 * kLanes;  // queries per tile

// st[n][0 .. 16 NQ) = qt^T k[n] for keys n0 .. n0 + KR; mx: the columns' running maxima.
template <int KR, int NQ>
VISATTN_AVX512 VISATTN_INLINE void scores(const float* qt, int64_t d, const float* k, int64_t k_ld, int64_t n0,
                                          float* st, lanes_t* mx) {
  constexpr int QT = NQ * kLanes;
  lanes_t acc[KR][NQ];
  for (int r = 0; r < KR; ++r)
    for (int j = 0; j < NQ; ++j) acc[r][j] = lanes_t{};
  const float* kr = k + n0 * k_ld;
  for (int64_t c = 0; c < d; ++c) {
    lanes_t qv[NQ];
    for (int j = 0; j < NQ; ++j) std::memcpy(&qv[j], qt + c * QT + j * kLanes, sizeof(lanes_t));
    for (int r = 0; r < KR; ++r) {
      const float key = kr[r * k_ld + c];
      for (int j = 0; j < NQ; ++j) acc[r][j] += key * qv[j];
    }
  }
  for (int r = 0; r < KR; ++r)
    for (int j = 0; j < NQ; ++j) {
      std::memcpy(st + (n0 + r) * QT + j * kLanes, &acc[r][j], sizeof(lanes_t));
      mx[j] = mx[j] < acc[r][j] ? acc[r][j] : mx[j];  // a NaN score is not kept; its exp is NaN anyway
    }
}

// o[q0 + r][0 .. 16 DB) = sum_n st[n][q0 + r] v[n] for RQ queries.
template <int RQ, int DB, int QT>
VISATTN_AVX512 VISATTN_INLINE void weighted_values(const float* st, int64_t N, int q0, const float* v, int64_t v_ld,
                                                   float* o) {
  lanes_t acc[RQ][DB];
  for (int r = 0; r < RQ; ++r)
    for (int j = 0; j < DB; ++j) acc[r][j] = lanes_t{};
  for (int64_t n = 0; n < N; ++n) {
    lanes_t vv[DB];
    for (int j = 0; j < DB; ++j) std::memcpy(&vv[j], v + n * v_ld + j * kLanes, sizeof(lanes_t));
    for (int r = 0; r < RQ; ++r) {
      const float p = st[n * QT + q0 + r];
      for (int j = 0; j < DB; ++j) acc[r][j] += p * vv[j];
    }
  }
  for (int r = 0; r < RQ; ++r)
    for (int j = 0; j < DB; ++j) std::memcpy(o + ((q0 + r) * DB + j) * kLanes, &acc[r][j], sizeof(lanes_t));
}

inline void prefetch_rows(const NextRows& next, int64_t r0, int64_t r1) {
  for (int s = 0; s < next.streams; ++s)
    for (int64_t r = r0; r < r1; ++r) {
      const char* row = next.base[s] + r * next.ld[s];
      for (int64_t off = 0; off < next.bytes; off += 64) _mm_prefetch(row + off, _MM_HINT_T1);
    }
}

// Queries i0 .. i0 + mq (mq <= 16 NQ) of p: gathered, biased and scaled into the lanes of qt [d][16 NQ]
// (lanes past mq repeat the last query: finite, never written out), scored, softmaxed, weighted.
template <int NQ, int DB>
VISATTN_AVX512 void tile(const AttendRows& p, int64_t i0, int mq, float scale, AttendScratch& buf) {
  constexpr int QT = NQ * kLanes, KR = NQ == 2 ? 12 : 24;
  constexpr int RQ = DB <= 2 ? 8 : 6;  // PV accumulators: RQ * DB registers of 32
  const int64_t d = p.d, N = p.N;
  float *qt = buf.qt.data(), *st = buf.st.data(), *o = buf.o.data();
  const __m512 sc = _mm512_set1_ps(scale);
  for (int j = 0; j < NQ; ++j) {
    alignas(64) int32_t idx[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      const int64_t i = i0 + std::min<int64_t>(j * kLanes + l, mq - 1);
      idx[l] = static_cast<int32_t>((p.q_rows ? p.q_rows[i] : i) * p.q_ld);
    }
    const __m512i at = _mm512_load_si512(idx);
    for (int64_t c = 0; c < d; ++c) {
      __m512 qc = _mm512_i32gather_ps(at, p.q + c, 4);
      if (p.q_bias) qc = _mm512_add_ps(qc, _mm512_set1_ps(p.q_bias[c]));
      _mm512_storeu_ps(qt + c * QT + j * kLanes, _mm512_mul_ps(qc, sc));
    }
  }
  lanes_t mx[NQ];
  for (int j = 0; j < NQ; ++j) mx[j] = lanes_t{} - 3.0e38f;
  int64_t n0 = 0;
  for (; n0 + KR <= N; n0 += KR) scores<KR, NQ>(qt, d, p.k, p.k_ld, n0, st, mx);
  for (; n0 < N; ++n0) scores<1, NQ>(qt, d, p.k, p.k_ld, n0, st, mx);
  alignas(64) float inv[QT];
  for (int j = 0; j < NQ; ++j) {  // exp(s - max) down each column; 1 / the column's sum scales the output
    lanes_t sum{};
    for (int64_t n = 0; n < N; ++n) {
      lanes_t s;
      std::memcpy(&s, st + n * QT + j * kLanes, sizeof(lanes_t));
      s = exp_le0(s - mx[j]);
      std::memcpy(st + n * QT + j * kLanes, &s, sizeof(lanes_t));
      sum += s;
    }
    const lanes_t r = (lanes_t{} + 1.f) / sum;
    std::memcpy(inv + j * kLanes, &r, sizeof(lanes_t));
  }
  int q0 = 0;
  for (; q0 + RQ <= mq; q0 += RQ) weighted_values<RQ, DB, QT>(st, N, q0, p.v, p.v_ld, o);
  for (; q0 + 2 <= mq; q0 += 2) weighted_values<2, DB, QT>(st, N, q0, p.v, p.v_ld, o);
  for (; q0 < mq; ++q0) weighted_values<1, DB, QT>(st, N, q0, p.v, p.v_ld, o);
  for (int r = 0; r < mq; ++r) {
    const int64_t i = i0 + r;
    const float g = p.gates[(p.gate_rows ? p.gate_rows[i] : i) * p.gate_ld], s = inv[r];
    float* out = p.out + (p.out_rows ? p.out_rows[i] : i) * p.out_ld;
    const float* orow = o + r * d;
    if (p.v_bias)
      for (int64_t c = 0; c < d; ++c) out[c] = (orow[c] * s + p.v_bias[c]) * g;
    else
      for (int64_t c = 0; c < d; ++c) out[c] = orow[c] * (s * g);
  }
}

template <int DB>
VISATTN_AVX512 void attend(const AttendRows& p, const NextRows& next, AttendScratch& buf) {
  const float scale = 1.f / std::sqrt(static_cast<float>(p.d));
  for (int64_t i0 = 0; i0 < p.m; i0 += kMaxQueries) {
    const int mq = static_cast<int>(std::min<int64_t>(kMaxQueries, p.m - i0));
    prefetch_rows(next, next.rows * i0 / p.m, next.rows * (i0 + mq) / p.m);  // spread over the tiles
    if (mq > kLanes) tile<2, DB>(p, i0, mq, scale, buf);
    else tile<1, DB>(p, i0, mq, scale, buf);
  }
}

}  // namespace fused

// The attention of p's m queries, written gated into their output rows (see AttendRows). Call only where
// fused_attention_runs(p.d).
inline void fused_attend(const AttendRows& p, const NextRows& next, AttendScratch& buf) {
  if (p.m == 0) {
    fused::prefetch_rows(next, 0, next.rows);
    return;
  }
  buf.qt.resize(p.d * fused::kMaxQueries);
  buf.st.resize(p.N * fused::kMaxQueries);
  buf.o.resize(fused::kMaxQueries * p.d);
  switch (p.d / kLanes) {
    case 1: fused::attend<1>(p, next, buf); break;
    case 2: fused::attend<2>(p, next, buf); break;
    case 3: fused::attend<3>(p, next, buf); break;
    default: fused::attend<4>(p, next, buf); break;
  }
}
#else
inline void fused_attend(const AttendRows&, const NextRows&, AttendScratch&) {}
#endif

}  // namespace visattn
