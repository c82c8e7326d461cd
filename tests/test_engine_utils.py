import csv
import json
import random

import numpy as np
import pytest
import torch
import torch.nn as nn

from visattn.engine.distributed import all_reduce_sum, broadcast_object, init_distributed
from visattn.engine.ema import ModelEMA
from visattn.engine.results import RunClock, Throughput, count_params, write_results
from visattn.engine.runlog import MetricsLogger
from visattn.utils.checkpoint import (
    load_train_state,
    load_weights,
    rng_state,
    save_train_state,
    save_weights,
    set_rng_state,
)


def test_weights_roundtrip_safetensors_and_wrapped_pth(tmp_path):
    model = nn.Linear(3, 2)
    save_weights(tmp_path / "w.safetensors", model.state_dict())
    loaded = load_weights(tmp_path / "w.safetensors")
    assert torch.equal(loaded["weight"], model.weight)
    # DeiT-style file: {"model": {...}} with DDP prefixes
    torch.save({"model": {"module." + k: v for k, v in model.state_dict().items()}, "epoch": 3}, tmp_path / "d.pth")
    loaded = load_weights(tmp_path / "d.pth")
    assert set(loaded) == {"weight", "bias"} and torch.equal(loaded["bias"], model.bias)
    assert not list(tmp_path.glob(".*.tmp"))


def test_load_weights_picks_the_ema_copy_of_a_dit_training_checkpoint(tmp_path):
    model, ema = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
    torch.save({"model": model, "ema": ema, "opt": {}}, tmp_path / "0400000.pt")
    assert torch.equal(load_weights(tmp_path / "0400000.pt")["w"], model["w"])
    assert torch.equal(load_weights(tmp_path / "0400000.pt", prefer_ema=True)["w"], ema["w"])


def test_load_weights_missing_file_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        load_weights(tmp_path / "nope.pth")


def test_train_state_rejects_unloadable_objects(tmp_path):
    with pytest.raises(TypeError, match=r"state\['bad'\] is a object"):
        save_train_state(tmp_path / "s.pt", {"bad": object()})
    assert not (tmp_path / "s.pt").exists()


def test_rng_state_restores_every_generator(tmp_path):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    save_train_state(tmp_path / "s.pt", {"rng": rng_state(), "step": 4})
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    state = load_train_state(tmp_path / "s.pt")
    set_rng_state(state["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert state["step"] == 4


def test_ema_is_weighted_average():
    model = nn.Linear(2, 1)
    ema = ModelEMA(model, decay=0.75)
    start = ema.module.weight.clone()
    with torch.no_grad():
        model.weight.add_(4.0)
    ema.update(model)
    torch.testing.assert_close(ema.module.weight, 0.75 * start + 0.25 * model.weight)
    assert not ema.module.weight.requires_grad
    with pytest.raises(ValueError, match="decay=1.5"):
        ModelEMA(model, decay=1.5)


def test_single_process_distributed_helpers():
    info = init_distributed("cpu")
    assert (info.rank, info.world_size, info.is_main) == (0, 1, True)
    assert broadcast_object({"a": 1}) == {"a": 1}
    assert all_reduce_sum(torch.ones(2)).tolist() == [1.0, 1.0]


def test_more_ranks_than_gpus_is_refused_with_the_fix(monkeypatch):
    """torchrun --nproc_per_node=2 on a one-GPU machine: say so, instead of CUDA's "invalid device ordinal"."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match=r"local rank 1 .* 1 CUDA device.*--nproc_per_node=1.*device=cpu"):
        init_distributed(None)


def test_results_and_metrics_files(tmp_path):
    write_results(tmp_path, {"top1": torch.tensor(0.5), "nan": float("nan"), "shape": (1, 2)})
    assert json.loads((tmp_path / "results.json").read_text()) == {"top1": 0.5, "nan": None, "shape": [1, 2]}
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log({"step": 1, "loss": 2.0})
    logger.log({"step": 2, "loss": 1.0, "top1": 0.5, "head_load": [0.1, 0.9]})
    logger.close()
    resumed = MetricsLogger(tmp_path, tensorboard=False)  # keeps the rows, forgets those after step 1
    resumed.drop_after(1)
    resumed.log({"step": 2, "loss": 1.5})
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["loss"] for r in rows] == ["2.0", "1.5"] and "head_load" not in rows[0]
    assert count_params(nn.Linear(3, 2)) == 8
    tp = Throughput()
    tp.start()
    tp.stop(10)
    assert tp.items == 10 and tp.rate > 0


def test_throughput_laps_give_each_log_rows_own_rate():
    tp = Throughput()
    tp.add(100, 10.0)  # a slow start (compilation, warm-up)
    assert tp.lap() == 10.0
    tp.add(300, 1.0)
    assert tp.lap() == 300.0 and tp.rate == pytest.approx(400 / 11)  # the row's rate; the run's overall
    assert tp.lap() == 0.0  # nothing timed since
    tp.load_state_dict({"items": 1000, "seconds": 5.0})  # a resumed run: its first lap starts here
    tp.add(50, 0.5)
    assert tp.lap() == 100.0


def test_run_clock_adds_the_earlier_processes_and_refuses_a_partial_total():
    clock = RunClock()
    clock.load_state_dict({"wall": 100.0, "cpu": 90.0, "thread_seconds": 200.0})  # 2 threads, 45% busy
    rec = clock.record("cpu")
    assert 100 < rec["wall_time_s"] < 101 and 90 <= rec["cpu_time_s"] < 91
    assert rec["cpu_share"] == pytest.approx(0.45, abs=0.01)
    assert clock.record("cuda")["cpu_share"] is None
    clock.load_state_dict(None)  # a checkpoint that kept no totals: unknown, not this process's time
    assert clock.record("cpu") == {"wall_time_s": None, "cpu_time_s": None, "cpu_share": None}


def test_amp_auto_follows_the_cpu_probe_and_is_recorded(monkeypatch, caplog):
    import logging

    from visattn.engine import amp

    cpu = torch.device("cpu")
    for faster, dtype in ((True, torch.bfloat16), (False, None)):
        monkeypatch.setattr(amp, "cpu_bf16_is_faster", lambda faster=faster: faster)
        with caplog.at_level(logging.INFO):
            choice = amp.choose_amp("auto", cpu)
        assert choice.dtype == dtype and choice.record()["amp"] == ("bf16" if faster else "none")
        assert "mixed precision:" in caplog.text
    assert amp.choose_amp("none", cpu).dtype is None and amp.choose_amp("bf16", cpu).dtype == torch.bfloat16
    assert amp.normalize_amp(True) == "bf16" and amp.normalize_amp(False) == "none"
    with pytest.raises(ValueError, match=r"train.amp='fp16' is not known; use one of auto\|bf16\|none"):
        amp.normalize_amp("fp16")


def _sleepy_probe(slow_in_bf16: bool, calls: list[bool]):
    """A StepProbe whose step is slow (20 ms) in one precision: stands in for a model whose speed
    differs between fp32 and bf16 at its own shapes."""
    import time

    from visattn.engine.amp import StepProbe

    model = nn.Linear(4, 4)

    def loss() -> torch.Tensor:
        bf16 = torch.is_autocast_enabled("cpu")
        calls.append(bf16)
        time.sleep(0.02 if bf16 == slow_in_bf16 else 0.0)
        return model(torch.randn(2, 4)).square().mean()

    return StepProbe(model, loss)


@pytest.mark.parametrize("slow_in_bf16", [True, False])
def test_amp_auto_lets_the_models_own_step_overrule_a_favourable_matmul(monkeypatch, slow_in_bf16):
    from visattn.engine import amp

    monkeypatch.setattr(amp, "cpu_bf16_is_faster", lambda: True)
    calls: list[bool] = []
    probe = _sleepy_probe(slow_in_bf16, calls)
    rng = torch.get_rng_state()
    choice = amp.choose_amp("auto", torch.device("cpu"), probe)
    assert choice.dtype == (None if slow_in_bf16 else torch.bfloat16)
    assert "training step measured" in choice.reason and " ms in bf16 vs " in choice.reason
    assert True in calls and False in calls
    # the probe leaves no trace: torch's RNG where it was, no gradients left behind
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in probe.model.parameters())


class _ScriptedClock:
    """time.perf_counter for engine.amp: a probe step advances it by its cost times the machine's
    load at that call (the load of other work, scripted per call)."""

    def __init__(self, loads: list[float]):
        self.now, self.loads, self.calls = 0.0, loads, []

    def perf_counter(self) -> float:
        return self.now

    def step(self, bf16: bool, cost: float) -> None:
        self.calls.append(bf16)
        self.now += cost * (self.loads[len(self.calls) - 1] if len(self.calls) <= len(self.loads) else 1.0)


def _scripted_probe(monkeypatch, clock: _ScriptedClock, fp32_cost: float, bf16_cost: float):
    from visattn.engine import amp

    monkeypatch.setattr(amp, "time", clock)
    model = nn.Linear(4, 4)

    def loss() -> torch.Tensor:
        bf16 = torch.is_autocast_enabled("cpu")
        clock.step(bf16, bf16_cost if bf16 else fp32_cost)
        return model(torch.randn(2, 4)).square().mean()

    return amp.StepProbe(model, loss)


def test_amp_auto_probe_times_both_precisions_alternately_so_a_burst_of_load_does_not_decide(monkeypatch):
    """Equal step costs, other work slowing the machine 4x during the probe's first three steps: timed
    one precision after the other, fp32 would take all of the load and bf16 would look 4x faster."""
    from visattn.engine import amp

    monkeypatch.setattr(amp, "cpu_bf16_is_faster", lambda: True)
    clock = _ScriptedClock(loads=[4.0, 4.0, 4.0])
    choice = amp.choose_amp("auto", torch.device("cpu"), _scripted_probe(monkeypatch, clock, 0.02, 0.02))
    assert clock.calls == [False, True] * 3  # warm-up pair, then 2 timed pairs
    assert choice.dtype is None and "20 ms in bf16 vs 20 ms in fp32" in choice.reason


def test_amp_auto_probe_stops_after_the_warm_up_where_bf16_is_emulated(monkeypatch):
    from visattn.engine import amp

    monkeypatch.setattr(amp, "cpu_bf16_is_faster", lambda: True)
    clock = _ScriptedClock(loads=[])
    choice = amp.choose_amp("auto", torch.device("cpu"), _scripted_probe(monkeypatch, clock, 0.01, 0.2))
    assert clock.calls == [False, True] and choice.dtype is None and "200 ms in bf16 vs 10 ms" in choice.reason


def test_amp_auto_skips_the_model_probe_where_bf16_matmuls_are_slow(monkeypatch):
    from visattn.engine import amp

    monkeypatch.setattr(amp, "cpu_bf16_is_faster", lambda: False)
    calls: list[bool] = []
    choice = amp.choose_amp("auto", torch.device("cpu"), _sleepy_probe(False, calls))
    assert choice.dtype is None and "matmul measured slower" in choice.reason and calls == []
    calls.clear()
    assert amp.choose_amp("none", torch.device("cpu"), _sleepy_probe(False, calls)).dtype is None and calls == []


def test_cpu_bf16_probe_is_quick_and_cached():
    import time

    from visattn.engine.amp import cpu_bf16_is_faster

    t0 = time.perf_counter()
    first = cpu_bf16_is_faster()
    t1 = time.perf_counter()
    assert cpu_bf16_is_faster() is first and time.perf_counter() - t1 < 1e-3  # cached per process
    assert t1 - t0 < 2.0


def test_amp_auto_takes_a_saved_choice_without_probing(monkeypatch):
    from visattn.engine import amp

    def no_probe():
        raise AssertionError("probed although the checkpoint holds the choice")

    monkeypatch.setattr(amp, "cpu_bf16_is_faster", no_probe)
    saved = {"amp": "bf16", "amp_reason": "auto: measured at the start"}
    for device in (torch.device("cpu"), torch.device("cuda")):  # the saved choice holds on any device
        choice = amp.choose_amp("auto", device, saved=saved)
        assert (choice.dtype, choice.reason) == (torch.bfloat16, saved["amp_reason"])
    # an explicit setting is the user's word, saved choice or not
    assert amp.choose_amp("none", torch.device("cpu"), saved=saved).dtype is None
    with pytest.raises(ValueError, match=r"amp=bf16\|none, not 'fp16'"):
        amp.choose_amp("auto", torch.device("cpu"), saved={"amp": "fp16"})
