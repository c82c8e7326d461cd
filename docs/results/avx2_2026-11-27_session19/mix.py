"""A model's share of heads that no single layer can hold (75% of 6-head layers: half at 4 of 6, half at 5 of 6),
from ``bench paths`` runs taken without ``--layer-mix`` that timed both budgets: adds the rows ``--layer-mix`` would
(``visattn.bench.paths.mix_rows``) to each run, then pools the runs as ``bench pool`` does.

    python docs/results/avx2_2026-11-27_session19/mix.py LOW HIGH WEIGHT_OF_LOW RUN.json [RUN.json ...]
    python docs/results/avx2_2026-11-27_session19/mix.py moh-67 moh-75 0.5 vits_mix_*.json   # ViT-S, 75%
    python docs/results/avx2_2026-11-27_session19/mix.py moh-83 moh-90 0.2 ditb_mix_*.json   # DiT-B/2, 90%

LOW and HIGH are the rows' budget labels (``moh-75`` at 6 heads is 5 of them: the nearest whole number).
"""

import json
import sys

from visattn.bench.paths import LayerMix, mix_rows
from visattn.bench.pool import pool_runs, pool_table


def main(low: str, high: str, weight: float, files: list[str]) -> None:
    results = [json.load(open(f)) for f in files]
    mix = LayerMix(f"{high}mix", low, high, weight, active=float("nan"))  # rows f"{high}mix <path>"
    for result in results:
        rows = [r for r in result["rows"] if "skipped" not in r]
        result["rows"] = rows + [{"shape": rows[0]["shape"], **r} for r in mix_rows(rows, [mix])]
    pooled = [r for r in pool_runs(results, files) if r["label"] == "mha" or r["label"].startswith(mix.label)]
    print(f"{weight:g} x {low} + {1 - weight:g} x {high}", pool_table(pooled))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4:])
