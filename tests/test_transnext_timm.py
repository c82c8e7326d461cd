"""TransNeXt as a timm model: released-code parity on fixtures, pretrained files, timm's model interface."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import timm
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import visattn
from visattn.attention.cosine import log_spaced_relative_coords
from visattn.models.transnext import TransNeXt

FIXTURES = Path(__file__).parent / "fixtures" / "transnext"
# One block per stage, heads 1, 2, 2, 4 (head dim 24).
TOY = dict(embed_dims=(24, 48, 48, 96), depths=(1, 1, 1, 1), mlp_ratios=(2, 2, 2, 2), num_classes=5)


def load_fixture(name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    path = FIXTURES / f"{name}.safetensors"
    with safe_open(str(path), "pt") as f:
        config = json.loads(f.metadata()["config"])
    return config, {k: v.float() for k, v in load_file(str(path)).items()}


def release_model_kwargs(config: dict) -> dict:
    kwargs = {k: config[k] for k in ("embed_dims", "depths", "mlp_ratios", "num_heads", "num_classes")}
    if "shared_head" in config:
        kwargs["attn"] = {"name": "cosine", "shared_heads": config["shared_head"], "routed_topk": config["routed_head"]}
    return {**kwargs, "img_size": config["img_size"]}


@pytest.mark.parametrize("release", ["transnext_release", "moh_vit_release"])
def test_released_weights_give_the_release_logits(release, tmp_path):
    """Weights in the release's key names, saved as the release's .pth, load through timm's pretrained
    path (checkpoint_filter_fn) and give the released code's logits, at its default and at pretrain_size=224."""
    config, tensors = load_fixture(release)
    weights = {k.removeprefix("weights."): v for k, v in tensors.items() if k.startswith("weights.")}
    path = tmp_path / "release.pth"
    torch.save({"model": weights}, path)
    overlay = dict(file=str(path), num_classes=config["num_classes"])
    images = tensors["input"]
    logits = {}
    for pretrain_size in (None, 224):
        model = timm.create_model(
            "visattn_transnext_micro", pretrained=True, pretrained_cfg_overlay=overlay,
            pretrain_size=pretrain_size, **release_model_kwargs(config),
        ).eval()
        with torch.no_grad():
            logits[pretrain_size] = model(images)
    torch.testing.assert_close(logits[None], tensors["logits"], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[224], tensors["logits_pretrain224"], atol=1e-4, rtol=0)
    assert (tensors["logits"] - tensors["logits_pretrain224"]).abs().max() > 1e-4  # the setting matters


def release_coords(query, key, pretrain):
    """The release's get_relative_position_cpb written out: offsets / (P - 1) * 8, then log-spaced."""
    axes = []
    for q, k, p in zip(query, key, pretrain, strict=True):
        aq = torch.arange(q, dtype=torch.float32)
        ak = torch.nn.functional.adaptive_avg_pool1d(aq[None], k)[0]
        axes.append((aq, ak, p))
    (qh, kh, ph), (qw, kw, pw) = axes
    qh, qw = (t.reshape(-1) for t in torch.meshgrid(qh, qw, indexing="ij"))
    kh, kw = (t.reshape(-1) for t in torch.meshgrid(kh, kw, indexing="ij"))
    rel = torch.stack([(qh[:, None] - kh[None]) / (ph - 1) * 8, (qw[:, None] - kw[None]) / (pw - 1) * 8], -1)
    return torch.sign(rel) * torch.log2(rel.abs() + 1.0) / 3.0


@pytest.mark.parametrize(
    "query, key, pretrain",
    [((4, 6), (4, 6), None), ((16, 8), (2, 1), None), ((8, 8), (2, 2), (56, 56)), ((7, 5), (3, 2), (14, 10))],
)
def test_position_offsets_are_the_release_formula(query, key, pretrain):
    table, index = log_spaced_relative_coords(query, key, pretrain)
    expected = release_coords(query, key, pretrain or query)
    torch.testing.assert_close(table[index].view(*expected.shape), expected)
    assert len(torch.unique(table, dim=0)) == len(table)  # each offset once


def test_pretrained_without_a_file_is_a_clear_error():
    with pytest.raises(ValueError, match="pretrained_cfg_overlay=dict\\(file=PATH\\)"):
        timm.create_model("visattn_transnext_micro", pretrained=True)


def test_pretrained_with_a_missing_file_names_it(tmp_path):
    missing = tmp_path / "MoH-ViT-S-75.pth"
    with pytest.raises(FileNotFoundError, match=f"file='{missing}' does not exist .*TransNeXt"):
        timm.create_model("visattn_moh_transnext_small_75", pretrained=True,
                          pretrained_cfg_overlay=dict(file=str(missing)))


def test_own_checkpoint_loads_through_timm_and_the_config_describes_the_model(tmp_path):
    torch.manual_seed(0)
    kwargs = dict(in_chans=1, img_size=64, attn={"name": "cosine", "shared_heads": [1, 1, 1, 2], "routed_topk": [0, 1, 1, 1]})
    source = timm.create_model("visattn_moh_transnext_small_75", **kwargs, **TOY).eval()
    path = tmp_path / "weights.safetensors"
    save_file(source.state_dict(), str(path))
    loaded = timm.create_model(
        "visattn_moh_transnext_small_75", pretrained=True, pretrained_cfg_overlay=dict(file=str(path), num_classes=5),
        **kwargs, **TOY,
    ).eval()
    x = torch.randn(2, 1, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), source(x))
    cfg = timm.data.resolve_data_config(model=loaded)
    assert cfg["input_size"] == (1, 64, 64) and cfg["interpolation"] == "bicubic"
    assert loaded.pretrained_cfg["paper_ids"] == "arXiv:2410.11842"
    assert loaded.pretrained_cfg["first_conv"] + ".weight" in loaded.state_dict()
    assert visattn.active_heads(loaded) == (1 + 2 + 2 + 3, 1 + 2 + 2 + 4)


def test_head_pooling_and_classifier_reset():
    torch.manual_seed(0)
    model = timm.create_model("visattn_transnext_micro", **TOY).eval()
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        features = model.forward_features(x)
        assert features.shape == (2, 96, 2, 3)
        pooled = model.forward_head(features, pre_logits=True)
        torch.testing.assert_close(pooled, features.mean((2, 3)))
        model.reset_classifier(7)
        assert model.get_classifier().out_features == 7 and model(x).shape == (2, 7)
        torch.testing.assert_close(model.forward_head(features, pre_logits=True), pooled)  # pooling kept
        model.reset_classifier(0, "max")
        torch.testing.assert_close(model(x), features.amax((2, 3)))
        model.reset_classifier(0, "")
        assert model(x).shape == (2, 96, 2, 3)
    with pytest.raises(ValueError, match="global_pool='token'"):
        model.reset_classifier(0, "token")
    with torch.device("meta"):
        meta = timm.create_model("visattn_transnext_micro", global_pool="", num_classes=0)
    assert meta(torch.randn(1, 3, 224, 224, device="meta")).shape == (1, 384, 7, 7)
    typed = timm.create_model("visattn_transnext_micro", device="meta", dtype=torch.bfloat16)
    assert {(p.device.type, p.dtype) for p in typed.parameters()} == {("meta", torch.bfloat16)}


def test_features_only_intermediates_and_pruning():
    torch.manual_seed(0)
    model = timm.create_model("visattn_transnext_micro", **TOY).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        final, maps = model.forward_intermediates(x)
        torch.testing.assert_close(final, model.forward_features(x))
        assert [m.shape[1:] for m in maps] == [(24, 16, 16), (48, 8, 8), (48, 4, 4), (96, 2, 2)]
        assert [info["reduction"] for info in model.feature_info] == [4, 8, 16, 32]
        early = model.forward_intermediates(x, indices=[1], stop_early=True, intermediates_only=True)
        torch.testing.assert_close(early[0], maps[1])
        torch.manual_seed(0)  # the same initial weights as model's
        features = timm.create_model("visattn_transnext_micro", features_only=True, out_indices=(1, 3), **TOY)
        assert features.feature_info.channels() == [48, 96]
        for got, want in zip(features.eval()(x), [maps[1], maps[3]], strict=True):
            torch.testing.assert_close(got, want)
        pruned = copy.deepcopy(model)
        assert pruned.prune_intermediate_layers([1]) == [1]
        assert len(pruned.stages) == 2 and pruned.num_features == 48
        torch.testing.assert_close(pruned.forward_features(x), maps[1])


def test_grad_checkpointing_gives_the_same_output_and_gradients():
    torch.manual_seed(0)
    attn = {"name": "cosine", "shared_heads": [1, 1, 1, 2], "routed_topk": [0, 1, 1, 1]}
    model = timm.create_model("visattn_transnext_micro", attn=attn, **TOY).train()
    x = torch.randn(2, 3, 32, 32)
    grads = []
    for enable in (False, True):
        model.zero_grad()
        model.set_grad_checkpointing(enable)
        model(x).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(model.parameters()))
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)


@pytest.mark.parametrize("attn", ["cosine", "mha"])
def test_torch_fx_traces_the_model(attn):
    torch.manual_seed(0)
    model = TransNeXt(**TOY, attn=attn).eval()
    traced = torch.fx.symbolic_trace(model)
    x = torch.randn(1, 3, 64, 96)  # another size than any seen while tracing: nothing shape-bound is baked in
    with torch.no_grad():
        torch.testing.assert_close(traced(x), model(x))


def test_torchscript_with_plain_attention_in_the_last_stage():
    """Blocks, stages, aggregated attention and the position bias script (the last stage: mha)."""
    torch.manual_seed(0)
    model = TransNeXt(**TOY, attn="mha").eval()
    scripted = torch.jit.script(model)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), model(x))


TOY_MOH = {"name": "cosine", "shared_heads": [1, 1, 1, 2], "routed_topk": [0, 1, 1, 1]}  # fits TOY's heads


@pytest.mark.parametrize("preset, extra", [("transnext_micro", {}), ("moh_transnext_small_75", {"attn": TOY_MOH})])
def test_torchscript_transnext_and_moh(preset, extra):
    torch.manual_seed(0)
    model = timm.create_model(f"visattn_{preset}", **TOY, **extra).eval()
    scripted = torch.jit.script(model)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), model(x))
