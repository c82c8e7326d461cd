"""``validate_dit_config``: every DiT value is checked before any work, naming key, value and fix."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from visattn.engine.dit.setup import min_eval_samples, validate_dit_config

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def dit_cfg(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return OmegaConf.to_container(compose("train_dit", overrides=list(overrides)), resolve=True)


def test_defaults_validate_and_follow_dit():
    cfg = validate_dit_config(dit_cfg())
    assert cfg["train"]["amp"] == "auto"
    assert cfg["train"]["batch_size"] == 256  # DiT's global batch
    assert validate_dit_config(dit_cfg("dit=s_2"))["sample"]["guided_channels"] == 3  # DiT's sampler


@pytest.mark.parametrize("preset", ["tiny", "tiny_fashion"])
def test_one_channel_presets_sample_with_guidance(preset):
    """The README's `mode=sample ckpt=RUN_DIR sample.cfg_scale=1.5` on a 1-channel pixel preset: every
    epsilon channel is guided (DiT's first-3-channels quirk is for 4-channel latents)."""
    cfg = validate_dit_config(dit_cfg(f"dit={preset}", "mode=sample", "ckpt=.", "sample.cfg_scale=1.5"))
    assert cfg["sample"]["guided_channels"] is None


def test_every_study_dit_run_validates(tmp_path):
    """Each DiT command of both study profiles passes the checks made before any work (the full
    profile samples with cfg 3 on 1-channel Fashion-MNIST)."""
    from visattn.study import load_study_config, plan_runs

    (tmp_path / "data" / "fashion-mnist-500-100-per-class").mkdir(parents=True)  # the quick subset's folder
    for profile in ("quick", "full"):
        name = load_study_config(profile).tasks.dit.config_name
        for spec in plan_runs(profile, tmp_path, tasks=["dit"], seeds=[0]):
            overrides = [o for o in spec.overrides if not o.startswith("hydra.")]
            with initialize_config_dir(config_dir=CONF, version_base="1.3"):
                cfg = OmegaConf.to_container(compose(name, overrides=overrides), resolve=True)
            validate_dit_config(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.batch_size=0"], r"train.batch_size=0 must be an integer >= 1"),
        (["train.lr=-1e-4"], r"train.lr=-0.0001 must be a finite number > 0"),
        (["train.clip_grad=-1"], r"train.clip_grad=-1 must be a finite number > 0"),
        (["train.steps=0"], r"train.steps=0 must be an integer >= 1"),
        (["train.ema_decay=1.5"], r"train.ema_decay=1.5 must be in \[0, 1\]"),
        (["train.aux_loss_weight=-0.01"], r"train.aux_loss_weight=-0.01 must be a finite number >= 0"),
        (["attn=moh", "+attn.top_k=2"], r"attention 'moh' does not take 'top_k' \(did you mean 'routed_topk'"),
        (["eval.num_samples=3"], r"eval.num_samples=3 must be an integer >= 4 \(FID needs 2, precision/recall"),
        (["mode=sample", "ckpt=.", "sample.num_samples=0"], r"sample.num_samples=0 must be an integer >= 1"),
        (["sample.cfg_scale=-1"], r"sample.cfg_scale=-1 must be a finite number >= 0"),
        (["sample.cfg_scale=4", "dit.class_dropout_prob=0"], r"sample.cfg_scale=4 needs the null class"),
        (["sample.steps=ddim0"], r"sample.steps='ddim0'"),
        (["sample.sampler=euler"], r"sample.sampler='euler' is not known; use one of \('ddpm', 'ddim'\)"),
        (["sample.guided_channels=0"], r"sample.guided_channels=0 must be null \(every channel\) or an integer"),
        (["sample.cfg_scale=1.5", "sample.guided_channels=3"], r"sample.guided_channels=3 exceeds the model's 1 channels; set .*=null"),
        (["train.amp=fp16"], r"train.amp='fp16' is not known"),
        (["sched.name=linear"], r"sched.name='linear' is not known; use one of cosine\|constant"),
        (["sched=cosine", "sched.warmup_epochs=-1"], r"sched.warmup_epochs=-1 must be a finite number >= 0"),
        (["mode=eval"], r"mode=eval needs ckpt=PATH"),
        (["resume=maybe"], r"resume='maybe' must be auto, true or false"),
        (["dit.preset=DiT-Q/2"], r"DiT-Q/2"),
    ],
)
def test_bad_values_fail_before_any_work(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate_dit_config(dit_cfg(*overrides))


def test_batch_must_split_over_processes():
    with pytest.raises(ValueError, match=r"train.batch_size=6 is not divisible by the 4 processes"):
        validate_dit_config(dit_cfg("train.batch_size=6"), world_size=4)


def test_old_clip_spelling_maps_to_the_new_key(caplog):
    cfg = validate_dit_config(dit_cfg("train.grad_clip=2.0"))
    assert cfg["train"]["clip_grad"] == 2.0 and "write train.clip_grad=2.0" in caplog.text
    with pytest.raises(ValueError, match="disagree; set only train.clip_grad"):
        validate_dit_config(dit_cfg("train.grad_clip=2.0", "train.clip_grad=1.0"))


def test_minimum_evaluation_samples_follow_the_scorer():
    assert min_eval_samples() == 4  # ADM's k = 3 nearest neighbours need 4 points; FID needs 2
