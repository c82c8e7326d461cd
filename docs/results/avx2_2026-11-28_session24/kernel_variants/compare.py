"""A variant of the small-heads kernel against the project's build: every output and gradient equal bit for bit over
eleven shapes and layouts (GQA, 1 to 64 keys, widths 1 to 32, gated or not), then forward and backward times at the
study classifier's layer (256 images x 8 heads x 17 tokens x 12, q/k/v views of one packed projection), without
gates and with 3 of 8 rows attended, interleaved (thread CPU time, 1 thread).

    python compare.py VARIANT.cpp TAG [ROUNDS]
"""

import statistics
import sys
import time

import torch
from build_variant import build

from visattn.kernels import small_attention_op

torch.set_num_threads(1)
assert small_attention_op() is not None, "the project's kernels are not built: python -m visattn.kernels"
new, old = build(sys.argv[1], sys.argv[2]), torch.ops.visattn
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 60


def equal_case(B, N, M, H, Hkv, d, packed, gated, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if packed:
        qkv = torch.randn(B, N, (H + 2 * Hkv) * d, generator=gen)
        q, k, v = qkv.split([H * d, Hkv * d, Hkv * d], -1)
        q, k, v = (t.view(B, N, -1, d).transpose(1, 2) for t in (q, k, v))
    else:
        q = torch.randn(B, H, N, d, generator=gen)
        k, v = torch.randn(B, Hkv, M, d, generator=gen), torch.randn(B, Hkv, M, d, generator=gen)
    gates = (torch.rand(B, N, H, generator=gen) > 0.5).float() * torch.rand(B, N, H, generator=gen) if gated else None
    grad = torch.randn(B, H, N, d, generator=gen)
    same = torch.equal(old.small_attention(q, k, v, d**-0.5, gates), new.small_attention(q, k, v, d**-0.5, gates))
    grads = zip(old.small_attention_backward(grad, q, k, v, d**-0.5, gates),
                new.small_attention_backward(grad, q, k, v, d**-0.5, gates), strict=True)
    return same and all(torch.equal(a, b) for a, b in grads)


cases = [(3, 17, 17, 8, 8, 12, True, False), (3, 17, 17, 8, 8, 12, True, True), (2, 49, 49, 8, 8, 8, True, True),
         (2, 5, 5, 4, 2, 3, False, True), (2, 64, 64, 2, 1, 32, False, False), (2, 9, 20, 6, 3, 20, False, True),
         (4, 1, 1, 2, 2, 1, False, False), (2, 33, 33, 3, 3, 17, True, True), (2, 16, 16, 4, 4, 16, True, False),
         (2, 8, 8, 4, 4, 8, False, True), (2, 24, 40, 4, 2, 28, False, True)]
print("every output and gradient equal bit for bit:", all(equal_case(*case) for case in cases))

B, N, H, d = 256, 17, 8, 12
torch.manual_seed(0)
q, k, v = (t.view(B, N, H, d).transpose(1, 2) for t in torch.randn(B, N, 3 * H * d).split(H * d, -1))
score = torch.rand(B, N, H)
three = (score >= score.topk(3, -1).values[..., -1:]).float() * torch.rand(B, N, H).add(0.1)
grad = torch.randn(B, N, H, d).transpose(1, 2)
calls = {}
for name, ops in (("project", old), ("variant", new)):
    for rows, gates in (("8/8", None), ("3/8", three)):
        calls[f"{name} forward {rows}"] = lambda ops=ops, g=gates: ops.small_attention(q, k, v, d**-0.5, g)
        calls[f"{name} backward {rows}"] = lambda ops=ops, g=gates: ops.small_attention_backward(grad, q, k, v,
                                                                                                 d**-0.5, g)
for call in calls.values():
    call()
times = {label: [] for label in calls}
for _ in range(rounds):
    for label, call in calls.items():
        t0 = time.thread_time()
        call()
        times[label].append(time.thread_time() - t0)
for label in calls:
    ref = label.replace("variant", "project")
    ratio = statistics.median(a / b for a, b in zip(times[label], times[ref], strict=True))
    print(f"{label:20s} {1e3 * statistics.median(times[label]):7.3f} ms  {ratio:.3f} of the project's")
