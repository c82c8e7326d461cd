"""One MoH layer's routed_kernel with the kernels' own loops (fused_attention.h, row_gemm.h: the default where
the CPU has AVX2 and FMA) against the same op told fused=False (MKL's GEMMs, SDPA for the shared heads), and
routed_kernel_dense with its attention in the loops against MKL's: interleaved in one process, 1 thread,
thread CPU time, paired ratios (new / old) with a bootstrap interval. ``mha`` is timed as the reference.

    python fused_ab.py B,N,C,H FRACTION [FRACTION ...] --rounds R
"""

import argparse
import random
import time

import torch

import visattn.attention.routed_kernel as routed_kernel
from visattn.attention import build_attention
from visattn.attention.moh import PATHS
from visattn.bench.attention import moh_budget
from visattn.bench.timing import paired_ratio, ratio_interval
from visattn.utils.allocator import tune_glibc_malloc

parser = argparse.ArgumentParser()
parser.add_argument("shape")
parser.add_argument("fractions", type=float, nargs="+")
parser.add_argument("--rounds", type=int, default=21)
args = parser.parse_args()
tune_glibc_malloc()
torch.set_num_threads(1)
B, N, C, H = (int(v) for v in args.shape.split(","))
x = torch.randn(B, N, C)


class MKL:
    """routed_kernel's ops as before this session on this CPU: MKL's GEMMs and SDPA (fused=False)."""

    def __enter__(self):
        self.heads, self.att, self.shared = (routed_kernel.moh_routed_heads_op, routed_kernel.moh_routed_attention_op,
                                             routed_kernel._shared_heads_fused)
        heads, att = self.heads, self.att

        def heads_op(*a, **k):
            op = heads(*a, **k)
            return op and (lambda *b: op(*b, False))

        def att_op(*a, **k):
            op = att(*a, **k)
            return op and (lambda *b, **kw: op(*b[:10], False, **kw))

        routed_kernel.moh_routed_heads_op, routed_kernel.moh_routed_attention_op = heads_op, att_op
        routed_kernel._shared_heads_fused = lambda *a: False

    def __exit__(self, *exc):
        routed_kernel.moh_routed_heads_op, routed_kernel.moh_routed_attention_op = self.heads, self.att
        routed_kernel._shared_heads_fused = self.shared


mha = build_attention("mha", C, num_heads=H).eval()
cases = {"mha": lambda: mha(x)}
layers = {}
for fraction in args.fractions:
    shared, topk = moh_budget(H, fraction)
    layer = build_attention("moh", C, num_heads=H, shared_heads=shared, routed_topk=topk).eval()
    layers[fraction] = layer
    for path in ("routed_kernel", "routed_kernel_dense"):
        def new(layer=layer, path=path):
            return PATHS[path](layer, x)

        def old(layer=layer, path=path):
            with MKL():
                return PATHS[path](layer, x)

        with torch.no_grad():
            torch.testing.assert_close(new(), old(), rtol=1e-4, atol=1e-4)
        cases[f"{shared}+{topk} of {H} {path} new"] = new
        cases[f"{shared}+{topk} of {H} {path} old"] = old

times = {name: [] for name in cases}
rng = random.Random(0)
with torch.no_grad():
    for f in cases.values():
        f()
    for _ in range(args.rounds):
        order = list(cases)
        rng.shuffle(order)
        for name in order:
            t = time.thread_time()
            cases[name]()
            times[name].append(1e3 * (time.thread_time() - t))

print(f"{args.shape}, {args.rounds} rounds, 1 thread, thread CPU time")
print("| case | median ms | vs mha | new / old (95%) |")
print("|---|---|---|---|")


def ratio(ts, ref):
    low, high = ratio_interval(ts, ref)
    return f"{paired_ratio(ts, ref):.3f} ({low:.3f}-{high:.3f})"


for name, ts in times.items():
    line = f"| {name} | {sorted(ts)[len(ts) // 2]:.2f} | {ratio(ts, times['mha'])} |"
    line += f" {ratio(ts, times[name[:-4] + ' old'])} |" if name.endswith(" new") else " |"
    print(line)
