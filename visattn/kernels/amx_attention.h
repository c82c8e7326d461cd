// The attention of one image's chosen (token, head) pairs in bfloat16 on AMX tiles, for
// moh_routed_attention's bf16 inputs (routed_kernel_dense under autocast): per head and tile of 16 chosen
// queries, the scores [16, N] from two tile products per 16 keys (queries and keys as bf16, sums in
// float32), the softmax in float32 AVX-512 (exp2_bf16), the probabilities rounded to bf16 and P @ V as tile
// products into four 16 x 16 float32 tiles, the gated outputs rounded to bf16 into their rows of z.
//
// Why: in bf16 the AMX matmuls run at 1.1-1.4 TFLOP/s, so SDPA's attention (113-197 GFLOP/s) is 51-71% of
// an MHA layer at ViT-S / DiT-B/2 sizes, and skipping heads' attention is where MoH can save time; the
// float32 loops of fused_attention.h on converted copies, and AVX512-BF16 dot products, ran no faster than
// SDPA (docs/results/benchmarks.md, 11th session). Heads 64 wide; CPUs with AMX-BF16 and AVX512-BF16 whose
// kernel grants the tile state (amx_attention_runs).
//
// The 12th session's profile (perf) of the first version: the softmax's exp was a third of its time, and
// cache misses on the query rows and on the key gathers another sixth (q, k and v are views of one
// [tokens, 3C] matmul output, far larger than L2). Hence one pass per row for exp, sum and rounding with
// a shorter exp, and prefetches of the next tile's queries and the next head's keys and values.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

#if VISATTN_HAS_AVX512_CODE && __GNUC__ >= 11
#define VISATTN_HAS_AMX_CODE 1
#define VISATTN_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512bf16,fma")))
#else
#define VISATTN_HAS_AMX_CODE 0
#endif

namespace visattn {

// Whether amx_attend_image serves heads `d` wide here: the CPU has AMX-BF16 and AVX512-BF16, and Linux
// lets this process use the tile registers (ARCH_REQ_XCOMP_PERM, asked once).
inline bool amx_attention_runs(int64_t d) {
#if VISATTN_HAS_AMX_CODE
  static const bool runs = [] {
    if (!avx512_runs() || !__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("avx512bf16") ||
        !__builtin_cpu_supports("avx512dq"))
      return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return runs && d == 64;
#else
  (void)d;
  return false;
#endif
}

// One image: every head from first_head on, its chosen tokens (mask as moh_routed_attention's), queries
// q + (b * N + n) * q_ld + h * d (bf16, to which q_bias, float32, is added), keys and values [N, d] per
// key/value head (bf16, row strides k_ld / v_ld, even), gates float32 [T, H], the values' float32 bias
// v_bias where v came without it; outputs bf16 into z [T, H * d] (row stride z_ld; 0 where a pair is off,
// or left as it was without zero_off). z may be q itself: a pair's query is read before the pair's output is
// written, and by no other pair.
struct AmxImage {
  int64_t B, N, H, Hkv, d, S, first_head, q_ld;
  const uint16_t* q;
  const float* q_bias;
  const uint16_t *k, *v;
  const int64_t *k_strides, *v_strides;
  const float *v_bias, *gates;
  const bool* mask;
  uint16_t* z;
  int64_t z_ld;
  bool zero_off;
};

// The first 64-byte aligned address from p on.
template <typename T>
T* aligned64(T* p) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) / 64 * 64);
}

// A buffer whose data() is 64-byte aligned, for tile loads and stores: a tile row that crosses a cache line
// costs two, and malloc aligns to 16 bytes (amx_projection.h's time moved between 2.4 and 5.3 ms from
// process to process with where its buffers landed, until they were aligned; 13th session).
template <typename T>
class AlignedBuffer {
 public:
  void resize(size_t n) { v_.resize(n + 64 / sizeof(T)); }
  T* data() { return aligned64(v_.data()); }

 private:
  std::vector<T> v_;
};

struct AmxScratch {
  AlignedBuffer<int32_t> kt, vp, qa, pb;
  AlignedBuffer<float> st, o;
  std::vector<int32_t> rows;
};

#if VISATTN_HAS_AMX_CODE
namespace amx {

constexpr int kTile = 16;  // queries per tile, keys per score tile

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes. Loaded before each head's tiles, after the last call that may go through
// the dynamic linker's lazy binder (memset, operator new): its xsave / xrstor between two tile
// instructions left the tiles unconfigured (SIGILL). So the functions below are static: called directly,
// never through the PLT. ldtilecfg in an asm statement of our own: GCC 12's _tile_loadconfig tells the
// compiler it reads 8 bytes of the configuration, so it may drop the stores of the rest (it did in
// amx_projection.h: every tile 0 rows, SIGILL).
VISATTN_AMX static inline void configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTile;
    cfg.colsb[t] = 64;
  }
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

VISATTN_AMX static inline void release() { _tile_release(); }

// 16 bf16 -> float32 (exact).
VISATTN_AMX VISATTN_INLINE __m512 widen(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 32 float32 -> 32 bf16, round to nearest even (NaN stays NaN).
VISATTN_AMX VISATTN_INLINE __m512i narrow(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }

// 2^t for t <= 0, t = (score - max) * log2(e): t = n + f with f in [-1/2, 1/2], 2^f from a degree-5
// polynomial (relative error 2.4e-6: the probabilities are rounded to bf16, 2^-9, and their float32 sum
// moves by less), times 2^n by vscalefps (0 below the smallest float; NaN stays NaN). Half the
// instructions of simd.h's exp_le0, which is within 2 ulp of expf for the float32 kernels.
VISATTN_AMX VISATTN_INLINE __m512 exp2_bf16(__m512 t) {
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);  // ln(2)^k / k!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, _mm512_sub_ps(t, f));
}

// The first `valid` of 16 lanes.
VISATTN_INLINE __mmask16 first_lanes(int64_t valid) {
  return valid >= 16 ? __mmask16(0xffff) : valid <= 0 ? __mmask16(0) : __mmask16((1u << valid) - 1);
}

// exp(score - max) of row[n .. n + 16) (shift = max * log2(e)), 0 past N. A function, not a lambda: a lambda
// does not inherit the target attribute.
VISATTN_AMX VISATTN_INLINE __m512 exp_from(const float* row, int64_t n, int64_t N, __m512 log2e, __m512 shift) {
  return _mm512_maskz_mov_ps(first_lanes(N - n), exp2_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(row + n), log2e, shift)));
}

// A row of scores, float32 [Np] (keys past N ignored) -> exp(score - max) rounded to bf16 in out [Np] (0
// past N); returns 1 / the float32 sum of the unrounded values, as simd.h's exp_row does. One pass for
// the maximum, one for the rest.
VISATTN_AMX VISATTN_INLINE float exp_row_bf16(const float* row, int64_t N, int64_t Np, uint16_t* out) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), lowest = _mm512_set1_ps(-INFINITY);
  __m512 mx = lowest;
  for (int64_t n = 0; n < N; n += kTile)
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(lowest, first_lanes(N - n), row + n));
  const __m512 shift = _mm512_mul_ps(_mm512_set1_ps(_mm512_reduce_max_ps(mx)), log2e);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t n = 0; n < Np; n += 2 * kTile) {
    const __m512 e0 = exp_from(row, n, N, log2e, shift), e1 = exp_from(row, n + kTile, N, log2e, shift);
    sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
    _mm512_storeu_si512(out + n, narrow(e0, e1));
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// Key/value head kvh of image b into tile layouts: kt [d/2][Np] (pairs of a key's dimensions 2c, 2c+1 as
// one int32: the B operand of the scores), vp [Np/2][d] (pairs of keys 2m, 2m+1 per column: P @ V's B
// operand); keys past N are 0.
VISATTN_AMX static inline void pack_kv(const AmxImage& a, int64_t b, int64_t kvh, int64_t Np, AmxScratch& s) {
  const int64_t N = a.N, d = a.d, d2 = d / 2;
  const uint16_t* kb = a.k + b * a.k_strides[0] + kvh * a.k_strides[1];
  const uint16_t* vb = a.v + b * a.v_strides[0] + kvh * a.v_strides[1];
  const int32_t* kw = reinterpret_cast<const int32_t*>(kb);
  const int64_t k_ld2 = a.k_strides[2] / 2;  // the key rows' stride in int32
  for (int64_t n0 = 0; n0 < Np; n0 += kLanes) {
    alignas(64) int32_t idx[kLanes];
    for (int l = 0; l < kLanes; ++l) idx[l] = static_cast<int32_t>(std::min<int64_t>(n0 + l, N - 1) * k_ld2);
    const __m512i at = _mm512_load_si512(idx);
    const __mmask16 valid = first_lanes(N - n0);
    for (int64_t c = 0; c < d2; ++c)
      _mm512_storeu_si512(s.kt.data() + c * Np + n0, _mm512_maskz_mov_epi32(valid, _mm512_i32gather_epi32(at, kw + c, 4)));
  }
  // interleave rows 2m and 2m+1 column by column
  alignas(64) int16_t lo_idx[32], hi_idx[32];
  for (int c = 0; c < 16; ++c) {
    lo_idx[2 * c] = static_cast<int16_t>(c);
    lo_idx[2 * c + 1] = static_cast<int16_t>(32 + c);
    hi_idx[2 * c] = static_cast<int16_t>(16 + c);
    hi_idx[2 * c + 1] = static_cast<int16_t>(48 + c);
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int64_t m = 0; m < Np / 2; ++m) {
    for (int64_t c0 = 0; c0 < d; c0 += 32) {
      const int64_t n = 2 * m;
      const __m512i r0 = n < N ? _mm512_loadu_si512(vb + n * a.v_strides[2] + c0) : _mm512_setzero_si512();
      const __m512i r1 = n + 1 < N ? _mm512_loadu_si512(vb + (n + 1) * a.v_strides[2] + c0) : _mm512_setzero_si512();
      _mm512_storeu_si512(s.vp.data() + m * d + c0, _mm512_permutex2var_epi16(r0, lo, r1));
      _mm512_storeu_si512(s.vp.data() + m * d + c0 + 16, _mm512_permutex2var_epi16(r0, hi, r1));
    }
  }
}

// Queries rows[0..mq) of head h (mq <= 16; the rest repeat the last), attended and written to z.
VISATTN_AMX static inline void tile(const AmxImage& a, int64_t b, int64_t h, const int32_t* rows, int mq, int64_t Np,
                             AmxScratch& s) {
  const int64_t N = a.N, d = a.d, H = a.H, kvh = h / (H / a.Hkv);
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  uint16_t* qa = reinterpret_cast<uint16_t*>(s.qa.data());
  for (int r = 0; r < kTile; ++r) {  // (q + q_bias) * scale, rounded to bf16: [16, d]
    const uint16_t* src = a.q + (b * N + rows[std::min(r, mq - 1)]) * a.q_ld + h * d;
    for (int64_t c = 0; c < d; c += 32) {
      __m512 x0 = widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c)));
      __m512 x1 = widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c + 16)));
      if (a.q_bias) {
        x0 = _mm512_add_ps(x0, _mm512_loadu_ps(a.q_bias + h * d + c));
        x1 = _mm512_add_ps(x1, _mm512_loadu_ps(a.q_bias + h * d + c + 16));
      }
      const __m512 sc = _mm512_set1_ps(scale);
      _mm512_storeu_si512(qa + r * d + c, narrow(_mm512_mul_ps(x0, sc), _mm512_mul_ps(x1, sc)));
    }
  }
  float* st = s.st.data();
  _tile_loadd(0, qa, d * 2);       // dimensions 0..31 of the 16 queries
  _tile_loadd(1, qa + 32, d * 2);  // 32..63
  for (int64_t n0 = 0; n0 < Np; n0 += kTile) {
    _tile_zero(4);
    _tile_loadd(2, s.kt.data() + n0, Np * 4);
    _tile_dpbf16ps(4, 0, 2);
    _tile_loadd(3, s.kt.data() + 16 * Np + n0, Np * 4);
    _tile_dpbf16ps(4, 1, 3);
    _tile_stored(4, st + n0, Np * 4);
  }
  alignas(64) float inv[kTile];
  uint16_t* pb = reinterpret_cast<uint16_t*>(s.pb.data());
  for (int r = 0; r < kTile; ++r) inv[r] = exp_row_bf16(st + r * Np, N, Np, pb + r * Np);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t m0 = 0; m0 < Np / 2; m0 += kTile) {  // 32 keys per step: pairs m0 .. m0 + 15
    _tile_loadd(0, pb + 2 * m0, Np * 2);
    _tile_loadd(2, s.vp.data() + m0 * d, d * 4);
    _tile_dpbf16ps(4, 0, 2);
    _tile_loadd(3, s.vp.data() + m0 * d + 16, d * 4);
    _tile_dpbf16ps(5, 0, 3);
    _tile_loadd(2, s.vp.data() + m0 * d + 32, d * 4);
    _tile_dpbf16ps(6, 0, 2);
    _tile_loadd(3, s.vp.data() + m0 * d + 48, d * 4);
    _tile_dpbf16ps(7, 0, 3);
  }
  float* o = s.o.data();
  _tile_stored(4, o, d * 4);
  _tile_stored(5, o + 16, d * 4);
  _tile_stored(6, o + 32, d * 4);
  _tile_stored(7, o + 48, d * 4);
  const float* bv = a.v_bias ? a.v_bias + kvh * d : nullptr;
  for (int r = 0; r < mq; ++r) {  // (o / sum + v_bias) * gate -> bf16
    const int64_t n = rows[r];
    const __m512 g = _mm512_set1_ps(a.gates[(b * N + n) * H + h]), sc = _mm512_set1_ps(inv[r]);
    uint16_t* zr = a.z + (b * N + n) * a.z_ld + h * d;
    for (int64_t c = 0; c < d; c += 32) {
      __m512 y0 = _mm512_mul_ps(_mm512_loadu_ps(o + r * d + c), sc);
      __m512 y1 = _mm512_mul_ps(_mm512_loadu_ps(o + r * d + c + 16), sc);
      if (bv) {
        y0 = _mm512_add_ps(y0, _mm512_loadu_ps(bv + c));
        y1 = _mm512_add_ps(y1, _mm512_loadu_ps(bv + c + 16));
      }
      _mm512_storeu_si512(zr + c, narrow(_mm512_mul_ps(y0, g), _mm512_mul_ps(y1, g)));
    }
  }
}

// Prefetches as asm statements: GCC took prefetch_next, a function of _mm_prefetch calls alone, for one
// without side effects and deleted the call (none were in the binary).
VISATTN_INLINE void prefetch_l1(const char* p) { asm volatile("prefetcht0 %0" : : "m"(*p)); }
VISATTN_INLINE void prefetch_l2(const char* p) { asm volatile("prefetcht1 %0" : : "m"(*p)); }

// Prefetches for the tile after tile t of `tiles` (of head h in image b, queries rows[0..m)): its query rows
// into L1, and a share of the next key/value head's rows (this image's next one, else the next image's
// first) into L2.
VISATTN_AMX static inline void prefetch_next(const AmxImage& a, int64_t b, int64_t h, const int32_t* rows, int64_t m,
                                             int64_t t, int64_t tiles) {
  const int64_t N = a.N, d = a.d, group = a.H / a.Hkv, kvh = h / group;
  for (int64_t i = (t + 1) * kTile; i < std::min<int64_t>(m, (t + 2) * kTile); ++i) {
    const char* q = reinterpret_cast<const char*>(a.q + (b * N + rows[i]) * a.q_ld + h * d);
    for (int64_t c = 0; c < d * 2; c += 64) prefetch_l1(q + c);
  }
  const bool same_image = h + 1 < a.H && (h + 1) / group != kvh;
  if (!same_image && (h + 1 < a.H || b + 1 >= a.B)) return;  // the next head shares these keys; or none is left
  const int64_t nb = same_image ? b : b + 1, nkv = same_image ? kvh + 1 : 0;
  const char* k = reinterpret_cast<const char*>(a.k + nb * a.k_strides[0] + nkv * a.k_strides[1]);
  const char* v = reinterpret_cast<const char*>(a.v + nb * a.v_strides[0] + nkv * a.v_strides[1]);
  for (int64_t n = N * t / tiles; n < N * (t + 1) / tiles; ++n)
    for (int64_t c = 0; c < d * 2; c += 64) {
      prefetch_l2(k + n * a.k_strides[2] * 2 + c);
      prefetch_l2(v + n * a.v_strides[2] * 2 + c);
    }
}

VISATTN_AMX static inline void image(const AmxImage& a, int64_t b, AmxScratch& s) {
  const int64_t N = a.N, d = a.d, H = a.H, group = H / a.Hkv;
  const int64_t Np = (N + 31) / 32 * 32;  // keys padded to whole steps of P @ V
  s.kt.resize(d / 2 * Np);
  s.vp.resize(Np / 2 * d);
  s.qa.resize(kTile * d / 2);
  s.pb.resize(kTile * Np / 2);
  s.st.resize(kTile * Np);
  s.o.resize(kTile * d);
  int64_t loaded = -1;
  for (int64_t h = a.first_head; h < H; ++h) {
    const int64_t kvh = h / group;
    if (kvh != loaded) {
      pack_kv(a, b, kvh, Np, s);
      loaded = kvh;
    }
    s.rows.clear();
    const bool* chosen = h >= a.S ? a.mask + (h - a.S) * a.B * N + b * N : nullptr;
    for (int64_t n = 0; n < N; ++n)
      if (!chosen || chosen[n]) s.rows.push_back(static_cast<int32_t>(n));
    const int64_t m = static_cast<int64_t>(s.rows.size()), tiles = (m + kTile - 1) / kTile;
    configure();
    for (int64_t t = 0; t < tiles; ++t) {
      prefetch_next(a, b, h, s.rows.data(), m, t, tiles);
      tile(a, b, h, s.rows.data() + t * kTile, static_cast<int>(std::min<int64_t>(kTile, m - t * kTile)), Np, s);
    }
    if (chosen && a.zero_off)
      for (int64_t n = 0; n < N; ++n)
        if (!chosen[n]) std::memset(a.z + (b * N + n) * a.z_ld + h * d, 0, d * sizeof(uint16_t));
  }
}

}  // namespace amx
#endif

// Images b0 .. b1 of a (see AmxImage). Call only where amx_attention_runs(a.d).
inline void amx_attend_images(const AmxImage& a, int64_t b0, int64_t b1, AmxScratch& scratch) {
#if VISATTN_HAS_AMX_CODE
  for (int64_t b = b0; b < b1; ++b) amx::image(a, b, scratch);
  amx::release();
#endif
}

}  // namespace visattn
