"""small_attention at the study classifier's shape ([256, 8, 17, 12], q/k/v as views of one packed projection, as a
layer gives them), interleaved, thread CPU time: without gates, with random gates (a share of the (token, head)
rows kept), with the first r rows of each head kept, and on contiguous copies of q/k/v (the memory order).

    python kernel_rows.py ROUNDS
"""
import statistics
import sys

import torch

from visattn.attention.impl_probe import default_timer, time_paths
from visattn.kernels import small_attention_op
from visattn.utils.ratios import median_ratio

torch.set_num_threads(1)
op = small_attention_op()
B, H, N, d = 256, 8, 17, 12
torch.manual_seed(0)
packed = torch.randn(B, N, 3 * H * d)
q, k, v = (packed[..., i * H * d : (i + 1) * H * d].view(B, N, H, d).transpose(1, 2) for i in range(3))
contiguous = [t.contiguous() for t in (q, k, v)]
runs = {"no gates": lambda: op(q, k, v, 0.3), "no gates, contiguous q/k/v": lambda: op(*contiguous, 0.3)}
for share in (1.0, 0.75, 0.5, 0.25, 0.0):
    gates = (torch.rand(B, N, H) < share).float()
    runs[f"random, {share:.0%} kept"] = lambda gates=gates: op(q, k, v, 0.3, gates)
for rows in (9, 5, 1):
    gates = torch.zeros(B, N, H)
    gates[:, :rows] = 1
    runs[f"first {rows} rows kept"] = lambda gates=gates: op(q, k, v, 0.3, gates)
samples = time_paths(runs, default_timer, int(sys.argv[1]), float("inf"), keep="no gates")
for name, times in samples.items():
    ratio = median_ratio(times, samples["no gates"])
    print(f"{name:28s} {1e3 * statistics.median(times):7.3f} ms  time vs no gates {ratio:.3f}")
