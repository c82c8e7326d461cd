"""One study-classifier layer (256 x 17 tokens, 96 wide, 8 heads; MoH 3 shared + top-2) and its parts, mha and MoH
masked dense, each with small_attention on and off (small_attention_runs patched), interleaved, thread CPU time.

    python layer_ab.py 256,17,96,8,3,2 15
"""
import statistics
import sys

import torch
from visattn.utils.allocator import tune_glibc_malloc
tune_glibc_malloc()
import visattn.attention.base as base
from visattn.attention import build_attention
from visattn.attention.impl_probe import default_timer, time_paths
from visattn.attention.moh import PATHS
from visattn.utils.ratios import median_ratio
torch.set_num_threads(1); torch.manual_seed(0)
B, N, C, H, S, K = (int(v) for v in sys.argv[1].split(","))
mha = build_attention("mha", C, num_heads=H).eval()
moh = build_attention("moh", C, num_heads=H, shared_heads=S, routed_topk=K, impl="masked_dense").eval()
x = torch.randn(B, N, C)
on = base.small_attention_runs
def off(*a, **k): return False
def flag(f, small):
    def g():
        base.small_attention_runs = on if small else off
        try: return f()
        finally: base.small_attention_runs = on
    return g
with torch.no_grad():
    q, k, v = moh.project_qkv(x)
    gates, _ = moh.route(x, None, selection=False)
runs = {
 "mha sdpa": flag(lambda: mha(x), False), "mha small": flag(lambda: mha(x), True),
 "moh sdpa": flag(lambda: moh(x), False), "moh small": flag(lambda: moh(x), True),
 "attend sdpa": flag(lambda: moh.attend(q, k, v), False), "attend small": flag(lambda: moh.attend(q, k, v), True),
 "route": lambda: moh.route(x, None, selection=False), "qkv": lambda: moh.project_qkv(x),
}
with torch.no_grad():
    for f in runs.values(): f()
    hs = runs["attend sdpa"](); hk = runs["attend small"]()
    print("strides sdpa", hs.stride(), "small", hk.stride())
    runs["gated proj (sdpa heads)"] = lambda: moh.merge_heads(x, hs, gates)
    runs["gated proj (small heads)"] = lambda: moh.merge_heads(x, hk, gates)
    runs["proj (small heads)"] = lambda: mha.merge_heads(x, hk, None)
    def by_hand():
        g, _ = moh.route(x, None, selection=False)
        q_, k_, v_ = moh.project_qkv(x)
        return moh.merge_heads(x, moh.attend(q_, k_, v_), g)
    runs["moh by hand small"] = flag(by_hand, True)
    runs["moh dense_forward small"] = flag(lambda: moh.dense_forward(x), True)
    runs["mha dense_forward small"] = flag(lambda: mha.dense_forward(x), True)
    s = time_paths(runs, default_timer, int(sys.argv[2]), float("inf"), keep="mha sdpa")
for name, t in s.items():
    print(f"{name:26s} {1e3*statistics.median(t):7.3f} ms  vs mha sdpa {median_ratio(t, s['mha sdpa']):.3f}")
