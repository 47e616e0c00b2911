"""When the engine speculates: `SpecBackoff`.

Speculation is not free. Drafts must be proposed from the latest tokens, so a
speculative step is scheduled only after the previous one has been
postprocessed: the host no longer prepares step N+1 while the device runs
step N. And a verify call scores every draft position even when few are kept.
So the engine speculates only while it pays:

  * batch: while at most `speculative_max_batch` requests run (larger batches
    are compute-bound enough that overlap and batching win; vLLM's
    `disable_by_batch_size`);
  * acceptance: over the last `window` speculative steps, at least
    `min_accepted` draft tokens kept per decode row and step; below that
    (free text the n-gram proposer cannot predict) speculation pauses for
    `pause_steps` steps, then is tried again.

docs/spec_decode.md has the measurements behind the defaults.
"""

from __future__ import annotations

import collections


class SpecBackoff:
  """Decides per step whether the engine speculates (module doc)."""

  def __init__(self, *, enabled: bool, max_batch: int, window: int = 8,
               min_accepted: float = 0.25, pause_steps: int = 32):
    self.enabled, self.max_batch = enabled, max_batch
    self.window, self.min_accepted, self.pause_steps = window, min_accepted, pause_steps
    self._recent: collections.deque[tuple[int, int]] = collections.deque(maxlen=window)
    self._paused = 0
    self.num_pauses = 0

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
        self._paused = self.pause_steps
        self.num_pauses += 1
        self._recent.clear()
