"""Does auto's probe misjudge routed_kernel_dense at DiT-B/2 (19th session: 3 of 14 probes)? Probes' timings of one
layer (16 x 256, 768, 12 heads; masked dense, routed_kernel, routed_kernel_dense; ``time_paths`` with five rounds as
``ImplProbe`` runs it), each call logged with the path before it; then 31 rounds of the same paths.

    python probe_bias.py 0.75 10    # budget, probes -> probe_bias_0.75.json; then resample.py
"""

import json
import sys

import torch

from visattn.attention import build_attention
from visattn.attention.impl_probe import default_timer, paired_ratios, time_paths
from visattn.attention.moh import PATHS
from visattn.bench.attention import moh_budget

torch.set_num_threads(1)
torch.manual_seed(0)
heads, dim, B, N = 12, 768, 16, 256
frac = float(sys.argv[1]) if len(sys.argv) > 1 else 0.75
shared, topk = moh_budget(heads, frac)
layer = build_attention(
    "moh", dim, num_heads=heads, shared_heads=shared, routed_topk=topk, impl="auto"
).eval()
x = torch.randn(B, N, dim)
names = ["masked_dense", "routed_kernel", "routed_kernel_dense"]
runs = {n: (lambda n=n: PATHS[n](layer, x)) for n in names}
log = []
prev = [None]


def timer(name, run):
    t = default_timer(name, run)
    log.append((name, prev[0], t))
    prev[0] = name
    return t


out = {"probes": [], "calls": log}
with torch.no_grad():
    for p in range(int(sys.argv[2]) if len(sys.argv) > 2 else 8):
        s = time_paths(runs, timer, 5, 3.0, keep="masked_dense")
        r = paired_ratios(s, "masked_dense")
        out["probes"].append(r)
        print("probe", p, {k: round(v, 3) for k, v in r.items()}, flush=True)
    s = time_paths(runs, timer, 31, float("inf"), keep="masked_dense")
    r = paired_ratios(s, "masked_dense")
    out["long"] = r
    print("31 rounds", {k: round(v, 3) for k, v in r.items()}, flush=True)
json.dump(out, open(f"probe_bias_{frac}.json", "w"))
