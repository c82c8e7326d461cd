"""The core attention contract: MHA = timm, GQA/MQA, MoH routing, its loss, the release's parity."""

import copy
import pickle

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import Attention as TimmAttention

import visattn
from visattn.attention import expand_per_layer, get_attention_class, parse_attn_spec

torch.set_grad_enabled(True)


def _x(b=2, n=7, c=32, seed=0):
    return torch.randn(b, n, c, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"qkv_bias": True, "qk_norm": True, "norm_layer": nn.LayerNorm},
        {"scale_norm": True, "norm_layer": nn.LayerNorm, "proj_bias": False},
        {"gated": True, "qkv_bias": True},
        {"attn_head_dim": 12, "dim_out": 24},
    ],
)
def test_mha_equals_timm_attention(kwargs):
    ref = TimmAttention(32, num_heads=4, **kwargs).eval()
    ours = visattn.build_attention("mha", 32, 4, **kwargs).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = _x()
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=1e-6)
    mask = torch.rand(2, 1, 7, 7) > 0.3
    mask[..., 0] = True
    torch.testing.assert_close(ours(x, attn_mask=mask), ref(x, attn_mask=mask), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours(x, is_causal=True), ref(x, is_causal=True), rtol=0, atol=1e-6)


def test_gqa_with_all_kv_heads_equals_mha_and_mqa_equals_gqa_with_one():
    x = _x()
    mha = visattn.build_attention("mha", 32, 4).eval()
    gqa = visattn.build_attention("gqa", 32, 4, num_kv_heads=4).eval()
    gqa.load_state_dict(mha.state_dict())
    torch.testing.assert_close(gqa(x), mha(x), rtol=0, atol=1e-6)

    gqa1 = visattn.build_attention("gqa", 32, 4, num_kv_heads=1).eval()
    mqa = visattn.build_attention("mqa", 32, 4).eval()
    mqa.load_state_dict(gqa1.state_dict())
    torch.testing.assert_close(mqa(x), gqa1(x), rtol=0, atol=1e-6)
    assert mqa.qkv.out_features == 32 + 2 * 8


def test_gqa_shares_kv_heads_across_groups():
    """Each query head of a group must see the same keys: compare with explicitly repeated k/v."""
    attn = visattn.build_attention("gqa", 32, 4, num_kv_heads=2).eval()
    x = _x()
    q, k, v = attn.project_qkv(x)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    torch.testing.assert_close(attn.attend(q, k, v), expected, rtol=0, atol=1e-6)


def _moh(heads=8, shared=2, topk=3, dim=32, **kw):
    return visattn.build_attention("moh", dim, heads, shared_heads=shared, routed_topk=topk, **kw)


@pytest.mark.parametrize("heads,shared,topk", [(8, 2, 3), (6, 0, 2), (6, 1, 1), (4, 3, 1)])
def test_moh_gives_each_token_exactly_its_budget(heads, shared, topk):
    attn = _moh(heads, shared, topk, dim=48)
    x = _x(c=48)
    gates, selected = attn.router(x, None)
    assert selected.shape == (2, 7, heads)
    assert (selected.sum(-1) == shared + topk).all()
    assert selected[..., :shared].all()
    assert ((gates != 0) == selected).all()
    assert attn.active_heads == (shared + topk, heads)


def test_unselected_head_has_no_influence_on_a_token():
    attn = _moh(8, 2, 2).eval()
    x = _x(n=16)
    _, selected = attn.router(x, None)
    out = attn(x)
    head = 5
    not_using = ~selected[..., head]
    assert not_using.any() and (~not_using).any(), "need tokens on both sides of the head for this test"
    with torch.no_grad():  # perturb only head 5's value weights
        d = attn.head_dim
        v_rows = slice(2 * 32 + head * d, 2 * 32 + (head + 1) * d)
        attn.qkv.weight[v_rows] += 1.0
    changed = attn(x)
    torch.testing.assert_close(changed[not_using], out[not_using], rtol=0, atol=1e-6)
    assert (changed[~not_using] - out[~not_using]).abs().amax() > 1e-3


def test_load_balancing_loss_matches_hand_computation():
    # 1 sample, 3 tokens, pool of 3 routed heads (no shared), top-1.
    attn = _moh(heads=3, shared=0, topk=1, dim=3).train()
    with torch.no_grad():
        attn.router.routed.weight.copy_(torch.eye(3))
    x = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [3.0, 0.0, 0.0]]])
    attn(x)
    p = torch.softmax(x[0], dim=-1)  # router probabilities per token
    f = torch.tensor([2 / 3, 1 / 3, 0.0])  # fraction of tokens choosing each head
    expected = 3 * (f * p.mean(0)).sum()  # E * sum_i f_i P_i
    torch.testing.assert_close(attn.aux_loss, expected)
    torch.testing.assert_close(visattn.aux_loss(nn.Sequential(attn)), expected)


def test_aux_loss_is_mean_over_routed_layers_and_zero_without_routing():
    model = nn.Sequential(_moh(), visattn.build_attention("mha", 32, 4), _moh(shared=4, topk=2)).train()
    x = _x()
    for layer in model:
        x = layer(x)
    expected = (model[0].aux_loss + model[2].aux_loss) / 2
    torch.testing.assert_close(visattn.aux_loss(model), expected)
    plain = nn.Sequential(visattn.build_attention("mha", 32, 4))
    plain(_x())
    assert visattn.aux_loss(plain).item() == 0.0


def test_gradients_reach_every_router_parameter():
    attn = _moh(8, 3, 2).train()
    out = attn(_x())
    (out.square().mean() + 0.01 * attn.aux_loss).backward()
    names = [n for n, _ in attn.router.named_parameters()]
    assert sorted(names) == ["mix.weight", "routed.weight", "shared.weight"]
    for name, p in attn.router.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_binary_ste_gates_are_exactly_zero_one_and_pass_gradient():
    attn = _moh(8, 2, 3, gate="binary_ste").train()
    x = _x()
    gates, selected = attn.router(x, None)
    assert set(gates.detach().unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(gates.detach(), selected.float())
    attn(x).sum().backward()
    assert attn.router.routed.weight.grad.abs().sum() > 0
    assert attn.router.shared.weight.grad.abs().sum() > 0


def test_l2norm_router_is_parameter_free_and_picks_largest_queries():
    attn = _moh(6, 2, 2, dim=48, router="l2norm", gate="binary_ste").train()
    assert list(attn.router.parameters()) == []
    x = _x(c=48)
    q, _, _ = attn.project_qkv(x)
    _, selected = attn.router(x, q)
    norms = q[:, 2:].norm(dim=-1).transpose(1, 2)  # [B, N, 4]
    expected = torch.zeros_like(norms, dtype=torch.bool).scatter_(-1, norms.topk(2, -1).indices, True)
    assert torch.equal(selected[..., 2:], expected)
    attn(x).sum().backward()
    assert attn.qkv.weight.grad.abs().sum() > 0  # straight-through reaches the queries


def test_moh_with_one_shared_head_weights_it_by_alpha_only():
    attn = _moh(4, 1, 1).eval()
    x = _x()
    gates, _ = attn.router(x, None)
    alpha = torch.softmax(attn.router.mix(x), -1) * 2
    torch.testing.assert_close(gates[..., 0], alpha[..., 0])


def test_head_load_statistics():
    attn = _moh(8, 2, 3)
    attn(_x())
    load = visattn.attention_stats(nn.Sequential(attn))[0]["head_load"]
    assert load.shape == (2, 8)
    assert (load[:, :2] == 1).all()
    torch.testing.assert_close(load.sum(-1), torch.full((2,), 5.0))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"shared_heads": 2, "routed_topk": 7}, r"routed_topk=7 is outside \[0, 6\]"),
        ({"shared_heads": 9, "routed_topk": 1}, r"shared_heads=9 must be in \[0, num_heads=8\]"),
        ({"shared_heads": 2, "routed_topk": 0}, r"routed_topk=0 .* shared_heads must equal num_heads=8"),
        ({"router": "mlp"}, r"router='mlp' is not known"),
        ({"gate": "hard"}, r"gate='hard' is not known"),
        ({"router": "l2norm", "two_stage": True}, r"two_stage=True needs router='linear'"),
    ],
)
def test_bad_moh_arguments_name_the_value_and_range(kwargs, match):
    with pytest.raises(ValueError, match=match):
        visattn.build_attention("moh", 32, 8, **kwargs)


def test_bad_shapes_and_names_raise_clear_errors():
    with pytest.raises(ValueError, match=r"dim=30 is not divisible by num_heads=4"):
        visattn.build_attention("mha", 30, 4)
    with pytest.raises(ValueError, match=r"unknown attention 'flash'; registered: .*mha"):
        visattn.build_attention("flash", 32, 4)
    with pytest.raises(ValueError, match=r"num_kv_heads=3 must divide num_heads=4"):
        visattn.build_attention("gqa", 32, 4, num_kv_heads=3)


def test_unknown_keyword_names_the_variant_and_the_closest_keyword():
    with pytest.raises(ValueError, match=r"attention 'moh' does not take 'top_k' \(did you mean 'routed_topk'\?\)"):
        visattn.build_attention("moh", 32, 4, top_k=2)
    with pytest.raises(ValueError, match=r"attention 'mta' does not take 'kernel'.*; it takes: .*q_kernel"):
        parse_attn_spec({"name": "mta", "kernel": 3})  # the spec is checked before any model is built


def test_expand_per_layer_checks_lengths():
    layers = expand_per_layer("moh", {"shared_heads": [1, 2, 3], "routed_topk": 1}, depth=3)
    assert [layer["shared_heads"] for layer in layers] == [1, 2, 3]
    assert all(layer["routed_topk"] == 1 for layer in layers)
    with pytest.raises(ValueError, match=r"attn.shared_heads has 4 entries but the model has 3 layers"):
        expand_per_layer("moh", {"shared_heads": [1, 2, 3, 4]}, depth=3)


# --- parity with the released MoH module (re-derived from the paper's formulas and the release's scales) ---


class ReleasedMoHReference(nn.Module):
    """Straightforward reference of the released MoH-DiT attention's maths, with its parameter names."""

    def __init__(self, dim, num_heads, shared_head, routed_head, head_dim=None):
        super().__init__()
        self.h, self.hs, self.k = num_heads, shared_head, routed_head
        self.d = head_dim or dim // num_heads
        self.qkv = nn.Linear(dim, 3 * num_heads * self.d, bias=True)
        self.proj = nn.Linear(num_heads * self.d, dim)
        if routed_head > 0:
            self.wg = nn.Linear(dim, num_heads - shared_head, bias=False)
            if shared_head > 0:
                self.wg_0 = nn.Linear(dim, 2, bias=False)
        if shared_head > 1:
            self.wg_1 = nn.Linear(dim, shared_head, bias=False)
        self.loss = None

    def forward(self, x):
        B, N, C = x.shape
        t = x.reshape(B * N, C)
        qkv = self.qkv(x).reshape(B, N, 3, self.h, self.d).permute(2, 0, 3, 1, 4)
        heads = torch.softmax(qkv[0] @ qkv[1].transpose(-1, -2) / self.d**0.5, -1) @ qkv[2]
        heads = heads.transpose(1, 2)  # B, N, h, d
        if self.k == 0:
            gates = torch.softmax(self.wg_1(t), 1) * self.hs
        else:
            probs = torch.softmax(self.wg(t), 1)
            E = probs.shape[1]
            mask = torch.zeros_like(probs)
            for row in range(probs.shape[0]):
                for i in torch.topk(probs[row], self.k).indices:
                    mask[row, i] = 1.0
            self.loss = (probs.mean(0) * mask.mean(0)).mean() * E * E
            routed = probs * mask
            routed = routed / routed.sum(1, keepdim=True) * self.k
            if self.hs == 0:
                gates = routed
            else:
                shared = torch.softmax(self.wg_1(t), 1) * self.hs if self.hs > 1 else torch.ones(B * N, 1)
                w = torch.softmax(self.wg_0(t), 1) * 2
                gates = torch.cat([shared * w[:, :1], routed * w[:, 1:]], 1)
        out = heads * gates.reshape(B, N, self.h, 1)
        return self.proj(out.reshape(B, N, self.h * self.d))


@pytest.mark.parametrize(
    "heads,shared,topk,head_dim", [(8, 2, 3, None), (6, 6, 0, None), (6, 0, 2, None), (4, 2, 1, 12), (4, 1, 2, None)]
)
def test_moh_matches_the_released_module_with_converted_weights(heads, shared, topk, head_dim):
    ref = ReleasedMoHReference(48, heads, shared, topk, head_dim).train()
    sd = visattn.convert_moh_state_dict({f"blocks.3.attn.{k}": v for k, v in ref.state_dict().items()})
    assert not any(".wg" in k for k in sd)
    ours = visattn.build_attention(
        "moh", 48, heads, shared_heads=shared, routed_topk=topk, head_dim=head_dim, qkv_bias=True
    ).train()
    ours.load_state_dict({k.removeprefix("blocks.3.attn."): v for k, v in sd.items()}, strict=True)
    x = _x(b=2, n=5, c=48, seed=1)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)
    if topk:
        torch.testing.assert_close(ours.aux_loss, ref.loss, rtol=1e-6, atol=1e-6)


# --- timm integration ---


def _tiny_vit(**kw):
    return timm.models.VisionTransformer(
        img_size=16, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=5, **kw
    )


@pytest.mark.parametrize("name", visattn.list_attentions())
def test_every_variant_plugs_into_timm_vit_and_trains(name):
    model = _tiny_vit(attn_layer=get_attention_class(name))
    x = torch.randn(2, 3, 16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = F.cross_entropy(model(x), torch.tensor([0, 1])) + 0.01 * visattn.aux_loss(model)
    loss.backward()
    opt.step()
    assert torch.isfinite(model(x)).all()


@pytest.mark.parametrize("name", visattn.list_attentions())
@pytest.mark.parametrize("training", [True, False])
def test_every_variant_takes_an_empty_batch(name, training):
    """B = 0 (a DDP rank with no images left, an empty eval shard): [0, N, C] out, a gradient back."""
    m = visattn.build_attention(name, 32, 4).train(training)
    x = torch.randn(0, 5, 32, requires_grad=True)
    y = m(x)
    assert y.shape == (0, 5, 32)
    y.sum().backward()
    assert x.grad.shape == (0, 5, 32)


def test_swap_mha_into_timm_vit_keeps_outputs():
    model = _tiny_vit(qkv_bias=True).eval()
    x = torch.randn(2, 3, 16, 16)
    before = model(x)
    visattn.swap_attention(model, "mha")
    assert all(type(m).__name__ == "MultiHeadAttention" for m in (b.attn for b in model.blocks))
    torch.testing.assert_close(model(x), before, rtol=0, atol=1e-6)


def test_swap_moh_keeps_pretrained_projections_and_takes_per_layer_budgets():
    model = _tiny_vit(qkv_bias=True)
    qkv = [b.attn.qkv.weight.clone() for b in model.blocks]
    visattn.swap_attention(model, "moh", per_layer=[{"shared_heads": 1, "routed_topk": 1}, {"shared_heads": 2, "routed_topk": 2}])
    for block, w in zip(model.blocks, qkv, strict=True):
        assert torch.equal(block.attn.qkv.weight, w)
    assert visattn.active_heads(model) == (2 + 4, 8)
    with pytest.raises(ValueError, match="per_layer has 1 entries but the model has 2 attention layers"):
        visattn.swap_attention(_tiny_vit(), "moh", per_layer=[{}])
    # the same budget as keyword lists, one value per attention layer (as in our models' specs)
    listed = visattn.swap_attention(_tiny_vit(qkv_bias=True), "moh", shared_heads=[1, 2], routed_topk=[1, 2])
    assert [(b.attn.router.shared_heads, b.attn.router.routed_topk) for b in listed.blocks] == [(1, 1), (2, 2)]
    with pytest.raises(ValueError, match="attn.shared_heads has 3 entries but the model has 2 layers"):
        visattn.swap_attention(_tiny_vit(), "moh", shared_heads=[1, 1, 1], routed_topk=1)


def test_swap_attention_refuses_a_model_it_finds_no_layer_to_replace():
    # EVA's (and BEiT's, Swin's, CaiT's) attention is not timm's ``Attention``: the swap used to return
    # the model untouched, so a user trained plain EVA believing it was MoH.
    eva = timm.create_model("eva02_tiny_patch14_224", img_size=28, depth=1)
    with pytest.raises(ValueError, match=r"no attention layer to replace.*EvaAttention"):
        visattn.swap_attention(eva, "moh")
    assert type(eva.blocks[0].attn).__name__ == "EvaAttention"
    with pytest.raises(ValueError, match="no attention layer to replace"):
        visattn.swap_attention(nn.Linear(4, 4), "mha")


def test_active_heads_counts_timm_and_our_layers():
    model = _tiny_vit()
    assert visattn.active_heads(model) == (8, 8)
    visattn.swap_attention(model, "moh", shared_heads=1, routed_topk=1)
    assert visattn.active_heads(model) == (4, 8)


def test_convert_moh_state_dict_renames_release_modules_under_any_prefix():
    w = torch.zeros(1)
    sd = {
        "blocks.0.attn.wg.weight": w,
        "module.stages.2.attn.wg_0.weight": w,
        "wg_1.weight": w,
        "levels.1.blocks.3.attn.cpb_fc1.bias": w,
        "blocks.0.attn.qkv.weight": w,
        "blocks.0.attn.wgx.weight": w,
    }
    assert sorted(visattn.convert_moh_state_dict(sd)) == sorted(
        [
            "blocks.0.attn.router.routed.weight",
            "module.stages.2.attn.router.mix.weight",
            "router.shared.weight",
            "levels.1.blocks.3.attn.cpb.fc1.bias",
            "blocks.0.attn.qkv.weight",
            "blocks.0.attn.wgx.weight",
        ]
    )


def test_expand_per_layer_reads_hydra_lists():
    from omegaconf import OmegaConf

    spec = OmegaConf.create({"shared_heads": [1, 2], "routed_topk": 1})
    assert [layer["shared_heads"] for layer in expand_per_layer("moh", spec, depth=2)] == [1, 2]


def test_moh_model_deep_copies_after_a_training_forward():
    # An EMA (timm's ModelEmaV3, visattn.engine.ema) or a "best model" snapshot deep-copies the model
    # mid-training; the router's last load-balancing loss is a non-leaf tensor and must not block it.
    model = nn.Sequential(_moh(8, 2, 3)).train()
    out = model(_x())
    (out.sum() + visattn.aux_loss(model)).backward()
    copied = copy.deepcopy(model)
    assert copied[0].aux_loss is not None and copied[0].aux_loss.grad_fn is None
    torch.testing.assert_close(copied[0].aux_loss, model[0].aux_loss.detach())
    assert model[0].aux_loss.grad_fn is not None  # the original keeps its graph for the training loss
    copied.eval()
    model.eval()
    torch.testing.assert_close(copied(_x(seed=1)), model(_x(seed=1)), rtol=0, atol=0)
    restored = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(restored(_x(seed=1)), model(_x(seed=1)), rtol=0, atol=0)


def test_swap_attention_warns_when_a_pretrained_weight_cannot_be_kept(caplog):
    # gqa has fewer key/value heads, so the timm qkv weight no longer fits: the user must be told
    # that the swapped model does not carry it, not find out from a collapsed accuracy.
    model = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, depth=1, num_heads=4)
    qkv = model.blocks[0].attn.qkv.weight.detach().clone()
    with caplog.at_level("WARNING", logger="visattn.attention.model_ops"):
        visattn.swap_attention(model, "gqa", num_kv_heads=2)
    assert "qkv.weight (576, 192) -> (384, 192)" in caplog.text and "NOT kept" in caplog.text
    assert model.blocks[0].attn.qkv.weight.shape != qkv.shape
    caplog.clear()
    with caplog.at_level("WARNING", logger="visattn.attention.model_ops"):
        visattn.swap_attention(model, "moh", num_kv_heads=2, shared_heads=2, routed_topk=1)
    assert caplog.text == ""  # every weight kept: no warning


def test_building_a_gqa_vit_does_not_warn_about_weights(caplog):
    with caplog.at_level("WARNING", logger="visattn.attention.model_ops"):
        timm.create_model("visattn_vit_tiny_patch16_224", attn="gqa", img_size=16, patch_size=8, depth=1)
    assert "NOT kept" not in caplog.text
