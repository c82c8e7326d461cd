"""The whole study model in one process, interleaved: MoH with its gates applied by the small-heads kernel as it writes
each row (new, 25th session) or by the gated projection after it (old: scale_rows forced off), and MHA. Training steps
as `bench study` takes them (forward, loss + load-balancing loss, backward, AdamW; every layer on the training paths
the run's probe chooses), or inference with --eval. Thread CPU time, 1 thread. Prints each variant's median time, its
images/s vs mha (median of paired ratios), and new/old (median of paired ratios, a 95% bootstrap interval, and in how
many rounds new took less time).

    python gating_ab.py cls|dit ROUNDS [moh-50,moh-90] [--eval]
"""
import statistics, sys, time
import torch
from visattn.attention.base import HeadAttention
from visattn.bench.study import build_study_workload
from visattn.utils.allocator import tune_glibc_malloc
tune_glibc_malloc(); torch.set_num_threads(1)
task, rounds = sys.argv[1], int(sys.argv[2]); train = "--eval" not in sys.argv
cells = sys.argv[3].split(",") if len(sys.argv) > 3 and not sys.argv[3].startswith("--") else ["moh-50", "moh-90"]
real = HeadAttention.gated_sdpa
old = {"on": False}
HeadAttention.gated_sdpa = lambda self, q, k, v, m, c, s, g, sr: real(self, q, k, v, m, c, s, g, sr and not old["on"])
works = {cell: build_study_workload(task, cell, 256) for cell in ["mha", *cells]}
for w in works.values():
    w.module.train(train)
def step(cell, use_old):
    old["on"] = use_old
    w = works[cell]
    if train:
        w.train_step("fp32")
    else:
        with torch.no_grad():
            w.infer()
variants = {"mha": ("mha", False)}
for c in cells:
    variants[f"{c} new"] = (c, False); variants[f"{c} old"] = (c, True)
for c, o in variants.values(): step(c, o); step(c, o)
t = {k: [] for k in variants}
for _ in range(rounds):
    for k, (c, o) in variants.items():
        t0 = time.thread_time(); step(c, o); t[k].append(time.thread_time() - t0)
print(f"{task} {'train' if train else 'eval'}, {rounds} rounds, whole model, batch 256")
for k, v in t.items():
    r = statistics.median(b / a for a, b in zip(v, t["mha"]))  # images/s vs mha
    extra = ""
    if k.endswith("new"):
        ratios = sorted(a / b for a, b in zip(v, t[k[:-3] + "old"]))
        import random
        rng = random.Random(0)
        boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
        extra = (f"  new/old time {statistics.median(ratios):.3f} ({boots[50]:.3f}-{boots[1949]:.3f}),"
                 f" new faster in {sum(r < 1 for r in ratios)}/{len(ratios)} rounds")
    print(f"  {k:12s} {1e3*statistics.median(v):8.2f} ms  img/s vs mha {r:.3f}{extra}")
