"""Each attention layer of the study classifier alone, forward and backward (batch 256, random input and output
gradient), every softmax layer on the small-heads kernel, interleaved in one process (thread CPU time, 1 thread,
glibc's allocator tuned as the bench and the trainers tune it). Prints each layer's median time and, per cell, the
median over rounds of its time over `mha`'s same layer.

    python layers.py mha,moh-50,moh-75,moh-90 ROUNDS
"""

import statistics
import sys
import time

import torch

from visattn.attention.impl_probe import device_name
from visattn.attention.train_paths import attention_layers
from visattn.bench.study import build_study_workload
from visattn.utils.allocator import tune_glibc_malloc

tune_glibc_malloc()
torch.set_num_threads(1)
cells, rounds = sys.argv[1].split(","), int(sys.argv[2])
layers = {}
for cell in cells:
    work = build_study_workload("cls", cell, 256, probe_train_paths=False)
    work.module.train()
    for i, layer in enumerate(attention_layers(work.module).values()):
        layer.train_attention = "small_attention"
        layers[(cell, i)] = layer
torch.manual_seed(0)
x = torch.randn(256, 17, 96, requires_grad=True)
grad = torch.randn(256, 17, 96)
for layer in layers.values():
    layer(x).backward(grad)
times = {key: [] for key in layers}
for _ in range(rounds):
    for key, layer in layers.items():
        t0 = time.thread_time()
        layer(x).backward(grad)
        times[key].append(time.thread_time() - t0)
depth = 1 + max(i for _, i in layers)
print(f"{device_name('cpu')}, torch {torch.__version__}, {rounds} rounds; per layer: ms (time vs {cells[0]}'s layer)")
for cell in cells:
    cols = []
    for i in range(depth):
        ratio = statistics.median(a / b for a, b in zip(times[(cell, i)], times[(cells[0], i)], strict=True))
        cols.append(f"{1e3 * statistics.median(times[(cell, i)]):5.2f} ({ratio:.3f})")
    print(f"  {cell:8s} " + "  ".join(cols))
