"""Head budgets in one place (visattn.models.budgets): the published numbers, conf/budget naming
them, and apply_budget giving both tasks' models the same budget."""

from pathlib import Path

import pytest
import timm
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import visattn
import visattn.models  # noqa: F401  (registers the visattn_* timm models)
from visattn.models.budgets import HeadBudget, apply_budget, get_budget, list_budgets, resolve_budget
from visattn.models.dit import create_dit

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.mark.parametrize(
    ("name", "active", "total"),
    [  # reference/moh_budgets.md, and ours
        ("MoH-DiT-S/2-90", 64, 72), ("MoH-DiT-S/2-75", 54, 72), ("MoH-DiT-B/2-90", 129, 144),
        ("MoH-DiT-B/2-75", 108, 144), ("MoH-DiT-L/2-90", 344, 384), ("MoH-DiT-L/2-75", 288, 384),
        ("MoH-DiT-XL/2-90", 403, 448), ("MoH-DiT-XL/2-75", 336, 448), ("MoH-ViT-S-80", 343, 429),
        ("MoH-ViT-S-75", 323, 429), ("MoH-ViT-B-75", 441, 588), ("MoH-ViT-B-50", 294, 588),
        ("MoH-DiT-T/2-75", 18, 24), ("demo_62", 30, 48), ("demo_pyramid_75", 42, 56),
        ("s_90", 64, 72), ("s_75", 54, 72), ("b_90", 129, 144), ("b_75", 108, 144),
    ],
)
def test_registered_budgets_have_their_published_activation(name, active, total):
    budget = get_budget(name)
    assert budget.active_heads() == (active, total)
    assert budget.ratio == pytest.approx(active / total)


def test_registry_lists_every_budget_and_rejects_bad_ones():
    assert set(list_budgets(aliases=True)) >= {"MoH-DiT-XL/2-90", "MoH-ViT-B-50", "demo_62", "s_75", "b_90"}
    assert get_budget("s_75") is get_budget("MoH-DiT-S/2-75")
    with pytest.raises(ValueError, match=r"unknown head budget 's_60'; registered: .*demo_62"):
        get_budget("s_60")
    with pytest.raises(ValueError, match=r"budget bad, layer 1: routed_topk=3 is outside \[0, 2\]"):
        HeadBudget("bad", (2, 2), (1, 3), (4, 4))
    with pytest.raises(ValueError, match="differ in length"):
        HeadBudget("bad", (2, 2), (1,), (4, 4))


@pytest.mark.parametrize(
    ("preset", "name"),
    [("moh_transnext_small_80", "MoH-ViT-S-80"), ("moh_transnext_small_75", "MoH-ViT-S-75"),
     ("moh_transnext_base_75", "MoH-ViT-B-75"), ("moh_transnext_base_50", "MoH-ViT-B-50")],
)
def test_moh_vit_budgets_are_the_transnext_presets(preset, name):
    from visattn.models.transnext import create_transnext

    with torch.device("meta"):
        model = create_transnext(preset)
    budget = get_budget(name)
    assert visattn.active_heads(model) == budget.active_heads()
    per_stage = {(m.shared_heads, m.routed_topk) for m in model.modules() if hasattr(m, "routed_topk")}
    assert per_stage == set(zip(budget.shared_heads, budget.routed_topk, strict=True))


def test_conf_budgets_only_name_a_registered_budget():
    for path in sorted((CONF / "budget").glob("*.yaml")):
        cfg = OmegaConf.load(path)
        assert cfg.name == path.stem
        assert [cfg[k] for k in ("num_heads", "shared_heads", "routed_topk")] == [None] * 3, path
        assert cfg.name == "none" or cfg.name in list_budgets(aliases=True), path


def test_resolve_budget_names_mappings_and_overrides():
    assert resolve_budget(None) == ("none", {}) == resolve_budget("none")
    assert resolve_budget({"name": "none", "num_heads": None, "shared_heads": None, "routed_topk": None}) == ("none", {})
    name, values = resolve_budget({"name": "demo_62", "shared_heads": None, "routed_topk": [1] * 6})
    assert name == "demo_62" and values == {"shared_heads": [2, 2, 3, 3, 4, 4], "routed_topk": [1] * 6}
    assert resolve_budget({"name": "mine", "shared_heads": [1, 1]}) == ("mine", {"shared_heads": [1, 1]})
    assert resolve_budget("demo_pyramid_75")[1]["num_heads"] == [4, 4, 8, 8, 16, 16]  # sets its geometry
    assert "num_heads" not in resolve_budget("s_75")[1]  # S keeps the model's heads
    with pytest.raises(ValueError, match=r"budget=s_75 has unknown keys \['topk'\]"):
        resolve_budget({"name": "s_75", "topk": [1]})
    with pytest.raises(ValueError, match="unknown head budget 'nope'"):
        resolve_budget({"name": "nope", "shared_heads": None})


def test_apply_budget_sets_attention_lists_and_geometry():
    kwargs = {"attn": {"name": "moh", "shared_heads": None, "routed_topk": None, "gate": "soft"}, "depth": 6}
    out = apply_budget(kwargs, "demo_pyramid_75", depth=6, declared_only=True)
    assert out["attn"] == {"name": "moh", "shared_heads": [2, 2, 4, 4, 8, 8], "routed_topk": [1, 1, 2, 2, 4, 4],
                           "gate": "soft"}
    assert out["num_heads"] == [4, 4, 8, 8, 16, 16]
    assert kwargs["attn"]["shared_heads"] is None  # the input is not changed
    unchanged = apply_budget(kwargs, "none")
    assert unchanged == kwargs and unchanged is not kwargs
    xl = apply_budget({"attn": "moh"}, "MoH-DiT-XL/2-75", depth=28)
    assert xl["head_dim"] == 72 and len(xl["num_heads"]) == 28


@pytest.mark.parametrize(
    ("kwargs", "budget", "extra", "message"),
    [
        ({"attn": "mha"}, "demo_62", {"declared_only": True},
         r"budget=demo_62 sets shared_heads=\[2, 2, 3, 3, 4, 4\], but attn=mha has no shared_heads.*attn=moh"),
        ({"attn": "moh"}, "s_75", {"depth": 6},
         r"attn.shared_heads has 12 entries but the model has 6 layers \(budget=s_75\)"),
        ({"attn": "moh"}, "MoH-ViT-S-75", {"depth": 3, "unit": "stage"}, r"has 4 entries but the model has 3 stages"),
        ({"depth": 12}, "s_75", {}, r"budget=s_75 routes heads but the model has no attention spec; give attn='moh'"),
    ],
)
def test_apply_budget_errors_name_the_budget_and_the_fix(kwargs, budget, extra, message):
    with pytest.raises(ValueError, match=message):
        apply_budget(kwargs, budget, **extra)


def test_one_budget_for_a_dit_and_a_vit():
    """The same function gives the DiT preset and a classification ViT their budget."""
    with torch.device("meta"):
        dit = create_dit("DiT-S/2", attn="moh", budget="s_75")
        preset = create_dit("MoH-DiT-S/2-75")
        vit = timm.create_model("visattn_vit_small_patch16_224", **apply_budget({"attn": "moh"}, "s_75", depth=12))
        pyramid = timm.create_model("visattn_vit_tiny_patch2_8",
                                    **apply_budget({"attn": "moh", "img_size": 8, "in_chans": 1}, "demo_pyramid_75"))
    assert visattn.active_heads(dit) == visattn.active_heads(preset) == visattn.active_heads(vit) == (54, 72)
    assert {k: v.shape for k, v in dit.state_dict().items()} == {k: v.shape for k, v in preset.state_dict().items()}
    assert [b.attn.num_heads for b in pyramid.blocks] == [4, 4, 8, 8, 16, 16]
    assert visattn.active_heads(pyramid) == (42, 56)


def test_conf_budget_applies_through_a_composed_config():
    """What the training set-up does: conf/budget/NAME.yaml plus the attn group -> the attention spec."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train_cls", overrides=["budget=s_75", "model=vit_small", "data=fake",
                                              "budget.routed_topk=[1,1,1,1,1,1,1,1,1,1,0,0]"])
        mha = compose("train_cls", overrides=["budget=demo_62", "attn=mha"])
    attn = OmegaConf.to_container(cfg.attn, resolve=True)
    out = apply_budget({"attn": attn}, cfg.budget, declared_only=True)
    assert out["attn"]["shared_heads"] == [2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 6, 6]
    assert out["attn"]["routed_topk"] == [1] * 10 + [0, 0]  # the override replaced the registered list
    with pytest.raises(ValueError, match="budget=demo_62 sets shared_heads.*attn=mha.*attn=moh"):
        apply_budget({"attn": OmegaConf.to_container(mha.attn)}, mha.budget, declared_only=True)
