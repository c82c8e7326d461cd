// The output projection of MoH's chosen (token, head) pairs in bfloat16 on AMX tiles, for
// routed_kernel_dense under autocast: out[t] = sum over the heads h that token t uses of z[t, h] @ W[:, h]^T,
// plus the bias. Tokens that chose the same routed heads form a group; a group's rows multiply the columns
// of W of its heads alone (shared ones and its routed ones), so the pairs that are off cost nothing.
//
// Why: the dense output matmul over [tokens, H*d] multiplies the zeros of every pair that is off, half the
// routed pairs' work at 50% of the heads; per-head matmuls (64 wide) in oneDNN ran at half its speed per
// FLOP, and the scatter-add of their rows cost more than they saved (13th session).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "amx_attention.h"

namespace visattn {

// z [T, H*d] bf16 (row stride z_ld), mask [H - S, T] (routed heads' pairs, head-major; heads < S are on
// for every token), wp: the weight [Co, H*d] packed by amx::pack_pairs, bias float32 [Co] or null, out [T, Co]
// bf16 (row stride out_ld).
struct AmxProjection {
  int64_t T, H, d, S, Co;
  const uint16_t* z;
  int64_t z_ld;
  const bool* mask;
  const int32_t* wp;
  const float* bias;
  uint16_t* out;
  int64_t out_ld;
};

// Up to 32 rows of one group: tokens rows[0 .. count), heads heads[0 .. nh).
struct ProjectionBlock {
  const int32_t* rows;
  int count;
  const int32_t* heads;
  int nh;
};

// The tokens grouped by the routed heads they chose (E = H - S <= 64): `tokens` holds each group's tokens
// in turn, `heads` each group's heads (shared first) in turn, and blocks cut each group into runs of 32.
struct ProjectionGroups {
  std::vector<int32_t> tokens, heads;
  std::vector<ProjectionBlock> blocks;
};

inline ProjectionGroups projection_groups(const AmxProjection& p) {
  const int64_t T = p.T, E = p.H - p.S;
  std::vector<uint64_t> key(T, 0);
  for (int64_t e = 0; e < E; ++e) {
    const bool* m = p.mask + e * T;
    for (int64_t t = 0; t < T; ++t) key[t] |= static_cast<uint64_t>(m[t]) << e;
  }
  std::unordered_map<uint64_t, int32_t> id;
  std::vector<int32_t> group(T), size;
  std::vector<uint64_t> keys;
  for (int64_t t = 0; t < T; ++t) {
    const auto [it, added] = id.try_emplace(key[t], static_cast<int32_t>(keys.size()));
    if (added) {
      keys.push_back(key[t]);
      size.push_back(0);
    }
    group[t] = it->second;
    ++size[it->second];
  }
  const int64_t G = static_cast<int64_t>(keys.size());
  std::vector<int64_t> start(G + 1, 0), head_start(G + 1, 0);
  for (int64_t g = 0; g < G; ++g) {
    start[g + 1] = start[g] + size[g];
    head_start[g + 1] = head_start[g] + p.S + __builtin_popcountll(keys[g]);
  }
  ProjectionGroups out;
  out.tokens.resize(T);
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < T; ++t) out.tokens[fill[group[t]]++] = static_cast<int32_t>(t);
  out.heads.reserve(head_start[G]);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t h = 0; h < p.S; ++h) out.heads.push_back(static_cast<int32_t>(h));
    for (int64_t e = 0; e < E; ++e)
      if (keys[g] >> e & 1) out.heads.push_back(static_cast<int32_t>(p.S + e));
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = start[g]; r < start[g + 1]; r += 32)
      out.blocks.push_back({out.tokens.data() + r, static_cast<int>(std::min<int64_t>(32, start[g + 1] - r)),
                            out.heads.data() + head_start[g], static_cast<int>(head_start[g + 1] - head_start[g])});
  return out;
}

#if VISATTN_HAS_AMX_CODE
namespace amx {

// 32 values of a row of W as 16 pairs (2i, 2i+1), each one int32 of two bf16 (float32 rounded to nearest even,
// as .to(torch.bfloat16) rounds).
VISATTN_AMX VISATTN_INLINE __m512i pairs_of(const uint16_t* row) { return _mm512_loadu_si512(row); }
VISATTN_AMX VISATTN_INLINE __m512i pairs_of(const float* row) {
  return narrow(_mm512_loadu_ps(row), _mm512_loadu_ps(row + 16));
}

// w [Co, K] (bf16 or float32; K a multiple of 32, Co of 32, contiguous) -> wp: the AMX B operands of
// x @ w^T, 1 KB tiles in the order project_block reads them: for each 32 of Co (c) and 32 of K (step s),
// the tiles of columns 32c .. 32c+15 and 32c+16 .. 32c+31; in a tile, int32 16 * i + j holds
// w[col + j, 32s + 2i] and w[col + j, 32s + 2i + 1] (pairs of K, as AMX wants them). A head's steps for 32
// columns are one run of 4 KB; a float32 w is rounded here, so no bf16 copy of it is made first.
// The 16 x 16 int32 matrix r (row j in r[j]) transposed in place: pairs within 128-bit lanes, then pairs of
// pairs, then the lanes themselves.
VISATTN_AMX VISATTN_INLINE void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int j = 0; j < 16; j += 2) {
    t[j] = _mm512_unpacklo_epi32(r[j], r[j + 1]);
    t[j + 1] = _mm512_unpackhi_epi32(r[j], r[j + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // u[g + m], lane L: rows g .. g+3 of column 4L + m
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i even = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88), odd = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xdd);
    const __m512i even2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88);
    const __m512i odd2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xdd);
    r[m] = _mm512_shuffle_i32x4(even, even2, 0x88);
    r[8 + m] = _mm512_shuffle_i32x4(even, even2, 0xdd);
    r[4 + m] = _mm512_shuffle_i32x4(odd, odd2, 0x88);
    r[12 + m] = _mm512_shuffle_i32x4(odd, odd2, 0xdd);
  }
}

template <typename T>
VISATTN_AMX static inline void pack_pairs(const T* w, int64_t Co, int64_t K, int32_t* wp) {
  for (int64_t c = 0; c < Co / 32; ++c)
    for (int64_t s = 0; s < K / 32; ++s)
      for (int64_t half = 0; half < 2; ++half) {
        __m512i r[16];
        for (int64_t j = 0; j < 16; ++j) r[j] = pairs_of(w + (32 * c + 16 * half + j) * K + 32 * s);
        transpose16(r);
        int32_t* tile = wp + ((c * (K / 32) + s) * 2 + half) * 256;
        for (int i = 0; i < 16; ++i) _mm512_store_si512(tile + 16 * i, r[i]);
      }
}

// One block: its rows of z staged [32, nh * d], then per 32 output columns four 16 x 16 float32 tiles
// (rows 0-15 / 16-31 by columns j0 .. j0+15 / j0+16 .. j0+31), d/32 tile products per head. The next
// block's rows of z are prefetched into L2 meanwhile (z is far larger than L2).
VISATTN_AMX static inline void project_block(const AmxProjection& p, const ProjectionBlock& blk,
                                             const ProjectionBlock* next, uint16_t* a, float* c) {
  const int64_t d = p.d, nh = blk.nh, K = nh * d, count = blk.count, steps = p.H * d / 32;
  const int32_t* rows = blk.rows;
  const int32_t* heads = blk.heads;
  for (int64_t r = 0; r < 32; ++r) {
    uint16_t* dst = a + r * K;
    if (r >= count) {  // zmm stores, not std::fill: GCC may make that a memset call (see configure)
      for (int64_t col = 0; col < K; col += 32) _mm512_storeu_si512(dst + col, _mm512_setzero_si512());
      continue;
    }
    const uint16_t* src = p.z + static_cast<int64_t>(rows[r]) * p.z_ld;
    for (int64_t i = 0; i < nh; ++i)
      for (int64_t col = 0; col < d; col += 32)
        _mm512_storeu_si512(dst + i * d + col, _mm512_loadu_si512(src + heads[i] * d + col));
  }
  if (next)
    for (int64_t r = 0; r < next->count; ++r) {
      const char* src = reinterpret_cast<const char*>(p.z + static_cast<int64_t>(next->rows[r]) * p.z_ld);
      for (int64_t i = 0; i < next->nh; ++i)
        for (int64_t col = 0; col < d * 2; col += 64) prefetch_l2(src + next->heads[i] * d * 2 + col);
    }
  const bool two = count > 16;
  for (int64_t j0 = 0; j0 < p.Co; j0 += 32) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    const int32_t* panel = p.wp + j0 / 32 * steps * 512;
    for (int64_t i = 0; i < nh; ++i)
      for (int64_t k0 = 0; k0 < d; k0 += 32) {
        const uint16_t* a0 = a + i * d + k0;
        const int32_t* b0 = panel + (heads[i] * d + k0) / 32 * 512;
        _tile_loadd(0, a0, K * 2);
        _tile_loadd(2, b0, 64);
        _tile_dpbf16ps(4, 0, 2);
        _tile_loadd(3, b0 + 256, 64);
        _tile_dpbf16ps(5, 0, 3);
        if (two) {
          _tile_loadd(1, a0 + 16 * K, K * 2);
          _tile_dpbf16ps(6, 1, 2);
          _tile_dpbf16ps(7, 1, 3);
        }
      }
    _tile_stored(4, c, 32 * 4);
    _tile_stored(5, c + 16, 32 * 4);
    if (two) {
      _tile_stored(6, c + 16 * 32, 32 * 4);
      _tile_stored(7, c + 16 * 32 + 16, 32 * 4);
    }
    const __m512 b_lo = p.bias ? _mm512_loadu_ps(p.bias + j0) : _mm512_setzero_ps();
    const __m512 b_hi = p.bias ? _mm512_loadu_ps(p.bias + j0 + 16) : _mm512_setzero_ps();
    for (int64_t r = 0; r < count; ++r) {
      const float* cr = c + r * 32;
      const __m512i v = narrow(_mm512_add_ps(_mm512_loadu_ps(cr), b_lo), _mm512_add_ps(_mm512_loadu_ps(cr + 16), b_hi));
      _mm512_storeu_si512(p.out + static_cast<int64_t>(rows[r]) * p.out_ld + j0, v);
    }
  }
}

}  // namespace amx
#endif

// Blocks b0 .. b1 of `blocks`, after pack_pairs. Call only where amx_attention_runs(p.d) and p.Co % 32 == 0.
// w [Co, H*d] (bf16 or float32, contiguous) into wp [H*d/2 * Co] (amx::pack_pairs).
template <typename T>
inline void amx_pack_weight(const T* w, int64_t Co, int64_t K, int32_t* wp) {
#if VISATTN_HAS_AMX_CODE
  amx::pack_pairs(w, Co, K, wp);
#endif
}

inline void amx_project_blocks(const AmxProjection& p, const ProjectionBlock* blocks, int64_t b0, int64_t b1) {
#if VISATTN_HAS_AMX_CODE
  int max_heads = 0;
  for (int64_t b = b0; b < b1; ++b) max_heads = std::max(max_heads, blocks[b].nh);
  AlignedBuffer<uint16_t> a;
  AlignedBuffer<float> c;
  a.resize(32 * max_heads * p.d);
  c.resize(32 * 32);
  amx::configure();
  for (int64_t b = b0; b < b1; ++b) amx::project_block(p, blocks[b], b + 1 < b1 ? &blocks[b + 1] : nullptr, a.data(), c.data());
  amx::release();
#endif
}

}  // namespace visattn
