"""How wide the router's logit columns in a training MoH layer's qkv matmul should be: layer 1 of the study classifier
(or DiT), forward and backward as it trains, on the small-heads kernel, with the router's 10 logit rows padded to
``router_columns`` = 10, 12 or 16 (rows of q, k, v then 3C + that many floats apart), beside MHA's layer, interleaved in
one process (thread CPU time, 1 thread).

    python logit_pad.py cls|dit moh-90 ROUNDS
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
task, cell, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])


def layer(cell):
    work = build_study_workload(task, cell, 256, probe_train_paths=False)
    work.module.train()
    attn = list(attention_layers(work.module).values())[1]
    attn.train_attention = "small_attention"
    return attn


mha, moh = layer("mha"), layer(cell)
shape = {"cls": (256, 17, 96), "dit": (256, 49, 64)}[task]
x = torch.randn(*shape, requires_grad=True)
grad = torch.randn(*shape)
variants = {"mha": None, "cols16": 16, "cols12": 12, "cols10": 10}


def step(variant):
    if variant == "mha":
        loss = (mha(x) * grad).sum()
    else:
        moh.router_columns = variants[variant]
        loss = (moh(x) * grad).sum() + 0.01 * moh.aux_loss
    loss.backward()


for variant in variants:
    step(variant)
times = {variant: [] for variant in variants}
for _ in range(rounds):
    for variant in variants:
        t0 = time.thread_time()
        step(variant)
        times[variant].append(time.thread_time() - t0)
print(f"{device_name('cpu')}, torch {torch.__version__}, {task} {cell} layer 1, batch 256, {rounds} rounds")
for variant, t in times.items():
    ratio = statistics.median(a / b for a, b in zip(t, times["mha"], strict=True))
    diff = statistics.median(a - b for a, b in zip(t, times["mha"], strict=True))
    print(f"  {variant:7s} {1e3 * statistics.median(t):7.2f} ms  vs mha {ratio:.3f}  paired diff {1e3 * diff:+.2f} ms")
for variant in ("cols12", "cols10"):
    diff = statistics.median(a - b for a, b in zip(times[variant], times["cols16"], strict=True))
    print(f"  {variant} - cols16: {1e3 * diff:+.2f} ms")
