"""Fresh probes of one DiT-B/2 layer (16 x 256, 768, 12 heads) through impl=auto: the path each takes and its ratios."""

import sys
import time

import torch

from visattn.attention import build_attention
from visattn.attention.impl_probe import ImplProbe, use_impl_probe
from visattn.bench.attention import moh_budget

torch.set_num_threads(1)
torch.manual_seed(0)
frac, probes = float(sys.argv[1]), int(sys.argv[2])
shared, topk = moh_budget(12, frac)
layer = build_attention("moh", 768, num_heads=12, shared_heads=shared, routed_topk=topk, impl="auto").eval()
x = torch.randn(16, 256, 768)
for p in range(probes):
    layer._recall = None
    start = time.perf_counter()
    with use_impl_probe(ImplProbe()), torch.no_grad():
        layer(x)
    c = layer.path_log["[16, 256, 768] float32"]
    print(f"probe {p}: {c.path} in {time.perf_counter() - start:.1f} s, ratios {c.ratios}", flush=True)
