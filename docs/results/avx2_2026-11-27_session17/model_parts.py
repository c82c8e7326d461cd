"""What MoH's inference costs over mha's in the study's whole models, part by part, in context.

Times four forwards in the same shuffled rounds (process CPU time, 1 thread): ``mha``; the MoH cell with every
layer on ``masked_dense`` (what ``impl=auto`` chose for MoH-75/90 in the study bench); the same with every layer's
router replaced by the gates it returned for these inputs (the router's cost removed); and with no gates at all
(the gated projection's cost removed too). Each ratio is the
median of the per-round ratios to ``mha`` with its 95% interval (``visattn.bench.timing``).

    python docs/results/avx2_2026-11-27_session17/model_parts.py cls moh-90 31
"""

import sys

import torch

from visattn.bench.study import build_study_workload
from visattn.bench.timing import interleaved_times, median, paired_ratio, ratio_interval


def main(task: str, cell: str, rounds: int) -> None:
    torch.set_num_threads(1)
    works = {c: build_study_workload(task, c, 256) for c in ("mha", cell)}
    for work in works.values():
        work.module.eval()
    moh = works[cell].module
    layers = [m for m in moh.modules() if getattr(m, "router", None) is not None]
    for layer in layers:
        layer.impl = "dense"
    gates = {}
    with torch.no_grad():
        for layer in layers:  # record each layer's gates for these inputs
            layer.route = lambda *a, layer=layer, route=layer.route, **k: gates.setdefault(layer, route(*a, **k))
        moh(*works[cell].inputs)
        for layer in layers:
            del layer.route

    def replaced(route_of):
        def run():
            for layer in layers:
                layer.route = route_of(layer)
            try:
                return moh(*works[cell].inputs)
            finally:
                for layer in layers:
                    del layer.route
        return run

    runs = {
        "mha": lambda: works["mha"].module(*works["mha"].inputs),
        cell: lambda: moh(*works[cell].inputs),
        "router's gates given": replaced(lambda layer: lambda *a, **k: gates[layer]),
        "no gates": replaced(lambda layer: lambda *a, **k: (None, None)),
    }
    with torch.no_grad():
        times = interleaved_times(runs, warmup=3, repeats=rounds, clock="cpu")
    print(f"{task}, {cell} on masked_dense, {rounds} rounds")
    print("| forward | ms (median) | time vs mha (95% interval) |")
    print("|---|---|---|")
    for name, samples in times.items():
        interval = ratio_interval(samples, times["mha"])
        cell_text = f"{paired_ratio(samples, times['mha']):.3f}"
        if interval and name != "mha":
            cell_text += f" ({interval[0]:.3f}-{interval[1]:.3f})"
        print(f"| {name} | {1e3 * median(samples):.2f} | {cell_text} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
