"""Op-level self CPU time of the study model's training step (or its forward, with ``infer``), ``mha`` against a
MoH cell: torch.profiler around single steps of the two models in alternation (the machine's drift falls on both),
1 thread; the 32 ops whose time differs most. The profiler adds a few us per op, more to the model with more ops.

    python docs/results/avx2_2026-11-27_session18/train_profile.py cls moh-75 16 [train|infer]
"""

import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from visattn.bench.study import build_study_workload


def main(task: str, cell: str, alternations: int, mode: str = "train") -> None:
    torch.set_num_threads(1)
    works = {c: build_study_workload(task, c, 256) for c in ("mha", cell)}
    self_ms = {c: defaultdict(float) for c in works}

    def step(work):
        if mode == "train":
            work.module.train()
            work.train_step("fp32")
        else:
            work.module.eval()
            with torch.no_grad():
                work.module(*work.inputs)

    for work in works.values():
        for _ in range(2):
            step(work)
    for i in range(alternations):
        for c in ("mha", cell) if i % 2 == 0 else (cell, "mha"):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step(works[c])
            for event in prof.key_averages():
                self_ms[c][event.key] += event.self_cpu_time_total / alternations / 1e3
    ref, other = self_ms["mha"], self_ms[cell]
    keys = sorted(set(ref) | set(other), key=lambda k: -abs(other.get(k, 0) - ref.get(k, 0)))
    print(f"self ms per step, all ops: mha {sum(ref.values()):.1f}, {cell} {sum(other.values()):.1f}")
    print(f"| op | mha | {cell} | difference |\n|---|---|---|---|")
    for key in keys[:32]:
        a, b = ref.get(key, 0.0), other.get(key, 0.0)
        print(f"| {key} | {a:.2f} | {b:.2f} | {b - a:+.2f} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:5])
