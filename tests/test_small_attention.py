"""The small-heads attention kernel (visattn/kernels/small_attention.cpp, visattn.attention.small_heads): equal to
SDPA to float rounding, forward and backward, its limits named in its errors, and taken by a layer in eval where the
probe timed it faster, in training only where the layer's run chose it (visattn.attention.train_paths). No timing
is asserted (docs/benchmarks.md has those)."""

import pytest
import torch
import torch.nn.functional as F

import visattn.attention.small_heads as small_heads
import visattn.kernels as kernels
from visattn.attention import build_attention
from visattn.attention.impl_probe import ImplProbe
from visattn.utils.flops import count_flops


@pytest.fixture
def op():
    if kernels.small_attention_op() is None:
        pytest.skip("no C++ toolchain: SDPA runs instead")
    return kernels.small_attention_op()


def _qkv(B, H, Hkv, N, d, M=None, seed=0):
    """q [B, H, N, d] and k, v [B, Hkv, M, d] as views of one packed projection, as a layer's qkv split gives them."""
    torch.manual_seed(seed)
    M = N if M is None else M
    packed = torch.randn(B, max(N, M), (H + 2 * Hkv) * d) * 2
    q = packed[:, :N, : H * d].view(B, N, H, d).transpose(1, 2)
    k = packed[:, :M, H * d : (H + Hkv) * d].view(B, M, Hkv, d).transpose(1, 2)
    v = packed[:, :M, (H + Hkv) * d :].view(B, M, Hkv, d).transpose(1, 2)
    return q, k, v


@pytest.mark.parametrize(
    ("B", "H", "Hkv", "N", "M", "d"),
    [
        (3, 8, 8, 17, 17, 12),  # the study classifier's layers
        (2, 8, 8, 49, 49, 8),  # the study DiT's
        (2, 6, 2, 9, 9, 32),  # grouped keys and values, the widest heads
        (1, 2, 2, 1, 1, 1),  # one token, one-wide heads
        (2, 3, 3, 64, 64, 5),  # the most keys; a width no vector divides
        (2, 4, 4, 7, 20, 16),  # fewer queries than keys
        (0, 4, 4, 7, 7, 16),  # no images
    ],
)
@pytest.mark.parametrize("contiguous", [False, True])
def test_equals_sdpa(op, B, H, Hkv, N, M, d, contiguous):
    q, k, v = _qkv(B, H, Hkv, N, d, M)
    if contiguous:  # [B, H, N, d] tensors, as a q/k norm gives them
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = op(q, k, v, d**-0.5)
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=H != Hkv)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert out.transpose(1, 2).is_contiguous()  # the merged [B, N, H, d] layout the output projection reads


def test_scale_is_the_one_given(op):
    q, k, v = _qkv(2, 4, 4, 10, 8)
    ref = F.scaled_dot_product_attention(q, k, v, scale=1.0)
    torch.testing.assert_close(op(q, k, v, 1.0), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, k, v: (q, torch.randn(2, 4, 65, 8), torch.randn(2, 4, 65, 8)), "keys <= 64"),
        (lambda q, k, v: tuple(torch.randn(2, 4, 10, 33) for _ in range(3)), "width <= 32"),
        (lambda q, k, v: (q, k.transpose(-1, -2), v), "must be"),  # [B, Hkv, d, M]: its sizes do not match
        (lambda q, k, v: (q.double(), k.double(), v.double()), "float32"),
        (lambda q, k, v: (q, k[:, :3], v[:, :3]), "multiple of Hkv"),
        (lambda q, k, v: (q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v), "contiguous"),
    ],
)
def test_bad_arguments_are_refused_with_the_limit(op, change, message):
    q, k, v = _qkv(2, 4, 4, 10, 8)
    with pytest.raises(RuntimeError, match=message):
        op(*change(q, k, v), 0.3)


class FixedTimes:
    """A probe timer: each path's seconds from ``times``; counts the kernel's timed calls."""

    def __init__(self, times):
        self.times, self.calls = times, []

    def __call__(self, path, run):
        self.calls.append(path)
        return self.times[path]


def _counting(monkeypatch, op):
    calls = []
    monkeypatch.setattr(small_heads, "small_attention_op", lambda: (lambda *a: calls.append(1) or op(*a)))
    return calls


@pytest.mark.parametrize(("kernel_time", "taken"), [(0.5, True), (1.5, False)])
def test_a_layer_in_eval_takes_the_kernel_where_the_probe_timed_it_faster(op, monkeypatch, kernel_time, taken):
    layer = build_attention("mha", 48, num_heads=4).eval()
    x = torch.randn(2, 17, 48)
    with torch.no_grad(), kernels.disabled():
        ref = layer(x)
    calls = _counting(monkeypatch, op)
    probe = ImplProbe(timer=FixedTimes({"sdpa": 1.0, "small_attention": kernel_time}))
    monkeypatch.setattr(small_heads, "PROBE", probe)
    with torch.no_grad():
        out = layer(x)
        probed = len(calls)
        again = layer(x)
    (choice,) = probe.choices.values()
    assert choice.path == ("small_attention" if taken else "sdpa")
    assert len(calls) - probed == int(taken)  # the second forward: the kernel once, or SDPA
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, ref, rtol=1e-5, atol=1e-5)


def test_sdpa_runs_where_the_kernel_does_not_apply(op, monkeypatch):
    calls = _counting(monkeypatch, op)
    monkeypatch.setattr(small_heads, "PROBE", ImplProbe(timer=FixedTimes({"sdpa": 1.0, "small_attention": 0.1})))
    layer = build_attention("mha", 48, num_heads=4, attn_drop=0.1)
    x = torch.randn(2, 17, 48)
    layer.train()(x).sum().backward()  # training: dropout and gradients
    layer.eval()(x).sum().backward()  # eval with gradients: no backward in the kernel
    with torch.no_grad():
        layer(torch.randn(2, 65, 48))  # more keys than the kernel holds
        layer(x, attn_mask=torch.ones(17, 17, dtype=torch.bool))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x)
    flops = count_flops(layer, x)  # the FLOP counter sees SDPA (the kernel's FLOPs would not be counted)
    assert calls == []
    with kernels.disabled():
        assert flops == count_flops(layer, x)
    with torch.no_grad():
        layer(x)
    assert calls  # and the same layer takes the kernel in plain eval


def test_scripted_layers_keep_sdpa(op):
    layer = build_attention("mha", 48, num_heads=4).eval()
    x = torch.randn(2, 17, 48)
    with torch.no_grad():
        torch.testing.assert_close(torch.jit.script(layer)(x), layer(x), rtol=1e-5, atol=1e-5)


def _gates(B, N, H, seed=1):
    """MoH-like gates [B, N, H] (a transposed view: read through its strides): about half the (token, head) pairs 0,
    head 1 of image 0 off for every token, and every head of the last image off."""
    torch.manual_seed(seed)
    gates = torch.rand(B, H, N) * (torch.rand(B, H, N) < 0.5)
    gates[0, 1] = 0
    gates[-1] = 0
    return gates.transpose(1, 2)


@pytest.mark.parametrize("contiguous", [False, True])  # the kernel reads token by token / head by head
@pytest.mark.parametrize(("H", "Hkv", "N", "d"), [(8, 8, 17, 12), (6, 2, 9, 32), (4, 4, 49, 8)])
def test_rows_gated_0_are_skipped_and_the_others_unchanged_bit_for_bit(op, H, Hkv, N, d, contiguous):
    q, k, v = _qkv(3, H, Hkv, N, d)
    if contiguous:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    gates = _gates(3, N, H)
    full = op(q, k, v, d**-0.5)
    out = op(q, k, v, d**-0.5, gates)
    attended = (gates != 0).transpose(1, 2)  # [B, H, N], the output's layout
    assert torch.equal(out[attended], full[attended])
    assert (out[~attended] == 0).all() and not (full[~attended] == 0).all()
    assert (out[0, 1] == 0).all() and (out[-1] == 0).all()  # a head, and an image, with no row attended
    assert out.transpose(1, 2).is_contiguous()
    # scale_rows: each row multiplied by its gate as it is written, the product a gated merge takes after
    scaled = op(q, k, v, d**-0.5, gates, True)
    assert torch.equal(scaled, out * gates.transpose(1, 2).unsqueeze(-1)) and scaled.transpose(1, 2).is_contiguous()


def test_a_nan_gate_is_not_skipped(op):
    q, k, v = _qkv(2, 4, 4, 10, 8)
    gates = torch.zeros(2, 10, 4)
    gates[1, 3, 2] = float("nan")  # a NaN gate must reach the output, not be hidden by a skipped row
    out = op(q, k, v, 0.3, gates)
    torch.testing.assert_close(out[1, 2, 3], op(q, k, v, 0.3)[1, 2, 3], rtol=0, atol=0)
    assert out.abs().sum() == out[1, 2, 3].abs().sum()


@pytest.mark.parametrize("gates", [torch.ones(2, 4, 10), torch.ones(2, 10, 4).double()])
def test_bad_gates_are_refused_with_their_shape(op, gates):
    q, k, v = _qkv(2, 4, 4, 10, 8)
    with pytest.raises(RuntimeError, match=r"gates must be float32 \[B, N, H\] = \[2, 10, 4\]"):
        op(q, k, v, 0.3, gates)


def test_moh_in_eval_skips_unselected_rows_with_the_masked_dense_output(op, monkeypatch):
    layer = build_attention("moh", 48, num_heads=4, shared_heads=1, routed_topk=1, impl="dense").eval()
    x = torch.randn(3, 17, 48)
    calls = []
    monkeypatch.setattr(small_heads, "small_attention_op", lambda: (lambda *a: calls.append(len(a)) or op(*a)))
    monkeypatch.setattr(small_heads, "PROBE", ImplProbe(timer=FixedTimes({"sdpa": 1.0, "small_attention": 0.5})))
    with torch.no_grad():
        skipping = layer(x)
        assert calls[-1] == 6  # the gates were passed, to skip rows and gate the others
        layer.attends_by_sdpa = False  # every row attended, then gated
        every_row = layer(x)
        assert calls[-1] == 4
        with kernels.disabled():
            sdpa = layer(x)
    torch.testing.assert_close(skipping, every_row, rtol=1e-6, atol=1e-6)  # one projection GEMM or another
    torch.testing.assert_close(skipping, sdpa, rtol=1e-5, atol=1e-5)


def _sdpa_grads(q, k, v, grad_out, scale):
    """SDPA's output and gradients for q, k, v (the reference of the kernel's backward)."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(grad_out)
    return out, q.grad, k.grad, v.grad


@pytest.mark.parametrize(
    ("B", "H", "Hkv", "N", "M", "d"),
    [(3, 8, 8, 17, 17, 12), (2, 8, 8, 49, 49, 8), (2, 6, 2, 9, 9, 32), (1, 2, 2, 1, 1, 1), (2, 3, 3, 64, 64, 5),
     (2, 4, 4, 7, 20, 16), (0, 4, 4, 7, 7, 16)],
)
@pytest.mark.parametrize("contiguous", [False, True])
def test_backward_equals_sdpa(op, B, H, Hkv, N, M, d, contiguous):
    q, k, v = _qkv(B, H, Hkv, N, d, M)
    if contiguous:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    grad_out = torch.randn(B, N, H, d).transpose(1, 2)  # the merge's backward gives this layout
    ref, *ref_grads = _sdpa_grads(q, k, v, grad_out, d**-0.5)
    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = small_heads.SmallAttention.apply(qq, kk, vv, d**-0.5, None, False)
    out.backward(grad_out)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for name, got, want in zip("qkv", (qq.grad, kk.grad, vv.grad), ref_grads, strict=True):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("contiguous", ["q", "kv"])
def test_queries_and_keys_in_different_layouts_equal_sdpa(op, contiguous):
    """The kernel reads a packed projection in one pass token by token; with queries or keys head-major ([B, H, N, d]
    tensors) it reads each in its own order, with the gates, forward and backward."""
    q, k, v = _qkv(3, 8, 8, 17, 12)
    if contiguous == "q":
        q = q.contiguous()
    else:
        k, v = k.contiguous(), v.contiguous()
    gates = _gates(3, 17, 8)
    on = (gates != 0).transpose(1, 2).unsqueeze(-1)  # [B, H, N, 1]
    grad_out = torch.randn(3, 17, 8, 12).transpose(1, 2) * on
    ref, *ref_grads = _sdpa_grads(q, k, v, grad_out, 12**-0.5)
    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = small_heads.SmallAttention.apply(qq, kk, vv, 12**-0.5, gates, False)
    out.backward(grad_out)
    torch.testing.assert_close(out, ref * on, rtol=1e-5, atol=1e-5)
    for name, got, want in zip("qkv", (qq.grad, kk.grad, vv.grad), ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(("H", "Hkv", "N", "d"), [(8, 8, 17, 12), (6, 2, 9, 32)])
def test_backward_skips_the_rows_gated_0_exactly(op, H, Hkv, N, d):
    """Where the heads are multiplied by the gates, a row gated 0 has no gradient: skipping it gives SDPA's
    gradients of the gated output."""
    q, k, v = _qkv(3, H, Hkv, N, d)
    gates = _gates(3, N, H)
    on = (gates != 0).transpose(1, 2).unsqueeze(-1)  # [B, H, N, 1]
    grad_out = torch.randn(3, N, H, d).transpose(1, 2) * on
    _, *ref_grads = _sdpa_grads(q, k, v, grad_out, d**-0.5)
    dq, dk, dv, dgates = torch.ops.visattn.small_attention_backward(grad_out, q, k, v, d**-0.5, gates)
    assert dgates.numel() == 0  # without scale_rows the gates only select rows
    assert (dq * ~on == 0).all() and (dq[0, 1] == 0).all() and (dk[-1] == 0).all() and (dv[-1] == 0).all()
    for name, got, want in zip("qkv", (dq, dk, dv), ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)


def test_scaled_rows_need_the_gates(op):
    q, k, v = _qkv(2, 4, 4, 10, 8)
    with pytest.raises(RuntimeError, match="scale_rows needs the gates"):
        op(q, k, v, 0.3, None, True)


@pytest.mark.parametrize(("H", "Hkv", "N", "d"), [(8, 8, 17, 12), (6, 2, 9, 32), (4, 4, 49, 8)])
def test_backward_of_scaled_rows_equals_sdpa_times_the_gates(op, H, Hkv, N, d):
    """The gradients of SDPA's heads times gates [B, N, H], the gates' own included, except at the rows gated 0:
    there the kernel gives the gate 0, the gradient MoH's soft gates pass back there (not dO . O)."""
    q, k, v = _qkv(3, H, Hkv, N, d)
    gates = _gates(3, N, H)
    grad_out = torch.randn(3, N, H, d).transpose(1, 2)
    qr, kr, vr, gr = (t.detach().requires_grad_(True) for t in (q, k, v, gates))
    ref = F.scaled_dot_product_attention(qr, kr, vr, enable_gqa=H != Hkv) * gr.transpose(1, 2).unsqueeze(-1)
    ref.backward(grad_out)
    qq, kk, vv, gg = (t.detach().requires_grad_(True) for t in (q, k, v, gates))
    out = small_heads.SmallAttention.apply(qq, kk, vv, d**-0.5, gg, True)
    out.backward(grad_out)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    on = gates != 0
    assert (gg.grad[~on] == 0).all() and not (gr.grad[~on] == 0).all()
    torch.testing.assert_close(gg.grad[on], gr.grad[on], rtol=1e-4, atol=1e-5)
    for name, got, want in zip("qkv", (qq.grad, kk.grad, vv.grad), (qr.grad, kr.grad, vr.grad), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)


def test_backward_refuses_a_grad_of_another_shape(op):
    q, k, v = _qkv(2, 4, 4, 10, 8)
    with pytest.raises(RuntimeError, match="grad_out must be float32 shaped as q"):
        torch.ops.visattn.small_attention_backward(torch.ones(2, 4, 9, 8), q, k, v, 0.3, None)


@pytest.mark.parametrize(
    ("kind", "budget"), [("mha", {}), ("moh", {"shared_heads": 1, "routed_topk": 1, "impl": "dense"})]
)
def test_a_layer_trains_on_the_kernel_only_where_its_run_chose_it(op, monkeypatch, kind, budget):
    """train_attention="small_attention": forward and every gradient as on SDPA (MoH's rows gated 0 skipped both
    ways); the default, and autocast, train on SDPA."""
    torch.manual_seed(0)
    sdpa, fast = (build_attention(kind, 48, num_heads=4, **budget) for _ in range(2))
    fast.load_state_dict(sdpa.state_dict())
    fast.train_attention = "small_attention"
    calls = []
    monkeypatch.setattr(small_heads, "small_attention_op", lambda: (lambda *a: calls.append(len(a)) or op(*a)))
    x = torch.randn(3, 17, 48)
    outs = []
    for layer in (sdpa, fast):
        out = layer.train()(x)
        loss = out.square().mean() + (0.01 * layer.aux_loss if layer.aux_loss is not None else 0)
        loss.backward()
        outs.append(out)
        assert len(calls) == (1 if layer is fast else 0)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(fast.named_parameters(), sdpa.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast(x).float().sum().backward()  # bf16: SDPA
    assert len(calls) == 1
