// MKL's SGEMM for visattn.kernels, looked up at run time: x86 builds of libtorch_cpu export it, so the
// library loads on any build and callers check sgemm_fn() before use (the Python side keeps its PyTorch
// path where it is null).
#pragma once

#include <dlfcn.h>

namespace visattn {

using sgemm_t = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                         const int*, const float*, const int*, const float*, float*, const int*);

inline sgemm_t sgemm_fn() {
  static const sgemm_t fn = reinterpret_cast<sgemm_t>(dlsym(RTLD_DEFAULT, "sgemm_"));
  return fn;
}

// Row-major c[m, n] = alpha * op(a) @ op(b) + beta * c, with op(a) [m, k] (a stored [k, m] when a_t) and
// op(b) [k, n] (b stored [n, k] when b_t); ld* are the stored rows' strides.
inline void sgemm(bool a_t, bool b_t, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
                  int ldb, float beta, float* c, int ldc) {
  // column-major BLAS sees each row-major matrix transposed: c^T = op(b)^T @ op(a)^T
  sgemm_fn()(b_t ? "T" : "N", a_t ? "T" : "N", &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
}

}  // namespace visattn
