"""Diagnostic for issue 32 without a GPU: the host-side work of a MoH layer's forward as it runs on a GPU, on a
CPU. On a GPU at ViT-S / DiT-B sizes a layer is bound by the host issuing its calls, not by the device, so
the host's cost is what to cut; here it is emulated on tiny CPU tensors (dispatch and Python, little
compute): the router takes its GPU branch, with the CPU gates op standing in for the Triton launch, and
the CPU kernels are off (as on a GPU).

    python docs/results/gpu/host_emulation.py

Prints the median microseconds per forward over 9 interleaved rounds: `mha`, MoH with the head load from
the gates kernel, and MoH computing the head load itself (as before the 14th session). Only ratios within
one run mean anything: the absolute figures are this CPU's.
"""

from __future__ import annotations

import statistics
import time

import torch

import visattn.attention.routing as routing
from visattn import kernels
from visattn.attention import build_attention


def with_load(logits, S, E, k, two_stage, shared_routed, eps, tokens):
    """``moh_gates_cuda``'s outputs, from the CPU op (the load: ones, its shape is what matters here)."""
    gates, keep, _, _ = torch.ops.visattn.moh_gates(logits.float(), S, E, k, two_stage, shared_routed, eps, False)
    return gates, keep, keep.new_ones((logits.shape[1] // tokens, S + E))


def without_load(*args):
    gates, keep, _ = with_load(*args)
    return gates, keep, None  # the router then computes the load itself (image_head_load)


def per_call_us(fn, calls: int = 2000) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    if kernels.moh_routing_op() is None:
        raise SystemExit("the CPU kernels are needed (their gates op stands in for the GPU's launch)")
    routing.eager_cuda_gates = lambda x: type(x) is torch.Tensor  # the router's GPU branch for CPU tensors
    torch.set_num_threads(1)
    x = torch.randn(1, 4, 64)
    mha = build_attention("mha", 64, num_heads=8).eval()
    moh = build_attention("moh", 64, num_heads=8, impl="dense").eval()
    gates_ops = {"moh, load from the kernel": with_load, "moh, image_head_load": without_load}
    times: dict[str, list[float]] = {"mha": [], **{label: [] for label in gates_ops}}
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16), kernels.disabled():
        mha(x)
        for _ in range(9):
            times["mha"].append(per_call_us(lambda: mha(x)))
            for label, op in gates_ops.items():
                routing.moh_cuda_gates_op = lambda op=op: op
                moh(x)
                times[label].append(per_call_us(lambda: moh(x)))
    for label, samples in times.items():
        print(f"{label:28s} {statistics.median(samples):7.1f} us  (range {min(samples):.0f}-{max(samples):.0f})")


if __name__ == "__main__":
    main()
