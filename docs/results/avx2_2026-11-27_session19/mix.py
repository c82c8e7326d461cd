"""A model's share of heads that no single layer can hold: e.g. 75% where a layer has 6 heads is half the layers at 4
of 6 and half at 5 of 6, as the released MoH budgets reach a share per layer. From ``bench paths`` runs that timed
both budgets with ``mha`` in the same rounds: per round, the layers' times weighted by their share of the layers,
over ``mha``'s; the median over all runs' rounds and the two-level bootstrap interval of
``visattn.bench.timing.pooled_interval`` (runs, then rounds).

    python docs/results/avx2_2026-11-27_session19/mix.py LOW HIGH WEIGHT_OF_LOW RUN.json [RUN.json ...]
    python docs/results/avx2_2026-11-27_session19/mix.py moh-67 moh-75 0.5 vits_mix_*.json   # ViT-S, 75%
    python docs/results/avx2_2026-11-27_session19/mix.py moh-83 moh-90 0.2 ditb_mix_*.json   # DiT-B/2, 90%

LOW and HIGH are the rows' budget labels (``moh-75`` at 6 heads is 5 of them: the nearest whole number).
"""

import json
import sys

from visattn.bench.timing import paired_ratio, pooled_interval, pooled_ratio


def main(low: str, high: str, weight: float, files: list[str]) -> None:
    runs = [{r["label"]: r["infer_samples_ms"] for r in json.load(open(f))["rows"]} for f in files]
    paths = sorted({label.split(" ", 1)[1] for label in runs[0] if label.startswith(f"{low} ")})
    for path in paths:
        pairs = []
        for rows in runs:
            a, b, ref = rows[f"{low} {path}"], rows[f"{high} {path}"], rows["mha"]
            pairs.append(([weight * x + (1 - weight) * y for x, y in zip(a, b, strict=True)], ref))
        each = ", ".join(f"{paired_ratio(s, r):.3f}" for s, r in pairs)
        lo, hi = pooled_interval(pairs) or (float("nan"), float("nan"))
        print(f"{path:22s} {weight:g} x {low} + {1 - weight:g} x {high} vs mha: {pooled_ratio(pairs):.3f} "
              f"({lo:.3f}-{hi:.3f}); runs: {each}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4:])
