"""TransNeXt backbone: published sizes and budgets, resolution freedom, aggregated attention maths."""

from __future__ import annotations

import functools
import logging

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.optim import param_groups_weight_decay

import visattn
from visattn.attention import build_attention
from visattn.models.aggregated_attention import AggregatedAttention
from visattn.models.transnext import MOH_PRESETS, TransNeXt, convert_transnext_state_dict, create_transnext

PUBLISHED_PARAMS = {
    "transnext_micro": 12.8e6,
    "transnext_tiny": 28.2e6,
    "transnext_small": 49.7e6,
    "transnext_base": 89.7e6,
}
PUBLISHED_ACTIVE = {
    "moh_transnext_small_80": (343, 429),
    "moh_transnext_small_75": (323, 429),
    "moh_transnext_base_75": (441, 588),
    "moh_transnext_base_50": (294, 588),
}
# One block per stage, heads 1, 2, 2, 4 (head dim 24): small enough for exact checks on CPU.
TOY = dict(embed_dims=(24, 48, 48, 96), depths=(1, 1, 1, 1), mlp_ratios=(2, 2, 2, 2), num_classes=5)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@functools.cache
def meta_param_count(preset: str) -> int:
    with torch.device("meta"):
        return n_params(create_transnext(preset))


@pytest.mark.parametrize("preset", sorted(PUBLISHED_PARAMS))
def test_preset_parameter_counts_match_the_paper(preset):
    assert abs(meta_param_count(preset) / PUBLISHED_PARAMS[preset] - 1) < 0.01


@pytest.mark.parametrize("preset", sorted(PUBLISHED_ACTIVE))
def test_moh_presets_activate_the_published_heads_and_log_it(preset, caplog):
    with caplog.at_level(logging.INFO, logger="visattn.models.transnext"), torch.device("meta"):
        model = timm.create_model(f"visattn_{preset}")
    active, total = PUBLISHED_ACTIVE[preset]
    assert visattn.active_heads(model) == (active, total)
    assert f"{active}/{total}" in caplog.text
    routers = n_params(model) - meta_param_count(MOH_PRESETS[preset][0])
    assert 0 < routers < 0.01 * n_params(model)  # MoH adds only the routers


def test_timm_entry_takes_an_attention_spec_with_per_stage_budgets():
    spec = {"name": "cosine", "shared_heads": [2, 4, 4, 8], "routed_topk": [0, 0, 2, 4]}
    with torch.device("meta"):
        model = timm.create_model("visattn_transnext_micro", num_classes=10, attn=spec)
    assert visattn.active_heads(model) == (2 * 2 + 2 * 4 + 15 * 6 + 2 * 12, 2 * 2 + 2 * 4 + 15 * 8 + 2 * 16)
    assert model.head.out_features == 10
    with pytest.raises(ValueError, match="4 stages"):
        TransNeXt(**TOY, attn={"name": "cosine", "shared_heads": [1, 2, 2], "routed_topk": [0, 0, 1]})


def test_moh_means_cosine_attention_routed_in_every_stage():
    with torch.device("meta"):
        model = TransNeXt(
            **TOY, attn={"name": "moh", "shared_heads": None, "routed_topk": None, "gate": "soft"}
        )
    mixers = [block.attn for stage in model.stages for block in stage.blocks]
    assert [type(m).__name__ for m in mixers] == ["AggregatedAttention"] * 3 + ["CosineAttention"]
    assert all(m.router is not None for m in mixers)
    with pytest.raises(ValueError, match="stage 1 .*routed_topk=3"):
        TransNeXt(**TOY, attn={"name": "cosine", "shared_heads": [0, 1, 1, 2], "routed_topk": [3, 1, 1, 1]})


def test_same_weights_run_at_several_input_sizes():
    torch.manual_seed(0)
    model = TransNeXt(**TOY).eval()
    images = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        small = model(images[..., :32, :32])
        large = model(images)
        again = model(images[..., :32, :32])
    assert small.shape == large.shape == (2, 5)
    assert torch.isfinite(large).all()
    torch.testing.assert_close(again, small)  # tables of the other size do not leak in
    assert model.stages[-1].blocks[0].attn.grid_size is None  # the grid goes with each call, no state
    with pytest.raises(ValueError, match="multiples of 32"):
        model(torch.randn(1, 3, 48, 64))
    latents = TransNeXt(**TOY, in_chans=4)  # as a backbone on 32 x 32 SD latents
    assert latents(torch.randn(1, 4, 32, 32)).shape == (1, 5)


def reference_aggregated(attn: AggregatedAttention, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Aggregated attention written as dense attention over all tokens with explicit window masks."""
    H, W = grid
    q, k, v = attn.project_qkv(x)
    pooled, pool_size = attn.pooled_tokens(x, grid)
    pk, pv = attn.pooled_kv(pooled)
    rows, cols = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    dy = rows.flatten()[None, :] - rows.flatten()[:, None]  # key row - query row, [N, N]
    dx = cols.flatten()[None, :] - cols.flatten()[:, None]
    near = (dy.abs() <= 1) & (dx.abs() <= 1)
    length_scale = torch.log(near.sum(-1, keepdim=True) + float(pk.shape[-2]))  # keys each query sees
    qn = F.normalize(q, dim=-1)
    qs = (qn + attn.query_embedding) * F.softplus(attn.temperature) * length_scale
    slot = ((dy + 1) * 3 + (dx + 1)).clamp(0, 8)
    local = qs @ F.normalize(k, dim=-1).transpose(-2, -1) + attn.local_bias[:, 0][:, slot]
    local = local.masked_fill(~near, float("-inf"))
    pool = qs @ F.normalize(pk, dim=-1).transpose(-2, -1) + attn.cpb(grid, pool_size)
    probs = torch.cat([local, pool], dim=-1).softmax(-1)
    tokens = qn @ attn.learnable_tokens + attn.learnable_bias  # [B, h, N, 9]
    extra = torch.gather(tokens, -1, slot.expand(*tokens.shape[:2], -1, -1)) * near
    out = (probs[..., : H * W] + extra) @ v + probs[..., H * W :] @ pv
    return attn.merge_heads(x, out, None)


def test_aggregated_attention_equals_dense_reference_and_masks_the_border():
    torch.manual_seed(0)
    attn = AggregatedAttention(48, 2, pool_ratio=2, qkv_bias=True)
    with torch.no_grad():  # make the learnable tokens and biases matter
        attn.learnable_bias.normal_(0, 0.5)
        attn.local_bias.normal_(0, 0.5)
    grid = (4, 6)
    attn.set_grid_size(grid)
    x = torch.randn(2, 24, 48)
    torch.testing.assert_close(attn(x), reference_aggregated(attn, x, grid), atol=1e-5, rtol=1e-4)

    q, k, _ = attn.project_qkv(x)
    pooled, pool_size = attn.pooled_tokens(x, grid)
    probs = attn.attention_probs(q, k, attn.pooled_kv(pooled)[0], grid, pool_size)
    corner = probs[:, :, 0]  # query (0, 0): window slots 0, 1, 2, 3, 6 lie outside the image
    assert (corner[..., [0, 1, 2, 3, 6]] == 0).all()
    assert (corner[..., [4, 5, 7, 8]] > 0).all() and (corner[..., 9:] > 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs[..., 0]))


def test_aggregated_attention_infers_square_grids_and_rejects_misfits():
    attn = AggregatedAttention(24, 1, pool_ratio=2)
    assert attn(torch.randn(1, 16, 24)).shape == (1, 16, 24)
    with pytest.raises(ValueError, match="not a square"):
        attn(torch.randn(1, 12, 24))
    attn.set_grid_size((3, 5))
    with pytest.raises(ValueError, match="does not fit"):
        attn(torch.randn(1, 16, 24))


@pytest.mark.parametrize("kind", ["aggregated", "cosine"])
def test_moh_with_every_head_shared_is_the_dense_mixer_with_soft_head_weights(kind):
    torch.manual_seed(0)
    heads, grid = 4, (4, 4)

    def build(**kw):
        if kind == "aggregated":
            return AggregatedAttention(96, heads, pool_ratio=2, **kw)
        return build_attention("cosine", 96, heads, **kw)

    moh = build(shared_heads=heads, routed_topk=0)
    dense = build()
    missing, unexpected = dense.load_state_dict(moh.state_dict(), strict=False)
    assert missing == [] and all(key.startswith("router.") for key in unexpected)
    for m in (moh, dense):
        m.set_grid_size(grid)
    x = torch.randn(2, 16, 96)
    weights = F.softmax(moh.router.shared(x), dim=-1) * heads
    q, k, v = dense.project_qkv(x)
    per_head = dense.aggregate(x, q, k, v, grid) if kind == "aggregated" else dense.attend(q, k, v)
    expected = dense.merge_heads(x, per_head, weights)
    torch.testing.assert_close(moh(x), expected)
    assert not torch.allclose(expected, dense(x))  # the soft weights do change the output
    assert moh.active_heads == (heads, heads)


def test_micro_model_trains_one_step_at_64px_with_moh():
    torch.manual_seed(0)
    attn = {"name": "cosine", "shared_heads": [2, 4, 4, 8], "routed_topk": [0, 0, 2, 4]}
    model = create_transnext("transnext_micro", num_classes=10, attn=attn, drop_path_rate=0.1).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images, labels = torch.randn(2, 3, 64, 64), torch.tensor([1, 7])
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    loss = F.cross_entropy(model(images), labels) + 0.01 * visattn.aux_loss(model)
    loss.backward()
    assert torch.isfinite(loss) and visattn.aux_loss(model) > 0
    no_grad = [name for name, p in model.named_parameters() if p.grad is None]
    assert no_grad == []
    opt.step()
    changed = [name for name, p in model.named_parameters() if not torch.equal(p, before[name])]
    assert len(changed) == len(before)


def test_no_weight_decay_lists_the_attention_parameters_only():
    model = TransNeXt(**TOY)
    names = model.no_weight_decay()
    assert "stages.0.blocks.0.attn.local_bias" in names and "stages.0.blocks.0.attn.query_embedding" in names
    assert "stages.3.blocks.0.attn.temperature" in names
    assert "stages.3.blocks.0.attn.cpb.fc1.weight" in names
    decayed = {"qkv.weight", "proj.weight", "learnable_tokens", "mlp.fc1.weight", "sr.weight"}
    assert not any(name.endswith(tuple(decayed)) for name in names)
    groups = param_groups_weight_decay(model, 0.05, no_weight_decay_list=names)  # what the trainer uses
    undecayed = {id(p) for group in groups if group["weight_decay"] == 0 for p in group["params"]}
    params = dict(model.named_parameters())
    assert all(id(params[name]) in undecayed for name in names)
    assert id(params["stages.0.blocks.0.attn.learnable_tokens"]) not in undecayed


def test_released_transnext_keys_map_onto_ours():
    attn = {"name": "cosine", "shared_heads": [1, 2, 1, 2], "routed_topk": [0, 0, 1, 1]}
    model = TransNeXt(**TOY, attn=attn)
    ours = model.state_dict()
    assert convert_transnext_state_dict(ours).keys() == ours.keys()  # our own layout passes unchanged
    q, kv = torch.randn(24, 24), torch.randn(48, 24)
    released = {
        "patch_embed2.proj.weight": torch.randn(48, 24, 3, 3),
        "block1.0.attn.q.weight": q,
        "block1.0.attn.kv.weight": kv,
        "block1.0.attn.relative_pos_bias_local": torch.randn(1, 9),
        "block1.0.attn.norm.weight": torch.randn(24),
        "block1.0.mlp.dwconv.dwconv.weight": torch.randn(32, 1, 3, 3),
        "block3.0.attn.wg.weight": torch.randn(1, 48),
        "block4.0.attn.cpb_fc1.weight": torch.randn(512, 2),
        "norm4.weight": torch.randn(96),
    }
    converted = convert_transnext_state_dict(released)
    assert sorted(converted) == sorted(
        [
            "stages.1.patch_embed.proj.weight",
            "stages.0.blocks.0.attn.qkv.weight",
            "stages.0.blocks.0.attn.local_bias",
            "stages.0.blocks.0.attn.pool_norm.weight",
            "stages.0.blocks.0.mlp.dwconv.weight",
            "stages.2.blocks.0.attn.router.routed.weight",
            "stages.3.blocks.0.attn.cpb.fc1.weight",
            "stages.3.norm.weight",
        ]
    )
    torch.testing.assert_close(converted["stages.0.blocks.0.attn.qkv.weight"], torch.cat([q, kv]))
    _, unexpected = model.load_state_dict(converted, strict=False)  # shapes fit, names exist
    assert unexpected == []
    with pytest.raises(ValueError, match="only"):
        convert_transnext_state_dict({"block1.0.attn.q.weight": q})
    old_layout = {"patch_embeds.0.proj.weight": q, "stages.2.1.attn.qkv.weight": kv, "stage_norms.3.bias": q}
    assert sorted(convert_transnext_state_dict(old_layout)) == [  # earlier visattn checkpoints
        "stages.0.patch_embed.proj.weight", "stages.2.blocks.1.attn.qkv.weight", "stages.3.norm.bias"
    ]


def test_swap_attention_refuses_transnext_mixers():
    with torch.device("meta"):
        model = create_transnext("transnext_micro", num_classes=10)
    with pytest.raises(ValueError, match="AggregatedAttention layers are part of its design"):
        visattn.swap_attention(model, "moh")
