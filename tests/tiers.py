"""Test tiers: `python -m pytest -m "not slow"` is the fast tier, the whole suite is CI's.

Slow: real servers, notebooks, several processes, soak, fuzzing and the default
model end to end (marked per module or test with `pytest.mark.slow`). A grid
that repeats one check over many cases keeps one representative in the fast
tier and the rest in the full suite: `fast_first(values, fast=...)`.
"""

import pytest


def fast_first(values, fast):
  """Parametrize values: those in `fast` run in both tiers, the others only in the
  full suite (marked slow)."""
  missing = set(fast) - set(values)
  if missing:
    raise ValueError(f"fast values {sorted(missing)} are not among {list(values)}")
  return [v if v in fast else pytest.param(v, marks=pytest.mark.slow) for v in values]
