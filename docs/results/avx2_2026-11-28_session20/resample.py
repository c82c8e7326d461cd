"""The chance that a probe of k rounds ranks routed_kernel_dense ahead of routed_kernel, resampled (2,000 draws of k
rounds without replacement) from the 81 timed rounds in probe_bias_0.75.json (10 probes of 5 rounds, then 31).

    python resample.py probe_bias_0.75.json
"""

import json
import random
import statistics
import sys

calls = json.load(open(sys.argv[1]))["calls"]
rounds, i = [], 0
for _ in range(10):  # each probe: a first call and a warm-up of each path, then 5 rounds
    i += 6
    for _ in range(5):
        rounds.append({name: t for name, _, t in calls[i : i + 3]})
        i += 3
i += 6
for _ in range(31):
    rounds.append({name: t for name, _, t in calls[i : i + 3]})
    i += 3


def ratio(rs, name):
    return statistics.median(r[name] / r["masked_dense"] for r in rs)


print(
    f"{len(rounds)} rounds:",
    {n: round(ratio(rounds, n), 3) for n in ("routed_kernel", "routed_kernel_dense")},
)
rng = random.Random(1)
for k in (5, 15, 31):
    kernel, dense, wrong = [], [], 0
    for _ in range(2000):
        sample = rng.sample(rounds, k)
        a, b = ratio(sample, "routed_kernel"), ratio(sample, "routed_kernel_dense")
        kernel.append(a)
        dense.append(b)
        wrong += b < a
    lo_hi = lambda v: [round(q, 3) for q in statistics.quantiles(v, n=20)[::18]]  # noqa: E731
    print(
        f"{k} rounds: routed_kernel 5-95% {lo_hi(kernel)}, routed_kernel_dense {lo_hi(dense)}, "
        f"ranked wrongly {wrong / 2000:.1%}"
    )
