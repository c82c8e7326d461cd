"""``python -m visattn.bench pool RUN.json RUN.json ...``: each row's ratio to the reference from several runs of
one bench command, with an interval that covers the runs' differences.

Within a run every ratio is paired round by round (``timing.paired_ratio``), so the machine's drift during the
run cancels. Between runs the machine itself can differ (the load on the other core, the clock, where memory
landed, a path a probe chose), and on a 2-core AMD EPYC two runs minutes apart differed by +-1.5%, more than
either run's interval (docs/benchmarks.md, 17th session). So a claim such as "at least 0.95x `mha`'s images/s"
rests on several runs: this pools their rounds (``timing.pooled_ratio``) and bootstraps runs and rounds
(``timing.pooled_interval``). Runs must come from the same machine, torch, thread count and clock.
"""

from __future__ import annotations

from typing import Any

from .report import ratio_cell
from .timing import paired_ratio, pooled_interval, pooled_ratio

MODES = ("infer", "train")
SAME_IN_EVERY_RUN = ("mode", "cpu", "torch", "threads", "clock")


def _group(row: dict[str, Any]) -> str:
    """The table a row belongs to: its layer shape (attention, paths) or preset (model, study)."""
    return str(row.get("shape", row.get("preset", "")))


def _check_runs(results: list[dict[str, Any]], names: list[str]) -> None:
    if len(results) < 2:
        raise ValueError(f"pool needs at least two runs of one bench command, got {len(results)}")
    first = results[0]["meta"]
    for result, name in zip(results[1:], names[1:], strict=True):
        for key in SAME_IN_EVERY_RUN:
            if result["meta"].get(key) != first.get(key):
                raise ValueError(
                    f"{name}: {key}={result['meta'].get(key)!r} but {names[0]} has {key}={first.get(key)!r}; pool runs "
                    "of one command on one machine (the same cpu, torch, threads and clock)"
                )


def _references(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """The reference row of each (group, dtype): the first measured one, as the benches put it."""
    refs: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        if "skipped" not in row:
            refs.setdefault((_group(row), row["dtype"]), row)
    return refs


def pool_runs(results: list[dict[str, Any]], names: list[str] | None = None) -> list[dict[str, Any]]:
    """One row per (group, dtype, label) of the first run: ``runs`` (how many had it), and per mode the runs' own
    paired ratios (``{mode}_run_ratios``), the pooled ratio (``{mode}_ratio``) and its interval (``{mode}_ratio_ci``).
    ``results``: the JSON the benches write (``--out``); ``names`` label them in errors."""
    names = names or [f"run {i + 1}" for i in range(len(results))]
    _check_runs(results, names)
    refs = [_references(result["rows"]) for result in results]
    measured = [{(_group(r), r["dtype"], r["label"]): r for r in result["rows"] if "skipped" not in r}
                for result in results]
    pooled = []
    for key, first in measured[0].items():
        group, dtype, label = key
        out: dict[str, Any] = {"group": group, "dtype": dtype, "label": label,
                               "runs": sum(key in rows for rows in measured)}
        if first.get("auto_path") is not None:  # the paths bench's auto rows: what each run's probe chose
            out["auto_paths"] = [rows[key].get("auto_path") for rows in measured if key in rows]
        for mode in MODES:
            runs = []
            for rows, ref in zip(measured, refs, strict=True):
                row, reference = rows.get(key), ref.get((group, dtype))
                if row and reference and row.get(f"{mode}_samples_ms") and reference.get(f"{mode}_samples_ms"):
                    runs.append((row[f"{mode}_samples_ms"], reference[f"{mode}_samples_ms"]))
            if not runs:
                continue
            out[f"{mode}_run_ratios"] = [paired_ratio(s, r) for s, r in runs]
            out[f"{mode}_ratio"] = pooled_ratio(runs)
            is_reference = label == refs[0][(group, dtype)]["label"]  # its ratio is 1 by definition
            out[f"{mode}_ratio_ci"] = pooled_interval(runs) if len(runs) > 1 and not is_reference else None
        pooled.append(out)
    return pooled


def pool_table(rows: list[dict[str, Any]]) -> str:
    """One markdown table per (group, dtype): each run's ratio, the pooled ratio with its interval, and the
    pooled ratio as images/s (the inverse)."""
    out: list[str] = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["group"], row["dtype"]), []).append(row)
    modes = [m for m in MODES if any(f"{m}_ratio" in r for r in rows)]
    for (group, dtype), members in groups.items():
        out.append(f"\n### {group}, {dtype}: time vs the reference, pooled over runs\n")
        head = "| variant | runs |" + "".join(
            f" {m} vs ref, each run | {m} vs ref, pooled (95% interval) | img/s {m} vs ref, pooled |" for m in modes
        )
        out.append(head)
        out.append("|" + "---|" * (head.count("|") - 1))
        for r in members:
            label = r["label"] + (f" -> {' / '.join(map(str, r['auto_paths']))}" if r.get("auto_paths") else "")
            cells = [label, str(r["runs"])]
            for m in modes:
                each = r.get(f"{m}_run_ratios")
                cells += [" / ".join(f"{x:.3f}" for x in each) if each else "-", ratio_cell(r, m),
                          ratio_cell(r, m, throughput=True)]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"
