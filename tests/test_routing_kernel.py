"""The compiled MoH routing kernel (visattn.kernels) against the PyTorch routing it replaces."""

import functools
import logging
from pathlib import Path

import pytest
import torch

import visattn.kernels as kernels
from visattn.attention import build_attention
from visattn.attention.routing import head_capacity, head_choice_selection
from visattn.utils.flops import flop_counter

BUDGETS = [  # (heads, shared, topk, two_stage)
    (8, 2, 2, True), (8, 1, 3, True), (8, 0, 4, False), (8, 2, 6, True), (6, 3, 2, False), (4, 2, 1, True), (12, 0, 11, False),
    (8, 8, 0, False),  # dense: soft weights over every head
]


@pytest.fixture
def kernel():
    op = kernels.moh_routing_op()
    if op is None:
        pytest.skip("no C++ toolchain here: the kernel cannot be built (the PyTorch path runs instead)")
    return op


def _layer(heads, shared, topk, two_stage, dim=48):
    # impl="dense": the masked dense path on every call (auto would time its paths at the first call)
    return build_attention("moh", dim, num_heads=heads, shared_heads=shared, routed_topk=topk, two_stage=two_stage,
                           impl="dense").eval()


@pytest.mark.parametrize("heads, shared, topk, two_stage", BUDGETS)
@pytest.mark.parametrize("scale", [1.0, 30.0])  # 30: logits far apart, probabilities near 0 and 1
def test_compiled_gates_equal_the_pytorch_routing(kernel, monkeypatch, heads, shared, topk, two_stage, scale):
    torch.manual_seed(heads * 10 + topk)
    layer = _layer(heads, shared, topk, two_stage)
    router = layer.router
    x = torch.randn(3, 11, 48) * scale
    calls = []
    # the gates alone differ: both take the logits from F.linear (the logits kernel has its tests below)
    monkeypatch.setattr("visattn.attention.routing.moh_router_logits_op", lambda: None)
    monkeypatch.setattr("visattn.attention.fused_gating.moh_routing_op", lambda: lambda *a: calls.append(1) or kernel(*a))
    with torch.no_grad():
        gates, none = router(x, None, selection=False)
        out = layer(x)
        load = router.head_load
        _, selected = router(x, None, selection=True)  # the skipping paths' form
        monkeypatch.setattr("visattn.attention.fused_gating.moh_routing_op", lambda: None)  # the PyTorch routing
        ref_gates, _ = router(x, None, selection=False)
        ref_out = layer(x)
        ref_load = router.head_load
        _, ref_selected = router(x, None, selection=True)
    assert len(calls) == 3 and none is None  # the kernel ran, for the router (twice) and for the layer
    assert gates.shape == ref_gates.shape == (3, 11, heads) and gates.dtype == torch.float32
    torch.testing.assert_close(gates, ref_gates, rtol=1e-5, atol=1e-6)
    assert torch.equal(gates > 0, ref_gates > 0) and torch.equal(load, ref_load)
    assert torch.equal(selected, ref_selected) and selected.shape == (3, 11, heads)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)


def test_the_kernel_keeps_nan_and_runs_only_where_it_applies(kernel, monkeypatch):
    torch.manual_seed(0)
    layer = _layer(8, 2, 2, True)
    x = torch.randn(2, 5, 48)
    x[0, 1] = float("nan")
    with torch.no_grad():
        gates, _ = layer.router(x, None, selection=False)
    assert gates[0, 1].isnan().all() and gates[1].isfinite().all()

    calls = []
    monkeypatch.setattr("visattn.attention.fused_gating.moh_routing_op", lambda: lambda *a: calls.append(1) or kernel(*a))
    monkeypatch.setattr("visattn.attention.routing.moh_router_gates_op", lambda: None)  # inference's fused op: below
    x = torch.randn(2, 5, 48)
    with torch.no_grad():
        with flop_counter():  # a dispatch mode sees the PyTorch routing's matmuls
            layer.eval()(x)
        head_choice = build_attention("moh", 48, num_heads=8, shared_heads=2, routed_topk=2, routing="head_choice")
        head_choice.eval()(x)
        binary = build_attention("moh", 48, num_heads=8, shared_heads=2, routed_topk=2, gate="binary_ste").eval()
        binary(x)
    with flop_counter():  # with gradients too
        layer.train()(x)
    assert calls == []
    with torch.no_grad():
        layer.eval()(x)
    assert calls == [1]
    layer.train()(x)  # gradients on: the kernel and its backward (test_fused_gating.py)
    assert calls == [1, 1]


@pytest.mark.parametrize("rows, N, topk, pool", [(1024, 17, 2, 4), (96, 49, 3, 4), (10, 197, 2, 5), (7, 1, 1, 4),
                                                 (5, 3, 1, 3)])
def test_head_choice_selection_compiled_equals_pytorch_ties_and_nan_included(kernel, rows, N, topk, pool):
    """Head choice's selection per (head, image) row: the compiled op and the stable sort behind it pick
    the same tokens, ties to the lower index, NaN first (as topk ranks it)."""
    torch.manual_seed(N)
    probs = torch.rand(rows, N).round(decimals=1)  # many exact ties
    probs[0] = 0.5  # a row of equals: its first tokens
    probs[rows // 2, N // 2] = float("nan")
    capacity = head_capacity(N, topk, pool)
    chosen = head_choice_selection(probs, topk, pool)
    with kernels.disabled():
        assert torch.equal(head_choice_selection(probs, topk, pool), chosen)
    assert chosen.dtype == torch.bool and (chosen.sum(-1) == capacity).all()
    assert chosen[0, :capacity].all() and not chosen[0, capacity:].any()
    assert chosen[rows // 2, N // 2]
    for row, mask in zip(probs[1:rows // 2], chosen[1:rows // 2], strict=True):
        kept, dropped = row[mask], row[~mask]
        if dropped.numel():  # every kept value >= every dropped one, and ties kept from the left
            assert kept.min() >= dropped.max()
            tie = row == kept.min()
            assert mask[tie].tolist() == sorted(mask[tie].tolist(), reverse=True)


@pytest.mark.parametrize("heads, shared, topk, two_stage, N", [
    (8, 2, 3, True, 13), (8, 4, 2, False, 17), (6, 0, 2, False, 9), (8, 2, 2, True, 70),  # 70: nth_element
])
def test_head_choice_gates_compiled_equal_the_pytorch_routing(kernel, heads, shared, topk, two_stage, N):
    """Head choice without gradients: gates, selection and per-image load from the compiled ops against
    the PyTorch routing (the selection and load bit for bit); with gradients the PyTorch code runs."""
    torch.manual_seed(heads + N)
    layer = build_attention("moh", 48, num_heads=heads, shared_heads=shared, routed_topk=topk, two_stage=two_stage,
                            routing="head_choice").eval()
    x = torch.randn(3, N, 48)
    with torch.no_grad():
        with torch.profiler.profile() as profile:  # records the ops that ran (not a dispatch mode)
            gates, selected = layer.router(x, None)
        assert "visattn::moh_head_choice_gates" in {event.name for event in profile.events()}
        load = layer.router.head_load
        with kernels.disabled():
            ref_gates, ref_selected = layer.router(x, None)
            ref_load = layer.router.head_load
    torch.testing.assert_close(gates, ref_gates, rtol=1e-5, atol=1e-6)
    assert torch.equal(selected, ref_selected) and torch.equal(load, ref_load) and layer.router.aux_loss is None
    assert load.shape == (3, heads) and (load[:, :shared] == 1).all()
    with torch.no_grad(), flop_counter():  # a dispatch mode: the PyTorch code, which it counts
        layer(x)
    trained, _ = layer.train().router(x, None)  # gradients: the PyTorch code, differentiable
    assert trained.requires_grad
    torch.testing.assert_close(trained.detach(), ref_gates, rtol=1e-5, atol=1e-6)


def test_without_a_compiler_routing_falls_back_to_pytorch_with_a_warning(monkeypatch, tmp_path, caplog):
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++")
    monkeypatch.setattr(kernels, "SOURCES", [bad])
    monkeypatch.delenv("VISATTN_KERNELS", raising=False)
    monkeypatch.setenv("VISATTN_KERNEL_DIR", str(tmp_path / "kernels"))
    kernels._load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="visattn.kernels"):
            assert kernels.moh_routing_op() is None
        assert kernels.moh_routed_heads_op(torch.float32) is None
        assert "MoH runs its PyTorch code" in caplog.text
        monkeypatch.setenv("VISATTN_KERNELS", "0")
        kernels._load.cache_clear()
        assert kernels.moh_routing_op() is None  # switched off: not even tried
    finally:
        kernels._load.cache_clear()


def test_a_build_is_not_blocked_by_a_stale_cpp_extension_lock(monkeypatch, tmp_path):
    """torch up to 2.11 builds under a baton: it creates ``lock`` exclusively and waits while the file exists. A
    file left there (by a build killed midway, or by a lock taken on that path) hung every process on a fresh GPU
    machine; builds run under visattn's own lock, which clears it."""
    from torch.utils import cpp_extension

    seen = []

    def baton_build(name, build_directory, **kwargs):  # what torch 2.11's load sees first
        seen.append((Path(build_directory) / "lock").exists())
        raise RuntimeError("stopped after the lock check")

    monkeypatch.setattr(cpp_extension, "load", baton_build)
    monkeypatch.delenv("VISATTN_KERNELS", raising=False)
    monkeypatch.setenv("VISATTN_KERNEL_DIR", str(tmp_path))
    kernels._load.cache_clear()
    try:
        build_dir = tmp_path / kernels._build_name()
        build_dir.mkdir()
        (build_dir / "lock").touch()
        assert kernels.moh_routing_op() is None  # the fake build failed: the PyTorch path
        assert seen == [False]
    finally:
        kernels._load.cache_clear()


def test_tensors_off_the_cpu_never_load_the_cpu_kernels(monkeypatch):
    """Asking for a CPU op loads the kernels, on first use building them (minutes): a layer on another device
    (a GPU; here meta tensors) must not ask."""

    def refuse():
        raise AssertionError("the CPU kernels were asked for")

    monkeypatch.setattr(kernels, "_load", refuse)
    for impl in ("auto", "dense"):
        layer = build_attention("moh", 32, num_heads=4, shared_heads=1, routed_topk=2, impl=impl).to("meta")
        x = torch.empty(2, 5, 32, device="meta", requires_grad=True)
        layer.train()(x).sum().backward()
        with torch.no_grad():
            assert layer.eval()(x).shape == (2, 5, 32)
        if impl == "dense":  # a fixed path, whose choice still reads what the kernels offer: for CPU tensors alone
            assert layer.choose_path(x).path == "masked_dense"


@pytest.mark.parametrize("value", ["", "~/elsewhere"])
def test_the_kernel_dir_is_the_user_cache_when_unset_or_empty_and_expands_home(monkeypatch, tmp_path, value):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("VISATTN_KERNEL_DIR", value)
    expected = tmp_path / "elsewhere" if value else tmp_path / ".cache" / "visattn" / "kernels"
    assert kernels.kernel_dir() == expected
    monkeypatch.delenv("VISATTN_KERNEL_DIR")
    assert kernels.kernel_dir() == tmp_path / ".cache" / "visattn" / "kernels"


@pytest.mark.parametrize("T, C, R", [(37, 96, 10), (256, 64, 8), (5, 384, 14), (33, 24, 1), (19, 16, 21), (0, 8, 4)])
def test_router_logits_kernel_equals_the_matmul(kernel, T, C, R):
    """Row blocks of 4 with a partial last one, one and several column blocks, an empty input, and x read in place
    through a row stride (columns of a wider tensor)."""
    gen = torch.Generator().manual_seed(T + C + R)
    wide = torch.randn(T, C + 5, generator=gen)
    x, w = wide[:, 2 : 2 + C], torch.randn(R, C, generator=gen)
    got = torch.ops.visattn.moh_router_logits(x, w)
    assert got.shape == (T, R) and got.is_contiguous()
    torch.testing.assert_close(got, (x.double() @ w.double().t()).float(), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.visattn.moh_router_logits(x.double(), w.double())


def test_the_router_takes_the_logits_kernel_only_where_the_probe_found_it_faster(kernel, monkeypatch):
    import visattn.attention.routing as routing
    from visattn.attention.impl_probe import ImplProbe

    layer = build_attention("moh", 48, num_heads=6, shared_heads=2, routed_topk=2, qkv_bias=True, impl="dense").eval()
    x = torch.randn(3, 11, 48)
    with kernels.disabled(), torch.no_grad():
        ref_out, (ref_gates, _) = layer(x), layer.router(x, None, False)
    op = torch.ops.visattn.moh_router_logits
    fused_op = torch.ops.visattn.moh_router_gates
    for faster in ("router_kernel", "router_linear"):
        calls, fused = [], []
        monkeypatch.setattr(routing, "moh_router_logits_op", lambda calls=calls: lambda *a: calls.append(1) or op(*a))
        monkeypatch.setattr(routing, "moh_router_gates_op",
                            lambda fused=fused: lambda *a: fused.append(1) or fused_op(*a))
        seconds = {"router_kernel": 1.0, "router_linear": 1.0, faster: 0.5}
        timer = functools.partial(lambda seconds, path, run: (run(), seconds[path])[1], seconds)
        monkeypatch.setattr(routing, "_LOGITS_PROBE", ImplProbe(timer=timer, repeats=1, confirm=0))  # one round decides
        with torch.no_grad():
            gates, _ = layer.router(x, None, False)
            out = layer(x)
        (choice,) = routing._LOGITS_PROBE.choices.values()
        assert choice.path == faster and choice.shape == (33, 48, layer.router.logit_rows)
        # the probe's first call, warm-up and timed round; then, where the kernel won, the router's call and the
        # layer's take the logits and gates in one op (moh_router_gates)
        assert len(calls) == 3 and len(fused) == (2 if faster == "router_kernel" else 0)
        torch.testing.assert_close(gates, ref_gates, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        layer.train()(x).sum().backward()  # with gradients: the matmul, whatever the probe said
        layer.eval()
        assert len(calls) == 3 and len(fused) == (2 if faster == "router_kernel" else 0)
        if faster == "router_kernel":  # the logits alone (the training path's router_linear), as the probe said
            with torch.no_grad():
                routing.router_linear(x.reshape(33, 48), layer.router.stacked_weight())
            assert len(calls) == 4


@pytest.mark.parametrize("heads, shared, topk, two_stage", BUDGETS)
def test_fused_router_gates_equal_the_two_kernels_bit_for_bit(kernel, heads, shared, topk, two_stage):
    """moh_router_gates (the logits per block of tokens, then the gates, then the head load) against
    moh_router_logits, moh_gates and moh_head_load in turn: the same bits, over blocks of 256 tokens with a partial
    last one, x read through a row stride, NaN tokens kept NaN."""
    router = _layer(heads, shared, topk, two_stage).router
    weights = router.linear_weights()
    budget = (shared, router.pool, topk, router.mix is not None, router.shared is not None, router.eps)
    gen = torch.Generator().manual_seed(heads + topk)
    wide = torch.randn(5 * 121, 52, generator=gen) * 3
    x = wide[:, 1:49]  # 605 tokens: two whole blocks and a partial one
    x[7] = float("nan")
    gates, keep, load = torch.ops.visattn.moh_router_gates(x, weights, *budget, 121)
    logits = torch.ops.visattn.moh_router_logits(x, torch.cat(weights)).t()
    ref_gates, ref_keep, _, _ = kernel(logits, *budget, False)
    assert torch.equal(gates.nan_to_num(-1.0), ref_gates.nan_to_num(-1.0)) and torch.equal(keep, ref_keep)
    assert gates[7].isnan().all() and gates[8:].isfinite().all()
    assert torch.equal(load, torch.ops.visattn.moh_head_load(ref_keep, 121, shared)) and load.shape == (5, heads)
    _, _, no_load = torch.ops.visattn.moh_router_gates(x, weights, *budget, 0)
    assert no_load.numel() == 0
    with pytest.raises(RuntimeError, match="whole images of 100"):
        torch.ops.visattn.moh_router_gates(x, weights, *budget, 100)
    with pytest.raises(RuntimeError, match="rows do not match the budget"):
        torch.ops.visattn.moh_router_gates(x, weights[:-1], *budget, 121)
    with pytest.raises(RuntimeError, match=r"\[R_i, 48\] float32"):
        torch.ops.visattn.moh_router_gates(x, [w[:, :40] for w in weights], *budget, 121)


@pytest.mark.parametrize("heads, shared, topk, two_stage", BUDGETS)
def test_inference_routing_in_the_fused_op_equals_the_pytorch_routing(kernel, monkeypatch, heads, shared, topk,
                                                                      two_stage):
    """Where the logits probe chose the kernels' loops, the router of a layer in inference runs moh_router_gates
    alone, with gates, selection and head load as the PyTorch routing gives them; with gradients it does not."""
    import visattn.attention.routing as routing

    monkeypatch.setattr(routing, "_logits_path", lambda *args: True)
    layer = _layer(heads, shared, topk, two_stage)
    x = torch.randn(3, 11, 48) * 4
    with torch.no_grad():
        with torch.profiler.profile() as profile:
            gates, selected = layer.router(x, None)
            load = layer.router.head_load
            out = layer(x)
        ran = [event.name for event in profile.events() if event.name.startswith("visattn::")]
        with kernels.disabled():
            ref_gates, ref_selected = layer.router(x, None)
            ref_load = layer.router.head_load
            ref_out = layer(x)
    assert ran.count("visattn::moh_router_gates") == 2 and "visattn::moh_gates" not in ran
    torch.testing.assert_close(gates, ref_gates, rtol=1e-5, atol=1e-6)
    assert torch.equal(selected, ref_selected) and torch.equal(load, ref_load)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    with torch.profiler.profile() as profile:
        layer.router(x.requires_grad_(), None)
    assert "visattn::moh_router_gates" not in {event.name for event in profile.events()}
