"""The linear router's matmul (x [T, C] @ W^T, W [R, C] with R = 8-14) in ``F.linear`` against the kernels'
``moh_router_logits``, at the study's, ViT-S's and DiT-B's sizes: interleaved rounds of this process's CPU time,
1 thread, the ratio with its 95% interval (``visattn.bench.timing``). The 16th session's table in
docs/results/benchmarks.md. Run: ``python docs/results/avx2_2026-11-27_session16/router_logits.py``."""

import logging
import statistics

import torch
import torch.nn.functional as F

import visattn.kernels as kernels
from visattn.attention.impl_probe import device_name
from visattn.bench.timing import interleaved_times, ratio_interval

SHAPES = [  # (tokens, width, router rows): the study ViT / DiT, ViT-S, DiT-B/2 (batch 256, 256, 32, 16)
    (256 * 17, 96, 10), (256 * 49, 64, 10), (256 * 49, 64, 8), (32 * 197, 384, 8), (32 * 197, 384, 10),
    (16 * 256, 768, 14), (16 * 256, 768, 12),
]


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    op = kernels.moh_router_logits_op()
    if op is None:
        raise SystemExit("the kernels are not built here (or VISATTN_KERNELS=0): nothing to compare")
    logging.info("%s, torch %s, 1 thread", device_name("cpu"), torch.__version__)
    logging.info("| tokens x width, rows | F.linear ms | kernel ms | kernel / F.linear (95% interval) |")
    logging.info("|---|---|---|---|")
    for T, C, R in SHAPES:
        x, w = torch.randn(T, C), torch.randn(R, C)
        torch.testing.assert_close(op(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)
        t = interleaved_times({"linear": lambda: F.linear(x, w), "kernel": lambda: op(x, w)}, 3, 31, "cpu")
        low, high = ratio_interval(t["kernel"], t["linear"])
        linear, kernel = statistics.median(t["linear"]), statistics.median(t["kernel"])
        logging.info("| %d x %d, %d | %.3f | %.3f | %.3f (%.3f-%.3f) |", T, C, R, 1e3 * linear, 1e3 * kernel,
                     kernel / linear, low, high)


if __name__ == "__main__":
    main()
