"""Head-choice MoH routing: each routed head takes a fixed share of each image's tokens.

The module is checked against a reference written here from the formulas (routing.py's docstring):
P = softmax(W_r x_t) over the routed pool; head i keeps the c = round(N k / E) tokens of each image
with the highest P_i; a kept pair weighs alpha2 * P_i * E; shared heads weigh alpha1 *
softmax(W_s x_t) * h_s; the output is proj(concat_h(g_h * head_h))."""

import math

import pytest
import torch
from omegaconf import OmegaConf

import visattn
from visattn import build_attention
from visattn.attention import parse_attn_spec
from visattn.attention.moh import PATHS
from visattn.attention.routing import head_capacity


def _hc(dim=24, heads=6, shared=2, topk=2, seed=0, **kwargs):
    torch.manual_seed(seed)
    m = build_attention(
        "moh_head_choice", dim, num_heads=heads, shared_heads=shared, routed_topk=topk, **kwargs
    )
    with torch.no_grad():  # off the initialisation: spread router scores so choices differ per head
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m


def _reference(m, x):
    """x: [B, N, C] -> [B, N, C] by the formulas in this file's docstring (linear router, soft gates)."""
    B, N, C = x.shape
    H, d, hs = m.num_heads, m.head_dim, m.router.shared_heads
    E, k = H - hs, m.router.routed_topk
    q, kk, v = (
        (x @ m.qkv.weight.T + (m.qkv.bias if m.qkv.bias is not None else 0)).view(B, N, 3, H, d).unbind(2)
    )
    q, kk, v = (t.transpose(1, 2) for t in (q, kk, v))  # [B, H, N, d]
    att = torch.softmax(q @ kk.transpose(-1, -2) / math.sqrt(d), dim=-1) @ v  # [B, H, N, d]
    P = torch.softmax(x @ m.router.routed.weight.T, dim=-1)  # [B, N, E]
    c = max(1, min(N, math.floor(N * k / E + 0.5)))
    keep = torch.zeros_like(P)
    for b in range(B):
        for i in range(E):
            keep[b, P[b, :, i].argsort(descending=True)[:c], i] = 1
    alpha = torch.softmax(x @ m.router.mix.weight.T, dim=-1) * 2
    shared_w = torch.softmax(x @ m.router.shared.weight.T, dim=-1) * hs
    gates = torch.cat([alpha[..., :1] * shared_w, alpha[..., 1:] * P * E * keep], dim=-1)  # [B, N, H]
    heads = att * gates.transpose(1, 2).unsqueeze(-1)
    return m.proj(heads.transpose(1, 2).reshape(B, N, H * d))


@pytest.mark.parametrize(("B", "N"), [(3, 11), (1, 1), (2, 7), (4, 2)])
def test_output_equals_the_formula_reference_in_training_and_in_every_eval_path(B, N):
    m = _hc(qkv_bias=True).double()
    x = torch.randn(B, N, 24, dtype=torch.float64)
    ref = _reference(m, x)
    tol = {"rtol": 1e-5, "atol": 1e-6}  # the router's gates are float32 by design (routing.py)
    torch.testing.assert_close(m.train()(x), ref, **tol)  # the training (dense) path
    m.eval()
    with torch.no_grad():
        for path in m.paths:
            torch.testing.assert_close(PATHS[path](m, x), ref, **tol, msg=path)


def test_every_routed_head_takes_the_same_share_of_each_image():
    m = _hc(dim=32, heads=8, shared=2, topk=2).eval()
    x = torch.randn(5, 13, 32)
    gates, selected = m.router(x)
    c = head_capacity(13, 2, 6)
    assert c == 4  # round(13 * 2 / 6) = round(4.33)
    assert (selected[..., 2:].sum(dim=1) == c).all()  # [B, E]: c tokens per image and head
    assert selected[..., :2].all()  # shared heads on for every token
    assert ((gates != 0) == selected).all()
    per_token = selected.sum(-1).float()
    assert per_token.min() < per_token.max()  # tokens get different numbers of heads
    torch.testing.assert_close(per_token.mean(), torch.tensor(2 + 6 * c / 13))


def test_head_capacity_rounds_and_stays_in_range():
    assert [head_capacity(n, 1, 4) for n in (1, 2, 3, 6, 197)] == [1, 1, 1, 2, 49]  # 6/4 = 1.5 -> 2
    assert head_capacity(5, 3, 3) == 5 and head_capacity(0, 1, 2) == 0


def test_choices_are_per_image():
    m = _hc().eval()
    x = torch.randn(2, 9, 24)
    with torch.no_grad():
        before = m(x)[0]
        x[1] = torch.randn(9, 24) * 10  # another image cannot take or free a head's slots in image 0
        torch.testing.assert_close(m(x)[0], before)


def test_it_trains_gradients_reach_the_router_and_there_is_no_balancing_loss():
    m = _hc().train()
    x = torch.randn(2, 9, 24)
    m(x).square().mean().backward()
    for name in ("routed", "mix", "shared"):
        grad = getattr(m.router, name).weight.grad
        assert grad is not None and grad.abs().sum() > 0, name
    assert m.aux_loss is None  # balanced by construction
    assert float(visattn.aux_loss(torch.nn.Sequential(m))) == 0.0


@pytest.mark.parametrize("path", ["head_gather", "head_gather_dense_out", "dense_projections"])
def test_fast_path_gradients_equal_the_masked_paths(path):
    m = _hc(qkv_bias=True).double().train()
    x = torch.randn(2, 7, 24, dtype=torch.float64, requires_grad=True)
    grads = {}
    for name in ("masked_dense", path):
        m.zero_grad()
        x.grad = None
        PATHS[name](m, x).square().sum().backward()
        grads[name] = [x.grad.clone()] + [p.grad.clone() for p in m.parameters() if p.grad is not None]
    for a, b in zip(grads["masked_dense"], grads[path], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_kv_heads": 2},
        {"qk_norm": True},
        {"head_dim": 5},  # inner width 30 != dim 24
        {"dim_out": 10, "proj_bias": False},
        {"shared": 0, "topk": 3},
        {"gate": "binary_ste", "two_stage": False},
        {"router": "l2norm", "two_stage": False},
    ],
)
def test_paths_equal_masked_dense_with_options(kwargs):
    m = _hc(**kwargs).eval()
    x = torch.randn(3, 10, 24)
    with torch.no_grad():
        ref = m.dense_forward(x)
        for path in m.paths:
            torch.testing.assert_close(PATHS[path](m, x), ref, rtol=1e-5, atol=1e-5, msg=path)
    if kwargs.get("router") == "l2norm":
        assert "head_gather" not in m.paths  # the router reads every head's query: nothing to skip


def test_bf16_autocast_paths_close_to_masked_dense():
    m = _hc(dim=32, heads=8).eval()
    x = torch.randn(2, 16, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = m.dense_forward(x)
        for path in m.paths:
            out = PATHS[path](m, x)
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(out.float(), ref.float(), rtol=0.05, atol=0.05, msg=path)


def test_selected_by_name_spec_and_config():
    assert "moh_head_choice" in visattn.list_attentions()
    name, kwargs = parse_attn_spec(
        {"name": "moh", "routing": "head_choice", "shared_heads": 2, "routed_topk": 2}
    )
    assert build_attention(name, 32, num_heads=8, **kwargs).router.routing == "head_choice"
    conf = OmegaConf.load("conf/attn/moh_head_choice.yaml")
    name, kwargs = parse_attn_spec(conf)
    m = build_attention(name, 32, num_heads=8, **kwargs)
    assert m.router.routing == "head_choice" and m.active_heads == (6, 8)  # MoH's default budget


def test_bad_routing_values_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"routing='expert'.*token_choice"):
        build_attention("moh", 32, num_heads=4, routing="expert")
    with pytest.raises(ValueError, match="routing='head_choice' was given without routed_topk"):
        build_attention("mha", 32, num_heads=4, routing="head_choice")
    with pytest.raises(ValueError, match="impl='sparse_projections' is not available"):
        build_attention("moh_head_choice", 32, num_heads=4, impl="sparse_projections")


def test_head_choice_scripts_and_traces_like_the_dense_path():
    m = _hc().eval()
    x = torch.randn(2, 9, 24)
    with torch.no_grad():
        ref = m.dense_forward(x)
        torch.testing.assert_close(torch.jit.script(m)(x), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.fx.symbolic_trace(m)(x), ref, rtol=1e-5, atol=1e-5)
