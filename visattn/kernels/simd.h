// SIMD helpers of visattn.kernels: an exp for softmaxes, for one float and for sixteen at once (lanes_t;
// std::exp stays a scalar call per element), and VISATTN_SIMD_CLONES, which compiles a
// hot loop for AVX-512, AVX2 with FMA (x86-64-v3), AVX2 alone and the baseline and picks one when the library
// loads. The library is built without -march so that one build serves every x86-64 CPU; without the clones
// its loops would use SSE only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// "avx2" alone does not enable FMA: until the 16th session every AVX2 CPU ran these loops' multiply-adds as a
// multiply and an add (half the rate, twice the latency; small_gemm at 28% of the FMA peak on a Zen 3).
#define VISATTN_SIMD_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "avx2", "default")))
// Two clones, for loops written in 8-lane vectors (lanes8_t) whose templates are many: an AVX-512 CPU runs the
// x86-64-v3 one. Four clones of small_attention's backward took over 7 minutes to compile on a 2-core machine.
#define VISATTN_SIMD_CLONES_V3 __attribute__((target_clones("arch=x86-64-v3", "default")))
// For code written for AVX-512 registers alone (fused_attention.h, row_gemm.h): call it only where
// avx512_runs(). For code written for AVX2 registers with FMA (fused_attention.h): only where avx2_fma_runs().
#define VISATTN_AVX512 __attribute__((target("avx512f,fma")))
#define VISATTN_AVX2 __attribute__((target("avx2,fma")))
#define VISATTN_HAS_AVX512_CODE 1
#else
#define VISATTN_SIMD_CLONES
#define VISATTN_SIMD_CLONES_V3
#define VISATTN_HAS_AVX512_CODE 0
#endif
#define VISATTN_INLINE __attribute__((always_inline)) inline

namespace visattn {

// Sixteen floats as one value: one AVX-512 register in the AVX-512 clone, two or four narrower ones in
// the others (GCC's vector extension; the compiler picks the instructions per clone).
constexpr int64_t kLanes = 16;
typedef float lanes_t __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t int_lanes_t __attribute__((vector_size(kLanes * sizeof(int32_t))));
// Eight floats: one AVX2 register. GCC 12 compiles compares and selects on lanes_t (the max and exp's clamp)
// into scalar code in the AVX2 clone, so loops that must vectorise there use these.
typedef float lanes8_t __attribute__((vector_size(8 * sizeof(float))));
typedef int32_t int_lanes8_t __attribute__((vector_size(8 * sizeof(int32_t))));

// exp(x) for a softmax's x = value - max <= 0, branch-free (Cody-Waite range reduction, degree-6
// polynomial: within 2 ulp of expf). Below -87 it returns exp(-87) ~ 1.6e-38 instead of a denormal or 0
// (no difference to a sum or a ranking of probabilities); NaN gives NaN (so does -inf, which only
// non-finite logits produce). One template for a float and for lanes_t (a whole block in explicit SIMD
// code, for loops that do not leave the vectorising to the compiler).
// Always inlined: an out-of-line copy would be compiled for the baseline, and a lanes_t passed to it from
// an AVX-512 clone would not be where it looks (the calling conventions differ per target).
template <typename F, typename I>
__attribute__((always_inline)) inline F exp_le0_impl(F x) {
  const F c = x < -87.0f ? F{} - 87.0f : x;
  const F n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const F r = (c - n * 0.693359375f) + n * 2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  I bits;
  std::memcpy(&bits, &p, sizeof(F));
  if constexpr (std::is_same_v<F, float>) bits += static_cast<int32_t>(n) * (1 << 23);
  else bits += __builtin_convertvector(n, I) * (1 << 23);
  F out;
  std::memcpy(&out, &bits, sizeof(F));
  return out + (x - x);
}
__attribute__((always_inline)) inline float exp_le0(float x) { return exp_le0_impl<float, int32_t>(x); }
__attribute__((always_inline)) inline lanes_t exp_le0(lanes_t x) { return exp_le0_impl<lanes_t, int_lanes_t>(x); }
__attribute__((always_inline)) inline lanes8_t exp_le0(lanes8_t x) { return exp_le0_impl<lanes8_t, int_lanes8_t>(x); }

// Whether this CPU runs the VISATTN_AVX512 code. VISATTN_KERNELS_AVX2=1 in the environment says no on any CPU:
// the kernels then take the paths and loops of a CPU without AVX-512 (those without AMX too), so that an
// AVX-512 machine tests them as well (visattn.kernels.AVX2_ONLY_ENV).
inline bool avx512_runs() {
#if VISATTN_HAS_AVX512_CODE
  static const bool runs = [] {
    const char* avx2_only = std::getenv("VISATTN_KERNELS_AVX2");
    if (avx2_only && std::strcmp(avx2_only, "1") == 0) return false;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  }();
  return runs;
#else
  return false;
#endif
}

// Whether this CPU runs the VISATTN_AVX2 code: AVX2 and FMA, which every CPU with AVX-512 has too.
inline bool avx2_fma_runs() {
#if VISATTN_HAS_AVX512_CODE
  static const bool runs = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return runs;
#else
  return false;
#endif
}

}  // namespace visattn
