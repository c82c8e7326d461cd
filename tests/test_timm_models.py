"""visattn ViTs as timm models: pretrained configs, loading local checkpoints (timm/DeiT keys,
released MoH keys), features_only / forward_intermediates / pruning with our attention, and a
gradient for every parameter of every variant in a ViT, a TransNeXt and a DiT."""

import logging

import pytest
import timm
import torch
from timm.models.vision_transformer import VisionTransformer

import visattn
from visattn.models.dit import DiT
from visattn.models.transnext import create_transnext
from visattn.models.vit import set_patch_grid

TINY = "visattn_vit_tiny_patch2_8"
TINY_ARGS = dict(img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=64, depth=6, num_heads=8,
                 mlp_ratio=2.0)
# Small settings that every variant accepts (8 heads of width 8 or 4).
VARIANT_KWARGS = {"uneven": {"head_dims": [4, 4, 8, 8, 8, 8, 12, 12]}}


def test_pretrained_config_describes_the_preset():
    model = timm.create_model(TINY)
    cfg = model.pretrained_cfg
    assert cfg["input_size"] == (1, 8, 8) and cfg["num_classes"] == 10
    assert cfg["first_conv"] == "patch_embed.proj" and cfg["classifier"] == "head"
    assert timm.data.resolve_data_config({}, model=model)["input_size"] == (1, 8, 8)
    assert model.patch_embed.proj.in_channels == 1
    big = timm.create_model("visattn_vit_small_patch16_224", pretrained=False)
    assert big.pretrained_cfg["input_size"] == (3, 224, 224) and "arXiv:2410.11842" in big.pretrained_cfg["paper_ids"]


def test_pretrained_without_a_file_says_how_to_give_one():
    with pytest.raises(ValueError, match="pretrained_cfg_overlay=dict\\(file=PATH\\)"):
        timm.create_model(TINY, pretrained=True)


def test_pretrained_with_a_missing_file_names_it(tmp_path):
    missing = tmp_path / "deit_small_patch16_224-cd65a155.pth"
    with pytest.raises(FileNotFoundError, match=f"file='{missing}' does not exist .*pretrained_cfg_overlay"):
        timm.create_model(TINY, pretrained=True, pretrained_cfg_overlay=dict(file=str(missing)))


def _timm_vit_file(tmp_path, wrap=True):
    torch.manual_seed(0)
    ref = VisionTransformer(**TINY_ARGS).eval()
    path = tmp_path / "deit_like.pth"
    torch.save({"model": ref.state_dict()} if wrap else ref.state_dict(), path)
    return ref, path


def test_timm_vit_weights_load_into_mha_and_give_the_same_logits(tmp_path):
    ref, path = _timm_vit_file(tmp_path)
    model = timm.create_model(TINY, pretrained=True, pretrained_cfg_overlay=dict(file=str(path))).eval()
    x = torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(model(x), ref(x))


def test_timm_vit_weights_load_into_moh_with_routers_at_init(tmp_path, caplog):
    ref, path = _timm_vit_file(tmp_path, wrap=False)
    with caplog.at_level(logging.INFO, logger="visattn.models.vit"):
        model = timm.create_model(TINY, attn="moh", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    assert "keep the model's initialisation" in caplog.text and "router.routed.weight" in caplog.text
    torch.testing.assert_close(model.blocks[3].attn.qkv.weight, ref.blocks[3].attn.qkv.weight)
    torch.testing.assert_close(model.head.weight, ref.head.weight)


def test_released_moh_key_names_load(tmp_path):
    torch.manual_seed(0)
    src = timm.create_model(TINY, attn="moh")
    released = {k.replace("router.routed.", "wg.").replace("router.mix.", "wg_0.").replace("router.shared.", "wg_1."): v
                for k, v in src.state_dict().items()}
    assert any(".wg_0." in k for k in released)
    path = tmp_path / "moh.pth"
    torch.save(released, path)
    model = timm.create_model(TINY, attn="moh", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    for key, value in src.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value)


@pytest.mark.parametrize("attn", ["moh", "cosine"])
def test_features_only_intermediates_and_pruning_with_our_attention(attn):
    torch.manual_seed(0)
    x = torch.randn(2, 1, 8, 8)
    features = timm.create_model(TINY, attn=attn, features_only=True, out_indices=(1, 3, 5)).eval()
    maps = features(x)
    assert [m.shape for m in maps] == [torch.Size([2, 64, 4, 4])] * 3
    assert features.feature_info.channels() == [64, 64, 64]
    model = timm.create_model(TINY, attn=attn).eval()
    final, inter = model.forward_intermediates(x, indices=[1, 3])
    assert [t.shape for t in inter] == [torch.Size([2, 64, 4, 4])] * 2
    torch.testing.assert_close(model.forward_head(final), model(x))
    model.prune_intermediate_layers(indices=[1], prune_head=True)
    assert len(model.blocks) == 2
    torch.testing.assert_close(model.forward_intermediates(x, indices=[1], intermediates_only=True)[0], inter[0])


def test_cosine_in_a_vit_biases_patch_tokens_only():
    model = timm.create_model(TINY, attn="cosine")
    attn = model.blocks[0].attn
    assert attn.grid_size == (4, 4)
    bias = attn.relative_position_bias(17, 17)  # class token + 4x4 patches
    assert bias.shape == (8, 17, 17)
    assert bias[:, 0].abs().sum() == 0 and bias[:, :, 0].abs().sum() == 0
    assert bias[:, 1:, 1:].abs().sum() > 0
    with pytest.raises(ValueError, match="dynamic_img_size"):
        timm.create_model(TINY, attn="cosine", dynamic_img_size=True)


def test_cosine_refuses_a_larger_token_grid_than_it_was_given():
    # The bias covers the last H*W tokens; a larger image used to make the extra patch tokens count as
    # "prefix" tokens, so the bias of a 4x4 grid landed silently on the last 16 patches of an 8x8 one.
    model = timm.create_model(TINY, attn="cosine", depth=1).eval()
    model.set_input_size(img_size=16)  # 8x8 patches; the bias still has the 4x4 grid
    with pytest.raises(ValueError, match=r"1 prefix tokens.*set_patch_grid"):
        model(torch.randn(1, 1, 16, 16))
    set_patch_grid(model)
    assert model(torch.randn(1, 1, 16, 16)).shape == (1, 10)
    # the README's swap into a timm ViT, here one that takes any image size
    vit = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, dynamic_img_size=True)
    visattn.swap_attention(vit, "cosine", grid_size=vit.patch_embed.grid_size)
    assert vit.eval()(torch.randn(1, 3, 16, 16)).shape == (1, 1000)
    with pytest.raises(ValueError, match="does not fit 65 queries"):
        vit(torch.randn(1, 3, 32, 32))


def _step_and_check_grads(model, loss):
    loss = loss + 0.01 * visattn.aux_loss(model)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not missing, f"parameters without a gradient: {missing}"
    assert not bad, f"non-finite gradients: {bad}"


def _routed(name):
    kwargs = dict(VARIANT_KWARGS.get(name, {}))
    if name not in ("moh",):
        kwargs.update(shared_heads=2, routed_topk=3)  # routing as a capability of every variant
    return {"name": name, **kwargs}


@pytest.mark.parametrize("name", visattn.list_attentions())
def test_every_variant_trains_in_a_vit_with_a_gradient_for_every_parameter(name):
    torch.manual_seed(0)
    model = timm.create_model(TINY, attn=_routed(name), depth=2).train()
    _step_and_check_grads(model, model(torch.randn(4, 1, 8, 8)).logsumexp(-1).mean())


@pytest.mark.parametrize("name", visattn.list_attentions())
def test_every_variant_trains_in_a_dit_with_a_gradient_for_every_parameter(name):
    torch.manual_seed(0)
    model = DiT(input_size=8, patch_size=2, in_channels=1, hidden_size=64, depth=2, num_heads=8,
                num_classes=3, learn_sigma=False, attn=_routed(name)).train()
    out = model(torch.randn(2, 1, 8, 8), torch.tensor([3, 700]), torch.tensor([0, 2]))
    _step_and_check_grads(model, out.square().mean())


@pytest.mark.parametrize("name", visattn.list_attentions())
def test_every_variant_trains_in_a_transnext_with_a_gradient_for_every_parameter(name):
    torch.manual_seed(0)
    spec = {"name": name}  # stage head counts differ (2..16): each variant's own defaults
    model = create_transnext("transnext_micro", num_classes=10, attn=spec).train()
    _step_and_check_grads(model, model(torch.randn(2, 3, 64, 64)).logsumexp(-1).mean())


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_moh_vit_traces_with_torch_fx(train):
    """fx records MoH's dense path (the eval-time sparse path groups tokens by data)."""
    torch.manual_seed(0)
    model = timm.create_model(TINY, attn="moh", depth=2).train(train)
    traced = torch.fx.symbolic_trace(model)
    x = torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(traced(x), model(x), rtol=1e-4, atol=1e-5)  # no dropout: deterministic
