"""Training, resume, evaluation, ImageFolder and continue-tuning through the classification engine,
with a tiny ViT on digits (a few seconds each)."""

import csv
import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from PIL import Image
from safetensors.torch import load_file
from test_engine_faults import ONE_PRECISION

import visattn.engine.cls.trainer as trainer
from visattn.engine.checkpoints import (
    EVALUATION,
    MODEL_WEIGHTS,
    latest_checkpoint,
    record_evaluation,
    remove_stale,
    save_checkpoint,
)
from visattn.engine.cls.setup import build_cls_model, load_model_weights
from visattn.engine.cls.trainer import run_cls
from visattn.engine.preempt import Preempted
from visattn.utils.machine import usable_cores

CONF = Path(__file__).resolve().parents[1] / "conf"
TINY = [
    "+model.kwargs.embed_dim=16", "+model.kwargs.depth=2", "+model.kwargs.num_heads=4", "train.epochs=2",
    "sched.warmup_epochs=1", "train.batch_size=128", "train.tensorboard=false", "train.progress=false",
    "train.num_threads=null", "aug=none", "aug.mixup=0.2", "aug.label_smoothing=0.1",
    ONE_PRECISION,
]


def cfg_of(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train_cls", overrides=[*TINY, *overrides])


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full")
    return run_dir, run_cls(cfg_of(), run_dir)


def test_run_writes_results_metrics_checkpoints(full_run):
    run_dir, results = full_run
    on_disk = json.loads((run_dir / "results.json").read_text())
    for key in ("top1", "top5", "top1_best", "active_heads", "active_ratio", "params", "flops_per_image",
                "train_images_per_s", "eval_images_per_s", "peak_memory_mb", "wall_time_s", "cpu_time_s", "config"):
        assert on_disk[key] is not None, key
    # CPU seconds over wall x torch threads: spin-waits and threads outside torch's pool may pass 1,
    # never the cores there are. Not recorded for a run on CUDA (device=auto takes a GPU where there is one).
    if torch.cuda.is_available():
        assert on_disk["cpu_share"] is None
    else:
        assert 0 < on_disk["cpu_share"] <= 1.05 * usable_cores()
    assert on_disk["task"] == "cls" and on_disk["attn"] == "moh" and on_disk["completed"] is True
    assert (on_disk["amp"], on_disk["amp_reason"]) == ("none", "train.amp=none")
    assert on_disk["active_heads"] == [6, 8] and on_disk["active_ratio"] == 0.75  # 2 layers x (2 shared + 1 routed)
    assert 0 < on_disk["active_head_flops_per_image"] <= on_disk["flops_per_image"]
    assert 0.0 <= on_disk["top1"] <= on_disk["top5"] <= 1.0 and on_disk["top1_best"] >= on_disk["top1"]
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert rows[0].split(",")[:5] == ["step", "epoch", "loss", "aux_loss", "lr"] and len(rows) == 3
    load = json.loads((run_dir / "head_load.json").read_text())
    assert (load["layers"], load["heads"], len(load["classes"])) == (2, [4, 4], 10)
    per_token = np.asarray(load["load"]).sum(axis=-1)  # heads used per token, averaged per class
    np.testing.assert_allclose(per_token, 3.0, atol=1e-5)
    assert "best.safetensors" in {p.name for p in run_dir.iterdir()}
    (ckpt,) = (run_dir / "checkpoints").iterdir()  # one complete unit, older ones removed
    assert sorted(p.name for p in ckpt.iterdir()) == ["evaluation.json", "manifest.json", "model.safetensors",
                                                      "state.pt"]
    state = torch.load(ckpt / "state.pt", weights_only=True)
    assert state["epoch"] == 2 and len(state["rng"]) == 1 and ckpt.name == f"step-{state['step']:09d}"


def test_resume_after_interruption_matches_uninterrupted(full_run, tmp_path):
    run_dir, results = full_run
    first = run_cls(cfg_of("train.stop_after_epoch=1"), tmp_path)
    assert first["completed"] is False
    saved_wall = latest_checkpoint(tmp_path).state()["clock"]["wall"]  # saved before epoch 1's evaluation
    resumed = run_cls(cfg_of("resume=true"), tmp_path)
    for key in ("top1", "top5", "top1_best", "train_steps"):
        assert resumed[key] == results[key], key
    # the training rate covers both epochs, not only the one trained after the resume
    counted = [latest_checkpoint(d).state()["throughput"]["items"] for d in (run_dir, tmp_path)]
    assert counted[0] == counted[1] > 0
    # so does the run's clock: the first process's seconds are in the resumed run's wall time
    first_wall = first["wall_time_s"]
    assert resumed["wall_time_s"] > first_wall > 0 and resumed["cpu_time_s"] > first["cpu_time_s"]
    # the resumed process's checkpoint counts on from the one it loaded; compared with the first run's
    # total it would race epoch 2's training against epoch 1's evaluation
    assert 0 < saved_wall <= first_wall and latest_checkpoint(tmp_path).state()["clock"]["wall"] > saved_wall
    a, b = latest_checkpoint(run_dir).weights(), latest_checkpoint(tmp_path).weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert len((tmp_path / "metrics.csv").read_text().splitlines()) == 3


def test_resume_without_checkpoint_says_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint.*resume=RUN_DIR"):
        run_cls(cfg_of("resume=true"), tmp_path)


def test_eval_of_saved_checkpoint_reproduces_its_accuracy(full_run, tmp_path):
    run_dir, results = full_run
    evaluated = run_cls(cfg_of("mode=eval", f"ckpt={run_dir}"), tmp_path)  # a run dir: its best.safetensors
    assert evaluated["top1"] == results["top1_best"]
    assert json.loads((tmp_path / "results.json").read_text())["ckpt"] == str(run_dir)
    last = run_cls(cfg_of("mode=eval", f"ckpt={latest_checkpoint(run_dir).path}"), tmp_path / "last")
    assert last["top1"] == results["top1"]  # a checkpoint folder: its model.safetensors (the last epoch)


def test_timm_weight_file_loads_into_mha_and_moh(tmp_path):
    from timm.models.vision_transformer import VisionTransformer

    ref = VisionTransformer(img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=16, depth=2,
                            num_heads=4, mlp_ratio=2.0)
    torch.save({"model": {f"module.{k}": v for k, v in ref.state_dict().items()}}, tmp_path / "deit.pth")
    x = torch.randn(2, 1, 8, 8)
    mha = build_cls_model(cfg_of("attn=mha"))
    load_model_weights(mha, tmp_path / "deit.pth")
    torch.testing.assert_close(mha.eval()(x), ref.eval()(x))
    moh = build_cls_model(cfg_of())
    load_model_weights(moh, tmp_path / "deit.pth")  # routers keep their initialisation
    assert torch.equal(moh.blocks[1].attn.qkv.weight, ref.blocks[1].attn.qkv.weight)
    wrong = build_cls_model(cfg_of("attn=mha", "data.num_classes=5"))
    with pytest.raises(ValueError, match=r"head.weight.*\(10, 16\), \(5, 16\).*data.num_classes"):
        load_model_weights(wrong, tmp_path / "deit.pth")


def test_continue_tuning_moh_from_our_mha_checkpoint(tmp_path):
    mha = run_cls(cfg_of("attn=mha", "train.epochs=1", "sched.warmup_epochs=0"), tmp_path / "mha")
    weights = tmp_path / "mha" / "best.safetensors"
    cfg = cfg_of("experiment=continue_tune_digits", f"model.init_from={weights}", "attn.shared_heads=2",
                 "attn.routed_topk=1", "train.epochs=1", "sched.warmup_epochs=0")
    tuned = run_cls(cfg, tmp_path / "moh")
    assert mha["active_ratio"] == 1.0 and tuned["active_ratio"] == 0.75
    model = build_cls_model(cfg)
    assert not [n for n, _ in model.named_parameters() if ".router." in n]  # l2norm router: parameter-free
    load_model_weights(model, weights)
    start = load_file(weights)
    assert torch.equal(model.blocks[0].attn.qkv.weight, start["blocks.0.attn.qkv.weight"])


def test_tiny_imagefolder_trains_with_deit_augmentation(tmp_path):
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            (tmp_path / "data" / split / cls).mkdir(parents=True)
            for i in range(4):
                pixels = rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(tmp_path / "data" / split / cls / f"{i}.png")
    cfg = cfg_of("data=imagefolder", f"data.root={tmp_path / 'data'}", "data.image_size=16", "data.num_classes=2",
                 "data.num_workers=0", "model=vit_tiny_patch4_32", "aug=deit", "train.batch_size=4",
                 "train.epochs=1", "sched.warmup_epochs=0")
    results = run_cls(cfg, tmp_path / "run")
    assert results["train_steps"] == 2 and 0.0 <= results["top1"] <= 1.0  # 8 images, batch 4, 1 epoch
    assert json.loads((tmp_path / "run" / "head_load.json").read_text())["classes"] == ["cat", "dog"]


# ------------------------------------------------------------------ a stop during the epoch's evaluation

class Crash(Exception):
    pass


def metrics_rows(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def same_row(a, b):
    """Two metrics.csv rows agree on everything but the timings."""
    return {k: v for k, v in a.items() if "images_per_s" not in k} == {
        k: v for k, v in b.items() if "images_per_s" not in k}


def count_calls(patch, name):
    """Patch ``trainer.<name>`` to count its calls (then call the real one); returns the list of calls."""
    real, calls = getattr(trainer, name), []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    patch.setattr(trainer, name, counted)
    return calls


def assert_matches_uninterrupted(run_dir, resumed, full_run):
    full_dir, results = full_run
    for key in ("top1", "top5", "top1_best", "train_steps", "completed"):
        assert resumed[key] == results[key], key
    assert json.loads((run_dir / "results.json").read_text())["top1"] == results["top1"]
    a, b = latest_checkpoint(full_dir).weights(), latest_checkpoint(run_dir).weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows, full_rows = metrics_rows(run_dir), metrics_rows(full_dir)
    assert [r["epoch"] for r in rows] == ["1", "2"]  # one row per epoch: none lost, none twice
    assert all(same_row(r, f) for r, f in zip(rows, full_rows, strict=True))


def test_crash_during_evaluation_loses_no_training(full_run, tmp_path, monkeypatch):
    """The epoch is saved before its evaluation: a resume evaluates it, then trains only the next epoch."""
    steps_per_epoch = full_run[1]["train_steps"] // 2

    def crash(*args, **kwargs):
        raise Crash

    with monkeypatch.context() as patch:
        patch.setattr(trainer, "evaluate", crash)  # epoch 1's evaluation
        with pytest.raises(Crash):
            run_cls(cfg_of(), tmp_path)
    found = latest_checkpoint(tmp_path)
    state = found.state()
    assert (state["epoch"], state["step"], state["pending_eval_row"]["epoch"]) == (1, steps_per_epoch, 1)
    assert found.evaluation() is None
    with monkeypatch.context() as patch:
        steps, evaluations = count_calls(patch, "clip_and_norm"), count_calls(patch, "evaluate")
        resumed = run_cls(cfg_of(), tmp_path)  # resume: auto
    assert (len(steps), len(evaluations)) == (steps_per_epoch, 2)  # epoch 2 trained; epochs 1 and 2 evaluated
    assert_matches_uninterrupted(tmp_path, resumed, full_run)


def test_stop_signal_during_evaluation_exits_after_it_and_resume_goes_on(full_run, tmp_path, monkeypatch):
    """SIGTERM while epoch 1 is evaluated: the evaluation stops after its current batch (promptly: a
    scheduler's kill follows a stop within seconds), the run exits preempted at that epoch's step (no
    step of epoch 2) with the evaluation pending, and the resume evaluates epoch 1 without training it again."""
    steps_per_epoch = full_run[1]["train_steps"] // 2
    real = trainer.evaluate

    def signal_then_evaluate(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(trainer, "evaluate", signal_then_evaluate)
        with pytest.raises(Preempted, match=f"SIGTERM after step {steps_per_epoch};"):
            run_cls(cfg_of(), tmp_path)
    assert json.loads((tmp_path / "results.json").read_text())["preempted"] is True
    found = latest_checkpoint(tmp_path)
    assert found.step == steps_per_epoch and found.state()["epoch"] == 1
    assert found.evaluation() is None and found.state()["pending_eval_row"] is not None
    with monkeypatch.context() as patch:
        steps, evaluations = count_calls(patch, "clip_and_norm"), count_calls(patch, "evaluate")
        resumed = run_cls(cfg_of(), tmp_path)
    assert (len(steps), len(evaluations)) == (steps_per_epoch, 2)  # epoch 1's evaluation, then epoch 2's
    assert_matches_uninterrupted(tmp_path, resumed, full_run)


def test_stop_signal_in_an_epochs_last_step_saves_the_epoch_and_resume_evaluates_it(full_run, tmp_path, monkeypatch):
    steps_per_epoch = full_run[1]["train_steps"] // 2
    real, calls = trainer.clip_and_norm, []

    def signal_at_last_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == steps_per_epoch:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(trainer, "clip_and_norm", signal_at_last_step)
        evaluations = count_calls(patch, "evaluate")
        with pytest.raises(Preempted, match=f"SIGTERM after step {steps_per_epoch};"):
            run_cls(cfg_of(), tmp_path)
    found = latest_checkpoint(tmp_path)
    assert (found.state()["epoch"], found.state()["batches"], len(evaluations)) == (1, 0, 0)  # not mid-epoch
    with monkeypatch.context() as patch:
        steps, evaluations = count_calls(patch, "clip_and_norm"), count_calls(patch, "evaluate")
        resumed = run_cls(cfg_of(), tmp_path)
    assert (len(steps), len(evaluations)) == (steps_per_epoch, 2)
    assert_matches_uninterrupted(tmp_path, resumed, full_run)


@pytest.mark.parametrize("stopped", ["after_recording", "before_recording", "checkpoint_without_pending_eval"])
def test_rerun_of_a_trained_run_without_results_writes_the_final_metrics(full_run, tmp_path, monkeypatch, stopped):
    """All epochs saved, results.json never written (killed after the evaluation was recorded, during
    it, or a checkpoint of a version that saved after evaluating): a re-run writes results with top-1."""
    full_dir, results = full_run
    run_dir = tmp_path / "run"
    shutil.copytree(full_dir, run_dir)
    (run_dir / "results.json").unlink()
    found = latest_checkpoint(run_dir)
    if stopped != "after_recording":
        (found.path / EVALUATION).unlink(missing_ok=True)
    if stopped == "checkpoint_without_pending_eval":
        state = {k: v for k, v in found.state().items() if k not in ("pending_eval_row", "throughput", "clock")}
        weights = found.weights()
        shutil.rmtree(found.path)
        save_checkpoint(run_dir, found.step, {MODEL_WEIGHTS: weights}, state)
    with monkeypatch.context() as patch:
        steps, evaluations = count_calls(patch, "clip_and_norm"), count_calls(patch, "evaluate")
        rerun = run_cls(cfg_of(), run_dir)
    assert len(steps) == 0 and len(evaluations) == (0 if stopped == "after_recording" else 1)
    on_disk = json.loads((run_dir / "results.json").read_text())
    for key in ("top1", "top5", "eval_loss", "top1_best", "completed"):
        assert rerun[key] == on_disk[key] == results[key], key
    if stopped != "checkpoint_without_pending_eval":
        assert rerun["train_images_per_s"] == results["train_images_per_s"]  # kept in the checkpoint, not 0
        assert rerun["wall_time_s"] > found.state()["clock"]["wall"]  # the training's time, then this process's
    else:  # the older checkpoint format kept no counts: the rate and times are unknown, not this process's
        assert rerun["train_images_per_s"] is None and on_disk["train_images_per_s"] is None
        assert rerun["wall_time_s"] is rerun["cpu_time_s"] is rerun["cpu_share"] is None
    rows, full_rows = metrics_rows(run_dir), metrics_rows(full_dir)
    assert all(same_row(r, f) for r, f in zip(rows, full_rows, strict=True))  # the final row once, as it was


def test_evaluation_record_rides_along_the_checkpoint_and_names_the_fix_when_altered(tmp_path):
    save_checkpoint(tmp_path, 3, {MODEL_WEIGHTS: {"w": torch.zeros(2)}}, {"step": 3})
    with pytest.raises(FileNotFoundError, match="holds no checkpoint; save step 4 before recording"):
        record_evaluation(tmp_path, 4, {"metrics": {}})
    record_evaluation(tmp_path, 3, {"metrics": {"top1": 0.1 + 0.2}})
    left = tmp_path / "checkpoints" / "step-000000003" / f".{EVALUATION}.123.abcd.tmp"  # a cut-off record
    left.write_text("{")
    remove_stale(tmp_path)
    found = latest_checkpoint(tmp_path)  # the record is outside the manifest: the checkpoint still verifies
    assert not left.exists() and found.step == 3 and EVALUATION not in found.files
    assert found.evaluation() == {"step": 3, "metrics": {"top1": 0.1 + 0.2}}  # floats survive exactly
    (found.path / EVALUATION).write_text('{"step": 2, "metrics": {}}')
    with pytest.raises(ValueError, match=r"does not record an evaluation of step 3.*delete the file"):
        found.evaluation()
    (found.path / EVALUATION).write_text('{"step": 3')
    with pytest.raises(ValueError, match=r"evaluation.json is not a JSON evaluation record.*delete it"):
        found.evaluation()


def test_amp_auto_times_the_classifier_without_touching_the_training(tmp_path, monkeypatch):
    """As for DiT: the probe of train.amp=auto runs the model's own step and leaves training as it was."""
    from visattn.engine import amp

    short = ["train.epochs=1", "sched.warmup_epochs=0"]
    run_cls(cfg_of(*short, "train.amp=none", "device=cpu"), tmp_path / "none")
    monkeypatch.setattr(amp, "cpu_bf16_is_faster", lambda: True)
    monkeypatch.setattr(amp, "BF16_MARGIN", 1e9)
    probed = run_cls(cfg_of(*short, "train.amp=auto", "device=cpu"), tmp_path / "auto")
    assert probed["amp"] == "none" and "this model's training step measured" in probed["amp_reason"]
    rows = [list(csv.DictReader((tmp_path / name / "metrics.csv").open())) for name in ("none", "auto")]
    assert len(rows[0]) == len(rows[1]) == 1
    assert [(r["loss"], r["top1"]) for r in rows[0]] == [(r["loss"], r["top1"]) for r in rows[1]]


def test_a_resumed_run_keeps_the_precision_auto_chose_at_its_start(tmp_path, monkeypatch):
    """As for DiT: the checkpoint records auto's choice and a resume takes it without probing."""
    from visattn.engine import amp

    monkeypatch.setattr(amp, "cpu_bf16_is_faster", lambda: True)
    monkeypatch.setattr(amp, "BF16_MARGIN", 1e9)  # fp32 wins at the start
    first = run_cls(cfg_of("train.stop_after_epoch=1", "train.amp=auto", "device=cpu"), tmp_path)
    assert latest_checkpoint(tmp_path).state()["amp"] == {"amp": "none", "amp_reason": first["amp_reason"]}

    def no_probe():
        raise AssertionError("a resumed run probed bf16 again")

    monkeypatch.setattr(amp, "cpu_bf16_is_faster", no_probe)
    resumed = run_cls(cfg_of("resume=true", "train.amp=auto", "device=cpu"), tmp_path)
    assert resumed["completed"] is True
    assert (resumed["amp"], resumed["amp_reason"]) == ("none", first["amp_reason"])
