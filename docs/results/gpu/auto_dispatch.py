"""Diagnostic for issue 32 item 1 on a GPU, without one: what ``impl="auto"`` costs the host on each call over the
path it chose. On a GPU a MoH layer at ViT-S / DiT-B sizes is bound by the host issuing its calls, so that cost
shows in the layer's time (auto ran 1.045x the masked dense path's time, median of 48 layer rows on an H200,
docs/results/gpu.md, 20th session). Here the chosen path's body is replaced by the identity, so what is timed is
the module call, ``uses_sparse``, ``sparse_forward`` and the path choice's recall.

    python docs/results/gpu/auto_dispatch.py

Prints the minimum and median microseconds per call over 15 rounds of 20,000 calls (tiny CPU tensors, one
thread); compare runs of two versions alternately on one machine, as the figures drift between processes.
"""

from __future__ import annotations

import statistics
import time

import torch

import visattn.attention.moh as moh
from visattn.attention import build_attention


def main() -> None:
    torch.set_num_threads(1)
    layer = build_attention("moh", 64, num_heads=8, shared_heads=2, routed_topk=3, impl="auto").eval()
    x = torch.randn(1, 4, 64)
    with torch.no_grad():
        layer(x)  # the probe's choice, then its body replaced
        moh.PATHS[layer.last_path] = lambda attn, x: x

        def per_call_us(calls: int = 20000) -> float:
            start = time.perf_counter()
            for _ in range(calls):
                layer(x)
            return (time.perf_counter() - start) / calls * 1e6

        rounds = sorted(per_call_us() for _ in range(15))
    print(f"auto's dispatch to {layer.last_path}: min {rounds[0]:.2f} us, median {statistics.median(rounds):.2f} us")


if __name__ == "__main__":
    main()
