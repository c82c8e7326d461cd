"""MoH's masked dense path in eval with the small heads' kernel skipping the rows its gates zero (row_gates, the
default) against the same model attending every row (HeadAttention.attends_by_sdpa set False), interleaved, thread
CPU time; then each model's op times under torch.profiler (self time, summed over the rounds).

    python ab_skip.py cls|dit moh-50,moh-75,moh-90 ROUNDS
"""
import collections
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


def run(work, skip):
    layers = [m for m in work.module.modules() if hasattr(m, "attends_by_sdpa")]

    def infer():
        for layer in layers:
            layer.attends_by_sdpa = skip
        return work.infer()

    return infer


runs = {}
for cell, work in works.items():
    work.module.eval()
    runs[f"{cell} skip"], runs[f"{cell} every row"] = run(work, True), run(work, False)
with torch.no_grad():
    for infer in runs.values():
        infer()
    samples = time_paths(runs, default_timer, rounds, float("inf"), keep=f"{cells[0]} every row")
    op_ms = {name: collections.Counter() for name in runs}
    for _ in range(5):
        for name, infer in runs.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                infer()
            for event in prof.key_averages():
                op_ms[name][event.key] += event.self_cpu_time_total / 5e3
for cell in cells:
    skip, every = op_ms[f"{cell} skip"], op_ms[f"{cell} every row"]
    ratio = median_ratio(samples[f"{cell} skip"], samples[f"{cell} every row"])
    print(f"{cell}: model time skip / every row {ratio:.3f};"
          f" small_attention {skip['visattn::small_attention']:.2f} / {every['visattn::small_attention']:.2f} ms,"
          f" all ops {sum(skip.values()):.1f} / {sum(every.values()):.1f} ms (profiler, 5 rounds)")
