// SIMD helpers of visattn.kernels: a vectorisable exp for softmaxes (the compiler turns loops over it into
// SIMD code, where std::exp stays a scalar call per element), and VISATTN_SIMD_CLONES, which compiles a
// hot loop for AVX-512, AVX2 and the baseline and picks one when the library loads. The library is built
// without -march so that one build serves every x86-64 CPU; without the clones its loops would use SSE only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VISATTN_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VISATTN_SIMD_CLONES
#endif

namespace visattn {

// exp(x) for a softmax's x = value - max <= 0, branch-free so that the loops over tokens vectorise
// (Cody-Waite range reduction, degree-6 polynomial: within 2 ulp of expf). Below -87 it returns
// exp(-87) ~ 1.6e-38 instead of a denormal or 0 (no difference to a sum or a ranking of
// probabilities); NaN gives NaN (so does -inf, which only non-finite logits produce).
inline float exp_le0(float x) {
  const float c = std::max(x, -87.0f);
  const float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (c - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) * (1 << 23);
  float out;
  std::memcpy(&out, &bits, 4);
  return out + (x - x);
}

}  // namespace visattn
