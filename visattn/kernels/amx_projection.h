// The output projection of MoH's chosen (token, head) pairs in bfloat16 on AMX tiles, for
// routed_kernel_grouped under autocast: out[t] = sum over the heads h that token t uses of
// z[t, h] @ W_O[:, h]^T, plus the bias. Tokens that chose the same routed heads form a group; a group's rows
// multiply only its heads' columns of W_O (shared heads and its routed ones), so the pairs that are off cost
// nothing.
//
// Why: the dense output matmul multiplies the zeros of every pair that is off, half the routed pairs' work at
// 50% of the heads; per-head matmuls (64 wide) in oneDNN ran at half its speed per FLOP, and the
// scatter-add of their rows cost more than they saved (13th session). The queries grouped the same way
// saved too little (tried, not kept: their K is the whole model width, and a group's padding to whole
// tiles costs as much as the skipped pairs save; docs/results/benchmarks.md).
#pragma once

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "amx_attention.h"

namespace visattn {

// z [T, H*d] bf16 (row stride z_ld; only each group's heads' columns are read), wp: W_O [Co, H*d] packed by
// amx::pack_pairs, bias float32 [Co] or null, out [T, Co] bf16 (row stride out_ld); Co a multiple of 32.
struct AmxProjection {
  int64_t H, d, Co;
  const uint16_t* z;
  int64_t z_ld;
  const int32_t* wp;
  const float* bias;
  uint16_t* out;
  int64_t out_ld;
};

// Up to 32 rows of one group: tokens rows[0 .. count), heads heads[0 .. nh).
struct GroupBlock {
  const int32_t* rows;
  int count;
  const int32_t* heads;
  int nh;
};

// The T tokens grouped by the routed heads they chose (mask [H - S, T], head-major: the routed heads' pairs;
// heads < S are on for every token; E = H - S <= 64): `tokens` holds each group's tokens in turn, `heads`
// each group's heads (shared first) in turn, and blocks cut each group into runs of 32.
struct HeadGroups {
  std::vector<int32_t> tokens, heads;
  std::vector<GroupBlock> blocks;
};

inline HeadGroups head_groups(const bool* mask, int64_t T, int64_t H, int64_t S) {
  const int64_t E = H - S;
  std::vector<uint64_t> key(T, 0);
  for (int64_t e = 0; e < E; ++e) {
    const bool* m = mask + e * T;
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
    head_start[g + 1] = head_start[g] + S + __builtin_popcountll(keys[g]);
  }
  HeadGroups out;
  out.tokens.resize(T);
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < T; ++t) out.tokens[fill[group[t]]++] = static_cast<int32_t>(t);
  out.heads.reserve(head_start[G]);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t h = 0; h < S; ++h) out.heads.push_back(static_cast<int32_t>(h));
    for (int64_t e = 0; e < E; ++e)
      if (keys[g] >> e & 1) out.heads.push_back(static_cast<int32_t>(S + e));
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

// w [Co, K] (bf16 or float32; K and Co multiples of 32, contiguous) -> wp: the AMX B operands of x @ w^T,
// 1 KB tiles in the order the blocks read them (here those of c0 <= c < c1, so that threads share the work):
// for each 32 of Co (c) and 32 of K (step s), the tiles of
// columns 32c .. 32c+15 and 32c+16 .. 32c+31; in a tile, int32 16 * i + j holds w[col + j, 32s + 2i] and
// w[col + j, 32s + 2i + 1] (pairs of K, as AMX wants them). A head's steps for 32 columns are one run of
// 4 KB; a float32 w is rounded here, so no bf16 copy of it is made first.
template <typename T>
VISATTN_AMX static inline void pack_pairs(const T* w, int64_t K, int64_t c0, int64_t c1, int32_t* wp) {
  for (int64_t c = c0; c < c1; ++c)
    for (int64_t s = 0; s < K / 32; ++s)
      for (int64_t half = 0; half < 2; ++half) {
        __m512i r[16];
        for (int64_t j = 0; j < 16; ++j) r[j] = pairs_of(w + (32 * c + 16 * half + j) * K + 32 * s);
        transpose16(r);
        int32_t* tile = wp + ((c * (K / 32) + s) * 2 + half) * 256;
        for (int i = 0; i < 16; ++i) _mm512_store_si512(tile + 16 * i, r[i]);
      }
}

// A block's steps of 32 along K: step k reads z's columns a_off[k] .. + 32 of the block's rows and the
// packed weight's step b_step[k] (its heads' steps alone).
struct BlockPlan {
  std::vector<int64_t> a_off, b_step;
};

inline void plan_block(const AmxProjection& p, const GroupBlock& blk, BlockPlan& plan) {
  plan.a_off.clear();
  plan.b_step.clear();
  for (int64_t i = 0; i < blk.nh; ++i)
    for (int64_t k = 0; k < p.d / 32; ++k) {
      plan.a_off.push_back(blk.heads[i] * p.d + 32 * k);
      plan.b_step.push_back(blk.heads[i] * p.d / 32 + k);
    }
}

// Steps per chunk of K: A's chunk [32 rows, 32 * chunk] stays within 24 KB, so in L1 beside the weight's
// tiles, which stream from L2 (with 9-10 of 12 heads, DiT-B/2 at 75-90%, the whole K took 1.05-1.1x the
// time; 13th session).
constexpr int64_t kChunkSteps = 12;

// The block's rows at steps k0 .. k0 + kc staged [32, 32 * kc] (rows past count 0). zmm stores, not
// std::fill: GCC may make that a memset call (see configure).
VISATTN_AMX static inline void stage(const AmxProjection& p, const GroupBlock& blk, const int64_t* a_off, int64_t kc,
                                     uint16_t* a) {
  for (int64_t r = 0; r < 32; ++r) {
    uint16_t* dst = a + r * kc * 32;
    const uint16_t* src = r < blk.count ? p.z + static_cast<int64_t>(blk.rows[r]) * p.z_ld : nullptr;
    for (int64_t k = 0; k < kc; ++k)
      _mm512_storeu_si512(dst + k * 32, src ? _mm512_loadu_si512(src + a_off[k]) : _mm512_setzero_si512());
  }
}

// The next block's rows into L2 while this one computes (z is far larger than L2).
VISATTN_INLINE void prefetch_block(const AmxProjection& p, const GroupBlock& next, const BlockPlan& plan) {
  for (int64_t r = 0; r < next.count; ++r) {
    const char* src = reinterpret_cast<const char*>(p.z + static_cast<int64_t>(next.rows[r]) * p.z_ld);
    for (const int64_t off : plan.a_off) prefetch_l2(src + off * 2);
  }
}

// One step of 32 of K into tiles 4-7 (rows 0-15 / 16-31 of A by the B tiles b0 and b0 + 256: 16 columns each);
// rows 16-31 only with `two`.
VISATTN_AMX VISATTN_INLINE void step(const uint16_t* a0, int64_t a_ld, const int32_t* b0, bool two) {
  _tile_loadd(0, a0, a_ld * 2);
  _tile_loadd(2, b0, 64);
  _tile_dpbf16ps(4, 0, 2);
  _tile_loadd(3, b0 + 256, 64);
  _tile_dpbf16ps(5, 0, 3);
  if (two) {
    _tile_loadd(1, a0 + 16 * a_ld, a_ld * 2);
    _tile_dpbf16ps(6, 1, 2);
    _tile_dpbf16ps(7, 1, 3);
  }
}

// Tiles 4-7 from / to c [32, 32] float32.
VISATTN_AMX VISATTN_INLINE void load_tiles(const float* c) {
  _tile_loadd(4, c, 32 * 4);
  _tile_loadd(5, c + 16, 32 * 4);
  _tile_loadd(6, c + 16 * 32, 32 * 4);
  _tile_loadd(7, c + 16 * 32 + 16, 32 * 4);
}

VISATTN_AMX VISATTN_INLINE void store_tiles(float* c) {
  _tile_stored(4, c, 32 * 4);
  _tile_stored(5, c + 16, 32 * 4);
  _tile_stored(6, c + 16 * 32, 32 * 4);
  _tile_stored(7, c + 16 * 32 + 16, 32 * 4);
}

// c [32, 32] (+ bias[0 .. 32) where given) rounded to bf16 into out + row * out_ld + col for the block's rows.
VISATTN_AMX static inline void write_rows(const AmxProjection& p, const GroupBlock& blk, const float* c,
                                          const float* bias, int64_t col) {
  const __m512 b_lo = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b_hi = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int64_t r = 0, count = blk.count; r < count; ++r) {
    const float* cr = c + r * 32;
    const __m512i v = narrow(_mm512_add_ps(_mm512_loadu_ps(cr), b_lo), _mm512_add_ps(_mm512_loadu_ps(cr + 16), b_hi));
    _mm512_storeu_si512(p.out + static_cast<int64_t>(blk.rows[r]) * p.out_ld + col, v);
  }
}

// One block by its plan, in chunks of K (kChunkSteps): per chunk its rows staged, then per 32 output columns
// the chunk's steps, the sums kept in acc [Co/32, 32, 32] between chunks.
VISATTN_AMX static inline void project_block(const AmxProjection& p, const GroupBlock& blk, const BlockPlan& plan,
                                             uint16_t* a, float* acc) {
  const int64_t n = static_cast<int64_t>(plan.a_off.size()), steps = p.H * p.d / 32;
  const int64_t chunks = std::max<int64_t>(1, (n + kChunkSteps - 1) / kChunkSteps);
  const int64_t per_chunk = (n + chunks - 1) / chunks;
  const bool two = blk.count > 16;
  int64_t k0 = 0;
  do {  // once at least: the rows of a group of no head are the bias
    const int64_t kc = std::min(per_chunk, n - k0);
    const bool first = k0 == 0, last = k0 + kc == n;
    stage(p, blk, plan.a_off.data() + k0, kc, a);
    for (int64_t j0 = 0; j0 < p.Co; j0 += 32) {
      float* c = acc + j0 * 32;
      if (first) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
      } else {
        load_tiles(c);
      }
      const int32_t* panel = p.wp + j0 / 32 * steps * 512;
      for (int64_t k = 0; k < kc; ++k) step(a + 32 * k, 32 * kc, panel + plan.b_step[k0 + k] * 512, two);
      store_tiles(c);
      if (last) write_rows(p, blk, c, p.bias ? p.bias + j0 : nullptr, j0);
    }
    k0 += kc;
  } while (k0 < n);
}

}  // namespace amx
#endif

// Rows 32 * c0 .. 32 * c1 of w [Co, K] (bf16 or float32, contiguous; K and Co multiples of 32) into their
// place in wp [K/2 * Co] (amx::pack_pairs).
template <typename T>
inline void amx_pack_weight(const T* w, int64_t K, int64_t c0, int64_t c1, int32_t* wp) {
#if VISATTN_HAS_AMX_CODE
  amx::pack_pairs(w, K, c0, c1, wp);
#endif
}

// Blocks b0 .. b1 of `blocks` (head_groups), after amx_pack_weight. Call only where amx_attention_runs(p.d)
// and p.Co % 32 == 0.
inline void amx_project_blocks(const AmxProjection& p, const GroupBlock* blocks, int64_t b0, int64_t b1) {
#if VISATTN_HAS_AMX_CODE
  AlignedBuffer<uint16_t> a;
  AlignedBuffer<float> acc;
  a.resize(32 * 32 * amx::kChunkSteps);
  acc.resize(p.Co * 32);
  amx::BlockPlan plan, next_plan;
  for (amx::BlockPlan* q : {&plan, &next_plan}) {  // no allocation between tile instructions (see configure)
    q->a_off.reserve(p.H * p.d / 32);
    q->b_step.reserve(p.H * p.d / 32);
  }
  if (b0 < b1) amx::plan_block(p, blocks[b0], plan);
  amx::configure();
  for (int64_t b = b0; b < b1; ++b) {
    if (b + 1 < b1) {
      amx::plan_block(p, blocks[b + 1], next_plan);
      amx::prefetch_block(p, blocks[b + 1], next_plan);
    }
    amx::project_block(p, blocks[b], plan, a.data(), acc.data());
    std::swap(plan, next_plan);
  }
  amx::release();
#endif
}

}  // namespace visattn
