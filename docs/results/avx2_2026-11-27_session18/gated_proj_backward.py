"""moh_gated_proj_backward against what mha's output projection does backward (the input's and the weight's
gradient matmuls and the bias's sum over the whole tensor), alone, interleaved rounds, process CPU time, 1 thread:

    python docs/results/avx2_2026-11-27_session18/gated_proj_backward.py 256,8,17,12 41   # the study ViT's layer
"""

import sys

import torch

from visattn.bench.timing import interleaved_times, median, paired_ratio, ratio_interval
from visattn.kernels import moh_routing_op


def main(shape: str, rounds: int) -> None:
    if moh_routing_op() is None:
        raise SystemExit("the kernels do not load here (visattn.kernels)")
    torch.set_num_threads(1)
    B, H, N, d = map(int, shape.split(","))
    C = H * d
    torch.manual_seed(0)
    heads = torch.randn(B, N, H, d).transpose(1, 2)  # attention's output, laid out as [B, N, H, d]
    gates, weight, grad = torch.rand(B, N, H), torch.randn(C, C), torch.randn(B, N, C)
    merged = heads.transpose(1, 2).reshape(B * N, C)

    def moh():
        torch.ops.visattn.moh_gated_proj_backward(grad, heads, gates, weight, True)

    def mha():
        g = grad.view(B * N, C)
        torch.mm(g, weight).view(B, N, H, d).transpose(1, 2)  # the heads' gradient, as attention's backward reads it
        torch.mm(g.t(), merged)
        g.sum(0)

    times = interleaved_times({"mha": mha, "moh": moh}, warmup=3, repeats=rounds, clock="cpu")
    for name, samples in times.items():
        print(f"{name}: {1e3 * median(samples):.3f} ms")
    print(f"moh / mha: {paired_ratio(times['moh'], times['mha']):.3f}", ratio_interval(times["moh"], times["mha"]))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
