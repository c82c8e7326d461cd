"""``python -m visattn.bench loop`` end to end on tiny models (it runs and reports; no timing assertions)."""

import json

import pytest

from visattn.bench.__main__ import main
from visattn.bench.loop import _kwargs
from visattn.utils.machine import cpu_model

TINY = ["--vit", "tiny_patch2_8", "--vit-batch", "4", "--vit-kwargs", "depth=2", "embed_dim=32", "num_heads=2",
        "--dit", "DiT-T/2", "--dit-batch", "2", "--dit-kwargs", "depth=2", "hidden_size=32", "input_size=8",
        "--warmup", "0", "--repeats", "2", "--log-every", "2", "--threads", "1", "--device", "cpu"]


def test_loop_races_both_tasks_and_prints_the_ratio_and_where_it_goes(tmp_path, capsys):
    out = tmp_path / "loop.json"
    result = main(["loop", *TINY, "--out", str(out)])
    text = capsys.readouterr().out
    assert f"Device: cpu: {cpu_model()}" in text  # names the CPU
    assert "ours / bare" in text and "Where the difference goes" in text
    rows = result["rows"]
    assert [r["task"] for r in rows] == ["cls", "dit"]
    for row in rows:
        assert row["ours_ms"] > 0 and row["bare_ms"] > 0 and row["ratio"] > 0
        assert f"{row['ratio']:.3f}x" in text
        assert len(row["ours_samples_ms"]) == len(row["bare_samples_ms"]) == 2
        assert set(row["parts_ms"]) == {"grad check", "gate", "optimizer (found_inf)", "EMA (masked)",
                                        "sums + lr + aux", "log read"}
    assert json.loads(out.read_text())["rows"][0]["model"] == "tiny_patch2_8 mha"


def test_loop_with_clipping_and_moh_in_bf16(capsys):
    result = main(["loop", *TINY, "--tasks", "dit", "--attn", "moh", "--clip", "1.0", "--dtypes", "bf16"])
    (row,) = result["rows"]
    assert row["dtype"] == "bf16" and row["model"] == "DiT-T/2 moh" and "clip + norm" in row["parts_ms"]


def test_model_keywords_are_read_as_yaml_and_a_bad_one_names_the_fix():
    assert _kwargs(["depth=2", "mlp_ratio=2.5", "qkv_bias=false"]) == {"depth": 2, "mlp_ratio": 2.5, "qkv_bias": False}
    with pytest.raises(ValueError, match="write key=value"):
        _kwargs(["depth"])
