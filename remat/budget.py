"""Memory budgets: a fraction of the activation peak, or an absolute cap on the whole peak.

DESIGN.md, "The words": a fraction b in (0, 1] means a cap of persistent bytes plus
b × the no-recompute activation peak (as torch.compile's activation_memory_budget); an
absolute budget caps the whole iteration's peak. The two look alike as numbers, so the
rule is: a value with a unit, or an integer above 1, is bytes; a number in (0, 1] is a
fraction; anything else is refused, with the accepted forms in the message.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable

from remat.errors import BudgetError

MiB = 2**20
GiB = 2**30

ACCEPTED_FORMS = (
    'a fraction of the activation peak in (0, 1] such as 0.5, "0.5" or "50%", '
    'or an absolute cap on the whole peak: integer bytes such as 2048, '
    'or a size with a unit such as "6GiB", "512MiB", "500MB", "1.5GB", "100kB"'
)

UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

_SIZE = re.compile(r"^\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*|%)\s*$")


@dataclass(frozen=True)
class Budget:
    """Exactly one of `fraction` (of the activation peak) or `nbytes` (whole peak) is set."""

    fraction: float | None = None
    nbytes: int | None = None

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.nbytes is None):
            raise BudgetError("a Budget is either a fraction or a number of bytes, not both nor neither")
        if self.fraction is not None and not (0 < self.fraction <= 1):
            raise BudgetError(f"a budget fraction must be in (0, 1], got {self.fraction}")
        if self.nbytes is not None and self.nbytes <= 0:
            raise BudgetError(f"a budget in bytes must be positive, got {self.nbytes}")

    @property
    def is_fraction(self) -> bool:
        return self.fraction is not None

    def to_bytes(self, persistent_bytes: int, baseline_step_peak_bytes: int) -> int:
        """The cap on the whole peak (persistent bytes included), in bytes."""
        if self.fraction is not None:
            return int(persistent_bytes + math.floor(self.fraction * baseline_step_peak_bytes))
        assert self.nbytes is not None
        return int(self.nbytes)

    def for_later_shape(self, own_bytes: int, earlier_bytes: Iterable[int]) -> int | None:
        """Where a fraction is out of reach for a later batch shape (a loader's smaller last
        batch: the same weights, gradients and optimizer state under fewer activations), the
        largest budget in bytes of the shapes compiled before, if above `own_bytes`: the step
        then holds no more than it already did. Else None."""
        earlier = max(earlier_bytes, default=None) if self.fraction is not None else None
        return earlier if earlier is not None and earlier > own_bytes else None

    def describe(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction:g} of the activation peak"
        return f"{self.nbytes} bytes ({format_bytes(self.nbytes or 0)})"


def not_held(measured: int, predicted: int, budget: int | None, slack: int = 0) -> str | None:
    """What to tell the user when a step's measured peak went over its budget by more than
    `slack` (a tensor the memory model did not see: an op whose fake kernel gives a buffer
    fewer bytes than the real one makes), or None when the budget held."""
    if budget is None or measured <= budget + slack:
        return None
    return (
        f"remat: the step's measured peak, {format_bytes(measured)}, is over its budget of {format_bytes(budget)} "
        f"(predicted {format_bytes(predicted)}): an op holds {format_bytes(measured - predicted)} the plan did not see. "
        f"Lower the budget by that much to stay under it, and report the model (remat profile shows where it differs)."
    )


def format_bytes(nbytes: float) -> str:
    """Bytes in MiB or GiB, for messages."""
    if abs(nbytes) >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    mib = nbytes / 2**20
    return f"{mib:.1f} MiB" if abs(mib) >= 100 else f"{mib:.2f} MiB" if abs(mib) >= 10 else f"{mib:.3f} MiB"


def _bad(value: object, why: str) -> BudgetError:
    return BudgetError(f"invalid memory budget {value!r}: {why}. Accepted forms: {ACCEPTED_FORMS}")


def _from_number(value: float, original: object, integer_literal: bool) -> Budget:
    """A bare number: a fraction in (0, 1], or whole bytes when written as an integer above 1."""
    if math.isnan(value):
        raise _bad(original, "it is NaN")
    if math.isinf(value):
        raise _bad(original, "it is infinite")
    if value == 0:
        raise _bad(original, "it is zero")
    if value < 0:
        raise _bad(original, "it is negative")
    if value <= 1:
        return Budget(fraction=float(value))
    if not integer_literal:
        raise _bad(
            original,
            "a fraction must be in (0, 1]; an absolute budget needs a unit (\"6GiB\", \"500MB\") "
            "or a whole number of bytes (2048)",
        )
    return Budget(nbytes=int(value))


def parse_budget(value: str | int | float | Budget) -> Budget:
    """Read a budget from the command line or an API call; see ACCEPTED_FORMS."""
    if isinstance(value, Budget):
        return value
    if isinstance(value, bool):
        raise _bad(value, "a boolean is not a budget")
    if isinstance(value, int):
        if value > 1:
            return Budget(nbytes=int(value))
        return _from_number(float(value), value, integer_literal=True)
    if isinstance(value, float):
        return _from_number(value, value, integer_literal=False)
    if not isinstance(value, str):
        raise _bad(value, f"a {type(value).__name__} is not a budget")
    text = value.strip()
    if text.lower().lstrip("+-") == "nan":
        raise _bad(value, "it is NaN")
    m = _SIZE.match(text)
    if m is None:
        raise _bad(value, "cannot read it as a number with an optional unit")
    number, unit = m.group(1), m.group(2)
    x = float(number)
    if not unit:
        return _from_number(x, value, integer_literal=re.fullmatch(r"\+?\d+", number) is not None)
    if unit == "%":  # a percentage of the activation peak: "50%" is 0.5
        if not 0 < x <= 100:
            raise _bad(value, "a percentage of the activation peak must be in (0%, 100%]")
        return Budget(fraction=x / 100)
    if unit.lower() not in UNITS:
        raise _bad(value, f"unknown unit {unit!r} (units: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    if x == 0:
        raise _bad(value, "it is zero")
    if x < 0:
        raise _bad(value, "it is negative")
    nbytes = x * UNITS[unit.lower()]
    if math.isinf(nbytes):
        raise _bad(value, "it is infinite")
    if nbytes < 1:
        raise _bad(value, "it is less than one byte")
    return Budget(nbytes=int(round(nbytes)))
