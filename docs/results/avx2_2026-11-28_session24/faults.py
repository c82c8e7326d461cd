"""Minor page faults and thread CPU time per training step of study models, each cell's model built in this one
process and timed interleaved (1 thread, batch 256, every softmax layer on the small-heads kernel). With `tune`,
glibc's mmap and trim thresholds are raised first, as `python -m visattn.bench` and the trainers do.

    python faults.py cls|dit CELL[,CELL...] ROUNDS [tune]
"""

import resource
import statistics
import sys
import time

import torch

from visattn.attention.train_paths import attention_layers
from visattn.bench.study import build_study_workload
from visattn.utils.allocator import tune_glibc_malloc

if sys.argv[4:] == ["tune"]:
    assert tune_glibc_malloc(), "glibc's thresholds could not be set (set in the environment already?)"
torch.set_num_threads(1)
task, cells, rounds = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
works = {}
for cell in cells:
    work = build_study_workload(task, cell, 256, probe_train_paths=False)
    for layer in attention_layers(work.module).values():
        layer.train_attention = "small_attention"
    work.module.train()
    works[cell] = work
for work in works.values():
    work.train_step("fp32")
    work.train_step("fp32")
times = {cell: [] for cell in works}
faults = {cell: [] for cell in works}
for _ in range(rounds):
    for cell, work in works.items():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.thread_time()
        work.train_step("fp32")
        times[cell].append(time.thread_time() - t0)
        faults[cell].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
for cell in cells:
    print(f"{cell:8s} {1e3 * statistics.median(times[cell]):7.1f} ms a step, "
          f"{statistics.median(faults[cell]):8.0f} minor faults a step")
