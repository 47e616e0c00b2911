"""Hybrid attention on the host: the sliding-window page group, on the FakeRunner.

A hybrid model's sliding-window layers keep their own pages (`WindowPages`);
a sequence holds only those its window still reads. The FakeRunner keeps a
second pool for that group and reads every query's window back through
`Sequence.window_pages`, so a window page released too early, released twice
or handed to another sequence while read fails with `FakeKVError`. Covered:
the bound on held window pages while decoding and in chunked prefill, the
prefix-cache rule (a hit counts only as far as the window group still holds
the prefix's last window), preemption, failed steps, page ownership and
`kv_cache_usage`.
"""

from __future__ import annotations

import collections

import pytest
from frontend_fake import ByteTokenizer
from runner_faults import FaultyRunner

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.engine.fake_runner import FakeKVError, FakeRunner
from serving.engine.page_allocator import PageAllocator, WindowPages, page_hash
from serving.engine.scheduler import Scheduler
from serving.types import SamplingParams, Sequence, WindowGroup

PAGE, WINDOW = 4, 8
WINDOW_PAGES = WINDOW // PAGE


def config(**kw) -> EngineConfig:
  base = dict(max_num_seqs=4, max_model_len=160, page_size=PAGE, num_pages=100,
              max_num_batched_tokens=16, compilation_cache=False)
  return EngineConfig.of(**{**base, **kw})


def prompt(seed: int, n: int) -> list[int]:
  return [(seed * 31 + i * 7) % 250 + 1 for i in range(n)]


def echo(prompt: list[int], n: int) -> list[int]:
  """What the FakeRunner generates: prompt tokens, cycling."""
  return [prompt[i % len(prompt)] for i in range(n)]


class Harness:
  """Scheduler + hybrid FakeRunner stepped like the engine (step N is postprocessed after
  step N+1 was dispatched); `on_step(plan)` runs after every step is dispatched, before
  the previous one is postprocessed (when the most pages are held)."""

  def __init__(self, window_pages: int = 60, **kw):
    self.config = config(**kw)
    cache = self.config.cache
    self.allocator = PageAllocator(cache.num_pages, PAGE, cache.enable_prefix_caching)
    self.window = WindowPages(window_pages, PAGE, WINDOW, cache.enable_prefix_caching)
    self.scheduler = Scheduler(self.config, self.allocator, window=self.window)
    self.runner = FakeRunner(num_pages=cache.num_pages, page_size=PAGE,
                             max_num_seqs=self.config.scheduler.max_num_seqs, vocab_size=300,
                             window_group=WindowGroup(WINDOW, window_pages))
    self.inflight = None
    self.outputs: dict[str, Sequence] = {}
    self.check = True  # the ownership check after each step (off to test the FakeRunner's)

  def add(self, rid: str, ids: list[int], max_tokens: int = 4) -> Sequence:
    seq = Sequence(request_id=rid, prompt_ids=list(ids),
                   params=SamplingParams(max_tokens=max_tokens, temperature=0.0))
    self.scheduler.add(seq)
    self.outputs[rid] = seq
    return seq

  def step(self, on_step=lambda plan: None):
    plan = self.scheduler.schedule()
    inflight = (plan, self.runner.execute(plan=plan)) if not plan.empty else None
    on_step(plan)
    if self.inflight is not None:
      done, handle = self.inflight
      self.scheduler.postprocess(done, self.runner.fetch(handle=handle))
    self.inflight = inflight
    if self.check:
      check_ownership(self.scheduler)
    return plan

  def run(self, on_step=lambda plan: None, limit: int = 500) -> None:
    for _ in range(limit):
      if not (self.scheduler.running or self.scheduler.waiting or self.inflight):
        return
      self.step(on_step)
    raise AssertionError("did not finish")


def check_ownership(scheduler: Scheduler) -> None:
  """Both groups' invariants; a page held by n running sequences has >= n references,
  and one held by two is a prefix-cache page (committed)."""
  groups = [(scheduler.allocator, lambda s: s.pages)]
  if scheduler.window is not None:
    groups.append((scheduler.window.allocator, lambda s: [p for p in s.window_pages if p]))
  for alloc, pages_of in groups:
    alloc.check()
    owners = collections.Counter(p for s in scheduler.running for p in pages_of(s))
    for page, n in owners.items():
      assert alloc.refcount(page) >= n, f"page {page}: {n} holders, {alloc.refcount(page)} refs"
      if n > 1:
        assert page in alloc._hash_of, f"page {page} shared by {n} without the cache"


def referenced(alloc: PageAllocator) -> int:
  return alloc.num_usable - alloc.num_free


# ---- WindowPages ----


def test_window_match_needs_the_last_window_of_the_prefix():
  w = WindowPages(num_pages=20, page_size=PAGE, window=WINDOW)
  hashes, parent = [], None
  for i in range(6):
    parent = page_hash(parent, [i] * PAGE)
    hashes.append(parent)
  pages = w.allocator.allocate(6)
  for i, (page, h) in enumerate(zip(pages, hashes, strict=True)):
    w.allocator.commit(page, h, hashes[i - 1] if i else None, [i] * PAGE)
  w.allocator.release(pages)  # cached, unreferenced
  # A query at 24 reads (16, 24]: pages 4 and 5 (first_live(24) = 17 // 4 = 4).
  k, got = w.match(hashes)
  assert (k, got) == (6, [0, 0, 0, 0, pages[4], pages[5]])
  assert w.allocator.refcount(pages[4]) == w.allocator.refcount(pages[5]) == 1
  w.release_all(got)
  # Page 4 evicted: a prefix of 6 pages is unusable; 5 pages need pages 3 and 4 (gone);
  # 4 pages need pages 2 and 3.
  w.allocator._evictable.move_to_end(pages[4], last=False)
  assert w.allocator.allocate(len(w.allocator._free) + 1) is not None
  k, got = w.match(hashes)
  assert (k, got) == (4, [0, 0, pages[2], pages[3]])


def test_window_ensure_refuses_to_recreate_computed_positions():
  w = WindowPages(num_pages=20, page_size=PAGE, window=WINDOW)
  pages = [0, 0, 0]
  assert w.ensure(pages, start=0, end=12) and all(pages)
  w.release_behind(pages, position=20, limit=3)
  assert pages == [0, 0, 0] and referenced(w.allocator) == 0
  with pytest.raises(RuntimeError, match="computed positions"):
    w.ensure(pages, start=12, end=16)  # positions 5..11 are read but were released


# ---- scheduler ----


def test_a_long_sequence_holds_only_its_window():
  """16x the window: at every step the window group holds at most window pages + 1 while
  decoding (the full group all of them), and the output is right."""
  h = Harness()
  n = 16 * WINDOW
  seq = h.add("long", prompt(1, 10), max_tokens=n - 10)
  most = collections.Counter()

  def on_step(plan):
    if seq in h.scheduler.running:
      held = referenced(h.window.allocator)
      assert held == h.window.held(seq.window_pages)
      assert referenced(h.allocator) == len(seq.pages)
      phase = "prefill" if any(c.seq is seq for c in plan.prefills) else "decode"
      most[phase] = max(most[phase], held)
      if phase == "decode":
        assert held <= WINDOW_PAGES + 1, (seq.num_computed, seq.window_pages)

  h.run(on_step)
  assert seq.output_ids == echo(seq.prompt_ids, n - 10)
  assert most["decode"] == WINDOW_PAGES + 1
  assert referenced(h.window.allocator) == referenced(h.allocator) == 0


@pytest.mark.parametrize("caching", [True, False])
def test_chunked_prefill_releases_behind_the_window(caching):
  """A prompt of many chunks: window pages stay within the window plus the chunks in
  flight (two with prefix caching: a page is released once its hash is published)."""
  h = Harness(enable_prefix_caching=caching)
  budget = h.config.scheduler.max_num_batched_tokens
  seq = h.add("long", prompt(2, 120), max_tokens=4)
  chunks = 2 if caching else 1
  bound = -(-(chunks * budget + WINDOW - 1) // PAGE) + 1
  most = [0]

  def on_step(plan):
    most[0] = max(most[0], referenced(h.window.allocator))
    assert referenced(h.window.allocator) <= bound

  h.run(on_step)
  assert seq.output_ids == echo(seq.prompt_ids, 4)
  assert most[0] >= chunks * budget // PAGE  # the chunks in flight are held: not vacuous


def test_prefix_hit_only_where_the_window_group_holds_the_last_window():
  h = Harness()
  h.add("first", prompt(3, 40), max_tokens=2)
  h.run()
  # Same prompt: the window tail of the prefix was published before its release.
  again = h.add("again", prompt(3, 40), max_tokens=6)
  h.step()
  assert again.num_computed == 40 and len(again.page_hashes) == 9  # 36 tokens cached
  assert again.window_pages[:7] == [0] * 7 and all(again.window_pages[7:9])
  h.run()
  assert again.output_ids == echo(again.prompt_ids, 6)
  # The window group lost the pages: the full pages alone do not make a hit.
  alloc = h.window.allocator
  alloc.release(alloc.allocate(alloc.num_free))  # evicts every cached window page
  cold = h.add("cold", prompt(3, 40), max_tokens=3)
  hits = h.allocator.stats.hits
  h.step()
  assert cold.page_hashes == [] and h.allocator.stats.hits == hits
  assert all(h.allocator.refcount(p) == 1 for p in cold.pages)  # the full hit was given back


def test_preemption_frees_both_groups_and_recomputes():
  h = Harness(num_pages=14, window_pages=10, max_num_batched_tokens=12)
  prompts = [prompt(i, 9 + i) for i in range(4)]
  seqs = [h.add(f"r{i}", p, max_tokens=20) for i, p in enumerate(prompts)]
  h.run()
  assert h.scheduler.num_preemptions > 0
  for seq, p in zip(seqs, prompts, strict=True):
    assert seq.output_ids == echo(p, 20)
  assert referenced(h.allocator) == referenced(h.window.allocator) == 0


def test_a_tight_window_group_preempts_rather_than_overlaps():
  """Fewer window pages than the running sequences need: preemption, never a shared page."""
  h = Harness(window_pages=8)
  seqs = [h.add(f"r{i}", prompt(i, 4), max_tokens=24) for i in range(4)]  # grow past 7 pages
  h.run()
  assert h.scheduler.num_preemptions > 0
  assert all(s.output_ids == echo(s.prompt_ids, 24) for s in seqs)


def test_the_kv_check_catches_a_window_page_released_early():
  """The oracle: a live window page freed (as a refcount bug would) and handed to
  another sequence is noticed when its owner next reads its window."""
  h = Harness(window_pages=12)
  h.check = False
  victim = h.add("victim", prompt(5, 10), max_tokens=30)
  for _ in range(3):
    h.step()
  live = [p for p in victim.window_pages if p][-1]  # read for a while yet
  h.window.allocator.release([live])  # the bug: one reference too few
  free = h.window.allocator._free
  if live in free:  # handed out next (were it cached, nothing would overwrite it)
    free.remove(live)
    free.appendleft(live)
  h.add("thief", prompt(6, 12), max_tokens=30)
  with pytest.raises(FakeKVError, match="victim"):
    for _ in range(4):
      h.step()


def test_the_kv_check_catches_a_window_read_through_the_dummy_page():
  h = Harness()
  victim = h.add("victim", prompt(5, 10), max_tokens=30)
  h.step()
  h.step()
  plan = h.scheduler.schedule()
  i = max(i for i, p in enumerate(victim.window_pages) if p)
  victim.window_pages[i - 1] = 0  # a page still in the window, dropped from the table
  with pytest.raises(FakeKVError, match="victim"):
    h.runner.execute(plan=plan)


# ---- engine ----


def engine(faults: dict | None = None, window_pages: int = 40, **kw) -> LLMEngine:
  cfg = config(**kw)
  runner = FakeRunner(num_pages=cfg.cache.num_pages, page_size=PAGE,
                      max_num_seqs=cfg.scheduler.max_num_seqs, vocab_size=300,
                      window_group=WindowGroup(WINDOW, window_pages))
  if faults is not None:
    runner = FaultyRunner(runner, **faults)
  return LLMEngine(runner=runner, tokenizer=ByteTokenizer(), config=cfg)


def submit(eng: LLMEngine, rid: str, ids: list[int], max_tokens: int = 6) -> list:
  outs: list = []
  eng.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                           ignore_eos=True), outs.append)
  return outs


def tokens_of(outs) -> list[int]:
  return [t for o in outs for t in o.token_ids]


def assert_all_pages_free(eng: LLMEngine) -> None:
  for alloc in (eng.allocator, eng.window.allocator):
    alloc.check()
    assert alloc.num_free == alloc.num_usable
  assert not eng.scheduler.running and not eng.scheduler.waiting


def test_engine_shares_prefixes_under_preemption_and_matches_alone():
  system = prompt(7, 5 * PAGE)
  prompts = [system + prompt(i, 3 + 2 * i) for i in range(6)]
  alone = {}
  for i, p in enumerate(prompts):
    eng = engine()
    outs = submit(eng, "x", p, max_tokens=12)
    eng.run_until_idle()
    alone[i] = tokens_of(outs)
  eng = engine(num_pages=24, window_pages=14, max_num_batched_tokens=12)
  outs = {i: submit(eng, f"r{i}", p, max_tokens=12) for i, p in enumerate(prompts)}
  while eng.has_unfinished():
    eng.step()
    check_ownership(eng.scheduler)
  assert {i: tokens_of(o) for i, o in outs.items()} == alone
  stats = eng.stats()
  assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total > 0
  assert_all_pages_free(eng)


def test_engine_failed_step_leaves_no_window_hash_and_frees_both_groups():
  bad_prompt = [0] + prompt(4, 5 * PAGE)
  eng = engine(faults=dict(fail_request=lambda s: s.prompt_ids[0] == 0))
  good = submit(eng, "good", prompt(1, 9), max_tokens=20)
  bad = submit(eng, "bad", bad_prompt)
  eng.run_until_idle()
  assert bad[-1].finish_reason == "error"
  assert tokens_of(good) == echo(prompt(1, 9), 20)
  assert eng.allocator.match_prefix(bad_prompt)[0] == []
  assert not eng.window.allocator._page_of.keys() & {
      page_hash(None, bad_prompt[:PAGE])}
  assert_all_pages_free(eng)


def test_kv_cache_usage_is_the_fuller_group():
  eng = engine(window_pages=13, num_pages=100)
  submit(eng, "a", prompt(1, 30), max_tokens=40)
  eng.step()
  eng.step()
  full, window = eng.allocator.usage, eng.window.allocator.usage
  assert window > full > 0
  assert eng.stats().kv_cache_usage == window


@pytest.mark.parametrize("options", [dict(num_decode_steps=4),
                                     dict(speculative_method="ngram", num_speculative_tokens=3)],
                         ids=["multi_step", "ngram"])
def test_engine_decodes_ahead_within_the_window_pages(options):
  """Multi-step decoding and speculation give rows pages past their input: those positions
  need window pages too, and their reads are checked like any other."""
  eng = engine(**options)
  prompts = [prompt(i, 6 + 5 * i) for i in range(3)]
  outs = [submit(eng, f"r{i}", p, max_tokens=40) for i, p in enumerate(prompts)]
  while eng.has_unfinished():
    eng.step()
    check_ownership(eng.scheduler)
  for p, o in zip(prompts, outs, strict=True):
    assert tokens_of(o) == echo(p, 40)
  assert_all_pages_free(eng)


def test_disaggregated_serving_refuses_a_window_group():
  from serving.engine.disaggregated import DisaggregatedEngine

  engines = [engine(), engine()]
  with pytest.raises(ValueError, match="hybrid-attention"):
    DisaggregatedEngine(engines[:1], engines[1:], config=engines[0].config)


def test_a_window_group_too_small_for_one_sequence_is_refused():
  with pytest.raises(ValueError, match="sliding-window page group has 5 pages"):
    engine(window_pages=6)
