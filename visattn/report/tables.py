"""Markdown tables of the report: quality (mean +- std, 95% interval), paired comparisons, cost.

Anything a run did not measure is shown as "—"; nothing is estimated. Each comparison table is one
family of tests (every cell x metric in it), corrected with Holm's method (see ``stats``).
"""

from __future__ import annotations

from collections.abc import Sequence

from .metrics import Metric, quality_metrics
from .runs import Cell
from .stats import REFERENCE, PairedDifference, Summary, paired_difference, paired_verdicts, summarize

DASH = "—"
FLOP_UNITS = [(1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP")]


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
        row += [_quality_text(cell, m) for m in metrics]
        if task == "dit":
            samples = sorted({int(v) for v in cell.values("num_samples")})
            row.append(f"{cell.text('extractor') or DASH} / {', '.join(map(str, samples)) or DASH}")
        rows.append(row)
    return markdown_table(header, rows)


def _quality_text(cell: Cell, metric: Metric) -> str:
    """mean ± std [interval]; for a metric the runs left out on purpose (sFID below its sample-size
    rule), the runs' reason instead of a dash."""
    summary = summarize(cell.values(metric.key))
    if summary is None and cell.text(f"{metric.key}_note"):
        return cell.text(f"{metric.key}_note")
    return format_summary(summary, metric.scale, metric.digits)


def by_seed(cell: Cell, key: str) -> dict:
    """``{seed: value}`` of one metric over the cell's runs (runs without the value left out)."""
    return {run.seed: run.value(key) for run in cell.runs if run.value(key) is not None}


def format_difference(diff: PairedDifference | None, scale: float = 1.0, digits: int = 2) -> str:
    """``+mean [low, high]`` of a paired difference, or ``+mean (n=1)``."""
    if diff is None:
        return DASH
    fmt = f"{{:+.{digits}f}}"
    if diff.low is None:
        return f"{fmt.format(diff.mean * scale)} (n={diff.n})"
    return f"{fmt.format(diff.mean * scale)} [{fmt.format(diff.low * scale)}, {fmt.format(diff.high * scale)}]"


def paired_family(pairs: Sequence[tuple[Cell, Cell]], metrics: Sequence[Metric]) -> list[list[tuple[str, str]]]:
    """Per (candidate, reference) pair and metric: (difference text, verdict), the verdicts corrected
    with Holm over the whole family (all pairs x metrics of one table)."""
    diffs = [[paired_difference(by_seed(cand, m.key), by_seed(ref, m.key)) for m in metrics] for cand, ref in pairs]
    flat = [d for row in diffs for d in row]
    verdicts = iter(paired_verdicts(flat, [m.higher_is_better for _ in pairs for m in metrics]))
    return [[(format_difference(d, m.scale, m.digits), next(verdicts)) for d, m in zip(row, metrics, strict=True)]
            for row in diffs]


def _cell_text(difference: str, verdict: str) -> str:
    return verdict if difference == DASH else f"{verdict}: {difference}"


def mha_family(cells: Sequence[Cell], reference: Cell | None, metrics: Sequence[Metric]) -> dict[str, list[str]]:
    """variant -> verdict per metric against MHA (``reference`` for MHA itself, — without a baseline)."""
    if reference is None:
        return {cell.variant: [DASH] * len(metrics) for cell in cells}
    others = [cell for cell in cells if cell is not reference]
    family = paired_family([(cell, reference) for cell in others], metrics)
    out = {reference.variant: [REFERENCE] * len(metrics)}
    out.update({cell.variant: [v for _, v in row] for cell, row in zip(others, family, strict=True)})
    return out


def comparison_table(cells: Sequence[Cell], reference: Cell | None) -> str:
    """Per cell and metric: the paired difference to MHA (mean [95% paired t-interval]) and the
    Holm-corrected verdict."""
    metrics = quality_metrics(cells[0].task)
    header = ["variant", "active heads (of MHA)", *(f"{m.label} vs MHA" for m in metrics)]
    if reference is None:
        return markdown_table(header, [[c.variant, _heads_text(c, reference), *[DASH] * len(metrics)] for c in cells])
    others = [cell for cell in cells if cell is not reference]
    family = paired_family([(cell, reference) for cell in others], metrics)
    rows = [[reference.variant, _heads_text(reference, reference), *[REFERENCE] * len(metrics)]]
    rows += [[cell.variant, _heads_text(cell, reference), *(_cell_text(d, v) for d, v in row)]
             for cell, row in zip(others, family, strict=True)]
    return markdown_table(header, rows)


def same_budget_pairs(cells: Sequence[Cell], reference: Cell | None) -> list[tuple[Cell, Cell]]:
    """(routed cell, unrouted cell) pairs with the same number of active heads per token, e.g. MoH at
    75% against a plain MHA built with 75% of the heads; the MHA baseline itself is never a partner."""
    plain = [c for c in cells if not c.routed and c is not reference and c.heads]
    return [(routed, other) for routed in cells if routed.routed and routed.heads
            for other in plain if other.heads[0] == routed.heads[0]]


def same_budget_table(cells: Sequence[Cell], reference: Cell | None) -> str | None:
    """Routing against simply having fewer heads: per pair, the headline metric of both and the
    paired, Holm-corrected verdict on every quality metric; None without pairs."""
    return _pair_table(same_budget_pairs(cells, reference), ("routed", "without routing"))


def routing_kind_pairs(cells: Sequence[Cell]) -> list[tuple[Cell, Cell]]:
    """(head-choice cell, token-choice cell) pairs routed alike but for the kind: the same per-layer
    budget and router settings (``Run.routing``)."""
    token_choice = {cell.routing[1]: cell for cell in cells if cell.routing and cell.routing[0] == "token_choice"}
    return [(cell, token_choice[cell.routing[1]]) for cell in cells
            if cell.routing and cell.routing[0] == "head_choice" and cell.routing[1] in token_choice]


def routing_kind_table(cells: Sequence[Cell]) -> str | None:
    """Head choice against token choice at the same budget: per pair, the headline metric of both
    and the paired, Holm-corrected verdict on every quality metric; None without pairs."""
    return _pair_table(routing_kind_pairs(cells), ("head choice", "token choice"))


def _pair_table(pairs: Sequence[tuple[Cell, Cell]], names: tuple[str, str]) -> str | None:
    metrics = quality_metrics(pairs[0][0].task) if pairs else ()
    if not pairs or not metrics:
        return None
    headline, (first, second) = metrics[0], names
    header = [first, second, "active heads", f"{headline.label}, {first}",
              f"{headline.label}, {second}", *(f"{m.label}: {first} vs {second}" for m in metrics)]
    family = paired_family(pairs, metrics)
    rows = []
    for (routed, other), row in zip(pairs, family, strict=True):
        rows.append([
            routed.variant, other.variant, str(routed.heads[0]),
            format_summary(summarize(routed.values(headline.key)), headline.scale, headline.digits),
            format_summary(summarize(other.values(headline.key)), headline.scale, headline.digits),
            *(_cell_text(d, v) for d, v in row),
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


CONTENDED_SHARE = 0.9  # a run whose process got less of its threads' CPU time shared its cores
CONTENDED_MARK = "†"
CONTENDED_NOTE = (f"{CONTENDED_MARK} at least one run of this cell (or of MHA) got less than "
                  f"{CONTENDED_SHARE:.0%} of its threads' CPU time (results.json: cpu_share): it shared its "
                  "cores with other work, so its measured throughput and wall time read low.")


def contended(cell: Cell) -> bool:
    """Whether a run of the cell recorded a CPU share below ``CONTENDED_SHARE``."""
    return any(share < CONTENDED_SHARE for share in cell.values("cpu_share"))


def cost_table(cells: Sequence[Cell], reference: Cell | None) -> str:
    """Parameters, executed and active-head FLOPs (``visattn.utils.flops.active_head_flops``), and measured
    throughput / peak memory as ratios to MHA (mean over seeds); timings of cells with a run that
    shared its cores are marked (``CONTENDED_NOTE`` under the table)."""
    header = [
        "variant",
        "active heads (of MHA)",
        "params",
        "executed FLOPs / image",
        "active-head FLOPs / image",
        "train throughput (× MHA)",
        "inference throughput (× MHA)",
        "peak memory (× MHA)",
        "wall time / run",
    ]
    rows, marked = [], False
    for cell in cells:
        mark = CONTENDED_MARK if contended(cell) or (reference is not None and contended(reference)) else ""
        marked |= bool(mark)
        rows.append(
            [
                cell.variant,
                _heads_text(cell, reference),
                _scaled(_mean(cell, "params"), [(1e9, "G"), (1e6, "M"), (1e3, "k")]),
                _scaled(_mean(cell, "flops_per_image"), FLOP_UNITS),
                _scaled(_mean(cell, "active_head_flops_per_image"), FLOP_UNITS),
                _ratio_text(cell, reference, "train_images_per_s", "img/s") + mark,
                _ratio_text(cell, reference, "eval_images_per_s", "img/s") + mark,
                _ratio_text(cell, reference, "peak_memory_mb", "MB"),
                (DASH if _mean(cell, "wall_time_s") is None else f"{_mean(cell, 'wall_time_s'):.0f} s") + mark,
            ]
        )
    table = markdown_table(header, rows)
    return f"{table}\n\n{CONTENDED_NOTE}" if marked else table


def noise_statement(cells: Sequence[Cell], reference: Cell | None) -> str:
    """Plain sentences: which cells differ from MHA on the headline metric after the correction."""
    metrics = quality_metrics(cells[0].task)
    if reference is None or not metrics:
        return "No MHA baseline among these runs, so no variant is compared with MHA."
    headline = metrics[0]
    verdicts = mha_family(cells, reference, metrics)
    groups: dict[str, list[str]] = {}
    for cell in cells:
        if cell is not reference:
            groups.setdefault(verdicts[cell.variant][0], []).append(cell.variant)
    lines = [f"On {headline.label} (paired by seed with `{reference.variant}`, Holm-corrected over this table):"]
    wording = {
        "better": "better than MHA",
        "worse": "worse than MHA",
        "within noise": "not distinguishable from MHA (the corrected test does not reject: not ranked)",
        "not ranked (n<2)": "not ranked (fewer than 2 seeds shared with MHA)",
        DASH: "not measured",
    }
    for verdict, text in wording.items():
        if groups.get(verdict):
            lines.append(f"- {text}: {', '.join(groups[verdict])}")
    return "\n".join(lines)
