"""Benchmark report: tables with seed intervals and honest comparisons, and PNG plots, from run dirs."""

from .document import write_report
from .runs import Cell, Run, find_run_dirs, group_cells, load_run, reference_cell
from .stats import Summary, compare, summarize

__all__ = [
    "Cell",
    "Run",
    "Summary",
    "compare",
    "find_run_dirs",
    "group_cells",
    "load_run",
    "reference_cell",
    "summarize",
    "write_report",
]
