"""Benchmark report: tables with seed intervals and honest comparisons, and PNG plots, from run dirs."""

from .document import write_report
from .runs import Cell, Run, find_run_dirs, group_cells, load_run, reference_cell
from .stats import PairedDifference, Summary, compare, holm, paired_difference, summarize

__all__ = [
    "Cell",
    "PairedDifference",
    "Run",
    "Summary",
    "compare",
    "find_run_dirs",
    "group_cells",
    "holm",
    "load_run",
    "paired_difference",
    "reference_cell",
    "summarize",
    "write_report",
]
