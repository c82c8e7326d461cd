"""CLI: ``python -m visattn.bench attention|model|paths|study|loop|pool ...``.

Prints a markdown table and writes every measurement (raw samples included) to ``--out`` as JSON.
Ratios are to the reference (``mha``) measured in the same interleaved rounds; report those, not
absolute times, on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from visattn.attention import list_attentions
from visattn.attention.moh import MOH_IMPLS
from visattn.utils.allocator import tune_glibc_malloc
from visattn.utils.checks import int_at_least
from visattn.utils.machine import describe_machine, machine_line

from .attention import Shape, run_attention_bench
from .loop import TASKS, loop_table, run_loop_bench
from .models import MODEL_PRESETS, run_model_bench
from .paths import PATH_CHOICES, ROUTINGS, paths_table, run_paths_bench
from .pool import pool_runs, pool_table
from .report import markdown_table
from .study import STUDY_TASKS, run_study_bench
from .workload import DTYPES

DEFAULT_SHAPES = ["32,197,384,6", "32,256,768,12"]
# The study's attention layers (classification: 96 wide, 8 heads, 17 tokens; DiT: 64 wide, 8 heads,
# 49 tokens; batch 256) and ViT-S's.
STUDY_SHAPES = ["256,17,96,8", "256,49,64,8", "32,197,384,6"]


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    p.add_argument("--warmup", type=int_at_least(0), default=2, help="untimed rounds before timing")
    p.add_argument("--repeats", type=int_at_least(1), default=10, help="timed rounds (median reported)")
    p.add_argument("--threads", type=int_at_least(1), default=torch.get_num_threads(), help="torch intra-op threads")
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall time, or this process's CPU time (steadier on a shared machine; use with --threads 1)",
    )
    p.add_argument("--no-train", dest="train", action="store_false", help="skip the training step")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda when available")
    p.add_argument("--out", type=Path, default=None, help="JSON file for every measurement")


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when available, else CPU; ``cuda`` without a GPU is refused."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here; use --device cpu (or auto)")
    return torch.device(name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m visattn.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    att = sub.add_parser("attention", help="one attention layer per variant")
    att.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="batch,tokens,dim,heads")
    att.add_argument(
        "--variants", nargs="+", default=None, help=f"default: all ({', '.join(list_attentions())})"
    )
    att.add_argument(
        "--budgets", nargs="+", type=float, default=[0.5, 0.75, 0.9], help="MoH active-head fractions"
    )
    att.add_argument("--no-masked", dest="masked", action="store_false", help="skip MoH's masked dense rows")
    att.add_argument("--no-memory", dest="memory", action="store_false", help="skip peak-memory measurement")
    _common(att)
    paths = sub.add_parser("paths", help="MoH's exact inference paths, impl=auto and head choice vs mha")
    paths.add_argument("--shapes", nargs="+", default=STUDY_SHAPES, help="batch,tokens,dim,heads")
    paths.add_argument("--budgets", nargs="+", type=float, default=[0.5, 0.75], help="active-head fractions")
    paths.add_argument("--paths", nargs="+", default=None, choices=PATH_CHOICES, metavar="PATH",
                       help="time only these rows besides mha (default: all): MoH's paths where a layer has them, "
                            f"auto, kernel_parts (the second MHA row); one of {', '.join(PATH_CHOICES)}")
    paths.add_argument("--routings", nargs="+", default=None, choices=sorted(ROUTINGS),
                       help="time only these routings' rows (moh: token choice, hc: head choice; default: both)")
    paths.add_argument("--layer-mix", action="store_true",
                       help="where a budget is no whole number of a layer's heads (75%% of 6), also time the other "
                            "whole number around it (rows moh-75alt) and give a model's mix of the two layers "
                            "(rows moh-75mix: half the layers at 4 of 6, half at 5), as per-layer budgets reach it")
    _common(paths)
    paths.set_defaults(dtypes=["fp32"])
    mod = sub.add_parser("model", help="whole presets, images/s")
    mod.add_argument(
        "--presets",
        nargs="+",
        default=["vit_small", "dit_b2", "transnext_micro"],
        choices=sorted(MODEL_PRESETS),
    )
    mod.add_argument(
        "--attns",
        nargs="+",
        default=["mha", "moh-50", "moh-75", "moh-90"],
        help="first is the reference; mha, any registered name, or moh-<percent>",
    )
    mod.add_argument("--batch", type=int_at_least(1), default=32)
    mod.add_argument("--no-memory", dest="memory", action="store_false", help="skip peak-memory measurement")
    mod.add_argument("--compile", action="store_true", help="time torch.compile'd models (inductor; compiled in the warm-up)")
    mod.add_argument("--compare-kernels", action="store_true",
                     help="also time each attention with visattn.kernels off ('<attn> pytorch' rows)")
    _common(mod)
    study = sub.add_parser("study", help="the study's models (conf/study/), whole, per cell: images/s")
    study.add_argument("--tasks", nargs="+", default=list(STUDY_TASKS), choices=STUDY_TASKS)
    study.add_argument(
        "--cells", nargs="+", default=["mha", "moh-50", "moh-75", "moh-90"],
        help="cells of conf/study/cells.yaml; the first is the reference",
    )
    study.add_argument("--batch", type=int_at_least(1), default=256)
    study.add_argument("--profile", default="full", help="the study profile whose command lines build the models")
    study.add_argument("--memory", dest="memory", action="store_true", help="measure peak memory too")
    study.add_argument("--compare-kernels", action="store_true",
                       help="also time each cell with visattn.kernels off ('<cell> pytorch' rows, same rounds)")
    study.add_argument("--moh-impl", choices=MOH_IMPLS, default=None,
                       help="also time each cell with its MoH layers' impl set to this, where they have it "
                            "('<cell> <impl>' rows, same rounds; e.g. sparse or routed_kernel_loops to train on it)")
    _common(study)
    study.set_defaults(dtypes=["fp32"], memory=False)
    pool = sub.add_parser("pool", help="several runs' JSON (--out) of one bench command: ratios pooled over the runs")
    pool.add_argument("runs", nargs="+", type=Path, help="the runs' JSON files (at least two)")
    pool.add_argument("--out", type=Path, default=None, help="JSON file for the pooled rows")
    loop = sub.add_parser("loop", help="the engine's training step vs a bare PyTorch loop, per task (overhead)")
    loop.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    loop.add_argument("--vit", default="small_patch16_224", help="classification: a ViT preset (visattn.models.vit)")
    loop.add_argument("--vit-batch", type=int_at_least(1), default=32)
    loop.add_argument("--vit-kwargs", nargs="*", default=None, help="key=value overrides of the ViT preset")
    loop.add_argument("--dit", default="DiT-S/2", help="generation: a DiT preset (visattn.models.dit)")
    loop.add_argument("--dit-batch", type=int_at_least(1), default=8)
    loop.add_argument("--dit-kwargs", nargs="*", default=None, help="key=value overrides, e.g. depth=2 input_size=8")
    loop.add_argument("--attn", default=None, help="attention of both models (default: mha / the DiT preset's)")
    loop.add_argument("--clip", type=float, default=None, help="clip gradients (both loops) at this norm")
    loop.add_argument("--log-every", type=int_at_least(1), default=10,
                      help="steps per timed block; our loop reads its counters once per block, as at a log point")
    _common(loop)
    loop.set_defaults(dtypes=["fp32"], warmup=1, repeats=10)
    return parser.parse_args(argv)


def _finish(out: Path | None, meta: dict, rows: list[dict], text: str) -> dict:
    """Write ``{"meta", "rows"}`` to ``out`` (atomically; None: nowhere), print ``text``, return the result."""
    result = {"meta": meta, "rows": rows}
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(out)
    sys.stdout.write(text)
    return result


def pool_main(args: argparse.Namespace) -> dict:
    """``pool``: read the runs, print the pooled table, write the pooled rows (with the runs' meta) to ``--out``."""
    results = []
    for path in args.runs:
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, ValueError) as err:
            raise SystemExit(f"pool: cannot read {path} ({err}); give the JSON files a bench wrote with --out") from err
        if not isinstance(results[-1], dict) or "meta" not in results[-1] or "rows" not in results[-1]:
            raise SystemExit(f"pool: {path} has no 'meta' and 'rows'; give the JSON files a bench wrote with --out")
    try:
        rows = pool_runs(results, [str(p) for p in args.runs])
    except ValueError as err:
        raise SystemExit(f"pool: {err}") from err
    meta = {**results[0]["meta"], "mode": "pool", "pooled_mode": results[0]["meta"].get("mode"),
            "runs": [str(p) for p in args.runs]}
    header = (f"Pooled {len(results)} runs of `{meta['pooled_mode']}` on {meta.get('device', meta.get('cpu'))} "
              f"({meta.get('threads')} thread(s), {meta.get('clock')} clock)\n")
    return _finish(args.out, meta, rows, header + pool_table(rows))


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    if args.mode == "pool":
        return pool_main(args)
    tuned = tune_glibc_malloc()
    torch.set_num_threads(args.threads)
    machine = describe_machine()
    meta = {
        "mode": args.mode,
        "argv": sys.argv if argv is None else ["python", "-m", "visattn.bench", *argv],
        "torch": torch.__version__,
        "threads": args.threads,
        "clock": args.clock,
        "cpu": machine["cpu"],  # the model name (/proc/cpuinfo), not just the architecture
        "cores": machine["cores"],
        **({"gpu": machine["gpu"]} if "gpu" in machine else {}),
        "malloc_tuned": tuned,
    }
    device = resolve_device(args.device)
    if device.type == "cuda" and args.clock == "cpu":
        raise SystemExit("--clock cpu times this process's CPU, not the GPU's work; use --clock wall on CUDA")
    if device.type == "cuda":
        meta.update(device=torch.cuda.get_device_name(device), memory_measure="allocated device memory growth "
                    "during one call (torch.cuda.max_memory_allocated after reset_peak_memory_stats)")
    else:
        meta.update(device=f"cpu: {machine['cpu']}", memory_measure="resident-set high-water mark growth "
                    "during one call (VmHWM after clear_refs)")
    if args.mode == "loop":
        rows = run_loop_bench(args.tasks, device, args.dtypes, args.vit, args.vit_batch, args.vit_kwargs, args.dit,
                              args.dit_batch, args.dit_kwargs, args.attn, args.clip, args.repeats, args.warmup,
                              args.log_every, clock=args.clock)
        table = loop_table(rows)
    elif args.mode == "attention":
        shapes = [Shape.parse(s) for s in args.shapes]
        variants = args.variants or list_attentions()
        rows = run_attention_bench(
            shapes,
            variants,
            args.budgets,
            args.dtypes,
            args.warmup,
            args.repeats,
            args.train,
            args.memory,
            clock=args.clock,
            masked=args.masked,
            device=device,
        )
        table = markdown_table(rows, "shape")
    elif args.mode == "study":
        rows = run_study_bench(args.tasks, args.cells, args.batch, args.dtypes, args.warmup, args.repeats,
                               args.train, args.memory, clock=args.clock, profile=args.profile, device=device,
                               compare_kernels=args.compare_kernels, moh_impl=args.moh_impl)
        table = markdown_table(rows, "preset")
    elif args.mode == "paths":
        shapes = [Shape.parse(s) for s in args.shapes]
        rows = run_paths_bench(shapes, args.budgets, args.dtypes, args.warmup, args.repeats, clock=args.clock,
                               device=device, paths=args.paths, routings=args.routings, layer_mix=args.layer_mix)
        table = paths_table(rows)
    else:
        rows = run_model_bench(
            args.presets,
            args.attns,
            args.batch,
            args.dtypes,
            args.warmup,
            args.repeats,
            args.train,
            args.memory,
            clock=args.clock,
            device=device,
            compile=args.compile,
            compare_kernels=args.compare_kernels,
        )
        table = markdown_table(rows, "preset")
    header = f"Machine: {machine_line(machine)}; {args.threads} thread(s), {args.clock} clock\nDevice: {meta['device']}\n"
    return _finish(args.out, meta, rows, header + table)


if __name__ == "__main__":
    main()
