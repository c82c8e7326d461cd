// The row softmax of visattn.kernels' attention loops (moh_routed_heads.cpp, amx_attention.h), float32:
// exp_row for a row of scores, softmax_row where the probabilities themselves are needed. Compiled for
// AVX-512, AVX2 and the baseline (VISATTN_SIMD_CLONES); static, for the one source that includes it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace visattn {

// exp_row for a short row, in plain loops the compiler vectorises (eight partial maxima and sums, so
// nothing is reassociated that it may not without -ffast-math).
static VISATTN_SIMD_CLONES float exp_row_short(float* row, int64_t n) {
  constexpr int64_t L = 8;
  float part[L];
  for (int64_t l = 0; l < L; ++l) part[l] = row[0];
  int64_t j = 0;
  for (; j + L <= n; j += L)
    for (int64_t l = 0; l < L; ++l) part[l] = std::max(part[l], row[j + l]);
  float mx = part[0];
  for (int64_t l = 1; l < L; ++l) mx = std::max(mx, part[l]);
  for (; j < n; ++j) mx = std::max(mx, row[j]);
  for (j = 0; j < n; ++j) row[j] = exp_le0(row[j] - mx);
  for (int64_t l = 0; l < L; ++l) part[l] = 0.f;
  for (j = 0; j + L <= n; j += L)
    for (int64_t l = 0; l < L; ++l) part[l] += row[j + l];
  float total = 0.f;
  for (int64_t l = 0; l < L; ++l) total += part[l];
  for (; j < n; ++j) total += row[j];
  return 1.f / total;
}

// exp_row in whole blocks of a vector type F of W floats, the last block padded; per-lane maxima and sums.
template <typename F, int64_t W>
VISATTN_INLINE float exp_row_vectors(float* row, int64_t n) {
  const int64_t full = n / W * W, tail = n - full;
  float block[W];
  float mx = row[0];
  for (int64_t j = full; j < n; ++j) mx = std::max(mx, row[j]);
  if (full) {
    F top;
    std::memcpy(&top, row, sizeof(F));
    for (int64_t j = W; j < full; j += W) {
      F v;
      std::memcpy(&v, row + j, sizeof(F));
      top = top < v ? v : top;
    }
    std::memcpy(block, &top, sizeof(F));
    for (int64_t l = 0; l < W; ++l) mx = std::max(mx, block[l]);
  }
  F sums{};
  for (int64_t j = 0; j < full; j += W) {
    F v;
    std::memcpy(&v, row + j, sizeof(F));
    v = exp_le0(v - mx);
    std::memcpy(row + j, &v, sizeof(F));
    sums += v;
  }
  float total = 0.f;
  if (tail) {  // the last block padded with the maximum; its padding lanes neither stored nor summed
    for (int64_t l = 0; l < W; ++l) block[l] = l < tail ? row[full + l] : mx;
    F v;
    std::memcpy(&v, block, sizeof(F));
    v = exp_le0(v - mx);
    std::memcpy(block, &v, sizeof(F));
    for (int64_t l = 0; l < tail; ++l) {
      row[full + l] = block[l];
      total += block[l];
    }
  }
  std::memcpy(block, &sums, sizeof(F));
  for (int64_t l = 0; l < W; ++l) total += block[l];
  return 1.f / total;
}

// exp_row for a long row on an AVX-512 CPU: sixteen floats a block.
static VISATTN_SIMD_CLONES float exp_row_blocks(float* row, int64_t n) {
  return exp_row_vectors<lanes_t, kLanes>(row, n);
}

// exp_row on a CPU without AVX-512, any row: eight floats a block. On an AMD Zen 3 (AVX2) its clone ran rows of
// 17-256 scores 4-7x faster than exp_row_short's and exp_row_blocks', which GCC compiles to scalar code there
// (simd.h), and the kernel's MKL attention went from 1.18-1.23x SDPA's time to 0.98-1.07x (the paths bench's
// `mha kernel_parts` rows, 15th session). The baseline clone is scalar code too.
static VISATTN_SIMD_CLONES float exp_row_eights(float* row, int64_t n) { return exp_row_vectors<lanes8_t, 8>(row, n); }

// row[0..n) <- exp(row - max(row)); returns 1 / the sum of the new row, which a softmax multiplies by. The
// caller scales what it computes from the row (d values per row, not n) instead of the row itself, as
// flash attention does. A NaN score makes the sum NaN. The blocks ran the softmax of 197-256 tokens 1.5x
// faster than plain loops; on the study's 17 tokens their padded tail and reductions made the loops
// kernel's layer 5% slower (10th session), so short rows take the loops (both on AVX-512 CPUs).
static inline float exp_row(float* row, int64_t n) {
  if (!avx512_runs()) return exp_row_eights(row, n);
  return n < 4 * kLanes ? exp_row_short(row, n) : exp_row_blocks(row, n);
}

// row[0..n) <- softmax(row), for the backward's recomputed probabilities.
static inline void softmax_row(float* row, int64_t n) {
  const float inv = exp_row(row, n);
  for (int64_t j = 0; j < n; ++j) row[j] *= inv;
}

}  // namespace visattn
