"""The shared value checks: what they accept, and that their messages name the key and the value."""

import argparse
import math

import pytest

from visattn.utils.checks import int_at_least, require_count, require_positive


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "3", None])
def test_require_count_refuses_non_integers_and_small_values(value):
    with pytest.raises(ValueError, match=r"train\.steps=.* must be an integer >= 1"):
        require_count("train.steps", value)


def test_require_count_accepts_the_minimum():
    require_count("k", 0, minimum=0)
    require_count("k", 1)


@pytest.mark.parametrize("value", [0, -0.5, math.nan, math.inf, True, "1e-3"])
def test_require_positive_refuses_and_names_the_fix(value):
    with pytest.raises(ValueError, match=r"optim\.lr=.* must be a finite number > 0; try 1e-3"):
        require_positive("optim.lr", value, fix="; try 1e-3")


def test_require_positive_allow_zero():
    require_positive("optim.weight_decay", 0, allow_zero=True)
    with pytest.raises(ValueError, match=">= 0"):
        require_positive("optim.weight_decay", -1e-4, allow_zero=True)


def test_int_at_least_parses_and_refuses():
    parse = int_at_least(1)
    assert parse("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="0 is below 1"):
        parse("0")
    with pytest.raises(argparse.ArgumentTypeError, match="'two' is not an integer"):
        parse("two")
