"""Every config group composes (and the model builds on the meta device); bad configs stop with a
message that names the key, the value and the fix."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from visattn.engine.cls.setup import attn_spec, validate_cls_config

CONF = Path(__file__).resolve().parents[1] / "conf"
# budgets are written for one geometry; the model each one needs
BUDGET_MODEL = {"s_": "vit_small", "b_": "vit_base"}


def compose_cls(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train_cls", overrides=list(overrides))


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group", ["model", "attn", "data", "aug", "optim", "sched"])
def test_every_option_composes_and_validates(group, tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    for option in options(group):
        extra = [f"data.root={tmp_path}"] if group == "data" and option == "imagefolder" else []
        if group == "model" and option != "vit_tiny_patch2_8":  # 224 px models (TransNeXt: multiples of 32)
            extra = ["data=fake"]
        cfg = compose_cls(f"{group}={option}", *extra)
        assert cfg[group] is not None
        model = validate_cls_config(cfg)
        assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.parametrize("budget", options("budget"))
def test_budgets_build_with_their_ratio(budget):
    model = next((m for prefix, m in BUDGET_MODEL.items() if budget.startswith(prefix)), "vit_tiny_patch2_8")
    data = "data=digits" if model == "vit_tiny_patch2_8" else "data=fake"
    cfg = compose_cls(f"budget={budget}", f"model={model}", data)
    spec = attn_spec(cfg)
    if cfg.budget.shared_heads is not None:
        assert spec["shared_heads"] == list(cfg.budget.shared_heads)
    validate_cls_config(cfg)


def test_published_budget_gives_published_ratio():
    from visattn.attention import active_heads

    model = validate_cls_config(compose_cls("budget=s_75", "model=vit_small", "data=fake"))
    assert active_heads(model) == (54, 72)
    model = validate_cls_config(compose_cls("budget=demo_pyramid_75"))
    assert [b.attn.num_heads for b in model.blocks] == [4, 4, 8, 8, 16, 16]
    assert active_heads(model) == (42, 56)


# the experiment group is shared with train_dit.py; these are the classification ones
CLS_EXPERIMENTS = [e for e in options("experiment") if "/dit" not in (CONF / "experiment" / f"{e}.yaml").read_text()]


@pytest.mark.parametrize("experiment", CLS_EXPERIMENTS)
def test_experiments_compose(experiment, tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    weights = tmp_path / "w.safetensors"
    weights.touch()
    overrides = [f"experiment={experiment}", f"data.root={tmp_path}"]
    if experiment.startswith("transnext") and not (CONF / "model" / "transnext_small.yaml").exists():
        pytest.skip("conf/model/transnext_small.yaml (the TransNeXt model config) is not in the tree yet")
    if experiment.startswith("continue_tune"):
        overrides = [f"experiment={experiment}", f"model.init_from={weights}"]
    cfg = compose_cls(*overrides)
    if experiment in ("deit_s", "transnext_s"):
        assert (cfg.train.epochs, cfg.train.batch_size, cfg.optim.weight_decay) == (300, 1024, 0.05)
        assert (cfg.aug.mixup, cfg.aug.cutmix, cfg.aug.label_smoothing, cfg.aug.re_prob) == (0.8, 1.0, 0.1, 0.25)
        assert cfg.aug.auto_augment.startswith("rand-m9-mstd0.5")
    validate_cls_config(cfg)


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        (["budget=s_75"], ValueError,
         r"attn.shared_heads has 12 entries but the model has 6 layers.*budget=s_75.*budget written for "
         r"this model's depth, or budget=none"),
        (["attn.shared_heads=4", "attn.routed_topk=7"], ValueError, r"routed_topk=7 is outside \[0, 4\]"),
        (["data=imagefolder", "data.root=/no/such/dir"], FileNotFoundError, r"data.root=/no/such/dir.*train"),
        (["data=imagefolder"], ValueError, r"data.root=null.*data.root=PATH"),
        (["attn=mha", "budget=demo_62"], ValueError, r"budget=demo_62 sets shared_heads.*attn=mha.*attn=moh"),
        (["mode=eval"], ValueError, r"mode=eval needs ckpt=PATH"),
        (["ckpt=/no/such.pth", "mode=eval"], FileNotFoundError, r"ckpt=/no/such.pth does not exist"),
        (["train.epochs=2"], ValueError, r"sched.warmup_epochs=2 .* lower it"),
        (["data.image_size=9"], ValueError, r"data.image_size=9 is not a multiple of the model's patch size 2"),
        (["+model.kwargs.num_heads=[8,8]"], ValueError, r"num_heads has 2 entries but the model has 6 layers"),
        (["budget.num_heads=[4,4,4]"], ValueError,
         r"num_heads has 3 entries but the model has 6 layers.*from budget.num_heads: one value per layer"),
        (["data.in_chans=3"], ValueError, r"data.mean=\[0.5\] needs one value per channel"),
        (["train.clip_grad=-1"], ValueError, r"train.clip_grad=-1 must be a finite number > 0; null turns"),
        (["optim.lr=-0.001"], ValueError, r"optim.lr=-0.001 must be a finite number > 0"),
        (["optim.lr=nan"], ValueError, r"optim.lr=nan must be a finite number > 0"),
        (["train.batch_size=0"], ValueError, r"train.batch_size=0 must be an integer >= 1"),
        (["train.eval_batch_size=0"], ValueError, r"train.eval_batch_size=0 must be an integer >= 1"),
        (["train.max_nonfinite_steps=-1"], ValueError, r"train.max_nonfinite_steps=-1 must be an integer >= 0"),
        (["train.amp=fp16"], ValueError, r"train.amp='fp16' is not known; use one of auto\|bf16\|none"),
        (["resume=maybe"], FileNotFoundError, r"resume=maybe does not exist; give auto, true"),
        (["train.aux_loss_weight=-0.01"], ValueError, r"train.aux_loss_weight=-0.01 must be a finite number >= 0"),
        (["train.ema=true", "train.ema_decay=1.5"], ValueError, r"train.ema_decay=1.5 must be in \[0, 1\]"),
        (["attn=moh", "+attn.top_k=2"], ValueError, r"attention 'moh' does not take 'top_k' \(did you mean 'routed_topk'"),
    ],
)
def test_validation_errors_name_key_value_and_fix(overrides, error, message):
    with pytest.raises(error, match=message):
        validate_cls_config(compose_cls(*overrides))


def test_batch_must_split_over_processes():
    with pytest.raises(ValueError, match=r"train.batch_size=63 is not divisible by the 2 processes"):
        validate_cls_config(compose_cls("train.batch_size=63"), world_size=2)


def test_old_amp_spelling_is_accepted_with_a_warning(caplog):
    validate_cls_config(compose_cls("train.amp=false"))
    assert "train.amp=False is deprecated; write train.amp=none" in caplog.text
