"""Every registered attention passed as a bare ``attn_layer=`` to timm's ``VisionTransformer`` (timm
builds it with its own keywords only: no grid, no prefix count) trains: one step gives every
parameter a finite gradient. Cosine attention infers its token grid at the first call then
(``grid_size="auto"``), with or without a class token in front of the patches."""

import pytest
import timm
import torch
import torch.nn.functional as F

import visattn
from visattn.attention import get_attention_class
from visattn.attention.cosine import CosineAttention

IMG, PATCH = 16, 4  # a 4 x 4 patch grid


def _vit(attn_layer, **kwargs) -> timm.models.VisionTransformer:
    """A tiny timm ViT; x: [B, 3, 16, 16] -> logits [B, 5]."""
    return timm.models.VisionTransformer(
        img_size=IMG, patch_size=PATCH, embed_dim=32, depth=2, num_heads=4, num_classes=5,
        attn_layer=attn_layer, **kwargs,
    )


def _train_step_and_check_grads(model: torch.nn.Module) -> None:
    """One training step (forward, loss, backward); every parameter that requires grad must get a
    finite gradient, named in the failure message otherwise."""
    model.train()
    logits = model(torch.randn(2, 3, IMG, IMG))
    loss = F.cross_entropy(logits, torch.tensor([0, 1])) + 0.01 * visattn.aux_loss(model)
    loss.backward()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    missing = [n for n, p in params if p.grad is None]
    bad = [n for n, p in params if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not missing, f"parameters without a gradient after one training step: {missing}"
    assert not bad, f"parameters with a non-finite gradient: {bad}"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("name", visattn.list_attentions())
def test_every_variant_as_a_bare_timm_attn_layer_gives_every_parameter_a_gradient(name):
    _train_step_and_check_grads(_vit(get_attention_class(name)))


@pytest.mark.parametrize(
    "vit_kwargs, prefix",
    [
        ({}, 1),  # class token + 4 x 4 patches: 17 tokens
        ({"class_token": False, "global_pool": "avg"}, 0),  # 16 tokens
        ({"reg_tokens": 4}, 5),  # class token, 4 registers + 4 x 4 patches: 21 tokens
    ],
    ids=["class-token", "no-class-token", "registers"],
)
def test_bare_cosine_infers_the_patch_grid_and_its_bias_trains(vit_kwargs, prefix):
    model = _vit(CosineAttention, **vit_kwargs)
    attn = model.blocks[0].attn
    keys_before = set(model.state_dict())
    _train_step_and_check_grads(model)
    assert model.num_prefix_tokens == prefix
    assert [b.attn.inferred_prefix for b in model.blocks] == [prefix] * len(model.blocks)
    assert attn.cpb.fc1.weight.grad.abs().sum() > 0 and attn.cpb.fc2.weight.grad.abs().sum() > 0
    # parameters exist from construction: a never-run model loads the trained one's state_dict strictly
    assert set(model.state_dict()) == keys_before
    _vit(CosineAttention, **vit_kwargs).load_state_dict(model.state_dict(), strict=True)


def test_inferred_grid_gives_the_explicit_grids_output():
    auto = CosineAttention(32, 4).eval()
    fixed = CosineAttention(32, 4, grid_size=(4, 4), num_prefix_tokens=1).eval()
    fixed.load_state_dict(auto.state_dict(), strict=True)
    x = torch.randn(2, 17, 32)  # class token + 4 x 4 grid
    torch.testing.assert_close(auto(x), fixed(x), rtol=0, atol=0)
    torch.testing.assert_close(auto.relative_position_bias(17, 17), fixed.relative_position_bias(17, 17))
    assert auto.grid_size is None and auto.inferred_prefix == 1


def test_inferred_grid_follows_square_sizes_and_refuses_other_counts():
    attn = CosineAttention(32, 4).eval()
    attn(torch.randn(1, 17, 32))  # first call: 1 prefix token
    assert attn(torch.randn(1, 65, 32)).shape == (1, 65, 32)  # 8 x 8 after the same prefix token
    refused = r"33 tokens minus 1 prefix token\(s\) \(inferred at the layer's first call\) leave 32, not a "
    with pytest.raises(ValueError, match=refused):
        attn(torch.randn(1, 33, 32))  # a 4 x 8 grid (timm's dynamic_img_size on a non-square image)
    given = CosineAttention(32, 4, num_prefix_tokens=2)
    with pytest.raises(ValueError, match=r"17 tokens minus 2 prefix token\(s\) leave 15"):
        given(torch.randn(1, 17, 32))
    attn.set_grid_size("auto")  # forgets the inferred prefix
    assert attn(torch.randn(1, 16, 32)).shape == (1, 16, 32) and attn.inferred_prefix == 0


def test_cosine_grid_modes():
    assert CosineAttention(32, 4, position_bias=False).relative_position_bias(17, 17) is None
    assert CosineAttention(32, 4, grid_size=None).infer_grid  # None is the default: "auto"
    off = CosineAttention(32, 4)
    off.set_grid_size(None)  # the bias off from now on
    assert off.relative_position_bias(17, 17) is None
    with pytest.raises(ValueError, match="grid_size='sideways' must be"):
        off.set_grid_size("sideways")
    with pytest.raises(ValueError, match="needs position_bias=True"):
        CosineAttention(32, 4, grid_size="auto", position_bias=False)
    # pretrain_size without grid_size: the caller passes the bias (TransNeXt's blocks), else refused
    caller = CosineAttention(32, 4, pretrain_size=(4, 4))
    x = torch.randn(1, 16, 32)
    assert caller.relative_position_bias(16, 16) is None
    assert caller(x, attn_mask=caller.cpb((4, 4))).shape == (1, 16, 32)
    with pytest.raises(ValueError, match="grid_size='caller'.*attn_mask=layer.cpb"):
        caller(x)
    assert CosineAttention(32, 4, pretrain_size=(4, 4), grid_size="auto").infer_grid
