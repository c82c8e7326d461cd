"""MoH's routing and gating on the compiled kernels with gradients (visattn.attention.fused_gating)
against the PyTorch code they replace: outputs, load-balancing loss and every gradient."""

import pytest
import torch

import visattn.kernels as kernels
from visattn.attention import build_attention
from visattn.attention.fused_gating import (
    GatedMerge,
    GatedProjection,
    RoutedGates,
    gated_merge_runs,
    gated_projection_runs,
)

BUDGETS = [  # (heads, shared, topk, two_stage)
    (8, 2, 2, True), (8, 1, 3, True), (8, 0, 4, False), (8, 2, 6, True), (6, 3, 2, False), (4, 2, 1, True),
    (12, 0, 11, False), (8, 4, 4, True), (8, 8, 0, False),  # the last: dense, soft weights over every head
]


@pytest.fixture(autouse=True)
def kernel():
    if kernels.moh_routing_op() is None:
        pytest.skip("no C++ toolchain here: the kernels cannot be built (the PyTorch path runs instead)")


def _step(layer, x, weights, aux_weight=0.37, kernels_on=True):
    """One forward and backward of sum(out * weights) + aux_weight * aux; returns the output, the loss and
    every gradient (x first)."""
    layer.zero_grad()
    x = x.detach().requires_grad_()
    with torch.enable_grad() if kernels_on else kernels.disabled():
        out = layer(x)
        aux = layer.router.aux_loss  # None for a dense layer (no pool to balance)
        aux = torch.zeros(()) if aux is None else aux
        ((out * weights).sum() + aux_weight * aux).backward()
    grads = {"x": x.grad}
    grads.update({name: p.grad for name, p in layer.named_parameters() if p.grad is not None})
    return out.detach(), aux.detach(), grads


@pytest.mark.parametrize("heads, shared, topk, two_stage", BUDGETS)
@pytest.mark.parametrize("scale", [1.0, 6.0])  # 6: logits further apart, gates near 0 and 1
@pytest.mark.parametrize("qkv_bias", [False, True])
def test_training_on_the_kernels_equals_the_pytorch_routing(heads, shared, topk, two_stage, scale, qkv_bias):
    torch.manual_seed(heads * 10 + topk)
    layer = build_attention("moh", 48, num_heads=heads, shared_heads=shared, routed_topk=topk, two_stage=two_stage,
                            qkv_bias=qkv_bias, impl="dense").train()
    with torch.no_grad():
        for p in layer.router.parameters():
            p.mul_(scale)
    x = torch.randn(3, 11, 48)
    weights = torch.randn(3, 11, 48)
    out, aux, grads = _step(layer, x, weights)
    ref_out, ref_aux, ref_grads = _step(layer, x, weights, kernels_on=False)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux, ref_aux, rtol=1e-5, atol=1e-7)
    assert grads.keys() == ref_grads.keys() and any("router" in name for name in grads)
    for name, grad in grads.items():
        # atol relative to the gradient's largest entry: where the gates' terms cancel (a pool of 2, k=1:
        # the renormalised gate is exactly alpha2) the rest is rounding on either side
        scale_of = ref_grads[name].abs().max().item()
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-4 * scale_of, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("aux_weight", [0.0, None])
def test_the_routing_backward_takes_a_missing_gradient(aux_weight):
    """The loss left out of the objective (no gradient reaches it), or only the loss (the gates unused)."""
    torch.manual_seed(0)
    layer = build_attention("moh", 48, num_heads=8, shared_heads=2, routed_topk=3, impl="dense").train()
    logits = torch.randn(layer.router.logit_rows, 40, requires_grad=True)
    budget = (2, 6, 3, True, True, layer.router.eps)
    gates, keep, aux = RoutedGates.apply(logits, budget, True)
    assert not keep.requires_grad and keep.sum(0).eq(3).all()
    (gates.sum() if aux_weight == 0.0 else aux).backward()
    # the reference: the PyTorch routing on the same logits
    ref = logits.detach().requires_grad_()
    with kernels.disabled():
        layer.router.train()
        ref_gates, _ = layer.router(torch.zeros(1, 40, 48), None, selection=False, logits=ref)
        (ref_gates.sum() if aux_weight == 0.0 else layer.router.aux_loss).backward()
    torch.testing.assert_close(logits.grad, ref.grad, rtol=1e-4, atol=1e-6)


def test_the_routing_kernel_reads_logits_in_either_layout():
    """Head-major [R, T], or the router's columns of the fused projection read in place ([T, R] with a row
    stride); the gradient comes back in the logits' own layout."""
    torch.manual_seed(0)
    rows, tokens = 10, 300  # more than one block of tokens
    fused = torch.randn(tokens, 40, requires_grad=True)
    budget = (3, 5, 2, True, True, torch.finfo(torch.float32).eps)
    weights = torch.randn(tokens, 8)
    strided = fused[:, 7 : 7 + rows].t()  # token-major view: stride (1, 40)
    dense = strided.detach().contiguous().requires_grad_()
    results = []
    for logits in (strided, dense):
        gates, keep, aux = RoutedGates.apply(logits, budget, True)
        ((gates * weights).sum() + aux).backward()
        results.append((gates, keep, aux))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(fused.grad[:, 7 : 7 + rows].t(), dense.grad)
    assert fused.grad[:, :7].eq(0).all() and fused.grad[:, 7 + rows :].eq(0).all()
    keep = results[0][1]
    grad = torch.ops.visattn.moh_gates_backward(strided.detach(), keep, weights, torch.empty(0), *budget)
    assert grad.t().is_contiguous()  # token-major, as the projection's backward reads it


def _merge_reference(heads, gates):
    B, H, N, d = heads.shape
    return (heads * gates.transpose(1, 2).unsqueeze(-1)).transpose(1, 2).reshape(B, N, H * d)


def test_gated_merge_equals_the_broadcast_product():
    torch.manual_seed(0)
    heads = torch.randn(3, 11, 5, 12).transpose(1, 2)  # [B, H, N, d] laid out as SDPA's output
    gates = torch.rand(3, 11, 5)
    assert gated_merge_runs(heads, gates)
    h1, g1 = heads.detach().requires_grad_(), gates.detach().requires_grad_()
    h2, g2 = heads.detach().requires_grad_(), gates.detach().requires_grad_()
    out = GatedMerge.apply(h1, g1)
    ref = _merge_reference(h2, g2)
    assert out.shape == ref.shape == (3, 11, 60)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=0)
    torch.testing.assert_close(g1.grad, g2.grad, rtol=1e-5, atol=1e-6)
    assert h1.grad.transpose(1, 2).is_contiguous()  # the layout attention's backward takes


def test_gated_merge_serves_only_what_it_can():
    heads = torch.randn(2, 4, 7, 8)  # [B, H, N, d] contiguous: not SDPA's layout
    gates = torch.rand(2, 7, 4)
    assert not gated_merge_runs(heads, gates)
    laid_out = heads.transpose(1, 2).contiguous().transpose(1, 2)
    assert gated_merge_runs(laid_out, gates)
    assert not gated_merge_runs(laid_out.bfloat16(), gates)
    with kernels.disabled():
        assert not gated_merge_runs(laid_out, gates)
    with pytest.raises(RuntimeError, match=r"laid out as \[B, N, H, d\]"):
        torch.ops.visattn.moh_gated_merge(heads, gates)


def test_training_on_the_kernels_is_deterministic_and_keeps_nan_in_its_token():
    torch.manual_seed(0)
    layer = build_attention("moh", 48, num_heads=8, shared_heads=2, routed_topk=2, impl="dense").train()
    x = torch.randn(2, 9, 48)
    weights = torch.randn(2, 9, 48)
    first = _step(layer, x, weights)
    again = _step(layer, x, weights)
    for a, b in zip(first[2].values(), again[2].values(), strict=True):
        assert torch.equal(a, b)
    x[1, 4] = float("nan")
    out, _, grads = _step(layer, x, weights, aux_weight=0.0)
    assert out[1, 4].isnan().all() and out[0].isfinite().all()
    assert grads["x"][0].isfinite().all()


@pytest.mark.parametrize("with_bias", [True, False])
def test_gated_projection_equals_merge_then_linear(with_bias):
    """Blocks of 256 tokens: 600 tokens end in a partial block."""
    if not kernels.has_sgemm():
        pytest.skip("this torch build exports no SGEMM")
    torch.manual_seed(0)
    heads = torch.randn(4, 150, 6, 8).transpose(1, 2)  # [B, H, N, d] laid out as SDPA's output
    gates = torch.rand(4, 150, 6)
    weight = torch.randn(20, 48)
    bias = torch.randn(20) if with_bias else None
    assert gated_projection_runs(heads, gates, weight, bias)
    assert not gated_projection_runs(heads, gates, weight, torch.randn(20).bfloat16())
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (heads, gates, weight, bias)]
    refs = [t.detach().requires_grad_() if t is not None else None for t in (heads, gates, weight, bias)]
    out = GatedProjection.apply(*leaves)
    ref = torch.nn.functional.linear(_merge_reference(refs[0], refs[1]), refs[2], refs[3])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for leaf, reference in zip(leaves, refs, strict=True):
        if leaf is not None:
            torch.testing.assert_close(leaf.grad, reference.grad, rtol=1e-4, atol=1e-4)


def test_the_kernels_agree_on_two_threads():
    """Several blocks of tokens over two threads: per-thread weight gradients and per-block loss terms."""
    if not kernels.has_sgemm():
        pytest.skip("this torch build exports no SGEMM")
    torch.manual_seed(0)
    layer = build_attention("moh", 48, num_heads=8, shared_heads=2, routed_topk=3, impl="dense").train()
    x = torch.randn(8, 97, 48)  # 776 tokens: four blocks of the routing kernel and of the projection
    weights = torch.randn(8, 97, 48)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        out, aux, grads = _step(layer, x, weights)
    finally:
        torch.set_num_threads(threads)
    ref_out, ref_aux, ref_grads = _step(layer, x, weights, kernels_on=False)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux, ref_aux, rtol=1e-5, atol=1e-7)
    for name, grad in grads.items():
        scale_of = ref_grads[name].abs().max().item()
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-4 * scale_of,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_torch_func_transforms_run_the_pytorch_code():
    """torch.func.grad (per-sample gradients, e.g.) over a MoH layer: the kernels' Functions have no
    functorch rules, so the PyTorch code runs and the gradients equal autograd's."""
    from torch.func import functional_call, grad

    torch.manual_seed(0)
    layer = build_attention("moh", 48, num_heads=8, shared_heads=2, routed_topk=2, impl="dense").train()
    params = {name: p.detach() for name, p in layer.named_parameters()}
    x = torch.randn(2, 5, 48)

    def loss(p, x):
        out = functional_call(layer, p, (x,))
        return out.square().mean() + 0.37 * layer.router.aux_loss

    grads = grad(loss)(params, x)
    layer.zero_grad()
    loss(dict(layer.named_parameters()), x).backward()
    for name, p in layer.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
