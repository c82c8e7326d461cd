"""The study's models in eval, interleaved, thread CPU time: images/s of each cell against the first, as the median
of the rounds' paired ratios (what ``bench study`` reports, without its training rounds).

    python ab_models.py cls|dit mha,moh-50,moh-75,moh-90 ROUNDS
"""
import statistics
import sys

import torch

from visattn.utils.allocator import tune_glibc_malloc

tune_glibc_malloc()
from visattn.attention.impl_probe import default_timer, time_paths  # noqa: E402
from visattn.bench.study import build_study_workload  # noqa: E402
from visattn.utils.ratios import median_ratio  # noqa: E402

torch.set_num_threads(1)
task, cells, rounds = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
works = {cell: build_study_workload(task, cell, 256) for cell in cells}
for work in works.values():
    work.module.eval()
with torch.no_grad():
    for work in works.values():
        work.infer()
    samples = time_paths({cell: work.infer for cell, work in works.items()}, default_timer, rounds, float("inf"),
                         keep=cells[0])
for cell, times in samples.items():
    ratio = 1 / median_ratio(times, samples[cells[0]])
    print(f"{cell:8s} {1e3 * statistics.median(times):8.1f} ms  images/s vs {cells[0]} {ratio:.3f}")
