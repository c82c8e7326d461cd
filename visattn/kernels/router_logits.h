// The linear routers' logits for a run of tokens, in the kernels' own loops (small_gemm): shared by
// moh_router_logits and moh_router_gates. Defined in moh_routed_heads.cpp, beside small_gemm.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace visattn {

// The routers' weights ([R_i, C] each, float32) stacked in order and transposed: [C, sum R_i rounded up to 16],
// the columns past the rows zero; the layout router_logits_rows reads.
std::vector<float> pack_router_weights(at::TensorList weights, int64_t C);

// out[t, 0..R) (row stride ldo) = x[t, :] @ wt for t < n: x [n, C] with row stride ldx, wt packed as
// above. Each row is summed in C order, the same whatever n, so any split of the tokens gives the same bits.
void router_logits_rows(int64_t n, int64_t R, int64_t C, const float* x, int64_t ldx, const float* wt, float* out,
                        int64_t ldo);

}  // namespace visattn
