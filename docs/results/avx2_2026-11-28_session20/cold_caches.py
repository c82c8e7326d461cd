"""Probe-style timing of one DiT-B/2 layer's paths, with the caches warm (the probe) and with a 64 MB buffer swept
before each call (the weights out of cache, as in a whole model or the paths bench): paired ratios to masked dense."""

import statistics
import sys

import torch

from visattn.attention import build_attention
from visattn.attention.impl_probe import default_timer, paired_ratios, time_paths
from visattn.attention.moh import PATHS
from visattn.bench.attention import moh_budget

torch.set_num_threads(1)
torch.manual_seed(0)
frac, rounds = float(sys.argv[1]), int(sys.argv[2])
shared, topk = moh_budget(12, frac)
layer = build_attention("moh", 768, num_heads=12, shared_heads=shared, routed_topk=topk, impl="auto").eval()
x = torch.randn(16, 256, 768)
sweep = torch.ones(16 * 1024 * 1024)  # 64 MB
names = ["masked_dense", "routed_kernel", "routed_kernel_dense"]
runs = {n: (lambda n=n: PATHS[n](layer, x)) for n in names}


def cold(name, run):
    sweep.add_(1.0)
    return default_timer(name, run)


with torch.no_grad():
    for label, timer in [("warm", default_timer), ("cold", cold), ("warm", default_timer), ("cold", cold)]:
        s = time_paths(runs, timer, rounds, float("inf"), keep="masked_dense")
        r = paired_ratios(s, "masked_dense")
        print(
            label,
            {k: round(v, 3) for k, v in r.items()},
            "md ms",
            round(1e3 * statistics.median(s["masked_dense"])),
            flush=True,
        )
