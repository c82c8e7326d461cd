"""The small-heads kernel's forward and backward against SDPA's, at the study's attention shapes (batch 256, q/k/v as
views of a packed projection, dO in the merge's [B, N, H, d] layout), interleaved, thread CPU time, 1 thread; and with
MoH-like gates (2 shared heads of 8 and 1 routed: 3/8 of the rows attended).

    python kernel_train.py ROUNDS
"""

import statistics
import sys
import time

import torch
import torch.nn.functional as F

import visattn.kernels as kernels
from visattn.attention.impl_probe import device_name

torch.set_num_threads(1)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 21
op = kernels.small_attention_op()
assert op is not None, "the kernels did not build"
print(f"{device_name('cpu')}, torch {torch.__version__}, 1 thread, thread CPU time, {rounds} rounds, median ms")
for name, (B, H, N, d) in {"study classifier": (256, 8, 17, 12), "study DiT": (256, 8, 49, 8)}.items():
    torch.manual_seed(0)
    C = H * d
    packed = torch.randn(B, N, 3 * C + 16)
    q, k, v = (packed[..., i * C : (i + 1) * C].view(B, N, H, d).transpose(1, 2) for i in range(3))
    grad = torch.randn(B, N, H, d).transpose(1, 2)
    gates = torch.zeros(B, N, H)
    gates[..., :2] = 1.0
    gates.scatter_(-1, 2 + torch.randint(0, H - 2, (B, N, 1)), 1.0)
    grad_gated = grad * (gates != 0).transpose(1, 2).unsqueeze(-1)
    scale = d**-0.5

    def sdpa():
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        F.scaled_dot_product_attention(qq, kk, vv, scale=scale).backward(grad)

    def kernel(g=None, dO=grad):
        op(q, k, v, scale, g)
        torch.ops.visattn.small_attention_backward(dO, q, k, v, scale, g)

    runs = {
        "SDPA forward+backward": sdpa,
        "kernel forward+backward": kernel,
        "kernel, 3/8 of the rows (gated)": lambda: kernel(gates, grad_gated),
        "SDPA forward": lambda: F.scaled_dot_product_attention(q, k, v, scale=scale),
        "kernel forward": lambda: op(q, k, v, scale),
        "kernel backward": lambda: torch.ops.visattn.small_attention_backward(grad, q, k, v, scale, None),
    }
    for run in runs.values():
        run()
    times = {label: [] for label in runs}
    for _ in range(rounds):
        for label, run in runs.items():
            t0 = time.thread_time()
            run()
            times[label].append(time.thread_time() - t0)
    ref = times["SDPA forward+backward"]
    print(f"\n{name}: B={B}, H={H}, N={N}, d={d}")
    for label, t in times.items():
        ratio = statistics.median(a / b for a, b in zip(t, ref))
        print(f"  {label:34s} {1e3 * statistics.median(t):8.2f} ms   {ratio:.3f} of SDPA forward+backward")
