"""Host-side KV page allocator with a hash-chain prefix cache.

Pages are refcounted. A page filled completely with a sequence's tokens is
*committed* under the hash of its whole token prefix (parent hash + its own
tokens), so a later request with the same prefix shares it instead of
recomputing it. Committed pages whose refcount drops to zero stay cached in an
LRU list and are evicted only when free pages run out.

Whoever mirrors the cache elsewhere (KV events for a router, offload tiers) subscribes a
`CacheListener`: it is told of every page stored under a hash, every cached page
evicted (before its page is handed out again) and every clear.

Page 0 is the reserved dummy page (padding writes) and is never handed out.
Invariants (checked by `check()` in tests): every page other than 0 is in
exactly one of {free list, LRU evictable, referenced}; refcounts are >= 0.

A hybrid model's sliding-window layers form a second page group
(`WindowPages`): a `PageAllocator` over their own page ids, and the window
rule — which pages a sequence still needs, which a cached prefix must still
hold (docs/engine.md, "Hybrid attention").
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import struct


def page_hash(parent: bytes | None, tokens: list[int]) -> bytes:
  """Hash of a full page given its parent's hash: identifies the whole prefix."""
  h = hashlib.blake2b(parent or b"", digest_size=16)
  h.update(struct.pack(f"<{len(tokens)}i", *tokens))
  return h.digest()


class CacheListener:
  """Told of the prefix cache's changes, on the engine's thread, as they happen. The
  default methods do nothing; subclasses override what they mirror."""

  def stored(self, page: int, h: bytes, parent: bytes | None, tokens: list[int]) -> None:
    """Page `page` now holds the full page `tokens` whose prefix hash is `h`
    (`parent`: the previous page's hash, or the chain's root salt)."""

  def evicted(self, page: int, h: bytes) -> None:
    """Cached page `page` (hash `h`) leaves the cache; its content is still intact now
    and is overwritten once its new owner's step runs."""

  def cleared(self) -> None:
    """Every cached page left the cache at once."""


@dataclasses.dataclass
class PrefixStats:
  queries: int = 0  # prompt tokens looked up
  hits: int = 0  # prompt tokens found cached


class PageAllocator:
  """Refcounted pages [1, num_pages) plus the prefix cache (see module doc)."""

  def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
    if num_pages < 2:
      raise ValueError(f"num_pages={num_pages} must be at least 2 (page 0 is reserved)")
    self.num_pages, self.page_size = num_pages, page_size
    self.enable_prefix_caching = enable_prefix_caching
    self._free = collections.deque(range(1, num_pages))
    self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
    self._refs = [0] * num_pages
    self._hash_of: dict[int, bytes] = {}
    self._page_of: dict[bytes, int] = {}
    self.stats = PrefixStats()
    self.listeners: list[CacheListener] = []

  @property
  def num_usable(self) -> int:
    return self.num_pages - 1

  @property
  def num_free(self) -> int:
    """Pages obtainable now (free + evictable cached pages)."""
    return len(self._free) + len(self._evictable)

  @property
  def usage(self) -> float:
    return 1.0 - self.num_free / self.num_usable

  def refcount(self, page: int) -> int:
    return self._refs[page]

  def lookup(self, h: bytes) -> int | None:
    """The page cached under prefix hash `h`, if any (no reference taken)."""
    return self._page_of.get(h) if self.enable_prefix_caching else None

  def share(self, pages: list[int]) -> None:
    """Takes one more reference on each of `pages` (cached ones leave the LRU list)."""
    for page in pages:
      if self._refs[page] == 0:
        if page not in self._evictable:
          raise RuntimeError(f"page {page} is free: only held or cached pages are shared")
        del self._evictable[page]
      self._refs[page] += 1

  def allocate(self, n: int) -> list[int] | None:
    """n fresh pages with refcount 1, or None (nothing taken) if too few are free."""
    if n > self.num_free:
      return None
    out = []
    for _ in range(n):
      if self._free:
        page = self._free.popleft()
      else:
        page, _ = self._evictable.popitem(last=False)  # least recently used
        h = self._hash_of.pop(page)
        del self._page_of[h]
        for listener in self.listeners:
          listener.evicted(page, h)
      self._refs[page] = 1
      out.append(page)
    return out

  def release(self, pages: list[int]) -> None:
    """Drops one reference to each page; unreferenced pages become free or evictable."""
    for page in pages:
      if self._refs[page] <= 0:
        raise RuntimeError(f"page {page} released more often than referenced")
      self._refs[page] -= 1
      if self._refs[page] == 0:
        if page in self._hash_of:
          self._evictable[page] = None
        else:
          self._free.append(page)

  def match_prefix(self, tokens: list[int], salt: bytes | None = None, *, count: bool = True
                   ) -> tuple[list[int], list[bytes]]:
    """Longest cached full-page prefix of `tokens` (leaving >= 1 token to compute).

    `salt` roots the hash chain (None: the base model's): pages committed
    under one root are never found under another (LoRA adapters).
    Returns (pages, their hashes); each returned page gains a reference.
    `count=False` leaves the hit-rate statistics alone (a KV export, not a request).
    """
    if not self.enable_prefix_caching:
      return [], []
    ps = self.page_size
    max_pages = (len(tokens) - 1) // ps
    pages, hashes, parent = [], [], salt
    for i in range(max_pages):
      h = page_hash(parent, tokens[i * ps:(i + 1) * ps])
      page = self._page_of.get(h)
      if page is None:
        break
      if self._refs[page] == 0:
        del self._evictable[page]
      self._refs[page] += 1
      pages.append(page)
      hashes.append(h)
      parent = h
    if count:
      self.stats.queries += len(tokens)
      self.stats.hits += len(pages) * ps
    return pages, hashes

  def adopt(self, hashes: list[bytes]) -> tuple[list[int], list[bool]] | None:
    """Pages for full pages arriving from another engine, named by their prefix hashes
    (consecutive, in chain order): a page already cached under a hash is reused, the
    others are fresh pages to write and then `commit`. Every returned page holds a
    reference. -> (pages, which are fresh), or None (nothing taken) if too few are free.
    """
    cached = [self._page_of.get(h) if self.enable_prefix_caching else None for h in hashes]
    need = sum(p is None for p in cached)
    pinned = [p for p in cached if p is not None and self._refs[p] == 0]
    if need > self.num_free - len(pinned):
      return None
    self.share([p for p in cached if p is not None])  # pinned first: allocating cannot evict
    fresh = iter(self.allocate(need) or [])
    pages = [page if page is not None else next(fresh) for page in cached]
    return pages, [page is None for page in cached]

  def commit(self, page: int, h: bytes, parent: bytes | None, tokens: list[int]) -> None:
    """Registers a full page under its prefix hash `h` = page_hash(parent, tokens)
    (no-op if that prefix is cached)."""
    if not self.enable_prefix_caching or h in self._page_of or page in self._hash_of:
      return
    self._page_of[h] = page
    self._hash_of[page] = h
    for listener in self.listeners:
      listener.stored(page, h, parent, tokens)

  def holds(self, h: bytes) -> bool:
    """True if a page (held or evictable) is cached under prefix hash `h`."""
    return h in self._page_of

  def cached_hashes(self) -> list[bytes]:
    """The prefix hashes cached now (held or evictable pages), in no particular order."""
    return list(self._page_of)

  def clear_cache(self) -> int:
    """Forgets every cached prefix (vLLM's reset_prefix_cache): evictable pages become
    free, held pages stay with their sequences but are no longer found or committed under
    their hashes. -> how many prefixes were dropped."""
    dropped = len(self._page_of)
    self._free.extend(self._evictable)
    self._evictable.clear()
    self._page_of.clear()
    self._hash_of.clear()
    for listener in self.listeners:
      listener.cleared()
    return dropped

  def check(self) -> None:
    """Asserts the allocator's invariants (for tests)."""
    free, evict = set(self._free), set(self._evictable)
    assert len(free) == len(self._free), "duplicate page in the free list"
    assert not free & evict, "page both free and evictable"
    for page in range(1, self.num_pages):
      in_use = self._refs[page] > 0
      assert self._refs[page] >= 0
      assert (page in free) + (page in evict) + in_use == 1, f"page {page} state broken"
    assert 0 not in free and 0 not in evict
    assert all(self._page_of[h] == p for p, h in self._hash_of.items())


class WindowPages:
  """The sliding-window page group of a hybrid model: its own `PageAllocator` (page ids,
  refcounts, prefix cache under the same prefix hashes as the full-attention pages) and
  the window rule.

  A query at position p of a sliding layer reads positions (p - window, p], so a
  sequence whose next computed position is n needs its pages from
  `first_live(n)` on; older ones are released (`Sequence.window_pages` holds 0
  there, the dummy page, which attention masks). A cached prefix of k full pages
  is usable only if this group still caches its last window: pages
  `[first_live(k * page_size), k)` (`match`).
  """

  def __init__(self, num_pages: int, page_size: int, window: int,
               enable_prefix_caching: bool = True):
    if window < 1:
      raise ValueError(f"sliding window={window} must be at least 1")
    self.allocator = PageAllocator(num_pages, page_size, enable_prefix_caching)
    self.window, self.page_size = window, page_size

  def first_live(self, position: int) -> int:
    """Index of the oldest page a query at `position` (or later) reads."""
    return max(0, position - self.window + 1) // self.page_size

  def match(self, hashes: list[bytes]) -> tuple[int, list[int]]:
    """For a cached full-page prefix with these page hashes: the longest k <= len(hashes)
    pages whose window tail this group caches, and the sequence's window pages for them
    (0 behind the window; the others gain a reference)."""
    for k in range(len(hashes), 0, -1):
      lo = self.first_live(k * self.page_size)
      pages = [self.allocator.lookup(h) for h in hashes[lo:k]]
      if all(p is not None for p in pages):
        self.allocator.share(pages)
        return k, [0] * lo + pages
    return 0, []

  def ensure(self, seq_pages: list[int], start: int, end: int) -> bool:
    """Extends `seq_pages` (a sequence's window pages, in place) so that positions
    [first_live(start), end) have pages; False (nothing taken) if too few are free.
    Positions before `start` are computed: their pages must be held already."""
    ps = self.page_size
    need = -(-end // ps)
    seq_pages.extend([0] * (need - len(seq_pages)))
    missing = [i for i in range(self.first_live(start), need) if seq_pages[i] == 0]
    if any(i * ps < start for i in missing):
      raise RuntimeError(f"window pages {missing} of computed positions (< {start}) are gone")
    fresh = self.allocator.allocate(len(missing))
    if fresh is None:
      return False
    for i, page in zip(missing, fresh, strict=True):
      seq_pages[i] = page
    return True

  def release_behind(self, seq_pages: list[int], position: int, limit: int) -> None:
    """Releases the pages no query at `position` or later reads, among the first `limit`
    (in place: their entries become 0)."""
    for i in range(min(self.first_live(position), limit, len(seq_pages))):
      if seq_pages[i]:
        self.allocator.release([seq_pages[i]])
        seq_pages[i] = 0

  def release_all(self, seq_pages: list[int]) -> None:
    """Drops the sequence's every window page."""
    self.allocator.release([p for p in seq_pages if p])
    seq_pages.clear()

  def held(self, seq_pages: list[int]) -> int:
    """Pages of the group a sequence holds."""
    return sum(1 for p in seq_pages if p)
