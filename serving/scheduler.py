"""Host-side continuous-batching scheduler: plain Python, no device calls.

Lifecycle of a sequence:
  1. `add(seq)` queues it (WAITING).
  2. `schedule()` admits waiting sequences into free decode slots (FCFS),
     reusing cached prefix pages, and splits prompts into chunks within the
     per-step token budget (`max_num_batched_tokens`) after reserving one
     token per decoding sequence. It returns a `StepPlan` of prefill chunks
     and one decode batch, and only mutates host state.
  3. The engine runs the plan; one step later (host/device overlap) it calls
     `postprocess(plan, tokens)`, which appends sampled tokens and finishes
     sequences on EOS / stop ids / max_tokens / max_model_len.
  4. When pages run out, the most recently admitted running sequence is
     preempted (pages freed, back to the front of the queue) and later
     recomputed — requests are never failed for lack of memory.

Tokens sampled by an in-flight step are "pending": the next decode step
reads them on the device, so the host need not wait for them. A sequence
with a pending token cannot be (re)prefilled until that token arrives.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools

from serving.config import EngineConfig
from serving.page_allocator import PageAllocator, page_hash
from serving.types import FinishReason, SamplingParams


class Status(enum.Enum):
  WAITING = 1
  RUNNING = 2
  FINISHED = 3


@dataclasses.dataclass(eq=False)
class Sequence:
  request_id: str
  prompt_ids: list[int]
  params: SamplingParams
  eos_ids: frozenset[int] = frozenset()
  seed: int = 0
  output_ids: list[int] = dataclasses.field(default_factory=list)
  status: Status = Status.WAITING
  pages: list[int] = dataclasses.field(default_factory=list)
  page_hashes: list[bytes] = dataclasses.field(default_factory=list)
  num_computed: int = 0  # tokens whose KV is written (or being written)
  pending: int = 0  # tokens sampled by in-flight steps, not yet in output_ids
  slot: int | None = None
  finish_reason: FinishReason | None = None
  stop_reason: str | int | None = None  # the stop string or stop token id that ended it
  admit_order: int = 0

  @property
  def num_tokens(self) -> int:
    """Known tokens plus pending ones."""
    return len(self.prompt_ids) + len(self.output_ids) + self.pending

  @property
  def num_generated(self) -> int:
    return len(self.output_ids) + self.pending

  @property
  def in_prefill(self) -> bool:
    """Still has known tokens whose KV is not computed."""
    return self.num_computed < len(self.prompt_ids) + len(self.output_ids)

  def token_ids(self) -> list[int]:
    return self.prompt_ids + self.output_ids


@dataclasses.dataclass
class PrefillChunk:
  seq: Sequence
  start: int  # first position of the chunk
  end: int  # one past the last position
  sample: bool  # the chunk ends at the last known token: sample the next one


@dataclasses.dataclass
class StepPlan:
  prefills: list[PrefillChunk]
  decodes: list[Sequence]
  preempted: list[Sequence]

  @property
  def empty(self) -> bool:
    return not self.prefills and not self.decodes


class Scheduler:
  """Continuous batching over `max_num_seqs` slots (see module doc)."""

  def __init__(self, config: EngineConfig, allocator: PageAllocator):
    self.config = config
    self.allocator = allocator
    self.waiting: collections.deque[Sequence] = collections.deque()
    self.running: list[Sequence] = []
    self.free_slots = list(range(config.max_num_seqs - 1, -1, -1))
    self.num_preemptions = 0
    self.prefill_tokens_computed = 0
    self._order = itertools.count()

  def add(self, seq: Sequence) -> None:
    self.waiting.append(seq)

  def has_work(self) -> bool:
    return bool(self.waiting or self.running)

  def schedule(self) -> StepPlan:
    preempted: list[Sequence] = []
    decodes = self._schedule_decodes(preempted)
    budget = self.config.max_num_batched_tokens - len(decodes)
    prefills = []
    for seq in sorted(self.running, key=lambda s: s.admit_order):
      if budget <= 0:
        break
      if seq.status is not Status.RUNNING or not seq.in_prefill or seq.pending:
        continue
      end = min(seq.num_computed + budget, len(seq.prompt_ids) + len(seq.output_ids))
      protected = set(decodes) | {c.seq for c in prefills}
      if self._ensure_pages_or_preempt(seq, end, preempted, protected):
        prefills.append(self._chunk(seq, end))
        budget -= end - prefills[-1].start
    while budget > 0 and self.waiting and self.free_slots and not self.waiting[0].pending:
      seq = self.waiting[0]
      self._admit(seq)
      end = min(seq.num_computed + budget, len(seq.prompt_ids) + len(seq.output_ids))
      if not self._ensure_pages(seq, end):
        self._release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        break
      prefills.append(self._chunk(seq, end))
      budget -= end - prefills[-1].start
    self.prefill_tokens_computed += sum(c.end - c.start for c in prefills)
    return StepPlan(prefills=prefills, decodes=decodes, preempted=preempted)

  def _schedule_decodes(self, preempted: list[Sequence]) -> list[Sequence]:
    """One token for every running sequence past prefill; preempts if pages run out."""
    decodes = []
    candidates = sorted((s for s in self.running if not s.in_prefill), key=lambda s: s.admit_order)
    for seq in candidates:
      if seq.status is not Status.RUNNING or not self._wants_token(seq):
        continue
      # The input token sits at position num_tokens - 1.
      if self._ensure_pages_or_preempt(seq, seq.num_tokens, preempted, set(decodes)):
        decodes.append(seq)
    for seq in decodes:
      seq.num_computed = seq.num_tokens
      seq.pending += 1
    return decodes

  def _ensure_pages_or_preempt(self, seq: Sequence, num_tokens: int,
                               preempted: list[Sequence], protected: set[Sequence]) -> bool:
    """Pages for `num_tokens` tokens of a running seq, preempting the newest if needed.

    Sequences already in this step's plan (`protected`) are never victims.
    """
    while not self._ensure_pages(seq, num_tokens):
      victim = max((s for s in self.running if s not in protected),
                   key=lambda s: s.admit_order)
      self._preempt(victim)
      preempted.append(victim)
      if victim is seq:
        return False
    return True

  def _wants_token(self, seq: Sequence) -> bool:
    max_tokens = seq.params.max_tokens or self.config.max_model_len
    return seq.num_generated < max_tokens and seq.num_tokens < self.config.max_model_len

  def _admit(self, seq: Sequence) -> None:
    """Moves the head of the queue into a slot, sharing cached prefix pages.

    Requests with penalties skip the prefix cache: their on-device penalty
    state is rebuilt from the tokens of a prefill that starts at 0.
    """
    pages, hashes = ([], []) if _uses_penalties(seq.params) else self.allocator.match_prefix(
        seq.token_ids())
    seq.pages, seq.page_hashes = pages, hashes
    seq.num_computed = len(pages) * self.config.page_size
    seq.slot = self.free_slots.pop()
    seq.status = Status.RUNNING
    seq.admit_order = next(self._order)
    self.waiting.popleft()
    self.running.append(seq)

  def _chunk(self, seq: Sequence, end: int) -> PrefillChunk:
    """Prefill of known tokens [num_computed, end); pages must be allocated."""
    known = len(seq.prompt_ids) + len(seq.output_ids)
    chunk = PrefillChunk(seq=seq, start=seq.num_computed, end=end, sample=end == known)
    seq.num_computed = end
    if chunk.sample:
      seq.pending += 1
    self._commit_full_pages(seq, end)
    return chunk

  def _ensure_pages(self, seq: Sequence, num_tokens: int) -> bool:
    need = -(-num_tokens // self.config.page_size) - len(seq.pages)
    if need <= 0:
      return True
    pages = self.allocator.allocate(need)
    if pages is None:
      return False
    seq.pages.extend(pages)
    return True

  def _commit_full_pages(self, seq: Sequence, num_tokens: int) -> None:
    """Registers pages that `num_tokens` known tokens fill completely."""
    ps = self.config.page_size
    tokens = seq.token_ids()
    for i in range(len(seq.page_hashes), min(num_tokens, len(tokens)) // ps):
      parent = seq.page_hashes[-1] if seq.page_hashes else None
      h = page_hash(parent, tokens[i * ps:(i + 1) * ps])
      seq.page_hashes.append(h)
      self.allocator.commit(seq.pages[i], h)

  def _release(self, seq: Sequence) -> None:
    self.allocator.release(seq.pages)
    seq.pages, seq.page_hashes = [], []
    seq.num_computed = 0
    if seq.slot is not None:
      self.free_slots.append(seq.slot)
      seq.slot = None
    if seq in self.running:
      self.running.remove(seq)

  def _preempt(self, seq: Sequence) -> None:
    """Frees a running sequence's pages; it is recomputed later (front of the queue)."""
    self._release(seq)
    seq.status = Status.WAITING
    self.num_preemptions += 1
    self.waiting.appendleft(seq)

  def finish(self, seq: Sequence, reason: FinishReason) -> None:
    """Ends a sequence (stop, length, abort, error) and frees its pages and slot."""
    if seq.status is Status.FINISHED:
      return
    if seq.status is Status.WAITING and seq in self.waiting:
      self.waiting.remove(seq)
    self._release(seq)
    seq.status = Status.FINISHED
    seq.finish_reason = reason

  def postprocess(self, plan: StepPlan, prefill_tokens: list[int],
                  decode_tokens: list[int]) -> list[tuple[Sequence, int]]:
    """Applies a finished step's sampled tokens; returns (seq, token) appended."""
    results = []
    sampled = [c.seq for c in plan.prefills if c.sample]
    for seq, token in zip(sampled + plan.decodes, prefill_tokens + decode_tokens, strict=True):
      seq.pending -= 1
      if seq.status is Status.FINISHED:
        continue
      seq.output_ids.append(token)
      results.append((seq, token))
      reason = self._stop_reason(seq, token)
      if reason is not None:
        self.finish(seq, reason)
      elif seq.status is Status.RUNNING:
        self._commit_full_pages(seq, seq.num_computed)
    return results

  def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
    p = seq.params
    if token in p.stop_token_ids:
      seq.stop_reason = token
      return "stop"
    if not p.ignore_eos and token in seq.eos_ids:
      return "stop"
    max_tokens = p.max_tokens or self.config.max_model_len
    if len(seq.output_ids) >= max_tokens or seq.num_tokens >= self.config.max_model_len:
      return "length"
    return None


def _uses_penalties(p: SamplingParams) -> bool:
  return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
