"""The benchmark study: every attention variant and head budget on Fashion-MNIST, seeds, report."""

from .plan import RunSpec, format_override, load_study_config, plan_runs
from .runner import RunOutcome, run_one, run_study

__all__ = ["RunOutcome", "RunSpec", "format_override", "load_study_config", "plan_runs", "run_one", "run_study"]
