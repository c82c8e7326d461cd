"""The GPU speed features, checked where a CPU can check them (issue 31): TF32 and compile settings
reach the run, AdamW is fused (its found_inf skips an update on the device), the foreach EMA is the
per-parameter update, a skipped step changes nothing, the device-side gate stops a diverging run as
the host-side guard did, the stop flag agrees over ranks, DiT's batches are pinned on CUDA, and the
training loops make no host read between their log steps."""

import collections
import copy
import json
import math
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import visattn.data
import visattn.engine.cls.trainer as cls_trainer
import visattn.engine.dit.training as dit_train
from visattn.engine.amp import apply_tf32
from visattn.engine.cls.trainer import run_cls
from visattn.engine.dit import data as dit_data
from visattn.engine.dit.trainer import run as run_dit
from visattn.engine.ema import ModelEMA
from visattn.engine.guard import GRADIENTS, NonFiniteError, NonFiniteGuard
from visattn.engine.optim import adamw, adamw_kind, build_optimizer
from visattn.engine.preempt import StopSignal
from visattn.engine.step import StepGate, clip_and_norm, compiled, optimizer_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_engine_faults import cls_cfg, dit_cfg  # noqa: E402  (the tiny configs of the fault tests)

CPU = torch.device("cpu")


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    model.register_buffer("seen", torch.zeros(2))
    return model


# ------------------------------------------------------------------ TF32, compile, fused AdamW

@pytest.fixture
def tf32_flags():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_tf32_is_set_for_cuda_only_and_reported(tf32_flags):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    assert apply_tf32(True, "cpu") is False  # nothing to set on CPU, and reported as off
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, False)
    assert apply_tf32(True, torch.device("cuda", 0)) is True
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (True, True)
    assert apply_tf32(False, "cuda") is False
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, False)
    with pytest.raises(ValueError, match="train.tf32='yes' must be true or false"):
        apply_tf32("yes", "cuda")


def test_both_trainers_apply_train_tf32_on_their_device_and_record_it(tmp_path, monkeypatch):
    calls = []

    def spy(enabled, device):
        calls.append((enabled, torch.device(device).type))
        return apply_tf32(enabled, device)

    monkeypatch.setattr(cls_trainer, "apply_tf32", spy)
    monkeypatch.setattr(dit_train, "apply_tf32", spy)
    cls = run_cls(cls_cfg("train.epochs=1", "train.tf32=false"), tmp_path / "cls")
    dit = run_dit(dit_cfg("train.steps=2"), tmp_path / "dit")
    assert calls == [(False, "cpu"), (True, "cpu")]
    for task, results in (("cls", cls), ("dit", dit)):
        assert results["tf32"] is False  # a CPU run: no TF32
        assert json.loads((tmp_path / task / "results.json").read_text())["tf32"] is False


def test_bad_tf32_and_compile_settings_are_refused_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match="train.compile=3 must be true, false or a torch.compile backend"):
        run_dit(dit_cfg("train.steps=2", "train.compile=3"), tmp_path / "a")
    with pytest.raises(ValueError, match="train.tf32='on' must be true or false"):
        run_cls(cls_cfg("train.tf32=on"), tmp_path / "b")
    with pytest.raises(ValueError, match="train.compile=0"):
        compiled(nn.Linear(2, 2), 0)


def test_adamw_is_fused_on_cuda_and_cpu():
    assert adamw_kind("cuda") == {"fused": True} and adamw_kind(CPU) == {"fused": True}
    model = tiny_model()
    optim = {"name": "adamw", "lr": 1e-3, "weight_decay": 0.05, "betas": [0.9, 0.999], "eps": 1e-8}
    assert build_optimizer(model, optim).defaults["fused"] is True
    assert adamw(model.parameters(), CPU, lr=1e-3).defaults["fused"] is True


# ------------------------------------------------------------------ EMA, skipped steps

def old_ema_update(ema_module: nn.Module, model: nn.Module, decay: float) -> None:
    """The update before the foreach one: a lerp_ per parameter, buffers copied."""
    with torch.no_grad():
        ema_params = dict(ema_module.named_parameters())
        for name, param in model.named_parameters():
            ema_params[name].lerp_(param.detach().to(ema_params[name].dtype), 1.0 - decay)
        ema_buffers = dict(ema_module.named_buffers())
        for name, buf in model.named_buffers():
            ema_buffers[name].copy_(buf)


@pytest.mark.parametrize("decay", [0.9999, 0.75, 0.3])  # lerp takes another formula past weight 0.5
def test_foreach_ema_equals_the_per_parameter_update_bit_for_bit(decay):
    model = tiny_model()
    ema, masked = ModelEMA(model, decay), ModelEMA(model, decay)
    reference = copy.deepcopy(ema.module)
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
            model.seen.add_(1)
        old_ema_update(reference, model, decay)
        ema.update(model)
        masked.update(model, torch.tensor(True))
        for a, b, c in zip(reference.state_dict().values(), ema.state_dict().values(),
                           masked.state_dict().values(), strict=True):
            assert torch.equal(a, b) and torch.equal(a, c)


def nan_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, math.nan)


@pytest.mark.parametrize("fused", [True, False])  # fused: on the device (found_inf); else the host decides
def test_a_skipped_step_leaves_weights_optimizer_state_and_ema_exactly_as_they_were(fused):
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    ema = ModelEMA(model, 0.9)
    gate = StepGate(NonFiniteGuard(3, "test"), StopSignal(), CPU, grad_what=GRADIENTS)
    loss = model(torch.randn(4, 6)).square().mean()
    loss.backward()
    apply = gate.check(0, loss, clip_and_norm(model.parameters(), None))
    optimizer_step(opt, apply)
    ema.update(model, apply)
    assert bool(apply) and opt.state[model[0].weight]["step"].item() == 1
    before = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), copy.deepcopy(ema.state_dict()))
    nan_grads(model)
    apply = gate.check(1, torch.tensor(1.0), clip_and_norm(model.parameters(), None))
    assert not bool(apply)
    optimizer_step(opt, apply)
    ema.update(model, apply)
    after = (model.state_dict(), opt.state_dict(), ema.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(before[0].values(), after[0].values(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(before[2].values(), after[2].values(), strict=True))
    for key, state in before[1]["state"].items():
        assert all(torch.equal(v, after[1]["state"][key][k]) for k, v in state.items())


def test_the_gradient_check_computes_no_norm_without_clipping():
    model = tiny_model()
    model(torch.randn(4, 6)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert clip_and_norm(model.parameters(), None).item() == 0.0
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters(), strict=True))  # untouched
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    torch.testing.assert_close(clip_and_norm(model.parameters(), 1e-3), norm)  # with clipping: the norm
    model[0].weight.grad[0, 0] = math.inf
    assert clip_and_norm(model.parameters(), None).item() == math.inf


# ------------------------------------------------------------------ the device-side gate

SEQUENCE = [(1.0, 1.0), (math.nan, 1.0), (1.0, 2.0), (1.0, math.inf), (math.inf, 1.0), (1.0, math.nan),
            (1.0, 1.0), (1.0, 1.0)]  # with limit 2: step 5 is the 3rd in a row and stops the run


def test_the_gate_decides_like_the_guard_and_stops_at_the_read_with_the_same_error():
    host, decisions = NonFiniteGuard(2, "lr"), []
    with pytest.raises(NonFiniteError) as expected:
        for step, (loss, norm) in enumerate(SEQUENCE):
            decisions.append(host.check(step, loss, norm))
    assert decisions == [True, False, True, False, False]  # then step 5 raised
    guard = NonFiniteGuard(2, "lr")
    gate = StepGate(guard, StopSignal(), CPU)
    applied = [gate.check(step, torch.tensor(loss), torch.tensor(norm)) for step, (loss, norm) in enumerate(SEQUENCE)]
    assert [bool(a) for a in applied] == [*decisions, False, False, False]  # no update after the limit
    with pytest.raises(NonFiniteError) as raised:
        gate.sync(len(SEQUENCE))  # read later than the tripping step: the same error
    assert str(raised.value) == str(expected.value)
    assert raised.value.failure == expected.value.failure
    assert (guard.consecutive, guard.skipped) == (3, 4)


def test_the_gate_logs_skips_at_the_read_and_resumes_from_the_guards_counts(caplog):
    guard = NonFiniteGuard(5, "lr")
    guard.load_state_dict({"consecutive": 2, "skipped": 7})  # as a resumed run's checkpoint gives them
    gate = StepGate(guard, StopSignal(), CPU, grad_what=GRADIENTS)
    gate.check(10, torch.tensor(1.0), torch.tensor(math.inf))
    with caplog.at_level("WARNING"):
        assert gate.sync(11, torch.tensor(0.5)) == [0.5]
    assert (guard.consecutive, guard.skipped) == (3, 8)
    assert "1 update(s) skipped" in caplog.text and "the last at step 10: gradients nan/inf" in caplog.text
    for step in range(11, 14):
        gate.check(step, torch.tensor(1.0), torch.tensor(math.inf))
    with pytest.raises(NonFiniteError, match=r"step 13: the gradients held nan/inf for 6 steps in a row"):
        gate.sync(14)


def test_the_stop_flag_is_the_handlers_in_one_process_and_agreed_a_step_late_on_cuda_ddp():
    stop = StopSignal()
    one = StepGate(NonFiniteGuard(5, ""), stop, CPU)
    ddp_cpu = StepGate(NonFiniteGuard(5, ""), stop, CPU, distributed=True)  # gloo: read at once
    ddp_lag = StepGate(NonFiniteGuard(5, ""), stop, CPU, distributed=True, lag=True)  # as on CUDA
    finite = torch.tensor(1.0)
    seen = []
    for step in range(3):
        if step == 1:
            stop.received = 15
        for gate in (one, ddp_cpu, ddp_lag):
            gate.check(step, finite, finite)
        seen.append((one.stop_now(), ddp_cpu.stop_now(), ddp_lag.stop_now()))
    assert seen == [(False, False, False), (True, True, False), (True, True, True)]


def test_dit_batches_go_through_pinned_memory_on_cuda_only(monkeypatch):
    pinned, moved = [], []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self.shape) or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, device, non_blocking=False: moved.append(non_blocking) or self)
    x, y = torch.zeros(2, 1, 4, 4), torch.zeros(2, dtype=torch.long)
    dit_data.to_device(x, y, CPU)
    assert pinned == [] and moved == [True, True]
    dit_data.to_device(x, y, torch.device("cuda", 0))
    assert pinned == [x.shape, y.shape]


# ------------------------------------------------------------------ compile

@pytest.mark.parametrize("task", ["cls", "dit"])
def test_train_compile_trains_both_loops_like_eager(task, tmp_path):
    """aot_eager: dynamo's graph capture and AOT autograd, without inductor's C++ build (minutes on
    two loaded cores); the losses follow the eager run's."""
    if task == "cls":
        runs = {c: run_cls(cls_cfg("train.epochs=1", f"train.compile={c}"), tmp_path / c) for c in ("false", "aot_eager")}
    else:
        runs = {c: run_dit(dit_cfg("train.steps=3", f"train.compile={c}"), tmp_path / c) for c in ("false", "aot_eager")}
    losses = {c: [r.split(",")[2] for r in (tmp_path / c / "metrics.csv").read_text().splitlines()[1:]]
              for c in runs}
    assert len(losses["false"]) > 0
    for eager, comp in zip(losses["false"], losses["aot_eager"], strict=True):
        assert float(comp) == pytest.approx(float(eager), rel=1e-4, abs=1e-6)


# ------------------------------------------------------------------ no host reads between log steps

SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
            "equal", "is_nonzero", "allclose", "repeat_interleave"}
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")
DATA_PIPELINE = (str(Path(torch.utils.data.__file__).parent), str(Path(visattn.data.__file__).parent))


class HostReads(TorchDispatchMode):
    """Every read of a tensor's value on the host (``item`` and kin, ``tolist``, ``numpy``; on the
    dispatcher: ``_local_scalar_dense`` and the ops whose output size needs one, like ``nonzero``),
    tagged with the training step it came in (``clip_and_norm`` calls so far). Reads made by the
    host-side data pipeline are left out: its tensors are built on the host and never were the device's."""

    def __init__(self, monkeypatch, module) -> None:
        super().__init__()
        self.steps = 0
        self.reads: list[tuple[int, str, str]] = []
        real = module.clip_and_norm

        def counting(params, clip):
            self.steps += 1
            return real(params, clip)

        monkeypatch.setattr(module, "clip_and_norm", counting)
        for name in HOST_READS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def _note(self, what: str) -> None:
        stack = traceback.extract_stack()
        if any(f.filename.startswith(DATA_PIPELINE) for f in stack):
            return
        caller = next((f for f in reversed(stack) if "test_gpu_features" not in f.filename
                       and "/torch/_tensor.py" not in f.filename and "_python_dispatch" not in f.filename), stack[-1])
        self.reads.append((self.steps, what, f"{caller.filename}:{caller.lineno}"))

    def _wrap(self, name, real):
        def read(tensor, *args, **kwargs):
            self._note(name)
            return real(tensor, *args, **kwargs)

        return read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in SYNC_OPS:
            self._note(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def between_log_steps(reads, allowed: set[int]) -> list[tuple[int, str, str]]:
    """The reads made during a step that is no log, save or epoch-end step (0: before training)."""
    return [r for r in reads if r[0] not in allowed and r[0] != 0]


def test_the_dit_loop_reads_nothing_on_the_host_between_log_steps(tmp_path, monkeypatch):
    steps, every = 12, 4
    with HostReads(monkeypatch, dit_train) as reads:
        run_dit(dit_cfg(f"train.steps={steps}", f"train.log_every={every}", "train.ckpt_every=100"), tmp_path)
    assert reads.steps == steps
    assert {r[0] for r in reads.reads} - {0} <= {4, 8, 12}  # the log steps (12: also the final save)
    assert between_log_steps(reads.reads, {4, 8, 12}) == []
    assert any(r[0] == 4 for r in reads.reads)  # the log step reads (the counter works)


def test_the_classification_loop_reads_nothing_on_the_host_between_log_steps(tmp_path, monkeypatch):
    every = 4
    with HostReads(monkeypatch, cls_trainer) as reads:
        results = run_cls(cls_cfg("train.epochs=2", f"train.log_every={every}"), tmp_path)
    per_epoch = results["train_steps"] // 2
    allowed = {s for s in range(1, results["train_steps"] + 1) if s % every == 0} | {per_epoch, 2 * per_epoch}
    assert reads.steps == results["train_steps"] and per_epoch % every  # an epoch's end is no log step
    bad = between_log_steps(reads.reads, allowed)
    assert bad == [], collections.Counter((s, w, where) for s, w, where in bad)
    assert any(r[0] == every for r in reads.reads)


def test_train_compile_true_builds_with_inductor_and_trains(tmp_path):
    """SLOW (about a minute on two loaded cores: inductor generates and compiles C++ for the forward
    and backward graphs). The default backend through the DiT loop, the one a GPU run takes."""
    results = run_dit(dit_cfg("train.steps=2", "train.compile=true"), tmp_path)
    assert results["train_steps"] == 2 and math.isfinite(results["skipped_steps"]) and results["skipped_steps"] == 0
