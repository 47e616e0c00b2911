"""Host-side page allocator and prefix cache (no device)."""

import pytest

from serving.engine.page_allocator import CacheListener, PageAllocator, page_hash


def test_allocate_release_and_reserved_page():
  a = PageAllocator(num_pages=5, page_size=4)
  pages = a.allocate(4)
  assert sorted(pages) == [1, 2, 3, 4]  # page 0 is never handed out
  assert a.allocate(1) is None and a.num_free == 0
  a.release(pages[:2])
  assert a.num_free == 2
  a.check()
  with pytest.raises(RuntimeError):
    a.release([pages[0]])


def test_prefix_match_shares_and_evicts_lru():
  a = PageAllocator(num_pages=4, page_size=2)
  tokens = [1, 2, 3, 4, 5]
  pages = a.allocate(3)
  h0 = page_hash(None, [1, 2])
  h1 = page_hash(h0, [3, 4])
  a.commit(pages[0], h0, None, [1, 2])
  a.commit(pages[1], h1, h0, [3, 4])
  shared, hashes = a.match_prefix(tokens)
  assert shared == pages[:2] and hashes == [h0, h1]
  assert a.refcount(pages[0]) == 2
  # A prompt that is exactly cached still leaves one token to compute.
  assert a.match_prefix([1, 2, 3, 4])[0] == pages[:1]
  a.release(pages[:1])
  a.release(shared + pages)
  a.check()
  assert a.num_free == 3  # two cached pages are evictable, one is free
  got = a.allocate(3)  # takes the free page, then evicts the cached ones
  assert sorted(got) == sorted(pages)
  assert a.match_prefix(tokens) == ([], [])
  a.check()


def test_prefix_caching_disabled():
  a = PageAllocator(num_pages=4, page_size=2, enable_prefix_caching=False)
  p = a.allocate(1)
  a.commit(p[0], page_hash(None, [1, 2]), None, [1, 2])
  assert a.match_prefix([1, 2, 3]) == ([], [])
  a.release(p)
  assert a.num_free == 3


def test_lookup_and_share_take_cached_pages_only():
  """The window group's prefix lookup: `lookup` takes no reference, `share` takes one
  (an evictable page leaves the LRU list), and a free page cannot be shared."""
  a = PageAllocator(num_pages=4, page_size=2)
  page, other = a.allocate(2)
  h = page_hash(None, [1, 2])
  a.commit(page, h, None, [1, 2])
  a.release([page, other])
  assert a.lookup(h) == page and a.refcount(page) == 0
  a.share([page])
  assert a.refcount(page) == 1 and a.num_free == 2  # no longer evictable
  a.check()
  with pytest.raises(RuntimeError, match="free"):
    a.share([other])
  assert PageAllocator(4, 2, enable_prefix_caching=False).lookup(h) is None


class Recorder(CacheListener):
  """Keeps the cache's contents as told by the listener calls."""

  def __init__(self):
    self.cached: dict[bytes, int] = {}
    self.log: list[tuple] = []

  def stored(self, page, h, parent, tokens):
    self.cached[h] = page
    self.log.append(("stored", page, parent, tuple(tokens)))

  def evicted(self, page, h):
    assert self.cached.pop(h) == page
    self.log.append(("evicted", page))

  def cleared(self):
    self.cached.clear()
    self.log.append(("cleared",))


def test_listener_mirrors_stores_evictions_and_clear():
  """A listener told of every store, eviction and clear holds exactly the allocator's
  cached prefixes; a duplicate commit tells nothing; a cleared cache frees its
  unreferenced pages and keeps held ones with their owners."""
  a = PageAllocator(num_pages=4, page_size=2)
  rec = Recorder()
  a.listeners.append(rec)
  pages = a.allocate(3)
  h0 = page_hash(None, [1, 2])
  h1 = page_hash(h0, [3, 4])
  a.commit(pages[0], h0, None, [1, 2])
  a.commit(pages[1], h1, h0, [3, 4])
  a.commit(pages[2], h1, h0, [3, 4])  # already cached under h1: no event
  assert rec.log == [("stored", pages[0], None, (1, 2)), ("stored", pages[1], h0, (3, 4))]
  a.release(pages)
  a.allocate(2)  # the free page, then the least recently released cached page
  assert rec.cached == {h1: pages[1]} and a.lookup(h0) is None
  assert rec.log[-1] == ("evicted", pages[0])
  held = a.allocate(1)
  a.commit(held[0], page_hash(None, [9, 9]), None, [9, 9])
  assert a.clear_cache() == 1
  assert rec.cached == {} and rec.log[-1] == ("cleared",)
  assert a.match_prefix([9, 9, 1]) == ([], [])
  a.release(held)  # no longer cached: it goes back to the free list
  a.check()
  assert a.num_free == 1
