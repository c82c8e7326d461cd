"""A training step of the study's whole models with every softmax layer's attention on SDPA and on the small-heads
kernel (``HeadAttention.train_attention``), all interleaved in one process (thread CPU time, 1 thread, batch 256).
MoH's training path is its masked dense path throughout (``probe_train_paths=False``).

    python ab_train_attention.py cls|dit mha,moh-50,moh-75,moh-90 ROUNDS
"""

import statistics
import sys
import time

import torch

from visattn.attention.impl_probe import device_name
from visattn.attention.train_paths import attention_layers
from visattn.bench.study import build_study_workload

torch.set_num_threads(1)
task, cells, rounds = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
works = {}
for cell in cells:
    for attention in ("sdpa", "small_attention"):
        work = build_study_workload(task, cell, 256, probe_train_paths=False)
        for layer in attention_layers(work.module).values():
            layer.train_attention = attention
        work.module.train()
        works[f"{cell} / {attention}"] = work
for work in works.values():
    work.train_step("fp32")
times = {label: [] for label in works}
for _ in range(rounds):
    for label, work in works.items():
        t0 = time.thread_time()
        work.train_step("fp32")
        times[label].append(time.thread_time() - t0)
print(f"{device_name('cpu')}, torch {torch.__version__}, study {task}, {rounds} rounds; images/s vs the row named")
for label, t in times.items():
    cell = label.split(" / ")[0]
    per = {ref: statistics.median(a / b for a, b in zip(times[ref], t)) for ref in (f"{cells[0]} / sdpa",
                                                                                    f"{cells[0]} / small_attention")}
    print(f"  {label:28s} {1e3 * statistics.median(t):7.1f} ms  " + "  ".join(f"{v:.3f} vs {k}" for k, v in per.items()))
