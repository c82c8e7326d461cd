"""Sparse MoH inference equals the dense (masked) path for any routing."""

import pytest
import torch

from visattn import build_attention
from visattn.attention.sparse import sparse_moh_forward, sparse_moh_supported


def _moh(dim=32, heads=4, seed=0, **kwargs):
    torch.manual_seed(seed)
    m = build_attention("moh", dim, num_heads=heads, **kwargs).eval()
    with torch.no_grad():  # off the initialisation: spread router logits so selections vary per token
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m


def _assert_matches_dense(m, x, tol=1e-5):
    """Both sparse plans (sparse and dense projections) against the masked dense path."""
    with torch.no_grad():
        m.impl = "dense"
        dense = m(x)
        for projections in ("sparse", "dense"):
            sparse = sparse_moh_forward(m, x, projections=projections)
            assert sparse.dtype == dense.dtype
            torch.testing.assert_close(sparse.float(), dense.float(), rtol=tol, atol=tol, msg=projections)


BUDGETS = [(h, s, k) for h in (4, 6) for s in range(h + 1) for k in range(h - s + 1) if (k == 0) == (s == h)]


@pytest.mark.parametrize(("heads", "shared", "topk"), BUDGETS)
def test_sparse_equals_dense_every_budget(heads, shared, topk):
    m = _moh(dim=24, heads=heads, shared_heads=shared, routed_topk=topk, seed=heads + shared)
    x = torch.randn(3, 11, 24)
    _assert_matches_dense(m, x)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"qk_norm": True, "qkv_bias": True},
        {"head_dim": 12},  # inner width 48 != dim 32
        {"num_kv_heads": 2},
        {"router": "l2norm", "two_stage": False},
        {"gate": "binary_ste"},
        {"proj_bias": False, "shared_heads": 0, "routed_topk": 2},
        {"dim_out": 20},
    ],
)
def test_sparse_equals_dense_options(kwargs):
    kwargs = {"shared_heads": 1, "routed_topk": 2, **kwargs}
    m = _moh(**kwargs)
    _assert_matches_dense(m, torch.randn(2, 13, 32))


@pytest.mark.parametrize(("batch", "tokens"), [(1, 1), (1, 7), (4, 1)])
def test_batch_one_and_single_token(batch, tokens):
    m = _moh(shared_heads=1, routed_topk=1)
    _assert_matches_dense(m, torch.randn(batch, tokens, 32))


def test_an_empty_batch_gives_an_empty_output_in_eval():
    """B = 0 (e.g. a rank with no images left): the eval path returns [0, N, C] instead of failing to
    group zero tokens."""
    m = _moh(shared_heads=1, routed_topk=1)
    assert m.uses_sparse()
    with torch.no_grad():
        assert m(torch.randn(0, 5, 32)).shape == (0, 5, 32)


def test_head_that_no_token_selected():
    m = _moh(dim=36, heads=6, shared_heads=1, routed_topk=1, seed=3)
    with torch.no_grad():  # the router can never pick the last two routed heads
        m.router.routed.weight[-2:] = 0
        m.router.routed.weight[0] = m.router.routed.weight[0].abs() + 1
    x = torch.randn(2, 9, 36).abs()
    _assert_matches_dense(m, x)
    assert not m.stats["head_load"][:, -2:].any()


def test_unselected_head_weights_do_not_matter_in_sparse_path():
    m = _moh(shared_heads=1, routed_topk=1, seed=5)
    x = torch.randn(1, 1, 32)
    with torch.no_grad():
        m.impl = "sparse"
        before = m(x)
        _, selected = m.router(x)
        off = int((~selected[0, 0]).nonzero()[0])
        d = m.head_dim
        m.qkv.weight[off * d : (off + 1) * d] = float("nan")  # the unselected head's query weights
        after = m(x)
    torch.testing.assert_close(after, before)


def test_bf16_autocast_close_to_dense():
    m = _moh(shared_heads=1, routed_topk=2)
    x = torch.randn(2, 16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_matches_dense(m, x, tol=0.05)
        assert m(x).dtype == torch.bfloat16


def test_auto_leaves_the_masked_path_in_eval_only():
    """auto probes in eval (here a scripted timer makes sparse projections fastest) and keeps the
    masked dense path in training, with a mask and for impl='dense'; impl='sparse' runs its path in
    training too."""
    from visattn.attention.impl_probe import ImplProbe, use_impl_probe

    fast = {"masked_dense": 3.0, "dense_projections": 2.0, "sparse_projections": 1.0, "routed_kernel": 4.0,
            "routed_kernel_loops": 4.0, "masked_kernel_loops": 4.0, "routed_kernel_dense": 4.0}
    m = _moh(shared_heads=1, routed_topk=1)
    x = torch.randn(2, 5, 32)
    with use_impl_probe(ImplProbe(timer=lambda path, run: fast[path])):
        m.eval()(x)
        assert m.last_path == "sparse_projections" and m.uses_sparse()
        m.last_path = None
        m.train()(x)
        assert m.last_path is None and not m.uses_sparse()
        assert m.aux_loss is not None  # the dense training path still computes the load-balancing loss
        m.eval()(x, attn_mask=torch.ones(5, 5, dtype=torch.bool))  # masks take the dense path
        assert m.last_path is None
        dense = build_attention("moh", 32, num_heads=4, impl="dense").eval()
        dense(x)
        assert not dense.uses_sparse() and dense.last_path is None
    sparse = build_attention("moh", 32, num_heads=4, shared_heads=1, routed_topk=2, impl="sparse")
    assert sparse.training and sparse.uses_sparse()
    sparse(x)
    # 2 of 3 routed heads per token: dense projections (compiled in eval where the kernel runs; with
    # gradients, as here, the same computation in PyTorch)
    assert sparse.last_path == "routed_kernel_dense"


@pytest.mark.parametrize("projections", ["sparse", "dense"])
def test_sparse_gradients_match_dense(projections):
    # float64: the float32 gradients of a summed square differ by rounding only, at ~1e-6 relative
    m = _moh(shared_heads=1, routed_topk=2).double().train()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    grads = {}
    for impl in ("dense", "sparse"):
        m.impl = "dense"
        m.zero_grad()
        out = m(x) if impl == "dense" else sparse_moh_forward(m, x, projections=projections)
        out.square().sum().backward()
        grads[impl] = [p.grad.clone() for p in m.parameters() if p.grad is not None]
    for a, b in zip(grads["dense"], grads["sparse"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_auto_projections_follow_routed_density(monkeypatch):
    import visattn.attention.sparse as sparse

    seen = []
    monkeypatch.setattr(sparse, "_dense_projections", lambda attn, x: seen.append("dense"))
    monkeypatch.setattr(sparse, "_sparse_projections", lambda attn, x: seen.append("sparse"))
    x = torch.randn(1, 3, 48)
    sparse_moh_forward(_moh(dim=48, heads=6, shared_heads=1, routed_topk=2), x)  # 2 of 5 routed heads
    sparse_moh_forward(_moh(dim=48, heads=6, shared_heads=3, routed_topk=2), x)  # 2 of 3
    sparse_moh_forward(
        _moh(dim=48, heads=6, shared_heads=0, routed_topk=1, router="l2norm", two_stage=False), x
    )
    assert seen == ["sparse", "dense", "dense"]
    with pytest.raises(ValueError, match="projections='fast'"):
        sparse_moh_forward(_moh(), x[..., :32], projections="fast")


def test_bad_impl_and_unsupported_sparse():
    with pytest.raises(ValueError, match="impl='fast'"):
        build_attention("moh", 32, num_heads=4, impl="fast")
    with pytest.raises(ValueError, match="scale_norm"):
        build_attention("moh", 32, num_heads=4, impl="sparse", scale_norm=True)
    auto = build_attention("moh", 32, num_heads=4, scale_norm=True).eval()
    assert not auto.uses_sparse()  # falls back to the dense path
    assert sparse_moh_supported(build_attention("mha", 32, num_heads=4)) is not None


def test_sparse_forward_skips_unselected_query_flops():
    from visattn.utils.flops import count_flops

    B, N, C = 2, 16, 32
    m = _moh(shared_heads=0, routed_topk=1, proj_bias=False)
    x = torch.randn(B, N, C)
    with torch.no_grad():
        sparse = count_flops(lambda: sparse_moh_forward(m, x, projections="sparse"))
    m.impl = "dense"
    dense = count_flops(m, x)
    # one of four heads per token: queries and outputs shrink 4x; keys/values stay dense
    assert sparse < 0.75 * dense


@pytest.mark.parametrize(("path", "routing"), [("sparse_projections", "token_choice"), ("routed_kernel", "token_choice"),
                                               ("head_gather", "head_choice")])
def test_bf16_paths_slice_autocasts_own_cast_of_the_weights(path, routing):
    """Under CPU autocast in inference, the paths that slice qkv's and proj's weights (per head, shared and
    routed) slice autocast's own cast of each weight, which it keeps for the region: a second call casts no
    weight or slice of one (cast per call, they had cost routed_kernel and sparse_projections 3% of a bf16
    DiT-B/2 layer, 13th session). The outputs stay those of the per-call casts."""
    from visattn import kernels
    from visattn.attention import sparse
    from visattn.attention.moh import PATHS

    if kernels.autocast_weight_op() is None:
        pytest.skip("no C++ toolchain: the matmuls cast the slices (autocast caches no view)")
    m = _moh(dim=64, heads=4, shared_heads=1, routed_topk=2, routing=routing, qkv_bias=True)
    x = torch.randn(2, 9, 64)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        first = PATHS[path](m, x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            second = PATHS[path](m, x)
        casts = [e.input_shapes[0] for e in prof.events() if e.name == "aten::_to_copy"]
        real = sparse.autocast_cast
        try:
            sparse.autocast_cast = lambda p, dtype: None
            per_call = PATHS[path](m, x)
        finally:
            sparse.autocast_cast = real
    weight_sized = m.head_dim * 64  # a head's rows of qkv or columns of proj, and more
    assert not [s for s in casts if len(s) == 2 and s[0] * s[1] >= weight_sized]
    assert torch.equal(first, second) and torch.equal(second, per_call)
    with pytest.raises(RuntimeError, match="inside torch.autocast"):
        kernels.autocast_weight_op()(m.qkv.weight)


@pytest.mark.parametrize("router", ["linear", "l2norm"])
def test_straight_through_gates_train_every_head_on_every_path(router):
    """Binary straight-through gates pass a gradient to every head's output, selected or not, so a training forward
    attends every head whatever the layer's impl and training attention: every parameter's gradient is the masked
    dense path's on SDPA. Its runs' probe leaves such a layer on that path, and it refuses another."""
    from visattn.attention.moh import REFERENCE_PATH
    from visattn.attention.train_paths import probed_layers

    m = _moh(dim=48, heads=4, shared_heads=1, routed_topk=1, router=router, gate="binary_ste", two_stage=False)
    m.train()
    x, grad = torch.randn(2, 17, 48), torch.randn(2, 17, 48)

    def grads(impl, attention="sdpa"):
        m.impl, m.train_attention = impl, attention
        m.zero_grad()
        m(x).backward(grad)
        return {name: p.grad.clone() for name, p in m.named_parameters()}

    want = grads("dense")
    assert want["qkv.weight" if router == "l2norm" else "router.routed.weight"].abs().sum() > 0
    for impl, attention in [("dense", "small_attention"), ("auto", "small_attention"), ("sparse", "sdpa"),
                            *((path, "sdpa") for path in m.paths)]:
        for name, got in grads(impl, attention).items():
            scale = want[name].abs().max().item()  # the perturbed weights give gradients up to ~100
            torch.testing.assert_close(got, want[name], rtol=1e-4, atol=1e-5 * scale, msg=f"{impl}, {attention}: {name}")
    m.impl = "auto"
    assert probed_layers(torch.nn.Sequential(m)) == {}
    if "routed_kernel_loops" in m.paths:
        with pytest.raises(ValueError, match="not a training path of this layer; it has: masked_dense"):
            m.train_path = "routed_kernel_loops"
    m.train_path = REFERENCE_PATH
