// MoH token-choice routing in one pass over the router's logits (visattn.attention.routing.HeadRouter,
// the masked dense path without gradients). Exact to float rounding against the PyTorch formulation:
// the same softmaxes, top-k (ties to the lower index), renormalisation and two-stage weights; the
// selection can differ only where two probabilities are within rounding of each other.
// Built on first use by visattn.kernels (torch.utils.cpp_extension); the PyTorch path is the fallback.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t BLOCK = 256;  // tokens per pass: every row of a block stays in L1


}  // namespace

// logits: [R, T] float32 head-major (rows: S shared when shared_routed, E routed, then 2 mix rows when
// two_stage) -> (gates [T, S + E] float32 token-major, keep [E, T] float32: 1 where a routed head is chosen).
std::tuple<at::Tensor, at::Tensor> moh_gates(const at::Tensor& logits_in, int64_t S, int64_t E, int64_t k, bool two_stage,
                     bool shared_routed, double eps_in) {
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.scalar_type() == at::kFloat, "moh_gates: logits must be [R, T] float32");
  auto logits = logits_in.contiguous();
  const int64_t R = logits.size(0), T = logits.size(1), H = S + E;
  TORCH_CHECK(E >= 1 && 1 <= k && k <= E && S >= 0 && R == (shared_routed ? S : 0) + E + (two_stage ? 2 : 0),
              "moh_gates: logits rows do not match the budget");
  auto gates = at::empty({T, H}, logits.options());
  auto keep_out = at::empty({E, T}, logits.options());
  const float* L = logits.data_ptr<float>();
  float* G = gates.data_ptr<float>();
  float* K = keep_out.data_ptr<float>();
  const float eps = static_cast<float>(eps_in);
  const int64_t routed0 = shared_routed ? S : 0;
  at::parallel_for(0, (T + BLOCK - 1) / BLOCK, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> buf((H + 4) * BLOCK);
    float* a0 = buf.data();
    float* a1 = a0 + BLOCK;
    float* mx = a1 + BLOCK;
    float* sum = mx + BLOCK;
    float* g = sum + BLOCK;  // [H, BLOCK]
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t t0 = blk * BLOCK, n = std::min(BLOCK, T - t0);
      auto row = [&](int64_t i) { return L + i * T + t0; };
      if (two_stage) {
        const float *m0 = row(R - 2), *m1 = row(R - 1);
        for (int64_t t = 0; t < n; ++t) {
          const float m = std::max(m0[t], m1[t]);
          const float e0 = visattn::exp_le0(m0[t] - m), e1 = visattn::exp_le0(m1[t] - m), s = e0 + e1;
          a0[t] = e0 / s * 2.0f;
          a1[t] = e1 / s * 2.0f;
        }
      }
      if (S > 0 && shared_routed) {
        std::copy(row(0), row(0) + n, mx);
        for (int64_t i = 1; i < S; ++i) {
          const float* l = row(i);
          for (int64_t t = 0; t < n; ++t) mx[t] = std::max(mx[t], l[t]);
        }
        std::fill(sum, sum + n, 0.0f);
        for (int64_t i = 0; i < S; ++i) {
          const float* l = row(i);
          float* gi = g + i * BLOCK;
          for (int64_t t = 0; t < n; ++t) { gi[t] = visattn::exp_le0(l[t] - mx[t]); sum[t] += gi[t]; }
        }
        for (int64_t i = 0; i < S; ++i) {
          float* gi = g + i * BLOCK;
          if (two_stage)
            for (int64_t t = 0; t < n; ++t) gi[t] = gi[t] / sum[t] * (a0[t] * static_cast<float>(S));
          else
            for (int64_t t = 0; t < n; ++t) gi[t] = gi[t] / sum[t] * static_cast<float>(S);
        }
      } else {
        for (int64_t i = 0; i < S; ++i)
          for (int64_t t = 0; t < n; ++t) g[i * BLOCK + t] = two_stage ? a0[t] : 1.0f;
      }
      if (E > 0) {
        std::copy(row(routed0), row(routed0) + n, mx);
        for (int64_t i = 1; i < E; ++i) {
          const float* l = row(routed0 + i);
          for (int64_t t = 0; t < n; ++t) mx[t] = std::max(mx[t], l[t]);
        }
        std::fill(sum, sum + n, 0.0f);
        float* p = g + S * BLOCK;  // [E, BLOCK]: the pool's probabilities, then its gates
        for (int64_t i = 0; i < E; ++i) {
          const float* l = row(routed0 + i);
          float* pi = p + i * BLOCK;
          for (int64_t t = 0; t < n; ++t) { pi[t] = visattn::exp_le0(l[t] - mx[t]); sum[t] += pi[t]; }
        }
        for (int64_t i = 0; i < E; ++i) {
          float* pi = p + i * BLOCK;
          for (int64_t t = 0; t < n; ++t) pi[t] = pi[t] / sum[t];
        }
        if (k < E) {  // rank = heads that beat head i (larger, or equal at a lower index); keep rank < k
          float* rank = mx;  // the max is no longer needed
          for (int64_t i = 0; i < E; ++i) {
            std::fill(rank, rank + n, 0.0f);
            const float* pi = p + i * BLOCK;
            for (int64_t j = 0; j < E; ++j) {
              if (j == i) continue;
              const float* pj = p + j * BLOCK;
              if (j < i) for (int64_t t = 0; t < n; ++t) rank[t] += pj[t] >= pi[t] ? 1.0f : 0.0f;
              else for (int64_t t = 0; t < n; ++t) rank[t] += pj[t] > pi[t] ? 1.0f : 0.0f;
            }
            float* ki = K + i * T + t0;
            for (int64_t t = 0; t < n; ++t) ki[t] = rank[t] < static_cast<float>(k) ? 1.0f : 0.0f;
          }
          std::fill(sum, sum + n, 0.0f);
          for (int64_t i = 0; i < E; ++i) {
            float* pi = p + i * BLOCK;
            const float* ki = K + i * T + t0;
            for (int64_t t = 0; t < n; ++t) { pi[t] = pi[t] * ki[t]; sum[t] += pi[t]; }
          }
        } else {
          std::fill(sum, sum + n, 0.0f);
          for (int64_t i = 0; i < E; ++i) {
            std::fill(K + i * T + t0, K + i * T + t0 + n, 1.0f);
            for (int64_t t = 0; t < n; ++t) sum[t] += p[i * BLOCK + t];
          }
        }
        for (int64_t t = 0; t < n; ++t) sum[t] = std::max(sum[t], eps);
        for (int64_t i = 0; i < E; ++i) {
          float* pi = p + i * BLOCK;
          if (two_stage)
            for (int64_t t = 0; t < n; ++t) pi[t] = pi[t] * (a1[t] * static_cast<float>(k) / sum[t]);
          else
            for (int64_t t = 0; t < n; ++t) pi[t] = pi[t] / sum[t] * static_cast<float>(k);
        }
      }
      float* out = G + t0 * H;
      for (int64_t t = 0; t < n; ++t)
        for (int64_t h = 0; h < H; ++h) out[t * H + h] = g[h * BLOCK + t];
    }
  });
  return {gates, keep_out};
}

TORCH_LIBRARY(visattn, m) {
  m.def("moh_gates(Tensor logits, int S, int E, int k, bool two_stage, bool shared_routed, float eps) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(visattn, CPU, m) { m.impl("moh_gates", &moh_gates); }
