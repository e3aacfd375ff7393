"""Integer helpers shared by the planner, the host bookkeeping and the kernels."""

from __future__ import annotations

__all__ = ["cdiv", "round_up", "next_power_of_2"]


def cdiv(a: int, b: int) -> int:
  """``ceil(a / b)`` for integers (``b > 0``)."""
  return -(-a // b)


def round_up(a: int, b: int) -> int:
  """The smallest multiple of ``b`` that is ``>= a``."""
  return cdiv(a, b) * b


def next_power_of_2(n: int) -> int:
  """The smallest power of two ``>= n`` (1 for ``n <= 1``): padded sizes, one compiled shape each."""
  return 1 << max(n - 1, 0).bit_length()
