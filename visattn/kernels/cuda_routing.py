"""MoH's token-choice gates on a GPU in one Triton kernel (inference).

On CUDA the PyTorch routing (``visattn.attention.routing.HeadRouter``) is about 25 small kernels,
and at ViT-S / DiT-B sizes a layer is bound by their launches: the masked dense MoH layer took 3.2-3.8x
MHA's time on an H200 (docs/results/gpu.md). This kernel computes what ``torch.ops.visattn.moh_gates``
computes on the CPU (``moh_routing.cpp``): the two-stage weights, the shared heads' softmax, the
routed pool's softmax, its top-k (ties to the lower index) and the renormalised gates, from the router's
logits in place (any float dtype and strides, so neither the transpose nor the float cast of the
logits is a kernel of its own), and each image's head load (the statistic every forward records: three
more kernels otherwise). One program per image, so the load is summed in order, exactly.

For training, ``moh_gates_backward_cuda`` is the gradient with respect to the logits (of the gates and of the
load-balancing loss, which ``moh_gates_cuda(..., prob_sums=True)`` gives the sums for), as
``torch.ops.visattn.moh_gates_backward`` is on the CPU; ``visattn.attention.fused_gating.RoutedGatesCuda``
joins them. The tests hold both equal to the PyTorch routing (``HeadRouter.forward``) and its autograd.
Triton ships with PyTorch's CUDA builds; without it the PyTorch code runs. With ``TRITON_INTERPRET=1`` set
before triton is imported, the kernels run on CPU tensors in Triton's interpreter (how the tests check them
on machines without a GPU).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch build: the PyTorch routing runs
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _gates_block(
        L, stride_r, stride_t, G, K, T, eps, t, live, src,
        S: tl.constexpr, E: tl.constexpr, k: tl.constexpr, H: tl.constexpr, R: tl.constexpr,
        ROUTED0: tl.constexpr, TWO_STAGE: tl.constexpr, SHARED_ROUTED: tl.constexpr,
        S_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    ):  # fmt: skip
        """Tokens t ([BLOCK_T]; those not `live` are computed from token `src` and not stored), every row of
        their logits in registers ([rows, BLOCK_T] tiles). Returns how many live tokens chose each routed head
        and the sum of their routed probabilities ([E_PAD] each)."""
        if TWO_STAGE:  # the mix rows come last
            m0 = tl.load(L + (R - 2) * stride_r + src * stride_t).to(tl.float32)
            m1 = tl.load(L + (R - 1) * stride_r + src * stride_t).to(tl.float32)
            m = tl.maximum(m0, m1)
            e0 = tl.exp(m0 - m)
            e1 = tl.exp(m1 - m)
            a0 = e0 / (e0 + e1) * 2.0
            a1 = e1 / (e0 + e1) * 2.0
        else:
            a0 = tl.full((BLOCK_T,), 1.0, tl.float32)
            a1 = a0
        if S > 0:
            si = tl.arange(0, S_PAD)
            rows = (si[:, None] < S) & live[None, :]
            if SHARED_ROUTED:
                shared = si[:, None] < S
                ls = tl.load(L + si[:, None] * stride_r + src[None, :] * stride_t, mask=shared, other=float("-inf"))
                ls = ls.to(tl.float32)
                es = tl.exp(ls - tl.max(ls, 0)[None, :])
                es = tl.where(shared, es, 0.0)
                gs = es / tl.sum(es, 0)[None, :] * (a0 * S)[None, :]
            else:
                gs = tl.zeros((S_PAD, BLOCK_T), tl.float32) + a0[None, :]
            tl.store(G + t[None, :] * H + si[:, None], gs, mask=rows)
        if E > 0:
            ei = tl.arange(0, E_PAD)
            pool = ei[:, None] < E
            rows = pool & live[None, :]
            routed_rows = L + (ROUTED0 + ei[:, None]) * stride_r
            lr = tl.load(routed_rows + src[None, :] * stride_t, mask=pool, other=float("-inf"))
            lr = lr.to(tl.float32)
            p = tl.exp(lr - tl.max(lr, 0)[None, :])
            p = tl.where(pool, p, 0.0)
            p = p / tl.sum(p, 0)[None, :]
            if k < E:
                # rank = the heads that beat head i (larger, or equal at a lower index); keep rank < k
                rank = tl.zeros((E_PAD, BLOCK_T), tl.float32)
                for j in tl.static_range(E):
                    pj = tl.sum(tl.where(ei[:, None] == j, p, 0.0), 0)  # row j, exactly (a sum of zeros)
                    beats = (pj[None, :] > p) | ((pj[None, :] == p) & (ei[:, None] > j))
                    rank += beats.to(tl.float32)
                keep = tl.where(pool & (rank < k), 1.0, 0.0)
            else:
                keep = tl.where(pool, 1.0, 0.0)
            kept = p * keep
            total = tl.maximum(tl.sum(kept, 0), eps)
            if TWO_STAGE:
                gr = kept * (a1 * k / total)[None, :]
            else:
                gr = kept / total[None, :] * k
            tl.store(G + t[None, :] * H + S + ei[:, None], gr, mask=rows)
            tl.store(K + ei[:, None] * T + t[None, :], keep, mask=rows)
            return tl.sum(tl.where(rows, keep, 0.0), 1), tl.sum(tl.where(rows, p, 0.0), 1)
        else:
            return tl.zeros((E_PAD,), tl.float32), tl.zeros((E_PAD,), tl.float32)

    @triton.jit
    def _gates_kernel(
        L, stride_r, stride_t, G, K, LOAD, PSUM, N, eps,
        S: tl.constexpr, E: tl.constexpr, k: tl.constexpr, H: tl.constexpr, R: tl.constexpr,
        ROUTED0: tl.constexpr, TWO_STAGE: tl.constexpr, SHARED_ROUTED: tl.constexpr, WITH_PSUM: tl.constexpr,
        S_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    ):  # fmt: skip
        """One program: one image's N tokens, BLOCK_T at a time, and the image's head load (a count of 0/1
        values, exact, divided by N: as ``mean`` gives it); with WITH_PSUM also the sums of the image's routed
        probabilities ([B, E])."""
        b = tl.program_id(0)
        T = tl.num_programs(0) * N
        count = tl.zeros((E_PAD,), tl.float32)
        psum = tl.zeros((E_PAD,), tl.float32)
        for n0 in range(0, N, BLOCK_T):
            n = n0 + tl.arange(0, BLOCK_T)
            live = n < N
            t = b * N + n
            src = tl.where(live, t, b * N)  # past the image: its first token, computed and not stored
            block_count, block_psum = _gates_block(
                L, stride_r, stride_t, G, K, T, eps, t, live, src, S, E, k, H, R, ROUTED0, TWO_STAGE,
                SHARED_ROUTED, S_PAD, E_PAD, BLOCK_T,
            )  # fmt: skip
            count += block_count
            psum += block_psum
        if S > 0:
            si = tl.arange(0, S_PAD)
            tl.store(LOAD + b * H + si, tl.full((S_PAD,), 1.0, tl.float32), mask=si < S)
        if E > 0:
            ei = tl.arange(0, E_PAD)
            tl.store(LOAD + b * H + S + ei, count / N, mask=ei < E)
            if WITH_PSUM:
                tl.store(PSUM + b * E + ei, psum, mask=ei < E)

    @triton.jit
    def _gates_backward_kernel(
        L, stride_r, stride_t, KEEP, DG, W, OUT, out_stride_r, out_stride_t, T, eps,
        S: tl.constexpr, E: tl.constexpr, k: tl.constexpr, H: tl.constexpr, R: tl.constexpr,
        ROUTED0: tl.constexpr, TWO_STAGE: tl.constexpr, SHARED_ROUTED: tl.constexpr, HAS_W: tl.constexpr,
        S_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    ):  # fmt: skip
        """One program: BLOCK_T tokens' logit gradients [R, BLOCK_T] from the gates' gradients DG [T, H] (and W
        [E]: d loss / d P[e, t], the same for every token, where HAS_W), the softmaxes recomputed and the
        selection KEEP [E, T] the forward's. The formulas of moh_gates_backward (moh_routing.cpp)."""
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        live = t < T
        src = tl.where(live, t, 0)
        da0 = tl.zeros((BLOCK_T,), tl.float32)  # d loss / d alpha0, alpha1 (alpha = 2 softmax(mix rows))
        da1 = tl.zeros((BLOCK_T,), tl.float32)
        if TWO_STAGE:
            m0 = tl.load(L + (R - 2) * stride_r + src * stride_t).to(tl.float32)
            m1 = tl.load(L + (R - 1) * stride_r + src * stride_t).to(tl.float32)
            m = tl.maximum(m0, m1)
            e0 = tl.exp(m0 - m)
            e1 = tl.exp(m1 - m)
            s0 = e0 / (e0 + e1)
            s1 = e1 / (e0 + e1)
        else:
            s0 = tl.full((BLOCK_T,), 0.5, tl.float32)
            s1 = s0
        if S > 0:
            si = tl.arange(0, S_PAD)
            shared = si[:, None] < S
            gs = tl.load(DG + src[None, :] * H + si[:, None], mask=shared, other=0.0)
            if SHARED_ROUTED:  # gates softmax * S (* alpha0)
                ls = tl.load(L + si[:, None] * stride_r + src[None, :] * stride_t, mask=shared, other=float("-inf"))
                ls = ls.to(tl.float32)
                ps = tl.exp(ls - tl.max(ls, 0)[None, :])
                ps = tl.where(shared, ps, 0.0)
                ps = ps / tl.sum(ps, 0)[None, :]
                if TWO_STAGE:
                    dps = gs * (2.0 * s0 * S)[None, :]
                    da0 += tl.sum(gs * ps, 0) * S
                else:
                    dps = gs * S
                dls = ps * (dps - tl.sum(ps * dps, 0)[None, :])
                out = OUT + si[:, None] * out_stride_r + t[None, :] * out_stride_t
                tl.store(out, dls.to(OUT.dtype.element_ty), mask=shared & live[None, :])
            elif TWO_STAGE:  # gates alpha0
                da0 += tl.sum(gs, 0)
        if E > 0:  # gates kept * c / D: kept = p * keep, D = max(sum kept, eps), c = alpha1 * k (or k)
            ei = tl.arange(0, E_PAD)
            pool = ei[:, None] < E
            lr = tl.load(L + (ROUTED0 + ei[:, None]) * stride_r + src[None, :] * stride_t, mask=pool,
                         other=float("-inf"))
            lr = lr.to(tl.float32)
            p = tl.exp(lr - tl.max(lr, 0)[None, :])
            p = tl.where(pool, p, 0.0)
            p = p / tl.sum(p, 0)[None, :]
            keep = tl.load(KEEP + ei[:, None] * T + src[None, :], mask=pool, other=0.0)
            gr = tl.load(DG + src[None, :] * H + S + ei[:, None], mask=pool, other=0.0)
            kept = p * keep
            total = tl.sum(kept, 0)
            dot = tl.sum(gr * kept, 0)
            D = tl.maximum(total, eps)
            if TWO_STAGE:
                c = 2.0 * s1 * k
            else:
                c = tl.full((BLOCK_T,), k, tl.float32)
            dD = tl.where(total >= eps, -dot * c / (D * D), 0.0)  # clamp_min passes its gradient where sum >= eps
            dp = (gr * (c / D)[None, :] + dD[None, :]) * keep
            if HAS_W:
                dp += tl.load(W + ei, mask=ei < E, other=0.0)[:, None]
            dp = tl.where(pool, dp, 0.0)
            if TWO_STAGE:
                da1 = dot * k / D
            dl = p * (dp - tl.sum(p * dp, 0)[None, :])
            out = OUT + (ROUTED0 + ei[:, None]) * out_stride_r + t[None, :] * out_stride_t
            tl.store(out, dl.to(OUT.dtype.element_ty), mask=pool & live[None, :])
        if TWO_STAGE:
            d0 = 2.0 * da0
            d1 = 2.0 * da1
            mix = s0 * d0 + s1 * d1
            out = OUT + t * out_stride_t
            tl.store(out + (R - 2) * out_stride_r, (s0 * (d0 - mix)).to(OUT.dtype.element_ty), mask=live)
            tl.store(out + (R - 1) * out_stride_r, (s1 * (d1 - mix)).to(OUT.dtype.element_ty), mask=live)


def _pad(n: int) -> int:
    return max(2, 1 << (n - 1).bit_length())


def _check_budget(name: str, logits: torch.Tensor, S: int, E: int, two_stage: bool, shared_routed: bool) -> None:
    if triton is None:
        raise RuntimeError(f"{name} needs triton (shipped with PyTorch's CUDA builds)")
    rows = (S if shared_routed else 0) + E + (2 if two_stage else 0)
    if logits.shape[0] != rows:
        raise ValueError(f"logits have {logits.shape[0]} rows; the budget (S={S}, E={E}, two_stage={two_stage}, "
                         f"shared_routed={shared_routed}) needs {rows}")


def moh_gates_cuda(
    logits: torch.Tensor, S: int, E: int, k: int, two_stage: bool, shared_routed: bool, eps: float, tokens: int,
    prob_sums: bool = False,
) -> tuple[torch.Tensor, ...]:
    """logits [R, T] (the router's rows: shared, routed, then the two mix rows; any float dtype and strides) of
    T = B * tokens tokens, image by image -> gates [T, S + E] float32 (zero where a head is off), keep [E, T]
    float32 (1 for a chosen routed head), as ``torch.ops.visattn.moh_gates`` and ``HeadRouter.forward`` compute
    them, and each image's head load [B, S + E] (``routing.image_head_load``); with ``prob_sums`` also each
    image's sums of the routed pool's probabilities [B, E] (the load-balancing loss's P_e, times T)."""
    _check_budget("moh_gates_cuda", logits, S, E, two_stage, shared_routed)
    R, T = logits.shape
    H = S + E
    if tokens < 1 or T % tokens:
        raise ValueError(f"{T} tokens are not whole images of tokens={tokens}")
    B = T // tokens
    gates = torch.empty((T, H), dtype=torch.float32, device=logits.device)
    keep = torch.empty((E, T), dtype=torch.float32, device=logits.device)
    load = torch.empty((B, H), dtype=torch.float32, device=logits.device)
    psum = torch.empty((B, E) if prob_sums else (1,), dtype=torch.float32, device=logits.device)  # (1,): unused
    if T > 0:
        e_pad, s_pad = _pad(E), _pad(S)
        block = max(16, min(128, 4096 // e_pad, triton.next_power_of_2(tokens)))
        _gates_kernel[(B,)](
            logits, logits.stride(0), logits.stride(1), gates, keep, load, psum, tokens, eps,
            S=S, E=E, k=k, H=H, R=R, ROUTED0=S if shared_routed else 0, TWO_STAGE=two_stage,
            SHARED_ROUTED=shared_routed, WITH_PSUM=prob_sums, S_PAD=s_pad, E_PAD=e_pad, BLOCK_T=block,
        )  # fmt: skip
    return (gates, keep, load, psum) if prob_sums else (gates, keep, load)


def moh_gates_backward_cuda(
    logits: torch.Tensor, keep: torch.Tensor, grad_gates: torch.Tensor, aux_grad: torch.Tensor | None,
    S: int, E: int, k: int, two_stage: bool, shared_routed: bool, eps: float,
) -> torch.Tensor:
    """The gradient of ``moh_gates_cuda``'s gates (grad_gates [T, S + E] float32) and of the load-balancing loss
    (aux_grad [E] float32: d loss / d P[e, t], the same for every token; None without the loss) with respect to
    its logits [R, T] and given its keep [E, T]: [R, T] in the logits' dtype and layout."""
    _check_budget("moh_gates_backward_cuda", logits, S, E, two_stage, shared_routed)
    R, T = logits.shape
    H = S + E
    if keep.shape != (E, T) or grad_gates.shape != (T, H):
        raise ValueError(f"keep {tuple(keep.shape)} and grad_gates {tuple(grad_gates.shape)} do not match "
                         f"logits {tuple(logits.shape)}: expected ({E}, {T}) and ({T}, {H})")
    keep = keep.float().contiguous()
    grad_gates = grad_gates.float().contiguous()
    weights = aux_grad.float().contiguous() if aux_grad is not None else keep.new_zeros(1)
    out = torch.empty_like(logits)  # its strides: token-major when the logits are
    if T > 0:
        e_pad, s_pad = _pad(E), _pad(S)
        block = max(16, min(128, 4096 // e_pad))
        _gates_backward_kernel[(triton.cdiv(T, block),)](
            logits, logits.stride(0), logits.stride(1), keep, grad_gates, weights, out, out.stride(0),
            out.stride(1), T, eps, S=S, E=E, k=k, H=H, R=R, ROUTED0=S if shared_routed else 0,
            TWO_STAGE=two_stage, SHARED_ROUTED=shared_routed, HAS_W=aux_grad is not None, S_PAD=s_pad,
            E_PAD=e_pad, BLOCK_T=block,
        )  # fmt: skip
    return out
