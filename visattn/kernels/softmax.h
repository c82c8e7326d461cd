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

// exp_row for a long row: whole lanes_t blocks, the last one padded; per-lane maxima and sums.
static VISATTN_SIMD_CLONES float exp_row_blocks(float* row, int64_t n) {
  const int64_t full = n / kLanes * kLanes, tail = n - full;
  float block[kLanes];
  float mx = row[0];
  for (int64_t j = full; j < n; ++j) mx = std::max(mx, row[j]);
  if (full) {
    lanes_t top;
    std::memcpy(&top, row, sizeof(lanes_t));
    for (int64_t j = kLanes; j < full; j += kLanes) {
      lanes_t v;
      std::memcpy(&v, row + j, sizeof(lanes_t));
      top = top < v ? v : top;
    }
    std::memcpy(block, &top, sizeof(lanes_t));
    for (int64_t l = 0; l < kLanes; ++l) mx = std::max(mx, block[l]);
  }
  lanes_t sums{};
  for (int64_t j = 0; j < full; j += kLanes) {
    lanes_t v;
    std::memcpy(&v, row + j, sizeof(lanes_t));
    v = exp_le0(v - mx);
    std::memcpy(row + j, &v, sizeof(lanes_t));
    sums += v;
  }
  float total = 0.f;
  if (tail) {  // the last block padded with the maximum; its padding lanes neither stored nor summed
    for (int64_t l = 0; l < kLanes; ++l) block[l] = l < tail ? row[full + l] : mx;
    lanes_t v;
    std::memcpy(&v, block, sizeof(lanes_t));
    v = exp_le0(v - mx);
    std::memcpy(block, &v, sizeof(lanes_t));
    for (int64_t l = 0; l < tail; ++l) {
      row[full + l] = block[l];
      total += block[l];
    }
  }
  std::memcpy(block, &sums, sizeof(lanes_t));
  for (int64_t l = 0; l < kLanes; ++l) total += block[l];
  return 1.f / total;
}

// row[0..n) <- exp(row - max(row)); returns 1 / the sum of the new row, which a softmax multiplies by. The
// caller scales what it computes from the row (d values per row, not n) instead of the row itself, as
// flash attention does. A NaN score makes the sum NaN. The blocks ran the softmax of 197-256 tokens 1.5x
// faster than plain loops; on the study's 17 tokens their padded tail and reductions made the loops
// kernel's layer 5% slower (10th session), so short rows take the loops.
static inline float exp_row(float* row, int64_t n) { return n < 4 * kLanes ? exp_row_short(row, n) : exp_row_blocks(row, n); }

// row[0..n) <- softmax(row), for the backward's recomputed probabilities.
static inline void softmax_row(float* row, int64_t n) {
  const float inv = exp_row(row, n);
  for (int64_t j = 0; j < n; ++j) row[j] *= inv;
}

}  // namespace visattn
