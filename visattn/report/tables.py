"""Markdown tables of the report: quality (mean +- std, 95% interval), comparison with MHA, cost.

Anything a run did not measure is shown as "—"; nothing is estimated.
"""

from __future__ import annotations

from collections.abc import Sequence

from .metrics import Metric, quality_metrics
from .runs import Cell
from .stats import REFERENCE, Summary, compare, summarize

DASH = "—"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def format_summary(summary: Summary | None, scale: float = 1.0, digits: int = 2) -> str:
    """``mean ± std [low, high]``; ``mean (n=1, no interval)`` for one seed; ``—`` when unmeasured."""
    if summary is None:
        return DASH
    fmt = f"{{:.{digits}f}}"
    mean = fmt.format(summary.mean * scale)
    if not summary.has_interval:
        return f"{mean} (n=1, no interval)"
    return (
        f"{mean} ± {fmt.format(summary.std * scale)} "
        f"[{fmt.format(summary.low * scale)}, {fmt.format(summary.high * scale)}]"
    )


def head_fraction(cell: Cell, reference: Cell | None) -> float | None:
    """Active heads per token as a fraction of the MHA baseline's heads (so a narrower plain MHA
    sits at its head budget, not at 100%); of the cell's own total when there is no baseline."""
    if cell.heads is None:
        return None
    total = reference.heads[1] if reference is not None and reference.heads else cell.heads[1]
    return cell.heads[0] / total


def _heads_text(cell: Cell, reference: Cell | None) -> str:
    fraction = head_fraction(cell, reference)
    return DASH if fraction is None else f"{cell.budget} ({fraction:.0%})"


def _seeds_text(cell: Cell) -> str:
    return str(len(cell.runs))


def quality_table(cells: Sequence[Cell], reference: Cell | None) -> str:
    """Per cell: head budget, seeds, and every quality metric of the task as mean ± std [95% CI]."""
    task = cells[0].task
    metrics = quality_metrics(task)
    header = ["variant", "active heads (of MHA)", "seeds", *(m.label for m in metrics)]
    if task == "dit":
        header.append("extractor / samples")
    rows = []
    for cell in cells:
        row = [cell.variant, _heads_text(cell, reference), _seeds_text(cell)]
        row += [format_summary(summarize(cell.values(m.key)), m.scale, m.digits) for m in metrics]
        if task == "dit":
            samples = sorted({int(v) for v in cell.values("num_samples")})
            row.append(f"{cell.text('extractor') or DASH} / {', '.join(map(str, samples)) or DASH}")
        rows.append(row)
    return markdown_table(header, rows)


def comparison_verdicts(cell: Cell, reference: Cell | None, metrics: Sequence[Metric]) -> list[str]:
    if reference is None:
        return [DASH] * len(metrics)
    if cell is reference:
        return [REFERENCE] * len(metrics)
    return [
        compare(summarize(cell.values(m.key)), summarize(reference.values(m.key)), m.higher_is_better)
        for m in metrics
    ]


def comparison_table(cells: Sequence[Cell], reference: Cell | None) -> str:
    """Per cell and metric: better / worse than MHA only when the 95% intervals do not overlap."""
    metrics = quality_metrics(cells[0].task)
    header = ["variant", "active heads (of MHA)", *(f"{m.label} vs MHA" for m in metrics)]
    rows = [
        [cell.variant, _heads_text(cell, reference), *comparison_verdicts(cell, reference, metrics)]
        for cell in cells
    ]
    return markdown_table(header, rows)


def same_budget_pairs(cells: Sequence[Cell], reference: Cell | None) -> list[tuple[Cell, Cell]]:
    """(routed cell, unrouted cell) pairs with the same number of active heads per token, e.g. MoH at
    75% against a plain MHA built with 75% of the heads; the MHA baseline itself is never a partner."""
    plain = [c for c in cells if not c.routed and c is not reference and c.heads]
    return [(routed, other) for routed in cells if routed.routed and routed.heads
            for other in plain if other.heads[0] == routed.heads[0]]


def same_budget_table(cells: Sequence[Cell], reference: Cell | None) -> str | None:
    """Routing against simply having fewer heads: per pair, the headline metric of both and the
    verdict on every quality metric (same 95%-interval rule as against MHA); None without pairs."""
    pairs = same_budget_pairs(cells, reference)
    metrics = quality_metrics(cells[0].task) if cells else ()
    if not pairs or not metrics:
        return None
    headline = metrics[0]
    header = ["routed", "without routing", "active heads", f"{headline.label}, routed",
              f"{headline.label}, without routing", *(f"{m.label}: routed vs without" for m in metrics)]
    rows = []
    for routed, other in pairs:
        rows.append([
            routed.variant, other.variant, str(routed.heads[0]),
            format_summary(summarize(routed.values(headline.key)), headline.scale, headline.digits),
            format_summary(summarize(other.values(headline.key)), headline.scale, headline.digits),
            *(compare(summarize(routed.values(m.key)), summarize(other.values(m.key)), m.higher_is_better)
              for m in metrics),
        ])
    return markdown_table(header, rows)


def _mean(cell: Cell, key: str) -> float | None:
    summary = summarize(cell.values(key))
    return None if summary is None else summary.mean


def _ratio_text(cell: Cell, reference: Cell | None, key: str, unit: str, digits: int = 0) -> str:
    value = _mean(cell, key)
    if value is None:
        return DASH
    absolute = f"{value:.{digits}f} {unit}"
    ref_value = None if reference is None else _mean(reference, key)
    if not ref_value:
        return absolute
    return f"{value / ref_value:.2f}× ({absolute})"


def _scaled(value: float | None, units: Sequence[tuple[float, str]]) -> str:
    if value is None:
        return DASH
    for factor, unit in units:
        if abs(value) >= factor:
            return f"{value / factor:.2f} {unit}"
    return f"{value:.0f}"


def cost_table(cells: Sequence[Cell], reference: Cell | None) -> str:
    """Parameters, FLOPs and measured throughput / peak memory as ratios to MHA (mean over seeds)."""
    header = [
        "variant",
        "active heads (of MHA)",
        "params",
        "FLOPs / image",
        "train throughput (× MHA)",
        "inference throughput (× MHA)",
        "peak memory (× MHA)",
        "wall time / run",
    ]
    rows = []
    for cell in cells:
        rows.append(
            [
                cell.variant,
                _heads_text(cell, reference),
                _scaled(_mean(cell, "params"), [(1e9, "G"), (1e6, "M"), (1e3, "k")]),
                _scaled(_mean(cell, "flops_per_image"), [(1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP")]),
                _ratio_text(cell, reference, "train_images_per_s", "img/s"),
                _ratio_text(cell, reference, "eval_images_per_s", "img/s"),
                _ratio_text(cell, reference, "peak_memory_mb", "MB"),
                DASH if _mean(cell, "wall_time_s") is None else f"{_mean(cell, 'wall_time_s'):.0f} s",
            ]
        )
    return markdown_table(header, rows)


def noise_statement(cells: Sequence[Cell], reference: Cell | None) -> str:
    """Plain sentences: which cells differ from MHA beyond the seed noise, which do not."""
    metrics = quality_metrics(cells[0].task)
    if reference is None or not metrics:
        return "No MHA baseline among these runs, so no variant is compared with MHA."
    headline = metrics[0]
    groups: dict[str, list[str]] = {}
    for cell in cells:
        if cell is reference:
            continue
        verdict = comparison_verdicts(cell, reference, [headline])[0]
        groups.setdefault(verdict, []).append(cell.variant)
    lines = [f"On {headline.label} (95% t-intervals over seeds, compared with `{reference.variant}`):"]
    wording = {
        "better": "better than MHA beyond the seed noise",
        "worse": "worse than MHA beyond the seed noise",
        "within noise": "inside the seed noise of MHA (intervals overlap: not ranked)",
        "not ranked (n<2)": "not ranked (fewer than 2 seeds, no interval)",
        DASH: "not measured",
    }
    for verdict, text in wording.items():
        if groups.get(verdict):
            lines.append(f"- {text}: {', '.join(groups[verdict])}")
    return "\n".join(lines)
