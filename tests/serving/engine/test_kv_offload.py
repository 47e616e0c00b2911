"""The tiered prefix cache's host tier (serving/engine/kv_offload.py) over the fake runner.

- `HostPagePool` is LRU: a full pool pushes out the least recently used page
  (a hit refreshes it) and hands it back for the disk tier; what it returns
  are copies.
- A multi-turn workload whose device pool is too small for the conversations
  gives exactly the tokens it gives with the tier off, while the tier serves
  prefix hits that the device pool no longer has (fewer prefill tokens
  computed). The fake runner reads every context back from its pool, so a
  page reloaded into the wrong place, or not at all, raises.
- A step's reloads are one import (one transfer) when they fit
  `kv_transfer_pages`.
- LoRA adapters' pages are found only under their own adapter.
- A reload that fails costs its request only the recomputation of that
  prefix: the output is the same, the failure is counted.
- The disk tier: a host tier of a few pages pushes the rest out to disk, and a
  later turn reloads them from there through the host tier (outputs identical).
  A restarted engine on the same directory serves a conversation's next turn
  from disk (disk hits counted, outputs identical); a corrupted file and a file
  written for another model are refused (deleted, counted) and those requests
  recompute, with the same outputs.
- Disk pages are read ahead of admission by the reader thread (never on the
  engine thread). A read that raises costs only its conversation the
  recomputation of those pages (the others still hit disk; counted and exported
  as `kv_prefetch_misses_total`); reads that do not finish within
  `prefetch_wait_s` are recomputed instead of waited for.
- The host tier refuses what it cannot serve: a sliding-window page group, no
  prefix cache, a disk tier without a host tier, a host tier too small for a page.
"""

from __future__ import annotations

import os
import shutil
import threading

import numpy as np
import pytest
from frontend_fake import ByteTokenizer
from prometheus_client.parser import text_string_to_metric_families
from runner_faults import FaultyRunner

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.engine.fake_runner import FakeRunner
from serving.engine.kv_disk_store import DiskPageStore
from serving.engine.kv_offload import HostPagePool
from serving.engine.page_allocator import page_hash
from serving.entrypoints.metrics import Metrics
from serving.types import SamplingParams, WindowGroup

PAGE = 4


def page(value: int) -> list[np.ndarray]:
  return [np.full((1, PAGE, 2), value, np.int64), np.full((1, PAGE, 2), -value, np.int64)]


def test_host_pool_is_lru_and_hands_back_what_it_pushes_out():
  pool = HostPagePool(2, [((1, PAGE, 2), np.int64)] * 2)
  assert pool.put(b"a", page(1)) is None and pool.put(b"b", page(2)) is None
  got = pool.get(b"a")  # a is now the most recently used
  got[0][:] = 99  # a copy: the pool keeps its own
  assert pool.get(b"a")[0][0, 0, 0] == 1
  out = pool.put(b"c", page(3))
  assert out is not None and out[0] == b"b" and out[1][1][0, 0, 0] == -2
  assert b"b" not in pool and pool.get(b"c")[0][0, 0, 0] == 3 and len(pool) == 2
  assert pool.put(b"a", page(7)) is None  # held: refreshed, not rewritten
  assert pool.get(b"a")[0][0, 0, 0] == 1
  assert pool.nbytes == 2 * pool.page_bytes == 2 * 2 * PAGE * 2 * 8
  with pytest.raises(ValueError, match="at least one"):
    HostPagePool(0, [((1,), np.int64)])


PAGE_BYTES = 2 * PAGE * 2 * 8  # the fake runner's page: K and V [1, PAGE, 2] int64
IDENTITY = {"model": "fake", "page_size": str(PAGE), "layout": "k,v [1, 4, 2] int64"}


def make_engine(num_pages: int, host_gb: float = 0.0, runner=None, disk_dir=None,
                identity=IDENTITY, store=DiskPageStore, **kw) -> LLMEngine:
  disk = dict(kv_offload_disk_dir=str(disk_dir), kv_offload_disk_gb=0.01) if disk_dir else {}
  kw = dict(dict(kv_transfer_pages=3), **kw)
  config = EngineConfig.of(max_num_seqs=4, max_model_len=256, page_size=PAGE,
                           num_pages=num_pages, max_num_batched_tokens=32,
                           compilation_cache=False, kv_offload_host_gb=host_gb,
                           **disk, **kw)
  runner = runner or FakeRunner(num_pages=num_pages, page_size=PAGE, max_num_seqs=4,
                                vocab_size=300)
  store = store(str(disk_dir), 2**24, identity) if disk_dir else None
  return LLMEngine(runner=runner, tokenizer=ByteTokenizer(), config=config, kv_disk=store)


def conversations(engine: LLMEngine, n: int = 6, turns: int = 4, system: int = 21,
                  lora: str | None = None, first: int = 0, prompts: dict | None = None
                  ) -> list[list[list[int]]]:
  """`n` interleaved conversations sharing a system prompt; each turn's prompt is the
  whole history so far plus a new user message. -> each conversation's outputs. With
  `first`, the turns before it are taken as answered by `conversations(..., turns=first)`
  (the fake runner's answers depend only on the prompt) and are not sent. `prompts`
  collects each request's prompt by request id."""
  rng = np.random.default_rng(0)
  sys_prompt = [int(t) for t in rng.integers(1, 250, system)]
  history = [list(sys_prompt) for _ in range(n)]
  outputs: list[list[list[int]]] = [[] for _ in range(n)]
  for _ in range(first):  # replays the history of the turns not sent
    for c in range(n):
      history[c] += [int(t) for t in rng.integers(1, 250, 5 + c % 3)]
      history[c] += [history[c][i % len(history[c])] for i in range(6)]
  for turn in range(first, turns):
    got: dict[int, list[int]] = {}
    for c in range(n):
      history[c] += [int(t) for t in rng.integers(1, 250, 5 + c % 3)]
      got[c] = []
      if prompts is not None:
        prompts[f"c{c}t{turn}"] = list(history[c])
      engine.add_request(f"c{c}t{turn}", list(history[c]),
                         SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                         lambda out, c=c, got=got: got[c].extend(out.token_ids), lora=lora)
    engine.run_until_idle()
    for c in range(n):
      outputs[c].append(got[c])
      history[c] += got[c]
  engine.allocator.check()
  assert all(engine.allocator.refcount(p) == 0 for p in range(1, engine.allocator.num_pages))
  return outputs


def test_host_tier_serves_evicted_prefixes_with_identical_outputs():
  off = make_engine(num_pages=40)
  on = make_engine(num_pages=40, host_gb=1e-3)
  assert conversations(on) == conversations(off)
  s_off, s_on = off.stats(), on.stats()
  tier = s_on.kv_offload
  assert s_off.kv_offload is None
  assert tier.pages_offloaded > 0 and tier.host.hits > 0 and tier.pages_reloaded > 0
  assert tier.reload_failures == 0 and tier.host.used_bytes > 0
  assert tier.host.capacity_bytes == on.offload.host.nbytes
  assert s_on.prefill_tokens_computed_total < s_off.prefill_tokens_computed_total
  # Every admitted lookup is counted once: hits are the pages reloaded.
  assert tier.host.hits == tier.pages_reloaded and tier.host.misses > 0


def test_a_full_host_tier_evicts_and_serves_on():
  small = make_engine(num_pages=40, host_gb=4 * 2 * PAGE * 2 * 8 / 2**30)  # four pages
  assert small.offload.host.capacity == 4
  assert conversations(small) == conversations(make_engine(num_pages=40))
  assert len(small.offload.host) == 4 and small.stats().kv_offload.pages_offloaded > 4


def test_lora_pages_are_found_only_under_their_adapter():
  engine = make_engine(num_pages=40, host_gb=1e-3, max_loras=1)
  engine.add_lora("a", "/a", 4, None)
  base = conversations(engine, n=3, turns=2)  # the tier now holds the base model's pages
  reference = make_engine(num_pages=40, max_loras=1)
  reference.add_lora("a", "/a", 4, None)
  # The fake runner's KV records the adapter: a base page reloaded for "a" would raise.
  adapted = conversations(engine, lora="a")
  assert adapted == conversations(reference, lora="a") and adapted[:3] != base
  assert engine.stats().kv_offload.host.hits > 0


def test_a_failed_reload_recomputes_that_prefix_for_that_request_only():
  runner = FaultyRunner(FakeRunner(num_pages=40, page_size=PAGE, max_num_seqs=4,
                                   vocab_size=300), fail_imports=frozenset({0}))
  engine = make_engine(num_pages=40, host_gb=1e-3, runner=runner)  # the first reload fails
  assert conversations(engine) == conversations(make_engine(num_pages=40))
  tier = engine.stats().kv_offload
  assert runner.num_imports > 1 and tier.reload_failures >= 1
  assert tier.pages_reloaded > 0  # later reloads went through


def test_a_steps_reloads_are_one_transfer_when_they_fit_a_chunk():
  runner = FaultyRunner(FakeRunner(num_pages=40, page_size=PAGE, max_num_seqs=4,
                                   vocab_size=300))
  engine = make_engine(num_pages=40, host_gb=1e-3, runner=runner, kv_transfer_pages=40)
  assert conversations(engine) == conversations(make_engine(num_pages=40))
  tier = engine.stats().kv_offload
  assert tier.pages_reloaded > tier.reload_steps > 0  # steps reloaded several pages...
  assert runner.num_imports == tier.reload_steps  # ...in one import each


def test_disk_tier_takes_what_the_host_tier_pushes_out(tmp_path):
  engine = make_engine(num_pages=40, host_gb=4 * PAGE_BYTES / 2**30, disk_dir=tmp_path)
  assert conversations(engine) == conversations(make_engine(num_pages=40))
  engine.shutdown()
  tier = engine.stats().kv_offload
  assert tier.disk.pages_stored > 0 and tier.disk.hits > 0 and tier.disk.used_bytes > 0
  assert tier.disk.misses > 0 and not tier.disk.disabled


def test_a_restart_serves_the_next_turn_from_disk(tmp_path):
  reference = conversations(make_engine(num_pages=40))
  first = make_engine(num_pages=40, host_gb=1e-3, disk_dir=tmp_path)
  assert conversations(first, turns=3) == [c[:3] for c in reference]
  first.shutdown()  # the host tier is written to disk
  restarted = make_engine(num_pages=40, host_gb=1e-3, disk_dir=tmp_path)
  assert len(restarted.offload.disk.hashes()) > 0  # what the restart found
  assert conversations(restarted, first=3) == [c[3:] for c in reference]
  tier = restarted.stats().kv_offload
  assert tier.disk.hits > 0 and tier.pages_reloaded >= tier.disk.hits


def test_corrupt_and_foreign_files_are_refused(tmp_path):
  reference = conversations(make_engine(num_pages=40))
  first = make_engine(num_pages=40, host_gb=1e-3, disk_dir=tmp_path)
  conversations(first, turns=3)
  first.shutdown()
  store_dir = first.offload.disk.path
  names = sorted(f for f in os.listdir(store_dir) if f.endswith(".kvp"))
  assert len(names) >= 2
  for name in names[1:]:  # a flipped byte in the payload of every other file
    with open(os.path.join(store_dir, name), "r+b") as f:
      f.seek(-9, os.SEEK_END)
      byte = f.read(1)
      f.seek(-9, os.SEEK_END)
      f.write(bytes([byte[0] ^ 0xFF]))
  # The same page written by a server of another model, copied over a file of ours.
  other = DiskPageStore(str(tmp_path / "other"), 2**24, {**IDENTITY, "model": "other"})
  h = bytes.fromhex(names[0].removesuffix(".kvp"))
  assert other.put(h, [np.zeros((1, PAGE, 2), np.int64)] * 2)
  other.close()
  shutil.copy(os.path.join(other.path, names[0]), os.path.join(store_dir, names[0]))
  restarted = make_engine(num_pages=40, host_gb=1e-3, disk_dir=tmp_path)
  assert h not in restarted.offload.disk  # refused when the restart indexed the directory
  assert conversations(restarted, first=3) == [c[3:] for c in reference]
  disk = restarted.offload.disk.stats
  tier = restarted.stats().kv_offload
  assert disk.refused >= 2 and tier.disk.hits == 0  # every page read was refused
  assert names[0] not in os.listdir(store_dir)


def test_replicas_merge_their_tiers_counters():
  from serving.engine.replicas import merge_stats

  engines = [make_engine(num_pages=40, host_gb=1e-3) for _ in range(2)]
  conversations(engines[0])
  conversations(engines[1], n=3)
  parts = [e.stats() for e in engines]
  merged = merge_stats(parts).kv_offload
  assert merged.host.hits == sum(p.kv_offload.host.hits for p in parts) > 0
  assert merged.pages_reloaded == sum(p.kv_offload.pages_reloaded for p in parts)
  assert merged.disk is None and merge_stats([make_engine(num_pages=40).stats()] * 2
                                             ).kv_offload is None


def test_refusals():
  with pytest.raises(ValueError, match="needs the prefix cache"):
    make_engine(num_pages=40, host_gb=1e-3, enable_prefix_caching=False)
  with pytest.raises(ValueError, match="holds no KV page"):
    make_engine(num_pages=40, host_gb=1e-12)
  with pytest.raises(ValueError, match="set kv_offload_host_gb too"):
    EngineConfig.of(kv_offload_disk_dir="/tmp/x", kv_offload_disk_gb=1.0)
  with pytest.raises(ValueError, match="go together"):
    EngineConfig.of(kv_offload_host_gb=1.0, kv_offload_disk_dir="/tmp/x")
  runner = FakeRunner(num_pages=40, page_size=PAGE, max_num_seqs=4, vocab_size=300,
                      window_group=WindowGroup(8, 40))
  with pytest.raises(ValueError, match="sliding-window"):
    make_engine(num_pages=40, host_gb=1e-3, runner=runner)


class ReadSpy(DiskPageStore):
  """A disk tier that records the thread of every page read and, for the hashes in
  `fail`, raises instead of reading; with `gate` set, every read waits for it."""

  fail: frozenset[bytes] = frozenset()
  gate: threading.Event | None = None

  def __init__(self, *args):
    super().__init__(*args)
    self.threads: list[str] = []

  def get(self, h: bytes):
    self.threads.append(threading.current_thread().name)
    if self.gate is not None:
      self.gate.wait()
    if h in self.fail:
      raise RuntimeError("injected read failure")
    return super().get(h)


def chain(tokens: list[int]) -> set[bytes]:
  """The base model's prefix hashes of `tokens`' full pages."""
  hashes, parent = set(), None
  for i in range((len(tokens) - 1) // PAGE):
    parent = page_hash(parent, tokens[i * PAGE:(i + 1) * PAGE])
    hashes.add(parent)
  return hashes


def warm_disk(tmp_path) -> tuple[list, dict]:
  """Three turns through an engine with a small host tier, shut down so that its pages
  are on disk. -> the full reference outputs (tiers off) and every request's prompt."""
  prompts: dict = {}
  reference = conversations(make_engine(num_pages=40), prompts=prompts)
  first = make_engine(num_pages=40, host_gb=1e-3, disk_dir=tmp_path)
  conversations(first, turns=3)
  first.shutdown()
  return reference, prompts


def test_disk_hits_are_read_ahead_off_the_engine_thread(tmp_path):
  reference, _ = warm_disk(tmp_path)
  restarted = make_engine(num_pages=40, host_gb=1e-3, disk_dir=tmp_path, store=ReadSpy)
  assert conversations(restarted, first=3) == [c[3:] for c in reference]
  tier = restarted.stats().kv_offload
  assert tier.disk.hits > 0 and tier.pages_prefetched >= tier.disk.hits
  threads = restarted.offload.disk.threads
  assert threads and all(t.startswith("kv-disk-reader") for t in threads)


def test_a_failed_prefetch_recomputes_for_that_request_only(tmp_path):
  reference, prompts = warm_disk(tmp_path)
  own = chain(prompts["c5t3"]) - chain(prompts["c4t3"])  # c5's history, not the system's
  ReadFails = type("ReadFails", (ReadSpy,), {"fail": frozenset(own)})
  restarted = make_engine(num_pages=40, host_gb=1e-3, disk_dir=tmp_path, store=ReadFails)
  assert own & set(restarted.offload.disk.hashes())  # c5's next turn was on disk
  assert conversations(restarted, first=3) == [c[3:] for c in reference]
  tier = restarted.stats().kv_offload
  assert tier.prefetch_misses > 0  # c5's pages: recomputed
  assert tier.disk.hits > 0  # the other conversations' pages came from disk
  assert restarted.health() is None
  samples = {s.name: s.value for family in text_string_to_metric_families(
      Metrics(restarted.stats, model_name="m").render()[0].decode()) for s in family.samples}
  assert samples["xlaserve_kv_prefetch_misses_total"] == tier.prefetch_misses
  assert samples["xlaserve_kv_prefetch_pages_total"] == tier.pages_prefetched


def test_a_slow_prefetch_falls_back_to_recompute(tmp_path):
  reference, _ = warm_disk(tmp_path)
  ReadWaits = type("ReadWaits", (ReadSpy,), {"gate": threading.Event()})
  restarted = make_engine(num_pages=40, host_gb=1e-3, disk_dir=tmp_path, store=ReadWaits)
  restarted.offload.prefetch_wait_s = 0.05  # then admitted with what arrived: nothing
  try:
    assert conversations(restarted, first=3) == [c[3:] for c in reference]
    tier = restarted.stats().kv_offload
    assert tier.disk.hits == 0 and tier.prefetch_misses > 0 and tier.pages_prefetched > 0
  finally:
    ReadWaits.gate.set()
  restarted.shutdown()
