"""Host-side page allocator and prefix cache (no device)."""

import pytest

from serving.engine.page_allocator import PageAllocator, page_hash


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
  a.commit(pages[0], h0)
  a.commit(pages[1], h1)
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
  a.commit(p[0], page_hash(None, [1, 2]))
  assert a.match_prefix([1, 2, 3]) == ([], [])
  a.release(p)
  assert a.num_free == 3


def test_lookup_and_share_take_cached_pages_only():
  """The window group's prefix lookup: `lookup` takes no reference, `share` takes one
  (an evictable page leaves the LRU list), and a free page cannot be shared."""
  a = PageAllocator(num_pages=4, page_size=2)
  page, other = a.allocate(2)
  h = page_hash(None, [1, 2])
  a.commit(page, h)
  a.release([page, other])
  assert a.lookup(h) == page and a.refcount(page) == 0
  a.share([page])
  assert a.refcount(page) == 1 and a.num_free == 2  # no longer evictable
  a.check()
  with pytest.raises(RuntimeError, match="free"):
    a.share([other])
  assert PageAllocator(4, 2, enable_prefix_caching=False).lookup(h) is None
