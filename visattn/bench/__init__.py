"""Benchmark harness: every attention variant, and whole models, side by side; the training loops
against a bare PyTorch loop (``python -m visattn.bench attention|model|paths|loop --help``)."""

from .attention import AttentionCase, Shape, attention_cases, moh_budget, run_attention_bench
from .models import MODEL_PRESETS, run_model_bench
from .report import markdown_table

__all__ = [
    "MODEL_PRESETS",
    "AttentionCase",
    "Shape",
    "attention_cases",
    "markdown_table",
    "moh_budget",
    "run_attention_bench",
    "run_model_bench",
]
