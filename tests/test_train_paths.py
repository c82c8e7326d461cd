"""MoH's training paths under impl=auto (visattn.attention.train_paths) and train.attn_paths in runs."""

import contextlib
import json

import pytest
import torch
import torch.nn as nn

import visattn.kernels as kernels
from visattn.attention import apply_train_paths, build_attention, choose_train_paths
from visattn.attention.moh import REFERENCE_PATH
from visattn.attention.train_paths import KERNEL_PATH, attention_layers, probed_layers
from visattn.engine.checkpoints import latest_checkpoint
from visattn.engine.moh_paths import (
    BEFORE_RECORDS,
    RECORD_KEY,
    check_attn_paths,
    saved_train_paths,
    settle_train_paths,
)


@pytest.fixture
def kernel():
    if kernels.moh_routed_heads_op(torch.float32, blas=False) is None:
        pytest.skip("no C++ toolchain: the PyTorch path runs instead")


class Tiny(nn.Module):
    """Two MoH layers (one of a named path), a batch norm (buffers) and dropout (random state)."""

    def __init__(self, impl_b: str = "auto") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.BatchNorm1d(7)
        self.drop = nn.Dropout(0.5)
        self.a = build_attention("moh", 32, num_heads=8, shared_heads=2, routed_topk=2)
        self.b = build_attention("moh", 32, num_heads=8, shared_heads=2, routed_topk=3, impl=impl_b)

    def forward(self, x):  # x: [B, N=7, C=32]
        return self.b(self.a(self.drop(self.norm(x))))


def scripted(times):
    """A timer giving each option a fixed time (no run: the decision alone is tested); an option it does not name
    (SDPA's reference, the small-heads kernel) takes 2.0, slower than any it names."""
    return lambda path, run: times.get(path, 2.0)


def test_probe_keeps_the_kernel_only_where_it_wins_by_the_margin(kernel):
    model, x = Tiny(), torch.randn(4, 7, 32)
    assert list(probed_layers(model)) == ["a", "b"]
    faster = choose_train_paths(model, lambda: model(x), timer=scripted({REFERENCE_PATH: 1.0, KERNEL_PATH: 0.5}))
    assert faster["paths"] == {"a": KERNEL_PATH, "b": KERNEL_PATH}
    assert faster["times_ms"]["a"] == {REFERENCE_PATH: 1000.0, SMALL: 2000.0, KERNEL_PATH: 500.0}
    assert faster["attention"] == {}
    near = choose_train_paths(model, lambda: model(x), timer=scripted({REFERENCE_PATH: 1.0, KERNEL_PATH: 0.99}))
    assert near["paths"] == {"a": REFERENCE_PATH, "b": REFERENCE_PATH}  # within the 2% margin: masked dense
    named = Tiny(impl_b="dense")
    assert list(probed_layers(named)) == ["a"]  # a layer whose impl names a path is not probed
    record = choose_train_paths(named, lambda: named(x), timer=scripted({REFERENCE_PATH: 1.0, KERNEL_PATH: 0.5}))
    assert record["paths"] == {"a": KERNEL_PATH}


SMALL = "small_attention"


class TinyMHA(nn.Module):
    """Two MHA layers and one whose attention dropout keeps it on SDPA."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = build_attention("mha", 32, num_heads=8)
        self.b = build_attention("mha", 32, num_heads=8)
        self.dropped = build_attention("mha", 32, num_heads=8, attn_drop=0.1)

    def forward(self, x):  # x: [B, N=7, C=32]
        return self.dropped(self.b(self.a(x)))


def test_the_probe_chooses_the_small_heads_kernel_per_layer_and_a_record_sets_it(kernel):
    model, x = TinyMHA(), torch.randn(4, 7, 32)
    assert list(attention_layers(model)) == ["a", "b"] and probed_layers(model) == {}
    named = nn.ModuleDict({"dense": Tiny(impl_b="dense").b, "own": Tiny(impl_b="sparse_projections").b})
    assert list(attention_layers(named)) == ["dense"]  # a path of its own does not train through sdpa
    record = choose_train_paths(model, lambda: model(x), timer=scripted({"sdpa": 1.0, SMALL: 0.5}))
    assert record["attention"] == {"a": SMALL, "b": SMALL} and record["paths"] == {}
    assert record["times_ms"]["a"] == {"sdpa": 1000.0, SMALL: 500.0}
    near = choose_train_paths(model, lambda: model(x), timer=scripted({"sdpa": 1.0, SMALL: 0.99}))
    assert near["attention"] == {}  # within the margin: SDPA
    apply_train_paths(model, record)
    assert [m.train_attention for m in (model.a, model.b, model.dropped)] == [SMALL, SMALL, "sdpa"]
    apply_train_paths(model, {"paths": {}})  # a record from before the field: SDPA, as those runs trained
    assert model.a.train_attention == "sdpa"
    moh = Tiny()  # a MoH layer weighs the three: the small kernel here, on the masked dense path
    both = choose_train_paths(moh, lambda: moh(x), timer=scripted({REFERENCE_PATH: 1.0, SMALL: 0.5, KERNEL_PATH: 0.8}))
    assert both["paths"] == {"a": REFERENCE_PATH, "b": REFERENCE_PATH} and both["attention"] == {"a": SMALL, "b": SMALL}
    with pytest.raises(ValueError, match=r"no softmax attention layer for: \['c'\].*\['a', 'b'\]"):
        apply_train_paths(model, {"attention": {"c": SMALL}})
    with pytest.raises(ValueError, match=r"training attention of \['a'\] is not 'small_attention'"):
        apply_train_paths(model, {"attention": {"a": "flash"}})
    bf16 = choose_train_paths(model, lambda: model(x), lambda: torch.autocast("cpu", dtype=torch.bfloat16),
                              timer=scripted({}))
    assert bf16["times_ms"] == {}  # the kernel serves float32: nothing to time under bf16 autocast


def test_the_probe_leaves_no_trace(kernel):
    model, x = Tiny().eval(), torch.randn(4, 7, 32)
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    record = choose_train_paths(model, lambda: model(x))  # the real timer: every option runs forward and backward
    assert set(record["paths"]) == {"a", "b"} and set(record["times_ms"]["a"]) == {REFERENCE_PATH, SMALL, KERNEL_PATH}
    assert not model.training and torch.equal(rng, torch.random.get_rng_state())
    assert model.a.train_path == REFERENCE_PATH and model.a.train_attention == "sdpa"  # the settings as they were
    assert all(p.grad is None for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, buffers[key]), key  # batch-norm statistics included


def test_a_layer_trains_on_its_train_path_and_equals_the_masked_dense_path(kernel):
    torch.manual_seed(1)
    dense = build_attention("moh", 32, num_heads=8, shared_heads=2, routed_topk=2).train()
    fast = build_attention("moh", 32, num_heads=8, shared_heads=2, routed_topk=2).train()
    fast.load_state_dict(dense.state_dict())
    apply_train_paths(nn.Sequential(fast), {"paths": {"0": KERNEL_PATH}})
    assert fast.train_path == KERNEL_PATH and dense.train_path == REFERENCE_PATH
    x = torch.randn(3, 9, 32)
    outs = []
    for layer in (dense, fast):
        out = layer(x)
        (out.square().mean() + 0.01 * layer.aux_loss).backward()
        outs.append(out)
    assert fast.last_path == KERNEL_PATH and dense.last_path is None  # the dense layer never left forward's path
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(fast.named_parameters(), dense.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast(x)  # the kernel serves float32: bf16 trains on the masked dense path, not the PyTorch fallback
    assert fast.last_path == REFERENCE_PATH


def test_wrong_paths_and_layers_are_refused_with_what_exists():
    layer = build_attention("moh", 32, num_heads=8, shared_heads=2, routed_topk=2)
    with pytest.raises(ValueError, match=r"train_path='sparse_projections' is not a training path.*masked_dense"):
        layer.train_path = "sparse_projections"
    normed = build_attention("moh", 32, num_heads=8, shared_heads=2, routed_topk=2, qk_norm=True)
    with pytest.raises(ValueError, match="it has: masked_dense$"):
        normed.train_path = KERNEL_PATH  # the kernel does not normalise queries: no kernel path
    dense_soft = build_attention("moh", 32, num_heads=8, shared_heads=8, routed_topk=0)
    dense_soft.train_path = KERNEL_PATH  # every head on: the loops compute them all
    with pytest.raises(ValueError, match=r"no probed MoH layer for: \['c'\].*\['a', 'b'\]"):
        apply_train_paths(Tiny(), {"paths": {"c": KERNEL_PATH}})
    with pytest.raises(ValueError, match="train.attn_paths='fast' is not known; use dense or probe"):
        check_attn_paths("fast")


def test_settle_probes_only_a_fresh_probe_run(kernel):
    model, x = Tiny(), torch.randn(4, 7, 32)

    def no_forward():
        raise AssertionError("probed")

    none = settle_train_paths(model, "dense", no_forward, contextlib.nullcontext, None)
    assert none["paths"] == {} and model.a.train_path == REFERENCE_PATH
    saved = {"paths": {"a": KERNEL_PATH}, "times_ms": {}, "device": "x", "reason": "probe"}
    kept = settle_train_paths(model, "probe", no_forward, None, saved)
    assert kept == saved and model.a.train_path == KERNEL_PATH and model.b.train_path == REFERENCE_PATH
    assert settle_train_paths(model, "probe", no_forward, None, None, compile=True)["paths"] == {}
    assert model.a.train_path == REFERENCE_PATH
    fresh = settle_train_paths(model, "probe", lambda: model(x), contextlib.nullcontext, None)
    assert set(fresh["paths"]) == {"a", "b"}
    assert saved_train_paths(None) is None and saved_train_paths({}) == BEFORE_RECORDS  # an older checkpoint
    model.b.impl = "dense"  # force_resume after attn.impl changed: b no longer probes; its saved path is dropped
    both = {**saved, "paths": {"a": KERNEL_PATH, "b": KERNEL_PATH}}
    assert settle_train_paths(model, "probe", no_forward, None, both)["paths"] == {"a": KERNEL_PATH}


def test_a_run_records_its_probe_and_a_resume_keeps_it(kernel, tmp_path, monkeypatch):
    """train.attn_paths=probe in a classification run: rank 0's choice in results.json and every checkpoint; the
    resumed run applies the saved record without probing (here the probe would choose otherwise)."""
    from test_cls_train import cfg_of

    import visattn.attention.train_paths as train_paths
    from visattn.engine.cls.trainer import run_cls

    monkeypatch.setattr(train_paths, "default_timer", scripted({REFERENCE_PATH: 1.0, KERNEL_PATH: 0.5}))
    first = run_cls(cfg_of("train.stop_after_epoch=1", "train.attn_paths=probe", "device=cpu"), tmp_path)
    chosen = first[RECORD_KEY]["paths"]
    assert chosen and set(chosen.values()) == {KERNEL_PATH}
    assert latest_checkpoint(tmp_path).state()[RECORD_KEY]["paths"] == chosen

    def no_probe(*args, **kwargs):
        raise AssertionError("a resumed run probed its training paths again")

    monkeypatch.setattr("visattn.engine.moh_paths.choose_train_paths", no_probe)
    resumed = run_cls(cfg_of("resume=true", "train.attn_paths=probe", "device=cpu"), tmp_path)
    assert resumed["completed"] is True and resumed[RECORD_KEY]["paths"] == chosen
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk[RECORD_KEY]["paths"] == chosen
    default = run_cls(cfg_of("train.epochs=1", "sched.warmup_epochs=0", "device=cpu"), tmp_path / "dense")
    assert default[RECORD_KEY]["paths"] == {} and default[RECORD_KEY]["reason"] == "train.attn_paths=dense"


def test_a_probed_dit_run_resumes_bit_for_bit_though_a_new_probe_would_choose_otherwise(kernel, tmp_path,
                                                                                          monkeypatch):
    from test_dit_train import TINY_MODEL, config

    import visattn.attention.train_paths as train_paths
    from visattn.engine.dit.trainer import run

    probe = [*TINY_MODEL, "train.attn_paths=probe"]
    monkeypatch.setattr(train_paths, "default_timer", scripted({REFERENCE_PATH: 1.0, KERNEL_PATH: 0.5}))
    straight = run(config("train.steps=4", "train.ckpt_every=2", *probe), tmp_path / "straight")
    run(config("train.steps=2", *probe), tmp_path / "split")
    monkeypatch.setattr(train_paths, "default_timer", scripted({REFERENCE_PATH: 0.5, KERNEL_PATH: 1.0}))
    resumed = run(config("train.steps=4", "train.ckpt_every=2", "resume=true", *probe), tmp_path / "split")
    assert set(straight[RECORD_KEY]["paths"].values()) == {KERNEL_PATH}
    assert resumed[RECORD_KEY] == straight[RECORD_KEY]  # the saved record, not the new timer's choice
    a, b = latest_checkpoint(tmp_path / "straight"), latest_checkpoint(tmp_path / "split")
    assert b.state()["extra"][RECORD_KEY]["paths"] == straight[RECORD_KEY]["paths"]
    for key, value in a.weights("model.safetensors").items():
        assert torch.equal(value, b.weights("model.safetensors")[key]), key


def test_flop_counts_see_the_masked_dense_path_whatever_the_training_path(kernel):
    """Under a Python dispatch mode (the FLOP counter) the kernel does not run: training takes the masked
    dense path, so the dense forward that active-head FLOPs start from is the same either way."""
    from visattn.utils.flops import active_head_flops

    model, x = Tiny(), torch.randn(4, 7, 32)
    before = active_head_flops(model, x)
    apply_train_paths(model, {"paths": {"a": KERNEL_PATH, "b": KERNEL_PATH}})
    assert active_head_flops(model, x) == before
    assert model.a.last_path == REFERENCE_PATH
    model.train()(x)
    assert model.a.last_path == KERNEL_PATH  # outside the counter, the kernel


def test_straight_through_layers_train_on_the_masked_dense_path_whatever_a_record_says(kernel, caplog):
    """A layer of straight-through gates is not probed (the kernel path drops their gradient to the unselected
    heads), and a record from before that rule which put it on the kernel path is overridden, with a warning."""
    model = nn.ModuleDict({"a": build_attention("moh", 32, num_heads=8, shared_heads=2, routed_topk=2,
                                                gate="binary_ste", two_stage=False),
                           "b": Tiny().a})
    assert list(probed_layers(model)) == ["b"]
    with caplog.at_level("WARNING"):
        apply_train_paths(model, {"paths": {"a": KERNEL_PATH, "b": KERNEL_PATH}})
    assert (model["a"].train_path, model["b"].train_path) == (REFERENCE_PATH, KERNEL_PATH)
    assert "put a on routed_kernel_loops; their straight-through gates" in caplog.text
    caplog.clear()
    apply_train_paths(model, {"paths": {"a": REFERENCE_PATH}})
    assert model["b"].train_path == REFERENCE_PATH and not caplog.text
