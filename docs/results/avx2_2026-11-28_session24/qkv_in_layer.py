"""The qkv matmul (MoH's: with the router's 16 columns) timed inside the study classifier's first attention layer,
without the profiler: thread CPU time around the F.linear call alone, while the layers run forward and backward
interleaved (batch 256, 1 thread, glibc's allocator tuned). The 23rd session's profile read 1.75 against 0.57 ms
for that matmul's bias copy; torch.profiler's per-op figures moved by that much between two of its runs here.

    python qkv_in_layer.py ROUNDS
"""

import statistics
import sys
import time

import torch
import torch.nn.functional as F

import visattn.attention.base as base
from visattn.attention.train_paths import attention_layers
from visattn.bench.study import build_study_workload
from visattn.utils.allocator import tune_glibc_malloc

tune_glibc_malloc()
torch.set_num_threads(1)
rounds = int(sys.argv[1])
linear, times, current = F.linear, {}, [None]


def timed_linear(x, weight, bias=None):
    if x.dim() == 3 and weight.shape[0] in (288, 304):  # the qkv matmul: MHA's 288 columns, MoH's 288 + 16
        t0 = time.thread_time()
        out = linear(x, weight, bias)
        times.setdefault(current[0], []).append(time.thread_time() - t0)
        return out
    return linear(x, weight, bias)


F.linear = base.F.linear = timed_linear
layers = {}
for cell in ("mha", "moh-50"):
    work = build_study_workload("cls", cell, 256, probe_train_paths=False)
    work.module.train()
    layers[cell] = next(iter(attention_layers(work.module).values()))
    layers[cell].train_attention = "small_attention"
x = torch.randn(256, 17, 96, requires_grad=True)
grad = torch.randn(256, 17, 96)
steps = {cell: [] for cell in layers}
for _ in range(rounds):
    for cell, layer in layers.items():
        current[0] = cell
        t0 = time.thread_time()
        layer(x).backward(grad)
        steps[cell].append(time.thread_time() - t0)
for cell in layers:
    print(f"{cell:7s} qkv matmul {1e3 * statistics.median(times[cell][3:]):.3f} ms, "
          f"layer forward + backward {1e3 * statistics.median(steps[cell][3:]):.2f} ms")
