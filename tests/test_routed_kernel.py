"""The MoH heads kernel (impl='routed_kernel' / 'routed_kernel_loops', visattn/kernels/moh_routed_heads.cpp):
equal to the masked dense path and to its PyTorch fallback (sparse_projections), on every layer option it
accepts; where it runs and where the fallback runs instead. No timing is asserted (docs/benchmarks.md
has those)."""

import os
import subprocess
import sys

import pytest
import torch

import visattn.attention.routed_kernel as routed_kernel
import visattn.kernels as kernels
from visattn.attention import build_attention
from visattn.attention.moh import PATHS
from visattn.utils.flops import count_flops


@pytest.fixture
def kernel():
    if kernels.moh_routed_heads_op(torch.float32) is None:
        pytest.skip("no C++ toolchain or no MKL SGEMM in this torch build: the PyTorch path runs instead")
    return kernels.moh_routed_heads_op(torch.float32)


def _moh(dim=48, heads=8, shared=2, topk=3, seed=0, impl="dense", **kwargs):
    torch.manual_seed(seed)
    m = build_attention("moh", dim, num_heads=heads, shared_heads=shared, routed_topk=topk, impl=impl, **kwargs)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # a router far from its initialisation: uneven head loads
    return m.eval()


def _counted(monkeypatch, op):
    """Record the kernels' calls (where visattn.kernels would hand them out): "heads" for ``op``,
    "attention" for the attention op (routed_kernel_dense's, and routed_kernel's shared heads where the
    fused attention runs), "proj" for the grouped output projection (routed_kernel_grouped's in bf16)."""
    calls = []
    real = kernels.moh_routed_heads_op
    monkeypatch.setattr(routed_kernel, "moh_routed_heads_op",
                        lambda dtype, blas=True: real(dtype, blas) and (lambda *a: calls.append("heads") or op(*a)))
    real_attention = kernels.moh_routed_attention_op

    def counted_attention(dtype, head_dim=None):
        attention = real_attention(dtype, head_dim)
        return attention and (lambda *a, **kw: calls.append("attention") or attention(*a, **kw))

    monkeypatch.setattr(routed_kernel, "moh_routed_attention_op", counted_attention)
    real_proj = kernels.moh_routed_proj_op

    def counted_proj(dtype, head_dim):
        proj = real_proj(dtype, head_dim)
        return proj and (lambda *a: calls.append("proj") or proj(*a))

    monkeypatch.setattr(routed_kernel, "moh_routed_proj_op", counted_proj)
    return calls


def _kernel_calls(path: str, m, x: torch.Tensor) -> list[str]:
    """The kernel calls ``PATHS[path](m, x)`` makes in float32 inference where the kernels run."""
    if path in ("routed_kernel_dense", "routed_kernel_grouped"):  # float32: no grouped projection
        return ["attention"]
    group = m.num_heads // m.num_kv_heads
    shared = m.router.shared_heads
    fused_shared = (path == "routed_kernel" and shared and shared % group == 0 and x.dtype == torch.float32
                    and torch.ops.visattn.moh_fused_attention(m.head_dim))
    return ["attention", "heads"] if fused_shared else ["heads"]


LAYERS = [  # (heads, shared, topk, kwargs)
    (8, 2, 3, {}),
    (8, 0, 4, {}),  # no shared heads: the output starts from the bias
    (8, 1, 7, {}),  # every routed head taken
    (5, 3, 1, {"qkv_bias": True}),
    (8, 2, 2, {"num_kv_heads": 2}),  # grouped keys and values
    (8, 2, 2, {"num_kv_heads": 1, "two_stage": False}),
    (4, 1, 2, {"proj_bias": False}),
    (8, 2, 3, {"qk_norm": True}),  # k_norm only reaches the kernel through k (q_norm is refused below)
    (8, 8, 0, {"qkv_bias": True}),  # dense: every head on with soft weights (the loops skip nothing)
]


HEAD_CHOICE = [(8, 2, 3, {"routing": "head_choice"}), (5, 1, 2, {"routing": "head_choice", "qkv_bias": True})]
KERNEL_PATHS = ["routed_kernel", "routed_kernel_loops", "masked_kernel_loops", "routed_kernel_dense",
                "routed_kernel_grouped"]


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("heads, shared, topk, kwargs", LAYERS + HEAD_CHOICE + [(8, 2, 2, {"router": "l2norm"})])
@pytest.mark.parametrize("B, N", [(3, 17), (1, 1), (2, 70)])  # 70 tokens: column blocks of 64 + a tail
def test_the_kernel_equals_the_masked_dense_path(kernel, monkeypatch, path, heads, shared, topk, kwargs, B, N):
    """Each kernel path against the masked dense path, and against its PyTorch fallback (the skipping
    paths: sparse_projections, for head choice head_gather; routed_kernel_dense: dense_projections). A
    dense layer (routed_topk=0) has only routed_kernel_loops: nothing to skip, the others would be the
    same computation."""
    m = _moh(dim=80, heads=heads, shared=shared, topk=topk, **kwargs)  # 80 wide: output blocks 64 + 16
    if routed_kernel.routed_kernel_supported(m) is not None or (path != "routed_kernel_loops" and topk == 0):
        assert path not in m.paths
        with pytest.raises(ValueError, match=path):
            m.impl = path
        return
    x = torch.randn(B, N, 80)
    calls = _counted(monkeypatch, kernel)
    with torch.no_grad():
        ref = m.dense_forward(x)
        out = PATHS[path](m, x)
        with kernels.disabled():
            fallback = PATHS[path](m, x)
    assert calls == _kernel_calls(path, m, x)
    tol = 1e-5 * ref.abs().max().item()  # float32 rounding of sums in another order
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=tol)
    torch.testing.assert_close(out, fallback, rtol=1e-5, atol=tol)


def test_every_head_in_the_kernel_falls_back_to_the_masked_dense_path(kernel, monkeypatch):
    """Where the kernel does not run (kernels off, bf16, a dispatch mode such as the FLOP counter),
    masked_kernel_loops is the masked dense path itself, so a FLOP count is the masked dense one."""
    m = _moh(impl="masked_kernel_loops")
    x = torch.randn(2, 9, 48)
    calls = _counted(monkeypatch, kernel)
    with torch.no_grad():
        with kernels.disabled():
            assert torch.equal(m(x), m.dense_forward(x))
        half = _moh(impl="masked_kernel_loops").to(torch.bfloat16)
        x_half = x.to(torch.bfloat16)
        assert torch.equal(half(x_half), half.dense_forward(x_half))
        assert calls == []
        assert count_flops(m, x) == count_flops(lambda: m.dense_forward(x)) > 0
        assert calls == [] and m.last_path == "masked_kernel_loops"
        m(x)
    assert calls == ["heads"]


def test_bfloat16_matches_the_masked_dense_path_to_bf16_rounding(kernel, monkeypatch):
    if kernels.moh_routed_heads_op(torch.bfloat16) is None:
        pytest.skip("this torch build exports no bf16 GEMM")
    m = _moh().to(torch.bfloat16)
    x = torch.randn(4, 33, 48, dtype=torch.bfloat16)
    calls = _counted(monkeypatch, kernels.moh_routed_heads_op(torch.bfloat16))
    with torch.no_grad():
        ref = m.dense_forward(x).float()
        out = PATHS["routed_kernel"](m, x)
        loops = PATHS["routed_kernel_loops"](m, x)  # float32 only: the PyTorch path
    assert out.dtype == loops.dtype == torch.bfloat16 and calls == ["heads"]  # bf16: the shared heads on SDPA
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    torch.testing.assert_close(loops, PATHS["sparse_projections"](m, x), rtol=0, atol=0)


@pytest.mark.parametrize("path", ["routed_kernel", "routed_kernel_loops"])
def test_one_matmul_gives_shared_queries_keys_values_and_router_logits_in_float32(kernel, monkeypatch, path):
    """The kernel paths read x once for the shared heads' queries (routed_kernel runs them in PyTorch),
    the keys and values, and the router's logits (its rows appended, padded to ``router_columns``); in
    bf16 the router keeps its own matmul and the outputs stay equal to the masked dense path."""
    m = _moh(qkv_bias=True)
    widths = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda a, w, b=None: widths.append(w.shape[0]) or real(a, w, b))
    x = torch.randn(3, 17, 48)
    with torch.no_grad():
        out = PATHS[path](m, x)
        widths_fp32, widths[:] = list(widths), []
        ref = m.dense_forward(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    shared_q = m.router.shared_heads * m.head_dim if path == "routed_kernel" else 0
    assert widths_fp32[0] == shared_q + 2 * m.kv_dim + m.router_columns
    assert m.router.logit_rows not in widths_fp32 and m.router_columns % 16 == 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        PATHS[path](m, x)
    assert m.router.logit_rows in widths  # bf16: the router's own matmul


def _fused_or_skip(fused: bool, d: int) -> None:
    """fused=True where the fused attention cannot run (a head width it does not serve) still runs: MKL's."""
    if fused and d % 16 == 0 and not torch.ops.visattn.moh_fused_attention(d):
        pytest.skip("no AVX-512 or AVX2 with FMA here: the fused attention (fused_attention.h) does not run on this CPU")


# (head width, tokens): 8 wide (MKL whatever `fused` says); 16 wide with 45 tokens, so heads of 16-32
# chosen queries (one tile of 32 lanes) and of 16 or fewer (one of 16), keys in blocks of 12 plus a tail;
# 64 wide with 70 tokens: several tiles, the width of ViT-S and DiT heads
HEAD_WIDTHS = [(8, 7), (16, 45), (64, 70)]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("d, N", HEAD_WIDTHS)
def test_heads_no_token_chose_and_tokens_of_any_count_against_the_formula(kernel, d, N, fused):
    """The op itself on a hand-made selection (not top-k: a token may have 0..E heads, a head 0..N
    tokens, one head none at all) against the MoH formula written out; the values come without their
    bias (``v_bias``), which the kernel adds to each head's output, and ``out`` without the output's
    (``out_bias``), which it adds to every row. ``fused``: the attention in fused_attention.h's loops
    (where this CPU runs them) or through MKL."""
    _fused_or_skip(fused, d)
    torch.manual_seed(1)
    B, H, S = 3, 4, 1
    C = H * d
    Co = C + 48  # output columns in blocks of 64, 32 and 16 (the fused path's row_gemm)
    x = torch.randn(B * N, C)
    qkv_w, qkv_b, proj_w = torch.randn(3 * C, C) / C**0.5, torch.randn(3 * C), torch.randn(Co, C) / C**0.5
    k, v = torch.randn(B, H, N, d), torch.randn(B, H, N, d)
    mask = torch.rand(H - S, B * N) < 0.4
    mask[1] = False  # routed head 2: chosen by no token
    gates = torch.rand(B * N, H)
    base = torch.randn(B * N, Co)
    v_bias, out_bias = torch.randn(H * d), torch.randn(Co)
    outs = {}
    for first_head, loops in ((S, False), (0, False), (0, True), (S, True)):
        outs[first_head, loops] = out = base.clone()
        kernel(x, qkv_w, qkv_b, proj_w, k, v - v_bias.view(H, 1, d), v_bias, mask.contiguous(), gates, S, first_head,
               loops, out, out_bias, fused)

    q = (x @ qkv_w[: H * d].t() + qkv_b[: H * d]).view(B, N, H, d).transpose(1, 2)
    heads = torch.softmax(q @ k.transpose(-1, -2) / d**0.5, -1) @ v  # [B, H, N, d]
    weights = torch.zeros(B * N, H)
    weights[:, S:] = gates[:, S:] * mask.t()
    routed = (heads.transpose(1, 2).reshape(B * N, H, d) * weights.unsqueeze(-1)).reshape(B * N, H * d)
    weights[:, :S] = gates[:, :S]  # first_head=0: the shared heads too, every token
    every = (heads.transpose(1, 2).reshape(B * N, H, d) * weights.unsqueeze(-1)).reshape(B * N, H * d)
    for (first_head, _), out in outs.items():
        expected = base + out_bias + (every if first_head == 0 else routed) @ proj_w.t()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("d, N", HEAD_WIDTHS)
def test_the_attention_op_against_the_formula(kernel, d, N, fused):
    """routed_kernel_dense's op on a hand-made selection (a head no token chose, grouped keys and values,
    queries read from wider rows, both biases): every column from first_head on is written, the gated
    output where a pair is on and 0 where it is off; the columns before it are left as they were. With
    ``fused`` the attention runs in fused_attention.h's loops where this CPU allows, else through MKL."""
    _fused_or_skip(fused, d)
    torch.manual_seed(2)
    B, H, Hkv, S = 3, 4, 2, 1
    T = B * N
    rows = torch.randn(T, H * d + 5)  # the queries in wider rows, as in the one matmul's output
    q = rows[:, : H * d]
    q_bias, v_bias = torch.randn(H * d), torch.randn(Hkv * d)
    k, v = torch.randn(B, Hkv, N, d), torch.randn(B, Hkv, N, d)
    mask = torch.rand(H - S, T) < 0.5
    mask[1] = False
    gates = torch.rand(T, H)
    queries = (q + q_bias).view(B, N, H, d).transpose(1, 2)
    keys, values = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v + v_bias.view(1, Hkv, 1, d)))
    heads = torch.softmax(queries @ keys.transpose(-1, -2) / d**0.5, -1) @ values  # [B, H, N, d]
    on = torch.cat([torch.ones(S, T, dtype=torch.bool), mask]).t()  # [T, H]
    expected = (heads.transpose(1, 2).reshape(T, H, d) * (gates * on).unsqueeze(-1)).reshape(T, H * d)
    op = kernels.moh_routed_attention_op(torch.float32)
    if op is None:
        pytest.skip("no MKL SGEMM in this torch build")
    for first_head in (2, 0):
        z = torch.full((T, H * d), float("nan"))
        op(q, q_bias, k, v, v_bias, mask, gates, S, first_head, z, fused)
        torch.testing.assert_close(z[:, first_head * d :], expected[:, first_head * d :], rtol=1e-5, atol=1e-5)
        assert z[:, : first_head * d].isnan().all()
    assert (z.view(T, H, d)[:, 2] == 0).all()  # routed head 1 (head 2): chosen by no token
    rows2 = rows.clone()  # z over the queries themselves, in their strided rows: the same outputs
    q2 = rows2[:, : H * d]
    op(q2, q_bias, k, v, v_bias, mask, gates, S, 0, q2, fused)
    assert torch.equal(q2, z) and torch.equal(rows2[:, H * d :], rows[:, H * d :])


def _cpu_has_fma_vectors() -> bool:
    """Whether this CPU has FMA and AVX2 (every x86 CPU with AVX-512 has both)."""
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    return "avx2" in flags and "fma" in flags


def test_the_fused_attention_runs_where_the_cpu_has_avx2_and_fma():
    """fused_attention.h serves heads 16, 32, 48 or 64 wide on a CPU with AVX-512, or AVX2 and FMA (its
    AVX2 loops, also under VISATTN_KERNELS_AVX2=1), else no head: the ops then take MKL's GEMMs (the tests
    above run both where both run)."""
    if kernels.moh_routing_op() is None:
        pytest.skip("no C++ toolchain: no kernels")
    fused = torch.ops.visattn.moh_fused_attention
    assert [fused(d) for d in (16, 32, 48, 64)] == [_cpu_has_fma_vectors()] * 4
    assert not any(fused(d) for d in (8, 12, 24, 72, 80, 128))


# Run with VISATTN_KERNELS_AVX2=1: every kernel path of a MoH layer against masked dense, in inference and
# (routed_kernel_loops) training; heads 12 wide over 17 tokens (exp_row's short rows, small_gemm's narrow
# blocks) and 64 wide over 70 tokens (rows past 64; the AVX2 loops of fused_attention.h).
AVX2_SCRIPT = """
import torch
import visattn.kernels as kernels
from visattn.attention import build_attention
from visattn.attention.moh import PATHS

assert kernels.moh_routing_op() is not None
assert torch.ops.visattn.moh_fused_attention(64) == FMA_VECTORS, "the AVX2 loops of fused_attention.h"
assert kernels.build_id().endswith("+avx2")
checked = []
for dim, heads, tokens in ((96, 8, 17), (128, 2, 70)):
    torch.manual_seed(0)
    dense = build_attention("moh", dim, num_heads=heads, shared_heads=1, routed_topk=max(1, heads // 2))
    with torch.no_grad():
        for p in dense.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x = torch.randn(3, tokens, dim)
    dense.eval()
    with torch.no_grad():
        ref = PATHS['masked_dense'](dense, x)
        for path in ("routed_kernel", "routed_kernel_loops", "routed_kernel_dense", "masked_kernel_loops"):
            tol = 1e-5 * ref.abs().max().item()  # float32 rounding of sums in another order
            torch.testing.assert_close(PATHS[path](dense, x), ref, rtol=1e-5, atol=tol, msg=path)
            checked.append(path)
    fast = build_attention("moh", dim, num_heads=heads, shared_heads=1, routed_topk=max(1, heads // 2))
    fast.load_state_dict(dense.state_dict())
    fast.train_path = "routed_kernel_loops"
    grads = []
    for layer in (dense.train(), fast.train()):
        xg = x.clone().requires_grad_()
        layer(xg).square().mean().backward()
        grads.append([xg.grad] + [p.grad for p in layer.parameters()])
    assert fast.last_path == "routed_kernel_loops"
    for a, b in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item())
print("checked", len(checked))
"""


def test_the_avx2_code_equals_masked_dense_on_any_cpu(kernel):
    """The kernels' code for CPUs without AVX-512 (eight-float exp_row and small_gemm, the AVX2 loops of
    fused_attention.h, MKL's projections in routed_kernel), forced with VISATTN_KERNELS_AVX2=1 in a fresh process (the choice
    is made once per process), so that an AVX-512 machine checks it too."""
    env = {**os.environ, kernels.AVX2_ONLY_ENV: "1"}
    script = f"FMA_VECTORS = {_cpu_has_fma_vectors()}\n" + AVX2_SCRIPT
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "checked 8" in done.stdout


def _amx_or_skip() -> None:
    if kernels.moh_routing_op() is None or not torch.ops.visattn.moh_amx_attention(64):
        pytest.skip("no AMX here: bfloat16 routed_kernel_dense is dense_projections on this CPU")


@pytest.mark.parametrize("N", [7, 45, 70])  # tiles of 16 queries and steps of 32 keys, with their tails
def test_the_attention_op_in_bfloat16_against_the_formula(kernel, N):
    """The attention op with bfloat16 q, k, v and z (AMX tiles; float32 gates and biases) on a hand-made
    selection, against the formula in float32: equal to bf16 rounding; 0 where a pair is off; the columns
    before first_head untouched."""
    _amx_or_skip()
    torch.manual_seed(3)
    B, H, Hkv, S, d = 3, 4, 2, 1, 64
    T = B * N
    rows = torch.randn(T, (H + 2 * Hkv) * d + 16).to(torch.bfloat16)  # q, k, v in wider rows, as a matmul gives
    q, k, v, _ = rows.split([H * d, Hkv * d, Hkv * d, 16], dim=-1)
    k, v = (t.view(B, N, Hkv, d).transpose(1, 2) for t in (k, v))
    q_bias, v_bias = torch.randn(H * d), torch.randn(Hkv * d)
    mask = torch.rand(H - S, T) < 0.5
    mask[1] = False
    gates = torch.rand(T, H)
    queries = (q.float() + q_bias).view(B, N, H, d).transpose(1, 2)
    keys, values = (t.float().repeat_interleave(H // Hkv, dim=1) for t in (k, v + v_bias.view(1, Hkv, 1, d)))
    heads = torch.softmax(queries @ keys.transpose(-1, -2) / d**0.5, -1) @ values
    on = torch.cat([torch.ones(S, T, dtype=torch.bool), mask]).t()
    expected = (heads.transpose(1, 2).reshape(T, H, d) * (gates * on).unsqueeze(-1)).reshape(T, H * d)
    op = kernels.moh_routed_attention_op(torch.bfloat16, d)
    for first_head in (2, 0):
        z = torch.full((T, H * d), float("nan"), dtype=torch.bfloat16)
        op(q, q_bias, k, v, v_bias, mask, gates, S, first_head, z)
        scale = expected.abs().max().item()
        torch.testing.assert_close(z[:, first_head * d :].float(), expected[:, first_head * d :], rtol=2e-2,
                                   atol=1e-2 * scale)
        assert z[:, : first_head * d].isnan().all()
    assert (z.view(T, H, d)[:, 2] == 0).all()  # routed head 1 (head 2): chosen by no token
    # without zero_off (routed_kernel_grouped, which reads no pair that is off) those pairs keep their values
    kept = torch.full((T, H * d), float("nan"), dtype=torch.bfloat16)
    op(q, q_bias, k, v, v_bias, mask, gates, S, 0, kept, zero_off=False)
    assert kept.view(T, H, d)[~on].isnan().all() and torch.equal(kept.view(T, H, d)[on], z.view(T, H, d)[on])
    # z over the queries themselves, in their strided rows (as routed_kernel_dense calls it): the same outputs
    rows2 = rows.clone()
    q2, k2, v2, _ = rows2.split([H * d, Hkv * d, Hkv * d, 16], dim=-1)
    k2, v2 = (t.view(B, N, Hkv, d).transpose(1, 2) for t in (k2, v2))
    op(q2, q_bias, k2, v2, v_bias, mask, gates, S, 0, q2)
    assert torch.equal(q2, z) and torch.equal(rows2[:, H * d :], rows[:, H * d :])
    assert not kernels.moh_routed_attention_op(torch.bfloat16, 32) and not kernels.moh_routed_attention_op(torch.bfloat16)


def test_the_bfloat16_attention_op_at_the_edges_of_its_softmax(kernel):
    """Scores far below 0 (keys opposed to the queries: no padded key's 0 may count as the maximum) and a
    NaN key (NaN for the heads that read it, in its image alone), with 45 keys: a tail in every step."""
    _amx_or_skip()
    torch.manual_seed(4)
    B, N, H, d = 2, 45, 2, 64
    T = B * N
    direction = torch.randn(d)
    q = (6 * direction).repeat(T, H)  # [T, H * d]: every query along `direction`
    k = (-6 * direction + 0.3 * torch.randn(B, 1, N, d)).to(torch.bfloat16)  # scores about -36 * |direction|^2 / 8
    v = torch.randn(B, 1, N, d).to(torch.bfloat16)
    q = q.to(torch.bfloat16)
    gates, no_routed = torch.rand(T, H), torch.zeros(0, T, dtype=torch.bool)
    keys, values = k.float().expand(B, H, N, d), v.float().expand(B, H, N, d)
    scores = q.float().view(B, N, H, d).transpose(1, 2) @ keys.transpose(-1, -2) / d**0.5
    assert scores.max() < -200  # exp(-200) underflows: shifted by 0 instead of the maximum, every sum would be 0
    heads = torch.softmax(scores, -1) @ values
    expected = (heads.transpose(1, 2) * gates.view(B, N, H, 1)).reshape(T, H * d)
    op = kernels.moh_routed_attention_op(torch.bfloat16, d)
    z = torch.empty(T, H * d, dtype=torch.bfloat16)
    op(q, None, k, v, None, no_routed, gates, H, 0, z)
    torch.testing.assert_close(z.float(), expected, rtol=2e-2, atol=1e-2 * expected.abs().max().item())
    k[1, 0, 30, 5] = float("nan")
    op(q, None, k, v, None, no_routed, gates, H, 0, z)
    assert z[N:].isnan().all() and z[:N].isfinite().all()


# (groups' sizes) -> blocks of 32 rows with tails of 1, 16, 17 and 31; a token no routed head chose
GROUP_SIZES = [(1, 16, 17, 33, 63, 0), (70,)]


@pytest.mark.parametrize("sizes", GROUP_SIZES)
@pytest.mark.parametrize("S", [0, 2])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_grouped_projection_op_against_the_formula(kernel, sizes, S, weight_dtype, bias):
    """moh_routed_proj on hand-made groups (tokens that chose the same routed heads; sizes that leave
    every tail of a 32-row block; most groups with more than 12 steps of 32 along K, so in two chunks; a
    group of no routed head, with S=0 of no head at all: its rows are the bias) against z @ W^T + b with the
    pairs that are off set to 0: their values in z are NaN, so reading one would show. A float32 weight is
    rounded to bf16 (as autocast's cast) and gives the bf16 weight's result exactly; 2 threads give 1
    thread's."""
    _amx_or_skip()
    torch.manual_seed(5)
    H, d, Co = S + 8, 64, 96  # 96 outputs: three blocks of 32 columns
    E = H - S
    choices = [torch.rand(E) < 0.8 for _ in sizes]
    choices[-1][:] = False  # the last group: no routed head
    mask = torch.cat([c.view(E, 1).expand(E, n) for c, n in zip(choices, sizes, strict=True)], dim=1)
    T = mask.shape[1]
    order = torch.randperm(T)  # the groups' tokens interleaved
    mask = mask[:, order].contiguous()
    rows = torch.randn(T, H * d + 32).to(torch.bfloat16)  # z in wider rows, as over the queries
    z = rows[:, : H * d]
    on = torch.cat([torch.ones(S, T, dtype=torch.bool), mask]).t()  # [T, H]
    z.view(T, H, d)[~on] = float("nan")
    weight = (torch.randn(Co, H * d) / (H * d) ** 0.5).to(weight_dtype)
    b = torch.randn(Co) if bias else None
    expected = torch.where(on.repeat_interleave(d, dim=1), z.float(), 0.0) @ weight.bfloat16().float().t()
    expected = expected + (b if bias else 0)
    op = kernels.moh_routed_proj_op(torch.bfloat16, d)
    out = op(z, mask, S, weight, b)
    assert out.dtype == torch.bfloat16 and out.shape == (T, Co)
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
    assert torch.equal(out, op(z, mask, S, weight.bfloat16(), b))
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(out, op(z, mask, S, weight, b))
    finally:
        torch.set_num_threads(previous)


def test_the_grouped_projection_op_refuses_what_it_cannot_serve(kernel):
    _amx_or_skip()
    op = kernels.moh_routed_proj_op(torch.bfloat16, 64)
    z, mask = torch.zeros(5, 4 * 64, dtype=torch.bfloat16), torch.zeros(3, 5, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(z, mask, 1, torch.zeros(48, 4 * 64), None)
    with pytest.raises(RuntimeError, match="heads 64 wide"):
        op(z, torch.zeros(7, 5, dtype=torch.bool), 1, torch.zeros(64, 4 * 64), None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        op(z.float(), mask, 1, torch.zeros(64, 4 * 64), None)
    assert kernels.moh_routed_proj_op(torch.float32, 64) is None and kernels.moh_routed_proj_op(torch.bfloat16, 32) is None


def test_routed_kernel_grouped_is_routed_kernel_dense_where_its_projection_cannot_run(kernel, monkeypatch):
    """Float32, or output rows not a multiple of 32 wide: the grouped path is routed_kernel_dense, and
    auto does not time it twice (kernel_path_runs says no)."""
    m = _moh(dim=256, heads=4, shared=1, topk=2)
    x = torch.randn(2, 9, 256)
    calls = _counted(monkeypatch, kernel)
    with torch.no_grad():
        assert torch.equal(PATHS["routed_kernel_grouped"](m, x), PATHS["routed_kernel_dense"](m, x))
        assert not routed_kernel.kernel_path_runs(m, x, "routed_kernel_grouped")
        odd = _moh(dim=256, heads=4, shared=1, topk=2, dim_out=72)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not routed_kernel.kernel_path_runs(odd, x, "routed_kernel_grouped")
            assert torch.equal(PATHS["routed_kernel_grouped"](odd, x), PATHS["routed_kernel_dense"](odd, x))
    assert "proj" not in calls


def test_amx_attention_runs_where_the_cpu_has_amx_bf16():
    if kernels.moh_routing_op() is None:
        pytest.skip("no C++ toolchain: no kernels")
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    amx = {"amx_bf16", "amx_tile", "avx512_bf16", "avx512f"} <= set(flags)
    # a CPU with the flags may still be refused the tile state by its kernel: then False, never True without
    assert torch.ops.visattn.moh_amx_attention(64) in ((True, False) if amx else (False,))
    assert not any(torch.ops.visattn.moh_amx_attention(d) for d in (16, 32, 72, 128))


def test_routed_kernel_dense_leaves_the_weights_casts_to_autocast(kernel):
    """Under autocast the bf16 path hands qkv's and proj's float32 parameters to F.linear, whose casts
    autocast keeps for the rest of its region (as for nn.Linear in ``mha``): a second call in the same
    region casts no weight. Cast per call, they had cost it 1.75 ms a DiT-B/2 layer (12th session)."""
    _amx_or_skip()
    m = _moh(dim=256, heads=4, shared=1, topk=2, qkv_bias=True)
    x = torch.randn(2, 70, 256)
    weights = {tuple(p.shape) for p in (m.qkv.weight, m.proj.weight)}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        first = PATHS["routed_kernel_dense"](m, x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            second = PATHS["routed_kernel_dense"](m, x)
    casts = [e.input_shapes[0] for e in prof.events() if e.name == "aten::_to_copy"]
    assert casts and not any(tuple(shape) in weights for shape in casts)  # x is still cast, no weight is
    assert torch.equal(first, second)


@pytest.mark.parametrize("path", ["routed_kernel_dense", "routed_kernel_grouped"])
@pytest.mark.parametrize("bf16_model", [False, True])  # autocast over a float32 model, or a bf16 model
@pytest.mark.parametrize("kwargs", [{"qkv_bias": True}, {"qkv_bias": True, "num_kv_heads": 2},
                                    {"routing": "head_choice"}, {"proj_bias": False}])
def test_the_amx_paths_in_bfloat16_match_the_masked_dense_path(kernel, monkeypatch, kwargs, bf16_model, path):
    """routed_kernel_dense in bf16 (AMX attention) and routed_kernel_grouped (and the grouped output
    projection) against the float32 masked dense path, as close as the bf16 masked dense path is."""
    _amx_or_skip()
    m = _moh(dim=256, heads=4, shared=1, topk=2, **kwargs)
    m_scale = 0.1  # _moh's router noise would make the layer's logits large for bf16
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(m_scale)
    x = torch.randn(2, 70, 256)
    calls = _counted(monkeypatch, kernel)
    with torch.no_grad():
        ref = m.dense_forward(x)
        if bf16_model:
            half = m.to(torch.bfloat16)
            out, masked = PATHS[path](half, x.bfloat16()), half.dense_forward(x.bfloat16())
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out, masked = PATHS[path](m, x), m.dense_forward(x)
    assert calls == (["attention", "proj"] if path == "routed_kernel_grouped" else ["attention"])
    assert out.dtype == torch.bfloat16
    scale = ref.abs().max().item()
    bf16_error = (masked.float() - ref).abs().max().item()
    assert (out.float() - ref).abs().max().item() <= 2 * bf16_error + 1e-3 * scale


@pytest.mark.parametrize("path", ["routed_kernel", "routed_kernel_dense"])
@pytest.mark.parametrize("heads, shared, topk, kwargs", [
    (4, 1, 2, {"qkv_bias": True}),
    (4, 1, 2, {"qkv_bias": True, "num_kv_heads": 2}),
    (4, 1, 2, {"routing": "head_choice"}),
    (4, 1, 2, {"dim_out": 72}),  # output rows not in whole registers: MKL's projections
])
@pytest.mark.parametrize("dim", [64, 256])  # heads 16 and 64 wide: the fused attention's widths
def test_layers_with_the_fused_attention_s_widths_equal_the_masked_dense_path(
        kernel, monkeypatch, path, heads, shared, topk, kwargs, dim):
    """The MKL paths at head widths the fused attention serves (where this CPU runs it, it does: for
    routed_kernel's shared heads too), over several tiles of queries and a tail of keys, against the
    masked dense path."""
    m = _moh(dim=dim, heads=heads, shared=shared, topk=topk, **kwargs)
    x = torch.randn(2, 70, dim)
    calls = _counted(monkeypatch, kernel)
    with torch.no_grad():
        ref = m.dense_forward(x)
        out = PATHS[path](m, x)
    assert calls == _kernel_calls(path, m, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("dim", [48, 64])  # 64: 16-wide heads, the fused attention's where it runs
def test_nan_in_one_image_stays_in_that_image(kernel, path, dim):
    m = _moh(dim=dim, heads=4, shared=1, topk=2)
    x = torch.randn(3, 9, dim)
    x[1, 4] = float("nan")
    with torch.no_grad():
        ref = m.dense_forward(x)
        out = PATHS[path](m, x)
    assert torch.equal(out.isnan(), ref.isnan()) and out[1].isnan().any() and out[[0, 2]].isfinite().all()


@pytest.mark.parametrize("threads", [1, 2])  # 2: images split over threads, weight gradients summed
@pytest.mark.parametrize("heads, shared, topk, kwargs", LAYERS + HEAD_CHOICE)
@pytest.mark.parametrize("path", ["routed_kernel_loops", "masked_kernel_loops"])
def test_the_loops_gradients_equal_the_masked_dense_path_s(kernel, monkeypatch, path, heads, shared, topk, kwargs,
                                                           threads):
    """The loops paths in training: the kernel's forward and compiled backward, against autograd
    through the masked dense path (every parameter, the input; the load-balancing loss included)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_loops_gradients(kernel, monkeypatch, path, heads, shared, topk, kwargs)
    finally:
        torch.set_num_threads(previous)


def _check_loops_gradients(kernel, monkeypatch, path, heads, shared, topk, kwargs):
    m = _moh(dim=80, heads=heads, shared=shared, topk=topk, **kwargs).train()
    if path not in m.paths:
        return
    x = torch.randn(3, 21, 80)
    weight = torch.randn(3, 21, 80)
    calls = _counted(monkeypatch, kernel)
    grads = {}
    for name in ("masked_dense", path):
        m.zero_grad()
        x_path = x.clone().requires_grad_()
        out = PATHS[name](m, x_path)
        aux = m.router.aux_loss  # None for a dense layer: nothing routed to balance
        ((out * weight).sum() + (aux if aux is not None else 0)).backward()
        grads[name] = {"out": out.detach(), "x": x_path.grad, **{n: p.grad for n, p in m.named_parameters()}}
    assert calls == ["heads"]
    reference, loops = grads["masked_dense"], grads[path]
    assert reference.keys() == loops.keys()
    for name, value in reference.items():
        if value is None:
            assert loops[name] is None, name
            continue
        # float32 sums in another order; a gradient that is 0 in exact arithmetic (the routed router's
        # with one routed head per token: renormalised gates are constant) is rounding on both sides
        scale = max(value.abs().max().item(), reference["x"].abs().max().item() * 1e-3)
        torch.testing.assert_close(loops[name], value, rtol=1e-4, atol=2e-5 * scale, msg=name)


def test_gradients_dropout_and_the_kernels_off_take_the_pytorch_path(kernel, monkeypatch):
    """Where the kernel has no backward (routed_kernel, routed_kernel_dense) or no dropout, the fallback
    is sparse_projections (dense_projections) itself, whose gradients tests/test_sparse_moh.py holds equal
    to the masked dense path's."""
    m = _moh(attn_drop=0.1)
    x = torch.randn(2, 9, 48, requires_grad=True)
    calls = _counted(monkeypatch, kernel)
    out = PATHS["routed_kernel"](m, x)  # gradients wanted: not the kernel
    assert out.requires_grad and torch.equal(out, PATHS["sparse_projections"](m, x))
    assert torch.equal(PATHS["routed_kernel_dense"](m, x), PATHS["dense_projections"](m, x))  # nor this one's
    out.square().sum().backward()
    assert x.grad is not None and m.qkv.weight.grad is not None
    with torch.no_grad():
        m.train()
        PATHS["routed_kernel_loops"](m, x)  # attention dropout in training: not in the kernel
        m.eval()
        with kernels.disabled():
            PATHS["routed_kernel"](m, x)
        assert calls == []
        PATHS["routed_kernel"](m, x)
    assert calls == ["heads"]  # 48 wide, 8 heads: 6-wide heads, the shared ones on SDPA


def test_flop_counting_sees_the_pytorch_equivalent(kernel, monkeypatch):
    """Inside a dispatch mode (the FLOP counter) the path runs its PyTorch equivalent, so the executed
    FLOPs count the routed pairs' work instead of losing it inside the compiled op."""
    m = _moh(impl="routed_kernel")
    x = torch.randn(2, 9, 48)
    calls = _counted(monkeypatch, kernel)
    counted = count_flops(m, x)
    assert calls == [] and m.last_path == "routed_kernel"
    with torch.no_grad():
        assert counted == count_flops(lambda: PATHS["sparse_projections"](m, x)) > 0


def test_impl_sparse_prefers_the_kernel_and_the_path_list_names_it_where_it_applies():
    assert _moh(impl="sparse").fixed_path == "routed_kernel_loops"  # few tokens per routed head, small heads
    assert _moh(dim=384, heads=6, shared=1, topk=2, impl="sparse").fixed_path == "routed_kernel"  # ViT-S
    assert _moh(topk=5, impl="sparse").fixed_path == "routed_kernel_dense"  # most of the pool per token
    assert {"routed_kernel", "routed_kernel_loops"} <= set(_moh().paths)
    assert {"routed_kernel", "routed_kernel_loops", "head_gather"} <= set(_moh(routing="head_choice").paths)
    assert _moh(routing="head_choice", impl="sparse").fixed_path == "head_gather"
    m = _moh(router="l2norm")
    assert not any("kernel" in path for path in m.paths)
    assert "l2norm" in routed_kernel.routed_kernel_supported(m)
    with pytest.raises(ValueError, match="impl='routed_kernel' is not available"):
        _moh(router="l2norm", impl="routed_kernel")


def test_without_mkl_gemms_only_the_loops_run(kernel, monkeypatch):
    """A torch build without MKL's GEMMs (e.g. aarch64): routed_kernel is sparse_projections, the loops
    still run, and auto probes only the loops."""
    monkeypatch.setattr(kernels, "_has_blas", lambda dtype: False)
    m = _moh()
    x = torch.randn(2, 9, 48)
    with torch.no_grad():
        assert routed_kernel.kernel_runs(m, x, loops=True) and not routed_kernel.kernel_runs(m, x)
        assert torch.equal(PATHS["routed_kernel"](m, x), PATHS["sparse_projections"](m, x))
        torch.testing.assert_close(PATHS["routed_kernel_loops"](m, x), m.dense_forward(x), rtol=1e-5, atol=1e-5)
        m.impl = "auto"
        m(x)
    assert set(m.path_log["[2, 9, 48] float32"].times_ms) == {
        "masked_dense", "dense_projections", "sparse_projections", "routed_kernel_loops", "masked_kernel_loops"
    }
