"""train_dit's machinery end to end on tiny shapes: the SD VAE loader, the latent cache, resume."""

import csv
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from visattn.data.latents import read_latent_cache
from visattn.engine.checkpoints import latest_checkpoint
from visattn.engine.dit.sampling import agreement_labels, all_labels
from visattn.engine.dit.setup import sample_settings
from visattn.engine.dit.trainer import run
from visattn.models.vae import load_sd_vae
from visattn.utils.machine import usable_cores

CONF = str(Path(__file__).resolve().parents[1] / "conf")
TINY_MODEL = [
    "dit.preset=DiT-T/2", "attn=moh", "+dit.overrides.hidden_size=32", "+dit.overrides.depth=2",
    "train.batch_size=8", "train.log_every=1", "train.tensorboard=false", "eval.enabled=false",
    "sample.steps=4", "sample.num_samples=3", "sample.grid=3",
    # runs compared bit for bit train in one precision: under auto each run's probe decides, and for a
    # model this small its timed bf16 vs fp32 step can fall either side of the margin (see engine.amp)
    "train.amp=none",
]


def config(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="train_dit", overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True)


@pytest.fixture(scope="module")
def tiny_vae_dir(tmp_path_factory):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(8, 16),
        layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=8,
    )
    path = tmp_path_factory.mktemp("vae") / "sd-vae-ft-ema"
    vae.save_pretrained(path)
    return path


def test_missing_vae_says_where_to_put_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="sd-vae-ft-ema"):
        load_sd_vae(tmp_path / "nowhere")


def test_the_vae_decodes_a_large_batch_in_chunks_with_the_same_images(tiny_vae_dir, monkeypatch):
    import visattn.models.vae as vae_module

    vae = load_sd_vae(tiny_vae_dir)
    latents = torch.randn(7, 4, 4, 4)
    whole = vae.autoencoder.decode(latents / vae.scale).sample
    sizes = []
    decode = vae.autoencoder.decode
    monkeypatch.setattr(vae.autoencoder, "decode", lambda z: sizes.append(len(z)) or decode(z))
    monkeypatch.setattr(vae_module, "DECODE_BATCH", 3)
    torch.testing.assert_close(vae.decode(latents), whole, atol=1e-5, rtol=1e-5)
    assert sizes == [3, 3, 1]


def test_latent_cache_round_trip_and_training_in_latent_space(tiny_vae_dir, tmp_path):
    vae_args = ["vae=sd", f"vae.path={tiny_vae_dir}", "vae.downsample=2", f"data.latents={tmp_path / 'cache'}"]
    out = run(config("mode=cache_latents", "cache.shard_size=16", "cache.batch_size=12",
                     "cache.max_images=40", *vae_args), tmp_path)
    assert out["shards"] == 3 and out["images"] == 40
    cache = read_latent_cache(tmp_path / "cache")
    assert cache.mean.shape == (40, 2, 4, 4, 4) and cache.scale == pytest.approx(0.18215)

    from visattn.data.sets.digits import load_digits_arrays

    images, labels = load_digits_arrays("train")
    vae = load_sd_vae(tiny_vae_dir)
    x = torch.from_numpy(images[:5]).permute(0, 3, 1, 2).float().div(127.5).sub(1).expand(-1, 3, -1, -1)
    for view, batch in enumerate((x, x.flip(-1))):
        mean, std = vae.encode_moments(batch)
        torch.testing.assert_close(cache.mean[:5, view].float(), mean, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(cache.std[:5, view].float(), std, atol=2e-3, rtol=2e-3)
    assert torch.equal(cache.labels, torch.from_numpy(labels[:40]))
    z, y = cache.batch(torch.arange(4))
    assert z.shape == (4, 4, 4, 4) and torch.equal(y, cache.labels[:4])

    run_dir = tmp_path / "run"
    run(config("train.steps=2", *TINY_MODEL, *vae_args), run_dir)
    ckpt = run_dir  # a run dir: its newest checkpoint's EMA weights
    trained = (run_dir / "results.json").read_text()
    with pytest.raises(ValueError, match="holds a training run's results.json, which mode=sample would replace"):
        run(config("mode=sample", f"ckpt={ckpt}", *TINY_MODEL, *vae_args), run_dir)
    assert (run_dir / "results.json").read_text() == trained
    sample_dir = tmp_path / "samples"
    run(config("mode=sample", f"ckpt={ckpt}", *TINY_MODEL, *vae_args), sample_dir)
    with np.load(sample_dir / "samples.npz") as f:
        assert f["arr_0"].shape == (3, 8, 8, 3) and f["arr_0"].dtype == np.uint8
        sample_cfg = sample_settings(config("mode=sample", *TINY_MODEL, *vae_args))
        np.testing.assert_array_equal(f["arr_1"], all_labels(sample_cfg, 3, 10))  # each sample's class
    assert (sample_dir / "samples.png").is_file()
    results = json.loads((sample_dir / "results.json").read_text())  # every mode writes results.json
    assert results["mode"] == "sample" and results["task"] == "dit" and results["num_samples"] == 3


def test_train_end_eval_scores_class_agreement_and_active_head_flops(tmp_path):
    """The final evaluation passes each sample's conditioning label to the scorer and to samples.npz;
    results.json holds class agreement (digits has a domain classifier) and both FLOPs counts."""
    overrides = [o for o in TINY_MODEL if o != "eval.enabled=false"]
    cfg = config("train.steps=1", *overrides, "eval.num_samples=8", "eval.head_load_images=16")
    results = run(cfg, tmp_path)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["class_agreement"] == results["class_agreement"]
    assert isinstance(on_disk["class_agreement"], float) and 0.0 <= on_disk["class_agreement"] <= 1.0
    assert on_disk["sfid"] is None and "left out" in on_disk["sfid_note"]  # 8 samples: far too few for sFID
    # The executed (eval) path may already skip heads; the active-head count never exceeds it.
    assert 0 < on_disk["active_head_flops_per_image"] <= on_disk["flops_per_image"]
    # CPU seconds over wall x torch threads: threads outside torch's pool (the loader, BLAS of the
    # scorer) can lift it above 1, never above the cores there are (1.6 seen on 2 cores, 1 thread).
    assert on_disk["cpu_time_s"] > 0
    if torch.cuda.is_available():  # device=auto trained on the GPU: no CPU share is recorded
        assert on_disk["cpu_share"] is None
    else:
        assert 0 < on_disk["cpu_share"] <= 1.05 * usable_cores()
    with np.load(tmp_path / "samples.npz") as f:
        assert f["arr_0"].shape[0] == 8
        np.testing.assert_array_equal(f["arr_1"], all_labels(sample_settings(cfg), 8, 10))


@pytest.mark.parametrize("progress", [True, False])
def test_train_progress_switches_the_bars_of_training_and_sampling(tmp_path, capsys, caplog, progress):
    """train.progress (both tasks' key): false keeps tqdm bars out of the logs of unattended runs, whose
    log still has the loss at every log step and the final scores."""
    overrides = [o for o in TINY_MODEL if o != "eval.enabled=false"]
    with caplog.at_level(logging.INFO):
        run(config("train.steps=2", *overrides, "eval.num_samples=8", "eval.head_load_images=0",
                   f"train.progress={str(progress).lower()}"), tmp_path)
    assert "step 1/2: loss " in caplog.text and "step 2/2: loss " in caplog.text
    assert "8 samples (digits extractor): fid " in caplog.text
    err = capsys.readouterr().err
    assert ("train: " in err and "sampling: " in err) == progress
    assert ("train: " in err or "sampling: " in err) == progress
    assert not (tmp_path / "head_load.json").exists()  # eval.head_load_images=0: no head load, no empty batch


def test_a_rank_without_head_load_images_runs_no_empty_batch(tmp_path):
    """Under DDP with fewer head-load images than ranks, a rank gets none: it must not run the
    model on an empty batch (MoH's eval path cannot reshape 0 tokens) but still join the reduction."""
    from visattn.engine.distributed import DistInfo
    from visattn.engine.dit.data import build_train_data
    from visattn.engine.dit.setup import build_diffusion, build_model
    from visattn.engine.dit.training import measure_head_load

    cfg = config(*TINY_MODEL, "eval.head_load_images=1")
    model = build_model(cfg)
    diffusion = build_diffusion(cfg, model.learn_sigma)
    second_rank = DistInfo(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"))
    load = measure_head_load(model, build_train_data(cfg), diffusion, cfg, second_rank)
    assert load["layers"] == 2 and all(value == 0 for layer in load["load"] for row in layer for value in row)


def test_dense_soft_weights_write_no_head_load(tmp_path):
    # Every token uses every head, so there is no selection to show (the same rule as classification).
    run(config("train.steps=1", *TINY_MODEL, "attn.shared_heads=4", "attn.routed_topk=0"), tmp_path)
    assert (tmp_path / "results.json").is_file()
    assert not (tmp_path / "head_load.json").exists()


def test_resume_continues_exactly(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    run(config("train.steps=4", "train.ckpt_every=2", *TINY_MODEL), straight)
    run(config("train.steps=2", *TINY_MODEL), split)
    resumed = run(config("train.steps=4", "train.ckpt_every=2", "resume=true", *TINY_MODEL), split)
    a, b = latest_checkpoint(straight), latest_checkpoint(split)
    assert a.step == b.step == 4
    # the rate covers every step (kept in the checkpoint), and a re-run of the finished run reports it
    assert b.state()["throughput"]["items"] == 4 * 8 and resumed["train_images_per_s"] > 0
    (split / "results.json").unlink()
    again = run(config("train.steps=4", "train.ckpt_every=2", *TINY_MODEL), split)
    assert again["train_images_per_s"] == pytest.approx(resumed["train_images_per_s"])
    # so do the training seconds: both processes' steps, not the (empty) last process's
    assert resumed["train_wall_time_s"] == pytest.approx(b.state()["throughput"]["seconds"])
    assert again["train_wall_time_s"] == pytest.approx(resumed["train_wall_time_s"]) and again["train_wall_time_s"] > 0
    # the run's clock covers every process too: the training's, then the re-run's (scoring) time
    assert again["wall_time_s"] > b.state()["clock"]["wall"] > resumed["train_wall_time_s"]
    for part in ("model.safetensors", "ema.safetensors"):
        wa, wb = a.weights(part), b.weights(part)
        for key in wa:
            assert torch.equal(wa[key], wb[key]), f"{part}: {key} differs after resume"
    rows = (split / "metrics.csv").read_text().strip().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["1", "2", "3", "4"]
    load = json.loads((split / "head_load.json").read_text())
    assert load["layers"] == 2 and load["heads"] == [4, 4] and len(load["load"][0]) == 10
    # Default MoH budget for 4 heads: 2 shared + 1 routed of 2 -> per class the loads sum to 3 heads.
    np.testing.assert_allclose(np.asarray(load["load"]).sum(-1), 3.0, rtol=1e-5)


def test_bad_settings_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="data.latents=DIR"):
        run(config("vae=sd", *TINY_MODEL), tmp_path)
    with pytest.raises(ValueError, match="mode='nope'"):
        run(config("mode=nope"), tmp_path)
    with pytest.raises(ValueError, match="ckpt=PATH"):
        run(config("mode=sample", *TINY_MODEL), tmp_path)


def test_sched_sets_the_lr_of_every_step_and_refuses_a_warmup_longer_than_training(tmp_path):
    """The classification vocabulary: warm-up in epochs of the training set, then cosine to min_lr;
    a row of metrics.csv logs the lr of the step it follows."""
    run(config("train.steps=4", "train.lr=1e-3", "sched=cosine", "sched.warmup_epochs=0", "sched.min_lr=0",
               *TINY_MODEL), tmp_path / "cosine")
    rows = list(csv.DictReader((tmp_path / "cosine" / "metrics.csv").open()))
    expected = [0.5e-3 * (1 + np.cos(np.pi * step / 4)) for step in range(4)]
    np.testing.assert_allclose([float(r["lr"]) for r in rows], expected, rtol=1e-6)
    constant = run(config("train.steps=2", "train.lr=1e-3", *TINY_MODEL), tmp_path / "constant")
    assert constant["config"]["sched"]["name"] == "constant"  # DiT's own recipe by default
    assert {float(r["lr"]) for r in csv.DictReader((tmp_path / "constant" / "metrics.csv").open())} == {1e-3}
    with pytest.raises(ValueError, match=r"sched.warmup_epochs=1 is \d+ steps of \d+ images at batch 8, "
                                         r"no fewer than train.steps=4; lower it"):
        run(config("train.steps=4", "sched=cosine", "sched.warmup_epochs=1", *TINY_MODEL), tmp_path / "warm")


def test_resume_with_scoring_continues_exactly(tmp_path):
    """A run that scores its samples (eval.enabled, the default) builds its scorer, whose extractor's
    initialisation draws from torch's generator, before the checkpoint's RNG is restored: the resumed
    steps see the same noise, timesteps and label dropout as an uninterrupted run's."""
    from visattn.metrics import ReferenceBatch, save_npz_batch

    reference = tmp_path / "ref.npz"  # a small reference keeps the scoring cheap
    save_npz_batch(reference, ReferenceBatch(np.random.default_rng(0).integers(0, 256, (8, 8, 8, 1), np.uint8)))
    scoring = [o for o in TINY_MODEL if o != "eval.enabled=false"] + [
        "eval.num_samples=4", "eval.head_load_images=0", "eval.fid_step0=false", "train.ckpt_every=2",
        f"eval.reference={reference}"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    run(config("train.steps=4", *scoring), straight)
    run(config("train.steps=2", *scoring), split)
    run(config("train.steps=4", "resume=true", *scoring), split)
    a, b = latest_checkpoint(straight), latest_checkpoint(split)
    assert a.step == b.step == 4
    for part in ("model.safetensors", "ema.safetensors"):
        wa, wb = a.weights(part), b.weights(part)
        for key in wa:
            assert torch.equal(wa[key], wb[key]), f"{part}: {key} differs after resume"


def test_latent_cache_of_a_folder_with_a_bad_file_keeps_each_latent_with_its_own_label(tiny_vae_dir, tmp_path):
    """data.bad_images=skip fills a bad file's slot with the next good file: its latent must carry that
    file's class, not the bad file's, and results.json lists the skipped file."""
    from PIL import Image
    from safetensors.torch import load_file

    root = tmp_path / "folder"
    for split in ("train", "val"):
        for name, value in (("a_black", 0), ("b_white", 255)):
            (root / split / name).mkdir(parents=True)
            for i in range(2):
                Image.new("RGB", (8, 8), (value,) * 3).save(root / split / name / f"{i}.png")
    (root / "train" / "a_black" / "z_bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")  # slot 2 -> b_white/0
    out = run(config("mode=cache_latents", "vae=sd", f"vae.path={tiny_vae_dir}", "vae.downsample=2", "data=imagefolder",
                     f"data.root={root}", "data.image_size=8", "data.num_classes=2", "data.bad_images=skip",
                     f"data.latents={tmp_path / 'cache'}", "cache.batch_size=2"), tmp_path / "run")
    shard = load_file(tmp_path / "cache" / "latents-00000.safetensors")
    first_black, first_white = shard["mean"][0, 0].float(), shard["mean"][3, 0].float()
    for mean, label in zip(shard["mean"][:, 0].float(), shard["labels"].tolist(), strict=True):
        assert torch.allclose(mean, first_white if label else first_black), "a latent carries another image's label"
    assert shard["labels"].tolist() == [0, 0, 1, 1, 1]
    assert [Path(f["path"]).name for f in out["skipped_files"]] == ["z_bad.png"]


def test_cache_latents_checks_the_data_before_loading_the_vae(tmp_path):
    """A wrong data.root names data.root, even when the VAE path is also missing."""
    with pytest.raises(FileNotFoundError, match=r"data.root="):
        run(config("mode=cache_latents", "vae=sd", f"vae.path={tmp_path / 'no_vae'}", "vae.downsample=2",
                   "data=imagefolder", f"data.root={tmp_path / 'no_data'}", "data.image_size=8", "data.num_classes=2",
                   f"data.latents={tmp_path / 'cache'}"), tmp_path / "run")


def test_first_log_row_after_a_preemption_averages_every_step_since_the_last_row(tmp_path, signal_at_step):
    import visattn.engine.dit.training as dit_train
    from visattn.engine.preempt import Preempted

    every_4 = [*TINY_MODEL, "train.steps=4", "train.log_every=4", "train.ckpt_every=100"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    run(config(*every_4), straight)
    signal_at_step(dit_train, 3)
    with pytest.raises(Preempted, match="after step 3"):
        run(config(*every_4), split)
    run(config(*every_4), split)  # resume: auto
    (a,), (b,) = (list(csv.DictReader((d / "metrics.csv").open())) for d in (straight, split))
    assert a["step"] == b["step"] == "4"
    assert float(b["loss"]) == pytest.approx(float(a["loss"]), rel=1e-6)


def test_class_agreement_needs_the_datas_own_classifier(caplog):
    labels = np.arange(4)
    fashion = config("data=fashion_mnist")
    assert agreement_labels(fashion, labels) is labels  # its domain classifier, chosen by default
    fashion["eval"]["extractor"] = "digits"  # digits' classes say nothing of clothes
    with caplog.at_level(logging.WARNING):
        assert agreement_labels(fashion, labels) is None
    assert "eval.extractor=digits classifies digits images, not data=fashion_mnist" in caplog.text
    folder = config("data=imagefolder", "data.root=/data")
    assert agreement_labels(folder, labels) is None  # Inception names ImageNet's classes, not the folder's


def test_amp_auto_times_the_model_without_touching_the_training(tmp_path, monkeypatch, caplog):
    """On a CPU whose matmul probe favours bf16, train.amp=auto times the run's own training step;
    the probe draws from no stream of the run, so the run trains exactly as with amp=none."""
    from visattn.engine import amp

    on_cpu = [*TINY_MODEL, "device=cpu"]  # the CPU probe (on CUDA, auto takes bf16 where it is supported)
    plain = run(config("train.steps=3", "train.amp=none", *on_cpu), tmp_path / "none")
    monkeypatch.setattr(amp, "cpu_bf16_is_faster", lambda: True)
    monkeypatch.setattr(amp, "BF16_MARGIN", 1e9)  # the probe runs, and fp32 wins whatever it measures
    with caplog.at_level(logging.INFO):
        probed = run(config("train.steps=3", *on_cpu, "train.amp=auto"), tmp_path / "auto")
    assert probed["amp"] == "none" and "this model's training step measured" in probed["amp_reason"]
    a, b = latest_checkpoint(tmp_path / "none"), latest_checkpoint(tmp_path / "auto")
    for key, value in a.weights("model.safetensors").items():
        assert torch.equal(value, b.weights("model.safetensors")[key]), key
    losses = [(tmp_path / name / "metrics.csv").read_text().splitlines() for name in ("none", "auto")]
    assert [row.split(",")[2] for row in losses[0]] == [row.split(",")[2] for row in losses[1]]
    assert plain["amp_reason"] == "train.amp=none"


def test_a_resumed_run_keeps_the_precision_auto_chose_at_its_start(tmp_path, monkeypatch):
    """A resume does not probe again: the checkpoint's choice holds, even where a probe now would
    choose the other precision."""
    from visattn.engine import amp

    auto = [*TINY_MODEL, "train.amp=auto", "train.ckpt_every=2", "device=cpu"]  # the CPU probe
    monkeypatch.setattr(amp, "cpu_bf16_is_faster", lambda: True)
    monkeypatch.setattr(amp, "BF16_MARGIN", 1e9)  # fp32 wins at the start
    run(config("train.steps=2", *auto), tmp_path)
    first = latest_checkpoint(tmp_path).state()["extra"]
    assert first["amp"] == "none" and "this model's training step measured" in first["amp_reason"]

    def no_probe():
        raise AssertionError("a resumed run probed bf16 again")

    monkeypatch.setattr(amp, "cpu_bf16_is_faster", no_probe)
    resumed = run(config("train.steps=4", "resume=true", *auto), tmp_path)
    assert (resumed["amp"], resumed["amp_reason"]) == ("none", first["amp_reason"])
    assert latest_checkpoint(tmp_path).state()["extra"]["amp"] == "none"


def test_labels_beyond_the_models_classes_are_refused_before_training(tmp_path):
    """digits has labels 0..9: with data.num_classes=9, label 9 would be guidance's null class."""
    with pytest.raises(ValueError, match=r"labels run from 0 to 9 but the model has data.num_classes=9 classes"):
        run(config("train.steps=1", "data.num_classes=9", *TINY_MODEL), tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def test_a_stop_during_the_final_sampling_exits_at_once_and_the_resume_samples_without_training(tmp_path,
                                                                                                 monkeypatch):
    """SIGTERM while the trained model samples for its scores: the sampling stops after its current batch
    (Preempted at the last step, whose checkpoint holds the weights), and the resumed run samples and
    scores with no training step, as an uninterrupted run does."""
    import signal

    import visattn.engine.dit.sampling as sampling
    from visattn.engine.preempt import Preempted

    overrides = [*TINY_MODEL, "train.steps=2", "eval.enabled=true", "eval.num_samples=8", "sample.batch_size=2",
                 "eval.head_load_images=0", "eval.fid_step0=false"]
    whole = run(config(*overrides), tmp_path / "whole")
    real, batches = sampling.sample_loop, []

    def stop_in_the_second_batch(*args, **kwargs):
        batches.append(1)
        if len(batches) == 2:
            signal.raise_signal(signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(sampling, "sample_loop", stop_in_the_second_batch)
    with pytest.raises(Preempted, match="SIGTERM after step 2"):
        run(config(*overrides), tmp_path / "stopped")
    assert len(batches) == 2  # not the 4 batches of 8 samples: it stopped after the batch the signal came in
    assert json.loads((tmp_path / "stopped" / "results.json").read_text())["preempted"] is True
    monkeypatch.setattr(sampling, "sample_loop", real)
    steps = []
    import visattn.engine.dit.training as dit_train

    monkeypatch.setattr(dit_train, "clip_and_norm", lambda *a, **k: steps.append(1) or torch.zeros(()))
    resumed = run(config(*overrides), tmp_path / "stopped")
    assert steps == [] and resumed["completed"] is True and resumed["train_steps"] == 2
    assert resumed["fid"] == whole["fid"]


def test_each_log_row_gives_the_images_per_s_of_its_own_steps(tmp_path):
    """A row's rate covers the steps since the row before (a compiled run's slow first steps do not hide
    its speed afterwards); the run's rate in results.json covers every step, so it is their
    step-weighted harmonic mean."""
    results = run(config("train.steps=6", *TINY_MODEL, "train.log_every=2"), tmp_path / "run")
    rates = [float(r["images_per_s"]) for r in csv.DictReader((tmp_path / "run" / "metrics.csv").open())]
    assert len(rates) == 3 and min(rates) > 0
    assert results["train_images_per_s"] == pytest.approx(3 / sum(1 / r for r in rates), rel=1e-9)
