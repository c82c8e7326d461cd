"""The benchmark harness end to end on tiny shapes (no timing assertions)."""

import json
import types

import numpy as np
import pytest
import torch

from visattn.attention.moh import PATHS, TRAIN_PATHS
from visattn.bench import attention_cases, moh_budget
from visattn.bench.__main__ import main
from visattn.bench.attention import Shape
from visattn.bench.memory import call_peak_mb, peak_memory_available
from visattn.utils.machine import cpu_model, usable_cores


def test_attention_mode_writes_json_and_table(tmp_path, capsys):
    out = tmp_path / "bench.json"
    main(
        [
            "attention",
            "--shapes",
            "2,5,16,4",
            "--variants",
            "mha",
            "moh",
            "gqa",
            "--budgets",
            "0.5",
            "--dtypes",
            "fp32",
            "bf16",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--out",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    rows = data["rows"]
    labels = [r["label"] for r in rows if r["dtype"] == "fp32"]
    assert labels == ["mha", "moh-50", "moh-50-masked", "gqa"]
    by = {(r["label"], r["dtype"]): r for r in rows}
    assert by[("mha", "fp32")]["infer_ratio"] == 1.0 and by[("mha", "bf16")]["train_ratio"] == 1.0
    assert by[("moh-50", "fp32")]["active_heads"] == [2, 4]
    assert "train_ms" not in by[("moh-50-masked", "fp32")]  # its training step is moh-50's
    # mha: qkv + proj + attention core, in closed form
    B, N, C = 2, 5, 16
    assert by[("mha", "fp32")]["infer_flops"] == 2 * B * N * C * 4 * C + 4 * B * N * N * C
    assert by[("moh-50", "fp32")]["infer_flops"] < by[("moh-50-masked", "fp32")]["infer_flops"]
    assert all(r["infer_ms"] > 0 and r["matmul_peak_gflops"] > 0 for r in rows)
    assert "| moh-50 | 2/4 |" in capsys.readouterr().out


def test_model_mode_runs_a_tiny_vit(tmp_path, capsys, monkeypatch):
    import visattn.attention.fused_gating as fused_gating

    seen = []  # whether each forward's routing found the kernels on
    real = fused_gating.moh_routing_op
    monkeypatch.setattr(fused_gating, "moh_routing_op", lambda: seen.append(real() is not None) or real())
    out = tmp_path / "models.json"
    main(
        [
            "model",
            "--presets",
            "vit_digits",
            "--attns",
            "mha",
            "moh-50",
            "--batch",
            "2",
            "--dtypes",
            "fp32",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--no-memory",
            "--compare-kernels",
            "--out",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["rows"]
    # the last two with the kernels off (mha's small heads may run the kernels' attention)
    assert [r["label"] for r in rows] == ["mha", "moh-50", "mha pytorch", "moh-50 pytorch"]
    assert rows[1]["active_heads"] == rows[3]["active_heads"] == [24, 48]  # 6 layers of 8 heads, 4 active
    if real() is not None:
        assert True in seen and False in seen
    assert all(r["infer_images_per_s"] > 0 and r["train_images_per_s"] > 0 for r in rows)
    assert "vit_digits" in capsys.readouterr().out


def test_model_mode_compiled_counts_flops_eagerly_and_refuses_a_missing_gpu(tmp_path, capsys):
    out = tmp_path / "compiled.json"
    args = ["model", "--presets", "vit_digits", "--attns", "mha", "--batch", "2", "--dtypes", "fp32", "--warmup", "1",
            "--repeats", "1", "--threads", "1", "--no-memory", "--no-train"]
    main([*args, "--out", str(tmp_path / "eager.json")])
    main([*args, "--compile", "--device", "cpu", "--out", str(out)])
    eager, compiled = (json.loads((tmp_path / f).read_text()) for f in ("eager.json", "compiled.json"))
    assert compiled["rows"][0]["infer_flops"] == eager["rows"][0]["infer_flops"] > 0
    assert compiled["meta"]["device"].startswith("cpu: ")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device cuda: torch sees no CUDA device"):
            main([*args, "--device", "cuda"])


def test_moh_budget_and_cases():
    assert moh_budget(6, 0.5) == (1, 2)
    assert moh_budget(12, 0.75) == (6, 3)
    assert moh_budget(12, 0.9) == (6, 5)
    assert moh_budget(4, 1.0) == (4, 0)
    for heads in range(1, 17):
        for fraction in (0.1, 0.5, 0.75, 0.9):
            shared, topk = moh_budget(heads, fraction)
            assert 1 <= shared + topk <= heads and (topk == 0) == (shared == heads)
    with pytest.raises(ValueError, match="budget 1.5"):
        moh_budget(6, 1.5)
    with pytest.raises(ValueError, match="unknown attention 'nope'"):
        attention_cases(6, ["nope"], [0.5])
    with pytest.raises(ValueError, match="batch,tokens,dim,heads"):
        Shape.parse("32,197,384")


@pytest.mark.skipif(not peak_memory_available(), reason="needs Linux's /proc/self/clear_refs")
def test_call_peak_sees_a_large_allocation():
    mib = call_peak_mb(lambda: torch.ones(64 * 2**20 // 4).add_(1))
    assert 60 < mib < 200


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peak_probe_is_sized_by_time_not_shape(dtype):
    # bf16 is emulated (~20x slower than fp32) on AVX2-only CPUs: a fixed 2048^2 product took minutes
    # there; the time-sized probe costs about the same on every CPU.
    import time

    from visattn.bench.timing import matmul_peak_flops

    start = time.perf_counter()
    flops = matmul_peak_flops(dtype, budget_s=0.02)
    assert flops > 0 and time.perf_counter() - start < 2.0
    with pytest.raises(ValueError, match="budget_s=0"):
        matmul_peak_flops(dtype, budget_s=0)


def test_results_record_the_cpu_model_not_just_the_architecture(tmp_path, capsys):
    # Timings mean nothing without the machine: the JSON names the CPU model (as /proc/cpuinfo does)
    # and its usable cores, and the printed table says which machine it was measured on.
    out = tmp_path / "bench.json"
    argv = ["attention", "--shapes", "1,3,8,2", "--variants", "mha", "--dtypes", "fp32", "--warmup", "0"]
    main([*argv, "--repeats", "1", "--threads", "1", "--no-train", "--no-memory", "--out", str(out)])
    meta = json.loads(out.read_text())["meta"]
    assert meta["cpu"] == cpu_model()
    assert meta["cores"] == usable_cores()
    assert f"Machine: {cpu_model()}" in capsys.readouterr().out


@pytest.mark.parametrize(("flag", "value"), [("--repeats", "0"), ("--threads", "0"), ("--warmup", "-1"), ("--repeats", "x")])
def test_cli_refuses_counts_out_of_range_with_a_usage_error(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["attention", "--shapes", "2,5,16,4", flag, value])
    assert exit_info.value.code == 2  # argparse's usage error, not a traceback from inside the bench
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and ("is below" in err or "is not an integer" in err)


def test_study_mode_times_the_studys_own_models(tmp_path, capsys):
    """Both tasks' models as the study builds them (its configs, cell budgets), inference and an
    optimizer step, with the path each layer's inference took and the throughput ratios printed."""
    out = tmp_path / "study.json"
    main(["study", "--tasks", "cls", "dit", "--cells", "mha", "moh-50", "--batch", "2", "--warmup", "0",
          "--repeats", "1", "--threads", "1", "--clock", "cpu", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    by = {(r["preset"], r["label"]): r for r in rows}
    assert set(by) == {(f"study-{t}", c) for t in ("cls", "dit") for c in ("mha", "moh-50")}
    for task in ("cls", "dit"):
        mha, moh = by[(f"study-{task}", "mha")], by[(f"study-{task}", "moh-50")]
        assert mha["active_heads"] == [48, 48] and moh["active_heads"] == [24, 48]  # conf/study/cells.yaml
        assert mha["infer_ratio"] == 1.0 and mha["train_ratio"] == 1.0
        assert moh["train_images_per_s"] == pytest.approx(2 / (moh["train_ms"] / 1e3))
        assert len(moh["paths"]) == 6 and all(p in PATHS for p in moh["paths"])  # auto's choices, per layer
        # the study trains with train.attn_paths=probe: each MoH layer on what its start-up probe chose
        assert len(moh["train_paths"]) == 6 and set(moh["train_paths"]) <= set(TRAIN_PATHS)
        assert mha["train_paths"] == ["dense"] * 6
    text = capsys.readouterr().out
    assert "### study-dit, fp32" in text and "img/s infer vs ref" in text


def test_a_study_workload_steps_its_optimizer():
    from visattn.bench.study import build_study_workload

    work = build_study_workload("cls", "moh-75", batch=2)
    before = {n: p.detach().clone() for n, p in work.module.named_parameters()}
    work.module.train()
    work.train_step("fp32")
    moved = [n for n, p in work.module.named_parameters() if not torch.equal(p, before[n])]
    assert any(".router." in n for n in moved) and any(".qkv." in n for n in moved)


def test_a_gpu_bench_neither_probes_nor_builds_the_cpu_kernels(monkeypatch):
    """On a GPU the CPU kernels do not run: a bench there must not build them (minutes on first use) nor time
    the CPU training paths."""
    import visattn.attention as attention
    from visattn.attention import build_attention
    from visattn.bench.paths import MHAOnKernelParts
    from visattn.bench.study import build_study_workload

    def refuse(*args, **kwargs):
        raise AssertionError("called for a GPU bench")

    monkeypatch.setattr(attention, "choose_train_paths", refuse)
    monkeypatch.setattr("visattn.bench.paths.moh_routed_attention_op", refuse)
    build_study_workload("cls", "moh-75", batch=2, device="cuda")
    with pytest.raises(AssertionError, match="GPU bench"):  # the probe does run for a CPU bench
        build_study_workload("cls", "moh-75", batch=2, device="cpu")
    parts = MHAOnKernelParts(build_attention("mha", 32, num_heads=4).to("meta"))
    with torch.no_grad():
        assert parts(torch.empty(2, 5, 32, device="meta")).shape == (2, 5, 32)  # not a CPU tensor: mha itself


def test_study_mode_compares_each_cell_with_the_kernels_off(tmp_path, monkeypatch):
    """'<cell> pytorch' rows: the same model, timed in the same rounds, with visattn.kernels off."""
    import visattn.attention.fused_gating as fused_gating

    seen = []
    real = fused_gating.moh_routing_op
    monkeypatch.setattr(fused_gating, "moh_routing_op", lambda: seen.append(real() is not None) or real())
    out = tmp_path / "study.json"
    main(["study", "--tasks", "cls", "--cells", "mha", "moh-50", "--batch", "2", "--warmup", "0", "--repeats", "1",
          "--threads", "1", "--no-train", "--compare-kernels", "--out", str(out)])
    rows = {r["label"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["mha", "moh-50", "mha pytorch", "moh-50 pytorch"]
    # The same model. Executed FLOPs count the PyTorch equivalent of each path (the FLOP counter sees no
    # compiled op), so they match where both rows took the same paths; a compiled path skips work.
    on, off = rows["moh-50"], rows["moh-50 pytorch"]
    assert 0 < on["infer_flops"] <= off["infer_flops"]
    if on["paths"] == off["paths"]:
        assert off["infer_flops"] < 1.01 * on["infer_flops"]
    assert False in seen  # the pytorch row's forwards ran with the kernels off
    from visattn import kernels

    with kernels.disabled():
        assert kernels.moh_routing_op() is None


def test_study_mode_times_each_cell_again_with_a_named_moh_impl(tmp_path):
    """'<cell> <impl>' rows: the same model with its MoH layers set to the impl where they have it,
    trained on it."""
    out = tmp_path / "study.json"
    main(["study", "--tasks", "cls", "--cells", "mha", "moh-50", "--batch", "2", "--warmup", "0", "--repeats", "1",
          "--threads", "1", "--moh-impl", "sparse", "--out", str(out)])
    rows = {r["label"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["mha", "moh-50", "moh-50 sparse"]
    assert rows["moh-50 sparse"]["train_ms"] > 0
    assert all(p != "masked_dense" for p in rows["moh-50 sparse"]["paths"])  # every study layer routes
    assert all(p != "masked_dense" for p in rows["moh-50 sparse"]["train_paths"])


def test_interleaved_rounds_call_every_function_once_in_orders_that_change():
    """Each round is a permutation of the functions (a fixed order biased whoever followed a heavy
    path), drawn from the seed: two runs time the same orders."""
    from visattn.bench.timing import interleaved_times

    def orders(seed):
        calls = []
        fns = {name: (lambda name=name: calls.append(name)) for name in "abcde"}
        times = interleaved_times(fns, warmup=1, repeats=6, seed=seed)
        assert all(len(t) == 6 for t in times.values())
        assert calls[:5] == list("abcde")  # the warm-up round
        rounds = [calls[5 + 5 * i : 10 + 5 * i] for i in range(6)]
        assert all(sorted(r) == list("abcde") for r in rounds)
        return rounds

    rounds = orders(0)
    assert len({tuple(r) for r in rounds}) > 1 and {r[0] for r in rounds} != {"a"}
    assert orders(0) == rounds and orders(1) != rounds


def test_the_ratio_interval_pairs_rounds_and_covers_the_measured_ratio():
    """What a round shares (a neighbour's load) cancels in the interval, as it does in the ratio: a variant
    always 0.9x the reference in its round gets a tight interval, however much the rounds differ; the same
    timings with their rounds scrambled do not."""
    from visattn.bench.timing import ratio_interval

    gen = torch.Generator().manual_seed(0)
    load = (1 + torch.rand(41, generator=gen)).tolist()  # per round: 1x to 2x slower
    variant = [0.9 * t for t in load]
    low, high = ratio_interval(variant, load)
    assert 0.9 - 1e-9 < low <= high < 0.9 + 1e-9
    scrambled = variant[20:] + variant[:20]
    low, high = ratio_interval(scrambled, load)
    assert low < 0.85 and high > 0.95
    noisy = [t * (1 + 0.2 * (float(u) - 0.5)) for t, u in zip(variant, torch.rand(41, generator=gen), strict=True)]
    low, high = ratio_interval(noisy, load)
    assert low < 0.9 < high and high - low < 0.1
    assert ratio_interval(variant[:4], load[:4]) is None  # too few rounds
    assert ratio_interval(variant, load[:-1]) is None  # not one sample per round
    for rounds in (41, 3):  # refused before anything is computed, with or without enough rounds
        with pytest.raises(ValueError, match="confidence=95"):
            ratio_interval(variant[:rounds], load[:rounds], confidence=95)


def test_the_reported_ratio_is_the_median_of_the_rounds_ratios_which_drift_does_not_move():
    """A machine that drifts between 1x and 3x speed: the variant is 0.9x the reference in every round but one in
    five (1.2x there). The paired ratio is 0.9 with a tight interval; the ratio of the two medians, which draws
    them from whichever rounds they fall in, gets a bootstrap interval from 0.9 to 1.2."""
    from visattn.bench.timing import paired_ratio, ratio_interval

    gen = np.random.default_rng(0)
    load = np.concatenate([np.full(20, 1.0), np.full(21, 3.0)]) * (1 + 0.05 * gen.random(41))
    per_round = np.where(np.arange(41) % 5 == 0, 1.2, 0.9)
    variant = (load * per_round).tolist()
    reference = load.tolist()
    assert paired_ratio(variant, reference) == pytest.approx(0.9)
    low, high = ratio_interval(variant, reference)
    assert 0.9 - 1e-9 < low <= 0.9 <= high < 0.95
    rounds = gen.integers(0, 41, size=(2000, 41))
    unpaired = np.median(np.asarray(variant)[rounds], 1) / np.median(np.asarray(reference)[rounds], 1)
    assert np.quantile(unpaired, 0.975) - np.quantile(unpaired, 0.025) > 5 * (high - low + 0.01)
    with pytest.raises(ValueError, match="3 samples against 2 reference samples"):
        paired_ratio([1.0, 2.0, 3.0], [1.0, 2.0])


def test_the_pooled_interval_covers_a_change_of_the_machine_between_runs():
    """Two runs whose machines differed: the variant 0.95x the reference in every round of one, 1.00x in the
    other. Each run's own interval is tight around its ratio and excludes the other's; the pooled interval
    (runs, then rounds, resampled) spans both. Two runs that agree keep a tight pooled interval."""
    from visattn.bench.timing import pooled_interval, pooled_ratio, ratio_interval

    gen = np.random.default_rng(0)
    load = [(1 + gen.random(41)).tolist() for _ in range(2)]
    noise = [1 + 0.01 * (gen.random(41) - 0.5) for _ in range(2)]
    slower = [(np.asarray(load[0]) * 0.95 * noise[0]).tolist(), (np.asarray(load[1]) * 1.00 * noise[1]).tolist()]
    runs = list(zip(slower, load, strict=True))
    for (samples, reference), ratio in zip(runs, (0.95, 1.00), strict=True):
        low, high = ratio_interval(samples, reference)
        assert ratio - 0.006 < low <= high < ratio + 0.006
    low, high = pooled_interval(runs)
    assert low < 0.955 and high > 0.995
    assert 0.95 < pooled_ratio(runs) < 1.0
    agree = [runs[0], runs[0]]
    low, high = pooled_interval(agree)
    assert 0.944 < low <= high < 0.956
    assert pooled_interval([(s[:4], r[:4]) for s, r in runs]) is None  # too few rounds
    with pytest.raises(ValueError, match="40 samples against 41 reference samples"):
        pooled_ratio([(slower[0][:40], load[0])])
    with pytest.raises(ValueError, match="no runs to pool"):
        pooled_interval([])


def _bench_json(cpu: str, ratios: dict[str, float], rounds: int = 6) -> dict:
    """A bench's --out JSON with rows timed at fixed ratios to ``mha`` (the first row)."""
    ref = [10.0 + i for i in range(rounds)]
    rows = [{"shape": "s", "dtype": "fp32", "label": label, "infer_samples_ms": [r * t for t in ref],
             **({"auto_path": "routed_kernel"} if label.endswith("auto") else {})} for label, r in ratios.items()]
    meta = {"mode": "paths", "cpu": cpu, "torch": "2.x", "threads": 1, "clock": "cpu", "device": f"cpu: {cpu}"}
    return {"meta": meta, "rows": rows}


def test_bench_pool_reports_each_run_and_the_pooled_ratio(tmp_path, capsys):
    runs = [_bench_json("EPYC", {"mha": 1.0, "moh-50 auto": r, "moh-50 masked_dense": 1.0}) for r in (0.8, 0.9)]
    paths = []
    for i, run in enumerate(runs):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run))
    out = tmp_path / "pooled.json"
    main(["pool", *map(str, paths), "--out", str(out)])
    printed = capsys.readouterr().out
    assert printed.startswith("Pooled 2 runs of `paths` on cpu: EPYC")
    assert "| moh-50 auto -> routed_kernel / routed_kernel | 2 | 0.800 / 0.900 | 0.850 (0.800-0.900) |" in printed
    pooled = json.loads(out.read_text())
    assert pooled["meta"]["runs"] == list(map(str, paths)) and pooled["meta"]["pooled_mode"] == "paths"
    by = {r["label"]: r for r in pooled["rows"]}
    assert by["mha"]["infer_ratio"] == 1.0 and by["mha"]["infer_ratio_ci"] is None
    assert by["moh-50 auto"]["infer_run_ratios"] == pytest.approx([0.8, 0.9])


def test_bench_pool_refuses_runs_it_cannot_pool(tmp_path):
    good, other = tmp_path / "a.json", tmp_path / "b.json"
    good.write_text(json.dumps(_bench_json("EPYC", {"mha": 1.0, "moh": 0.9})))
    other.write_text(json.dumps(_bench_json("Xeon", {"mha": 1.0, "moh": 0.9})))
    with pytest.raises(SystemExit, match=r"b.json: cpu='Xeon' but .*a.json has cpu='EPYC'; pool runs of one command"):
        main(["pool", str(good), str(other)])
    with pytest.raises(SystemExit, match="at least two runs"):
        main(["pool", str(good)])
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SystemExit, match=r"cannot read .*bad.json .*give the JSON files a bench wrote with --out"):
        main(["pool", str(good), str(tmp_path / "bad.json")])


def test_tables_print_each_ratio_with_its_interval_and_images_per_s_inverts_it():
    from visattn.bench.report import markdown_table, ratio_cell

    row = {"label": "moh-50", "dtype": "fp32", "infer_ratio": 0.8, "infer_ratio_ci": [0.75, 0.85], "train_ratio": 1.1,
           "train_ratio_ci": None}
    assert ratio_cell(row, "infer") == "0.800 (0.750-0.850)"
    assert ratio_cell(row, "infer", throughput=True) == "1.250 (1.176-1.333)"
    assert ratio_cell(row, "train") == "1.100"
    assert ratio_cell({"label": "x"}, "train") == "-"
    table = markdown_table([{**row, "shape": "s", "infer_ms": 1.0, "matmul_peak_gflops": 10.0}], "shape")
    assert "| 0.800 (0.750-0.850) |" in table


def test_measured_rows_carry_the_interval_of_every_ratio_but_the_references():
    from visattn.bench.measure import measure_cases
    from visattn.bench.timing import ratio_interval
    from visattn.bench.workload import Workload

    def build(scale):
        layer = torch.nn.Linear(8, 8 * scale)
        return Workload(layer, (torch.randn(4, 8),))

    case = types.SimpleNamespace(train=False)
    cases = {label: (case, (scale,)) for label, scale in (("one", 1), ("four", 4))}
    rows = measure_cases(cases, build, ["fp32"], warmup=0, repeats=6, train=False, memory=False)
    by = {r["label"]: r for r in rows}
    assert by["one"]["infer_ratio_ci"] is None
    # the interval of the row's own samples against the reference's, round by round
    samples, reference = by["four"]["infer_samples_ms"], by["one"]["infer_samples_ms"]
    assert len(samples) == len(reference) == 6
    assert by["four"]["infer_ratio_ci"] == pytest.approx(list(ratio_interval(samples, reference)), rel=1e-9)
    assert by["four"]["infer_ratio"] == pytest.approx(float(np.median(np.divide(samples, reference))), rel=1e-12)
