"""The chosen pairs' attention (``moh_routed_attention``, what routed_kernel_dense runs) in fused_attention.h's
loops (fused=True; on an AVX2 CPU its AVX2 loops since the 27th session) against the same op through MKL's
GEMMs (fused=False) and against SDPA over every head: interleaved in one process, 1 thread, thread CPU time,
paired ratios with a 95% bootstrap interval.

    python attention_ab.py B,N,H,d DENSITY [--rounds R]

DENSITY: the share of (token, head) pairs on (1: every head shared, as SDPA computes them).
"""

import argparse
import random
import time

import torch
import torch.nn.functional as F

from visattn.bench.timing import paired_ratio, ratio_interval
from visattn.kernels import moh_routed_attention_op
from visattn.utils.allocator import tune_glibc_malloc

parser = argparse.ArgumentParser()
parser.add_argument("shape")
parser.add_argument("density", type=float)
parser.add_argument("--rounds", type=int, default=15)
args = parser.parse_args()
tune_glibc_malloc()
torch.set_num_threads(1)
torch.manual_seed(0)
B, N, H, d = (int(v) for v in args.shape.split(","))
T = B * N
q, k, v, gates = torch.randn(T, H * d), torch.randn(B, H, N, d), torch.randn(B, H, N, d), torch.rand(T, H)
S = H if args.density == 1 else 0
mask = (torch.rand(H - S, T) < args.density).contiguous()
op = moh_routed_attention_op(torch.float32, d)
assert torch.ops.visattn.moh_fused_attention(d), "fused_attention.h does not run here"


def kernel(fused):
    z = torch.empty(T, H * d)
    op(q, None, k, v, None, mask, gates, S, 0, z, fused)
    return z


def sdpa():
    return F.scaled_dot_product_attention(q.view(B, N, H, d).transpose(1, 2), k, v)


on = torch.cat([torch.ones(S, T, dtype=torch.bool), mask]).t()
expected = (sdpa().transpose(1, 2).reshape(T, H, d) * (gates * on).unsqueeze(-1)).reshape(T, H * d)
for fused in (True, False):
    torch.testing.assert_close(kernel(fused), expected, rtol=1e-4, atol=1e-5)
cases = {"fused": lambda: kernel(True), "mkl": lambda: kernel(False), "sdpa": sdpa}
times = {name: [] for name in cases}
rng = random.Random(0)
for f in cases.values():
    f()
for _ in range(args.rounds):
    order = list(cases)
    rng.shuffle(order)
    for name in order:
        t = time.thread_time()
        cases[name]()
        times[name].append(1e3 * (time.thread_time() - t))


def ratio(a, b):
    low, high = ratio_interval(times[a], times[b])
    return f"{paired_ratio(times[a], times[b]):.3f} ({low:.3f}-{high:.3f})"


flops = 4 * T * N * d * on.sum().item() / T
ms = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
print(f"{args.shape}, {on.float().mean():.2f} of the pairs on, {args.rounds} rounds, 1 thread, thread CPU time")
print(f"ms: fused {ms['fused']:.2f} ({flops / ms['fused'] / 1e6:.1f} GFLOP/s), mkl {ms['mkl']:.2f}, sdpa (every pair) "
      f"{ms['sdpa']:.2f}")
print(f"fused / mkl {ratio('fused', 'mkl')}; fused / sdpa {ratio('fused', 'sdpa')}; mkl / sdpa {ratio('mkl', 'sdpa')}")
