"""`compile_events()`: the jax compile and trace events that happen inside a `with` block.

Tests of "nothing compiles after warm-up" run their workload inside it and
assert the list it yields stayed empty.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax


@contextlib.contextmanager
def compile_events() -> Iterator[list[str]]:
  events: list[str] = []

  def listener(name, *args, **kwargs):
    if "compile" in name or "trace" in name:
      events.append(name)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield events
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
