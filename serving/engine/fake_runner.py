"""`FakeRunner`: the engine's Runner interface with hand-computable tokens and no jax.

It stands in for `serving.runner.model_runner.ModelRunner` wherever the device is not the
thing under test (scheduler and engine tests, front-end servers) and runs a
step in microseconds. It keeps the device's bookkeeping on the host, so the
tests exercise the same contract a real runner relies on:

  * a KV pool `kv[page][offset]` into which every step writes the token ids
    of the positions it computes, through the sequence's pages, as the real
    step writes K/V;
  * before a token is produced, the sequence's whole context is read back
    from the pool through its pages (what attention reads) and checked
    against the tokens it must be: a scheduler or allocator bug that would
    make a real model read another request's KV (a wrong page, a page freed
    early, a poisoned prefix hash) raises `FakeKVError` instead of passing
    silently;
  * with a `window_group` (a hybrid model's sliding-window layers), a second
    pool in that group's own page ids, written through `Sequence.window_pages`;
    each query reads the positions its window covers back from it (a prefill
    chunk's first query included), so a window page released early, released
    twice, or handed to another sequence while still read raises `FakeKVError`
    as well, and so does a read through the dummy page 0;
  * per decode slot, the last sampled token (the next decode's input);
  * with `state_slots` (a model with linear-attention layers, whose per-sequence
    states live in the decode slot: serving/runner/state_cache.py), per slot the
    request and the tokens folded into its state: a sequence's first chunk
    (position 0) takes the slot over, every later chunk or decode token must find
    the slot holding its own request and exactly its positions before it, so a
    slot read by another sequence, a chunk resuming mid-sequence on a fresh slot
    (e.g. from a prefix-cache hit) or a state a failed step left half-updated and
    then resumed raises `FakeKVError`;
  * `export_pages` / `import_pages` copy pool entries between two runners
    (disaggregated serving) or through the tiered prefix cache (`gather_pages`,
    `kv_page_specs`), so a page imported into the wrong place, or never
    imported, fails the same check;
  * per LoRA slot, the adapter the plan's `lora_loads` put there. KV is
    written as (adapter id, token) — KV computed under an adapter differs
    from the base model's — and a sequence whose slot holds another adapter,
    or whose context holds another adapter's KV, raises `FakeKVError`.

Tokens: the output token at index i of a request is its prompt token at
`i % len(prompt)` *as read from the KV pool*, so "abc" with max_tokens=5
yields "abcab" — plus the adapter's `lora_id` under a LoRA adapter (mod the
vocabulary), so "abc" under adapter 1 yields "bcdbc"; its logprob is -0.5,
and top alternative k is `token + k` with logprob `-0.5 - k`. A multi-step decode row
(`DecodeRow.num_steps`) runs its iterations in order, each writing the token
the previous one sampled and reading its context back. `step_s` makes
each step take that long (in `fetch`), so front-end tests can watch requests
in flight.

A request with an output constraint (`Sequence.grammar`) is sampled in
`sample(handle=, masks=)`, as the real runner does: its token is the one above
unless the mask forbids it, then the next allowed id above it (wrapping).

A speculative plan verifies each row's drafts as the real verifier does with
greedy sampling: drafts are written to the pool at the positions after the
row's token, the row's context (drafts included) is read back before each
token, and drafts are kept while they equal the token above. Rows whose drafts
the runner proposes itself (a draft model: `num_drafts` without `drafts`) get
the right tokens except the last, which is off by one.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from serving.types import (
    DecodeRow,
    PrefillChunk,
    SampledToken,
    Sequence,
    StepPlan,
    StepResult,
    TokenLogprob,
    WindowGroup,
)


class FakeKVError(AssertionError):
  """A step read KV that is not its sequence's own (a page-accounting bug)."""


@dataclasses.dataclass
class _Handle:
  tokens: dict[str, list[SampledToken]]
  num_drafts: dict[str, int]
  # Constrained requests not sampled yet: request id -> (sequence, decode slot, preferred token).
  pending: dict[str, tuple[Sequence, int, int]] = dataclasses.field(default_factory=dict)
  # Constrained rows of a speculative step not verified yet: request id -> (row, drafts).
  pending_rows: dict[str, tuple[DecodeRow, list[int]]] = dataclasses.field(default_factory=dict)


class FakeRunner:
  """Runner interface over a host-side token pool (see module doc)."""

  def __init__(self, *, num_pages: int, page_size: int, max_num_seqs: int,
               vocab_size: int = 32000, step_s: float = 0.0,
               window_group: WindowGroup | None = None, state_slots: bool = False):
    self.num_pages, self.page_size, self.vocab_size = num_pages, page_size, vocab_size
    self.state_slots = state_slots
    # Per decode slot with state_slots: (request id, tokens folded into the slot's state).
    self.slot_states: list[tuple[str, list[int]] | None] = [None] * (max_num_seqs + 1)
    self.step_s = step_s
    self.window_group = window_group
    self.kv: list[list[tuple[int, int] | None]] = [[None] * page_size
                                                   for _ in range(num_pages)]
    self.window_kv: list[list[tuple[int, int] | None]] = [
        [None] * page_size for _ in range(window_group.num_pages if window_group else 0)]
    self.last_tokens: list[int] = [0] * (max_num_seqs + 1)
    self.lora_slots: dict[int, int] = {}  # slot -> lora_id written there
    self.num_steps = 0
    self.closed = False

  def warm_up(self) -> int:
    return 0

  def execute(self, *, plan: StepPlan) -> _Handle:
    tokens = {}
    for slot, adapter in plan.lora_loads:
      self.lora_slots[slot] = adapter.lora_id
    for chunk in plan.prefills:
      sampled = self._prefill(chunk)
      if sampled is not None:
        tokens[chunk.seq.request_id] = [sampled]
    num_drafts, rows = {}, {}
    constrained = set(plan.constrained)
    for row in plan.decodes:
      rid = row.seq.request_id
      if plan.speculative:
        drafts = self._write_drafts(row)
        num_drafts[rid] = row.num_drafts
        if rid in constrained:  # verified once its masks come
          rows[rid] = (row, drafts)
          constrained.discard(rid)
        else:
          tokens[rid] = self._verify(row.seq, row.position, drafts)
      else:
        tokens[rid] = self._decode(row)
    self.num_steps += 1
    pending = {rid: (seq, seq.decode_slot, tokens.pop(rid)[0].token_id) for seq in plan.sampled
               if (rid := seq.request_id) in constrained}
    return _Handle(tokens, num_drafts, pending, rows)

  def sample(self, *, handle: _Handle, masks: dict[str, Any]) -> None:
    """Samples the constrained requests: the preferred token, or the next one allowed."""
    for rid, (seq, slot, token) in handle.pending.items():
      token = self._allowed(token, masks.get(rid))
      self.last_tokens[slot] = token
      handle.tokens[rid] = [SampledToken(token_id=token, logprob=self._logprob(seq, token))]
    for rid, (row, drafts) in handle.pending_rows.items():
      handle.tokens[rid] = self._verify(row.seq, row.position, drafts, masks.get(rid))
    handle.pending, handle.pending_rows = {}, {}

  def _allowed(self, token: int, mask) -> int:
    """`token` if the packed `mask` allows it (or there is none), else the next allowed id."""
    if mask is None:
      return token
    bits = np.unpackbits(np.asarray(mask, np.int32).view(np.uint8),
                         bitorder="little")[:self.vocab_size]
    allowed = np.flatnonzero(bits)
    if not allowed.size:
      return token
    above = allowed[allowed >= token]
    return int(above[0] if above.size else allowed[0])

  def fetch(self, *, handle: _Handle) -> StepResult:
    if handle.pending or handle.pending_rows:
      raise RuntimeError("fetch of a step whose constrained rows were never sampled")
    if self.step_s:
      time.sleep(self.step_s)
    return StepResult(tokens=handle.tokens, num_drafts=handle.num_drafts)

  def close(self) -> None:
    self.closed = True

  # ---- KV pages between engines (disaggregated serving) ----

  def export_pages(self, pages: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The pool's entries of `pages` as ModelRunner's layout [1 layer, n, page_size, 2]
    ((adapter id, token) per slot, -1 where nothing was written), twice (K and V)."""
    data = np.full((1, len(pages), self.page_size, 2), -1, np.int64)
    for i, page in enumerate(pages):
      for off, entry in enumerate(self.kv[page]):
        if entry is not None:
          data[0, i, off] = entry
    return data, data.copy()

  def gather_pages(self, pages: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """`export_pages` (the tiered prefix cache's asynchronous gather: here at once)."""
    return self.export_pages(pages)

  def kv_page_specs(self) -> list[tuple[tuple[int, ...], np.dtype]]:
    """One page's stored K and V: a slot of `export_pages`' output."""
    return [((1, self.page_size, 2), np.dtype(np.int64))] * 2

  def kv_page_spec(self) -> tuple[tuple[int, ...], str, str]:
    """One exported page: [1 layer, page_size, 2] entries, sent as int32."""
    return (1, self.page_size, 2), "int32", f"fake vocab={self.vocab_size}"

  def import_pages(self, pages: list[int], k: np.ndarray, v: np.ndarray) -> None:
    """Slot i of `export_pages` output into page pages[i]; 0 skips the slot."""
    if k.shape[0] != 1 or k.shape[1] < len(pages) or not np.array_equal(k, v):
      raise ValueError(f"KV pages of shape {k.shape} do not fit this pool")
    for i, page in enumerate(pages):
      if page:
        self.kv[page] = [None if e[1] < 0 else (int(e[0]), int(e[1])) for e in k[0, i]]

  # ---- one sequence ----

  def _prefill(self, chunk: PrefillChunk) -> SampledToken | None:
    seq, known = chunk.seq, chunk.seq.token_ids()
    for pos in range(chunk.start, chunk.end):
      self._write(seq, pos, known[pos])
      self._fold_state(seq, pos, known[pos])
    self._check_window(seq, chunk.start, chunk.end, [])
    if not chunk.sample:
      return None
    return self._sample(seq, chunk.end)

  def _decode(self, row: DecodeRow) -> list[SampledToken]:
    """A decode row's tokens: one, or `num_steps` of a multi-step call, each iteration
    writing the token the one before sampled."""
    seq, run = row.seq, []
    # The run's tokens extend the context checked only when the host knows every token
    # before them (not while an earlier step's tokens are in flight).
    known = len(seq.token_ids()) == row.position + 1
    for j in range(row.num_steps):
      self._write(seq, row.position + j, self.last_tokens[seq.decode_slot])
      self._fold_state(seq, row.position + j, self.last_tokens[seq.decode_slot])
      run.append(self._sample(seq, row.position + 1 + j,
                              [t.token_id for t in run] if known else ()))
    return run

  def _fold_state(self, seq: Sequence, pos: int, token: int) -> None:
    """With state slots: the token at `pos` updates the sequence's slot state, which must
    hold this request's positions [0, pos) (position 0 takes the slot over)."""
    if not self.state_slots:
      return
    slot, rid = seq.decode_slot, seq.request_id
    if pos == 0:
      self.slot_states[slot] = (rid, [])
    owner, folded = self.slot_states[slot] or (None, [])
    expected = seq.token_ids()[:pos]
    if owner != rid or len(folded) != pos or folded[:len(expected)] != expected:
      raise FakeKVError(f"{rid}: state slot {slot} holds {owner!r} after {len(folded)} "
                        f"tokens, but position {pos} needs this request's first {pos}")
    folded.append(token)

  def _write_drafts(self, row: DecodeRow) -> list[int]:
    """A speculative row's forward: writes its token and drafts; returns the drafts."""
    if self.state_slots:
      raise FakeKVError(f"{row.seq.request_id}: a speculative step on a state-slot model")
    seq, p = row.seq, row.position
    drafts = list(row.drafts) if row.drafts else self._device_drafts(seq, p, row.num_drafts)
    for j, token in enumerate([self.last_tokens[seq.decode_slot]] + drafts):
      self._write(seq, p + j, token)
    return drafts

  def _verify(self, seq: Sequence, p: int, drafts: list[int], masks=None) -> list[SampledToken]:
    """A speculative row's tokens: its drafts kept while right, then the token after them;
    `masks` [S, W]: position j's token is moved to the next id its mask allows."""
    run = []
    for j in range(len(drafts) + 1):
      sampled = self._sample(seq, p + 1 + j, drafts[:j])
      if masks is not None:
        token = self._allowed(sampled.token_id, masks[j])
        self.last_tokens[seq.decode_slot] = token
        sampled = SampledToken(token_id=token, logprob=self._logprob(seq, token))
      run.append(sampled)
      if j == len(drafts) or drafts[j] != sampled.token_id:
        break
    return run

  def _device_drafts(self, seq: Sequence, position: int, n: int) -> list[int]:
    """What a draft model proposes here: the true next tokens, the last one off by one."""
    n_prompt = len(seq.prompt_ids)
    lora_id = self._lora_id(seq)
    true = [(seq.prompt_ids[(position + j - n_prompt) % n_prompt] + lora_id)
            % self.vocab_size for j in range(1, n + 1)]
    return true[:-1] + [(true[-1] + 1) % self.vocab_size] if true else []

  def _write(self, seq: Sequence, pos: int, token: int) -> None:
    entry = (self._lora_id(seq), token)
    pools = [(self.kv, seq.pages)]
    if self.window_group is not None:
      pools.append((self.window_kv, seq.window_pages))
    for pool, pages in pools:
      page, offset = _page_of(pages, pos, self.page_size), pos % self.page_size
      if page == 0:
        raise FakeKVError(f"{seq.request_id}: position {pos} maps to the reserved page 0")
      pool[page][offset] = entry

  def _check_window(self, seq: Sequence, query: int, length: int, drafts: list[int]) -> None:
    """The sliding-window layers' read of queries from position `query` on (keys up to
    `length`): positions (query - window, length) through the window pages."""
    if self.window_group is None:
      return
    lora_id, ps = self._lora_id(seq), self.page_size
    tokens = seq.token_ids() + list(drafts)
    for p in range(max(0, query - self.window_group.window + 1), min(length, len(tokens))):
      page = _page_of(seq.window_pages, p, ps)
      got = self.window_kv[page][p % ps] if page else None
      if got != (lora_id, tokens[p]):
        raise FakeKVError(f"{seq.request_id}: window KV of position {p} read back as {got} "
                          f"(page {page}) but the sequence holds {(lora_id, tokens[p])}")

  def _lora_id(self, seq: Sequence) -> int:
    """The adapter the sequence computes with: the one in its slot, checked."""
    if seq.lora is None:
      return 0
    resident = self.lora_slots.get(seq.lora_slot)
    if resident != seq.lora.lora_id:
      raise FakeKVError(f"{seq.request_id}: adapter {seq.lora.lora_id} expected in LoRA slot "
                        f"{seq.lora_slot}, which holds {resident}")
    return resident

  def _sample(self, seq: Sequence, length: int, drafts: list[int] = ()) -> SampledToken:
    """The token after the first `length` positions (the sequence's tokens, then
    `drafts`), from the context read back."""
    lora_id = self._lora_id(seq)
    context = [self.kv[seq.pages[p // self.page_size]][p % self.page_size]
               for p in range(length)]
    expected = [(lora_id, t) for t in (seq.token_ids() + list(drafts))[:length]]
    if context[:len(expected)] != expected:
      raise FakeKVError(f"{seq.request_id}: KV read back {context[:len(expected)]} "
                        f"but the sequence holds {expected}")
    self._check_window(seq, length - 1, length, drafts)
    n_prompt = len(seq.prompt_ids)
    index = length - n_prompt  # output index of the token sampled now
    token = (context[index % n_prompt][1] + lora_id) % self.vocab_size
    self.last_tokens[seq.decode_slot] = token
    return SampledToken(token_id=token, logprob=self._logprob(seq, token))

  def _logprob(self, seq: Sequence, token: int) -> TokenLogprob | None:
    n = seq.params.logprobs
    if n is None:
      return None
    top = [((token + k) % self.vocab_size, -0.5 - k) for k in range(n)]
    return TokenLogprob(token, -0.5, top)


def _page_of(pages: list[int], pos: int, page_size: int) -> int:
  """The page of `pages` holding position `pos` (0, the dummy page, past the list)."""
  i = pos // page_size
  return pages[i] if i < len(pages) else 0
