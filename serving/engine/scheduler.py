"""Host-side continuous-batching scheduler: plain Python, no device calls.

Lifecycle of a sequence:
  1. `add(seq)` queues it (WAITING).
  2. `schedule()` admits waiting sequences into free decode slots (FCFS),
     reusing cached prefix pages, and splits prompts into chunks within the
     per-step token budget (`max_num_batched_tokens`) after reserving one
     token per decoding sequence. It returns a `StepPlan` of prefill chunks
     and one decode batch, and only mutates host state.
  3. The engine runs the plan; one step later (host/device overlap) it calls
     `postprocess(plan, result)`, which appends sampled tokens, finishes
     sequences on EOS / stop ids / max_tokens / max_model_len, and only then
     publishes the prefix hashes of pages the step filled: a page is never
     shared before the step that writes it has completed, so a failed step
     leaves no hash behind (its pages are freed by `finish(seq, "error")`).
  4. When pages run out, the most recently admitted running sequence is
     preempted (pages freed, back to the front of the queue) and later
     recomputed — requests are never failed for lack of memory.
  5. A request with a LoRA adapter is admitted only when its adapter holds
     (or can take) a runner slot (lora_slots.py); until then later requests
     pass it. The plan carries the slot loads the runner must do first. Its
     prefix hashes are rooted in the adapter (`Sequence.cache_salt`), so KV
     computed under one adapter is never shared with another or the base.

Tokens sampled by an in-flight step are "pending": the next decode step
reads them on the device, so the host need not wait for them. A sequence
with a pending token cannot be (re)prefilled until that token arrives.

Speculative decoding (`schedule(speculate=True)`, docs/spec_decode.md): each
decode row with no pending token gets up to `num_speculative_tokens` drafts
from the proposer (host proposers read the row's tokens; the draft model's
are proposed by the runner on the device), capped so that the row cannot
pass max_tokens or max_model_len, with pages for the draft positions. A step
brings back a run of tokens per row (kept drafts + one); `postprocess`
appends them one by one and stops at the first stop condition, and
publishes only pages whose KV was written for tokens that were kept.

Hybrid models (`window` set: a `WindowPages` group for the sliding-window
layers, docs/engine.md "Hybrid attention"): every step also gives a sequence
the window pages its queries read, and pages behind the window go back to that
group — once their prefix hash is published (postprocess), so that they stay
cached for a later prefix hit, or at once without prefix caching. A cached
prefix counts only as far as the window group still holds its last window.

Tiered prefix cache (`offload`, serving/engine/kv_offload.py): admission
continues a sequence's cached prefix in the host / disk tier; the pages found
there get fresh pages, count as computed, and the plan carries their reload
(`StepPlan.kv_reloads`), which the engine writes before the step runs. Their
hashes are published with the step's other pages. A reload that fails takes
its sequence out of the step (`drop_reload`): it is readmitted and recomputes
that prefix. Pages only the disk tier holds are read ahead by the tiers' reader
thread from the moment a request arrives (`KVOffload.prefetch`); a request whose
reads are not done yet is passed over (the requests behind it are admitted) for at
most `prefetch_wait_s` after its arrival, then admitted with what arrived.

Multi-step decoding (`num_decode_steps` = k > 1, docs/multi_step.md): when
only decode rows run, nothing waits in the queue, the step does not
speculate (a host proposer, ngram or suffix, between speculative steps: the
back-off's pauses and batches past `speculative_max_batch`; never with a
draft model, whose K/V must follow every token), no row follows a grammar,
at most `decode_steps_max_batch` rows decode and each can
take k more tokens (max_tokens, max_model_len), every row runs k decode
iterations in the step's one device call. The row gets pages for the k
positions, k pending tokens, and brings back a run of k tokens, cut like a
speculative run at the first stop condition. Host/device overlap is kept:
the next step is planned from the k pending tokens.
"""

from __future__ import annotations

import collections
import itertools

from serving.config import EngineConfig
from serving.engine.kv_offload import KVOffload
from serving.engine.lora_slots import LoraSlots
from serving.engine.page_allocator import PageAllocator, WindowPages, page_hash
from serving.spec_decode import Proposer
from serving.types import (
  DecodeRow,
  FinishReason,
  KVReload,
  PrefillChunk,
  SampledToken,
  SamplingParams,
  Sequence,
  StepPlan,
  StepResult,
)
from serving.types import SequenceStatus as Status


class Scheduler:
  """Continuous batching over `max_num_seqs` slots (see module doc)."""

  def __init__(self, config: EngineConfig, allocator: PageAllocator,
               lora_slots: LoraSlots | None = None, proposer: Proposer | None = None,
               window: WindowPages | None = None, offload: KVOffload | None = None):
    self.config = config
    self.offload = offload  # the tiered prefix cache's host / disk tiers
    self.allocator = allocator
    self.window = window  # a hybrid model's sliding-window page group
    self.lora_slots = lora_slots
    self.proposer = proposer  # speculative decoding's draft source (serving/spec_decode)
    self.waiting: collections.deque[Sequence] = collections.deque()
    self.running: list[Sequence] = []
    self.free_slots = list(range(config.scheduler.max_num_seqs - 1, -1, -1))
    self.num_preemptions = 0
    self.prefill_tokens_computed = 0
    self._order = itertools.count()

  def add(self, seq: Sequence) -> None:
    """Queues a sequence (and starts reading its disk-tier pages ahead, if any)."""
    self.waiting.append(seq)
    self._awaits_prefetch(seq)

  def _awaits_prefetch(self, seq: Sequence) -> bool:
    """True while the offload tiers read the sequence's disk pages ahead of its
    admission (bounded: `KVOffload.prefetch`); it starts the reads not started yet."""
    return (self.offload is not None and not _uses_penalties(seq.params)
            and not seq.offload_failed and self.offload.prefetch(seq, self.allocator.holds))

  def waiting_by_adapter(self) -> dict[str, int]:
    """LoRA adapter name -> waiting requests under it (adapters with waiting requests only).
    Safe from another thread: `list()` copies the queue in one step."""
    return dict(collections.Counter(s.lora.name for s in list(self.waiting) if s.lora is not None))

  def schedule(self, speculate: bool = False) -> StepPlan:
    """The next step's plan (host state only; see module doc). `speculate`: propose
    drafts for the decode rows (the engine's back-off decides)."""
    decodes = self._schedule_decodes(speculate)
    budget = self.config.scheduler.max_num_batched_tokens - sum(1 + r.num_drafts for r in decodes)
    prefills: list[PrefillChunk] = []
    for seq in sorted(self.running, key=lambda s: s.admit_order):
      if budget <= 0:
        break
      if (seq.status is not Status.RUNNING or not seq.in_prefill or seq.pending
          or _decodable(seq)):
        continue
      end = min(seq.num_computed + budget, seq.num_known)
      protected = {r.seq for r in decodes} | {c.seq for c in prefills}
      if self._ensure_pages_or_preempt(seq, end, protected):
        prefills.append(self._chunk(seq, end))
        budget -= end - prefills[-1].start
    reloads: list[KVReload] = []
    passed: list[Sequence] = []  # waiting for a LoRA slot: later requests go first
    while budget > 0 and self.waiting and self.free_slots and not self.waiting[0].pending:
      seq = self.waiting[0]
      if self._awaits_prefetch(seq) or not self._admit(seq):
        passed.append(self.waiting.popleft())
        continue
      end = min(seq.num_computed + budget, seq.num_known)
      if not self._ensure_pages(seq, end):
        self._release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        break
      prefills.append(self._chunk(seq, end))
      budget -= end - prefills[-1].start
      if seq.kv_reload is not None:
        self.offload.record(seq.kv_reload)
        if seq.kv_reload.pages:
          reloads.append(seq.kv_reload)
        seq.kv_reload = None
    self.waiting.extendleft(reversed(passed))
    self.prefill_tokens_computed += sum(c.end - c.start for c in prefills)
    loads = self.lora_slots.take_loads() if self.lora_slots is not None else []
    return StepPlan(prefills=prefills, decodes=decodes, lora_loads=loads,
                    speculative=any(r.num_drafts for r in decodes),
                    decode_steps=decodes[0].num_steps if decodes else 1, kv_reloads=reloads)

  def _decode_steps(self, speculate: bool) -> int:
    """Decode iterations for the next step's rows: `num_decode_steps` when nothing
    else needs the device soon (see module doc), else 1."""
    k = self.config.scheduler.num_decode_steps
    if k == 1 or speculate or self.waiting or not self.running:
      return 1
    if self.proposer is not None and self.proposer.on_device:  # the draft needs every K/V
      return 1
    if len(self.running) > self.config.scheduler.decode_steps_max_batch:
      return 1
    for seq in self.running:
      if (seq.status is not Status.RUNNING or seq.grammar is not None
          or (seq.in_prefill and not _decodable(seq))):
        return 1
      max_tokens = seq.params.max_tokens or self.config.scheduler.max_model_len
      if (seq.num_generated + k > max_tokens
          or seq.num_tokens + k > self.config.scheduler.max_model_len):
        return 1
    return k

  def _schedule_decodes(self, speculate: bool) -> list[DecodeRow]:
    """One token (plus drafts when speculating; `num_decode_steps` tokens in a multi-step
    call) for every running sequence past prefill; preempts if pages run out. A step
    asked to speculate whose rows got no drafts at all is a plain one, multi-step where
    `_decode_steps` allows it: a proposer that finds nothing costs no single steps."""
    decodes: list[DecodeRow] = []
    candidates = sorted((s for s in self.running if not s.in_prefill or _decodable(s)),
                        key=lambda s: s.admit_order)
    candidates = [s for s in candidates if s.status is Status.RUNNING and self._wants_token(s)]
    speculate = (speculate and self.proposer is not None
                 and len(candidates) <= self.config.speculative.speculative_max_batch)
    proposals = {s: self._propose(s) for s in candidates if speculate and not s.pending}
    if not any(n for _, n in proposals.values()):
      proposals = {}
    steps = self._decode_steps(bool(proposals))
    for seq in candidates:
      if seq.status is not Status.RUNNING:  # preempted for an earlier row's pages
        continue
      drafts, n = proposals.get(seq, ([], 0))
      # The input token sits at position num_tokens - 1; drafts (or the inputs of a
      # multi-step call's later iterations) at the positions after it.
      ahead = max(n, steps - 1)
      if self._ensure_pages_or_preempt(seq, seq.num_tokens + ahead, {r.seq for r in decodes}):
        decodes.append(DecodeRow(seq=seq, position=seq.num_tokens - 1, drafts=drafts,
                                 num_drafts=n, num_steps=steps))
    for row in decodes:
      row.seq.num_computed = row.position + row.num_steps
      row.seq.pending += row.num_steps
    return decodes

  def _propose(self, seq: Sequence) -> tuple[list[int], int]:
    """(host drafts, number of drafts) for a decode row whose tokens are all known."""
    max_tokens = seq.params.max_tokens or self.config.scheduler.max_model_len
    k = min(self.config.speculative.num_speculative_tokens, max_tokens - seq.num_generated - 1,
            self.config.scheduler.max_model_len - seq.num_tokens - 1)
    if k <= 0:
      return [], 0
    if self.proposer.on_device:  # the runner's draft model fills them in
      # ...unseen by the host, so not checked against an output constraint: none then.
      return ([], 0) if seq.grammar is not None else ([], k)
    drafts = list(self.proposer.propose(seq.request_id, seq.token_ids(), k))[:k]
    if seq.grammar is not None:  # only drafts the constraint allows (masks follow them)
      drafts = drafts[:seq.grammar.valid_prefix(drafts)]
    return drafts, len(drafts)

  def _ensure_pages_or_preempt(self, seq: Sequence, num_tokens: int,
                               protected: set[Sequence]) -> bool:
    """Pages for `num_tokens` tokens of a running seq, preempting the newest if needed.

    Sequences already in this step's plan (`protected`) are never victims.
    """
    while not self._ensure_pages(seq, num_tokens):
      victim = max((s for s in self.running if s not in protected),
                   key=lambda s: s.admit_order)
      self._preempt(victim)
      if victim is seq:
        return False
    return True

  def _wants_token(self, seq: Sequence) -> bool:
    max_tokens = seq.params.max_tokens or self.config.scheduler.max_model_len
    return seq.num_generated < max_tokens and seq.num_tokens < self.config.scheduler.max_model_len

  def _admit(self, seq: Sequence) -> bool:
    """Moves the head of the queue into a slot, sharing cached prefix pages; False
    (nothing changed) when its LoRA adapter can get no runner slot now.

    Requests with penalties skip the prefix cache: their on-device penalty
    state is rebuilt from the tokens of a prefill that starts at 0.
    """
    if seq.lora is not None:
      if self.lora_slots is None:
        raise ValueError(f"{seq.request_id}: LoRA adapter {seq.lora.name!r} but LoRA is off")
      seq.lora_slot = self.lora_slots.acquire(seq.lora)
      if seq.lora_slot is None:
        return False
    pages, hashes = ([], []) if _uses_penalties(seq.params) else self._match_prefix(seq)
    seq.pages, seq.page_hashes = pages, hashes
    seq.num_computed = len(pages) * self.config.cache.page_size
    if self.offload is not None and not _uses_penalties(seq.params) and not seq.offload_failed:
      self._match_offloaded(seq)
    seq.decode_slot = self.free_slots.pop()
    seq.status = Status.RUNNING
    seq.admit_order = next(self._order)
    self.waiting.popleft()
    self.running.append(seq)
    return True

  def _match_prefix(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
    """The sequence's cached prefix (pages, hashes), referenced; with a window group, cut
    to where that group still holds the last window (its pages go to `window_pages`)."""
    tokens = seq.token_ids()
    if self.window is None:
      return self.allocator.match_prefix(tokens, seq.cache_salt)
    pages, hashes = self.allocator.match_prefix(tokens, seq.cache_salt, count=False)
    k, seq.window_pages = self.window.match(hashes)
    self.allocator.release(pages[k:])
    stats = self.allocator.stats
    stats.queries += len(tokens) if self.allocator.enable_prefix_caching else 0
    stats.hits += k * self.config.cache.page_size
    return pages[:k], hashes[:k]

  def _match_offloaded(self, seq: Sequence) -> None:
    """Continues the sequence's cached prefix in the offload tiers: the pages found there
    get fresh device pages and a reload (`seq.kv_reload`, counted once admitted) and
    count as computed; without free pages for them, none."""
    ps = self.config.cache.page_size
    parent = seq.page_hashes[-1] if seq.page_hashes else seq.cache_salt
    reload = self.offload.match(seq, parent, len(seq.pages), (seq.num_known - 1) // ps)
    fresh = self.allocator.allocate(len(reload.arrays))
    if fresh is None:  # no room: recomputed instead
      reload = KVReload(seq=seq, pages=[], arrays=[], tiers=[])
    seq.kv_reload = reload
    reload.pages = fresh or []
    seq.pages.extend(reload.pages)
    seq.num_computed = len(seq.pages) * ps

  def drop_reload(self, plan: StepPlan, reload: KVReload) -> None:
    """Takes a sequence whose reload failed out of the planned step (its chunk was not
    dispatched): it goes back to the front of the queue and, readmitted, recomputes
    what the reload would have brought."""
    seq = reload.seq
    for chunk in [c for c in plan.prefills if c.seq is seq]:
      plan.prefills.remove(chunk)
      seq.pending -= chunk.sample
      self.prefill_tokens_computed -= chunk.end - chunk.start
    plan.kv_reloads.remove(reload)
    seq.offload_failed = True
    self._preempt(seq, count=False)

  def _chunk(self, seq: Sequence, end: int) -> PrefillChunk:
    """Prefill of known tokens [num_computed, end); pages must be allocated."""
    chunk = PrefillChunk(seq=seq, start=seq.num_computed, end=end, sample=end == seq.num_known,
                         admission=seq.admit_order)
    seq.num_computed = end
    if chunk.sample:
      seq.pending += 1
    return chunk

  def _ensure_pages(self, seq: Sequence, num_tokens: int) -> bool:
    """Pages for the first `num_tokens` positions (and, with a window group, the window
    pages of positions from `num_computed` on); False if a group has too few free."""
    need = -(-num_tokens // self.config.cache.page_size) - len(seq.pages)
    if need > 0:
      pages = self.allocator.allocate(need)
      if pages is None:
        return False
      seq.pages.extend(pages)
    if self.window is None:
      return True
    self._release_behind_window(seq)
    return self.window.ensure(seq.window_pages, seq.num_computed, num_tokens)

  def _release_behind_window(self, seq: Sequence) -> None:
    """Window pages no query from `num_computed` on reads go back to the group: those
    whose prefix hash is published (kept cached for later prefix hits), or all of them
    without prefix caching."""
    limit = len(seq.page_hashes) if self.window.allocator.enable_prefix_caching else len(
        seq.window_pages)
    self.window.release_behind(seq.window_pages, seq.num_computed, limit)

  def _commit_full_pages(self, seq: Sequence, num_tokens: int) -> None:
    """Publishes the prefix hashes of pages whose first `num_tokens` positions hold
    written KV of known tokens (called only after the writing step completed)."""
    ps = self.config.cache.page_size
    tokens = seq.token_ids()
    for i in range(len(seq.page_hashes), min(num_tokens, len(tokens)) // ps):
      parent = seq.page_hashes[-1] if seq.page_hashes else seq.cache_salt
      h = page_hash(parent, tokens[i * ps:(i + 1) * ps])
      seq.page_hashes.append(h)
      self.allocator.commit(seq.pages[i], h, parent, tokens[i * ps:(i + 1) * ps])
      if self.window is not None and seq.window_pages[i]:
        self.window.allocator.commit(seq.window_pages[i], h, parent, tokens[i * ps:(i + 1) * ps])
    if self.window is not None:
      self._release_behind_window(seq)

  def _release(self, seq: Sequence) -> None:
    self.allocator.release(seq.pages)
    if self.window is not None:
      self.window.release_all(seq.window_pages)
    seq.token_on_device = False
    seq.kv_reload = None
    seq.pages, seq.page_hashes = [], []
    seq.num_computed = 0
    if seq.decode_slot is not None:
      self.free_slots.append(seq.decode_slot)
      seq.decode_slot = None
    if seq.lora_slot is not None:
      self.lora_slots.release(seq.lora_slot)
      seq.lora_slot = None
    if seq in self.running:
      self.running.remove(seq)

  def _preempt(self, seq: Sequence, count: bool = True) -> None:
    """Frees a running sequence's pages; it is recomputed later (front of the queue)."""
    self._release(seq)
    seq.status = Status.WAITING
    self.num_preemptions += count
    self.waiting.appendleft(seq)

  def finish(self, seq: Sequence, reason: FinishReason) -> None:
    """Ends a sequence (stop, length, abort, error) and frees its pages and slot."""
    if seq.status is Status.FINISHED:
      return
    if seq.status is Status.WAITING and seq in self.waiting:
      self.waiting.remove(seq)
    if self.proposer is not None:
      self.proposer.finish(seq.request_id, seq.output_ids)
    self._release(seq)
    seq.status = Status.FINISHED
    seq.finish_reason = reason

  def postprocess(self, plan: StepPlan,
                  result: StepResult) -> list[tuple[Sequence, list[SampledToken]]]:
    """Applies a completed step: appends its tokens (a run per speculative row, cut at
    the first stop condition), publishes the pages it filled; returns each sequence's
    appended tokens, in plan order.

    Tokens are appended only if the sequence still holds exactly the tokens they were
    sampled after: when an earlier step failed and rolled the sequence back, a later
    step already in flight sampled from a token that was never kept, and its tokens
    are dropped (the sequence is recomputed).
    """
    appended = []
    kept: dict[Sequence, int] = {}  # tokens of a run whose KV the step wrote, past the first
    # KV the step wrote, by sequence (without kept drafts); a sequence that finishes
    # here publishes it before its pages are released, so a later request can reuse it.
    wrote = {r.seq: r.position + 1 for r in plan.decodes}
    wrote.update({c.seq: c.end for c in plan.prefills if c.admission == c.seq.admit_order})
    sampled = [(c.seq, c.end, 1) for c in plan.prefills if c.sample]
    sampled += [(r.seq, r.position + 1, r.num_steps) for r in plan.decodes]
    for seq, context, steps in sampled:
      seq.pending -= steps
      if seq.status is Status.FINISHED or seq.num_known != context:
        continue
      run = []
      for token in result.tokens[seq.request_id]:
        seq.output_ids.append(token.token_id)
        run.append(token)
        reason = self._stop_reason(seq, token.token_id)
        if reason is not None:
          if seq in wrote and seq.status is Status.RUNNING:
            # A multi-step run wrote the KV of its tokens before the stop too.
            end = wrote[seq] + (len(run) - 1 if steps > 1 else 0)
            self._commit_full_pages(seq, end)
          self.finish(seq, reason)
          break
      appended.append((seq, run))
      seq.token_on_device = seq.status is Status.RUNNING
      if seq.status is not Status.RUNNING or len(run) < 2:
        continue
      if steps > 1:  # num_computed counted the whole run when it was planned
        kept[seq] = len(run) - 1
      elif seq.num_computed == context:  # kept drafts of a speculative row: KV valid
        seq.num_computed += len(run) - 1
        kept[seq] = len(run) - 1
    # Written KV: prefill chunks up to their end, decode rows up to their input position
    # (plus the drafts kept, or a multi-step run's inputs). A sequence preempted since the
    # plan (and maybe readmitted on new pages) publishes nothing; decode rows cannot be
    # readmitted before their token arrives.
    written = [(c.seq, c.end) for c in plan.prefills if c.admission == c.seq.admit_order]
    written += [(r.seq, r.position + 1 + kept.get(r.seq, 0)) for r in plan.decodes]
    for seq, end in written:
      if seq.status is Status.RUNNING:
        self._commit_full_pages(seq, end)
    return appended

  def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
    p = seq.params
    if token in p.stop_token_ids:
      seq.stop_reason = token
      return "stop"
    if not p.ignore_eos and token in seq.eos_ids:
      return "stop"
    max_tokens = p.max_tokens or self.config.scheduler.max_model_len
    # Known tokens only, as for max_tokens: a later step's pending token (planned while
    # this one was in flight, within the limit) is still to come.
    if len(seq.output_ids) >= max_tokens or seq.num_known >= self.config.scheduler.max_model_len:
      return "length"
    return None

  def fail(self, plan: StepPlan) -> list[Sequence]:
    """Rolls back a step that did not complete: its tokens will never arrive and its
    KV may be unwritten. Every unfinished sequence of the plan loses its pages (no
    hash published) and goes back to the front of the queue, to be recomputed;
    returns them so that the caller can finish the ones to blame."""
    for chunk in plan.prefills:
      chunk.seq.pending -= chunk.sample
    for row in plan.decodes:
      row.seq.pending -= row.num_steps
    victims = [s for s in dict.fromkeys(plan.sequences) if s.status is not Status.FINISHED]
    for seq in reversed(victims):
      if seq.status is Status.RUNNING:
        self._preempt(seq, count=False)
    for slot, _ in plan.lora_loads:  # maybe never written
      self.lora_slots.forget(slot)
    return victims


def _decodable(seq: Sequence) -> bool:
  """A sequence whose only uncomputed position holds its latest sampled token, which the
  device holds too (`last_tokens`): it decodes, rather than prefilling that one token.
  This is every running sequence after its step was postprocessed, as when the engine
  speculates (its previous step is postprocessed before scheduling) — but not one
  readmitted since (its prefix-cache hit may stop one token short; its new slot holds
  another sequence's token)."""
  return (not seq.pending and seq.token_on_device
          and seq.num_computed == seq.num_known - 1)


def _uses_penalties(p: SamplingParams) -> bool:
  return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
