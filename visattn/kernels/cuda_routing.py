"""MoH's token-choice gates on a GPU in one Triton kernel (inference).

On CUDA the PyTorch routing (``visattn.attention.routing.HeadRouter``) is about 25 small kernels,
and at ViT-S / DiT-B sizes a layer is bound by their launches: the masked dense MoH layer took 3.2-3.8x
MHA's time on an H200 (docs/results/gpu.md). This kernel computes what ``torch.ops.visattn.moh_gates``
computes on the CPU (``moh_routing.cpp``): the two-stage weights, the shared heads' softmax, the
routed pool's softmax, its top-k (ties to the lower index) and the renormalised gates, from the router's
logits in place (any float dtype and strides, so neither the transpose nor the float cast of the
logits is a kernel of its own), and each image's head load (the statistic every forward records: three
more kernels otherwise). One program per image, so the load is summed in order, exactly.

There is no backward: training runs the PyTorch code (``HeadRouter.forward``), which the tests hold equal
to this kernel. Triton ships with PyTorch's CUDA builds; without it the PyTorch code runs. With
``TRITON_INTERPRET=1`` set before triton is imported, the kernel runs on CPU tensors in Triton's interpreter
(how the tests check it on machines without a GPU).
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
        ([E_PAD])."""
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
            return tl.sum(tl.where(rows, keep, 0.0), 1)
        else:
            return tl.zeros((E_PAD,), tl.float32)

    @triton.jit
    def _gates_kernel(
        L, stride_r, stride_t, G, K, LOAD, N, eps,
        S: tl.constexpr, E: tl.constexpr, k: tl.constexpr, H: tl.constexpr, R: tl.constexpr,
        ROUTED0: tl.constexpr, TWO_STAGE: tl.constexpr, SHARED_ROUTED: tl.constexpr,
        S_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    ):  # fmt: skip
        """One program: one image's N tokens, BLOCK_T at a time, and the image's head load (a count of 0/1
        values, exact, divided by N: as ``mean`` gives it)."""
        b = tl.program_id(0)
        T = tl.num_programs(0) * N
        count = tl.zeros((E_PAD,), tl.float32)
        for n0 in range(0, N, BLOCK_T):
            n = n0 + tl.arange(0, BLOCK_T)
            live = n < N
            t = b * N + n
            src = tl.where(live, t, b * N)  # past the image: its first token, computed and not stored
            count += _gates_block(
                L, stride_r, stride_t, G, K, T, eps, t, live, src, S, E, k, H, R, ROUTED0, TWO_STAGE,
                SHARED_ROUTED, S_PAD, E_PAD, BLOCK_T,
            )  # fmt: skip
        if S > 0:
            si = tl.arange(0, S_PAD)
            tl.store(LOAD + b * H + si, tl.full((S_PAD,), 1.0, tl.float32), mask=si < S)
        if E > 0:
            ei = tl.arange(0, E_PAD)
            tl.store(LOAD + b * H + S + ei, count / N, mask=ei < E)


def _pad(n: int) -> int:
    return max(2, 1 << (n - 1).bit_length())


def moh_gates_cuda(
    logits: torch.Tensor, S: int, E: int, k: int, two_stage: bool, shared_routed: bool, eps: float, tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [R, T] (the router's rows: shared, routed, then the two mix rows; any float dtype and strides) of
    T = B * tokens tokens, image by image -> gates [T, S + E] float32 (zero where a head is off), keep [E, T]
    float32 (1 for a chosen routed head), as ``torch.ops.visattn.moh_gates`` and ``HeadRouter.forward`` compute
    them, and each image's head load [B, S + E] (``routing.image_head_load``)."""
    if triton is None:
        raise RuntimeError("moh_gates_cuda needs triton (shipped with PyTorch's CUDA builds)")
    R, T = logits.shape
    H = S + E
    routed0 = S if shared_routed else 0
    if R != routed0 + E + (2 if two_stage else 0):
        raise ValueError(f"logits have {R} rows; the budget (S={S}, E={E}, two_stage={two_stage}, "
                         f"shared_routed={shared_routed}) needs {routed0 + E + (2 if two_stage else 0)}")
    if tokens < 1 or T % tokens:
        raise ValueError(f"{T} tokens are not whole images of tokens={tokens}")
    B = T // tokens
    gates = torch.empty((T, H), dtype=torch.float32, device=logits.device)
    keep = torch.empty((E, T), dtype=torch.float32, device=logits.device)
    load = torch.empty((B, H), dtype=torch.float32, device=logits.device)
    if T == 0:
        return gates, keep, load
    e_pad, s_pad = _pad(E), _pad(S)
    block = max(16, min(128, 4096 // e_pad, triton.next_power_of_2(tokens)))
    _gates_kernel[(B,)](
        logits, logits.stride(0), logits.stride(1), gates, keep, load, tokens, eps,
        S=S, E=E, k=k, H=H, R=R, ROUTED0=routed0, TWO_STAGE=two_stage, SHARED_ROUTED=shared_routed,
        S_PAD=s_pad, E_PAD=e_pad, BLOCK_T=block,
    )  # fmt: skip
    return gates, keep, load
