"""SDPA against the kernels' small_attention on q, k, v split from one projection as a layer's are (the study's
shapes and two past them), interleaved, thread CPU time: each shape's median time and paired ratio.

    python attention_only.py 21
"""

import statistics
import sys

import torch
import torch.nn.functional as F

from visattn.attention.impl_probe import default_timer, time_paths
from visattn.kernels import small_attention_op
from visattn.utils.allocator import tune_glibc_malloc
from visattn.utils.ratios import median_ratio

tune_glibc_malloc()
torch.set_num_threads(1)
op = small_attention_op()
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 21
for B, H, N, d in ((256, 8, 17, 12), (256, 8, 49, 8), (64, 8, 64, 16), (64, 6, 64, 32)):
    q, k, v = torch.randn(B, N, 3, H, d).permute(2, 0, 3, 1, 4).unbind(0)
    runs = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v), "small": lambda: op(q, k, v, d**-0.5)}
    with torch.no_grad():
        s = time_paths(runs, default_timer, rounds, float("inf"), keep="sdpa")
    flops = 4 * B * H * N * N * d
    ms = {name: 1e3 * statistics.median(t) for name, t in s.items()}
    print(f"B={B} H={H} N={N} d={d}: sdpa {ms['sdpa']:.2f} ms ({flops / ms['sdpa'] / 1e6:.1f} GFLOP/s), "
          f"small_attention {ms['small']:.2f} ms ({flops / ms['small'] / 1e6:.1f} GFLOP/s), "
          f"time ratio {median_ratio(s['small'], s['sdpa']):.3f}", flush=True)
