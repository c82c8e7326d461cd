// c[rows] (+)= a[rows] @ b, float32, in AVX-512 registers, for routed_kernel's per-head projections:
// the chosen tokens' queries (x's rows read in place, no gathered copy) and their heads' outputs through
// W_O, added into the tokens' output rows in the same pass.
//
// Why not MKL: there the rows had to be copied out first, the products copied back in with a second
// pass (add_rows), and each call packed its 64 columns of weights anew; at ViT-S / DiT-B/2 sizes that
// ran these projections at 81-91 GFLOP/s, this at 105-139 (11th session). The weights come packed once
// per call as b [k, n] (n a multiple of 16), so every row block reads them in whole registers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace visattn {

#if VISATTN_HAS_AVX512_CODE
namespace rows {

// R rows of c, NB blocks of 16 columns from column j0: R * NB accumulators.
template <int R, int NB>
VISATTN_AVX512 VISATTN_INLINE void block(int64_t k, const float* const* a, const float* b, int64_t ldb,
                                         float* const* c, bool add) {
  lanes_t acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = lanes_t{};
  for (int64_t kk = 0; kk < k; ++kk) {
    lanes_t bv[NB];
    for (int j = 0; j < NB; ++j) std::memcpy(&bv[j], b + kk * ldb + j * kLanes, sizeof(lanes_t));
    for (int r = 0; r < R; ++r) {
      const float av = a[r][kk];
      for (int j = 0; j < NB; ++j) acc[r][j] += av * bv[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) {
      lanes_t v = acc[r][j];
      if (add) {
        lanes_t old;
        std::memcpy(&old, c[r] + j * kLanes, sizeof(lanes_t));
        v += old;
      }
      std::memcpy(c[r] + j * kLanes, &v, sizeof(lanes_t));
    }
}

template <int NB>
VISATTN_AVX512 VISATTN_INLINE void column_block(int64_t m, int64_t k, const float* a, int64_t lda,
                                                const int64_t* a_rows, const float* b, int64_t ldb, float* c,
                                                int64_t ldc, const int64_t* c_rows, bool add, int64_t j0) {
  constexpr int R = NB == 4 ? 6 : 8;  // at most 24 accumulators of the 32 registers
  const float* ar[R];
  float* cr[R];
  int64_t i = 0;
  for (; i + R <= m; i += R) {
    for (int r = 0; r < R; ++r) {
      ar[r] = a + (a_rows ? a_rows[i + r] : i + r) * lda;
      cr[r] = c + (c_rows ? c_rows[i + r] : i + r) * ldc + j0;
    }
    block<R, NB>(k, ar, b + j0, ldb, cr, add);
  }
  for (; i < m; ++i) {
    ar[0] = a + (a_rows ? a_rows[i] : i) * lda;
    cr[0] = c + (c_rows ? c_rows[i] : i) * ldc + j0;
    block<1, NB>(k, ar, b + j0, ldb, cr, add);
  }
}

VISATTN_AVX512 inline void gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const int64_t* a_rows,
                                const float* b, int64_t ldb, float* c, int64_t ldc, const int64_t* c_rows, bool add) {
  int64_t j0 = 0;
  for (; j0 + 4 * kLanes <= n; j0 += 4 * kLanes) column_block<4>(m, k, a, lda, a_rows, b, ldb, c, ldc, c_rows, add, j0);
  for (; j0 + 2 * kLanes <= n; j0 += 2 * kLanes) column_block<2>(m, k, a, lda, a_rows, b, ldb, c, ldc, c_rows, add, j0);
  for (; j0 < n; j0 += kLanes) column_block<1>(m, k, a, lda, a_rows, b, ldb, c, ldc, c_rows, add, j0);
}

}  // namespace rows
#endif

// Row i of c (c + c_rows[i] * ldc; row i without c_rows) = (or += with `add`) row i of a (a + a_rows[i] *
// lda) @ b, for i < m: a [., k], b [k, n] (row stride ldb), n a multiple of 16; sums in k order. Call
// only where avx512_runs().
inline void row_gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const int64_t* a_rows,
                     const float* b, int64_t ldb, float* c, int64_t ldc, const int64_t* c_rows, bool add) {
#if VISATTN_HAS_AVX512_CODE
  rows::gemm(m, n, k, a, lda, a_rows, b, ldb, c, ldc, c_rows, add);
#endif
}

}  // namespace visattn
