"""The benchmark report on synthetic run directories: statistics, honesty rules, tables, plots."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest

from visattn.report import compare, group_cells, load_run, summarize, write_report
from visattn.report.__main__ import main as report_main
from visattn.report.runs import find_run_dirs, reference_cell
from visattn.report.stats import PairedDifference, holm, intervals_overlap, paired_difference, paired_verdicts

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CLASSES = ["T-shirt", "Trouser", "Pullover"]


def make_run(root: Path, task: str, cell: str, seed: int, heads: tuple[int, int], metrics: dict,
             routed: bool = False, **extra) -> Path:
    run = root / task / cell / f"seed{seed}"
    run.mkdir(parents=True)
    results = {
        "task": task, "attn": cell.split("-")[0], "seed": seed, "active_heads": list(heads),
        "active_ratio": heads[0] / heads[1], "params": 1_234_567, "flops_per_image": 2.5e8,
        "train_images_per_s": 400.0 + seed, "eval_images_per_s": 1500.0 - 10 * seed,
        "peak_memory_mb": 300.0, "wall_time_s": 60.0, "config": {"attn": {"name": cell.split("-")[0]}},
        **metrics, **extra,
    }
    (run / "results.json").write_text(json.dumps(results))
    (run / "cell.json").write_text(json.dumps({
        "cell": cell, "profile": "full", "command": f"python train_{task}.py seed={seed}",
        "machine": {"cpu": "Test CPU", "cores": 2, "torch": "2.x"}, "load_average": [0.5, 1.5 + seed],
    }))
    with (run / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["step", "epoch", "loss", "aux_loss", "lr", "top1"])
        writer.writeheader()
        for epoch in range(3):
            writer.writerow({"step": 10 * (epoch + 1), "epoch": epoch, "loss": 2.0 / (epoch + 1),
                             "aux_loss": "", "lr": 1e-3, "top1": 0.5 + 0.1 * epoch})
    if routed:
        layers, head_counts = 2, [4, 4]
        load = [[[0.25 * ((c + h + layer) % 4) for h in range(head_counts[layer])] for c in range(len(CLASSES))]
                for layer in range(layers)]
        (run / "head_load.json").write_text(json.dumps(
            {"classes": CLASSES, "layers": layers, "heads": head_counts, "load": load}))
    return run


@pytest.fixture()
def study_dirs(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    for seed, top1 in enumerate([0.850, 0.852, 0.848]):
        make_run(root, "cls", "mha", seed, (8, 8), {"top1": top1, "top5": 0.99, "top1_best": top1})
    # Mean above MHA's, but the intervals overlap: must read "within noise", never "better".
    for seed, top1 in enumerate([0.840, 0.870, 0.855]):
        make_run(root, "cls", "moh-75", seed, (6, 8), {"top1": top1, "top5": 0.99, "top1_best": top1}, routed=True)
    for seed, top1 in enumerate([0.700, 0.703, 0.698]):
        make_run(root, "cls", "relu", seed, (8, 8), {"top1": top1, "top5": 0.95, "top1_best": top1})
    make_run(root, "cls", "mqa", 0, (8, 8), {"top1": 0.95, "top5": 0.99, "top1_best": 0.95})
    gen = {"precision": 0.6, "recall": 0.5, "is": 5.0, "num_samples": 500, "extractor": "fashion_mnist"}
    for seed, fid in enumerate([30.0, 31.0, 29.0]):
        make_run(root, "dit", "mha", seed, (8, 8), {"fid": fid, "sfid": 20.0, **gen})
    for seed, fid in enumerate([20.0, 21.0, 19.5]):  # lower FID, disjoint intervals: better
        run = make_run(root, "dit", "moh-90", seed, (7, 8), {"fid": fid, "sfid": 15.0, **gen}, routed=True)
        (run / "samples.png").write_bytes(PNG_MAGIC)
    return root


def test_summary_matches_student_t() -> None:
    s = summarize([1.0, 2.0, 3.0])
    assert (s.n, s.mean, s.std) == (3, 2.0, 1.0)
    half = 4.302652729911275 / math.sqrt(3)  # t_{0.975, df=2}
    assert s.low == pytest.approx(2.0 - half) and s.high == pytest.approx(2.0 + half)
    one = summarize([0.5])
    assert one.n == 1 and one.low is None and not one.has_interval
    assert summarize([]) is None


def test_overlapping_intervals_are_never_ranked() -> None:
    ref = summarize([0.850, 0.852, 0.848])
    higher_mean_but_noisy = summarize([0.840, 0.870, 0.855])
    assert higher_mean_but_noisy.mean > ref.mean and intervals_overlap(higher_mean_but_noisy, ref)
    assert compare(higher_mean_but_noisy, ref, higher_is_better=True) == "within noise"
    assert compare(summarize([0.90, 0.901, 0.902]), ref, higher_is_better=True) == "better"
    assert compare(summarize([0.70, 0.701, 0.702]), ref, higher_is_better=True) == "worse"
    # Lower is better (FID): a clearly lower FID is better, not worse.
    assert compare(summarize([10.0, 10.5, 11.0]), summarize([30.0, 31.0, 29.0]), higher_is_better=False) == "better"
    assert compare(summarize([0.95]), ref, higher_is_better=True) == "not ranked (n<2)"
    assert compare(None, ref, higher_is_better=True) == "—"


def test_paired_difference_hand_computed() -> None:
    # d = 1, 1.5, 3: mean 11/6, sd sqrt(13/12), t = 3.051 on 2 df -> p = 0.0927; t_0.975,2 = 4.3027
    diff = paired_difference({0: 1.0, 1: 2.0, 2: 4.0, 3: 9.0}, {0: 0.0, 1: 0.5, 2: 1.0})  # seed 3 unpaired
    assert diff.n == 3 and diff.mean == pytest.approx(11 / 6)
    half = 4.302653 * math.sqrt(13 / 12) / math.sqrt(3)
    assert diff.low == pytest.approx(11 / 6 - half, rel=1e-5) and diff.high == pytest.approx(11 / 6 + half, rel=1e-5)
    assert diff.p_value == pytest.approx(0.09274, abs=1e-4)
    assert paired_difference({0: 1.0}, {1: 1.0}) is None
    assert paired_difference({0: 2.0}, {0: 1.0}).p_value is None  # one shared seed: no test
    assert paired_difference({0: 2.0, 1: 3.0}, {0: 1.0, 1: 2.0}).p_value is None  # no spread: no test


def test_holm_step_down_hand_computed() -> None:
    # sorted 0.005 <= 0.05/4, 0.01 <= 0.05/3, 0.03 > 0.05/2: stop, so 0.03 and 0.04 are kept
    assert holm([0.01, 0.04, 0.03, 0.005]) == [True, False, False, True]
    assert holm([0.01, 0.04]) == [True, True]  # 0.01 <= 0.025, 0.04 <= 0.05
    assert holm([0.03, 0.04]) == [False, False]  # each < 0.05 alone, but not after the correction
    assert holm([None, 0.001]) == [None, True]


def test_verdicts_only_where_the_corrected_test_rejects() -> None:
    def diff(mean, p):
        return PairedDifference(3, mean, mean - 1, mean + 1, p)

    verdicts = paired_verdicts([diff(-2.0, 0.001), diff(1.0, 0.03), diff(1.0, 0.04), None,
                                PairedDifference(1, 5.0, None, None, None)], [True, True, True, True, True])
    assert verdicts == ["worse", "within noise", "within noise", "—", "not ranked (n<2)"]
    assert paired_verdicts([diff(-2.0, 0.001)], [False]) == ["better"]  # lower FID is better


def test_cells_group_seeds_and_find_the_mha_reference(study_dirs: Path) -> None:
    cells = group_cells(load_run(p) for p in find_run_dirs([study_dirs]))
    keys = {cell.key: len(cell.runs) for cell in cells}
    assert keys[("cls", "moh-75", "6/8")] == 3 and keys[("cls", "mqa", "8/8")] == 1
    assert reference_cell(cells, "dit").variant == "mha"


def test_report_tables_verdicts_and_plots(study_dirs: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    report = write_report([study_dirs], out)
    text = report.read_text()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    comparison = [line for line in text.splitlines() if line.startswith("| moh-75 |") and "within noise" in line]
    assert comparison, "overlapping intervals must read 'within noise'"
    assert not any("| better" in line for line in text.splitlines() if line.startswith("| moh-75 |"))
    assert any(line.startswith("| relu |") and "| worse" in line for line in text.splitlines())
    assert any(line.startswith("| moh-90 |") and "| better" in line for line in text.splitlines())
    assert "n=1, no interval" in text and "not ranked (n<2)" in text
    assert "85.00 ± 0.20 [84.50, 85.50]" in text  # mha top-1: mean ± std [95% t-interval], in percent
    assert "fashion_mnist / 500" in text  # the extractor is named with the sample count
    assert "Test CPU (2 usable cores)" in text and "python train_cls.py seed=0" in text
    assert "load average at the start and end of the runs: 0.5 to 3.5" in text
    assert "wall time, summed: 0.27 h (16.0 min) over 16 runs" in text  # 16 runs of 60 s
    assert "1.00× (1490 img/s)" in text  # MHA's own inference throughput ratio
    assert "mha" in rows
    # The generation section links each cell's first-seed sample grid, relative to the report.
    assert "![moh-90 samples](../runs/dit/moh-90/seed0/samples.png)" in text
    assert "mha samples" not in text  # its runs left no grid: nothing is shown for it
    expected = [
        "cls_top1_vs_active_heads.png", "cls_top1_vs_throughput.png", "cls_training_curves.png",
        "cls_head_load_moh-75_6-8.png", "dit_fid_vs_active_heads.png", "dit_fid_vs_throughput.png",
        "dit_training_curves.png", "dit_head_load_moh-90_7-8.png",
    ]
    for name in expected:
        path = out / name
        assert path.is_file() and path.read_bytes()[:8] == PNG_MAGIC, name
        assert f"]({name})" in text, f"{name} not linked from REPORT.md"


def test_routing_is_compared_with_fewer_heads_at_the_same_budget(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    for seed in range(3):
        make_run(root, "cls", "mha", seed, (8, 8), {"top1": 0.85 + 0.001 * seed})
        make_run(root, "cls", "moh-50", seed, (4, 8), {"top1": 0.84 + 0.0012 * seed}, routed=True)
        make_run(root, "cls", "mha-fewer-heads-50", seed, (4, 4), {"top1": 0.80 + 0.001 * seed})
        make_run(root, "cls", "moh-90", seed, (7, 8), {"top1": 0.85 + 0.001 * seed}, routed=True)  # no partner
    text = write_report([root], tmp_path / "out").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| moh-50 | mha-fewer-heads-50 | 4 |")]
    assert len(rows) == 1 and rows[0].split("|")[6].strip().startswith("better: +4.02"), rows  # the top-1 verdict
    assert not any(line.startswith("| moh-90 | mha") for line in text.splitlines())  # MHA is not a partner


def test_head_choice_is_compared_with_token_choice_routed_alike(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    budget = {"shared_heads": [2, 2], "routed_topk": [1, 2]}

    def config(name: str, **attn) -> dict:
        return {"config": {"attn": {"name": name, "two_stage": None, **attn}, "budget": {"name": "none", **budget}}}

    for seed in range(3):
        make_run(root, "cls", "mha", seed, (8, 8), {"top1": 0.85 + 0.001 * seed})
        make_run(root, "cls", "moh-50", seed, (4, 8), {"top1": 0.84 + 0.001 * seed}, routed=True, **config("moh"))
        make_run(root, "cls", "moh-50-one-stage", seed, (4, 8), {"top1": 0.80 + 0.001 * seed}, routed=True,
                 **config("moh", two_stage=False))
        make_run(root, "cls", "moh-50-head-choice", seed, (4, 8), {"top1": 0.82 + 0.0011 * seed}, routed=True,
                 **config("moh_head_choice"))
    text = write_report([root], tmp_path / "out").read_text()
    section = text.split("### Head choice against token choice (same budget)")[1].split("###")[0]
    rows = [line for line in section.splitlines() if line.startswith("| moh-50-head-choice |")]
    assert len(rows) == 1 and rows[0].startswith("| moh-50-head-choice | moh-50 | 4 |"), section  # not one-stage
    assert rows[0].split("|")[6].strip().startswith("worse: -1.99"), rows  # paired top-1, in percent


def test_unmeasured_values_are_a_dash_never_estimated(tmp_path: Path) -> None:
    run = make_run(tmp_path / "runs", "cls", "mha", 0, (8, 8), {"top1": 0.8})
    results = json.loads((run / "results.json").read_text())
    del results["peak_memory_mb"]
    (run / "results.json").write_text(json.dumps(results))
    text = write_report([run], tmp_path / "out").read_text()
    cost_row = next(line for line in text.splitlines() if line.startswith("| mha |") and "img/s" in line)
    assert "| — |" in cost_row  # peak memory absent
    assert "SMOKE TEST" not in text


def test_cli_writes_report_and_flags_smoke_tests(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path / "runs", "cls", "mha", 0, (8, 8), {"top1": 0.8})
    info = json.loads((run / "cell.json").read_text())
    (run / "cell.json").write_text(json.dumps({**info, "profile": "quick"}))
    report_main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    assert capsys.readouterr().out.strip().endswith("REPORT.md")
    assert "SMOKE TEST" in (tmp_path / "out" / "REPORT.md").read_text()


def test_missing_results_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no results.json"):
        find_run_dirs([tmp_path])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_run_dirs([tmp_path / "nope"])
    with pytest.raises(FileNotFoundError, match="results.json"):
        load_run(tmp_path)


def test_every_cell_has_its_own_colour_and_marker() -> None:
    from visattn.report.plots import _style

    styles = [_style(i) for i in range(15)]
    assert len({s["marker"] for s in styles}) == 15
    assert len({tuple(s["color"]) for s in styles}) == 15
    assert len({(tuple(s["color"]), s["marker"]) for s in (_style(i) for i in range(60))}) == 60


def test_generation_tables_show_agreement_sfid_reason_and_both_flop_counts(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    note = "left out: sFID needs >= 10 x 1568-d = 15680 images per set (have 5000 samples, 10000 reference)"
    for seed in range(2):
        make_run(root, "dit", "mha", seed, (8, 8), {"fid": 5.0 + seed, "sfid": None, "sfid_note": note,
                                                     "class_agreement": 0.81 + 0.01 * seed})
        make_run(root, "dit", "moh-50", seed, (4, 8), {"fid": 6.0 + seed, "sfid": None, "sfid_note": note,
                                                        "class_agreement": 0.71 + 0.01 * seed},
                 routed=True, active_head_flops_per_image=1.5e8)
    text = write_report([root], tmp_path / "out").read_text()
    assert "0.815 ± 0.007" in text and note in text
    # a constant per-seed shift has no spread: no test, so no verdict (a t-test needs a variance)
    assert "class agreement vs MHA" in text and "not tested (no spread): -0.100 [-0.100, -0.100]" in text
    header = next(line for line in text.splitlines() if "executed FLOPs / image" in line)
    assert "active-head FLOPs / image" in header
    moh_cost = next(line for line in text.splitlines() if line.startswith("| moh-50 |") and "img/s" in line)
    assert "250.00 MFLOP | 150.00 MFLOP" in moh_cost


def _curve_cell(name: str, curves: dict[int, list[float]], core: bool = False, study: bool = True,
                heads: tuple[int, int] = (8, 8)):
    """A cls cell whose seed ``s`` logged top-1 ``curves[s][e]`` at epoch ``e``."""
    from visattn.report.runs import Cell, Run

    cell_info = {"cell": name, "core": core} if study else {}
    runs = [Run(Path(f"/runs/{name}/seed{seed}"), {"task": "cls", "attn": name, "seed": seed, "active_heads": list(heads)},
                metrics=[{"epoch": e, "top1": v} for e, v in enumerate(curve)], cell_info=cell_info)
            for seed, curve in curves.items()]
    return Cell("cls", runs[0].variant, runs[0].budget, runs)


def test_ranking_check_at_the_last_two_evaluations(study_dirs: Path, tmp_path: Path) -> None:
    from visattn.report.convergence import ranking_check, ranking_sentence

    settled = [_curve_cell("a", {0: [0.5, 0.8, 0.90], 1: [0.5, 0.8, 0.92]}), _curve_cell("b", {0: [0.6, 0.7, 0.85]})]
    check = ranking_check(settled, "epoch", "top1")
    assert check.points == (1.0, 2.0) and check.before == check.after == ("a", "b") and check.stable
    assert "is the same at epoch 1 and epoch 2 (best first: a, b)" in ranking_sentence(check, "epoch", "eval top-1")
    assert ranking_check(settled[:1], "epoch", "top1") is None
    assert "Ranking of the cells by seed-mean eval top-1" in write_report([study_dirs], tmp_path / "r").read_text()


def test_a_swap_counts_against_the_ranking_only_beyond_seed_noise() -> None:
    """Cells within seed noise of each other swap places by chance: that is not 'too short to rank'.
    A swap with a consistent per-seed difference is; a swap that cannot be tested (one seed) is not
    called settled."""
    from visattn.report.convergence import ranking_check, ranking_sentence

    # b passes a at epoch 2 by 0.1 pp on average, with per-seed differences of both signs
    noisy = [_curve_cell("a", {0: [0, 0.80, 0.850], 1: [0, 0.80, 0.860], 2: [0, 0.80, 0.855]}),
             _curve_cell("b", {0: [0, 0.79, 0.858], 1: [0, 0.79, 0.852], 2: [0, 0.79, 0.858]})]
    check = ranking_check(noisy, "epoch", "top1")
    assert check.before == ("a", "b") and check.after == ("b", "a") and check.stable
    text = ranking_sentence(check, "epoch", "eval top-1", scale=100.0, unit=" pp")
    assert "Swaps within seed noise at epoch 2" in text and "b over a by +0.10 pp [" in text
    assert "the order of the cells that differ holds" in text

    # b passes a at epoch 2 by 1 pp in every seed: the ranking is not settled
    real = [_curve_cell("a", {0: [0, 0.80, 0.850], 1: [0, 0.80, 0.860], 2: [0, 0.80, 0.855]}),
            _curve_cell("b", {0: [0, 0.79, 0.861], 1: [0, 0.79, 0.869], 2: [0, 0.79, 0.866]})]
    check = ranking_check(real, "epoch", "top1")
    assert not check.stable
    text = ranking_sentence(check, "epoch", "eval top-1", scale=100.0, unit=" pp")
    assert "Swaps BEYOND seed noise at epoch 2" in text and "not settled" in text

    one_seed = [_curve_cell("a", {0: [0, 0.80, 0.85]}), _curve_cell("b", {0: [0, 0.79, 0.86]})]
    check = ranking_check(one_seed, "epoch", "top1")
    assert not check.stable
    assert "not tested (fewer than 2 seeds, or no spread)" in ranking_sentence(check, "epoch", "eval top-1")


def test_the_ranking_check_covers_the_core_cells_and_tells_cells_apart() -> None:
    from visattn.report.convergence import ranking_check, ranking_sentence

    core = [_curve_cell("mha", {0: [0, 0.80, 0.85], 1: [0, 0.81, 0.86]}, core=True),
            _curve_cell("moh-50", {0: [0, 0.70, 0.75], 1: [0, 0.71, 0.76]}, core=True)]
    other = _curve_cell("relu", {0: [0, 0.90, 0.70], 1: [0, 0.91, 0.71]})  # swaps with both, but not core
    check = ranking_check([*core, other], "epoch", "top1")
    assert check.core_only and check.after == ("mha", "moh-50") and not check.swaps and check.stable
    assert "Ranking of the core cells" in ranking_sentence(check, "epoch", "eval top-1")

    # outside a study two cells of one attention are told apart by their head budget
    sweep = [_curve_cell("moh", {0: [0, 0.80, 0.85]}, study=False, heads=(6, 8)),
             _curve_cell("moh", {0: [0, 0.70, 0.75]}, study=False, heads=(4, 8))]
    check = ranking_check(sweep, "epoch", "top1")
    assert check.after == ("moh (6/8 heads)", "moh (4/8 heads)")


def test_runs_that_score_nothing_are_left_out(tmp_path: Path) -> None:
    """DiT's mode=sample / cache_latents runs write results.json without scores: not cells of a report."""
    root = tmp_path / "runs"
    scored = make_run(root, "dit", "mha", 0, (8, 8), {"fid": 3.0, "mode": "train"})
    make_run(root, "dit", "mha", 1, (8, 8), {"mode": "sample", "num_samples": 64})
    make_run(root, "dit", "mha", 2, (8, 8), {"mode": "cache_latents"})
    assert find_run_dirs([root]) == [scored.resolve()]


def test_incomplete_runs_are_left_out_and_logged(tmp_path: Path, caplog) -> None:
    """A failed run's results.json (completed: false, no final metrics) must not reach the tables."""
    root = tmp_path / "runs"
    done = make_run(root, "cls", "mha", 0, (8, 8), {"top1": 0.85, "completed": True})
    legacy = make_run(root, "cls", "mha", 1, (8, 8), {"top1": 0.86})
    failed = make_run(root, "cls", "mha", 2, (8, 8), {"completed": False, "failure": "non-finite loss"})
    with caplog.at_level("WARNING", logger="visattn.report.runs"):
        found = find_run_dirs([root])
    assert found == sorted([done.resolve(), legacy.resolve()])
    assert str(failed.resolve()) in caplog.text and "completed: false" in caplog.text
    with pytest.raises(FileNotFoundError, match="finished run"):
        find_run_dirs([failed])
    (cell,) = group_cells(load_run(p) for p in found)
    assert cell.values("top1") == [0.85, 0.86]
    report = write_report([root], tmp_path / "out")
    assert report.is_file()


def test_recorded_absolute_run_dir_is_shown_relative_to_the_repository():
    from visattn.report.runs import REPO_ROOT, Run

    run_dir = REPO_ROOT / "docs" / "results" / "x" / "runs" / "cls" / "00_mha" / "seed0"
    command = f"python train_cls.py attn=mha seed=0 hydra.run.dir=/elsewhere/clone/{run_dir.relative_to(REPO_ROOT)}"
    run = Run(path=run_dir, results={"task": "cls"}, cell_info={"command": command})
    assert run.command == "python train_cls.py attn=mha seed=0 hydra.run.dir=docs/results/x/runs/cls/00_mha/seed0"


def test_differences_without_spread_are_not_tested():
    """Recall 0.000 for every MHA run and 0.002 for every candidate run is a floor effect, not a
    difference measured without noise: no p value, so no verdict."""
    diff = paired_difference({0: 0.002, 1: 0.002, 2: 0.002}, {0: 0.0, 1: 0.0, 2: 0.0})
    assert diff.p_value is None and diff.mean == pytest.approx(0.002)
    # the 2026-11-22 study's recall: differences equal up to float rounding count as no spread
    rounded = paired_difference({0: 0.0002, 1: 0.0003, 2: 0.0002}, {0: 0.0, 1: 0.0001, 2: 0.0})
    assert rounded.p_value is None
    assert paired_verdicts([diff], [True]) == ["not tested (no spread)"]


def test_every_figure_names_the_machine_its_runs_ran_on(study_dirs: Path) -> None:
    from visattn.report.plots import _machine_caption
    from visattn.report.runs import find_run_dirs

    cells = group_cells([load_run(path) for path in find_run_dirs([study_dirs])])
    assert _machine_caption(cells) == "runs on: Test CPU (2 usable cores), no GPU; torch 2.x"


def test_timings_of_runs_that_shared_their_cores_are_marked(tmp_path: Path) -> None:
    """A run whose process got less than 90% of its threads' CPU time (cpu_share) measured its
    throughput beside other work: the cost table marks that cell's timings and says why."""
    from visattn.report.tables import CONTENDED_MARK, CONTENDED_NOTE

    root = tmp_path / "runs"
    for seed in range(2):
        make_run(root, "cls", "mha", seed, (8, 8), {"top1": 0.85 + 0.01 * seed}, cpu_share=0.99)
        make_run(root, "cls", "relu", seed, (8, 8), {"top1": 0.84 + 0.01 * seed}, cpu_share=0.45 if seed else 0.98)
    text = write_report([root], tmp_path / "out").read_text()
    relu = next(line for line in text.splitlines() if line.startswith("| relu |") and "img/s" in line)
    mha = next(line for line in text.splitlines() if line.startswith("| mha |") and "img/s" in line)
    assert relu.count(CONTENDED_MARK) == 3 and CONTENDED_MARK not in mha and CONTENDED_NOTE in text

    clean = tmp_path / "clean"
    for seed in range(2):
        make_run(clean, "cls", "mha", seed, (8, 8), {"top1": 0.85 + 0.01 * seed}, cpu_share=0.99)
    assert CONTENDED_NOTE not in write_report([clean], tmp_path / "out2").read_text()


def test_runs_without_a_clock_are_left_out_of_the_wall_time_and_counted(tmp_path: Path) -> None:
    """A run resumed from a checkpoint that kept no clock totals records null times: the summed wall
    time covers the other runs and says how many it leaves out; that cell's wall time is the others'."""
    root = tmp_path / "runs"
    for seed in range(3):
        make_run(root, "cls", "mha", seed, (8, 8), {"top1": 0.85 + 0.01 * seed},
                 wall_time_s=None if seed == 2 else 60.0 + 30 * seed)
    text = write_report([root], tmp_path / "out").read_text()
    assert "wall time, summed: 0.04 h (2.5 min) over 2 runs" in text
    assert "1 run(s) without it (resumed from a checkpoint that kept no clock)" in text
    mha = next(line for line in text.splitlines() if line.startswith("| mha |") and "img/s" in line)
    assert mha.rstrip(" |").endswith("75 s")


@pytest.mark.parametrize(("values", "target", "higher", "verdict"), [
    ([0.82, 0.83, 0.84], 0.80, True, "met (the 95% interval clears the target)"),
    ([0.70, 0.71, 0.72], 0.80, True, "missed (the 95% interval falls short of the target)"),
    ([0.79, 0.80, 0.84], 0.80, True, "mean meets it; the 95% interval holds the target (not settled)"),
    ([0.78, 0.79, 0.81], 0.80, True, "mean misses it; the 95% interval holds the target (not settled)"),
    ([2.5, 2.6, 2.7], 3.0, False, "met (the 95% interval clears the target)"),  # lower is better (FID)
    ([0.81], 0.80, True, "met by the one seed (no interval)"),
    ([], 0.80, True, "not measured"),
])
def test_recipe_target_verdict_needs_the_whole_interval(values, target, higher, verdict) -> None:
    from visattn.report.targets import target_verdict

    assert target_verdict(summarize(values), target, higher) == verdict


def test_report_checks_the_mha_cell_against_the_profile_targets(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    for seed, (agreement, recall) in enumerate([(0.802, 0.33), (0.788, 0.335), (0.79, 0.34)]):
        make_run(root, "dit", "mha", seed, (8, 8), {"fid": 3.0, "class_agreement": agreement, "recall": recall})
    text = write_report([root], tmp_path / "out", targets={"dit": {"class_agreement": 0.8, "recall": 0.3}}).read_text()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| class agreement |")
            or line.startswith("| recall |")}
    assert "| >= 0.800 | 0.793 ± 0.008 [0.775, 0.812] |" in rows["class agreement"]
    assert rows["class agreement"].rstrip(" |").endswith("mean misses it; the 95% interval holds the target (not settled)")
    assert rows["recall"].rstrip(" |").endswith("met (the 95% interval clears the target)")
    assert "The recipe's targets" not in write_report([root], tmp_path / "out2").read_text()  # none given


def test_a_target_that_is_no_metric_is_refused_naming_it() -> None:
    from visattn.report.targets import check_targets

    check_targets({"dit": {"class_agreement": 0.8, "recall": 0.3}})
    with pytest.raises(ValueError, match=r"dit\.agreement: 'agreement' is not a quality metric .*class_agreement"):
        check_targets({"dit": {"agreement": 0.8}})
    with pytest.raises(ValueError, match=r"task 'gen' has no quality metrics"):
        check_targets({"gen": {"fid": 3.0}})


def test_timings_come_from_the_machine_that_ran_most_runs(tmp_path: Path) -> None:
    """A study resumed on a faster CPU: throughput means over both machines would rank cells by where
    their seeds ran. The cost table keeps the majority machine's timings and says what it left out."""
    root = tmp_path / "runs"
    fast = {"cpu": "Test CPU", "cpu_isa": "AVX512", "native_bf16": True, "cores": 2, "torch": "2.x"}
    for cell, heads, slow_speed, fast_speed in (("mha", (8, 8), 400.0, 1000.0), ("moh-75", (6, 8), 200.0, 2000.0)):
        for seed in range(4):
            speed = fast_speed if seed == 3 else slow_speed
            run = make_run(root, "cls", cell, seed, heads, {"top1": 0.85, "top5": 0.99, "top1_best": 0.85},
                           train_images_per_s=speed, eval_images_per_s=speed, wall_time_s=1e5 / speed)
            if seed == 3:
                info = json.loads((run / "cell.json").read_text())
                (run / "cell.json").write_text(json.dumps({**info, "machine": fast}))
    report = write_report([root], tmp_path / "report").read_text()
    cost = report.split("### Cost", 1)[1].split("###", 1)[0]
    moh_row = next(line for line in cost.splitlines() if line.startswith("| moh-75 "))
    assert "0.50× (200 img/s)" in moh_row  # slow machine only; both machines would give 1.18×
    assert "500 s" in moh_row  # wall time from the same runs
    assert "the 6 runs on Test CPU (2 usable cores)" in cost
    assert "the other 2 run(s) ran on other machines" in cost
    assert "- Runs' machine: Test CPU, AVX512, native bf16 (2 usable cores), no GPU; torch 2.x: 2 runs (cls 2)" in report
    assert re.search(r"- Runs' machine: Test CPU \(2 usable cores\).*: 6 runs \(cls 6\)\n", report)


def test_machine_line_tells_cpus_of_one_name_apart_by_their_vector_units() -> None:
    from visattn.utils.machine import describe_machine, machine_line

    old = {"cpu": "AMD EPYC", "cores": 2, "torch": "2.x"}  # recorded before cpu_isa existed
    avx2 = {**old, "cpu_isa": "AVX2", "native_bf16": False}
    avx512 = {**old, "cpu_isa": "AVX512", "native_bf16": True}
    assert machine_line(old) == "AMD EPYC (2 usable cores), no GPU; torch 2.x"
    assert machine_line(avx2) == "AMD EPYC, AVX2, no native bf16 (2 usable cores), no GPU; torch 2.x"
    assert len({machine_line(old), machine_line(avx2), machine_line(avx512)}) == 3
    import torch

    assert describe_machine()["cpu_isa"] == torch.backends.cpu.get_cpu_capability()
