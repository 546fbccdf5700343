"""Per-expert capacity, computed exactly: the one function the layer, the reference MoE and the
planner's cost model share.

    expert_capacity(num_tokens=200, num_experts=8, k=2, capacity_factor=1.1, min_capacity=0)  # 55

The factor is the decimal number written (1.1 is 11/10) and the rest integer arithmetic, so the result
is the same on every rank and machine (floating point gives 56 here). docs/config.md, "Formulas".
"""
from __future__ import annotations

from decimal import Decimal
from fractions import Fraction
from functools import lru_cache
from numbers import Rational
from typing import Union

Factor = Union[int, float, Decimal, Fraction, str]


@lru_cache(maxsize=64)
def _exact(factor: Factor) -> Fraction:
    return Fraction(factor) if isinstance(factor, (Rational, Decimal)) else Fraction(str(factor))


def exact_factor(capacity_factor: Factor) -> Fraction:
    """``capacity_factor`` as the exact fraction of its decimal value (a float by its shortest repr)."""
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float, Decimal, Fraction, str)):
        raise TypeError(f"capacity_factor: got {capacity_factor!r}; expected a number")
    try:
        value = _exact(capacity_factor)
    except (ValueError, ArithmeticError):   # inf, nan, text that is no number
        raise ValueError(f"capacity_factor: got {capacity_factor!r}; expected a finite number > 0") from None
    if value <= 0:
        raise ValueError(f"capacity_factor: got {capacity_factor!r}; expected a number > 0")
    return value


def expert_capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: Factor, min_capacity: int) -> int:
    """``max(min_capacity, ceil(capacity_factor * k * num_tokens / num_experts))``, exactly: the
    per-expert buffer size of one GShard group of ``num_tokens`` tokens."""
    share = exact_factor(capacity_factor) * (int(k) * int(num_tokens))
    return max(int(min_capacity), -(-share.numerator // (share.denominator * int(num_experts))))
