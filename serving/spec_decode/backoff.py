"""When the engine speculates: `SpecBackoff`.

Speculation is not free. Drafts must be proposed from the latest tokens, so a
speculative step is scheduled only after the previous one has been
postprocessed: the host no longer prepares step N+1 while the device runs
step N. A verify call scores every draft position even when few are kept, and
a plain step between speculative ones may decode several tokens in one call
(multi-step). So the engine speculates only while it pays:

  * batch: while at most `speculative_max_batch` requests run (larger batches
    are compute-bound enough that overlap and batching win; vLLM's
    `disable_by_batch_size`);
  * acceptance: over the last `window` speculative steps, at least
    `min_accepted` draft tokens kept per decode row and step;
  * speed: over the last `window` speculative steps, at least as many tokens
    per second as the last `window` plain decode steps gave (the engine times
    both kinds, `record_time`). This compares what the machine actually does,
    whatever the model, the verify width or the load: a verify step that costs
    more than the tokens its kept drafts save loses. Until plain steps have
    been timed, the first full window pauses for `probe_steps` to time some.

Below either bar speculation pauses for `pause_steps` steps, then is tried
again. Each retry costs a window of slow steps, so the speed rule's pauses
double while they follow one another (up to `max_pause_factor` times
`pause_steps`): free text that speculation slows down pays 8 slow steps per
32, then per 64, 128, ... plain ones. A window found fast starts over at
`pause_steps`. docs/spec_decode.md has the measurements behind the defaults.
"""

from __future__ import annotations

import collections


class SpecBackoff:
  """Decides per step whether the engine speculates (module doc)."""

  def __init__(self, *, enabled: bool, max_batch: int, window: int = 8,
               min_accepted: float = 0.25, pause_steps: int = 32, probe_steps: int = 4,
               max_pause_factor: int = 16):
    self.enabled, self.max_batch = enabled, max_batch
    self.window, self.min_accepted, self.pause_steps = window, min_accepted, pause_steps
    self.probe_steps, self.max_pause_factor = probe_steps, max_pause_factor
    self._slow_factor = 1  # the next slow pause: pause_steps times this
    self._recent: collections.deque[tuple[int, int]] = collections.deque(maxlen=window)
    # (tokens, seconds) of the latest timed speculative and plain decode steps.
    self._spec_times: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
    self._plain_times: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
    self._paused = 0
    self.num_pauses = 0  # pauses for low acceptance
    self.num_slow_pauses = 0  # pauses because speculative steps gave fewer tokens/s

  def wants_step(self, num_running: int) -> bool:
    """Whether the next step speculates, given the requests running now."""
    if not self.enabled or not 0 < num_running <= self.max_batch:
      return False
    if self._paused:
      self._paused -= 1
      return False
    return True

  def record(self, rows: int, kept: int) -> None:
    """A speculative step's outcome: decode rows, drafts kept over all of them."""
    if rows <= 0:
      return
    self._recent.append((rows, kept))
    if len(self._recent) == self.window:
      total_rows = sum(r for r, _ in self._recent)
      if sum(k for _, k in self._recent) < self.min_accepted * total_rows:
        self._pause(self.pause_steps)
        self.num_pauses += 1

  def record_time(self, speculative: bool, tokens: int, seconds: float) -> None:
    """A decode-only step's tokens (over all rows) and wall time (the engine's time
    between two steps' results)."""
    if tokens <= 0 or seconds <= 0 or not self.enabled:
      return
    if not speculative:
      self._plain_times.append((tokens, seconds))
      return
    self._spec_times.append((tokens, seconds))
    if len(self._spec_times) < self.window:
      return
    if len(self._plain_times) < self.probe_steps:  # nothing to compare with yet: probe
      self._pause(self.probe_steps)
    elif _rate(self._spec_times) < _rate(self._plain_times):
      self._pause(self.pause_steps * self._slow_factor)
      self._slow_factor = min(2 * self._slow_factor, self.max_pause_factor)
      self.num_slow_pauses += 1
    else:
      self._slow_factor = 1
      self._spec_times.clear()  # the next window judges afresh

  def _pause(self, steps: int) -> None:
    self._paused = steps
    self._recent.clear()
    self._spec_times.clear()


def _rate(times: collections.deque[tuple[int, float]]) -> float:
  """Tokens per second over (tokens, seconds) samples."""
  return sum(t for t, _ in times) / sum(s for _, s in times)
