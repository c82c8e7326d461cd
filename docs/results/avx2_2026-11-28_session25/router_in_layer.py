"""Where a training MoH layer's time over MHA's goes: layer 1 of the study classifier (or DiT), forward and backward,
every variant on the small-heads kernel, interleaved in one process (thread CPU time, 1 thread):

- mha: MHA's layer;
- fixed: the MoH layer with fixed gates (no router, the qkv matmul 288 columns wide): skipping and gating alone;
- fixedcols: the same, the router's 16 logit columns computed in the qkv matmul and not used;
- cols: the layer as it trains (logits from those columns, the routing kernels and their backward);
- sep: the logits from the router's own matmul instead (F.linear; the kernels' loops with router_own_matmul.diff).

    python router_in_layer.py cls|dit moh-90 ROUNDS
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
with torch.no_grad():
    fixed = moh.route(x, None, selection=False)[0].clone()


def moh_forward(variant):
    if variant == "fixed":
        q, k, v = moh.project_qkv(x)
        gates = fixed
    elif variant == "fixedcols":
        q, k, v, _ = moh.project_qkv_and_logits(x)
        gates = fixed
    elif variant == "cols":
        q, k, v, logits = moh.project_qkv_and_logits(x)
        gates, _ = moh.route(x, q, selection=False, logits=logits)
    else:
        gates, _ = moh.route(x, None, selection=False)
        q, k, v = moh.project_qkv(x)
    heads, gated = moh.gated_sdpa(q, k, v, None, False, None, gates, True)
    return moh.merge_heads(x, heads, None if gated else gates)


def step(variant):
    if variant == "mha":
        loss = (mha(x) * grad).sum()
    else:
        loss = (moh_forward(variant) * grad).sum()
        if variant in ("cols", "sep"):
            loss = loss + 0.01 * moh.aux_loss
    loss.backward()


variants = ("mha", "fixed", "fixedcols", "cols", "sep")
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
    print(f"  {variant:9s} {1e3 * statistics.median(t):7.2f} ms  vs mha {ratio:.3f}  paired diff {1e3 * diff:+.2f} ms")
sep_cols = statistics.median(a / b for a, b in zip(times["sep"], times["cols"], strict=True))
print(f"  sep / cols {sep_cols:.3f}")
