// MoH token-choice routing and gating in one pass each (visattn.attention.routing.HeadRouter and
// HeadAttention.merge_heads), forward and backward. Exact to float rounding against the PyTorch
// formulation: the same softmaxes, top-k (ties to the lower index), renormalisation and two-stage
// weights; the selection can differ only where two probabilities are within rounding of each other.
// Also head choice's selection (moh_head_choice) and the per-image head load (moh_head_load), both
// bit for bit as the PyTorch code gives them.
// Built on first use by visattn.kernels (torch.utils.cpp_extension); the PyTorch path is the fallback.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "blas.h"
#include "router_logits.h"
#include "simd.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t BLOCK = 256;  // tokens per pass: every row of a block stays in L1

// logits[i, t0 .. t0 + n) for every row i -> dst [R, BLOCK]; the logits in any layout: head-major [R, T], or
// the router's columns of the attention's fused projection read in place ([T, R] with a row stride).
void load_rows(const at::Tensor& logits, int64_t t0, int64_t n, float* dst) {
  const float* L = logits.data_ptr<float>();
  const int64_t R = logits.size(0), sr = logits.stride(0), st = logits.stride(1);
  for (int64_t i = 0; i < R; ++i) {
    const float* src = L + i * sr + t0 * st;
    float* d = dst + i * BLOCK;
    if (st == 1) std::copy(src, src + n, d);
    else for (int64_t t = 0; t < n; ++t) d[t] = src[t * st];
  }
}

// moh_router_gates' input in place of a logits tensor: the tokens x [T, C] (row stride ldx) and the routers'
// weights packed by visattn::pack_router_weights; each block's logits are computed into the block's rows.
struct RouterInput {
  const float* x;
  int64_t ldx, C;
  const float* wt;
};

// The logits of tokens t0 .. t0 + n from the routers' input -> dst [R, BLOCK] (head-major, as load_rows gives
// them); tok: scratch [BLOCK, R].
void block_logits(const RouterInput& in, int64_t t0, int64_t n, int64_t R, float* tok, float* dst) {
  visattn::router_logits_rows(n, R, in.C, in.x + t0 * in.ldx, in.ldx, in.wt, tok, R);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < R; ++i) dst[i * BLOCK + t] = tok[t * R + i];
}

struct GatesArgs {
  const at::Tensor& logits;  // undefined where `input` is given
  const RouterInput* input;
  int64_t S, E, k;
  bool two_stage, shared_routed, with_aux;
  float eps;
  int64_t routed0, R, H, T;
  float* G;
  float* K;
  double* partial;
};

struct GatesBackwardArgs {
  const at::Tensor& logits;
  int64_t S, E, k;
  bool two_stage, shared_routed;
  float eps;
  int64_t routed0, R, H, T;
  const float* K;
  const float* dG;
  const float* W;
  const at::Tensor& out;
};

// One thread's buffers for a block of tokens: a0, a1, mx, sum [BLOCK] each, g [H, BLOCK] and the block's
// logits lb [R, BLOCK].
struct BlockScratch {
  std::vector<float> buf;
  float *a0, *a1, *mx, *sum, *g, *lb;
  BlockScratch(int64_t H, int64_t R) : buf((H + R + 4) * BLOCK) {
    a0 = buf.data();
    a1 = a0 + BLOCK;
    mx = a1 + BLOCK;
    sum = mx + BLOCK;
    g = sum + BLOCK;
    lb = g + H * BLOCK;
  }
};

// One block's softmaxes from its logits w.lb (n tokens): the two-stage weights times 2 (w.a0, w.a1), the
// shared heads' gates (rows 0..S of w.g) and the routed pool's probabilities (rows S..S+E of w.g); w.mx and
// w.sum are scratch. Token choice (moh_gates) and head choice (moh_head_choice_gates) share it.
inline __attribute__((always_inline)) void block_softmaxes(BlockScratch& w, int64_t n, int64_t S, int64_t E,
                                                           int64_t R, int64_t routed0, bool two_stage,
                                                           bool shared_routed) {
  const float* lb = w.lb;
  float *a0 = w.a0, *a1 = w.a1, *mx = w.mx, *sum = w.sum, *g = w.g;
  auto row = [&](int64_t i) { return lb + i * BLOCK; };
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
  }
}

// moh_gates' work on blocks [b0, b1) of tokens; compiled per instruction set (VISATTN_SIMD_CLONES).
VISATTN_SIMD_CLONES void gates_blocks(const GatesArgs& a, int64_t b0, int64_t b1) {
  const auto& logits = a.logits;
  const int64_t S = a.S, E = a.E, k = a.k, R = a.R, H = a.H, T = a.T, routed0 = a.routed0;
  const bool two_stage = a.two_stage, shared_routed = a.shared_routed, with_aux = a.with_aux;
  const float eps = a.eps;
  float* G = a.G;
  float* K = a.K;
  double* partial = a.partial;

    BlockScratch w(H, R);
    std::vector<float> tok(a.input != nullptr ? BLOCK * R : 0);
    float *a1 = w.a1, *mx = w.mx, *sum = w.sum, *g = w.g;
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t t0 = blk * BLOCK, n = std::min(BLOCK, T - t0);
      if (a.input != nullptr) block_logits(*a.input, t0, n, R, tok.data(), w.lb);
      else load_rows(logits, t0, n, w.lb);
      block_softmaxes(w, n, S, E, R, routed0, two_stage, shared_routed);
      if (E > 0) {
        float* p = g + S * BLOCK;  // [E, BLOCK]: the pool's probabilities, then its gates
        if (with_aux)
          for (int64_t i = 0; i < E; ++i) {
            const float* pi = p + i * BLOCK;
            float acc = 0.0f;
            for (int64_t t = 0; t < n; ++t) acc += pi[t];
            partial[(blk * 2 + 1) * E + i] = acc;
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
        if (with_aux)
          for (int64_t i = 0; i < E; ++i) {
            const float* ki = K + i * T + t0;
            float acc = 0.0f;
            for (int64_t t = 0; t < n; ++t) acc += ki[t];
            partial[blk * 2 * E + i] = acc;
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
  }

// moh_gates_backward's work on blocks [b0, b1) of tokens; compiled per instruction set.
VISATTN_SIMD_CLONES void gates_backward_blocks(const GatesBackwardArgs& a, int64_t b0, int64_t b1) {
  const auto& logits = a.logits;
  const int64_t S = a.S, E = a.E, k = a.k, R = a.R, H = a.H, T = a.T, routed0 = a.routed0;
  const bool two_stage = a.two_stage, shared_routed = a.shared_routed;
  const float eps = a.eps, kf = static_cast<float>(k), Sf = static_cast<float>(S);
  const float* K = a.K;
  const float* dG = a.dG;
  const float* W = a.W;
  const at::Tensor& out = a.out;
  const int64_t osr = out.stride(0), ost = out.stride(1);

    std::vector<float> buf((2 * H + 2 * R + 7) * BLOCK);
    float* s0 = buf.data();     // two-stage softmax
    float* s1 = s0 + BLOCK;
    float* da0 = s1 + BLOCK;    // d loss / d alpha
    float* da1 = da0 + BLOCK;
    float* mx = da1 + BLOCK;
    float* sum = mx + BLOCK;
    float* dot = sum + BLOCK;
    float* p = dot + BLOCK;     // [H, BLOCK] probabilities (shared rows, then the pool's)
    float* dp = p + H * BLOCK;  // [H, BLOCK] their gradients
    float* lb = dp + H * BLOCK; // [R, BLOCK] the block's logits
    float* dL = lb + R * BLOCK; // [R, BLOCK] their gradients, stored to `out` at the end of the block
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t t0 = blk * BLOCK, n = std::min(BLOCK, T - t0);
      load_rows(logits, t0, n, lb);
      auto row = [&](int64_t i) { return lb + i * BLOCK; };
      auto g = [&](int64_t t, int64_t h) { return dG[(t0 + t) * H + h]; };
      auto softmax = [&](int64_t first, int64_t rows, float* pr) {  // rows of L from `first` -> pr [rows, BLOCK]
        if (rows == 0) return;  // a dense layer's empty pool
        std::copy(row(first), row(first) + n, mx);
        for (int64_t i = 1; i < rows; ++i) {
          const float* l = row(first + i);
          for (int64_t t = 0; t < n; ++t) mx[t] = std::max(mx[t], l[t]);
        }
        std::fill(sum, sum + n, 0.0f);
        for (int64_t i = 0; i < rows; ++i) {
          const float* l = row(first + i);
          float* pi = pr + i * BLOCK;
          for (int64_t t = 0; t < n; ++t) { pi[t] = visattn::exp_le0(l[t] - mx[t]); sum[t] += pi[t]; }
        }
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t t = 0; t < n; ++t) pr[i * BLOCK + t] = pr[i * BLOCK + t] / sum[t];
      };
      auto softmax_backward = [&](int64_t rows, const float* pr, const float* dpr, float* out_rows) {
        std::fill(dot, dot + n, 0.0f);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t t = 0; t < n; ++t) dot[t] += pr[i * BLOCK + t] * dpr[i * BLOCK + t];
        for (int64_t i = 0; i < rows; ++i) {
          float* o = out_rows + i * BLOCK;
          for (int64_t t = 0; t < n; ++t) o[t] = pr[i * BLOCK + t] * (dpr[i * BLOCK + t] - dot[t]);
        }
      };
      if (two_stage) {
        const float *m0 = row(R - 2), *m1 = row(R - 1);
        for (int64_t t = 0; t < n; ++t) {
          const float m = std::max(m0[t], m1[t]);
          const float e0 = visattn::exp_le0(m0[t] - m), e1 = visattn::exp_le0(m1[t] - m), s = e0 + e1;
          s0[t] = e0 / s;
          s1[t] = e1 / s;
        }
      }
      std::fill(da0, da0 + n, 0.0f);
      std::fill(da1, da1 + n, 0.0f);
      if (S > 0 && shared_routed) {  // gates ps_i * S (* 2 s0)
        softmax(0, S, p);
        for (int64_t i = 0; i < S; ++i) {
          const float* pi = p + i * BLOCK;
          float* di = dp + i * BLOCK;
          if (two_stage)
            for (int64_t t = 0; t < n; ++t) {
              di[t] = g(t, i) * (2.0f * s0[t] * Sf);
              da0[t] += g(t, i) * pi[t] * Sf;
            }
          else
            for (int64_t t = 0; t < n; ++t) di[t] = g(t, i) * Sf;
        }
        softmax_backward(S, p, dp, dL);
      } else if (S > 0 && two_stage) {  // gates alpha0 = 2 s0
        for (int64_t i = 0; i < S; ++i)
          for (int64_t t = 0; t < n; ++t) da0[t] += g(t, i);
      }
      // the pool: gates kept_i * c / D with kept = p * keep, D = max(sum kept, eps), c = 2 s1 k (or k)
      float* pr = p + S * BLOCK;
      float* dpr = dp + S * BLOCK;
      softmax(routed0, E, pr);
      std::fill(sum, sum + n, 0.0f);
      std::fill(dot, dot + n, 0.0f);  // sum_i grad_i * kept_i
      for (int64_t i = 0; i < E; ++i) {
        const float* pi = pr + i * BLOCK;
        const float* ki = K + i * T + t0;
        for (int64_t t = 0; t < n; ++t) {
          const float kept = pi[t] * ki[t];
          sum[t] += kept;
          dot[t] += g(t, S + i) * kept;
        }
      }
      for (int64_t i = 0; i < E; ++i) {
        const float* ki = K + i * T + t0;
        float* di = dpr + i * BLOCK;
        const float w = W != nullptr ? W[i] : 0.0f;
        for (int64_t t = 0; t < n; ++t) {
          const float D = std::max(sum[t], eps);
          const float c = two_stage ? 2.0f * s1[t] * kf : kf;
          // clamp_min passes its gradient where sum >= eps (as torch's clamp_min backward)
          const float dD = sum[t] >= eps ? -dot[t] * c / (D * D) : 0.0f;
          di[t] = (g(t, S + i) * c / D + dD) * ki[t] + w;
        }
      }
      if (two_stage)
        for (int64_t t = 0; t < n; ++t) da1[t] = dot[t] * kf / std::max(sum[t], eps);
      // softmax backward of the pool (dot reused)
      std::fill(dot, dot + n, 0.0f);
      for (int64_t i = 0; i < E; ++i)
        for (int64_t t = 0; t < n; ++t) dot[t] += pr[i * BLOCK + t] * dpr[i * BLOCK + t];
      for (int64_t i = 0; i < E; ++i) {
        float* o = dL + (routed0 + i) * BLOCK;
        for (int64_t t = 0; t < n; ++t) o[t] = pr[i * BLOCK + t] * (dpr[i * BLOCK + t] - dot[t]);
      }
      if (two_stage) {  // alpha = 2 softmax(mix)
        float *o0 = dL + (R - 2) * BLOCK, *o1 = dL + (R - 1) * BLOCK;
        for (int64_t t = 0; t < n; ++t) {
          const float d0 = 2.0f * da0[t], d1 = 2.0f * da1[t], m = s0[t] * d0 + s1[t] * d1;
          o0[t] = s0[t] * (d0 - m);
          o1[t] = s1[t] * (d1 - m);
        }
      }
      float* O = out.data_ptr<float>();
      for (int64_t i = 0; i < R; ++i)
        for (int64_t t = 0; t < n; ++t) O[i * osr + (t0 + t) * ost] = dL[i * BLOCK + t];
    }
  }

}  // namespace

// logits: [R, T] float32 head-major (rows: S shared when shared_routed, E routed, then 2 mix rows when
// two_stage) -> (gates [T, S + E] float32 token-major, keep [E, T] float32: 1 where a routed head is chosen,
// and with `with_aux` the load-balancing loss's terms: load [E], the share of tokens that chose each routed
// head, and the loss E * sum_e load_e * mean_t P[e, t] (0-dim); else an empty tensor and 0).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moh_gates(const at::Tensor& logits_in, int64_t S, int64_t E, int64_t k,
                                                         bool two_stage, bool shared_routed, double eps_in,
                                                         bool with_aux) {
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.scalar_type() == at::kFloat, "moh_gates: logits must be [R, T] float32");
  const auto& logits = logits_in;  // any strides (load_rows)
  const int64_t R = logits.size(0), T = logits.size(1), H = S + E;
  TORCH_CHECK(((E >= 1 && 1 <= k && k <= E) || (E == 0 && k == 0 && !two_stage)) && S >= 0 &&
                  R == (shared_routed ? S : 0) + E + (two_stage ? 2 : 0),
              "moh_gates: logits rows do not match the budget");
  auto gates = at::empty({T, H}, logits.options());
  auto keep_out = at::empty({E, T}, logits.options());
  const int64_t blocks = (T + BLOCK - 1) / BLOCK;
  // per block: sum_t keep[e, t], then sum_t P[e, t] (summed in block order below: the same on any thread count)
  std::vector<double> partial(with_aux ? blocks * 2 * E : 0);
  float* G = gates.data_ptr<float>();
  float* K = keep_out.data_ptr<float>();
  const float eps = static_cast<float>(eps_in);
  const int64_t routed0 = shared_routed ? S : 0;
  const GatesArgs args{logits, nullptr, S, E, k, two_stage, shared_routed, with_aux, eps, routed0, R, H, T, G, K,
                       partial.data()};
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) { gates_blocks(args, b0, b1); });
  auto load = at::empty({with_aux ? E : 0}, logits.options());
  auto aux = at::zeros({}, logits.options());
  if (with_aux && T > 0) {
    double loss = 0.0;
    for (int64_t i = 0; i < E; ++i) {
      double kept = 0.0, prob = 0.0;
      for (int64_t blk = 0; blk < blocks; ++blk) {
        kept += partial[blk * 2 * E + i];
        prob += partial[(blk * 2 + 1) * E + i];
      }
      load.data_ptr<float>()[i] = static_cast<float>(kept / T);
      loss += (kept / T) * (prob / T);
    }
    aux.fill_(loss * E);
  }
  return {gates, keep_out, load, aux};
}

// The gradient of moh_gates' gates (and of the load-balancing loss) with respect to its logits.
// logits, keep: as moh_gates took and returned them; grad_gates: [T, S + E]; aux_grad: [E] added to each
// token's gradient of the pool's probabilities (d loss / d P[e, t], the same for every token), or empty.
// -> grad_logits [R, T], laid out as the logits are (token-major when they were, so that the projection's
// backward reads it contiguously). The softmaxes are recomputed per token; the selection is moh_gates' own.
at::Tensor moh_gates_backward(const at::Tensor& logits_in, const at::Tensor& keep_in, const at::Tensor& grad_in,
                              const at::Tensor& aux_grad_in, int64_t S, int64_t E, int64_t k, bool two_stage,
                              bool shared_routed, double eps_in) {
  const auto& logits = logits_in;  // any strides (load_rows)
  auto keep = keep_in.contiguous();
  auto grad = grad_in.contiguous();
  auto aux_grad = aux_grad_in.contiguous();
  const int64_t R = logits.size(0), T = logits.size(1), H = S + E;
  TORCH_CHECK(logits.scalar_type() == at::kFloat && keep.scalar_type() == at::kFloat && grad.scalar_type() == at::kFloat,
              "moh_gates_backward: float32 tensors expected");
  TORCH_CHECK(E >= 0 && R == (shared_routed ? S : 0) + E + (two_stage ? 2 : 0) && keep.size(0) == E &&
                  keep.size(1) == T && grad.size(0) == T && grad.size(1) == H,
              "moh_gates_backward: shapes do not match the budget");
  TORCH_CHECK(aux_grad.numel() == 0 || aux_grad.numel() == E, "moh_gates_backward: aux_grad must be [E] or empty");
  const bool token_major = logits.stride(0) == 1 && R > 1;
  auto out = token_major ? at::empty({T, R}, logits.options()).t() : at::empty({R, T}, logits.options());
  const float* K = keep.data_ptr<float>();
  const float* dG = grad.data_ptr<float>();
  const float* W = aux_grad.numel() ? aux_grad.data_ptr<float>() : nullptr;
  const float eps = static_cast<float>(eps_in);
  const int64_t routed0 = shared_routed ? S : 0;
  const GatesBackwardArgs args{logits, S, E, k, two_stage, shared_routed, eps, routed0, R, H, T, K, dG, W, out};
  at::parallel_for(0, (T + BLOCK - 1) / BLOCK, 1, [&](int64_t b0, int64_t b1) { gates_backward_blocks(args, b0, b1); });
  return out;
}

// keep [E, T] (1 where a token chose routed head e, tokens image-major, `tokens` per image) -> [B, S + E]:
// each image's share of tokens per head, 1 for the S shared heads (HeadRouter.head_load, the load
// plots' statistic). ATen's mean, pad and transpose cost more than the routing pass itself at the
// study's sizes (86 against 65 us a layer).
at::Tensor moh_head_load(const at::Tensor& keep_in, int64_t tokens, int64_t S) {
  TORCH_CHECK(keep_in.dim() == 2 && keep_in.scalar_type() == at::kFloat, "moh_head_load: keep must be [E, T] float32");
  TORCH_CHECK(tokens > 0 && keep_in.size(1) % tokens == 0 && S >= 0, "moh_head_load: ", keep_in.size(1),
              " tokens are not whole images of ", tokens);
  auto keep = keep_in.contiguous();
  const int64_t E = keep.size(0), B = keep.size(1) / tokens, H = S + E;
  auto out = at::empty({B, H}, keep.options());
  const float* K = keep.data_ptr<float>();
  float* L = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < S; ++h) L[b * H + h] = 1.0f;
    for (int64_t e = 0; e < E; ++e) {
      const float* row = K + e * B * tokens + b * tokens;
      float sum = 0.0f;  // whole counts (0 or 1 each): exact in float32 up to 2^24 tokens
      for (int64_t t = 0; t < tokens; ++t) sum += row[t];
      L[b * H + S + e] = sum / static_cast<float>(tokens);  // as torch.mean: the sum divided by the count
    }
  }
  return out;
}

// MoH inference's routing in one op: the linear routers' logits (x [T, C] float32, unit column stride, times the
// weights [R_i, C] stacked in moh_gates' row order: shared, routed, mix), computed per block of tokens and
// never stored, then moh_gates' pass over the block -> (gates [T, S + E], keep [E, T], and with `tokens` > 0 the
// head load moh_head_load gives, else an empty tensor). No load-balancing loss and no backward: the router's
// training takes moh_gates. Equal bit for bit to moh_router_logits followed by moh_gates (the same loops per
// token); one op instead of two and a head load (the study ViT's router took 0.75 ms a layer as three ops with
// their Python, 17th session).
std::tuple<at::Tensor, at::Tensor, at::Tensor> moh_router_gates(const at::Tensor& x_in, at::TensorList weights,
                                                                int64_t S, int64_t E, int64_t k, bool two_stage,
                                                                bool shared_routed, double eps_in, int64_t tokens) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "moh_router_gates: x must be [T, C] float32");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t T = x.size(0), C = x.size(1), H = S + E;
  int64_t R = 0;
  for (const auto& w : weights) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == C && w.scalar_type() == at::kFloat,
                "moh_router_gates: every weight must be [R_i, ", C, "] float32");
    R += w.size(0);
  }
  TORCH_CHECK(((E >= 1 && 1 <= k && k <= E) || (E == 0 && k == 0 && !two_stage)) && S >= 0 &&
                  R == (shared_routed ? S : 0) + E + (two_stage ? 2 : 0) && R > 0,
              "moh_router_gates: the weights' rows do not match the budget");
  TORCH_CHECK(tokens >= 0 && (tokens == 0 || T % tokens == 0), "moh_router_gates: ", T,
              " tokens are not whole images of ", tokens);
  auto gates = at::empty({T, H}, x.options());
  auto keep = at::empty({E, T}, x.options());
  if (T > 0) {
    const std::vector<float> wt = visattn::pack_router_weights(weights, C);
    const RouterInput input{x.data_ptr<float>(), x.stride(0), C, wt.data()};
    const at::Tensor no_logits;
    const GatesArgs args{no_logits, &input, S, E, k, two_stage, shared_routed, false, static_cast<float>(eps_in),
                         shared_routed ? S : 0, R, H, T, gates.data_ptr<float>(), keep.data_ptr<float>(), nullptr};
    at::parallel_for(0, (T + BLOCK - 1) / BLOCK, 1, [&](int64_t b0, int64_t b1) { gates_blocks(args, b0, b1); });
  }
  auto load = tokens > 0 ? moh_head_load(keep, tokens, S) : at::empty({0}, x.options());
  return {gates, keep, load};
}

namespace {

// A float's place in head choice's order as an int: larger first, NaN above everything, -0 equal to +0.
inline int32_t order_key(float v) {
  if (v != v) return INT32_MAX;
  v += 0.0f;  // -0 -> +0
  int32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits >= 0 ? bits : bits ^ INT32_MAX;  // negative floats: larger magnitude, smaller key
}

// keys[0, N) -> chosen[i] = whether fewer than `capacity` entries come before i (a larger key, or an equal one
// at a lower index). Every pair is compared, without branches: at N = 17 this ran three times faster than
// nth_element, whose comparisons mispredict (81 against 264 us for 1024 rows).
VISATTN_SIMD_CLONES void rank_select(const int32_t* keys, int64_t N, int64_t capacity, bool* chosen) {
  for (int64_t i = 0; i < N; ++i) {
    const int32_t key = keys[i];
    int32_t before = 0;
    for (int64_t j = 0; j < N; ++j) before += (keys[j] > key) | ((keys[j] == key) & (j < i));
    chosen[i] = before < capacity;
  }
}

constexpr int64_t kPairwiseMax = 64;  // above, the N^2 comparisons cost more than nth_element's N log N

// The `capacity` highest of row[0, N) in head choice's order -> chosen[0, N); keys and order: scratch of N.
void select_row(const float* row, int64_t N, int64_t capacity, int32_t* keys, int64_t* order, bool* chosen) {
  for (int64_t i = 0; i < N; ++i) keys[i] = order_key(row[i]);
  if (N <= kPairwiseMax) {
    rank_select(keys, N, capacity, chosen);
    return;
  }
  for (int64_t i = 0; i < N; ++i) order[i] = i;
  std::nth_element(order, order + capacity, order + N, [keys](int64_t i, int64_t j) {
    return keys[i] > keys[j] || (keys[i] == keys[j] && i < j);
  });
  std::fill(chosen, chosen + N, false);
  for (int64_t i = 0; i < capacity; ++i) chosen[order[i]] = true;
}

struct HeadChoiceArgs {
  const at::Tensor& logits;
  int64_t S, E, R, H, T, routed0;
  bool two_stage, shared_routed;
  float* G;
  float* P;
  float* W;
};

// moh_head_choice_gates' first pass on blocks [b0, b1) of tokens: the shared heads' gates into G, the pool's
// probabilities into P [E, T], and each token's routed weight (E, times its two-stage weight) into W [T].
VISATTN_SIMD_CLONES void head_choice_blocks(const HeadChoiceArgs& a, int64_t b0, int64_t b1) {
  const int64_t S = a.S, E = a.E, R = a.R, H = a.H, T = a.T;
  BlockScratch w(H, R);
  const float *a1 = w.a1, *g = w.g;
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t t0 = blk * BLOCK, n = std::min(BLOCK, T - t0);
    load_rows(a.logits, t0, n, w.lb);
    block_softmaxes(w, n, S, E, R, a.routed0, a.two_stage, a.shared_routed);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < S; ++h) a.G[(t0 + t) * H + h] = g[h * BLOCK + t];
    for (int64_t e = 0; e < E; ++e) std::copy(g + (S + e) * BLOCK, g + (S + e) * BLOCK + n, a.P + e * T + t0);
    for (int64_t t = 0; t < n; ++t) a.W[t0 + t] = a.two_stage ? a1[t] * static_cast<float>(E) : static_cast<float>(E);
  }
}

}  // namespace

// Head choice's selection (visattn.attention.routing.head_choice_selection): in each row of scores
// [R, N] (a routed head's probabilities over one image's tokens) the `capacity` highest, ties to the lower
// index and NaN above any number, as a stable descending sort orders them -> bool [R, N]. ATen's topk
// and sort cost about 230 ns a row of 17 at the study's sizes, mostly mispredicted branches.
at::Tensor moh_head_choice(const at::Tensor& scores_in, int64_t capacity) {
  TORCH_CHECK(scores_in.dim() == 2 && scores_in.scalar_type() == at::kFloat,
              "moh_head_choice: scores must be [R, N] float32");
  auto scores = scores_in.contiguous();
  const int64_t R = scores.size(0), N = scores.size(1);
  TORCH_CHECK(0 <= capacity && capacity <= N, "moh_head_choice: capacity ", capacity, " outside [0, ", N, "]");
  auto out = at::empty({R, N}, scores.options().dtype(at::kBool));
  const float* P = scores.data_ptr<float>();
  bool* O = out.data_ptr<bool>();
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    std::vector<int32_t> keys(N);
    std::vector<int64_t> order(N);
    for (int64_t r = r0; r < r1; ++r) select_row(P + r * N, N, capacity, keys.data(), order.data(), O + r * N);
  });
  return out;
}

// Head choice's gates without gradients (visattn.attention.routing.HeadRouter, routing="head_choice",
// soft gates): logits [R, T] as moh_gates takes them, `tokens` per image -> (gates [T, S + E] float32
// token-major, keep [E, T] float32: 1 where routed head e took the token). Shared heads as in moh_gates;
// each routed head takes the `capacity` tokens of each image with the highest probability (moh_head_choice's
// order), gated by that probability times E (times the token's two-stage weight). Without gradients the
// PyTorch code's ten or so operations made head choice's routing 0.22-0.23 ms a layer slower than token
// choice's at the study ViT's size.
std::tuple<at::Tensor, at::Tensor> moh_head_choice_gates(const at::Tensor& logits, int64_t S, int64_t E,
                                                         int64_t capacity, int64_t tokens, bool two_stage,
                                                         bool shared_routed) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "moh_head_choice_gates: logits must be [R, T] float32");
  const int64_t R = logits.size(0), T = logits.size(1), H = S + E;
  TORCH_CHECK(E >= 1 && S >= 0 && R == (shared_routed ? S : 0) + E + (two_stage ? 2 : 0),
              "moh_head_choice_gates: logits rows do not match the budget");
  TORCH_CHECK(tokens > 0 && T % tokens == 0 && 0 <= capacity && capacity <= tokens,
              "moh_head_choice_gates: ", T, " tokens are not whole images of ", tokens, " (capacity ", capacity, ")");
  auto gates = at::empty({T, H}, logits.options());
  auto keep = at::empty({E, T}, logits.options());
  auto probs = at::empty({E, T}, logits.options());
  auto weight = at::empty({T}, logits.options());
  float* G = gates.data_ptr<float>();
  float* K = keep.data_ptr<float>();
  const float* P = probs.data_ptr<float>();
  const float* W = weight.data_ptr<float>();
  const HeadChoiceArgs args{logits, S, E, R, H, T, shared_routed ? S : 0, two_stage, shared_routed,
                            G, probs.data_ptr<float>(), weight.data_ptr<float>()};
  at::parallel_for(0, (T + BLOCK - 1) / BLOCK, 1, [&](int64_t b0, int64_t b1) { head_choice_blocks(args, b0, b1); });
  const int64_t images = T / tokens;
  at::parallel_for(0, E * images, 16, [&](int64_t r0, int64_t r1) {
    std::vector<int32_t> keys(tokens);
    std::vector<int64_t> order(tokens);
    std::unique_ptr<bool[]> chosen(new bool[tokens]);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t e = r / images, first = (r % images) * tokens;
      const float* p = P + e * T + first;
      bool* c = chosen.get();
      select_row(p, tokens, capacity, keys.data(), order.data(), c);
      for (int64_t i = 0; i < tokens; ++i) {
        const float m = c[i] ? 1.0f : 0.0f;
        K[e * T + first + i] = m;
        G[(first + i) * H + S + e] = p[i] * m * W[first + i];  // as PyTorch: probs * mask * (alpha * E)
      }
    }
  });
  return {gates, keep};
}

namespace {

// One token's merged heads: out[c] = x[c] * g[c / d] over c < H * d (gexp: scratch of H * d floats).
VISATTN_SIMD_CLONES void gate_row(const float* x, const float* g, int64_t H, int64_t d, float* gexp, float* out) {
  for (int64_t h = 0; h < H; ++h) std::fill(gexp + h * d, gexp + (h + 1) * d, g[h]);
  const int64_t C = H * d;
  for (int64_t c = 0; c < C; ++c) out[c] = x[c] * gexp[c];
}

// gate_row's gradients for one token: dx[c] = dout[c] * g[c / d], dg[h] = sum_j dout[h d + j] x[h d + j]
// (scratch: 2 H d floats).
VISATTN_SIMD_CLONES void gate_row_backward(const float* dout, const float* x, const float* g, int64_t H, int64_t d,
                                           float* scratch, float* dx, float* dg) {
  float* gexp = scratch;
  float* prod = scratch + H * d;
  for (int64_t h = 0; h < H; ++h) std::fill(gexp + h * d, gexp + (h + 1) * d, g[h]);
  const int64_t C = H * d;
  for (int64_t c = 0; c < C; ++c) {
    dx[c] = dout[c] * gexp[c];
    prod[c] = dout[c] * x[c];
  }
  for (int64_t h = 0; h < H; ++h) {
    float acc = 0.0f;
    for (int64_t j = 0; j < d; ++j) acc += prod[h * d + j];
    dg[h] = acc;
  }
}

void check_merge_args(const at::Tensor& heads, const at::Tensor& gates) {
  TORCH_CHECK(heads.dim() == 4 && heads.scalar_type() == at::kFloat, "moh_gated_merge: heads must be [B, H, N, d] float32");
  const int64_t B = heads.size(0), H = heads.size(1), N = heads.size(2);
  TORCH_CHECK(heads.transpose(1, 2).is_contiguous(),
              "moh_gated_merge: heads must be laid out as [B, N, H, d] (attention's output, transposed)");
  TORCH_CHECK(gates.scalar_type() == at::kFloat && gates.dim() == 3 && gates.size(0) == B && gates.size(1) == N &&
                  gates.size(2) == H,
              "moh_gated_merge: gates must be [B, N, H] float32");
}

}  // namespace

// heads: [B, H, N, d] float32 laid out as [B, N, H, d] (SDPA's output) weighted by gates [B, N, H] float32
// -> [B, N, H * d], the merged heads that go into the output projection (HeadAttention.merge_heads).
at::Tensor moh_gated_merge(const at::Tensor& heads, const at::Tensor& gates_in) {
  check_merge_args(heads, gates_in);
  auto gates = gates_in.contiguous();
  const int64_t B = heads.size(0), H = heads.size(1), N = heads.size(2), d = heads.size(3), C = H * d;
  auto out = at::empty({B, N, C}, heads.options());
  const float* X = heads.data_ptr<float>();
  const float* G = gates.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, B * N, 64, [&](int64_t r0, int64_t r1) {
    std::vector<float> gexp(C);
    for (int64_t r = r0; r < r1; ++r) gate_row(X + r * C, G + r * H, H, d, gexp.data(), O + r * C);
  });
  return out;
}

// moh_gated_merge's backward: grad_out [B, N, H * d] -> (grad_heads [B, H, N, d] laid out as [B, N, H, d],
// as attention's backward takes it, grad_gates [B, N, H]).
std::tuple<at::Tensor, at::Tensor> moh_gated_merge_backward(const at::Tensor& grad_in, const at::Tensor& heads,
                                                            const at::Tensor& gates_in) {
  check_merge_args(heads, gates_in);
  auto grad = grad_in.contiguous();
  auto gates = gates_in.contiguous();
  const int64_t B = heads.size(0), H = heads.size(1), N = heads.size(2), d = heads.size(3), C = H * d;
  TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.numel() == B * N * C, "moh_gated_merge_backward: grad_out must be [B, N, H * d] float32");
  auto grad_heads = at::empty({B, N, H, d}, heads.options());
  auto grad_gates = at::empty({B, N, H}, gates.options());
  const float* dO = grad.data_ptr<float>();
  const float* X = heads.data_ptr<float>();
  const float* G = gates.data_ptr<float>();
  float* dX = grad_heads.data_ptr<float>();
  float* dG = grad_gates.data_ptr<float>();
  at::parallel_for(0, B * N, 64, [&](int64_t r0, int64_t r1) {
    std::vector<float> scratch(2 * C);
    for (int64_t r = r0; r < r1; ++r)
      gate_row_backward(dO + r * C, X + r * C, G + r * H, H, d, scratch.data(), dX + r * C, dG + r * H);
  });
  return {grad_heads.permute({0, 2, 1, 3}), grad_gates};
}

namespace {

constexpr int64_t PROJ_ROWS = 256;  // tokens per block: a block's merged heads stay in L2 for its GEMMs

// The bias as the GEMM's C (beta 1), as addmm does: cheaper than scaling C by beta 0 and a pass adding the bias
// after (MKL's sgemm_mscale and that pass were 10% of moh_gated_proj at the study's sizes, 17th session).
VISATTN_SIMD_CLONES void fill_rows(float* out, const float* bias, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = bias[c];
}

VISATTN_SIMD_CLONES void add_column_sums(const float* rows_in, int64_t rows, int64_t cols, float* sums) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) sums[c] += rows_in[r * cols + c];
}

void check_proj_args(const at::Tensor& heads, const at::Tensor& gates, const at::Tensor& weight) {
  check_merge_args(heads, gates);
  TORCH_CHECK(visattn::sgemm_fn() != nullptr, "moh_gated_proj: this torch build exports no SGEMM");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.size(1) == heads.size(1) * heads.size(3),
              "moh_gated_proj: weight must be [dim_out, H * d] float32, contiguous");
}

}  // namespace

// The gated head merge and the output projection in one pass over blocks of tokens:
// out [B, N, Co] = merge(heads [B, H, N, d] laid out as [B, N, H, d], gates [B, N, H]) @ weight^T + bias.
// The merged heads of a block are written to a per-thread buffer and read back by the block's GEMM while
// in cache, instead of making a round trip through memory (HeadAttention.merge_heads with gradients).
at::Tensor moh_gated_proj(const at::Tensor& heads, const at::Tensor& gates_in, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias) {
  check_proj_args(heads, gates_in, weight);
  auto gates = gates_in.contiguous();
  const int64_t B = heads.size(0), H = heads.size(1), N = heads.size(2), d = heads.size(3), C = H * d;
  const int64_t T = B * N, Co = weight.size(0);
  auto out = at::empty({B, N, Co}, heads.options());
  const float* X = heads.data_ptr<float>();
  const float* G = gates.data_ptr<float>();
  const float* W = weight.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* O = out.data_ptr<float>();
  at::parallel_for(0, (T + PROJ_ROWS - 1) / PROJ_ROWS, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> merged(PROJ_ROWS * C), gexp(C);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t r0 = blk * PROJ_ROWS, n = std::min(PROJ_ROWS, T - r0);
      for (int64_t r = 0; r < n; ++r) gate_row(X + (r0 + r) * C, G + (r0 + r) * H, H, d, gexp.data(), merged.data() + r * C);
      if (b != nullptr) fill_rows(O + r0 * Co, b, n, Co);
      visattn::sgemm(false, true, n, Co, C, 1.0f, merged.data(), C, W, C, b != nullptr ? 1.0f : 0.0f, O + r0 * Co, Co);
    }
  });
  return out;
}

// moh_gated_proj's backward: grad_out [B, N, Co] -> (grad_heads [B, H, N, d] laid out as [B, N, H, d],
// grad_gates [B, N, H], grad_weight [Co, H * d], grad_bias [Co] (empty without `with_bias`)). Per block:
// d merged = grad_out @ weight, then the merge's gradients, and grad_weight += grad_out^T @ merged with the
// block's merged heads recomputed. Per-thread weight gradients are summed in thread order.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moh_gated_proj_backward(
    const at::Tensor& grad_in, const at::Tensor& heads, const at::Tensor& gates_in, const at::Tensor& weight,
    bool with_bias) {
  check_proj_args(heads, gates_in, weight);
  auto grad = grad_in.contiguous();
  auto gates = gates_in.contiguous();
  const int64_t B = heads.size(0), H = heads.size(1), N = heads.size(2), d = heads.size(3), C = H * d;
  const int64_t T = B * N, Co = weight.size(0);
  TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.numel() == T * Co, "moh_gated_proj_backward: grad_out must be [B, N, dim_out] float32");
  auto grad_heads = at::empty({B, N, H, d}, heads.options());
  auto grad_gates = at::empty({B, N, H}, gates.options());
  const int64_t threads = at::get_num_threads();
  auto grad_w = at::zeros({threads, Co, C}, weight.options());
  auto grad_b = at::zeros({threads, with_bias ? Co : 0}, weight.options());
  const float* dY = grad.data_ptr<float>();
  const float* X = heads.data_ptr<float>();
  const float* G = gates.data_ptr<float>();
  const float* W = weight.data_ptr<float>();
  float* dX = grad_heads.data_ptr<float>();
  float* dG = grad_gates.data_ptr<float>();
  at::parallel_for(0, (T + PROJ_ROWS - 1) / PROJ_ROWS, 1, [&](int64_t b0, int64_t b1) {
    const int64_t tid = at::get_thread_num();
    float* dW = grad_w.data_ptr<float>() + tid * Co * C;
    float* db = with_bias ? grad_b.data_ptr<float>() + tid * Co : nullptr;
    std::vector<float> dmerged(PROJ_ROWS * C), merged(PROJ_ROWS * C), scratch(2 * C);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t r0 = blk * PROJ_ROWS, n = std::min(PROJ_ROWS, T - r0);
      const float* dYb = dY + r0 * Co;
      visattn::sgemm(false, false, n, C, Co, 1.0f, dYb, Co, W, C, 0.0f, dmerged.data(), C);
      for (int64_t r = 0; r < n; ++r) {
        const int64_t t = r0 + r;
        gate_row_backward(dmerged.data() + r * C, X + t * C, G + t * H, H, d, scratch.data(), dX + t * C, dG + t * H);
        gate_row(X + t * C, G + t * H, H, d, scratch.data(), merged.data() + r * C);
      }
      visattn::sgemm(true, false, Co, C, n, 1.0f, dYb, Co, merged.data(), C, 1.0f, dW, C);
      if (db != nullptr) add_column_sums(dYb, n, Co, db);
    }
  });
  return {grad_heads.permute({0, 2, 1, 3}), grad_gates, grad_w.sum(0), grad_b.sum(0)};
}

TORCH_LIBRARY(visattn, m) {
  m.def("moh_gates(Tensor logits, int S, int E, int k, bool two_stage, bool shared_routed, float eps, bool with_aux) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("moh_gates_backward(Tensor logits, Tensor keep, Tensor grad_gates, Tensor aux_grad, int S, int E, int k, bool two_stage, bool shared_routed, float eps) -> Tensor");
  m.def("moh_head_choice(Tensor scores, int capacity) -> Tensor");
  m.def("moh_head_choice_gates(Tensor logits, int S, int E, int capacity, int tokens, bool two_stage, bool shared_routed) -> (Tensor, Tensor)");
  m.def("moh_head_load(Tensor keep, int tokens, int S) -> Tensor");
  m.def("moh_router_gates(Tensor x, Tensor[] weights, int S, int E, int k, bool two_stage, bool shared_routed, float eps, int tokens) -> (Tensor, Tensor, Tensor)");
  m.def("moh_gated_merge(Tensor heads, Tensor gates) -> Tensor");
  m.def("moh_gated_merge_backward(Tensor grad_out, Tensor heads, Tensor gates) -> (Tensor, Tensor)");
  m.def("moh_gated_proj(Tensor heads, Tensor gates, Tensor weight, Tensor? bias) -> Tensor");
  m.def("moh_gated_proj_backward(Tensor grad_out, Tensor heads, Tensor gates, Tensor weight, bool with_bias) -> (Tensor, Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(visattn, CPU, m) {
  m.impl("moh_gates", &moh_gates);
  m.impl("moh_gates_backward", &moh_gates_backward);
  m.impl("moh_head_choice", &moh_head_choice);
  m.impl("moh_head_choice_gates", &moh_head_choice_gates);
  m.impl("moh_head_load", &moh_head_load);
  m.impl("moh_router_gates", &moh_router_gates);
  m.impl("moh_gated_merge", &moh_gated_merge);
  m.impl("moh_gated_merge_backward", &moh_gated_merge_backward);
  m.impl("moh_gated_proj", &moh_gated_proj);
  m.impl("moh_gated_proj_backward", &moh_gated_proj_backward);
}
