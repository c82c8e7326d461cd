"""Value checks shared by the config validators and the command-line tools.

Each raises with the key, the bad value and the rule, so the message says what to fix.
"""

from __future__ import annotations

import argparse
import math
from typing import Any


def require(ok: bool, key: str, value: Any, rule: str) -> None:
    """ValueError ``"{key}={value!r} {rule}"`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{key}={value!r} {rule}")


def require_count(key: str, value: Any, minimum: int = 1, why: str = "") -> None:
    """``value`` is an integer (not a bool) >= ``minimum``."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    require(ok, key, value, f"must be an integer >= {minimum}{why}")


def require_positive(key: str, value: Any, allow_zero: bool = False, fix: str = "") -> None:
    """``value`` is a finite number > 0 (>= 0 with ``allow_zero``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= 0 if allow_zero else value > 0)
    require(ok, key, value, f"must be a finite number {'>= 0' if allow_zero else '> 0'}{fix}")


def int_at_least(minimum: int):
    """An argparse ``type=``: an integer >= ``minimum``, else a usage error naming the value."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}; give an integer >= {minimum}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # argparse names the type in its message
    return parse
