"""Integer helpers shared by the planner, the host bookkeeping and the kernels."""

from __future__ import annotations

__all__ = ["cdiv", "round_up"]


def cdiv(a: int, b: int) -> int:
  """``ceil(a / b)`` for integers (``b > 0``)."""
  return -(-a // b)


def round_up(a: int, b: int) -> int:
  """The smallest multiple of ``b`` that is ``>= a``."""
  return cdiv(a, b) * b
