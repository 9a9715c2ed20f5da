"""Memory budgets: the accepted forms, their meaning in bytes, and the errors."""

import math

import pytest

from remat.budget import Budget, parse_budget
from remat.errors import BudgetError


@pytest.mark.parametrize(
    "value, fraction",
    [(0.5, 0.5), ("0.5", 0.5), (".25", 0.25), (1, 1.0), ("1", 1.0), (1.0, 1.0), ("1e-1", 0.1), (" 0.8 ", 0.8), ("50%", 0.5), ("100%", 1.0), ("25 %", 0.25)],
)
def test_fractions(value, fraction):
    b = parse_budget(value)
    assert b.is_fraction and b.fraction == pytest.approx(fraction) and b.nbytes is None


@pytest.mark.parametrize(
    "value, nbytes",
    [
        ("6GiB", 6 * 2**30),
        ("512MiB", 512 * 2**20),
        ("500MB", 500 * 10**6),
        ("1.5GB", 1_500_000_000),
        ("100kB", 100_000),
        ("1 GiB", 2**30),
        ("2KiB", 2048),
        ("2048", 2048),
        (2048, 2048),
        ("300b", 300),
    ],
)
def test_absolute(value, nbytes):
    b = parse_budget(value)
    assert not b.is_fraction and b.nbytes == nbytes


def test_to_bytes():
    # A fraction caps the whole peak at persistent + b * (activation peak).
    assert parse_budget(0.25).to_bytes(persistent_bytes=1000, baseline_step_peak_bytes=400) == 1100
    assert parse_budget(1).to_bytes(1000, 400) == 1400
    # An absolute budget is a cap on the whole peak, whatever the persistent bytes.
    assert parse_budget("2KiB").to_bytes(1000, 400) == 2048


def test_budget_passes_through():
    b = Budget(fraction=0.3)
    assert parse_budget(b) is b


@pytest.mark.parametrize(
    "value, why",
    [
        (0, "it is zero"),
        ("0", "it is zero"),
        (0.0, "it is zero"),
        ("0GiB", "it is zero"),
        (-1, "it is negative"),
        (-0.5, "it is negative"),
        ("-5MB", "it is negative"),
        (float("nan"), "it is NaN"),
        ("nan", "it is NaN"),
        ("abc", "cannot read it"),
        ("", "cannot read it"),
        ("6 GiBs", "unknown unit"),
        ("5XB", "unknown unit"),
        (True, "boolean"),
        ([0.5], "not a budget"),
        ("0.1B", "less than one byte"),
        ("150%", "percentage of the activation peak must be in (0%, 100%]"),
        ("0%", "percentage of the activation peak must be in (0%, 100%]"),
    ],
)
def test_bad_budgets_name_problem_and_forms(value, why):
    with pytest.raises(BudgetError) as e:
        parse_budget(value)
    msg = str(e.value)
    assert why in msg
    assert "Accepted forms" in msg and '"6GiB"' in msg and "(0, 1]" in msg


@pytest.mark.parametrize("value", [1.5, "1.5", "2048.0", 2.0, math.inf])
def test_fraction_above_one_says_absolute_needs_unit(value):
    with pytest.raises(BudgetError) as e:
        parse_budget(value)
    msg = str(e.value)
    if value is math.inf:
        assert "infinite" in msg
    else:
        assert "a fraction must be in (0, 1]" in msg
        assert "an absolute budget needs a unit" in msg and "whole number of bytes" in msg


def test_budget_dataclass_checks():
    with pytest.raises(BudgetError):
        Budget()
    with pytest.raises(BudgetError):
        Budget(fraction=0.5, nbytes=10)
    with pytest.raises(BudgetError):
        Budget(fraction=1.5)
