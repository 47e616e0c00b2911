"""Tiered prefix cache: KV pages evicted from the device pool live on in host memory
(and, past it, on disk) and come back on a prefix hit instead of being recomputed.

Lifecycle, on the engine thread:
  1. The scheduler allocates pages; every cached page it evicts is announced to
     `KVOffload.evicted` (a `CacheListener`, serving/engine/page_allocator.py) while
     its content is still intact, and queued.
  2. `before_step(plan)`, after `schedule()` and before the step is dispatched:
     the queued pages are gathered on the device in fixed-size chunks
     (`runner.gather_pages`, which also starts their copy to the host). The
     gather is dispatched before anything that writes those pages — a reload
     into them, the step itself, which donates the pool: JAX runs a read of a
     buffer before a later call that donates it. Then the plan's reloads
     (`plan.kv_reloads`: tier hits found at admission) are written into their
     fresh device pages (`runner.import_pages`, fixed-shape chunks of
     `kv_transfer_pages`: nothing compiles after warm-up). A chunk that fails
     names its sequences; the engine takes them out of the step and they
     recompute that prefix (`Scheduler.drop_reload`).
  3. `after_dispatch()`, once the step is dispatched and the previous step's
     tokens are out: the copies started by earlier steps land in the host pool.
     The copy of step N's evictions thus overlaps step N+1, and no token waits
     for a host copy.
  4. Prefetch (`prefetch`, from the scheduler when a request arrives and while it
     waits at the head of the queue): the sequence's prefix pages that only the disk
     tier holds are read by a reader thread, off the engine thread, into a staging
     area (at most `prefetch_pages` pages read or staged). Admission waits for them
     (the scheduler admits requests behind it meanwhile) up to `prefetch_wait_s`
     after the request arrived; a read not done by then, or one that failed, is a
     miss for that request only: it recomputes from that page on.
  5. Admission (`match`, from the scheduler): after the device pool's longest
     cached prefix, the hash chain goes on in the host tier, then the disk
     tier's staged reads (and pages still on their way to it). Pages found are
     copied out for the reload (a disk hit is promoted into the host tier); the
     sequence gets fresh pages for them and counts them as computed. Their hashes
     are published like any page the step filled, after it completed. Nothing on
     the engine thread reads a file.

The host tier (`HostPagePool`) is one preallocated buffer per stored array,
sized at start-up (`kv_offload_host_gb`, counted in the runner's capacity line),
LRU; when it is full the least recently used page leaves it (to the disk tier
when there is one) — it never blocks. A page is kept as the device stores it
(`runner.kv_page_specs()`: int8 / fp8 codes with their scales; the full K/V of
every layer, gathered from all shards under tensor parallelism). Hashes are
the prefix cache's own, rooted per LoRA adapter. Refused (ValueError at
start-up): a hybrid model's sliding-window page group, prefix caching off
(linear-attention models turn it off), multi-process serving.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from serving.engine.page_allocator import CacheListener, page_hash
from serving.types import (
  KVOffloadStats,
  KVReload,
  KVTierStats,
  RunnerDeadError,
  Sequence,
  StepPlan,
)

log = logging.getLogger(__name__)

# How long a request's admission may wait for its disk pages to be read (from its arrival).
PREFETCH_WAIT_S = 0.5

PageSpec = tuple[tuple[int, ...], Any]  # one stored array of a page: (shape, dtype)


class PageStore(Protocol):
  """The disk tier as the host tier uses it: `DiskPageStore` (serving/engine/kv_disk_store.py;
  `stats` a `DiskStoreStats`)."""

  capacity_bytes: int

  def put(self, h: bytes, arrays: list[np.ndarray]) -> bool:
    """Stores one page; False when the tier is disabled or the write failed."""
    ...

  def get(self, h: bytes) -> list[np.ndarray] | None:
    """The page stored under `h`; None on a miss, a mismatch or corruption."""
    ...

  def __contains__(self, h: bytes) -> bool:
    ...

  @property
  def stats(self) -> Any:
    ...

  def close(self) -> None:
    """Releases the directory (the files stay)."""
    ...


class HostPagePool:
  """`capacity` pages in preallocated host buffers (one per stored array), keyed by
  prefix hash, least recently used first out."""

  def __init__(self, capacity: int, specs: list[PageSpec]):
    if capacity < 1:
      raise ValueError(f"host tier capacity {capacity} pages: it must hold at least one")
    self.capacity = capacity
    self.buffers = [np.zeros((capacity, *shape), dtype) for shape, dtype in specs]
    self._slot_of: collections.OrderedDict[bytes, int] = collections.OrderedDict()
    self._free = list(range(capacity - 1, -1, -1))

  @property
  def page_bytes(self) -> int:
    return sum(b[0].nbytes for b in self.buffers)

  @property
  def nbytes(self) -> int:
    """Bytes reserved for the pool."""
    return sum(b.nbytes for b in self.buffers)

  def __len__(self) -> int:
    return len(self._slot_of)

  def __contains__(self, h: bytes) -> bool:
    return h in self._slot_of

  def put(self, h: bytes, arrays: list[np.ndarray]) -> tuple[bytes, list[np.ndarray]] | None:
    """Stores page `h` (most recently used); returns the page it pushed out to make room
    (hash, copies of its arrays), if any. A page already held is only refreshed."""
    if h in self._slot_of:
      self._slot_of.move_to_end(h)
      return None
    out = None
    if not self._free:
      old, slot = self._slot_of.popitem(last=False)
      out = (old, [b[slot].copy() for b in self.buffers])
      self._free.append(slot)
    slot = self._free.pop()
    for buf, a in zip(self.buffers, arrays, strict=True):
      buf[slot] = a
    self._slot_of[h] = slot
    return out

  def get(self, h: bytes) -> list[np.ndarray] | None:
    """Copies of page `h`'s arrays (it becomes the most recently used), or None."""
    slot = self._slot_of.get(h)
    if slot is None:
      return None
    self._slot_of.move_to_end(h)
    return [b[slot].copy() for b in self.buffers]

  def items(self) -> list[tuple[bytes, list[np.ndarray]]]:
    """Every page (hash, views of its arrays), least recently used first."""
    return [(h, [b[slot] for b in self.buffers]) for h, slot in self._slot_of.items()]

  def clear(self) -> None:
    self._slot_of.clear()
    self._free = list(range(self.capacity - 1, -1, -1))


@dataclasses.dataclass
class _Copy:
  """Evicted pages on their way to the host: the gathered chunk and when it started."""

  hashes: list[bytes]
  arrays: list[Any]  # [k, v]: [L, chunk, page_size, K, H'] each, slot i = hashes[i]
  started: float
  step: int


class KVOffload(CacheListener):
  """The host (and disk) tier of one engine's prefix cache (see module doc).

  `runner` provides `gather_pages(pages)` (the stored arrays of up to `chunk_pages`
  pages, dispatched, copy to the host started), `import_pages(pages, k, v)` and
  `kv_page_specs()`.
  """

  def __init__(self, runner: Any, host: HostPagePool, *, page_size: int, chunk_pages: int,
               disk: PageStore | None = None, prefetch_wait_s: float = PREFETCH_WAIT_S,
               prefetch_pages: int | None = None):
    self.runner, self.host, self.disk = runner, host, disk
    self.page_size, self.chunk_pages = page_size, chunk_pages
    # Disk pages read ahead of admission: by the reader thread, then staged here (engine
    # thread) until a sequence's admission takes them; at most `prefetch_pages` of both.
    self.prefetch_wait_s = prefetch_wait_s
    self.prefetch_pages = prefetch_pages or max(chunk_pages, min(host.capacity, 8 * chunk_pages))
    self._reader = (concurrent.futures.ThreadPoolExecutor(1, "kv-disk-reader")
                    if disk is not None else None)
    self._reading: dict[bytes, concurrent.futures.Future] = {}
    self._staged: collections.OrderedDict[bytes, list[np.ndarray]] = collections.OrderedDict()
    self._queued: list[tuple[int, bytes]] = []  # (device page, hash) evicted, not gathered
    self._copies: list[_Copy] = []
    self._step = 0
    # Pages the host tier pushes out are written to disk off the engine thread, in order.
    self._writer = (concurrent.futures.ThreadPoolExecutor(1, "kv-disk-writer")
                    if disk is not None else None)
    # Pages handed to the writer and not yet written: the disk tier's, found here meanwhile.
    self._writing: dict[bytes, list[np.ndarray]] = {}
    self._writing_lock = threading.Lock()
    self.stats = KVOffloadStats(host=KVTierStats(capacity_bytes=host.nbytes),
                                disk=KVTierStats() if disk is not None else None)

  def snapshot(self) -> KVOffloadStats:
    """A copy of the counters (metrics read it from another thread); the disk tier's
    writes, occupancy and state come from its store."""
    out = copy.deepcopy(self.stats)
    if self.disk is not None:
      d = self.disk.stats
      out.disk.pages_stored, out.disk.bytes_stored = d.writes, d.bytes_written
      out.disk.used_bytes, out.disk.disabled = d.bytes_used, d.disabled
      out.disk.capacity_bytes = self.disk.capacity_bytes
    return out

  # ---- the prefix cache's events ----

  def evicted(self, page: int, h: bytes) -> None:
    """Queues an evicted page for the host tier (gathered by `flush_evictions`)."""
    self._queued.append((page, h))

  def cleared(self) -> None:
    """The prefix cache was reset: the host tier forgets its pages too (the disk
    tier keeps its files: they are checked against the model when read)."""
    self._queued.clear()
    self._copies.clear()
    self._staged.clear()
    self.host.clear()
    self.stats.host.used_bytes = 0

  # ---- one step ----

  def before_step(self, plan: StepPlan) -> list[KVReload]:
    """Gathers the pages evicted since the last call, then writes the plan's reloads into
    their device pages. Returns the reloads that failed (their sequences must not run
    this step's chunk). A lost device (`RunnerDeadError`) propagates."""
    self._step += 1
    self.flush_evictions()
    if not plan.kv_reloads:
      return []
    return self._reload(plan.kv_reloads)

  def flush_evictions(self) -> None:
    """Dispatches the gather (and host copy) of every queued evicted page; call it
    before anything writes device pages (a step, an import)."""
    queued, self._queued = self._queued, []
    for i in range(0, len(queued), self.chunk_pages):
      chunk = queued[i:i + self.chunk_pages]
      arrays = self.runner.gather_pages([p for p, _ in chunk])
      self._copies.append(_Copy([h for _, h in chunk], list(arrays), time.perf_counter(),
                                self._step))

  def after_dispatch(self) -> None:
    """Lands the copies started by earlier steps in the host tier (blocking on any not
    done: they had a whole step's time)."""
    older = [c for c in self._copies if c.step < self._step]
    self._copies = [c for c in self._copies if c.step >= self._step]
    for c in older:
      self._land(c)

  def _land_ready(self) -> None:
    """Lands the copies already on the host, without waiting for the others."""
    ready = [c for c in self._copies if all(_is_ready(a) for a in c.arrays)]
    self._copies = [c for c in self._copies if c not in ready]
    for c in ready:
      self._land(c)

  def _land(self, chunk: _Copy) -> None:
    arrays = [np.asarray(a) for a in chunk.arrays]
    for i, h in enumerate(chunk.hashes):
      self._store_host(h, [a[:, i] for a in arrays])
    s = self.stats
    s.pages_offloaded += len(chunk.hashes)
    s.offload_chunks += 1
    s.offload_seconds += time.perf_counter() - chunk.started

  def _store_host(self, h: bytes, arrays: list[np.ndarray]) -> None:
    """Puts a page into the host tier; the page it pushes out goes to the disk tier."""
    held = h in self.host
    out = self.host.put(h, arrays)
    if not held:
      self.stats.host.pages_stored += 1
      self.stats.host.bytes_stored += self.host.page_bytes
    if out is not None and self.disk is not None:
      self._store_disk(*out)
    self.stats.host.used_bytes = len(self.host) * self.host.page_bytes

  def _store_disk(self, h: bytes, arrays: list[np.ndarray]) -> None:
    """Queues a page for the disk tier (its writer thread; `arrays` are the caller's to
    give away); until written, lookups find it in `_writing`."""
    with self._writing_lock:
      self._writing[h] = arrays
    self._writer.submit(self._write, h, arrays)

  def _write(self, h: bytes, arrays: list[np.ndarray]) -> None:
    """On the writer thread: one page to disk (a failed write disables the disk tier
    there, with its log line)."""
    try:
      self.disk.put(h, arrays)
    finally:
      with self._writing_lock:
        if self._writing.get(h) is arrays:
          del self._writing[h]

  def _writing_copy(self, h: bytes) -> list[np.ndarray] | None:
    """A copy of page `h` if it is on its way to the disk tier (still in memory)."""
    with self._writing_lock:
      pending = self._writing.get(h)
    return None if pending is None else [a.copy() for a in pending]

  # ---- prefetch ----

  def prefetch(self, seq: Sequence, on_device: Callable[[bytes], bool]) -> bool:
    """Starts reading, on the reader thread, the sequence's prefix pages (up to the
    first page no tier holds) that only the disk tier has: not `on_device`, not in the
    host tier, not on their way to disk, not read or staged already. True while some of
    them are still being read and the sequence arrived less than `prefetch_wait_s` ago:
    its admission should wait. Without a disk tier, False."""
    if self.disk is None:
      return False
    self._harvest()
    now = time.monotonic()
    if seq.prefetch_deadline is None:
      seq.prefetch_deadline = now + self.prefetch_wait_s
    ps, tokens, parent = self.page_size, seq.token_ids(), seq.cache_salt
    pending = False
    for i in range((seq.num_known - 1) // ps):
      h = page_hash(parent, tokens[i * ps:(i + 1) * ps])
      parent = h
      if on_device(h) or h in self.host or h in self._staged:
        continue
      if h in self._reading:
        pending = True
        continue
      with self._writing_lock:
        if h in self._writing:
          continue
      if h not in self.disk or not self._make_room():
        break
      self._reading[h] = self._reader.submit(self._read, h)
      self.stats.pages_prefetched += 1
      pending = True
    return pending and now < seq.prefetch_deadline

  def _make_room(self) -> bool:
    """Room for one more read: the oldest staged pages move into the host tier while
    reads and staged pages fill `prefetch_pages`. False if reads alone fill it."""
    while len(self._reading) + len(self._staged) >= self.prefetch_pages and self._staged:
      self._store_host(*self._staged.popitem(last=False))
    return len(self._reading) < self.prefetch_pages

  def _read(self, h: bytes) -> list[np.ndarray] | None:
    """On the reader thread: page `h` from the disk tier; None if it is gone, refused
    (the store deletes and counts it) or the read raised (logged)."""
    try:
      return self.disk.get(h)
    except Exception as e:  # the request recomputes this page: never the engine's failure
      log.warning("disk KV tier: reading a page failed (%s: %s); it is recomputed",
                  type(e).__name__, e)
      return None

  def _harvest(self) -> None:
    """Stages the pages the reader thread has finished reading."""
    for h in [h for h, f in self._reading.items() if f.done()]:
      arrays = self._reading.pop(h).result()
      if arrays is not None:
        self._staged[h] = arrays

  def wait_for_reads(self, timeout_s: float) -> None:
    """Waits up to `timeout_s` for a read in flight to finish (an engine with nothing
    else to do than wait for a sequence's prefetch)."""
    if self._reading:
      concurrent.futures.wait(list(self._reading.values()), timeout_s,
                              concurrent.futures.FIRST_COMPLETED)

  # ---- admission ----

  def match(self, seq: Sequence, parent: bytes | None, first: int, limit: int) -> KVReload:
    """The sequence's pages `first`, `first + 1`, ... (< `limit`) found in the tiers,
    continuing the hash chain from `parent` (the hash of page `first - 1`, or the
    chain's root salt), up to the first page no tier holds: a `KVReload` without
    device pages yet (the scheduler allocates them; `record` counts it)."""
    ps = self.page_size
    tokens = seq.token_ids()
    self._land_ready()
    seq.prefetch_deadline = None  # a later admission (after a preemption) waits anew
    reload = KVReload(seq=seq, pages=[], arrays=[], tiers=[])
    for i in range(first, limit):
      h = page_hash(parent, tokens[i * ps:(i + 1) * ps])
      arrays = self.host.get(h)
      tier = "host"
      if arrays is None and self.disk is not None:
        arrays, tier = self._from_disk(h), "disk"
        if arrays is not None:
          self._store_host(h, arrays)  # promoted: the next hit is a host hit
      if arrays is None:
        reload.missed = ("host", "disk") if self.disk is not None else ("host",)
        break
      reload.arrays.append(arrays)
      reload.tiers.append(tier)
      parent = h
    return reload

  def _from_disk(self, h: bytes) -> list[np.ndarray] | None:
    """Page `h` of the disk tier if it is in memory: read ahead (staged) or on its way
    to the file. A page the disk tier holds that was not read in time (or whose read
    failed) is a miss, counted in `prefetch_misses`."""
    self._harvest()
    arrays = self._staged.pop(h, None)
    if arrays is None:
      arrays = self._writing_copy(h)
    if arrays is None and (h in self._reading or h in self.disk):
      self.stats.prefetch_misses += 1
    return arrays

  def record(self, reload: KVReload) -> None:
    """Counts an admitted sequence's lookup: hits and misses per tier."""
    s = self.stats
    for tier in reload.tiers:
      if tier == "disk":
        s.host.misses += 1
        s.disk.hits += 1
      else:
        s.host.hits += 1
    for tier in reload.missed:
      getattr(s, tier).misses += 1

  # ---- reloads ----

  def _reload(self, reloads: list[KVReload]) -> list[KVReload]:
    """Writes every reload's pages in chunks; returns those a failed chunk touched."""
    start = time.perf_counter()
    items = [(r, page, arrays) for r in reloads
             for page, arrays in zip(r.pages, r.arrays, strict=True)]
    failed: list[KVReload] = []
    for i in range(0, len(items), self.chunk_pages):
      chunk = items[i:i + self.chunk_pages]
      k, v = (self._chunk_array([a[j] for _, _, a in chunk], j) for j in (0, 1))
      try:
        self.runner.import_pages([p for _, p, _ in chunk], k, v)
      except RunnerDeadError:
        raise
      except Exception as e:
        log.warning("KV reload of %d pages failed (%s): their requests recompute them",
                    len(chunk), e)
        failed += [r for r, _, _ in chunk if r not in failed]
    s = self.stats
    s.pages_reloaded += sum(len(r.pages) for r in reloads if r not in failed)
    s.reload_failures += len(failed)
    s.reload_seconds += time.perf_counter() - start
    s.reload_steps += 1
    return failed

  def _chunk_array(self, pages: list[np.ndarray], j: int) -> np.ndarray:
    """Stored array j of `pages` as one transfer chunk [L, chunk_pages, ...]: each page
    copied once, straight into its slot; the unused slots zero (they go to the dummy
    page)."""
    shape, dtype = self.host.buffers[j].shape[1:], self.host.buffers[j].dtype
    out = np.empty((shape[0], self.chunk_pages, *shape[1:]), dtype)
    for slot, page in enumerate(pages):
      out[:, slot] = page
    out[:, len(pages):] = 0
    return out

  # ---- shutdown ----

  def spill_to_disk(self) -> int:
    """Writes every host page (and those still in flight) to the disk tier and waits for
    the writes, e.g. at shutdown, so that a restarted server finds them; returns the
    pages newly written."""
    if self.disk is None:
      return 0
    self._reader.shutdown(wait=True)  # the reads in flight land in the host tier too
    self._reader = concurrent.futures.ThreadPoolExecutor(1, "kv-disk-reader")
    self._harvest()
    for h, arrays in self._staged.items():
      self._store_host(h, arrays)
    self._staged.clear()
    self.flush_evictions()
    for c in self._copies:
      self._land(c)
    self._copies = []
    self._writer.shutdown(wait=True)
    self._writer = concurrent.futures.ThreadPoolExecutor(1, "kv-disk-writer")
    before = self.disk.stats.writes
    for h, arrays in self.host.items():
      if h not in self.disk:
        self.disk.put(h, arrays)
    return self.disk.stats.writes - before

  def close(self) -> None:
    """Waits for the disk writes in flight and releases the disk tier's directory (its
    files stay for the next server)."""
    if self.disk is not None:
      self._reader.shutdown(wait=True)
      self._writer.shutdown(wait=True)
      self.disk.close()


def _is_ready(a: Any) -> bool:
  """A host (numpy) array, or a device array whose value is computed."""
  return isinstance(a, np.ndarray) or a.is_ready()
