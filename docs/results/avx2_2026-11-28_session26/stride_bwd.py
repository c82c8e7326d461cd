"""The small-heads kernel at a study layer's shape, q, k and v read from packed rows W floats apart (the first 3 H d
of each row; the rest unread, as the router's logit columns are), forward and backward, for each W interleaved in
one process (thread CPU time, 1 thread; median ms). Each call reads its inputs cold (the other widths' buffers
were touched since), as a training step's backward reads the projection its forward saved.

    python stride_bwd.py cls|dit ROUNDS 288,300,304
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
task, rounds, widths = sys.argv[1], int(sys.argv[2]), [int(w) for w in sys.argv[3].split(",")]
B, N, H, d = {"cls": (256, 17, 8, 12), "dit": (256, 49, 8, 8)}[task]
packed = {w: torch.randn(B, N, w) for w in widths}
grad_out = {w: torch.randn(B, N, H, d).transpose(1, 2) for w in widths}


def views(w):
    p = packed[w][..., : 3 * H * d]
    return (p[..., i * H * d : (i + 1) * H * d].view(B, N, H, d).transpose(1, 2) for i in range(3))


def forward(w):
    q, k, v = views(w)
    op(q, k, v, d**-0.5)


def backward(w):
    q, k, v = views(w)
    torch.ops.visattn.small_attention_backward(grad_out[w], q, k, v, d**-0.5, None, False)


runs = {(name, w): fn for w in widths for name, fn in (("forward", forward), ("backward", backward))}
for (_, w), fn in runs.items():
    fn(w)
times = {key: [] for key in runs}
for _ in range(rounds):
    for (name, w), fn in runs.items():
        t0 = time.thread_time()
        fn(w)
        times[name, w].append(time.thread_time() - t0)
print(f"{device_name('cpu')}, torch {torch.__version__}, {task} [B, H, N, d] = [{B}, {H}, {N}, {d}], {rounds} rounds")
for name in ("forward", "backward"):
    print(f"{name} ms by row stride: " + "  ".join(f"{w}: {1e3 * statistics.median(times[name, w]):.2f}" for w in widths))
