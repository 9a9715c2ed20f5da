"""Sparse constraint rows of the exact program, built row by row."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.optimize import LinearConstraint


class Rows:
    """Sparse constraint rows lo <= a.x <= hi, built row by row."""

    def __init__(self) -> None:
        self.r: list[int] = []
        self.c: list[int] = []
        self.v: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def add(self, terms: list[tuple[int, float]], lo: float, hi: float) -> None:
        i = len(self.lo)
        for col, val in terms:
            if val != 0:
                self.r.append(i)
                self.c.append(col)
                self.v.append(float(val))
        self.lo.append(lo)
        self.hi.append(hi)

    def extend(self, other: "Rows") -> "Rows":
        out = Rows()
        out.r = self.r + [i + len(self.lo) for i in other.r]
        out.c = self.c + other.c
        out.v = self.v + other.v
        out.lo = self.lo + other.lo
        out.hi = self.hi + other.hi
        return out

    def constraint(self, ncols: int) -> LinearConstraint:
        a = sp.csr_array((self.v, (self.r, self.c)), shape=(len(self.lo), ncols))
        return LinearConstraint(a, np.array(self.lo), np.array(self.hi))


