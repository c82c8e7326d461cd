"""Images/s relative to ``mha`` from a ``bench study`` JSON, as the paired ratio (the median of the per-round
ratios, ``visattn.bench.timing.paired_ratio``) with its 95% interval, from the samples the JSON keeps; for runs
made before the benches reported it.

    python docs/results/avx2_2026-11-27_session17/paired.py docs/results/avx2_2026-11-27_session17/study_cls_before.json
"""

import json
import sys

from visattn.bench.timing import paired_ratio, ratio_interval


def main(path: str) -> None:
    rows = [r for r in json.loads(open(path).read())["rows"] if "label" in r]
    reference = rows[0]
    print("| variant | inference images/s vs ref | training images/s vs ref |")
    print("|---|---|---|")
    for row in rows[1:]:
        cells = []
        for mode in ("infer", "train"):
            samples, ref = row.get(f"{mode}_samples_ms"), reference.get(f"{mode}_samples_ms")
            if not samples or not ref:
                cells.append("-")
                continue
            low, high = ratio_interval(samples, ref)  # of the time ratio; images/s is its inverse
            cells.append(f"{1 / paired_ratio(samples, ref):.3f} ({1 / high:.3f}-{1 / low:.3f})")
        print(f"| {row['label']} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main(sys.argv[1])
