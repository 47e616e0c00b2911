"""A launcher engine factory for the disaggregated end-to-end test (tests/launch_with.py).

`killable_prefill_engine` builds the real engine from the launcher's flags
(`--prefill_workers=1 --decode_workers=1`) with the prefill worker's runner
wrapped: once the file named by $XLASERVE_TEST_KILL_FILE exists, that worker's
second KV page export from then on raises `RunnerDeadError` and every later
call does too — the prefill worker dies in the middle of a transfer, as a
killed worker's device would.
"""

from __future__ import annotations

import os

from runner_faults import FaultyRunner

from serving.entrypoints.engine_builder import build_engine


class _KillableRunner(FaultyRunner):
  def __init__(self, runner, trigger: str):
    super().__init__(runner)
    self.trigger, self.since = trigger, None

  def export_pages(self, pages):
    if self.since is None and os.path.exists(self.trigger):
      self.since = self.num_exports
      self.dead_export_from = self.since + 1
    return super().export_pages(pages)


def killable_prefill_engine(model: str, config):
  trigger = os.environ["XLASERVE_TEST_KILL_FILE"]
  made = []

  def wrap(runner):
    wrapped = _KillableRunner(runner, trigger) if not made else runner
    made.append(wrapped)
    return wrapped

  return build_engine(model, config, wrap_runner=wrap)
