"""Which LoRA adapter sits in which runner slot: host bookkeeping, LRU, no device calls.

The runner has `max_loras` device slots; any number of adapters are
registered on the host. A running sequence with an adapter holds a reference
on the slot its adapter occupies. `acquire(adapter)`:
  1. the adapter is resident: one more reference (a hit, no device work);
  2. else a slot no running sequence uses — an empty one first, then the
     least recently used — is given to it and a *load* is queued; the
     scheduler hands queued loads to the runner in the next `StepPlan`
     (`lora_loads`), which writes the slot before anything of that step runs;
  3. else None: every slot is pinned by running requests of other adapters,
     and the sequence waits.
`forget(slot)` marks a slot's contents unknown (a step that was to load it
failed), so the next user reloads it.
"""

from __future__ import annotations

import itertools

from serving.types import LoraAdapter


class LoraSlots:
  """Slot residency and references (see module doc)."""

  def __init__(self, num_slots: int):
    self.num_slots = num_slots
    self.resident: list[LoraAdapter | None] = [None] * num_slots
    self.refs = [0] * num_slots
    self._last_used = [0] * num_slots
    self._clock = itertools.count(1)
    self._loads: list[tuple[int, LoraAdapter]] = []
    self.num_swaps = 0  # adapters written into a slot

  def acquire(self, adapter: LoraAdapter) -> int | None:
    """A slot holding `adapter` with a reference taken, or None (see module doc)."""
    slot = self._slot_of(adapter)
    if slot is None:
      idle = [s for s in range(self.num_slots) if self.refs[s] == 0]
      if not idle:
        return None
      slot = min(idle, key=lambda s: (self.resident[s] is not None, self._last_used[s]))
      self.resident[slot] = adapter
      self._loads = [(s, a) for s, a in self._loads if s != slot] + [(slot, adapter)]
      self.num_swaps += 1
    self.refs[slot] += 1
    self._last_used[slot] = next(self._clock)
    return slot

  def release(self, slot: int) -> None:
    if self.refs[slot] <= 0:
      raise AssertionError(f"LoRA slot {slot} released more often than acquired")
    self.refs[slot] -= 1

  def take_loads(self) -> list[tuple[int, LoraAdapter]]:
    """The loads queued since the last call (for the next step's plan)."""
    loads, self._loads = self._loads, []
    return loads

  def forget(self, slot: int) -> None:
    """The slot's device contents are unknown: its adapter must be loaded again."""
    if self.resident[slot] is not None and self.refs[slot] == 0:
      self.resident[slot] = None
    elif self.resident[slot] is not None:
      self._loads = [(s, a) for s, a in self._loads if s != slot] + [(slot,
                                                                       self.resident[slot])]

  def running_by_adapter(self) -> dict[str, int]:
    """Adapter name -> sequences holding it (resident adapters with users only)."""
    return {a.name: self.refs[s] for s, a in enumerate(self.resident)
            if a is not None and self.refs[s]}

  def _slot_of(self, adapter: LoraAdapter) -> int | None:
    for slot, resident in enumerate(self.resident):
      if resident is adapter:
        return slot
    return None
