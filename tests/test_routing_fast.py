"""The head-major router, the router columns fused into the qkv matmul and in-place gating equal the
straightforward token-major math they replace (MoH's released formulation: softmax and top-k per
token over its heads, renormalised gates, two-stage weights): gates, selection, head load,
load-balancing loss and every gradient, to float rounding."""

import unittest.mock

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import visattn
from visattn.attention.routing import head_choice_selection, rank_constants, top_k_mask


def reference_route(router, x, q=None):
    """The token-major formulation ([B, N, heads] throughout): (gates, selected, aux loss)."""
    B, N, _ = x.shape
    S, E, k = router.shared_heads, router.pool, router.routed_topk
    binary = router.gate_mode == "binary_ste"
    aux = None
    if S == 0:
        shared = x.new_zeros(B, N, 0)
    elif router.shared is None:
        shared = x.new_ones(B, N, S)
    else:
        shared = F.softmax(router.shared(x).float(), dim=-1) * S
        if binary:
            shared = 1.0 + (shared - shared.detach())
    if k == 0:
        return shared, torch.ones(B, N, S, dtype=torch.bool), aux
    if router.routed is not None:
        scores = router.routed(x).float()
    else:
        scores = torch.linalg.vector_norm(q[:, S:].float(), dim=-1).transpose(1, 2)
    probs = F.softmax(scores, dim=-1)
    if router.routing == "head_choice":
        selected = head_choice_selection(probs.transpose(1, 2), k, E).transpose(1, 2)  # rows: one head, one image
        routed = selected.float() + (probs - probs.detach()) if binary else probs * selected * E
    else:
        _, top = probs.topk(k, dim=-1)
        selected = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, top, True)
        if router.training and router.routed is not None:
            aux = (selected.float().mean(dim=(0, 1)) * probs.mean(dim=(0, 1))).sum() * E
        if binary:
            routed = selected.float() + (probs - probs.detach())
        else:
            kept = probs * selected
            routed = kept / kept.sum(-1, keepdim=True).clamp_min(router.eps) * k
    if router.mix is not None:
        alpha = F.softmax(router.mix(x).float(), dim=-1) * 2
        shared, routed = shared * alpha[..., :1], routed * alpha[..., 1:]
    always = torch.ones(B, N, S, dtype=torch.bool)
    return torch.cat([shared, routed], -1), torch.cat([always, selected], -1), aux


ROUTERS = [
    {"shared_heads": 2, "routed_topk": 1},  # two-stage, soft (the study's default)
    {"shared_heads": 3, "routed_topk": 2},
    {"shared_heads": 1, "routed_topk": 2},  # one shared head: weighted by alpha only
    {"shared_heads": 0, "routed_topk": 3},  # no shared heads, no two-stage
    {"shared_heads": 2, "routed_topk": 2, "two_stage": False},
    {"shared_heads": 2, "routed_topk": 6},  # the whole pool routed
    {"shared_heads": 8, "routed_topk": 0},  # dense: soft weights over every head
    {"shared_heads": 2, "routed_topk": 3, "gate": "binary_ste"},
    {"shared_heads": 2, "routed_topk": 2, "router": "l2norm", "gate": "binary_ste"},
    {"shared_heads": 2, "routed_topk": 3, "routing": "head_choice"},
]


@pytest.mark.parametrize("kwargs", ROUTERS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_router_equals_the_token_major_formulation(kwargs, train):
    torch.manual_seed(0)
    attn = visattn.build_attention("moh", 32, 8, **kwargs).train(train)
    x = torch.randn(3, 7, 32, requires_grad=True)
    q = attn.project_qkv(x)[0]
    gates, selected = attn.router(x, q)
    ref_gates, ref_selected, ref_aux = reference_route(attn.router, x, q)
    torch.testing.assert_close(gates, ref_gates, rtol=1e-6, atol=1e-6)
    assert torch.equal(selected, ref_selected)
    assert gates.is_contiguous() and gates.dtype == torch.float32
    torch.testing.assert_close(attn.router.head_load, ref_selected.float().mean(dim=1))
    if ref_aux is not None:
        torch.testing.assert_close(attn.router.aux_loss, ref_aux)
    weight = torch.randn_like(gates)
    loss = (gates * weight).sum() + (attn.router.aux_loss if train and ref_aux is not None else 0)
    ref_loss = (ref_gates * weight).sum() + (ref_aux if ref_aux is not None else 0)
    params = [x, *attn.parameters()]
    grads = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
    ref_grads = torch.autograd.grad(ref_loss, params, allow_unused=True)
    for grad, ref in zip(grads, ref_grads, strict=True):
        if ref is None:
            assert grad is None or not grad.any()
        else:
            torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6)


def test_gates_alone_leave_the_selection_out():
    attn = visattn.build_attention("moh", 32, 8, shared_heads=2, routed_topk=2)
    x = torch.randn(2, 5, 32)
    gates, selected = attn.router(x, None, selection=False)
    assert selected is None
    torch.testing.assert_close(gates, attn.router(x, None)[0])


def _top_k(probs, k):
    return top_k_mask(probs, *rank_constants(probs.shape[0], k))


@pytest.mark.parametrize("pool, k", [(6, 1), (6, 2), (5, 2), (4, 3), (8, 5), (2, 1)])
def test_top_k_mask_picks_what_topk_picks(pool, k):
    probs = torch.randn(pool, 400).softmax(0)
    mask = _top_k(probs, k)
    expected = torch.zeros_like(probs).scatter_(0, probs.topk(k, 0).indices, 1.0)
    assert torch.equal(mask, expected)


def test_top_k_mask_breaks_ties_towards_the_lower_index_and_keeps_exactly_k():
    probs = torch.tensor([[0.25, 0.5, 0.1], [0.25, 0.2, 0.1], [0.25, 0.2, 0.4], [0.25, 0.1, 0.4]])  # [E=4, T=3]
    assert _top_k(probs, 2).t().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1]]
    probs = torch.tensor([[0.0], [1.0], [0.0], [0.0]])  # a saturated softmax: differences of exactly 1
    assert _top_k(probs, 3).flatten().tolist() == [1, 1, 1, 0]
    nan = torch.full((5, 2), float("nan"))
    assert (_top_k(torch.nan_to_num(nan, nan=2.0), 2).sum(0) == 2).all()


def test_ranking_constants_stay_out_of_the_state_dict_and_follow_the_model():
    attn = visattn.build_attention("moh", 32, 8, shared_heads=2, routed_topk=2)
    assert not any("rank_" in key for key in attn.state_dict())
    assert attn.router.rank_weight.shape == (6, 15) and attn.router.rank_pairs.shape == (30,)
    half = attn.to(torch.bfloat16)  # constants of 0, +-1 and small counts survive any float dtype
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    gates, selected = half.router(x, None)
    assert (selected[..., 2:].sum(-1) == 2).all() and torch.isfinite(gates).all()


@pytest.mark.parametrize("qkv_bias", [True, False])
@pytest.mark.parametrize("kwargs", [{"shared_heads": 2, "routed_topk": 2}, {"shared_heads": 1, "routed_topk": 3},
                                    {"shared_heads": 8, "routed_topk": 0}])
def test_router_columns_in_the_qkv_matmul_equal_separate_matmuls(kwargs, qkv_bias):
    """Training's fused projection (router rows appended to qkv's weight) against the separate
    matmuls, in outputs, load-balancing loss and every gradient; the state dict is unchanged."""
    torch.manual_seed(0)
    fused = visattn.build_attention("moh", 32, 8, qkv_bias=qkv_bias, **kwargs).train()
    assert fused.router_columns % 16 == 0 and fused.router_columns >= fused.router.logit_rows
    separate = visattn.build_attention("moh", 32, 8, qkv_bias=qkv_bias, **kwargs).train()
    separate.load_state_dict(fused.state_dict())
    separate.router_columns = 0
    assert list(fused.state_dict()) == list(separate.state_dict())
    x = torch.randn(3, 9, 32)
    outs = []
    for attn in (fused, separate):
        out = attn(x)
        aux = attn.aux_loss if attn.aux_loss is not None else out.new_zeros(())
        (out.square().mean() + 0.01 * aux).backward()
        outs.append((out, aux))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[0][1], outs[1][1])
    for (name, a), b in zip(fused.named_parameters(), separate.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_eval_under_autocast_casts_x_once_for_qkv_and_the_router():
    """Without gradients, under autocast, x is cast once for the qkv and the router's matmuls (each
    would cast it again), and the router's logits do not come from the qkv matmul (extra columns
    misalign its rows): the same outputs as with a layer without the fused columns."""
    torch.manual_seed(0)
    layer = visattn.build_attention("moh", 32, 8, shared_heads=2, routed_topk=2, impl="dense").eval()
    separate = visattn.build_attention("moh", 32, 8, shared_heads=2, routed_topk=2, impl="dense").eval()
    separate.load_state_dict(layer.state_dict())
    separate.router_columns = 0

    class CastsOfX(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.casts = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].numel() == x.numel():  # x or a view of it
                self.casts += args[0].dtype == torch.float32
            return func(*args, **(kwargs or {}))

    widths = []
    real = torch.nn.functional.linear
    x = torch.randn(3, 9, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = separate(x)
        with CastsOfX() as separate_casts:
            separate(x)
        with unittest.mock.patch("torch.nn.functional.linear", lambda a, w, b=None: widths.append(w.shape[0]) or real(a, w, b)):
            with CastsOfX() as casts:
                out = layer(x)
    assert separate_casts.casts == 2 and casts.casts == 1
    # the router first (it reads x before the qkv matmul does: base.dense_forward), qkv, the output projection
    assert widths == [layer.router.logit_rows, 3 * 32, 32]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_variants_with_their_own_projection_keep_the_routers_matmul():
    uneven = visattn.build_attention("uneven", 64, 8, head_dims=[4, 4, 8, 8, 8, 8, 12, 12], shared_heads=2, routed_topk=3)
    assert uneven.router_columns == 0
    l2 = visattn.build_attention("moh", 32, 8, shared_heads=2, routed_topk=2, router="l2norm", gate="binary_ste",
                                 two_stage=False)
    assert l2.router_columns == 0  # no linear router: nothing to fuse


@pytest.mark.parametrize("name", ["moh", "cosine", "relu"])
def test_gating_in_place_without_gradients_equals_gating_with_them(name):
    torch.manual_seed(0)
    kwargs = {"shared_heads": 2, "routed_topk": 2} if name != "cosine" else {"shared_heads": 2, "routed_topk": 2,
                                                                            "position_bias": False}
    attn = visattn.build_attention(name, 32, 8, **kwargs).eval()
    if hasattr(attn, "impl"):
        attn.impl = "dense"
    x = torch.randn(2, 7, 32)
    with_grad = attn(x)
    with torch.no_grad():
        without = attn(x)
    with torch.inference_mode():
        inference = attn(x)
    torch.testing.assert_close(without, with_grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(inference, with_grad, rtol=1e-6, atol=1e-6)
