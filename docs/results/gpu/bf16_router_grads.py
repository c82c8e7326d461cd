"""Why a whole bf16 ViT-S's router gradients through MoH's kernels differ from the PyTorch routing's by more than 5%,
without a GPU: the largest relative difference of any router weight's gradient after one training step, kernels on
against ``visattn.kernels.disabled()``, in float32 or under bf16 autocast, through the Triton gates (in Triton's
interpreter, the router's GPU branch taken for CPU tensors) or the CPU's own compiled kernels.

    TRITON_INTERPRET=1 python docs/results/gpu/bf16_router_grads.py bf16 12 triton   # 0.14 (2026-11-27)
    TRITON_INTERPRET=1 python docs/results/gpu/bf16_router_grads.py fp32 12 triton   # 6e-6
    python docs/results/gpu/bf16_router_grads.py bf16 12 cpu                         # 0.063: the CPU's exact kernels

Both kernels equal the PyTorch routing in float32, so the bf16 difference is rounding: the routings' gates differ in
their last bits, and bf16 turns that into other top-k choices in later blocks where scores are close.
"""

import sys

import timm
import torch

import visattn.attention.routing as routing
import visattn.models  # noqa: F401  (registers the timm models)
from visattn import kernels


def main(dtype: str, depth: int, kernel: str) -> None:
    if kernel == "triton":
        routing.eager_cuda_gates = lambda x: type(x) is torch.Tensor  # the GPU branch, for CPU tensors
        routing.moh_router_logits_op = lambda: None  # the logits from F.linear, as on a GPU
    torch.manual_seed(0)
    model = timm.create_model("visattn_vit_small_patch16_224", attn={"name": "moh", "impl": "dense"}, num_classes=10,
                              depth=depth).train()
    x = torch.randn(4, 3, 224, 224)
    grads = []
    for off in (False, True):
        model.zero_grad(set_to_none=True)
        with (kernels.disabled() if off else torch.enable_grad(),
              torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16")):
            loss = model(x).float().square().mean() + 0.01 * sum(b.attn.router.aux_loss for b in model.blocks)
        loss.backward()
        grads.append({n: p.grad.float() for n, p in model.named_parameters() if "router" in n})
    worst = max((((g - grads[1][n]).abs().max() / grads[1][n].abs().max()).item(), n) for n, g in grads[0].items())
    print(f"{dtype}, {depth} blocks, {kernel}: largest relative difference {worst[0]:.3g} ({worst[1]})")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
