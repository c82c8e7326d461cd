"""moh_routed_heads (routed_kernel's op) with fused=True against fused=False on one DiT-B/2 layer's shapes
(16 x 256 tokens, 768 wide, 12 heads of 64), S shared heads and each routed pair on with probability DENSITY:
interleaved, 1 thread, thread CPU time, the paired ratio fused / MKL.

    python op_ab.py S DENSITY

Run in the 27th session on an experimental build, not kept: row_gemm.h's AVX2 port (6 rows x 16 columns,
gathered rows read once through every column block) with the AVX2 attention; with VISATTN_EXP_ATTEND_ONLY=1 that
build ran the attention alone in the loops (MKL's projections), as the kept code does on AVX2. At the kept code
fused=True is that second case. Output: op_ab.txt.
"""

import random
import sys
import time

import torch

from visattn.bench.timing import paired_ratio
from visattn.kernels import moh_routed_heads_op
from visattn.utils.allocator import tune_glibc_malloc

tune_glibc_malloc()
torch.set_num_threads(1)
B, N, C, H, d = 16, 256, 768, 12, 64
T = B * N
S, density = int(sys.argv[1]), float(sys.argv[2])
x, qkv_w, proj_w = torch.randn(T, C), torch.randn(3 * C, C) / C**0.5, torch.randn(C, C) / C**0.5
k, v = torch.randn(B, H, N, d), torch.randn(B, H, N, d)
mask, gates = (torch.rand(H - S, T) < density).contiguous(), torch.rand(T, H)
op = moh_routed_heads_op(torch.float32)


def run(fused):
    out = torch.zeros(T, C)
    op(x, qkv_w, None, proj_w, k, v, None, mask, gates, S, S, False, out, None, fused)
    return out


torch.testing.assert_close(run(True), run(False), rtol=1e-4, atol=1e-4)
times = {True: [], False: []}
for _ in range(15):
    for fused in random.sample([True, False], 2):
        t = time.thread_time()
        run(fused)
        times[fused].append(time.thread_time() - t)
print(S, density, "fused ms", sorted(times[True])[7] * 1e3, "mkl ms", sorted(times[False])[7] * 1e3, "ratio",
      paired_ratio(times[True], times[False]))
