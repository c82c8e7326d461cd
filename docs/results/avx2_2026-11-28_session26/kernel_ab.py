"""The small-heads kernel as committed at OLD (built from that commit's source under another op namespace) against the
running tree's, interleaved in one process (thread CPU time, 1 thread).

Whole study models (`cls` or `dit`): training steps as `bench study` takes them (forward, loss + load-balancing loss,
backward, AdamW) on the same training paths (the run's probe chooses them once, with the new kernel), or inference
with --eval. Prints each variant's median time, its images/s vs the first cell's with the same kernel (median of
paired ratios, a 95% bootstrap interval), and new/old time per cell (the same, and in how many rounds new took less
time).

The kernel alone (`kernel-cls` or `kernel-dit`, a study layer's shape, MoH-like gates): q, k and v read from packed
rows W floats apart (the first 3 H d of each row; 288 / 192 for MHA, 304 / 208 with the router's 16 logit columns),
the forward just after the rows were written (as after the qkv matmul), the backward after 64 MB were written (as
its forward's rows, long evicted). Median ms, and new/old.

    python kernel_ab.py OLD cls|dit ROUNDS [mha,moh-50,moh-90] [--eval]
    python kernel_ab.py OLD kernel-cls|kernel-dit ROUNDS [288,304]
"""

import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from visattn.bench.study import build_study_workload
from visattn.kernels import CFLAGS, HEADERS, LDFLAGS, small_attention_op
from visattn.utils.allocator import tune_glibc_malloc

tune_glibc_malloc()
torch.set_num_threads(1)
old_commit, task, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
train = "--eval" not in sys.argv
given = sys.argv[4] if len(sys.argv) > 4 and not sys.argv[4].startswith("--") else None


def build_old(commit: str) -> None:
    """small_attention.cpp and the headers at `commit`, its ops registered as torch.ops.visattn_old."""
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())
    build = Path.home() / ".cache" / "visattn" / f"ab_small_attention_{commit}"
    src = build / "src"  # the same path each run, so that a built library is reused
    src.mkdir(parents=True, exist_ok=True)
    for path in ["visattn/kernels/small_attention.cpp"] + [f"visattn/kernels/{h.name}" for h in HEADERS]:
        text = subprocess.check_output(["git", "-C", str(root), "show", f"{commit}:{path}"], text=True)
        if path.endswith(".cpp"):
            text = re.sub(r"TORCH_LIBRARY_FRAGMENT\(visattn,", "TORCH_LIBRARY(visattn_old,", text)
            text = re.sub(r"TORCH_LIBRARY_IMPL\(visattn,", "TORCH_LIBRARY_IMPL(visattn_old,", text)
        file = src / Path(path).name
        if not file.exists() or file.read_text() != text:  # rewritten, it would be rebuilt
            file.write_text(text)
    cpp_extension.load(name=f"ab_small_attention_{commit}", sources=[str(src / "small_attention.cpp")],
                       extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), build_directory=str(build),
                       is_python_module=False)


assert small_attention_op() is not None, "the project's kernels are not built: python -m visattn.kernels"
build_old(old_commit)
ops = {
    "new": (torch.ops.visattn.small_attention, torch.ops.visattn.small_attention_backward),
    "old": (torch.ops.visattn_old.small_attention, torch.ops.visattn_old.small_attention_backward),
}


def use(kernel: str) -> None:
    # small_attention_op() and SmallAttention.backward look the ops up on torch.ops.visattn at each call
    torch.ops.visattn.small_attention, torch.ops.visattn.small_attention_backward = ops[kernel]




def kernel_only(shape: str, widths: list[int]) -> None:
    B, N, H, d = {"cls": (256, 17, 8, 12), "dit": (256, 49, 8, 8)}[shape]
    packed = {w: torch.randn(B, N, w) for w in widths}
    gates = (torch.rand(B, N, H) * (torch.rand(B, N, H) > 0.1)).contiguous()
    grad_out = torch.randn(B, N, H, d).transpose(1, 2)
    evict = torch.empty(16 << 20)

    def views(w):
        p = packed[w][..., : 3 * H * d]
        return [p[..., i * H * d : (i + 1) * H * d].view(B, N, H, d).transpose(1, 2) for i in range(3)]

    def run(kernel, w, part):
        forward, backward = ops[kernel]
        if part == "forward":
            return forward(*views(w), d**-0.5, gates, True)
        return backward(grad_out, *views(w), d**-0.5, gates, True)

    def outputs(kernel, w, part):
        out = run(kernel, w, part)
        return [out] if part == "forward" else list(out)

    cases = [(kernel, w, part) for w in widths for part in ("forward", "backward") for kernel in ("new", "old")]
    for _, w, part in cases:
        pairs = zip(outputs("new", w, part), outputs("old", w, part), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs), ("new and old differ", w, part)
    times = {case: [] for case in cases}
    for _ in range(rounds):
        for case in cases:
            if case[2] == "forward":
                packed[case[1]].mul_(1.0)
            else:
                evict.fill_(1.0)
                grad_out.mul_(1.0)
            t0 = time.thread_time()
            run(*case)
            times[case].append(time.thread_time() - t0)
    print(f"small-heads kernel, [B, H, N, d] = [{B}, {H}, {N}, {d}], {rounds} rounds; old kernel: {old_commit}")
    for w in widths:
        for part in ("forward", "backward"):
            new, old = times["new", w, part], times["old", w, part]
            ratio = statistics.median(a / b for a, b in zip(old, new, strict=True))
            print(f"  rows {w} apart, {part:8s}: new {1e3 * statistics.median(new):6.2f} ms, old "
                  f"{1e3 * statistics.median(old):6.2f} ms, old/new {ratio:.3f}")


if task.startswith("kernel-"):
    kernel_only(task.removeprefix("kernel-"), [int(w) for w in (given or "288,304").split(",")])
    sys.exit()
cells = given.split(",") if given else ["mha", "moh-50", "moh-90"]
use("new")
works = {cell: build_study_workload(task, cell, 256) for cell in cells}
for w in works.values():
    w.module.train(train)


def step(cell: str, kernel: str) -> None:
    use(kernel)
    if train:
        works[cell].train_step("fp32")
    else:
        with torch.no_grad():
            works[cell].infer()


variants = [(cell, kernel) for cell in cells for kernel in ("new", "old")]
for v in variants:
    step(*v)
    step(*v)
times = {v: [] for v in variants}
for _ in range(rounds):
    for v in variants:
        t0 = time.thread_time()
        step(*v)
        times[v].append(time.thread_time() - t0)
use("new")
print(f"{task} {'train' if train else 'eval'}, {rounds} rounds, whole model, batch 256; old kernel: {old_commit}")
rng = random.Random(0)


def paired(ratios: list[float]) -> str:
    """The median of paired ratios and a 95% bootstrap interval over the rounds."""
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return f"{statistics.median(ratios):.3f} ({boots[50]:.3f}-{boots[1949]:.3f})"


for cell in cells:
    for kernel in ("new", "old"):
        t = times[cell, kernel]
        # images/s vs the first cell's with the same kernel: issue 32's item 2 under each kernel
        vs_ref = paired([b / a for a, b in zip(t, times[cells[0], kernel], strict=True)])
        line = f"  {cell:8s} {kernel}  {1e3 * statistics.median(t):8.2f} ms  img/s vs {cells[0]} {kernel} {vs_ref}"
        if kernel == "new":
            ratios = [a / b for a, b in zip(t, times[cell, "old"], strict=True)]
            line += f"  new/old time {paired(ratios)}, new faster in {sum(r < 1 for r in ratios)}/{len(ratios)} rounds"
        print(line)
