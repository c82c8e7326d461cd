"""Markdown tables for bench results (rows as ``measure.measure_cases`` gives them)."""

from __future__ import annotations

from typing import Any


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _inverse(ratio: float | None) -> float | None:
    """A time ratio as a throughput ratio (images/s relative to the reference)."""
    return 1.0 / ratio if ratio else None


def ratio_cell(row: dict[str, Any], mode: str, throughput: bool = False) -> str:
    """``row``'s ``{mode}_ratio`` (``infer`` or ``train``) with its 95% interval where the row has one,
    e.g. ``0.931 (0.902-0.958)``; ``throughput``: as images/s relative to the reference (the inverse)."""
    ratio, interval = row.get(f"{mode}_ratio"), row.get(f"{mode}_ratio_ci")
    if throughput:
        ratio = _inverse(ratio)
        interval = [1.0 / interval[1], 1.0 / interval[0]] if interval else None
    if ratio is None:
        return "-"
    return f"{ratio:.3f}" + (f" ({interval[0]:.3f}-{interval[1]:.3f})" if interval else "")


def markdown_table(rows: list[dict[str, Any]], group_key: str) -> str:
    """One table per (``group_key`` value, dtype); skipped rows listed after. Ratios to the reference carry
    their 95% interval in brackets (``timing.ratio_interval``)."""
    out: list[str] = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        if "skipped" in row:
            continue
        groups.setdefault((row[group_key], row["dtype"]), []).append(row)
    images = any("infer_images_per_s" in r for r in rows)
    for (group, dtype), members in groups.items():
        peak = members[0]["matmul_peak_gflops"]
        out.append(f"\n### {group}, {dtype} (matmul peak measured: {peak:.0f} GFLOP/s)\n")
        head = (
            "| variant | active heads | infer ms | infer vs ref | train ms | train vs ref | GFLOP infer "
            "| GFLOP train | % peak infer | % peak train | MiB infer | MiB train |"
        )
        if images:
            head += " img/s infer | img/s train | img/s infer vs ref | img/s train vs ref |"
        out.append(head)
        out.append("|" + "---|" * (head.count("|") - 1))
        for r in members:
            active = r.get("active_heads")
            cells = [
                r["label"],
                f"{active[0]}/{active[1]}" if active else "-",
                _fmt(r.get("infer_ms"), ".2f"),
                ratio_cell(r, "infer"),
                _fmt(r.get("train_ms"), ".2f"),
                ratio_cell(r, "train"),
                _fmt(r.get("infer_flops", 0) / 1e9 if "infer_flops" in r else None, ".4g"),
                _fmt(r.get("train_flops", 0) / 1e9 if "train_flops" in r else None, ".4g"),
                _fmt(100 * r["infer_peak_fraction"] if "infer_peak_fraction" in r else None, ".1f"),
                _fmt(100 * r["train_peak_fraction"] if "train_peak_fraction" in r else None, ".1f"),
                _fmt(r.get("infer_peak_mb"), ".1f"),
                _fmt(r.get("train_peak_mb"), ".1f"),
            ]
            if images:
                cells += [_fmt(r.get("infer_images_per_s"), ".1f"), _fmt(r.get("train_images_per_s"), ".1f"),
                          ratio_cell(r, "infer", throughput=True), ratio_cell(r, "train", throughput=True)]
            out.append("| " + " | ".join(cells) + " |")
    skipped = [r for r in rows if "skipped" in r]
    if skipped:
        out.append("\nSkipped:")
        out += [f"- {r.get(group_key, '')} {r['label']}: {r['skipped']}" for r in skipped]
    return "\n".join(out) + "\n"
