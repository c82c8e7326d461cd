"""impl='auto': every MoH path is exact, the probe's choice follows its (injected) timer, choices are
cached per key, and ``impl_choices`` records them per layer. No timing is asserted."""

import json

import pytest
import timm
import torch

from visattn import build_attention
from visattn.attention import impl_choices
from visattn.attention.impl_probe import (
    ImplProbe,
    default_timer,
    device_name,
    pick_path,
    time_paths,
    use_impl_probe,
)
from visattn.attention.moh import PATHS
from visattn.attention.routed_kernel import KERNEL_PATHS, kernel_path_runs
from visattn.kernels import moh_routed_attention_op, moh_routed_heads_op
from visattn.utils.flops import count_flops

# The compiled paths that run here (float32): their kernel needs a C++ toolchain, and routed_kernel and
# routed_kernel_dense MKL's GEMM
KERNEL_PATHS_HERE = {
    path for path, blas in (("routed_kernel", True), ("routed_kernel_loops", False), ("masked_kernel_loops", False))
    if moh_routed_heads_op(torch.float32, blas) is not None
} | ({"routed_kernel_dense"} if moh_routed_attention_op(torch.float32) is not None else set())


def _moh(dim=32, heads=8, shared=2, topk=2, routing="token_choice", seed=0, **kwargs):
    torch.manual_seed(seed)
    m = build_attention(
        "moh", dim, num_heads=heads, shared_heads=shared, routed_topk=topk, routing=routing, **kwargs
    )
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m.eval()


class ScriptedTimer:
    """Seconds per path from a table; records every call (path names in call order). With
    ``execute`` it also runs the path, as a real timer does."""

    def __init__(self, seconds: dict[str, float], execute: bool = False) -> None:
        self.seconds = seconds
        self.execute = execute
        self.calls: list[str] = []

    def __call__(self, path, run):
        self.calls.append(path)
        if self.execute:
            run()
        return self.seconds[path]


ALL_FAST = {
    "masked_dense": 1.0,
    "dense_projections": 1.0,
    "sparse_projections": 1.0,
    "routed_kernel": 1.0,
    "routed_kernel_loops": 1.0,
    "masked_kernel_loops": 1.0,
    "routed_kernel_dense": 1.0,
    "routed_kernel_grouped": 1.0,
    "head_gather": 1.0,
    "head_gather_dense_out": 1.0,
}


# --- every path is exact ------------------------------------------------------------------------

SHAPES = [(1, 1, 24, 6), (3, 7, 24, 6), (2, 17, 48, 8), (5, 3, 20, 4)]


@pytest.mark.parametrize("routing", ["token_choice", "head_choice"])
@pytest.mark.parametrize(("B", "N", "C", "H"), SHAPES)
def test_every_path_equals_the_dense_reference(routing, B, N, C, H):
    m = _moh(dim=C, heads=H, shared=H // 4, topk=H // 4 + 1, routing=routing, qkv_bias=True)
    x = torch.randn(B, N, C)
    with torch.no_grad():
        ref = m.dense_forward(x)
        assert len(m.paths) >= 3
        for path in m.paths:
            torch.testing.assert_close(PATHS[path](m, x), ref, rtol=1e-5, atol=1e-5, msg=path)


@pytest.mark.parametrize("routing", ["token_choice", "head_choice"])
def test_auto_output_equals_dense_whatever_it_picks(routing):
    m = _moh(routing=routing)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        ref = m.dense_forward(x)
        for path in m.paths:  # make each path the fastest in turn
            with use_impl_probe(ImplProbe(timer=ScriptedTimer({**ALL_FAST, path: 0.1}))):
                torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-5)
            # without the kernel, its paths are sparse_projections again and are not probed
            probed = path not in KERNEL_PATHS or path in KERNEL_PATHS_HERE
            assert (m.last_path == path) == probed


def test_auto_under_bf16_autocast_takes_the_grouped_projection_where_it_runs_and_times_it_fastest():
    """On a CPU with AMX, under bf16 autocast, ``auto`` probes ``routed_kernel_grouped`` beside
    ``routed_kernel_dense`` and, timed fastest, runs it: the output as close to float32's as the masked
    dense path in bf16. Elsewhere the grouped path is not probed (it would be ``routed_kernel_dense``)."""
    m = _moh(dim=256, heads=4, shared=1, topk=2)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(0.1)  # _moh's router noise would make the logits large for bf16
    x = torch.randn(2, 33, 256)
    timer = ScriptedTimer({**ALL_FAST, "routed_kernel_grouped": 0.1})
    with use_impl_probe(ImplProbe(timer=timer)), torch.no_grad():
        ref = m.dense_forward(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, masked = m(x), m.dense_forward(x)
            grouped_runs = kernel_path_runs(m, x, "routed_kernel_grouped")
    assert ("routed_kernel_grouped" in timer.calls) == grouped_runs
    assert (m.last_path == "routed_kernel_grouped") == grouped_runs
    bf16_error = (masked.float() - ref).abs().max().item()
    assert (out.float() - ref).abs().max().item() <= 2 * bf16_error + 1e-3 * ref.abs().max().item()


# --- the probe's decision ------------------------------------------------------------------------


def test_masked_dense_timed_fastest_is_picked():
    m = _moh()
    timer = ScriptedTimer({"masked_dense": 1.0, "dense_projections": 1.5, "sparse_projections": 2.0, "routed_kernel": 2.0,
                           "routed_kernel_loops": 2.0, "masked_kernel_loops": 2.0, "routed_kernel_dense": 2.0})
    with use_impl_probe(ImplProbe(timer=timer)), torch.no_grad():
        m(torch.randn(2, 9, 32))
    assert m.last_path == "masked_dense"


def test_a_path_must_beat_masked_dense_by_the_margin_and_in_most_rounds():
    samples = {"masked_dense": [1.0, 1.1], "dense_projections": [0.99, 1.09], "sparse_projections": [1.2, 1.3]}
    assert pick_path(samples, "masked_dense", margin=0.02) == "masked_dense"  # 1% faster: noise
    assert pick_path(samples, "masked_dense", margin=0.0) == "dense_projections"
    samples["sparse_projections"] = [0.5, 0.6]
    assert pick_path(samples, "masked_dense", margin=0.02) == "sparse_projections"
    samples["sparse_projections"] = [0.5, 1.2]  # one lucky round; slower than masked in the other: a tie
    assert pick_path(samples, "masked_dense", margin=0.02) == "masked_dense"


def test_one_slow_round_of_five_does_not_keep_a_faster_path_out():
    samples = {"masked_dense": [1.0, 1.0, 0.95, 1.0, 1.02], "routed_kernel_loops": [0.9, 0.91, 0.97, 0.9, 0.92]}
    assert pick_path(samples, "masked_dense", margin=0.02) == "routed_kernel_loops"
    samples["routed_kernel_loops"] = [0.9, 1.05, 0.97, 1.01, 0.92]  # faster in 2 rounds of 5
    assert pick_path(samples, "masked_dense", margin=0.02) == "masked_dense"


def test_a_path_is_compared_with_masked_dense_round_by_round():
    """The machine's speed drifting between rounds cancels in each round's ratio. Here masked dense ran once
    in a fast spell (round 1) that the kernel path missed, and at the machine's usual speed the kernel path
    took 0.9x its time in every other round: best against best (1.0 against 1.35) would keep masked dense."""
    samples = {"masked_dense": [1.0, 2.0, 2.2, 1.9, 2.1], "routed_kernel": [1.35, 1.8, 1.98, 1.71, 1.89]}
    assert pick_path(samples, "masked_dense", margin=0.02) == "routed_kernel"
    # and the other way: the kernel path's one fast spell does not make a path that is 5% slower the choice
    samples = {"masked_dense": [1.9, 2.0, 2.2, 1.9, 2.1], "routed_kernel": [1.0, 2.1, 2.31, 2.0, 2.2]}
    assert pick_path(samples, "masked_dense", margin=0.02) == "masked_dense"


def test_the_choice_records_the_paired_ratios_it_was_made_by(caplog):
    """``PathChoice.ratios``: each path's time over masked dense's, the median of the probe's rounds, in the record
    and the log line (the best times alone would not explain a choice on a machine whose speed drifts)."""
    m = _moh()
    timer = ScriptedTimer({"masked_dense": 2.0, "dense_projections": 1.0, "sparse_projections": 3.0, "routed_kernel": 3.0,
                           "routed_kernel_loops": 3.0, "masked_kernel_loops": 3.0, "routed_kernel_dense": 3.0})
    with use_impl_probe(ImplProbe(timer=timer)), torch.no_grad(), caplog.at_level("INFO", "visattn.attention.impl_probe"):
        m(torch.randn(2, 9, 32))
    choice = m.path_log["[2, 9, 32] float32"]
    assert choice.path == "dense_projections"
    assert choice.ratios["masked_dense"] == 1.0 and choice.ratios["dense_projections"] == 0.5
    assert set(choice.ratios) == set(choice.times_ms)
    assert "time vs masked_dense, median of the rounds" in caplog.text and "'dense_projections': 0.5" in caplog.text
    assert impl_choices(m)["layers"][0]["choices"]["[2, 9, 32] float32"]["ratios"] == choice.ratios


class ScriptedRounds:
    """Each path's seconds: ``early[path]`` in its first ``calls`` timings (the first call, the warm-up and the probe's
    five rounds), ``late[path]`` after; a path in neither, ``other`` (3: given up after the warm-up). Records each
    call's path."""

    def __init__(self, early: dict[str, float], late: dict[str, float], calls: int = 7, other: float = 3.0) -> None:
        self.early, self.late, self.switch, self.other = early, late, calls, other
        self.calls: list[str] = []

    def __call__(self, path, run):
        self.calls.append(path)
        return (self.early if self.calls.count(path) <= self.switch else self.late).get(path, self.other)


@pytest.mark.parametrize(
    ("early", "late", "confirm", "chosen", "kernel_calls"),
    [
        (0.97, 1.03, 10, "masked_dense", 2 + 5 + 10),  # a close call, rechecked: slower over all its rounds
        (0.97, 0.97, 10, "routed_kernel", 2 + 5 + 10),  # a close call that holds
        (0.50, 0.50, 10, "routed_kernel", 2 + 5 + 10),  # a clear win, rechecked too: it holds
        (0.50, 1.03, 10, "masked_dense", 2 + 5 + 10),  # a clear win in five rounds that turns slower
        (0.97, 1.03, 0, "routed_kernel", 2 + 5),  # confirm=0: the five rounds decide
        (1.01, 0.93, 10, "routed_kernel", 2 + 5 + 10),  # a near miss, rechecked: faster over all its rounds
        (1.01, 1.01, 10, "masked_dense", 2 + 5 + 10),  # a near miss that holds
        (1.05, 0.93, 10, "masked_dense", 2 + 5),  # a clear loss is not timed again
        (1.01, 0.93, 0, "masked_dense", 2 + 5),  # confirm=0: the five rounds decide
    ],
)
def test_a_close_call_is_timed_again_against_masked_dense(early, late, confirm, chosen, kernel_calls):
    m = _moh()
    with torch.no_grad():  # as the probe runs it
        if "routed_kernel" not in m.paths or not kernel_path_runs(m, torch.randn(2, 9, 32), "routed_kernel"):
            pytest.skip("no routed_kernel path on this machine (visattn.kernels)")
    timer = ScriptedRounds({"masked_dense": 1.0, "routed_kernel": early}, {"masked_dense": 1.0, "routed_kernel": late})
    with use_impl_probe(ImplProbe(timer=timer, confirm=confirm)), torch.no_grad():
        m(torch.randn(2, 9, 32))
    choice = m.path_log["[2, 9, 32] float32"]
    assert choice.path == chosen and timer.calls.count("routed_kernel") == kernel_calls
    assert timer.calls.count("masked_dense") == kernel_calls  # timed beside it, round for round
    if kernel_calls > 7:  # the record covers every round the decision read: 5 early and 10 late, so the late median
        assert choice.ratios["routed_kernel"] == pytest.approx(late)


def test_every_path_that_beat_the_reference_is_timed_again_and_the_pick_made_over_all_rounds():
    """The DiT-B/2 case (19th session): five rounds put ``routed_kernel_dense`` (0.87x) ahead of ``routed_kernel``
    (0.94x), which was the faster of the two over more rounds; a path that lost to the reference is not timed
    again."""
    early = {"masked_dense": 1.0, "routed_kernel_dense": 0.87, "routed_kernel": 0.94, "dense_projections": 1.2}
    late = {**early, "routed_kernel_dense": 1.0, "routed_kernel": 0.93}
    timer = ScriptedRounds(early, late)
    probe = ImplProbe(timer=timer, confirm=10)
    choice = probe.choose(("key",), dict.fromkeys(early, lambda: None), "masked_dense", (2, 9, 32), "float32", "cpu")
    assert choice.path == "routed_kernel"
    assert [timer.calls.count(p) for p in early] == [2 + 5 + 10, 2 + 5 + 10, 2 + 5 + 10, 2 + 5]
    assert choice.ratios["routed_kernel_dense"] == 1.0 and choice.ratios["routed_kernel"] == 0.93


class FirstCallTimer:
    """Each path's seconds, ``first`` times them on its first call (a JIT compile). Records each call's path."""

    def __init__(self, seconds: dict[str, float], first: float = 1000.0) -> None:
        self.seconds, self.first = seconds, first
        self.calls: list[str] = []

    def __call__(self, path, run):
        self.calls.append(path)
        return self.seconds[path] * (self.first if self.calls.count(path) == 1 else 1.0)


def test_a_first_call_that_compiles_is_not_the_warm_up():
    """On a GPU the masked dense path's first call compiled the Triton gates (1.35 s against 1.4 ms): taken as its
    warm-up, it was given up and the probe chose a path 4.5x slower (2026-11-27, H200)."""
    timer = FirstCallTimer({"masked_dense": 1.0, "dense_projections": 3.7, "sparse_projections": 6.4})
    samples = time_paths(dict.fromkeys(timer.seconds), timer, repeats=3, give_up=3.0, keep="masked_dense")
    assert samples == {"masked_dense": [1.0] * 3, "dense_projections": [3.7], "sparse_projections": [6.4]}
    assert pick_path(samples, "masked_dense", margin=0.02) == "masked_dense"


def test_the_reference_is_timed_in_every_round_whatever_its_warm_up():
    timer = ScriptedTimer({"masked_dense": 10.0, "routed_kernel": 1.0})
    samples = time_paths(dict.fromkeys(["masked_dense", "routed_kernel"]), timer, repeats=3, give_up=3.0,
                         keep="masked_dense")
    assert samples == {"masked_dense": [10.0] * 3, "routed_kernel": [1.0] * 3}
    without = time_paths(dict.fromkeys(["masked_dense", "routed_kernel"]), timer, repeats=3, give_up=3.0)
    assert without["masked_dense"] == [10.0]  # any other path: given up after its warm-up


def test_a_path_given_up_after_the_warm_up_is_compared_by_its_one_sample():
    samples = {"masked_dense": [4.0], "routed_kernel": [1.0, 1.1], "routed_kernel_loops": [1.2, 1.2]}
    assert pick_path(samples, "masked_dense", margin=0.02) == "routed_kernel"
    samples = {"masked_dense": [1.0, 1.0], "routed_kernel": [0.9, 0.9], "routed_kernel_loops": [3.5]}
    assert pick_path(samples, "masked_dense", margin=0.02) == "routed_kernel"


def test_paths_are_tried_in_order_of_their_median_not_of_their_best_round():
    """A path with one lucky round but slower most of the time does not take the place of a steady one
    (routed_kernel against routed_kernel_dense at DiT-B/2 90%, 11th session)."""
    samples = {
        "masked_dense": [1.0, 1.0, 1.0, 1.0, 1.0],
        "routed_kernel": [0.90, 0.97, 0.99, 0.98, 1.05],  # best 0.90, median 0.98
        "routed_kernel_dense": [0.92, 0.93, 0.93, 0.94, 0.93],  # best 0.92, median 0.93
    }
    assert pick_path(samples, "masked_dense", margin=0.02) == "routed_kernel_dense"


def test_a_fastest_path_that_fails_the_test_does_not_hide_the_next_one():
    samples = {"masked_dense": [1.0, 1.0, 1.0], "routed_kernel": [0.5, 1.2, 1.3], "routed_kernel_loops": [0.9, 0.9, 0.9]}
    assert pick_path(samples, "masked_dense", margin=0.02) == "routed_kernel_loops"


def test_probe_rounds_are_interleaved_and_hopeless_paths_stop_after_the_warm_up():
    timer = ScriptedTimer({"a": 1.0, "b": 1.2, "c": 10.0})
    samples = time_paths({"a": None, "b": None, "c": None}, timer, repeats=2, give_up=3.0)
    # a first call of each, the warm-up, then rounds of the two in a seeded order
    assert timer.calls[:6] == ["a", "b", "c"] * 2
    assert sorted(timer.calls[6:8]) == sorted(timer.calls[8:]) == ["a", "b"]
    assert samples == {"a": [1.0, 1.0], "b": [1.2, 1.2], "c": [10.0]}
    again = ScriptedTimer({"a": 1.0, "b": 1.2, "c": 10.0})
    time_paths({"a": None, "b": None, "c": None}, again, repeats=2, give_up=3.0)
    assert again.calls == timer.calls


def test_the_decision_is_deterministic_given_the_timer():
    seconds = {"masked_dense": 2.0, "dense_projections": 1.0, "sparse_projections": 3.0, "routed_kernel": 3.0,
               "routed_kernel_loops": 3.0, "masked_kernel_loops": 3.0, "routed_kernel_dense": 3.0}
    chosen = set()
    for _ in range(3):
        m = _moh()
        with use_impl_probe(ImplProbe(timer=ScriptedTimer(seconds))), torch.no_grad():
            m(torch.randn(2, 9, 32))
        chosen.add(m.last_path)
    assert chosen == {"dense_projections"}


def test_default_timer_counts_this_thread_s_cpu_time_with_one_thread_only(monkeypatch):
    """With one intra-op thread, time spent waiting for a core (other processes' load) is not counted."""
    import visattn.attention.impl_probe as impl_probe

    ticks = iter([10.0, 12.5])
    monkeypatch.setattr(impl_probe.time, "thread_time", lambda: next(ticks))
    monkeypatch.setattr(impl_probe.torch, "get_num_threads", lambda: 1)
    assert default_timer("masked_dense", lambda: None) == 2.5
    monkeypatch.setattr(impl_probe.torch, "get_num_threads", lambda: 2)
    assert default_timer("masked_dense", lambda: None) < 1.0  # wall time; the CPU clock is not read


# --- the cache ----------------------------------------------------------------------------------


def test_cache_is_keyed_by_shape_and_dtype_and_shared_by_identical_layers():
    timer = ScriptedTimer({**ALL_FAST, "masked_dense": 0.5})
    a, b = _moh(seed=0), _moh(seed=1)  # same geometry, other weights
    with use_impl_probe(ImplProbe(timer=timer)) as probe, torch.no_grad():
        a(torch.randn(2, 9, 32))
        probed = len(timer.calls)
        assert probed > 0
        a(torch.randn(2, 9, 32))
        b(torch.randn(2, 9, 32))
        assert len(timer.calls) == probed  # same key: no new timing
        assert b.path_log["[2, 9, 32] float32"].source == "cache"
        a(torch.randn(3, 9, 32))  # another batch size probes again
        assert len(timer.calls) == 2 * probed
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a(torch.randn(3, 9, 32))  # another compute dtype too (without the float32-only loops path)
        bf16_paths = len(a.path_log["[3, 9, 32] bfloat16"].times_ms)
        rounds = probed // len(a.path_log["[2, 9, 32] float32"].times_ms)  # timer calls per path
        assert len(timer.calls) == 2 * probed + rounds * bf16_paths
        before = len(timer.calls)
        _moh(topk=3)(torch.randn(2, 9, 32))  # another budget too
        assert len(timer.calls) == before + probed
        assert len(probe.choices) == 4


def test_training_never_probes_and_takes_the_masked_path(monkeypatch):
    m = _moh().train()
    timer = ScriptedTimer(ALL_FAST)
    with use_impl_probe(ImplProbe(timer=timer)):
        m(torch.randn(2, 9, 32)).sum().backward()
    assert timer.calls == [] and m.last_path is None and m.aux_loss is not None


def test_disk_cache_is_read_back_by_another_process_probe(tmp_path):
    x = torch.randn(2, 9, 32)
    with use_impl_probe(
        ImplProbe(timer=ScriptedTimer({**ALL_FAST, "dense_projections": 0.1}), disk_dir=tmp_path)
    ):
        with torch.no_grad():
            _moh()(x)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["choice"]["path"] == "dense_projections"
    timer = ScriptedTimer(ALL_FAST)
    m = _moh()
    with use_impl_probe(ImplProbe(timer=timer, disk_dir=tmp_path)), torch.no_grad():
        m(x)
    assert timer.calls == [] and m.last_path == "dense_projections"
    assert m.path_log["[2, 9, 32] float32"].source == "disk"


def test_probe_runs_are_not_counted_as_the_model_s_flops():
    x = torch.randn(2, 9, 32)
    m = _moh()
    timer = ScriptedTimer({**ALL_FAST, "sparse_projections": 0.1}, execute=True)
    with use_impl_probe(ImplProbe(timer=timer)):
        first = count_flops(m, x)  # probes (running every path) inside the FLOP counter
        assert len(timer.calls) > 3
        assert m.last_path == "sparse_projections"
        with torch.no_grad():  # as count_flops runs a module
            assert first == count_flops(lambda: PATHS["sparse_projections"](m, x))


def test_bad_probe_settings_and_impls_name_the_fix():
    with pytest.raises(ValueError, match="repeats=0"):
        ImplProbe(repeats=0)
    with pytest.raises(ValueError, match="margin=1.5"):
        ImplProbe(margin=1.5)
    with pytest.raises(ValueError, match=r"confirm=-1 must be >= 0"):
        ImplProbe(confirm=-1)
    with pytest.raises(
        ValueError, match=r"impl='head_gather' is not available.*it has: auto, dense, masked_dense"
    ):
        _moh(impl="head_gather")
    m = _moh()
    with pytest.raises(ValueError, match="impl='fastest' is not known"):
        m.impl = "fastest"


# --- the run record -----------------------------------------------------------------------------


def test_record_lists_each_layer_with_its_path_and_device():
    model = timm.create_model(
        "visattn_vit_tiny_patch2_8", attn={"name": "moh", "shared_heads": 2, "routed_topk": 2}, num_classes=3
    ).eval()
    timer = ScriptedTimer({**ALL_FAST, "dense_projections": 0.1})
    with use_impl_probe(ImplProbe(timer=timer)), torch.no_grad():
        model(torch.randn(2, 1, 8, 8))
    record = impl_choices(model)
    json.dumps(record)  # JSON-able
    assert record["device"] == device_name("cpu") and record["device"]
    layers = record["layers"]
    assert [entry["layer"] for entry in layers] == [f"blocks.{i}.attn" for i in range(len(model.blocks))]
    for entry in layers:
        assert entry["impl"] == "auto" and entry["path"] == "dense_projections"
        (choice,) = entry["choices"].values()
        assert choice["device"] == device_name("cpu") and choice["source"] in ("probe", "cache")
        assert set(choice["times_ms"]) == {"masked_dense", "dense_projections", "sparse_projections", *KERNEL_PATHS_HERE}
    assert [e["choices"]["[2, 17, 64] float32"]["source"] for e in layers].count("probe") == 1


def test_record_of_fixed_and_plain_layers():
    model = torch.nn.Sequential(
        _moh(impl="sparse_projections"), build_attention("mha", 32, num_heads=8).eval()
    )
    with torch.no_grad():
        model(torch.randn(2, 9, 32))
    first, second = impl_choices(model)["layers"]
    assert (
        first["path"] == "sparse_projections" and first["choices"]["[2, 9, 32] float32"]["source"] == "fixed"
    )
    assert second == {"layer": "1", "impl": None, "path": "dense", "choices": {}, "train_attention": "sdpa"}
    assert first["train_attention"] == "sdpa"  # what a run's probe may change (visattn.attention.train_paths)


def test_paths_bench_prints_every_path_and_auto_s_choice(tmp_path, capsys):
    from visattn.bench.__main__ import main

    out = tmp_path / "paths.json"
    argv = ["paths", "--shapes", "2,5,16,4", "--budgets", "0.5", "--warmup", "1", "--repeats", "1"]
    main([*argv, "--threads", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    labels = [r["label"] for r in rows]
    assert labels[:2] == ["mha", "mha kernel_parts"]
    kernel_paths = ["routed_kernel", "routed_kernel_loops", "masked_kernel_loops", "routed_kernel_dense"]
    for prefix, paths in (
        ("moh-50", ["sparse_projections", *kernel_paths]),
        ("hc-50", ["head_gather", "head_gather_dense_out", *kernel_paths]),
    ):
        for path in ["masked_dense", "dense_projections", *paths, "auto"]:
            assert f"{prefix} {path}" in labels
    auto = {r["label"]: r for r in rows}["hc-50 auto"]
    hc_paths = {label.removeprefix("hc-50 ") for label in labels if label.startswith("hc-50 ")} - {"auto"}
    assert auto["auto_path"] in hc_paths  # whichever timed fastest here, one of the rows
    assert {r["label"]: r for r in rows}["moh-50 masked_dense"]["vs_masked"] == 1.0
    printed = capsys.readouterr().out
    assert printed.startswith("Machine: ") and f"auto -> {auto['auto_path']}" in printed


def test_paths_bench_times_only_the_rows_asked_for(tmp_path):
    """``--paths`` / ``--routings`` keep those rows (and ``mha``, every ratio's reference); a path a layer lacks is
    no row, and a name that is no row is refused before anything is timed."""
    from visattn.bench.__main__ import main
    from visattn.bench.attention import Shape
    from visattn.bench.paths import run_paths_bench

    out = tmp_path / "paths.json"
    argv = ["paths", "--shapes", "2,5,16,4", "--budgets", "0.5", "0.75", "--warmup", "0", "--repeats", "1"]
    main([*argv, "--paths", "masked_dense", "auto", "head_gather", "--routings", "moh", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["label"] for r in rows] == [
        "mha", "moh-50 masked_dense", "moh-50 auto", "moh-75 masked_dense", "moh-75 auto",
    ]  # token choice has no head_gather
    assert {r["label"]: r["vs_masked"] for r in rows}["moh-50 masked_dense"] == 1.0
    main([*argv, "--paths", "kernel_parts", "head_gather", "--out", str(out)])
    assert [r["label"] for r in json.loads(out.read_text())["rows"]] == [
        "mha", "mha kernel_parts", "hc-50 head_gather", "hc-75 head_gather",
    ]
    with pytest.raises(ValueError, match=r"'dense_projection' is not a row of this bench; use some of .*dense_projections"):
        run_paths_bench([Shape.parse("2,5,16,4")], [0.5], ["fp32"], paths=["dense_projection"])
    with pytest.raises(ValueError, match=r"routings: 'tc' is not known; use some of moh, hc"):
        run_paths_bench([Shape.parse("2,5,16,4")], [0.5], ["fp32"], routings=["tc"])
    with pytest.raises(SystemExit):  # the CLI refuses it too, with argparse's message
        main([*argv, "--paths", "fastest"])


def test_a_budget_no_layer_can_hold_is_a_model_s_mix_of_two_layers():
    """75% of 6 heads: half the layers at 4, half at 5; 90% of 6: 60% at 5 (the nearest), 40% at 6; 90% of 12:
    80% at 11, 20% at 10. Whole numbers (50% of 6, 75% of 12) need no mix."""
    from visattn.bench.attention import Shape
    from visattn.bench.paths import layer_mixes, path_cases

    mixes = {m.label: m for m in layer_mixes(6, [0.5, 0.75, 0.9], ["moh"])}
    assert list(mixes) == ["moh-75mix", "moh-90mix"]
    assert (mixes["moh-75mix"].near, mixes["moh-75mix"].other) == ("moh-75", "moh-75alt")
    assert mixes["moh-75mix"].weight == pytest.approx(0.5) and mixes["moh-75mix"].active == pytest.approx(4.5)
    assert mixes["moh-90mix"].weight == pytest.approx(0.6) and mixes["moh-90mix"].active == pytest.approx(5.4)
    ((label, twelve),) = [(m.label, m) for m in layer_mixes(12, [0.75, 0.9], ["moh"])]
    assert label == "moh-90mix" and twelve.weight == pytest.approx(0.8)
    heads = {c.label: c.kwargs["shared_heads"] + c.kwargs["routed_topk"]
             for c in path_cases(Shape.parse("2,5,24,6"), [0.5, 0.75, 0.9], ["auto"], ["moh"], layer_mix=True)
             if c.name == "moh"}
    assert heads == {"moh-50 auto": 3, "moh-75 auto": 5, "moh-90 auto": 5, "moh-75alt auto": 4, "moh-90alt auto": 6}
    assert "moh-75alt auto" not in {c.label for c in path_cases(Shape.parse("2,5,24,6"), [0.75], ["auto"], ["moh"])}


def test_the_mix_rows_weigh_the_two_layers_round_by_round():
    from visattn.bench.paths import LayerMix, mix_rows

    def row(label, samples, path=None):
        return {"label": label, "dtype": "fp32", "infer_samples_ms": samples, "infer_flops": 10.0 * len(label),
                "active_heads": [0, 6], "auto_path": path}

    rows = [row("mha", [2.0, 4.0, 2.0, 4.0, 2.0]), row("moh-75 auto", [1.0, 2.0, 1.0, 2.0, 1.0], "routed_kernel"),
            row("moh-75alt auto", [2.0, 3.0, 2.0, 3.0, 2.0], "masked_dense")]
    (mix,) = mix_rows(rows, [LayerMix("moh-75mix", "moh-75", "moh-75alt", 0.25, 4.25)])
    assert mix["label"] == "moh-75mix auto" and mix["infer_samples_ms"] == [1.75, 2.75, 1.75, 2.75, 1.75]
    assert mix["infer_ratio"] == pytest.approx(0.875)  # the rounds' ratios' median: 1.75 / 2 (3 rounds), 2.75 / 4
    assert mix["infer_ratio_ci"] is not None and mix["active_heads"] == [4.25, 6]
    assert mix["layers"] == {"moh-75 auto": 0.25, "moh-75alt auto": 0.75}
    assert mix["infer_flops"] == 0.25 * 110 + 0.75 * 140  # 10 per character of the label
    assert mix["auto_path"] == "routed_kernel / masked_dense"
    assert mix_rows(rows[:2], [LayerMix("moh-75mix", "moh-75", "moh-75alt", 0.5, 4.5)]) == []  # no other layer timed


def test_the_paths_bench_gives_a_model_s_mix_with_layer_mix(tmp_path):
    from visattn.bench.__main__ import main

    out = tmp_path / "paths.json"
    main(["paths", "--shapes", "2,5,24,6", "--budgets", "0.75", "--paths", "masked_dense", "auto", "--routings", "moh",
          "--layer-mix", "--warmup", "0", "--repeats", "2", "--out", str(out)])
    rows = {r["label"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["mha", "moh-75 masked_dense", "moh-75 auto", "moh-75alt masked_dense", "moh-75alt auto",
                          "moh-75mix masked_dense", "moh-75mix auto"]
    mix, near, other = rows["moh-75mix auto"], rows["moh-75 auto"], rows["moh-75alt auto"]
    assert mix["infer_samples_ms"] == pytest.approx(
        [(a + b) / 2 for a, b in zip(near["infer_samples_ms"], other["infer_samples_ms"], strict=True)])
    assert rows["moh-75mix masked_dense"]["vs_masked"] == 1.0 and mix["vs_masked"] is not None


@pytest.mark.parametrize("kwargs", [{}, {"qkv_bias": True}, {"qkv_bias": True, "num_kv_heads": 2}])
def test_the_bench_s_mha_on_kernel_parts_equals_mha(kwargs):
    """The paths bench's second MHA row (``mha kernel_parts``): the same layer to float rounding in float32
    inference (16-wide heads, 70 tokens: the fused attention's tiles where this CPU runs it), and the layer
    itself with gradients."""
    from visattn.bench.paths import MHAOnKernelParts

    torch.manual_seed(0)
    mha = build_attention("mha", 64, num_heads=4, **kwargs).eval()
    x = torch.randn(2, 70, 64)
    with torch.no_grad():
        ref = mha(x)
        torch.testing.assert_close(MHAOnKernelParts(mha)(x), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(MHAOnKernelParts(mha)(x), mha(x))


def test_the_bench_s_mha_on_kernel_parts_in_bfloat16():
    """In bf16 under autocast: the same layer to bf16 rounding (AMX attention where it runs, else the layer)."""
    from visattn.bench.paths import MHAOnKernelParts

    torch.manual_seed(0)
    mha = build_attention("mha", 256, num_heads=4, qkv_bias=True).eval()
    x = torch.randn(2, 70, 256)
    with torch.no_grad():
        ref = mha(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, masked = MHAOnKernelParts(mha)(x), mha(x)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() <= 2 * (masked.float() - ref).abs().max() + 1e-3 * ref.abs().max()


def test_paths_bench_reports_auto_s_choice_per_dtype():
    """One workload serves both dtypes (bf16 under autocast): each row names the choice for its own dtype,
    not the path the layer ran last."""
    from visattn.bench.attention import Shape
    from visattn.bench.paths import run_paths_bench

    def timer(path, run):  # fastest: dense_projections in bf16, sparse_projections in fp32
        fast = "dense_projections" if torch.is_autocast_enabled("cpu") else "sparse_projections"
        return 0.1 if path == fast else 1.0

    with use_impl_probe(ImplProbe(timer=timer)):
        rows = run_paths_bench([Shape.parse("2,5,16,4")], [0.5], ["fp32", "bf16"], warmup=0, repeats=1)
    auto = {r["dtype"]: r["auto_path"] for r in rows if r["label"] == "moh-50 auto"}
    assert auto == {"fp32": "sparse_projections", "bf16": "dense_projections"}
