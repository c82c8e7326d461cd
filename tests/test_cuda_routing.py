"""MoH's Triton gates for GPUs (visattn.kernels.cuda_routing) against the PyTorch routing they replace.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, on CPU tensors), and the
router's GPU branch is reached by declaring CPU tensors eligible; with a GPU the same checks run on it.
"""

import pytest
import torch

import visattn.kernels as kernels
from visattn.attention import build_attention
from visattn.kernels import cuda_routing

pytestmark = pytest.mark.skipif(not cuda_routing.available(), reason="triton is not installed (a CPU-only torch)")

BUDGETS = [  # (heads, shared, topk, two_stage)
    (8, 2, 2, True), (8, 1, 3, True), (8, 0, 4, False), (8, 2, 6, True), (6, 3, 2, False), (12, 0, 11, False),
    (16, 4, 5, True), (8, 8, 0, False),  # the last: dense, soft weights over every head
]
GPU = torch.cuda.is_available()


@pytest.fixture
def device(monkeypatch):
    """"cuda" on a machine with a GPU; else "cpu", with the kernel interpreted (conftest.py sets
    TRITON_INTERPRET) and the router's GPU branch taken for CPU tensors."""
    if GPU:
        return "cuda"
    monkeypatch.setattr("visattn.attention.routing.eager_cuda_gates", lambda x: type(x) is torch.Tensor)
    # and the router's logits from F.linear, as on a GPU (the CPU kernels' own matmul rounds otherwise)
    monkeypatch.setattr("visattn.attention.routing.moh_router_logits_op", lambda: None)
    return "cpu"


@pytest.fixture
def calls(monkeypatch):
    """The kernel's calls, counted (None still where ``kernels.moh_cuda_gates_op`` says so)."""
    seen = []

    def counted(*args, **kwargs):
        seen.append(1)
        return cuda_routing.moh_gates_cuda(*args, **kwargs)

    monkeypatch.setattr("visattn.attention.routing.moh_cuda_gates_op",
                        lambda: None if kernels.moh_cuda_gates_op() is None else counted)
    return seen


def assert_same_load(load, ref):
    """The kernel's head load (a count of the image's tokens / N) against ``mean``'s: the same bits on a CPU; on a
    GPU ``mean`` multiplies by 1/N and Triton divides with the approximate ``div.full.f32`` (up to 2 ulps), so the two
    may be a few float32 ulps apart (2 seen on an H200)."""
    if load.device.type == "cpu":
        assert torch.equal(load, ref)
    else:
        torch.testing.assert_close(load, ref, rtol=2**-21, atol=0)


def _layer(heads, shared, topk, two_stage, device, dim=48, **kw):
    return build_attention("moh", dim, num_heads=heads, shared_heads=shared, routed_topk=topk, two_stage=two_stage,
                           impl="dense", **kw).to(device).eval()


@pytest.mark.parametrize("heads, shared, topk, two_stage", BUDGETS)
@pytest.mark.parametrize("scale", [1.0, 30.0])  # 30: logits far apart, probabilities near 0 and 1
def test_triton_gates_equal_the_pytorch_routing(device, calls, heads, shared, topk, two_stage, scale):
    torch.manual_seed(heads * 10 + topk)
    layer = _layer(heads, shared, topk, two_stage, device)
    router = layer.router
    x = torch.randn(2, 147, 48, device=device) * scale  # an image of 147 tokens: 128 and 19 in the kernel
    with torch.no_grad():
        gates, none = router(x, None, selection=False)
        load = router.head_load
        out = layer(x)
        _, selected = router(x, None, selection=True)
        with kernels.disabled():  # the PyTorch routing
            ref_gates, _ = router(x, None, selection=False)
            ref_load = router.head_load
            ref_out = layer(x)
            _, ref_selected = router(x, None, selection=True)
    assert len(calls) == 3 and none is None
    assert load.shape == (2, heads)
    assert_same_load(load, ref_load)
    assert gates.shape == (2, 147, heads) and gates.dtype == torch.float32 and gates.is_contiguous()
    torch.testing.assert_close(gates, ref_gates, rtol=1e-5, atol=1e-6)
    assert torch.equal(selected, ref_selected)
    assert torch.equal(selected.sum(-1), torch.full((2, 147), shared + topk if topk else heads, device=device))
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)


def test_the_kernel_reads_low_precision_logits_in_either_layout(device):
    torch.manual_seed(0)
    S, E, k = 3, 9, 4
    logits = torch.randn(S + E + 2, 70, device=device).to(torch.bfloat16)
    ref = cuda_routing.moh_gates_cuda(logits.float(), S, E, k, True, True, 1e-7, 35)
    token_major = logits.t().contiguous().t()  # strides (1, R): the router's matmul viewed head-major
    for form in (logits, token_major):
        gates, keep, load = cuda_routing.moh_gates_cuda(form, S, E, k, True, True, 1e-7, 35)
        assert torch.equal(gates, ref[0]) and torch.equal(keep, ref[1]) and torch.equal(load, ref[2])
    # two images of 35 tokens: the shared heads' load is 1, a routed head's the share of tokens that chose it
    expected = torch.cat([torch.ones(2, S, device=device), keep.view(E, 2, 35).mean(2).t()], 1)
    assert torch.equal(load, expected)
    # the gates of a token: softmax over the shared logits times 2 * alpha0 * S, and k routed heads
    # renormalised to 2 * alpha1 * k
    alpha = torch.softmax(logits[-2:].float(), 0) * 2
    shared = torch.softmax(logits[:S].float(), 0) * alpha[:1] * S
    torch.testing.assert_close(gates[:, :S].t(), shared)
    torch.testing.assert_close(gates[:, S:].sum(1), alpha[1] * k)
    assert torch.equal(keep.sum(0), torch.full((70,), float(k), device=device))


def test_ties_go_to_the_lower_head_and_nan_stays_in_its_token(device):
    S, E, k = 0, 6, 2
    logits = torch.zeros(E, 3, device=device)  # token 0: all equal
    logits[:, 1] = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, 2.0])  # token 1: head 5, then 1 over 2 and 3
    logits[2, 2] = float("nan")
    gates, keep, _ = cuda_routing.moh_gates_cuda(logits, S, E, k, False, False, 1e-7, 3)
    assert keep[:, 0].tolist() == [1, 1, 0, 0, 0, 0]
    assert keep[:, 1].tolist() == [0, 1, 0, 0, 0, 1]
    assert gates[2].isnan().all() and gates[:2].isfinite().all()


def test_a_budget_that_does_not_match_the_logits_is_refused(device):
    with pytest.raises(ValueError, match="logits have 5 rows.*needs 6"):
        cuda_routing.moh_gates_cuda(torch.zeros(5, 4, device=device), 2, 2, 1, True, True, 1e-7, 4)
    with pytest.raises(ValueError, match="6 tokens are not whole images of tokens=4"):
        cuda_routing.moh_gates_cuda(torch.zeros(6, 6, device=device), 2, 2, 1, True, True, 1e-7, 4)


def test_the_pytorch_routing_runs_where_the_kernel_does_not_apply(device, calls):
    x = torch.randn(2, 9, 48, device=device)
    with torch.no_grad():
        _layer(8, 2, 2, True, device, routing="head_choice")(x)
        _layer(8, 2, 2, False, device, gate="binary_ste")(x)
        _layer(8, 2, 2, False, device, router="l2norm")(x)
        with kernels.disabled():
            _layer(8, 2, 2, True, device)(x)
    assert calls == []
    layer = _layer(8, 2, 2, True, device)
    layer.train()(x)  # training: gradients and the load-balancing loss (RoutedGatesCuda)
    assert layer.router.aux_loss is not None and layer.router.aux_loss.requires_grad
    layer.eval()(x.requires_grad_())  # gradients to x
    with torch.no_grad():
        layer.eval()(x)
    assert calls == [1, 1, 1]


def _train_step(router, x, w, aux_weight):
    """gates [B, N, H] of a training forward and the gradients of (gates * w).sum() + aux_weight * aux with
    respect to x and the router's parameters."""
    gates, _ = router(x, None, selection=False)
    aux = router.aux_loss if aux_weight else None
    loss = (gates * w).sum() + (aux_weight * aux if aux is not None else 0.0)
    params = [p for p in router.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [x, *params], allow_unused=True)
    return gates.detach(), None if aux is None else aux.detach(), router.head_load, grads


@pytest.mark.parametrize("heads, shared, topk, two_stage", BUDGETS)
def test_triton_training_gates_and_gradients_equal_the_pytorch_routing(device, calls, heads, shared, topk,
                                                                       two_stage):
    torch.manual_seed(heads * 10 + topk)
    layer = _layer(heads, shared, topk, two_stage, device).train()
    with torch.no_grad():
        for p in layer.router.parameters():
            p.add_(torch.randn_like(p) * 0.5)  # logits spread out: uneven loads, kept sums far from eps
    x = (torch.randn(2, 37, 48, device=device) * 3).requires_grad_()  # 37 tokens: a partial block
    w = torch.randn(2, 37, heads, device=device)
    gates, aux, load, grads = _train_step(layer.router, x, w, 3.0)
    with kernels.disabled():
        ref_gates, ref_aux, ref_load, ref_grads = _train_step(layer.router, x, w, 3.0)
    assert len(calls) == 1
    torch.testing.assert_close(gates, ref_gates, rtol=1e-5, atol=1e-6)
    assert_same_load(load, ref_load)
    assert (aux is None) == (ref_aux is None) == (topk == 0)
    if aux is not None:
        torch.testing.assert_close(aux, ref_aux, rtol=1e-5, atol=1e-7)
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert (grad is None) == (ref is None)
        if grad is not None:
            torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())


def test_the_backward_keeps_the_logits_dtype_and_layout(device):
    from visattn.attention.fused_gating import RoutedGatesCuda

    torch.manual_seed(0)
    budget = (2, 6, 2, True, True, 1e-7)  # S, E, k, two_stage, shared_routed, eps
    T, R = 40, 2 + 6 + 2
    token_major = (torch.randn(T, R, device=device) * 2).t()  # [R, T] with strides (1, R), as the router's
    w = torch.randn(T, 8, device=device)
    grads = []
    for logits in (token_major.bfloat16(), token_major.float()):
        logits = logits.detach().requires_grad_()
        gates, keep, load, aux = RoutedGatesCuda.apply(logits, cuda_routing.moh_gates_cuda, budget, 20, True)
        ((gates * w).sum() + aux).backward()
        assert not keep.requires_grad and not load.requires_grad and load.shape == (2, 8)
        grads.append(logits.grad)
    low, full = grads
    assert low.dtype == torch.bfloat16 and low.stride() == (1, R) and full.stride() == (1, R)
    bf16_inputs = token_major.bfloat16().float().detach().requires_grad_()
    gates, _, _, aux = RoutedGatesCuda.apply(bf16_inputs, cuda_routing.moh_gates_cuda, budget, 20, True)
    ((gates * w).sum() + aux).backward()
    # the same float32 gradient, stored in bf16 (one bf16 step: the interpreter's rounding may differ)
    torch.testing.assert_close(low.float(), bf16_inputs.grad, rtol=2**-7, atol=1e-6)
    with pytest.raises(ValueError, match=r"keep \(5, 40\).*expected \(6, 40\)"):
        cuda_routing.moh_gates_backward_cuda(full, keep[:5], w, None, *budget)


def test_cpu_tensors_never_take_the_gpu_kernel():
    from visattn.attention.fused_gating import eager_cuda_gates

    assert not eager_cuda_gates(torch.zeros(2, 3, 4))


def _vit(depth=12):
    """A MoH ViT-S/16 (every layer on the masked dense path) and a batch of 4 images, on the CPU."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("visattn_vit_small_patch16_224", attn={"name": "moh", "impl": "dense"}, num_classes=10,
                              depth=depth)
    return model, torch.randn(4, 3, 224, 224)


@pytest.mark.skipif(not GPU, reason="needs a GPU: a whole model under bf16 autocast")
def test_a_moh_vit_in_bf16_on_the_gpu_equals_its_pytorch_routing(calls):
    model, x = _vit()
    model, x = model.cuda().eval(), x.cuda()
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        out = model(x)
        with kernels.disabled():
            ref = model(x)
    assert len(calls) == len(model.blocks)
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.02, atol=0.02)  # the gates rounded to bf16


@pytest.mark.parametrize("autocast", [False, True])
def test_a_moh_vit_training_step_equals_its_pytorch_routing(device, calls, autocast):
    """A whole model's router gradients through the kernel, forward and backward (the logits a strided view of the
    qkv matmul's extra columns; images of 197 tokens, two blocks of the kernel's loop), against the PyTorch
    routing. In float32: to float rounding. Under bf16 autocast the two routings' gates differ by rounding, which
    moves later blocks' top-k choices where scores are close: over 12 blocks that moved a router gradient by 5-14%,
    also on a CPU with its exact compiled kernels, and in float32 by 6e-6 (2026-11-27). So: two blocks, and 5%."""
    model, x = _vit(depth=2)
    model, x = model.to(device).train(), x.to(device)
    grads = []
    for off in (False, True):
        model.zero_grad(set_to_none=True)
        with (kernels.disabled() if off else torch.enable_grad(),
              torch.autocast(device, torch.bfloat16, enabled=autocast)):
            loss = model(x).float().square().mean()
            loss = loss + 0.01 * sum(block.attn.router.aux_loss for block in model.blocks)
        loss.backward()
        grads.append({name: p.grad.float() for name, p in model.named_parameters() if "router" in name})
    assert len(calls) == len(model.blocks)
    tolerance = 0.05 if autocast else 1e-3
    for name, grad in grads[0].items():
        ref = grads[1][name]
        torch.testing.assert_close(grad, ref, rtol=tolerance, atol=tolerance * ref.abs().max().item(), msg=name)
