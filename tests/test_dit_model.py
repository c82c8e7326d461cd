"""DiT model: adaLN-Zero init, the original release's state-dict layout, preset sizes, MoH loading."""

import pytest
import torch

import visattn
from visattn.models.dit import DiT, create_dit, modulate

TINY = dict(input_size=8, patch_size=2, in_channels=3, hidden_size=32, depth=2, num_heads=4, num_classes=5)


def _inputs(batch=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, 8, 8, generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g)
    y = torch.randint(0, 5, (batch,), generator=g)
    return x, t, y


def _randomize(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def test_fresh_model_outputs_exactly_zero():
    model = DiT(**TINY, attn={"name": "moh", "shared_heads": 2, "routed_topk": 1}).eval()
    out = model(*_inputs())
    assert out.shape == (3, 6, 8, 8)
    assert torch.count_nonzero(out) == 0


def test_mha_state_dict_has_the_original_keys_and_shapes():
    h, p, c = 32, 2, 3
    expected = {
        "pos_embed": (1, 16, h),
        "x_embedder.proj.weight": (h, c, p, p),
        "x_embedder.proj.bias": (h,),
        "t_embedder.mlp.0.weight": (h, 256),
        "t_embedder.mlp.0.bias": (h,),
        "t_embedder.mlp.2.weight": (h, h),
        "t_embedder.mlp.2.bias": (h,),
        "y_embedder.embedding_table.weight": (6, h),  # 5 classes + the null class
        "final_layer.linear.weight": (p * p * 2 * c, h),
        "final_layer.linear.bias": (p * p * 2 * c,),
        "final_layer.adaLN_modulation.1.weight": (2 * h, h),
        "final_layer.adaLN_modulation.1.bias": (2 * h,),
    }
    for i in range(2):
        expected.update({
            f"blocks.{i}.attn.qkv.weight": (3 * h, h),
            f"blocks.{i}.attn.qkv.bias": (3 * h,),
            f"blocks.{i}.attn.proj.weight": (h, h),
            f"blocks.{i}.attn.proj.bias": (h,),
            f"blocks.{i}.mlp.fc1.weight": (4 * h, h),
            f"blocks.{i}.mlp.fc1.bias": (4 * h,),
            f"blocks.{i}.mlp.fc2.weight": (h, 4 * h),
            f"blocks.{i}.mlp.fc2.bias": (h,),
            f"blocks.{i}.adaLN_modulation.1.weight": (6 * h, h),
            f"blocks.{i}.adaLN_modulation.1.bias": (6 * h,),
        })
    state = DiT(**TINY).state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == expected


@pytest.mark.parametrize(
    "preset, params",
    [("DiT-S/2", 32_963_360), ("DiT-B/2", 130_512_416), ("DiT-L/2", 458_102_816), ("DiT-XL/2", 675_129_632)],
)
def test_preset_parameter_counts_match_the_original(preset, params):
    with torch.device("meta"):
        model = create_dit(preset)
    assert sum(p.numel() for p in model.parameters()) == params


@pytest.mark.parametrize(
    "preset, active, total",
    [("MoH-DiT-S/2-90", 64, 72), ("MoH-DiT-S/2-75", 54, 72), ("MoH-DiT-B/2-90", 129, 144),
     ("MoH-DiT-B/2-75", 108, 144), ("MoH-DiT-L/2-90", 344, 384), ("MoH-DiT-L/2-75", 288, 384),
     ("MoH-DiT-XL/2-90", 403, 448), ("MoH-DiT-XL/2-75", 336, 448), ("Pyramid-DiT-XL/2", 448, 448)],
)
def test_moh_presets_have_the_released_budgets(preset, active, total):
    with torch.device("meta"):
        model = create_dit(preset)
    assert visattn.active_heads(model) == (active, total)


def test_pyramid_geometry_and_dit_xl_layout():
    with torch.device("meta"):
        pyramid = create_dit("Pyramid-DiT-XL/2")
        moh = create_dit("MoH-DiT-XL/2-90")
    heads = [b.attn.num_heads for b in pyramid.blocks]
    assert heads == [8] * 9 + [16] * 10 + [24] * 9
    assert {b.attn.head_dim for b in pyramid.blocks} == {72}
    assert pyramid.attn_name == "mha" and moh.attn_name == "moh"
    # Same projections as MoH-DiT: only the routers differ.
    moh_shapes = {k: v.shape for k, v in moh.state_dict().items() if ".router." not in k}
    assert moh_shapes == {k: v.shape for k, v in pyramid.state_dict().items()}


def test_released_moh_key_names_load_through_convert_moh_state_dict():
    spec = {"name": "moh", "shared_heads": [2, 4], "routed_topk": [1, 0]}
    source = _randomize(DiT(**TINY, attn=spec)).eval()
    released_names = {"router.routed": "wg", "router.mix": "wg_0", "router.shared": "wg_1"}
    released = {}
    for key, value in source.state_dict().items():
        for ours, theirs in released_names.items():
            key = key.replace(ours, theirs)
        released[key] = value
    assert any(".wg_0." in k for k in released) and not any("router" in k for k in released)
    target = DiT(**TINY, attn=spec).eval()
    target.load_state_dict(visattn.convert_moh_state_dict(released), strict=True)
    x, t, y = _inputs()
    torch.testing.assert_close(target(x, t, y), source(x, t, y), rtol=0, atol=0)


def test_router_sees_the_modulated_token():
    model = _randomize(DiT(**TINY, attn={"name": "moh", "shared_heads": 2, "routed_topk": 1})).eval()
    block = model.blocks[0]
    seen = {}
    block.attn.register_forward_pre_hook(lambda m, args: seen.__setitem__("attn", args[0]))
    block.attn.router.register_forward_pre_hook(lambda m, args: seen.__setitem__("router", args[0]))
    x, t, y = _inputs()
    model(x, t, y)
    tokens = model.x_embedder(x) + model.pos_embed
    c = model.t_embedder(t) + model.y_embedder(y)
    shift, scale = block.adaLN_modulation(c).chunk(6, dim=1)[:2]
    torch.testing.assert_close(seen["router"], modulate(block.norm1(tokens), shift, scale))
    assert seen["router"] is seen["attn"]


def test_per_layer_lists_must_match_depth():
    with pytest.raises(ValueError, match="routed_topk has 3 entries but the model has 2 layers"):
        DiT(**TINY, attn={"name": "moh", "shared_heads": 2, "routed_topk": [1, 1, 1]})
    with pytest.raises(ValueError, match="num_heads has 3 entries"):
        DiT(**{**TINY, "num_heads": [4, 4, 4]})
    with pytest.raises(ValueError, match="unknown DiT preset"):
        create_dit("DiT-M/2")


def test_attention_spec_passes_none_on_as_the_variants_meaning():
    model = DiT(**TINY, attn={"name": "mta", "kq_conv": None, "head_conv": "post"})
    assert all(block.attn.kq_stage is None for block in model.blocks)
    moh = DiT(**TINY, attn={"name": "moh", "shared_heads": None, "routed_topk": None})
    assert visattn.active_heads(moh) == (2 * 3, 2 * 4)  # MoH's default budget: 2 shared + 1 routed of 4


def test_label_dropout_only_in_training():
    model = DiT(**TINY)
    emb = model.y_embedder
    y = torch.zeros(4000, dtype=torch.long)
    emb.eval()
    assert torch.equal(emb(y), emb.embedding_table.weight[y])
    emb.train()
    dropped = (emb(y) == emb.embedding_table.weight[5]).all(dim=1).float().mean()
    assert 0.07 < dropped < 0.13  # class_dropout_prob = 0.1
