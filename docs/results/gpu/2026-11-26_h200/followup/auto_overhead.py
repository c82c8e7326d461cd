# Diagnostic: MoH impl=auto vs its masked dense path on CUDA, timed alone (not interleaved with other paths).
import statistics, sys, time, torch
from visattn.attention import build_attention
dev = torch.device("cuda")
x = torch.randn(32, 197, 384, device=dev)
mods = {i: build_attention("moh", 384, num_heads=6, shared_heads=1, routed_topk=2, impl=i).to(dev).eval()
        for i in ("masked_dense", "auto", "sparse_projections")}
def block(m, n=100):
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n):
        m(x); torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3
with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
    for m in mods.values():
        for _ in range(20): m(x)
    alone = {k: statistics.median(block(mods[k]) for _ in range(7)) for k in ("masked_dense", "auto")}
    print("alone, ms/call (sync each):", {k: round(v, 4) for k, v in alone.items()})
    after = {"masked_dense": [], "auto": []}
    for _ in range(50):
        for k in after:
            mods["sparse_projections"](x); torch.cuda.synchronize()
            t = time.perf_counter(); mods[k](x); torch.cuda.synchronize(); after[k].append(time.perf_counter() - t)
    print("each right after a sparse_projections call, ms:", {k: round(1e3 * statistics.median(v), 4) for k, v in after.items()})
    m = mods["auto"]; torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(2000): m.choose_path(x)
    print("choose_path, us:", round((time.perf_counter() - t) / 2000 * 1e6, 2))
