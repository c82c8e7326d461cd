"""The study's models in eval, small_attention on vs off (SDPA: small_attention_runs patched to False),
interleaved, thread CPU time: paired ratios.

    python ab_small.py cls|dit mha,moh-50,moh-75,moh-90 ROUNDS
"""
import statistics
import sys

import torch

from visattn.utils.allocator import tune_glibc_malloc
tune_glibc_malloc()
import visattn.attention.base as base
from visattn.bench.study import build_study_workload
from visattn.attention.impl_probe import default_timer, time_paths
from visattn.utils.ratios import median_ratio
torch.set_num_threads(1)
task, cells, rounds = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
works = {c: build_study_workload(task, c, 256) for c in cells}
on = base.small_attention_runs
def off(*a, **k): return False
def run(w, flag):
    def f():
        base.small_attention_runs = on if flag else off
        try:
            return w.infer()
        finally:
            base.small_attention_runs = on
    return f
runs = {}
for c, w in works.items():
    w.module.eval()
    runs[f"{c} sdpa"] = run(w, False)
    runs[f"{c} small"] = run(w, True)
with torch.no_grad():
    for f in runs.values(): f()
    s = time_paths(runs, default_timer, rounds, float("inf"), keep=f"{cells[0]} sdpa")
ref = s[f"{cells[0]} sdpa"]
for k, v in s.items():
    print(f"{k:16s} {1e3*statistics.median(v):8.1f} ms  time vs {cells[0]} sdpa {median_ratio(v, ref):.3f}")
for c in cells:
    print(f"{c}: small/sdpa time {median_ratio(s[c+' small'], s[c+' sdpa']):.3f}")
print(f"moh/mha images/s with small: " + ", ".join(f"{c} {1/median_ratio(s[c+' small'], s[cells[0]+' small']):.3f}" for c in cells[1:]))
print(f"moh/mha images/s with sdpa: " + ", ".join(f"{c} {1/median_ratio(s[c+' sdpa'], s[cells[0]+' sdpa']):.3f}" for c in cells[1:]))
