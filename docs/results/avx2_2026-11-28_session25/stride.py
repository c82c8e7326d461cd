"""The small-heads kernel's forward at the study classifier's layer ([256, 8, 17, 12]) with q, k and v read from
packed rows W floats apart (the first 288 of each row: q, k, v; the rest unread, as the router's logits are), for
each W interleaved in one process (thread CPU time, 1 thread; median ms). MHA's qkv rows are 288 apart; with the
router's 16 logit columns in the same matmul, a training MoH layer's are 304 apart.

    python stride.py ROUNDS 288,292,296,300,304,308,312,316,320,336,352,384,416
"""

import statistics
import sys
import time

import torch

from visattn.attention.impl_probe import device_name
from visattn.kernels import small_attention_op
from visattn.utils.allocator import tune_glibc_malloc

tune_glibc_malloc()
torch.set_num_threads(1)
op = small_attention_op()
assert op is not None, "the project's kernels are not built: python -m visattn.kernels"
B, N, H, d = 256, 17, 8, 12
rounds, widths = int(sys.argv[1]), [int(w) for w in sys.argv[2].split(",")]
packed = {w: torch.randn(B, N, w) for w in widths}


def run(w):
    p = packed[w][..., : 3 * H * d]
    q, k, v = (p[..., i * H * d : (i + 1) * H * d].view(B, N, H, d).transpose(1, 2) for i in range(3))
    op(q, k, v, d**-0.5)


for w in widths:
    run(w)
times = {w: [] for w in widths}
for _ in range(rounds):
    for w in widths:
        t0 = time.thread_time()
        run(w)
        times[w].append(time.thread_time() - t0)
print(f"{device_name('cpu')}, torch {torch.__version__}, {rounds} rounds; row stride: forward ms")
print("  ".join(f"{w}: {1e3 * statistics.median(t):.2f}" for w, t in times.items()))
