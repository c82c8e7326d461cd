// The attention of one (image, head)'s chosen queries against the image's keys and values, float32, in
// vector registers: per tile of queries, the scores [N, tile] (queries in the lanes, so the keys are read
// where they are, untransposed), a softmax down each column, and P @ V. The tile's scores stay in L1, and the
// next (image, head)'s queries, keys, values and output rows are prefetched into L2 while this one computes.
// - AVX-512: tiles of 32 queries, P @ V with the queries as rows.
// - AVX2 with FMA (16 registers of 8 floats): tiles of 16 queries, scores 6 keys at a time, P @ V with the
//   queries in the lanes as well (6 of the head's values at a time), so no tile leaves rows over. The queries
//   are read in whole rows and transposed into the lanes in registers, and the outputs transposed back the
//   same way.
//
// Why not MKL: at ViT-S / DiT-B/2 sizes (197-256 tokens, 64-wide heads) the two SGEMM calls per image and
// head, with the scores written out between them, ran the attention at 80-95 GFLOP/s on an AVX-512 Xeon, as
// SDPA does; this runs it 12-20% faster on the same machine (docs/results/benchmarks.md, 11th session). On an
// AVX2 EPYC (Zen 3) the AVX2 loops took 0.89-0.94x the SGEMM version's time and 0.89-0.93x SDPA's (27th
// session), with the queries then gathered lane by lane. It needs a head width that is a multiple of 16 up to
// 64; elsewhere callers keep the SGEMM version (fused_attention_runs).
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
inline bool fused_attention_runs(int64_t d) {
  return (avx512_runs() || avx2_fma_runs()) && d > 0 && d <= 64 && d % kLanes == 0;
}

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

// The pieces shared by both instruction sets take a vector type V of W floats (GCC's vector extension) and
// are inlined into each set's own functions.
template <typename V>
constexpr int kWidth = static_cast<int>(sizeof(V) / sizeof(float));

// st[n][0 .. W NQ) = qt^T k[n] for keys n0 .. n0 + KR; mx: the columns' running maxima.
template <int KR, int NQ, typename V>
VISATTN_INLINE void scores(const float* qt, int64_t d, const float* k, int64_t k_ld, int64_t n0, float* st, V* mx) {
  constexpr int W = kWidth<V>, QT = NQ * W;
  V acc[KR][NQ];
  for (int r = 0; r < KR; ++r)
    for (int j = 0; j < NQ; ++j) acc[r][j] = V{};
  const float* kr = k + n0 * k_ld;
  for (int64_t c = 0; c < d; ++c) {
    V qv[NQ];
    for (int j = 0; j < NQ; ++j) std::memcpy(&qv[j], qt + c * QT + j * W, sizeof(V));
    for (int r = 0; r < KR; ++r) {
      const float key = kr[r * k_ld + c];
      for (int j = 0; j < NQ; ++j) acc[r][j] += key * qv[j];
    }
  }
  for (int r = 0; r < KR; ++r)
    for (int j = 0; j < NQ; ++j) {
      std::memcpy(st + (n0 + r) * QT + j * W, &acc[r][j], sizeof(V));
      mx[j] = mx[j] < acc[r][j] ? acc[r][j] : mx[j];  // a NaN score is not kept; its exp is NaN anyway
    }
}

// st[n][.] <- exp(st[n][.] - mx) down each of the NQ columns of W queries; inv[q] = 1 / column q's sum, which
// scales the query's output.
template <int NQ, typename V>
VISATTN_INLINE void exp_columns(float* st, int64_t N, const V* mx, float* inv) {
  constexpr int W = kWidth<V>, QT = NQ * W;
  for (int j = 0; j < NQ; ++j) {
    V sum{};
    for (int64_t n = 0; n < N; ++n) {
      V s;
      std::memcpy(&s, st + n * QT + j * W, sizeof(V));
      s = exp_le0(s - mx[j]);
      std::memcpy(st + n * QT + j * W, &s, sizeof(V));
      sum += s;
    }
    const V r = (V{} + 1.f) / sum;
    std::memcpy(inv + j * W, &r, sizeof(V));
  }
}

inline void prefetch_rows(const NextRows& next, int64_t r0, int64_t r1) {
  for (int s = 0; s < next.streams; ++s)
    for (int64_t r = r0; r < r1; ++r) {
      const char* row = next.base[s] + r * next.ld[s];
      for (int64_t off = 0; off < next.bytes; off += 64) _mm_prefetch(row + off, _MM_HINT_T1);
    }
}

// AVX-512. idx[l] = the offset in p.q of query i0 + l, for the 16 NQ lanes of a tile (lanes past mq repeat the
// last query: finite, never written out).
template <int NQ>
VISATTN_INLINE void query_offsets(const AttendRows& p, int64_t i0, int mq, int32_t* idx) {
  for (int l = 0; l < NQ * kLanes; ++l) {
    const int64_t i = i0 + std::min<int64_t>(l, mq - 1);
    idx[l] = static_cast<int32_t>((p.q_rows ? p.q_rows[i] : i) * p.q_ld);
  }
}

// AVX-512. Output row i0 + r (r < mq) of p <- (o[r] / the row's sum + v_bias) * its gate, o: [mq][d].
VISATTN_INLINE void write_gated(const AttendRows& p, int64_t i0, int mq, const float* o, const float* inv) {
  for (int r = 0; r < mq; ++r) {
    const int64_t i = i0 + r;
    const float g = p.gates[(p.gate_rows ? p.gate_rows[i] : i) * p.gate_ld], s = inv[r];
    float* out = p.out + (p.out_rows ? p.out_rows[i] : i) * p.out_ld;
    const float* orow = o + r * p.d;
    if (p.v_bias)
      for (int64_t c = 0; c < p.d; ++c) out[c] = (orow[c] * s + p.v_bias[c]) * g;
    else
      for (int64_t c = 0; c < p.d; ++c) out[c] = orow[c] * (s * g);
  }
}

// AVX-512. o[q0 + r][0 .. 16 DB) = sum_n st[n][q0 + r] v[n] for RQ queries.
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

// Queries i0 .. i0 + mq (mq <= 16 NQ) of p: gathered, biased and scaled into the lanes of qt [d][16 NQ],
// scored, softmaxed, weighted.
template <int NQ, int DB>
VISATTN_AVX512 void tile(const AttendRows& p, int64_t i0, int mq, float scale, AttendScratch& buf) {
  constexpr int QT = NQ * kLanes, KR = NQ == 2 ? 12 : 24;
  constexpr int RQ = DB <= 2 ? 8 : 6;  // PV accumulators: RQ * DB registers of 32
  const int64_t d = p.d, N = p.N;
  float *qt = buf.qt.data(), *st = buf.st.data(), *o = buf.o.data();
  const __m512 sc = _mm512_set1_ps(scale);
  alignas(64) int32_t idx[QT];
  query_offsets<NQ>(p, i0, mq, idx);
  for (int j = 0; j < NQ; ++j) {
    const __m512i at = _mm512_load_si512(idx + j * kLanes);
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
  exp_columns<NQ>(st, N, mx, inv);
  int q0 = 0;
  for (; q0 + RQ <= mq; q0 += RQ) weighted_values<RQ, DB, QT>(st, N, q0, p.v, p.v_ld, o);
  for (; q0 + 2 <= mq; q0 += 2) weighted_values<2, DB, QT>(st, N, q0, p.v, p.v_ld, o);
  for (; q0 < mq; ++q0) weighted_values<1, DB, QT>(st, N, q0, p.v, p.v_ld, o);
  write_gated(p, i0, mq, o, inv);
}

template <int DB>
VISATTN_AVX512 void attend(const AttendRows& p, const NextRows& next, AttendScratch& buf) {
  constexpr int kMaxQueries = 2 * kLanes;
  const float scale = 1.f / std::sqrt(static_cast<float>(p.d));
  for (int64_t i0 = 0; i0 < p.m; i0 += kMaxQueries) {
    const int mq = static_cast<int>(std::min<int64_t>(kMaxQueries, p.m - i0));
    prefetch_rows(next, next.rows * i0 / p.m, next.rows * (i0 + mq) / p.m);  // spread over the tiles
    if (mq > kLanes) tile<2, DB>(p, i0, mq, scale, buf);
    else tile<1, DB>(p, i0, mq, scale, buf);
  }
}

// AVX2. ot[c][0 .. 8 NQ) = sum_n v[n][c] st[n][0 .. 8 NQ) for the head's values c0 .. c0 + KC: the queries in
// the lanes, as in scores (with the queries as rows, 16 rows did not split into blocks that fill the registers).
template <int KC, int NQ>
VISATTN_AVX2 VISATTN_INLINE void weighted_values_t(const float* st, int64_t N, const float* v, int64_t v_ld,
                                                   int64_t c0, float* ot) {
  constexpr int QT = NQ * 8;
  lanes8_t acc[KC][NQ];
  for (int r = 0; r < KC; ++r)
    for (int j = 0; j < NQ; ++j) acc[r][j] = lanes8_t{};
  for (int64_t n = 0; n < N; ++n) {
    lanes8_t pv[NQ];
    for (int j = 0; j < NQ; ++j) std::memcpy(&pv[j], st + n * QT + j * 8, sizeof(lanes8_t));
    const float* vr = v + n * v_ld + c0;
    for (int r = 0; r < KC; ++r) {
      const float x = vr[r];
      for (int j = 0; j < NQ; ++j) acc[r][j] += x * pv[j];
    }
  }
  for (int r = 0; r < KC; ++r)
    for (int j = 0; j < NQ; ++j) std::memcpy(ot + (c0 + r) * QT + j * 8, &acc[r][j], sizeof(lanes8_t));
}

// AVX2. r[0 .. 8) <- its transpose: r[l][c] = the old r[c][l].
VISATTN_AVX2 VISATTN_INLINE void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// qt[c][l] = (q row of lane l + q_bias)[c] * scale for the 8 NQ lanes of the tile at i0: 8 rows at a time read
// whole and transposed in registers. A lane gather per column (vgatherdps) took 10% of the attention's time at
// DiT-B/2 on a Zen 3, these 5% (28th session).
template <int NQ>
VISATTN_AVX2 VISATTN_INLINE void load_queries8(const AttendRows& p, int64_t i0, int mq, float scale, float* qt) {
  constexpr int QT = NQ * 8;
  const __m256 sc = _mm256_set1_ps(scale);
  for (int j = 0; j < NQ; ++j) {
    const float* rows[8];
    for (int l = 0; l < 8; ++l) {
      const int64_t i = i0 + std::min(j * 8 + l, mq - 1);  // lanes past mq repeat the last query
      rows[l] = p.q + (p.q_rows ? p.q_rows[i] : i) * p.q_ld;
    }
    for (int64_t c = 0; c < p.d; c += 8) {
      __m256 r[8];
      const __m256 bias = p.q_bias ? _mm256_loadu_ps(p.q_bias + c) : _mm256_setzero_ps();
      for (int l = 0; l < 8; ++l) r[l] = _mm256_add_ps(_mm256_loadu_ps(rows[l] + c), bias);
      transpose8(r);
      for (int l = 0; l < 8; ++l) _mm256_storeu_ps(qt + (c + l) * QT + j * 8, _mm256_mul_ps(r[l], sc));
    }
  }
}

// write_gated for ot [d][8 NQ] (the queries in the lanes), 8 x 8 blocks transposed in registers.
template <int NQ>
VISATTN_AVX2 VISATTN_INLINE void write_gated8(const AttendRows& p, int64_t i0, int mq, const float* ot,
                                              const float* inv) {
  constexpr int QT = NQ * 8;
  for (int j = 0; j < NQ && j * 8 < mq; ++j) {
    const int rows = std::min(8, mq - j * 8);
    float* out[8];
    __m256 scale[8], gate[8];
    for (int l = 0; l < rows; ++l) {
      const int64_t i = i0 + j * 8 + l;
      out[l] = p.out + (p.out_rows ? p.out_rows[i] : i) * p.out_ld;
      const float g = p.gates[(p.gate_rows ? p.gate_rows[i] : i) * p.gate_ld], s = inv[j * 8 + l];
      scale[l] = _mm256_set1_ps(p.v_bias ? s : s * g);
      gate[l] = _mm256_set1_ps(g);
    }
    for (int64_t c = 0; c < p.d; c += 8) {
      __m256 r[8];
      for (int l = 0; l < 8; ++l) r[l] = _mm256_loadu_ps(ot + (c + l) * QT + j * 8);
      transpose8(r);
      if (p.v_bias) {
        const __m256 vb = _mm256_loadu_ps(p.v_bias + c);
        for (int l = 0; l < rows; ++l)
          _mm256_storeu_ps(out[l] + c, _mm256_mul_ps(_mm256_fmadd_ps(r[l], scale[l], vb), gate[l]));
      } else {
        for (int l = 0; l < rows; ++l) _mm256_storeu_ps(out[l] + c, _mm256_mul_ps(r[l], scale[l]));
      }
    }
  }
}

// Queries i0 .. i0 + mq (mq <= 8 NQ), as tile: 2 NQ * R accumulators of the 16 registers, R = 6 keys (values)
// at a time, and 4 then 2 then 1 for the rest (one at a time, 2 NQ chains of FMAs wait on their latency).
template <int NQ>
VISATTN_AVX2 void tile8(const AttendRows& p, int64_t i0, int mq, float scale, AttendScratch& buf) {
  constexpr int R = NQ == 2 ? 6 : 12;
  const int64_t d = p.d, N = p.N;
  float *qt = buf.qt.data(), *st = buf.st.data(), *ot = buf.o.data();
  load_queries8<NQ>(p, i0, mq, scale, qt);
  lanes8_t mx[NQ];
  for (int j = 0; j < NQ; ++j) mx[j] = lanes8_t{} - 3.0e38f;
  int64_t n0 = 0;
  for (; n0 + R <= N; n0 += R) scores<R, NQ>(qt, d, p.k, p.k_ld, n0, st, mx);
  for (; n0 + 4 <= N; n0 += 4) scores<4, NQ>(qt, d, p.k, p.k_ld, n0, st, mx);
  for (; n0 + 2 <= N; n0 += 2) scores<2, NQ>(qt, d, p.k, p.k_ld, n0, st, mx);
  for (; n0 < N; ++n0) scores<1, NQ>(qt, d, p.k, p.k_ld, n0, st, mx);
  alignas(32) float inv[8 * NQ];
  exp_columns<NQ>(st, N, mx, inv);
  int64_t c0 = 0;
  for (; c0 + R <= d; c0 += R) weighted_values_t<R, NQ>(st, N, p.v, p.v_ld, c0, ot);
  for (; c0 + 4 <= d; c0 += 4) weighted_values_t<4, NQ>(st, N, p.v, p.v_ld, c0, ot);
  for (; c0 < d; ++c0) weighted_values_t<1, NQ>(st, N, p.v, p.v_ld, c0, ot);
  write_gated8<NQ>(p, i0, mq, ot, inv);
}

VISATTN_AVX2 inline void attend8(const AttendRows& p, const NextRows& next, AttendScratch& buf) {
  constexpr int kMaxQueries = 16;
  const float scale = 1.f / std::sqrt(static_cast<float>(p.d));
  for (int64_t i0 = 0; i0 < p.m; i0 += kMaxQueries) {
    const int mq = static_cast<int>(std::min<int64_t>(kMaxQueries, p.m - i0));
    prefetch_rows(next, next.rows * i0 / p.m, next.rows * (i0 + mq) / p.m);
    if (mq > 8) tile8<2>(p, i0, mq, scale, buf);
    else tile8<1>(p, i0, mq, scale, buf);
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
  constexpr int64_t kMaxQueries = 2 * kLanes;  // AVX-512's tile, the larger
  buf.qt.resize(p.d * kMaxQueries);
  buf.st.resize(p.N * kMaxQueries);
  buf.o.resize(kMaxQueries * p.d);
  if (!avx512_runs()) return fused::attend8(p, next, buf);
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
