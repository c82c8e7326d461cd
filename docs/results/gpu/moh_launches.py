"""Diagnostic for issue 32 on a GPU: one attention layer's kernel launches, its eager time, and its time replayed
from a CUDA graph (no launch cost: the GPU's own time), MoH against MHA, bf16 autocast, inference.

    python docs/results/gpu/moh_launches.py --out launches.json                 # eager, with launch counts
    python docs/results/gpu/moh_launches.py --mode graph --out graphs.json    # replayed from CUDA graphs

Per shape, every variant is timed in the same rounds (interleaved, 5 rounds of 50 calls, median); ratios are
to MHA in the same mode. "pytorch routing" rows run the same layer with visattn.kernels off (the PyTorch
routing, ~25 kernels). Graph mode leaves out the paths with host synchronisations (auto's, head_gather).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from visattn import kernels
from visattn.attention import build_attention
from visattn.bench.attention import moh_budget

SHAPES = {  # batch, tokens, width, heads
    "ViT-S b32": (32, 197, 384, 6), "DiT-B/2 b16": (16, 256, 768, 12),
    "ViT-S b256": (256, 197, 384, 6), "DiT-B/2 b128": (128, 256, 768, 12),
    "study ViT b256": (256, 17, 96, 8), "study DiT b256": (256, 49, 64, 8),
    "tiny": (2, 17, 96, 8),  # a smoke test of this script (also on a CPU: --device cpu)
}  # fmt: skip


def variants(heads: int) -> dict[str, tuple[tuple[str, dict], bool]]:
    """label -> ((attention name, its keyword arguments), kernels on)."""
    out = {"mha": (("mha", {}), True)}
    for pct in (50, 75, 90):
        shared, topk = moh_budget(heads, pct / 100)
        out[f"moh-{pct} masked dense"] = (("moh", dict(shared_heads=shared, routed_topk=topk, impl="dense")), True)
    shared, topk = moh_budget(heads, 0.5)
    dense = ("moh", dict(shared_heads=shared, routed_topk=topk, impl="dense"))
    out["moh-50 masked dense, pytorch routing"] = (dense, False)
    out["moh-50 auto"] = (("moh", dict(shared_heads=shared, routed_topk=topk, impl="auto")), True)
    out["moh-50 head choice, head_gather"] = (
        ("moh", dict(shared_heads=shared, routed_topk=topk, routing="head_choice", impl="head_gather")), True)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def launches(layer, x) -> int:
    """CUDA kernels (and copies, fills) one forward launches; on a CPU, the top-level aten operations."""
    if x.device.type != "cuda":
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            layer(x)
        return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        layer(x)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def graphed(layer, x):
    """A function replaying the layer's forward on a copy of x from a CUDA graph (None where the capture
    fails), and why not."""
    if x.device.type != "cuda":
        return None, "no CUDA graphs on a CPU"
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            layer(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            layer(static)
    except Exception as err:  # noqa: BLE001  (reported, not raised)
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"

    def replay():
        graph.replay()  # reads `static`, which this closure keeps alive

    replay.static = static
    return replay, None


def timed_ms(call, device: torch.device, n: int) -> float:
    sync(device)
    t = time.perf_counter()
    for _ in range(n):
        call()
    sync(device)
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--mode", choices=["eager", "graph"], default="eager",
                        help="graph: replay each layer from a CUDA graph (the GPU's own time; run it as its own "
                             "process: a failed replay leaves the device unusable)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--calls", type=int, default=50, help="calls per timed block")
    args = parser.parse_args()
    dev = torch.device(args.device)
    if args.mode == "graph" and dev.type != "cuda":
        parser.error("--mode graph needs --device cuda")
    rows = []
    # autocast's weight cache off under graphs: its casts would be captured as addresses it may free
    with torch.no_grad(), torch.autocast(dev.type, torch.bfloat16, cache_enabled=args.mode == "eager"):
        for shape in args.shapes:
            B, N, C, H = SHAPES[shape]
            torch.manual_seed(0)
            x = torch.randn(B, N, C, device=dev)
            cases = {}
            for label, ((name, kw), on) in variants(H).items():
                if args.mode == "graph" and kw.get("impl") not in (None, "dense"):
                    continue  # paths with host synchronisations cannot be captured
                layer = build_attention(name, C, num_heads=H, **kw).to(dev).eval()
                with contextlib.nullcontext() if on else kernels.disabled():
                    layer(x)  # auto's probe, Triton's compilation
                    if args.mode == "eager":
                        call, why = (lambda layer=layer, x=x: layer(x)), None
                        count = launches(layer, x)
                    else:
                        (call, why), count = graphed(layer, x), None
                cases[label] = dict(layer=layer, on=on, call=call, why=why, launches=count, ms=[])
            for _ in range(args.rounds):
                for case in cases.values():
                    if case["call"] is not None:
                        with contextlib.nullcontext() if case["on"] else kernels.disabled():
                            case["ms"].append(timed_ms(case["call"], dev, args.calls))
            ref = statistics.median(cases["mha"]["ms"]) if cases["mha"]["ms"] else float("nan")
            for label, case in cases.items():
                ms = statistics.median(case["ms"]) if case["ms"] else None
                row = dict(shape=shape, variant=label, mode=args.mode, launches=case["launches"], ms=ms,
                           vs_mha=None if ms is None else ms / ref, path=getattr(case["layer"], "last_path", None),
                           failed=case["why"])
                rows.append(row)
                timing = f"{ms:.4f} ms ({ms / ref:.3f}x)" if ms is not None else f"- [{case['why']}]"
                launched = "" if case["launches"] is None else f"launches {case['launches']:3d}  "
                print(f"{shape:15s} {label:40s} {args.mode} {launched}{timing}", flush=True)
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else None
    meta = dict(gpu=gpu, torch=torch.__version__, dtype="bf16 autocast", mode="inference", calls=args.calls,
                rounds=args.rounds)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
