"""The seed variants: ReLU, Multi-Token Attention, cosine attention, uneven and adaptive head widths."""

import math

import pytest
import timm
import torch
import torch.nn.functional as F

import visattn
from visattn.attention import expand_per_layer, get_attention_class
from visattn.attention.cosine import ContinuousPositionBias, log_spaced_relative_coords

torch.set_grad_enabled(True)

VARIANTS = ("relu", "mta", "cosine", "uneven", "adaptive")


def _x(b=2, n=7, c=32, seed=0):
    return torch.randn(b, n, c, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _perturb(module, std=0.3):
    """Move every parameter off its initialisation (identity kernels included)."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * std)
    return module


def _configured(cls, **fixed):
    """``cls`` with extra constructor defaults, for timm's ``attn_layer`` (which must be a class)."""

    class Configured(cls):
        def __init__(self, dim, **kwargs):
            super().__init__(dim, **{**fixed, **kwargs})

    return Configured


def _manual_heads(q, k, v, weights_fn):
    """Reference per-head attention with explicit weights [B, H, N, M] from weights_fn(scores)."""
    return weights_fn(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])) @ v


# --- shapes and gradients ---


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("shape", [(1, 1), (1, 5), (2, 7)])
def test_forward_backward_on_odd_shapes(name, shape):
    b, n = shape
    m = visattn.build_attention(name, 32, 4)
    x = _x(b, n).requires_grad_()
    y = m(x)
    assert y.shape == (b, n, 32) and torch.isfinite(y).all()
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert torch.isfinite(m.qkv.weight.grad).all()


# --- mta ---


@pytest.mark.parametrize(
    "kw",
    [{}, {"kq_conv": "pre", "head_conv": "pre"}, {"kq_conv": "post", "head_conv": "post"},
     {"kq_conv": "post", "head_conv": "pre", "q_kernel": 2, "k_kernel": 4}],
)
def test_mta_with_identity_kernels_equals_mha(kw):
    mha = visattn.build_attention("mha", 32, 4, qkv_bias=True).eval()
    mta = visattn.build_attention("mta", 32, 4, qkv_bias=True, group_norm=False, **kw).eval()
    missing = mta.load_state_dict(mha.state_dict(), strict=False).missing_keys
    assert set(missing) <= {"kq_kernel", "head_mix"}
    x = _x()
    torch.testing.assert_close(mta(x), mha(x), rtol=0, atol=1e-6)
    mask = torch.rand(2, 1, 7, 7) > 0.3
    mask[..., 0] = True
    torch.testing.assert_close(mta(x, attn_mask=mask), mha(x, attn_mask=mask), rtol=0, atol=1e-6)
    causal = visattn.build_attention("mta", 32, 4, qkv_bias=True, group_norm=False, causal=True, **kw).eval()
    causal.load_state_dict(mha.state_dict(), strict=False)
    torch.testing.assert_close(causal(x, is_causal=True), mha(x, is_causal=True), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "kw", [{}, {"kq_conv": "pre", "head_conv": "pre"}, {"kq_conv": "post", "head_conv": "post", "k_kernel": 4}]
)
def test_causal_mta_leaks_nothing_from_the_future(kw):
    kw = {"q_kernel": 3, "k_kernel": 5, **kw}
    m = _perturb(visattn.build_attention("mta", 32, 4, causal=True, **kw)).eval()
    x = _x(1, 8)
    j = 4
    x2 = x.clone()
    x2[:, j] += torch.randn(32)
    y, y2 = m(x, is_causal=True), m(x2, is_causal=True)
    torch.testing.assert_close(y2[:, :j], y[:, :j], rtol=0, atol=1e-6)
    assert (y2[:, j:] - y[:, j:]).abs().amax() > 1e-3
    # The same kernels without causal padding/masking do read later tokens: the check above can fail.
    leaky = visattn.build_attention("mta", 32, 4, **kw).eval()
    leaky.load_state_dict(m.state_dict())
    assert (leaky(x2)[:, :j] - leaky(x)[:, :j]).abs().amax() > 1e-3


def test_mta_rejects_bad_arguments():
    with pytest.raises(ValueError, match="head_kernel=3 must divide num_heads=4"):
        visattn.build_attention("mta", 32, 4, head_kernel=3)
    with pytest.raises(ValueError, match="kq_conv='mid'"):
        visattn.build_attention("mta", 32, 4, kq_conv="mid")
    with pytest.raises(ValueError, match="causal=True"):
        visattn.build_attention("mta", 32, 4)(_x(), is_causal=True)


def test_mta_group_norm_uses_depth_scaling():
    shallow = visattn.build_attention("mta", 32, 4, layer_idx=0)
    deep = visattn.build_attention("mta", 32, 4, layer_idx=11)
    assert shallow.head_scale == pytest.approx(0.8)
    assert deep.head_scale == pytest.approx(0.2 + 0.6 * math.exp(-3.3))
    deep.load_state_dict(shallow.state_dict())
    x = _x()
    torch.testing.assert_close(deep(x) - deep.proj.bias, (shallow(x) - shallow.proj.bias) * deep.head_scale / 0.8)


# --- relu ---


@pytest.mark.parametrize("norm", ["l1", "seqlen", "softplus"])
def test_relu_weights_match_the_formula(norm):
    m = visattn.build_attention("relu", 32, 4, norm=norm, qk_norm=(norm == "l1"))
    x = _x()
    q, k, v = m.project_qkv(x)
    w = m.attention_weights(q, k)
    s = q @ k.transpose(-2, -1) / math.sqrt(8)
    assert (w >= 0).all()
    if norm == "seqlen":
        torch.testing.assert_close(w, F.relu(s) / 7)
    else:
        act = F.relu(s) if norm == "l1" else F.softplus(s)
        torch.testing.assert_close(w, act / (act.sum(-1, keepdim=True) + 1e-6))
        rows = w.sum(-1)
        assert torch.all(((rows - 1).abs() < 1e-4) | (rows == 0))
    assert m.stats["zero_fraction"] == pytest.approx((w == 0).float().mean().item())
    torch.testing.assert_close(m(x), m.merge_heads(x, w @ v, None))


def test_relu_sparsity_rows_and_masks():
    m = visattn.build_attention("relu", 32, 4)
    x = _x()
    q, k, _ = m.project_qkv(x)
    w = m.attention_weights(q, k)
    assert 0.1 < m.stats["zero_fraction"] < 0.9  # a real fraction of exact zeros, unlike softmax
    rows = w.sum(-1)
    assert torch.all(((rows - 1).abs() < 1e-4) | (rows == 0))
    row_masked = torch.ones(7, 7, dtype=torch.bool)
    row_masked[3] = False
    w = m.attention_weights(q, k, attn_mask=row_masked)  # a row with nothing to attend: zeros, no NaN
    assert torch.isfinite(w).all() and (w[:, :, 3] == 0).all()
    causal = m.attention_weights(q, k, is_causal=True)
    assert (causal.triu(1) == 0).all()
    future_zeros = 7 * 6 / 2 * 2 * 4
    total_zeros = (causal == 0).sum().item()
    assert m.stats["zero_fraction"].item() == pytest.approx((total_zeros - future_zeros) / (2 * 4 * 28))
    with pytest.raises(ValueError, match="norm='l2'"):
        visattn.build_attention("relu", 32, 4, norm="l2")


# --- cosine ---


def test_log_spaced_coords_cover_every_offset_once():
    table, index = log_spaced_relative_coords((3, 4))
    assert table.shape == (5 * 7, 2) and index.shape == (12 * 12,)
    pairs = table[index].view(12, 12, 2)
    torch.testing.assert_close(pairs.diagonal(dim1=0, dim2=1), torch.zeros(2, 12))
    # token 0 is (0, 0), token 11 is (2, 3): offset (-2, -3), scaled by 8 / (grid - 1) as the release
    # does (-> (-8, -8)), then log-spaced
    expected = -torch.log2(torch.tensor([9.0, 9.0])) / 3
    torch.testing.assert_close(pairs[0, 11], expected)
    torch.testing.assert_close(pairs[11, 0], -expected)
    table, index = log_spaced_relative_coords((4, 4), (2, 2))  # pooled keys (TransNeXt)
    assert index.shape == (16 * 4,)
    torch.testing.assert_close(table[index].view(16, 4, 2)[0, 0], -torch.log2(torch.tensor([7 / 3, 7 / 3])) / 3)


def test_cosine_bias_table_shape_and_no_bias_for_leading_tokens():
    m = visattn.build_attention("cosine", 32, 4, grid_size=(2, 3))
    bias = m.relative_position_bias(7, 7)  # 1 class token + 2x3 grid
    assert bias.shape == (4, 7, 7)
    assert (bias[:, 0] == 0).all() and (bias[:, :, 0] == 0).all()
    torch.testing.assert_close(bias[:, 1:, 1:], m.cpb((2, 3)))
    assert bias[:, 1:, 1:].abs().sum() > 0
    assert isinstance(m.cpb, ContinuousPositionBias)
    assert m.cpb((2, 2), (1, 1)).shape == (4, 4, 1)
    m.set_grid_size((3, 3))
    assert m.relative_position_bias(10, 10).shape == (4, 10, 10)
    torch.testing.assert_close(m.cpb.coords((3, 3))[0], m.cpb.coords((3, 3))[0])  # deterministic per size
    with pytest.raises(ValueError, match="does not fit 7 queries"):
        m(_x())
    with pytest.raises(ValueError, match="grid_size"):
        m.set_grid_size((0, 3))
    m.set_grid_size(None)
    assert m.relative_position_bias(7, 7) is None
    assert expand_per_layer("cosine", {"grid_size": (14, 14)}, depth=3) == [{"grid_size": (14, 14)}] * 3


def test_cosine_matches_the_formula():
    m = _perturb(visattn.build_attention("cosine", 32, 4, grid_size=(2, 3)), std=0.05).eval()
    x = _x()
    q, k, v = m.project_qkv(x)
    temp = F.softplus(m.temperature) * math.log(7)
    scores = (F.normalize(q, dim=-1) + m.query_embedding) * temp @ F.normalize(k, dim=-1).transpose(-2, -1)
    weights = (scores + m.relative_position_bias(7, 7)).softmax(-1)
    torch.testing.assert_close(m(x), m.merge_heads(x, weights @ v, None), rtol=1e-5, atol=1e-5)
    assert F.softplus(visattn.build_attention("cosine", 32, 4).temperature).flatten()[0].item() == pytest.approx(
        1 / 0.24
    )
    m.set_grid_size(None)  # no grid: plain cosine attention, no bias
    weights = scores.softmax(-1)
    torch.testing.assert_close(m(x), m.merge_heads(x, weights @ v, None), rtol=1e-5, atol=1e-5)


# --- head widths ---


def test_uneven_with_equal_dims_equals_mha():
    mha = visattn.build_attention("mha", 32, 4, qkv_bias=True).eval()
    for head_dims in (None, [8, 8, 8, 8]):
        uneven = visattn.build_attention("uneven", 32, 4, qkv_bias=True, head_dims=head_dims).eval()
        uneven.load_state_dict(mha.state_dict(), strict=True)
        x = _x()
        torch.testing.assert_close(uneven(x), mha(x), rtol=0, atol=0)


def test_uneven_heads_attend_with_their_own_width():
    dims = [4, 12, 6, 10]
    m = visattn.build_attention("uneven", 32, 4, head_dims=dims).eval()
    x = _x()
    q, k, v = m.qkv(x).split(32, dim=-1)
    outs, start = [], 0
    for d in dims:
        sl = slice(start, start + d)
        outs.append(_manual_heads(q[..., sl], k[..., sl], v[..., sl], lambda s: s.softmax(-1)))
        start += d
    expected = m.proj(torch.cat(outs, dim=-1))
    torch.testing.assert_close(m(x), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="summing to the inner width num_heads \\* head_dim = 32"):
        visattn.build_attention("uneven", 32, 4, head_dims=[8, 8, 8, 9])
    assert expand_per_layer("uneven", {"head_dims": dims}, depth=2) == [{"head_dims": dims}] * 2


def test_adaptive_widths_are_learned():
    m = visattn.build_attention("adaptive", 32, 4)
    x = _x()
    m(x).square().sum().backward()
    assert m.alpha.grad is not None and m.alpha.grad.abs().sum() > 0
    assert torch.all(m.stats["head_width"] > 7.8)
    with torch.no_grad():
        m.alpha.copy_(torch.tensor([1.0, 0.5, 0.25, 0.0]))
    y = m(x)
    torch.testing.assert_close(m.stats["head_width"], torch.tensor([8.0, 4.0, 2.0, 0.0]), atol=0.2, rtol=0)

    def change_when_perturbing_values_of(head):
        with torch.no_grad():
            m.qkv.weight[64 + 8 * head : 64 + 8 * (head + 1)] += 1.0
            change = (m(x) - y).abs().amax()
            m.qkv.weight[64 + 8 * head : 64 + 8 * (head + 1)] -= 1.0
        return change

    # A head of width ~0 barely reaches proj; a full-width head does.
    assert change_when_perturbing_values_of(3) < 0.2 * change_when_perturbing_values_of(0)


# --- routing as a capability of every variant ---


@pytest.mark.parametrize("name", ["cosine", "relu", "mta", "uneven"])
def test_routing_composes_with_the_variant(name):
    m = visattn.build_attention(name, 32, 4, shared_heads=1, routed_topk=2).train()
    x = _x()
    y = m(x)
    assert m.aux_loss is not None and torch.isfinite(m.aux_loss)
    gates, _ = m.router(x)
    assert ((gates != 0).sum(-1) == 3).all()  # shared + topk heads per token
    assert torch.allclose(m.stats["head_load"].sum(-1), torch.tensor(3.0))
    # A head a token did not select has no influence on that token's output.
    b, t = 0, 0
    off = int((gates[b, t] == 0).nonzero()[0])
    m.eval()
    y = m(x)
    with torch.no_grad():
        m.qkv.weight[64 + 8 * off : 64 + 8 * (off + 1)] += 1.0  # that head's value weights
    y2 = m(x)
    torch.testing.assert_close(y2[b, t], y[b, t], rtol=0, atol=1e-6)
    assert (y2 - y).abs().amax() > 1e-3


# --- timm ---


@pytest.mark.parametrize(
    "name,kw",
    [
        ("relu", {"norm": "softplus"}),
        ("mta", {"kq_conv": "pre", "head_conv": "pre"}),
        ("cosine", {"shared_heads": 1, "routed_topk": 2}),
        ("uneven", {"head_dims": [4, 12, 8, 8]}),
        ("adaptive", {}),
    ],
)
def test_variant_with_options_trains_inside_timm_vit(name, kw):
    model = timm.models.VisionTransformer(
        img_size=16, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=5, qkv_bias=True,
        attn_layer=_configured(get_attention_class(name), **kw),
    )
    x = torch.randn(2, 3, 16, 16)
    before = [p.detach().clone() for p in model.parameters()]
    loss = F.cross_entropy(model(x), torch.tensor([0, 1])) + 0.01 * visattn.aux_loss(model)
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert torch.isfinite(model(x)).all()
    changed = [not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True)]
    assert sum(changed) > len(changed) // 2


@pytest.mark.parametrize(
    "kw",
    [{}, {"kq_conv": "pre", "head_conv": "pre", "q_kernel": 2, "k_kernel": 4},
     {"kq_conv": "post", "head_conv": "post"}, {"kq_conv": "post", "head_conv": "pre", "k_kernel": 5}],
)
def test_mta_factorized_path_equals_the_reference(kw):
    ref = _perturb(visattn.build_attention("mta", 32, 4, num_kv_heads=2, impl="reference", **kw))
    fast = visattn.build_attention("mta", 32, 4, num_kv_heads=2, impl="factorized", **kw)
    fast.load_state_dict(ref.state_dict())
    x = _x(2, 9)
    y_ref, y_fast = ref(x), fast(x)
    torch.testing.assert_close(y_fast, y_ref, rtol=1e-5, atol=1e-5)
    y_ref.square().sum().backward()
    y_fast.square().sum().backward()
    for (name, p_ref), p_fast in zip(ref.named_parameters(), fast.parameters(), strict=True):
        scale = p_ref.grad.abs().amax().item()
        torch.testing.assert_close(p_fast.grad, p_ref.grad, rtol=0, atol=1e-5 * scale, msg=name)
    mask = torch.rand(2, 1, 9, 9) > 0.3  # masked forwards take the reference path
    mask[..., 0] = True
    torch.testing.assert_close(fast(x, attn_mask=mask), ref(x, attn_mask=mask), rtol=1e-5, atol=1e-5)
