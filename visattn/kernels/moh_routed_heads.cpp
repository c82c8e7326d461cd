// The heads of token-choice MoH inference, one image at a time (visattn.attention.routed_kernel): for
// every head from `first_head` on, the image's tokens that chose it (all of them for a shared head) are
// gathered, their queries projected (one GEMM), attended against the image's keys and values, gated,
// projected through the head's slice of W_O (one GEMM) and added to their output rows. Nothing is
// computed for unselected (token, head) pairs and no index tensor, padding or per-head operator call is
// made: at ViT-S / DiT-B sizes those cost more than the skipped work (docs/benchmarks.md).
//
// The GEMMs are MKL's (SGEMM, cblas_gemm_bf16bf16f32), which x86 builds of libtorch_cpu export. They
// are looked up at run time, so the library loads on any build; moh_routed_blas(dtype) says whether
// the dtype's GEMM was found, and the Python side keeps the PyTorch paths where it was not. In float32,
// with `fused` on a CPU with AVX-512 or AVX2 and FMA, the attention between the two GEMMs runs in
// fused_attention.h's loops instead of two more (and so does moh_routed_attention's); with AVX-512 the two
// GEMMs run in row_gemm.h's. With `small_gemm` (float32, the loops path),
// the attention's GEMMs are loops here instead (at the study's
// sizes, 12-wide heads and 17-49 tokens, a BLAS call costs more than its few thousand multiply-adds) and
// the query and output projections are ATen matmuls over every (token, head) pair (heads_loops).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <dlfcn.h>

#include "amx_attention.h"
#include "amx_projection.h"
#include "blas.h"
#include "fused_attention.h"
#include "router_logits.h"
#include "row_gemm.h"
#include "simd.h"
#include "softmax.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using visattn::sgemm_fn;
using bf16gemm_t = void (*)(int, int, int, int, int, int, float, const uint16_t*, int, const uint16_t*, int, float,
                            float*, int);

bf16gemm_t bf16gemm_fn() {
  static const bf16gemm_t fn = reinterpret_cast<bf16gemm_t>(dlsym(RTLD_DEFAULT, "cblas_gemm_bf16bf16f32"));
  return fn;
}

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

// Row-major c[m, n] (float32, row stride ldc) = alpha * a[m, kk] @ (b_t ? b^T (b: [n, kk]) : b (b: [kk, n])).
void gemm(bool b_t, int m, int n, int kk, float alpha, const float* a, int lda, const float* b, int ldb, float* c,
          int ldc) {
  visattn::sgemm(false, b_t, m, n, kk, alpha, a, lda, b, ldb, 0.f, c, ldc);
}
void gemm(bool b_t, int m, int n, int kk, float alpha, const c10::BFloat16* a, int lda, const c10::BFloat16* b,
          int ldb, float* c, int ldc) {
  bf16gemm_fn()(kRowMajor, kNoTrans, b_t ? kTrans : kNoTrans, m, n, kk, alpha, reinterpret_cast<const uint16_t*>(a),
                lda, reinterpret_cast<const uint16_t*>(b), ldb, 0.f, c, ldc);
}

using visattn::exp_row;
using visattn::kLanes;
using visattn::lanes_t;
using visattn::softmax_row;

// Columns of b are padded to a multiple of kLanes (one AVX-512 register): small_gemm reads whole blocks.
inline int64_t padded(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// RB rows of c, NB column blocks of a vector type F of W floats: the accumulators are RB * NB registers and
// the rows' multiply-adds are independent, so neither latency nor loads and stores of c bound the loop. Row
// r of a is a[r], of c is c[r]; with `add`, c[r] += the product instead of being set to it.
template <typename F, int W, int RB, int NB>
VISATTN_INLINE void small_block(int64_t k, float alpha, const float* const* a, const float* b, int64_t ldb,
                                float* const* c, int64_t ncols, bool add) {
  F acc[RB][NB];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = F{};
  for (int64_t kk = 0; kk < k; ++kk) {
    F bv[NB];
    for (int j = 0; j < NB; ++j) std::memcpy(&bv[j], b + kk * ldb + j * W, sizeof(F));
    for (int r = 0; r < RB; ++r) {
      const float av = a[r][kk];
      for (int j = 0; j < NB; ++j) acc[r][j] += av * bv[j];
    }
  }
  float out[NB * W];
  for (int r = 0; r < RB; ++r) {
    for (int j = 0; j < NB; ++j) std::memcpy(out + j * W, &acc[r][j], sizeof(F));
    if (add)
      for (int64_t j = 0; j < ncols; ++j) c[r][j] += alpha * out[j];
    else
      for (int64_t j = 0; j < ncols; ++j) c[r][j] = alpha * out[j];
  }
}

template <typename F, int W, int RB, int NB_MAX>
VISATTN_INLINE void small_rows(int64_t nb, int64_t k, float alpha, const float* const* a, const float* b,
                               int64_t ldb, float* const* c, int64_t ncols, bool add) {
  if constexpr (NB_MAX > 1) {
    if (nb < NB_MAX) return small_rows<F, W, RB, NB_MAX - 1>(nb, k, alpha, a, b, ldb, c, ncols, add);
  }
  small_block<F, W, RB, NB_MAX>(k, alpha, a, b, ldb, c, ncols, add);
}

// small_gemm's loops over blocks of 4 rows and NB_MAX * W columns.
template <typename F, int W, int NB_MAX>
VISATTN_INLINE void small_gemm_blocks(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                                      const int64_t* a_rows, const float* b, int64_t ldb, float* c, int64_t ldc,
                                      const int64_t* c_rows, bool add) {
  const float* ar[4];
  float* cr[4];
  for (int64_t j0 = 0; j0 < n; j0 += NB_MAX * W) {
    const int64_t ncols = std::min<int64_t>(NB_MAX * W, n - j0), nb = (ncols + W - 1) / W;
    for (int64_t i = 0; i < m; i += 4) {
      const int rb = static_cast<int>(std::min<int64_t>(4, m - i));
      for (int r = 0; r < rb; ++r) {
        ar[r] = a + (a_rows ? a_rows[i + r] : i + r) * lda;
        cr[r] = c + (c_rows ? c_rows[i + r] : i + r) * ldc + j0;
      }
      if (rb == 4) small_rows<F, W, 4, NB_MAX>(nb, k, alpha, ar, b + j0, ldb, cr, ncols, add);
      else
        for (int r = 0; r < rb; ++r) small_rows<F, W, 1, NB_MAX>(nb, k, alpha, ar + r, b + j0, ldb, cr + r, ncols, add);
    }
  }
}

// On AVX-512 CPUs: 4 x 4 sixteen-float accumulators, half the registers.
VISATTN_SIMD_CLONES void small_gemm_sixteens(int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                                             int64_t lda, const int64_t* a_rows, const float* b, int64_t ldb,
                                             float* c, int64_t ldc, const int64_t* c_rows, bool add) {
  small_gemm_blocks<lanes_t, kLanes, 4>(m, n, k, alpha, a, lda, a_rows, b, ldb, c, ldc, c_rows, add);
}

// Elsewhere 4 x 3 eight-float accumulators: the sixteen-float blocks would take 32 of AVX2's 16 registers.
VISATTN_SIMD_CLONES void small_gemm_eights(int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                                           int64_t lda, const int64_t* a_rows, const float* b, int64_t ldb,
                                           float* c, int64_t ldc, const int64_t* c_rows, bool add) {
  small_gemm_blocks<visattn::lanes8_t, 8, 3>(m, n, k, alpha, a, lda, a_rows, b, ldb, c, ldc, c_rows, add);
}

// c[m, n] = alpha * a[m, k] @ b[k, n] (ldb), float32, for operands too small for a BLAS call to pay.
// Row i of a is a + a_rows[i] * lda (a + i * lda without a_rows), row i of c likewise, so gathering the
// chosen tokens' rows and adding into them need no copies; with `add` the product is added to c. b
// must be readable for padded(n) columns per row (the callers pad their copies); the padding only feeds
// accumulator lanes that are never written. Sums in k order: no reassociation, so no -ffast-math.
void small_gemm(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const int64_t* a_rows,
                const float* b, int64_t ldb, float* c, int64_t ldc, const int64_t* c_rows, bool add) {
  if (visattn::avx512_runs()) small_gemm_sixteens(m, n, k, alpha, a, lda, a_rows, b, ldb, c, ldc, c_rows, add);
  else small_gemm_eights(m, n, k, alpha, a, lda, a_rows, b, ldb, c, ldc, c_rows, add);
}

// [rows, cols] (row stride ld) -> [cols, padded(rows)] in `out` (transposed, rows padded with zeros).
template <typename T>
void transpose_padded(const T* src, int64_t rows, int64_t cols, int64_t ld, std::vector<T>& out) {
  const int64_t ldo = padded(rows);
  out.assign(cols * ldo, T(0));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) out[j * ldo + i] = src[i * ld + j];
}

// [rows, cols] (row stride ld) -> [rows, padded(cols)] in `out` (columns padded with zeros).
template <typename T>
void copy_padded(const T* src, int64_t rows, int64_t cols, int64_t ld, std::vector<T>& out) {
  const int64_t ldo = padded(cols);
  out.assign(rows * ldo, T(0));
  for (int64_t i = 0; i < rows; ++i) std::memcpy(&out[i * ldo], src + i * ld, cols * sizeof(T));
}

// dst[rows[i] * n ..][0..n) += src[i * n ..][0..n) for i < m: each gathered row's projection added to its token.
VISATTN_SIMD_CLONES void add_rows(float* dst, const float* src, const int64_t* rows, int64_t m, int64_t n) {
  for (int64_t i = 0; i < m; ++i) {
    float* out = dst + rows[i] * n;
    const float* in = src + i * n;
    for (int64_t c = 0; c < n; ++c) out[c] += in[c];
  }
}

// The float32 rows to sum into: the output itself for float32, else `acc` holding the output's values.
template <typename T>
float* out_rows_as_float(T* out, std::vector<float>& acc, int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    return out;
  } else {
    acc.resize(count);
    for (int64_t i = 0; i < count; ++i) acc[i] = static_cast<float>(out[i]);
    return acc.data();
  }
}

// Rounds as the masked dense path does: q, the attention output and the gated output are each
// stored in T there (the linear's, SDPA's and the multiply's outputs).
template <typename T>
inline float round_to(float value) {
  return static_cast<float>(static_cast<T>(value));
}

// The image's tokens that chose head h (all N for a shared head, h < S), ascending.
inline void chosen_rows(const bool* mask, int64_t h, int64_t S, int64_t b, int64_t N, int64_t T_total,
                        std::vector<int64_t>& rows) {
  rows.clear();
  const bool* chosen = h >= S ? mask + (h - S) * T_total + b * N : nullptr;
  for (int64_t n = 0; n < N; ++n)
    if (!chosen || chosen[n]) rows.push_back(n);
}

// The op's arguments as sizes and pointers (see moh_routed_heads for their layouts).
template <typename T>
struct Heads {
  int64_t B, Hkv, N, d, C, Co, H, group, S, first_head;
  const T *x, *wq, *bq, *wo, *k, *v;  // bq: nullptr without a bias
  const float* bv;  // the values' bias when v comes without it ([Hkv * d], float32 only), else nullptr
  const float* bo;  // the output's bias when out comes without it ([Co], float32 only), else nullptr
  int64_t ldwo, k_stride[3], v_stride[3];  // proj_w's row stride; k's and v's strides over (image, head, token)
  const bool* mask;
  const float* gates;
  T* out;
  // float32 with `fused` (heads_blas: fused_head): the routed heads' W_q rows packed [heads, C, d] and their
  // W_O columns packed [heads, d, Co], heads from first_head on
  bool fused = false;
  const float *wq_t = nullptr, *wo_t = nullptr;
  // float32 where fused_attention.h runs but row_gemm.h does not: heads_blas's attention in its loops, the
  // projections MKL's
  bool attend_fused = false;

  Heads(const at::Tensor& x_, const at::Tensor& qkv_w, const c10::optional<at::Tensor>& qkv_b, const at::Tensor& proj_w,
        const at::Tensor& k_, const at::Tensor& v_, const c10::optional<at::Tensor>& v_bias,
        const at::Tensor& routed_mask, const at::Tensor& gates_, int64_t S_, int64_t first_head_, at::Tensor& out_,
        const c10::optional<at::Tensor>& out_bias)
      : B(k_.size(0)), Hkv(k_.size(1)), N(k_.size(2)), d(k_.size(3)), C(x_.size(1)), Co(out_.size(1)),
        H(gates_.size(1)), group(H / Hkv), S(S_), first_head(first_head_), x(x_.data_ptr<T>()),
        wq(qkv_w.data_ptr<T>()), bq(qkv_b.has_value() ? qkv_b->data_ptr<T>() : nullptr), wo(proj_w.data_ptr<T>()),
        k(k_.data_ptr<T>()), v(v_.data_ptr<T>()), bv(v_bias.has_value() ? v_bias->data_ptr<float>() : nullptr),
        bo(out_bias.has_value() ? out_bias->data_ptr<float>() : nullptr),
        ldwo(proj_w.stride(0)),
        k_stride{k_.stride(0), k_.stride(1), k_.stride(2)}, v_stride{v_.stride(0), v_.stride(1), v_.stride(2)},
        mask(routed_mask.data_ptr<bool>()), gates(gates_.data_ptr<float>()), out(out_.data_ptr<T>()) {}

  // Image b's keys / values of key/value head kvh: [N, d], row stride k_stride[2] / v_stride[2].
  const T* keys(int64_t b, int64_t kvh) const { return k + b * k_stride[0] + kvh * k_stride[1]; }
  const T* values(int64_t b, int64_t kvh) const { return v + b * v_stride[0] + kvh * v_stride[1]; }
  float gate(int64_t b, int64_t n, int64_t h) const { return gates[(b * N + n) * H + h]; }
  // The bias to add to head h's attention output (the probabilities sum to 1, so P (V + b) = P V + b), or
  // nullptr where v has it.
  const float* value_bias(int64_t h) const { return bv ? bv + h / group * d : nullptr; }
};

// The rows of image b's next head after h (or of the next image's first head, up to b_end) that
// fused_attend prefetches: its queries (when q is not null), keys, values and output rows (when out is not
// null).
visattn::NextRows next_head_rows(int64_t b, int64_t b_end, int64_t h, int64_t first_head, int64_t H, int64_t N,
                                 int64_t d, int64_t group, const float* q, int64_t q_ld, const float* k0,
                                 const int64_t* ks, const float* v0, const int64_t* vs, float* out, int64_t out_ld) {
  visattn::NextRows next;
  const int64_t hn = h + 1 < H ? h + 1 : first_head, bn = h + 1 < H ? b : b + 1, kvn = hn / group;
  if (bn >= b_end) return next;
  if (q) next.add(q + bn * N * q_ld + hn * d, q_ld);
  next.add(k0 + bn * ks[0] + kvn * ks[1], ks[2]);
  next.add(v0 + bn * vs[0] + kvn * vs[1], vs[2]);
  if (out) next.add(out + bn * N * out_ld + hn * d, out_ld);
  next.rows = N;
  next.bytes = d * static_cast<int64_t>(sizeof(float));
  return next;
}

// A thread's buffers for fused_head.
struct FusedBuffers {
  std::vector<int32_t> rows32;
  std::vector<float> q, o_gated;
  visattn::AttendScratch attention;
};

// Head h of image b in AVX-512 loops (heads_blas with `fused`, float32): the chosen tokens' queries from
// x's rows in place (row_gemm with W_q[h] packed as [C, d]), their attention (fused_attend), and the gated
// outputs through W_O[:, h] (packed as [d, Co]) added into their rows of `sum`: no copies of rows and no
// second pass to add them. rows: the tokens (of image b) that chose h, at least one.
void fused_head(const Heads<float>& p, int64_t b, int64_t b_end, int64_t h, const std::vector<int64_t>& rows,
                float* sum, FusedBuffers& buf) {
  const int64_t N = p.N, d = p.d, C = p.C, Co = p.Co, m = static_cast<int64_t>(rows.size()), kvh = h / p.group;
  const int64_t packed = h - p.first_head;
  buf.q.resize(m * d);
  visattn::row_gemm(m, d, C, p.x + b * N * C, C, rows.data(), p.wq_t + packed * C * d, d, buf.q.data(), d, nullptr,
                    false);
  if (p.bq)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t c = 0; c < d; ++c) buf.q[i * d + c] += p.bq[h * d + c];
  buf.rows32.assign(rows.begin(), rows.end());
  buf.o_gated.resize(m * d);
  const visattn::AttendRows a{m, N, d, buf.q.data(), d, nullptr, nullptr, p.keys(b, kvh), p.values(b, kvh),
                              p.k_stride[2], p.v_stride[2], p.value_bias(h), p.gates + b * N * p.H + h, p.H,
                              buf.rows32.data(), buf.o_gated.data(), d, nullptr};
  visattn::fused_attend(a, next_head_rows(b, b_end, h, p.first_head, p.H, N, d, p.group, nullptr, 0, p.k, p.k_stride,
                                          p.v, p.v_stride, nullptr, 0), buf.attention);
  visattn::row_gemm(m, Co, d, buf.o_gated.data(), d, nullptr, p.wo_t + packed * d * Co, Co, sum, Co, rows.data(), true);
}

// Head h's attention for image b's tokens `rows`, gated, into o_gated [m, d] in fused_attention.h's loops, where
// p.attend_fused (float32); false where it did nothing. q: the tokens' queries [m, d] with their bias.
template <typename T>
bool gated_attention_in_loops(const Heads<T>& p, int64_t b, int64_t h, const std::vector<int64_t>& rows, const T* q,
                              T* o_gated, FusedBuffers& buf) {
  if constexpr (std::is_same_v<T, float>) {
    if (!p.attend_fused) return false;
    const int64_t N = p.N, m = static_cast<int64_t>(rows.size()), kvh = h / p.group;
    buf.rows32.assign(rows.begin(), rows.end());
    const visattn::AttendRows a{m, N, p.d, q, p.d, nullptr, nullptr, p.keys(b, kvh), p.values(b, kvh), p.k_stride[2],
                                p.v_stride[2], p.value_bias(h), p.gates + b * N * p.H + h, p.H, buf.rows32.data(),
                                o_gated, p.d, nullptr};
    visattn::fused_attend(a, visattn::NextRows{}, buf.attention);
    return true;
  }
  return false;
}

// Through MKL's GEMMs, one image at a time (its output rows stay in cache while every head adds to
// them). Gathering several images per head for larger GEMMs measured no faster.
template <typename T>
void heads_blas(const Heads<T>& p) {
  const int64_t N = p.N, d = p.d, C = p.C, Co = p.Co;
  const int ldk = static_cast<int>(p.k_stride[2]), ldv = static_cast<int>(p.v_stride[2]);
  const float scale = 1.f / std::sqrt(static_cast<float>(d));

  at::parallel_for(0, p.B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int64_t> rows;
    std::vector<T> xg, q, probs, o_gated;
    std::vector<float> qf, s, o, r, acc, inv;
    FusedBuffers buffers;
    for (int64_t b = b0; b < b1; ++b) {
      T* out_rows = p.out + b * N * Co;
      // float32 adds straight into the output rows; bfloat16 sums in float32 and rounds once at the end
      float* sum = out_rows_as_float<T>(out_rows, acc, N * Co);
      if (p.bo)  // float32 only; the rows stay in cache for the heads that add to them
        for (int64_t n = 0; n < N; ++n)
          for (int64_t c = 0; c < Co; ++c) sum[n * Co + c] += p.bo[c];
      for (int64_t h = p.first_head; h < p.H; ++h) {
        chosen_rows(p.mask, h, p.S, b, N, p.B * N, rows);
        const int64_t m = static_cast<int64_t>(rows.size());
        if (m == 0) continue;
        if constexpr (std::is_same_v<T, float>) {
          if (p.fused) {
            fused_head(p, b, b1, h, rows, sum, buffers);
            continue;
          }
        }
        // queries of the chosen tokens: [m, C] @ W_q[h]^T -> [m, d]
        xg.resize(m * C);
        for (int64_t i = 0; i < m; ++i) std::memcpy(&xg[i * C], p.x + (b * N + rows[i]) * C, C * sizeof(T));
        qf.resize(m * d);
        gemm(true, m, d, C, 1.f, xg.data(), C, p.wq + h * d * C, C, qf.data(), d);
        q.resize(m * d);
        for (int64_t i = 0; i < m; ++i)
          for (int64_t c = 0; c < d; ++c)
            q[i * d + c] = static_cast<T>(qf[i * d + c] + (p.bq ? static_cast<float>(p.bq[h * d + c]) : 0.f));
        // attention against every key of the image (N is at most a few hundred: one block, one pass)
        const int64_t kvh = h / p.group;
        o_gated.resize(m * d);
        if (!gated_attention_in_loops(p, b, h, rows, q.data(), o_gated.data(), buffers)) {
          s.resize(m * N);
          gemm(true, m, N, d, scale, q.data(), d, p.keys(b, kvh), ldk, s.data(), N);
          o.resize(m * d);
          inv.assign(m, 1.f);
          if constexpr (std::is_same_v<T, float>) {
            // exp(s - max) @ V, each row then scaled by 1 / its sum with the gate
            for (int64_t i = 0; i < m; ++i) inv[i] = exp_row(&s[i * N], N);
            gemm(false, m, d, N, 1.f, s.data(), N, p.values(b, kvh), ldv, o.data(), d);
          } else {  // the probabilities rounded to T, as SDPA's bf16 output of the masked dense path is
            probs.resize(m * N);
            for (int64_t i = 0; i < m; ++i) softmax_row(&s[i * N], N);
            for (int64_t i = 0; i < m * N; ++i) probs[i] = static_cast<T>(s[i]);
            gemm(false, m, d, N, 1.f, probs.data(), N, p.values(b, kvh), ldv, o.data(), d);
          }
          // gate (cast to T first, as the dense path multiplies in T), then W_O[:, h] -> [m, Co], added
          const float* bv = p.value_bias(h);
          for (int64_t i = 0; i < m; ++i) {
            const float g = round_to<T>(p.gate(b, rows[i], h));
            if (bv)  // float32 only
              for (int64_t c = 0; c < d; ++c) o_gated[i * d + c] = static_cast<T>((o[i * d + c] * inv[i] + bv[c]) * g);
            else
              for (int64_t c = 0; c < d; ++c)
                o_gated[i * d + c] = static_cast<T>(round_to<T>(o[i * d + c]) * (g * inv[i]));
          }
        }
        r.resize(m * Co);
        gemm(true, m, Co, d, 1.f, o_gated.data(), d, p.wo + h * d, static_cast<int>(p.ldwo), r.data(), Co);
        add_rows(sum, r.data(), rows.data(), m, Co);
      }
      if constexpr (!std::is_same_v<T, float>)
        for (int64_t i = 0; i < N * Co; ++i) out_rows[i] = static_cast<T>(acc[i]);
    }
  });
}

// The attention alone, float32, for callers that project densely (the whole-tensor matmuls run faster than
// the per-head GEMMs of heads_blas where most routed pairs are on, 10th session): per image and head from
// `first_head` on, the chosen tokens' queries (their rows of q, plus q_bias) are gathered, attended against
// the image's keys and values, and gated into the tokens' rows of z [T, H*d] (row stride z_ld); the rows of
// tokens that did not choose the head are set to 0. z may be q itself: a pair's query is read before the
// pair's output is written, and by no other pair. q: [T, >= H*d] (row stride q_ld); k/v: [B, Hkv, N, d];
// q_bias [H*d] and v_bias [Hkv*d] may be nullptr (v_bias: v computed without it). With `fused`
// (fused_attention_runs) in vector registers (fused_attention.h), else through MKL's GEMMs.
void heads_attention(int64_t B, int64_t N, int64_t H, int64_t Hkv, int64_t d, int64_t S, int64_t first_head,
                     const float* q, int64_t q_ld, const float* q_bias, const at::Tensor& k, const at::Tensor& v,
                     const float* v_bias, const bool* mask, const float* gates, float* z, int64_t z_ld, bool fused) {
  const int64_t group = H / Hkv;
  const int64_t ks[3] = {k.stride(0), k.stride(1), k.stride(2)}, vs[3] = {v.stride(0), v.stride(1), v.stride(2)};
  const float *k0 = k.data_ptr<float>(), *v0 = v.data_ptr<float>();
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int64_t> rows;
    std::vector<int32_t> rows32;
    std::vector<float> qg, s, o, inv;
    visattn::AttendScratch scratch;
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t h = first_head; h < H; ++h) {
        chosen_rows(mask, h, S, b, N, B * N, rows);
        const int64_t m = static_cast<int64_t>(rows.size()), kvh = h / group;
        const float *kb = k0 + b * ks[0] + kvh * ks[1], *vb = v0 + b * vs[0] + kvh * vs[1];
        const float* bv = v_bias ? v_bias + kvh * d : nullptr;
        float* z_img = z + b * N * z_ld + h * d;
        if (fused) {
          rows32.assign(rows.begin(), rows.end());
          const visattn::AttendRows p{m, N, d, q + b * N * q_ld + h * d, q_ld, rows32.data(),
                                      q_bias ? q_bias + h * d : nullptr, kb, vb, ks[2], vs[2], bv,
                                      gates + b * N * H + h, H, rows32.data(), z_img, z_ld, rows32.data()};
          visattn::fused_attend(p, next_head_rows(b, b1, h, first_head, H, N, d, group, q, q_ld, k0, ks, v0, vs, z, z_ld),
                                scratch);
        } else if (m > 0) {
          qg.resize(m * d);
          for (int64_t i = 0; i < m; ++i) {
            const float* src = q + (b * N + rows[i]) * q_ld + h * d;
            for (int64_t c = 0; c < d; ++c) qg[i * d + c] = src[c] + (q_bias ? q_bias[h * d + c] : 0.f);
          }
          s.resize(m * N);
          gemm(true, m, N, d, scale, qg.data(), d, kb, static_cast<int>(ks[2]), s.data(), N);
          inv.resize(m);
          for (int64_t i = 0; i < m; ++i) inv[i] = exp_row(&s[i * N], N);
          o.resize(m * d);
          gemm(false, m, d, N, 1.f, s.data(), N, vb, static_cast<int>(vs[2]), o.data(), d);
          for (int64_t i = 0; i < m; ++i) {
            const float g = gates[(b * N + rows[i]) * H + h];
            float* zr = z_img + rows[i] * z_ld;
            for (int64_t c = 0; c < d; ++c) zr[c] = (o[i * d + c] * inv[i] + (bv ? bv[c] : 0.f)) * g;
          }
        }
        for (int64_t n = 0, i = 0; n < N; ++n) {  // the tokens that did not choose the head
          if (i < m && rows[i] == n) ++i;
          else std::memset(z_img + n * z_ld, 0, d * sizeof(float));
        }
      }
    }
  });
}

// The attention of heads_loops, float32, one image at a time, given every token's queries q [T, H*d]: for
// each head from `first_head` on and the tokens that chose it (every token for a shared head), the
// scores' exponentials and the output through small_gemm (K^T and V as padded copies once per image and
// key/value head), scaled by the gate over the softmax's sum, into the tokens' rows of z [T, H*d]
// (zero-initialised; other rows stay 0).
void heads_loops_attention(const Heads<float>& p, const float* q_all, float* z_all) {
  const int64_t N = p.N, d = p.d, H = p.H, Hd = H * d;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const int64_t dp = padded(d), Np = padded(N);
  at::parallel_for(0, p.B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int64_t> rows;
    std::vector<float> s, k_t, v_p, inv;
    for (int64_t b = b0; b < b1; ++b) {
      int64_t kv_loaded = -1;  // the key/value head k_t and v_p hold, for this image
      for (int64_t h = p.first_head; h < H; ++h) {
        chosen_rows(p.mask, h, p.S, b, N, p.B * N, rows);
        const int64_t m = static_cast<int64_t>(rows.size());
        if (m == 0) continue;
        const int64_t kvh = h / p.group;
        if (kv_loaded != kvh) {
          transpose_padded(p.keys(b, kvh), N, d, p.k_stride[2], k_t);  // K^T [d, Np]
          copy_padded(p.values(b, kvh), N, d, p.v_stride[2], v_p);     // V [N, dp]
          kv_loaded = kvh;
        }
        float* z_img = z_all + b * N * Hd + h * d;
        s.resize(m * N);
        small_gemm(m, N, d, scale, q_all + b * N * Hd + h * d, Hd, rows.data(), k_t.data(), Np, s.data(), N,
                   nullptr, false);
        inv.resize(m);
        for (int64_t i = 0; i < m; ++i) inv[i] = exp_row(&s[i * N], N);
        small_gemm(m, d, N, 1.f, s.data(), N, nullptr, v_p.data(), dp, z_img, Hd, rows.data(), false);
        const float* bv = p.value_bias(h);
        for (int64_t i = 0; i < m; ++i) {
          const float g = p.gate(b, rows[i], h);
          float* z = z_img + rows[i] * Hd;
          if (bv)
            for (int64_t c = 0; c < d; ++c) z[c] = (z[c] * inv[i] + bv[c]) * g;
          else
            for (int64_t c = 0; c < d; ++c) z[c] *= g * inv[i];
        }
      }
    }
  });
}

// The queries of heads first .. first + count for every token: x [T, C] @ W_q^T (+ b_q) -> [T, count * d].
at::Tensor head_queries(const at::Tensor& x, const at::Tensor& qkv_w, const c10::optional<at::Tensor>& qkv_b,
                        int64_t first, int64_t count, int64_t d) {
  const at::Tensor wq = qkv_w.narrow(0, first * d, count * d);
  return qkv_b.has_value() ? at::addmm(qkv_b->narrow(0, first * d, count * d), x, wq.t()) : at::mm(x, wq.t());
}

// The loops path (float32): the query and output projections as whole-tensor matmuls over every (token,
// head) pair from `first_head` on, zeros where a pair is off, and the attention of the chosen pairs in
// heads_loops_attention. At the study's sizes (12-wide heads, 17-49 tokens) a BLAS or SDPA call per image
// and head costs more than its work, and so did the projections per image and head in this kernel's own
// loops (17 rows each): ATen's matmuls over all rows ran the layer faster even where half the pairs are
// off (docs/benchmarks.md, 9th session). out [T, Co] holds the bias (and what heads before first_head
// add) on entry.
void heads_loops(const Heads<float>& p, const at::Tensor& x, const at::Tensor& qkv_w,
                 const c10::optional<at::Tensor>& qkv_b, const at::Tensor& proj_w, at::Tensor& out) {
  const int64_t H = p.H, d = p.d, first = p.first_head, Hr = H - first;
  const at::Tensor wo = proj_w.narrow(1, first * d, Hr * d);
  at::Tensor q = head_queries(x, qkv_w, qkv_b, first, Hr, d);
  at::Tensor q_all = q;  // [T, H*d]: the heads before first_head are never read
  if (first > 0) {
    q_all = at::zeros({x.size(0), H * d}, x.options());
    q_all.narrow(1, first * d, Hr * d).copy_(q);
  }
  at::Tensor z_all = at::zeros_like(q_all);
  heads_loops_attention(p, q_all.data_ptr<float>(), z_all.data_ptr<float>());
  out.addmm_(z_all.narrow(1, first * d, Hr * d), wo.t());
  if (p.bo) out.add_(at::from_blob(const_cast<float*>(p.bo), {p.Co}, out.options()));
}

// [rows, cols] (row stride ld) -> [cols, rows] contiguous in `out` (a small_gemm `a` operand).
template <typename T>
void transpose_into(const T* src, int64_t rows, int64_t cols, int64_t ld, std::vector<T>& out) {
  out.resize(rows * cols);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) out[j * rows + i] = src[i * ld + j];
}

// The gradients of heads_loops (every head, first_head = 0, no dropout), given every token's queries q
// [T, H*d] and its output gradient through each head's slice of W_O, gz = grad_out @ W_O [T, H*d] (both
// computed by the caller with whole-tensor matmuls). Per image and head, for the chosen tokens only: the
// attention is recomputed (as flash attention's backward does), then its gradients: dk and dv (added
// into), the gates' (dgates), and, into rows of [T, H*d] buffers that are zero elsewhere, the gated head
// output z = gate * o (for W_O's gradient) and the queries' gradient dq (for x's, W_q's and b_q's). Each
// image's rows are written by the thread that owns it.
void heads_loops_backward(const Heads<float>& p, const float* q_all, const float* gz_all, float* z_all,
                          float* dq_all, float* dk, float* dv, float* dgates) {
  const int64_t N = p.N, d = p.d, H = p.H, Hkv = p.Hkv, Hd = H * d;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const int64_t dp = padded(d), Np = padded(N);
  at::parallel_for(0, p.B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int64_t> rows;
    std::vector<float> k_t, v_p, k_p, v_t, s, o, do_p, q_p, dprobs, tr;
    for (int64_t b = b0; b < b1; ++b) {
      const float* q_img = q_all + b * N * Hd;
      const float* gz_img = gz_all + b * N * Hd;
      int64_t kv_loaded = -1;
      for (int64_t h = 0; h < H; ++h) {
        chosen_rows(p.mask, h, p.S, b, N, p.B * N, rows);
        const int64_t m = static_cast<int64_t>(rows.size());
        if (m == 0) continue;
        const int64_t kvh = h / p.group;
        if (kv_loaded != kvh) {
          transpose_padded(p.keys(b, kvh), N, d, p.k_stride[2], k_t);    // K^T [d, Np]
          copy_padded(p.values(b, kvh), N, d, p.v_stride[2], v_p);       // V [N, dp]
          copy_padded(p.keys(b, kvh), N, d, p.k_stride[2], k_p);         // K [N, dp]
          transpose_padded(p.values(b, kvh), N, d, p.v_stride[2], v_t);  // V^T [d, Np]
          kv_loaded = kvh;
        }
        // recompute: probabilities, the head's output
        s.resize(m * N);
        small_gemm(m, N, d, scale, q_img + h * d, Hd, rows.data(), k_t.data(), Np, s.data(), N, nullptr, false);
        for (int64_t i = 0; i < m; ++i) softmax_row(&s[i * N], N);
        o.resize(m * d);
        small_gemm(m, d, N, 1.f, s.data(), N, nullptr, v_p.data(), dp, o.data(), d, nullptr, false);
        // the gate: dgates, z = g o (W_O's input), and the head output's gradient g gz
        do_p.assign(m * dp, 0.f);
        q_p.assign(m * dp, 0.f);
        for (int64_t i = 0; i < m; ++i) {
          const int64_t n = rows[i], t = b * N + n;
          const float g = p.gate(b, n, h);
          const float* gz = gz_img + n * Hd + h * d;
          float* z = z_all + t * Hd + h * d;
          float dg = 0.f;
          for (int64_t c = 0; c < d; ++c) {
            dg += gz[c] * o[i * d + c];
            z[c] = g * o[i * d + c];
            do_p[i * dp + c] = g * gz[c];
          }
          dgates[t * H + h] = dg;
          std::memcpy(&q_p[i * dp], q_img + n * Hd + h * d, d * sizeof(float));
        }
        // attention's backward
        transpose_into(s.data(), m, N, N, tr);  // P^T [N, m]
        small_gemm(N, d, m, 1.f, tr.data(), m, nullptr, do_p.data(), dp,
                   dv + (b * Hkv + kvh) * N * d, d, nullptr, true);
        dprobs.resize(m * N);
        small_gemm(m, N, d, 1.f, do_p.data(), dp, nullptr, v_t.data(), Np, dprobs.data(), N, nullptr, false);
        for (int64_t i = 0; i < m; ++i) {
          const float* pr = &s[i * N];
          float* dpr = &dprobs[i * N];
          float delta = 0.f;
          for (int64_t j = 0; j < N; ++j) delta += pr[j] * dpr[j];
          for (int64_t j = 0; j < N; ++j) dpr[j] = pr[j] * (dpr[j] - delta);  // dS
        }
        small_gemm(m, d, N, scale, dprobs.data(), N, nullptr, k_p.data(), dp, dq_all + b * N * Hd + h * d, Hd,
                   rows.data(), false);
        transpose_into(dprobs.data(), m, N, N, tr);  // dS^T [N, m]
        small_gemm(N, d, m, scale, tr.data(), m, nullptr, q_p.data(), dp, dk + (b * Hkv + kvh) * N * d, d, nullptr,
                   true);
      }
    }
  });
}

// x: [T, C] (T = B * N, contiguous); qkv_w: [>= H * d, C] (the query rows of head h at h * d), qkv_b
// its bias or None; proj_w: [Co, H * d] (unit column stride); k, v: [B, Hkv, N, d] (unit last stride);
// v_bias: None, or (float32) the values' bias [Hkv * d] when v was computed without it; routed_mask:
// [E, T] bool (E = H - S routed heads, head-major); gates: [T, H] float32; first_head: 0 (every head
// here) or S (the shared heads computed by the caller); small_gemm: float32 only; out: [T, Co], holding
// the output's bias (unless out_bias gives it: float32, [Co]) and the shared heads' part when first_head
// = S on entry, the whole layer output on return.
void moh_routed_heads(const at::Tensor& x, const at::Tensor& qkv_w, const c10::optional<at::Tensor>& qkv_b,
                      const at::Tensor& proj_w, const at::Tensor& k, const at::Tensor& v,
                      const c10::optional<at::Tensor>& v_bias, const at::Tensor& routed_mask, const at::Tensor& gates,
                      int64_t S, int64_t first_head, bool small_gemm, at::Tensor out,
                      const c10::optional<at::Tensor>& out_bias, bool fused) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "moh_routed_heads: float32 or bfloat16, got ", dtype);
  for (const at::Tensor& t : {qkv_w, proj_w, k, v, out})
    TORCH_CHECK(t.scalar_type() == dtype, "moh_routed_heads: every tensor in ", dtype);
  TORCH_CHECK(!qkv_b.has_value() || (qkv_b->scalar_type() == dtype && qkv_b->is_contiguous()), "moh_routed_heads: qkv_b");
  TORCH_CHECK(!v_bias.has_value() || (dtype == at::kFloat && v_bias->scalar_type() == at::kFloat &&
                                      v_bias->is_contiguous() && v_bias->numel() == k.size(1) * k.size(3)),
              "moh_routed_heads: v_bias is float32, [Hkv * d]");
  TORCH_CHECK(!out_bias.has_value() || (dtype == at::kFloat && out_bias->scalar_type() == at::kFloat &&
                                        out_bias->is_contiguous() && out_bias->numel() == out.size(1)),
              "moh_routed_heads: out_bias is float32, [Co]");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && qkv_w.is_contiguous() && out.is_contiguous(),
              "moh_routed_heads: x, qkv_w and out contiguous");
  TORCH_CHECK(proj_w.stride(1) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "moh_routed_heads: unit last strides");
  TORCH_CHECK(routed_mask.scalar_type() == at::kBool && routed_mask.is_contiguous(), "moh_routed_heads: routed_mask bool");
  TORCH_CHECK(gates.scalar_type() == at::kFloat && gates.is_contiguous() && gates.dim() == 2, "moh_routed_heads: gates");
  const int64_t B = k.size(0), N = k.size(2), H = gates.size(1);
  TORCH_CHECK(x.size(0) == B * N && out.size(0) == B * N && gates.size(0) == B * N, "moh_routed_heads: token counts");
  TORCH_CHECK(0 <= S && S <= H && routed_mask.size(0) == H - S && routed_mask.size(1) == B * N && H % k.size(1) == 0,
              "moh_routed_heads: head counts");
  TORCH_CHECK(first_head == 0 || first_head == S, "moh_routed_heads: first_head is 0 or S");
  TORCH_CHECK(!small_gemm || dtype == at::kFloat, "moh_routed_heads: small_gemm is float32 only");
  TORCH_CHECK(small_gemm || (dtype == at::kFloat ? sgemm_fn() != nullptr : bf16gemm_fn() != nullptr),
              "moh_routed_heads: no MKL GEMM for ", dtype, " in this torch build (check moh_routed_blas first)");
  if (N == 0 || B == 0) return;
  if (dtype == at::kFloat) {
    Heads<float> heads(x, qkv_w, qkv_b, proj_w, k, v, v_bias, routed_mask, gates, S, first_head, out, out_bias);
    at::Tensor wq_t, wo_t;
    // row_gemm.h is AVX-512 code. On an AVX2 EPYC (Zen 3) a port of it made this op at DiT-B/2 sizes 1.10-1.17x
    // slower than with MKL's GEMMs with a third of the routed pairs on (0.96x with 90%; 27th session), so there
    // the attention alone runs in fused_attention.h's loops.
    heads.fused = !small_gemm && fused && visattn::fused_attention_runs(heads.d) && visattn::avx512_runs() &&
                  heads.Co % visattn::kLanes == 0 && heads.H > first_head;
    heads.attend_fused = !small_gemm && fused && visattn::fused_attention_runs(heads.d);
    if (heads.fused) {
      const int64_t Hr = heads.H - first_head, d = heads.d;
      wq_t = qkv_w.narrow(0, first_head * d, Hr * d).view({Hr, d, heads.C}).transpose(1, 2).contiguous();
      wo_t = proj_w.narrow(1, first_head * d, Hr * d).t().contiguous();  // [Hr * d, Co]
      heads.wq_t = wq_t.data_ptr<float>();
      heads.wo_t = wo_t.data_ptr<float>();
    }
    if (small_gemm) heads_loops(heads, x, qkv_w, qkv_b, proj_w, out);
    else heads_blas(heads);
  } else {
    heads_blas(
        Heads<c10::BFloat16>(x, qkv_w, qkv_b, proj_w, k, v, v_bias, routed_mask, gates, S, first_head, out, out_bias));
  }
}

// The attention of every (token, head) pair chosen, heads from first_head on, for a caller that projects
// queries and outputs itself (heads_attention_blas): q [T, >= H*d] (unit column stride), q_bias [H*d] or
// None, k/v [B, Hkv, N, d] (unit last stride), v_bias [Hkv*d] or None (v computed without it),
// routed_mask [E, T] bool, gates [T, H] float32, z [T, H*d] (unit column stride; it may be q itself): its
// columns of heads >= first_head are written (gated outputs, 0 where a pair is off). float32. With `fused`
// (the default) the attention runs in fused_attention.h's loops where this CPU and head width allow
// (moh_fused_attention), else through MKL's SGEMM (check moh_routed_blas); the tests run both. Without
// `zero_off` the bfloat16 version leaves the pairs that are off as they were, for a caller that does not
// read them (routed_kernel_grouped); float32 writes their 0 regardless.
// The bfloat16 version of moh_routed_attention (amx_attention.h): q, k, v and z bf16, the biases and gates
// float32, heads 64 wide on a CPU with AMX (moh_amx_attention), key and value rows 4-byte aligned.
void routed_attention_amx(const at::Tensor& q, const c10::optional<at::Tensor>& q_bias, const at::Tensor& k,
                          const at::Tensor& v, const c10::optional<at::Tensor>& v_bias, const at::Tensor& routed_mask,
                          const at::Tensor& gates, int64_t S, int64_t first_head, at::Tensor& z, bool zero_off) {
  const int64_t B = k.size(0), Hkv = k.size(1), N = k.size(2), d = k.size(3), H = gates.size(1);
  for (const at::Tensor& t : {k, v, z})
    TORCH_CHECK(t.scalar_type() == at::kBFloat16, "moh_routed_attention: q, k, v and z all bfloat16 (or float32)");
  TORCH_CHECK(visattn::amx_attention_runs(d), "moh_routed_attention: bfloat16 needs AMX and heads 64 wide (",
              d, " here; check moh_amx_attention)");
  const auto even = [](const at::Tensor& t) {
    return t.stride(0) % 2 == 0 && t.stride(1) % 2 == 0 && t.stride(2) % 2 == 0 &&
           reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0;
  };
  TORCH_CHECK(even(k) && even(v), "moh_routed_attention: bfloat16 keys and values need 4-byte aligned rows");
  const int64_t ks[3] = {k.stride(0), k.stride(1), k.stride(2)}, vs[3] = {v.stride(0), v.stride(1), v.stride(2)};
  const visattn::AmxImage a{B, N, H, Hkv, d, S, first_head, q.stride(0),
                            reinterpret_cast<const uint16_t*>(q.data_ptr()),
                            q_bias.has_value() ? q_bias->data_ptr<float>() : nullptr,
                            reinterpret_cast<const uint16_t*>(k.data_ptr()), reinterpret_cast<const uint16_t*>(v.data_ptr()),
                            ks, vs, v_bias.has_value() ? v_bias->data_ptr<float>() : nullptr, gates.data_ptr<float>(),
                            routed_mask.data_ptr<bool>(), reinterpret_cast<uint16_t*>(z.data_ptr()), z.stride(0),
                            zero_off};
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    visattn::AmxScratch scratch;
    visattn::amx_attend_images(a, b0, b1, scratch);
  });
}

void moh_routed_attention(const at::Tensor& q, const c10::optional<at::Tensor>& q_bias, const at::Tensor& k,
                          const at::Tensor& v, const c10::optional<at::Tensor>& v_bias, const at::Tensor& routed_mask,
                          const at::Tensor& gates, int64_t S, int64_t first_head, at::Tensor z, bool fused,
                          bool zero_off) {
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  for (const at::Tensor& t : {q, k, v, z})
    TORCH_CHECK(t.scalar_type() == (bf16 ? at::kBFloat16 : at::kFloat),
                "moh_routed_attention: q, k, v and z all float32 or all bfloat16");
  TORCH_CHECK(gates.scalar_type() == at::kFloat, "moh_routed_attention: gates float32");
  for (const auto& t : {q_bias, v_bias})
    TORCH_CHECK(!t.has_value() || (t->scalar_type() == at::kFloat && t->is_contiguous()),
                "moh_routed_attention: biases float32, contiguous");
  TORCH_CHECK(bf16 || sgemm_fn() != nullptr, "moh_routed_attention: no MKL SGEMM in this torch build");
  const int64_t B = k.size(0), Hkv = k.size(1), N = k.size(2), d = k.size(3), H = gates.size(1), T = B * N;
  TORCH_CHECK(q.dim() == 2 && q.size(0) == T && q.stride(1) == 1 && q.size(1) >= H * d, "moh_routed_attention: q");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && H % Hkv == 0, "moh_routed_attention: k, v");
  // z's rows may be strided, so that z can be q itself
  TORCH_CHECK(z.dim() == 2 && z.size(0) == T && z.size(1) == H * d && z.stride(1) == 1 && z.stride(0) >= H * d,
              "moh_routed_attention: z [T, H*d], unit column stride");
  TORCH_CHECK(gates.is_contiguous() && gates.size(0) == T && routed_mask.scalar_type() == at::kBool &&
                  routed_mask.is_contiguous() && routed_mask.size(0) == H - S && routed_mask.size(1) == T &&
                  0 <= first_head && first_head <= H,
              "moh_routed_attention: gates, routed_mask, first_head");
  TORCH_CHECK(!q_bias.has_value() || q_bias->numel() == H * d, "moh_routed_attention: q_bias [H*d]");
  TORCH_CHECK(!v_bias.has_value() || v_bias->numel() == Hkv * d, "moh_routed_attention: v_bias [Hkv*d]");
  if (T == 0) return;
  if (bf16) return routed_attention_amx(q, q_bias, k, v, v_bias, routed_mask, gates, S, first_head, z, zero_off);
  // the gathered queries' offsets are 32-bit
  fused = fused && visattn::fused_attention_runs(d) && N * q.stride(0) <= std::numeric_limits<int32_t>::max();
  heads_attention(B, N, H, Hkv, d, S, first_head, q.data_ptr<float>(), q.stride(0),
                  q_bias.has_value() ? q_bias->data_ptr<float>() : nullptr, k, v,
                  v_bias.has_value() ? v_bias->data_ptr<float>() : nullptr, routed_mask.data_ptr<bool>(),
                  gates.data_ptr<float>(), z.data_ptr<float>(), z.stride(0), fused);
}

// The output projection of the chosen pairs (amx_projection.h): z [T, H*d] bf16 (unit column stride; its
// pairs that are off are not read), routed_mask [H - S, T] bool, weight [Co, H*d] bf16 or float32 (rounded
// to bf16 as it is packed: no bf16 copy per call), bias [Co] float32 or None -> [T, Co] bf16, equal to
// z @ weight^T + bias with those pairs 0. Heads 64 wide on a CPU with AMX (moh_amx_attention), Co a multiple
// of 32, at most 64 routed heads.
at::Tensor moh_routed_proj(const at::Tensor& z, const at::Tensor& routed_mask, int64_t S, const at::Tensor& weight,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(routed_mask.scalar_type() == at::kBool && routed_mask.dim() == 2 && routed_mask.is_contiguous(),
              "moh_routed_proj: routed_mask [H - S, T] bool, contiguous");
  const int64_t E = routed_mask.size(0), H = S + E, T = routed_mask.size(1), Co = weight.size(0);
  TORCH_CHECK(S >= 0 && H > 0 && E <= 64, "moh_routed_proj: at most 64 routed heads (", E, " here)");
  TORCH_CHECK(z.scalar_type() == at::kBFloat16 && z.dim() == 2 && z.size(0) == T && z.stride(1) == 1 &&
                  z.size(1) % H == 0,
              "moh_routed_proj: z [T, H*d] bfloat16, unit column stride");
  const int64_t d = z.size(1) / H;
  TORCH_CHECK(visattn::amx_attention_runs(d), "moh_routed_proj: needs AMX and heads 64 wide (", d,
              " here; check moh_amx_attention)");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat,
              "moh_routed_proj: weight bfloat16 or float32 (rounded to bfloat16)");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == H * d && weight.is_contiguous() && Co % 32 == 0,
              "moh_routed_proj: weight [Co, H*d] contiguous, Co a multiple of 32 (", Co, " here)");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == Co),
              "moh_routed_proj: bias float32 [Co]");
  at::Tensor out = at::empty({T, Co}, z.options().memory_format(at::MemoryFormat::Contiguous));
  if (T == 0) return out;
  visattn::AlignedBuffer<int32_t> packed;
  packed.resize(H * d / 2 * Co);
  at::parallel_for(0, Co / 32, 1, [&](int64_t c0, int64_t c1) {
    if (weight.scalar_type() == at::kFloat)
      visattn::amx_pack_weight(weight.data_ptr<float>(), H * d, c0, c1, packed.data());
    else
      visattn::amx_pack_weight(reinterpret_cast<const uint16_t*>(weight.data_ptr()), H * d, c0, c1, packed.data());
  });
  const visattn::AmxProjection p{H, d, Co, reinterpret_cast<const uint16_t*>(z.data_ptr()), z.stride(0),
                                 packed.data(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
                                 reinterpret_cast<uint16_t*>(out.data_ptr()), Co};
  const visattn::HeadGroups groups = visattn::head_groups(routed_mask.data_ptr<bool>(), T, H, S);
  const auto& blocks = groups.blocks;
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t b0, int64_t b1) {
    visattn::amx_project_blocks(p, blocks.data(), b0, b1);
  });
  return out;
}

// A float32 parameter as CPU autocast casts it for a matmul (at::autocast::cached_cast): the cast autocast
// keeps for the rest of its outermost region, as it keeps nn.Linear's weight, so that slices of it cost no
// cast of their own per call (autocast does not cache a slice: it is a view, not a leaf). Registered for
// AutocastCPU alone: outside CPU autocast it is an error.
at::Tensor autocast_weight(const at::Tensor& weight) {
  return at::autocast::cached_cast(at::autocast::get_autocast_dtype(at::kCPU), weight, c10::DeviceType::CPU);
}

at::Tensor autocast_weight_outside_autocast(const at::Tensor& weight) {
  TORCH_CHECK(false, "autocast_weight: call it inside torch.autocast('cpu')");
  return weight;
}

// The gradients of moh_routed_heads(..., first_head = 0, small_gemm = true) for grad_out [T, Co]: dx [T, C],
// d(qkv_w's query rows) [H * d, C], d(their bias) [H * d] (empty without a bias), d(proj_w) [Co, H * d],
// dk and dv [B, Hkv, N, d] and dgates [T, H] (0 where a head is off). The selection gets none.
std::vector<at::Tensor> moh_routed_heads_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                                  const at::Tensor& qkv_w, const c10::optional<at::Tensor>& qkv_b,
                                                  const at::Tensor& proj_w, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& routed_mask, const at::Tensor& gates, int64_t S) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && grad_out.scalar_type() == at::kFloat,
              "moh_routed_heads_backward: float32 only");
  TORCH_CHECK(grad_out.is_contiguous() && grad_out.dim() == 2 && grad_out.size(0) == x.size(0),
              "moh_routed_heads_backward: grad_out [T, Co] contiguous");
  const int64_t B = k.size(0), Hkv = k.size(1), N = k.size(2), d = k.size(3), H = gates.size(1);
  // grad_out stands in for the forward's output, which has its shape: the backward reads Heads' sizes and
  // never writes through Heads::out
  at::Tensor out_shape = grad_out;
  const Heads<float> heads(x, qkv_w, qkv_b, proj_w, k, v, c10::nullopt, routed_mask, gates, S, 0, out_shape,
                           c10::nullopt);
  // The projections' parts as whole-tensor matmuls over every (token, head) pair, zeros where a pair is
  // off: per image and head, as the forward runs them, they took two thirds of the backward's time at the
  // study's sizes (17 rows per weight-gradient update), and ATen's GEMMs over all the rows ran the
  // backward 2x faster even where half the pairs are off (docs/benchmarks.md, 9th session).
  const at::Tensor wq = qkv_w.narrow(0, 0, H * d);
  auto q_all = head_queries(x, qkv_w, qkv_b, 0, H, d);  // [T, H*d]
  auto gz_all = at::mm(grad_out, proj_w);               // [T, H*d]
  auto z_all = at::zeros_like(q_all);
  auto dq_all = at::zeros_like(q_all);
  auto dk = at::zeros({B, Hkv, N, d}, x.options());
  auto dv = at::zeros({B, Hkv, N, d}, x.options());
  auto dgates = at::zeros_like(gates);
  if (B > 0 && N > 0)
    heads_loops_backward(heads, q_all.data_ptr<float>(), gz_all.data_ptr<float>(), z_all.data_ptr<float>(),
                         dq_all.data_ptr<float>(), dk.data_ptr<float>(), dv.data_ptr<float>(), dgates.data_ptr<float>());
  auto dx = at::mm(dq_all, wq);
  auto dwq = at::mm(dq_all.t(), x);
  auto dbq = qkv_b.has_value() ? dq_all.sum(0) : at::empty({0}, x.options());
  auto dwo = at::mm(grad_out.t(), z_all);
  return {dx, dwq, dbq, dwo, dk, dv, dgates};
}

// The linear routers' logits: x [T, C] (unit column stride) @ w^T (w [R, C]) -> [T, R] float32, through
// small_gemm (router_logits_rows: the weights packed once as w^T [C, padded(R)], every row of x read once). A GEMM
// of a few output columns is no case MKL optimises on every CPU: on AMD Zen 3 its SGEMM took 2-4x this time at the
// study's and DiT-B's sizes (10 or 14 columns; 16 ran twice as fast as 10, 8 slower than 16 at 384 wide), and the
// router's matmul was half of its cost (16th session). HeadRouter times both on the running machine.
at::Tensor moh_router_logits(const at::Tensor& x_in, const at::Tensor& w_in) {
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(1),
              "moh_router_logits: x [T, C] and w [R, C]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w_in.scalar_type() == at::kFloat, "moh_router_logits: float32");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t T = x.size(0), C = x.size(1), R = w_in.size(0), ldx = x.stride(0);
  auto out = at::empty({T, R}, x.options());
  if (T == 0 || R == 0) return out;
  if (C == 0) return out.zero_();
  const std::vector<float> wt = visattn::pack_router_weights({w_in}, C);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 256, [&](int64_t t0, int64_t t1) {
    visattn::router_logits_rows(t1 - t0, R, C, xp + t0 * ldx, ldx, wt.data(), op + t0 * R, R);
  });
  return out;
}

// Whether this torch build exports the GEMM moh_routed_heads needs for `dtype` (float32: SGEMM,
// bfloat16: cblas_gemm_bf16bf16f32).
bool moh_routed_blas(at::ScalarType dtype) {
  if (dtype == at::kFloat) return sgemm_fn() != nullptr;
  if (dtype == at::kBFloat16) return bf16gemm_fn() != nullptr;
  return false;
}

// Whether moh_routed_attention and moh_routed_heads (float32, with MKL) run their attention in
// fused_attention.h's loops for heads `head_dim` wide on this CPU (`fused`, their default), else through SGEMM.
bool moh_fused_attention(int64_t head_dim) { return visattn::fused_attention_runs(head_dim); }

// Whether moh_routed_attention takes bfloat16 inputs for heads `head_dim` wide here (AMX, amx_attention.h).
bool moh_amx_attention(int64_t head_dim) { return visattn::amx_attention_runs(head_dim); }

}  // namespace

namespace visattn {

std::vector<float> pack_router_weights(at::TensorList weights, int64_t C) {
  int64_t R = 0;
  for (const auto& w : weights) R += w.size(0);
  const int64_t ldw = padded(R);
  std::vector<float> wt(C * ldw, 0.0f);
  int64_t r0 = 0;
  for (const auto& w_in : weights) {
    const at::Tensor w = w_in.contiguous();
    const float* src = w.data_ptr<float>();
    for (int64_t i = 0; i < w.size(0); ++i)
      for (int64_t c = 0; c < C; ++c) wt[c * ldw + r0 + i] = src[i * C + c];
    r0 += w.size(0);
  }
  return wt;
}

void router_logits_rows(int64_t n, int64_t R, int64_t C, const float* x, int64_t ldx, const float* wt, float* out,
                        int64_t ldo) {
  small_gemm(n, R, C, 1.f, x, ldx, nullptr, wt, padded(R), out, ldo, nullptr, false);
}

}  // namespace visattn

TORCH_LIBRARY_FRAGMENT(visattn, m) {
  m.def("moh_routed_heads(Tensor x, Tensor qkv_w, Tensor? qkv_b, Tensor proj_w, Tensor k, Tensor v, Tensor? v_bias, "
        "Tensor routed_mask, Tensor gates, int S, int first_head, bool small_gemm, Tensor(a!) out, "
        "Tensor? out_bias=None, bool fused=True) -> ()");
  m.def("moh_routed_heads_backward(Tensor grad_out, Tensor x, Tensor qkv_w, Tensor? qkv_b, Tensor proj_w, Tensor k, "
        "Tensor v, Tensor routed_mask, Tensor gates, int S) -> Tensor[]");
  m.def("moh_routed_attention(Tensor q, Tensor? q_bias, Tensor k, Tensor v, Tensor? v_bias, Tensor routed_mask, "
        "Tensor gates, int S, int first_head, Tensor(a!) z, bool fused=True, bool zero_off=True) -> ()");
  m.def("moh_routed_proj(Tensor z, Tensor routed_mask, int S, Tensor weight, Tensor? bias) -> Tensor");
  m.def("autocast_weight(Tensor weight) -> Tensor");
  m.def("moh_router_logits(Tensor x, Tensor w) -> Tensor");
  m.def("moh_routed_blas(ScalarType dtype) -> bool", &moh_routed_blas);
  m.def("moh_fused_attention(int head_dim) -> bool", &moh_fused_attention);
  m.def("moh_amx_attention(int head_dim) -> bool", &moh_amx_attention);
}
TORCH_LIBRARY_IMPL(visattn, CPU, m) {
  m.impl("moh_routed_heads", &moh_routed_heads);
  m.impl("moh_routed_heads_backward", &moh_routed_heads_backward);
  m.impl("moh_routed_attention", &moh_routed_attention);
  m.impl("moh_routed_proj", &moh_routed_proj);
  m.impl("moh_router_logits", &moh_router_logits);
  m.impl("autocast_weight", &autocast_weight_outside_autocast);
}
TORCH_LIBRARY_IMPL(visattn, AutocastCPU, m) { m.impl("autocast_weight", &autocast_weight); }
