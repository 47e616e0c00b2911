"""Host-side draft proposers (ngram prompt lookup, suffix decoding): no device, no jax."""

from __future__ import annotations

import random

import numpy as np
import pytest

from serving.spec_decode import (
    DraftModelProposer,
    NgramProposer,
    Proposer,
    SuffixProposer,
    make_proposer,
)
from serving.spec_decode.proposers import _SuffixTrie

# ---------------------------------------------------------------------------------------------
# Brute-force references


def ngram_reference(ctx: list[int], k: int, min_n: int, max_n: int) -> list[int]:
  """The longest n whose suffix n-gram occurs ending before the last position; the k tokens
  after its most recent such occurrence."""
  if k <= 0:
    return []
  length = len(ctx)
  for n in range(max_n, min_n - 1, -1):
    if n > length - 1:
      continue
    suffix = ctx[length - n:]
    for end in range(length - 1, n - 1, -1):
      if ctx[end - n:end] == suffix:
        return ctx[end:end + k]
  return []


def suffix_followers(ctx: list[int], s: list[int]) -> dict[int, tuple[int, int]]:
  """token -> (times it follows an occurrence of s in ctx, position of its last such time)."""
  out: dict[int, tuple[int, int]] = {}
  m = len(s)
  for i in range(len(ctx) - m):
    if ctx[i:i + m] == s:
      t = ctx[i + m]
      out[t] = (out.get(t, (0, 0))[0] + 1, i + m)
  return out


def suffix_own_reference(ctx: list[int], k: int, depth: int, min_prob: float) -> list[int]:
  """SuffixProposer over the request's own context only, by counting substrings directly."""
  if k <= 0:
    return []
  cap = depth - min(k, depth // 2)
  length = len(ctx)
  m = 0
  for mm in range(min(cap, length - 1), 0, -1):
    if suffix_followers(ctx, ctx[length - mm:]):
      m = mm
      break
  if m == 0:
    return []
  s = ctx[length - m:]
  path: list[int] = []
  while len(path) < k and len(s) < depth:
    followers = suffix_followers(ctx, s)
    if not followers:
      break
    total = sum(c for c, _ in followers.values())
    # most frequent; ties: the one whose last occurrence is latest (it reached the count last)
    best = max(followers, key=lambda t: followers[t])
    if followers[best][0] < min_prob * total:
      break
    path.append(best)
    s = s + [best]
  return path


def children_map(trie: _SuffixTrie) -> dict[int, list[int]]:
  """node -> its children, from the edge dict (and, if kept, the same as the child lists)."""
  out: dict[int, list[int]] = {}
  for key, child in trie.edges.items():
    out.setdefault(key >> 31, []).append(child)
  if trie.removable:
    for node, children in out.items():
      assert sorted(trie.children(node)) == sorted(children)
  return out


def trie_counts(trie: _SuffixTrie) -> dict[tuple[int, ...], tuple]:
  """Every string in a suffix trie -> (count, continuations)."""
  kids, out = children_map(trie), {}
  stack: list[tuple[int, tuple[int, ...]]] = [(0, ())]
  while stack:
    node, prefix = stack.pop()
    for child in kids.get(node, []):
      string = prefix + (trie.token[child],)
      out[string] = (trie.count[child], trie.cont[child])
      stack.append((child, string))
  return out


def check_trie(trie: _SuffixTrie) -> None:
  """The trie's redundant fields agree: edges, child lists, continuations, best children."""
  kids = children_map(trie)
  live = [0]
  for node in live:
    children = kids.get(node, [])
    live.extend(children)
    assert trie.cont[node] == sum(trie.count[c] for c in children) or node == 0
    for c in children:
      assert trie.edges[(node << 31) | trie.token[c]] == c
    if node and children:
      assert trie.count[trie.best[node]] == max(trie.count[c] for c in children)
  assert len(live) == trie.num_nodes == len(trie.edges) + 1
  assert not set(live) & set(trie.free)


def substring_counts(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], tuple]:
  """What a trie over `seqs` must hold: each substring (<= depth long) -> (occurrences,
  occurrences followed by a token, counted only below depth)."""
  out: dict[tuple[int, ...], list[int]] = {}
  for seq in seqs:
    for i in range(len(seq)):
      for j in range(i + 1, min(i + depth, len(seq)) + 1):
        entry = out.setdefault(tuple(seq[i:j]), [0, 0])
        entry[0] += 1
        if j < len(seq) and j - i < depth:
          entry[1] += 1
  return {s: tuple(v) for s, v in out.items()}


def random_stream(rng: random.Random, length: int, vocab: int) -> list[int]:
  """Small-vocabulary tokens with copied spans, so that long matches happen."""
  out: list[int] = []
  while len(out) < length:
    if out and rng.random() < 0.3:
      start = rng.randrange(len(out))
      out.extend(out[start:start + rng.randint(1, 8)])
    else:
      out.append(rng.randrange(vocab))
  return out[:length]


# ---------------------------------------------------------------------------------------------
# NgramProposer


def test_ngram_longest_n_wins():
  ctx = [1, 2, 3, 9, 2, 4, 1, 2]
  # [1, 2] last occurred ending at 2 (-> 3); [2] more recently ending at 5 (-> 4).
  assert NgramProposer(1, 2).propose("r", ctx, 2) == [3, 9]
  assert NgramProposer(1, 1).propose("r", ctx, 2) == [4, 1]


def test_ngram_most_recent_occurrence_wins():
  ctx = [5, 6, 1, 5, 6, 2, 5, 6]
  assert NgramProposer(2, 3).propose("r", ctx, 3) == [2, 5, 6]


def test_ngram_k_cap_and_context_end():
  p = NgramProposer(1, 3)
  assert p.propose("r", [7, 8, 7], 5) == [8, 7]  # fewer: the context ends
  assert p.propose("s", [7, 8, 7], 1) == [8]
  assert p.propose("t", [1, 2, 3, 4, 1, 2, 3, 4, 1], 2) == [2, 3]
  assert p.propose("t", [1, 2, 3, 4, 1, 2, 3, 4, 1], 0) == []
  assert p.propose("t", [1, 2, 3, 4, 1, 2, 3, 4, 1], -1) == []


def test_ngram_no_self_match():
  p = NgramProposer(1, 3)
  assert p.propose("a", [1], 3) == []
  assert p.propose("b", [1, 2, 3], 3) == []
  assert p.propose("c", [4, 4], 3) == [4]
  # grows one token at a time: the new suffix never matches itself
  p2 = NgramProposer(1, 3)
  ctx: list[int] = []
  for t in [10, 11, 12, 13]:
    ctx.append(t)
    assert p2.propose("r", ctx, 3) == []
  ctx.append(11)
  assert p2.propose("r", ctx, 3) == [12, 13, 11]


def test_ngram_min_n_respected():
  ctx = [1, 2, 3, 1]
  assert NgramProposer(2, 3).propose("r", ctx, 3) == []
  assert NgramProposer(1, 3).propose("r", ctx, 3) == [2, 3, 1]


def test_ngram_forget_and_rewritten_context():
  p = NgramProposer(1, 2)
  assert p.propose("r", [1, 2, 1], 2) == [2, 1]
  p.forget("r")
  assert "r" not in p._state
  p.forget("r")  # twice is fine
  assert p.propose("r", [3, 4, 3], 2) == [4, 3]
  # without forget: a shorter or changed context is re-indexed, not mixed with the old one
  assert p.propose("r", [5, 5], 2) == [5]
  assert p.propose("r", [5, 6, 9, 6], 2) == [9, 6]
  p.finish("r", [1, 2])
  assert "r" not in p._state


def test_ngram_numpy_context():
  p = NgramProposer(1, 2)
  out = p.propose("r", np.array([1, 2, 1], np.int32), 2)
  assert out == [2, 1] and all(type(t) is int for t in out)
  out = p.propose("r", np.array([1, 2, 1, 2], np.int64), 3)
  assert out == [1, 2] and all(type(t) is int for t in out)


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 4), (3, 5)])
def test_ngram_incremental_equals_brute_force(min_n, max_n):
  for seed in range(8):
    rng = random.Random(seed * 100 + max_n)
    stream = random_stream(rng, 200, vocab=rng.randint(2, 5))
    p = NgramProposer(min_n, max_n)
    length = 0
    while length < len(stream):
      length += rng.randint(0, 3)  # sometimes no new token at all
      ctx = stream[:length]
      k = rng.randint(0, 6)
      assert p.propose("r", ctx, k) == ngram_reference(ctx, k, min_n, max_n), (seed, length, k)
    # a fresh proposer over the whole context agrees with the incremental one
    assert (NgramProposer(min_n, max_n).propose("x", stream, 5)
            == p.propose("r", stream, 5) == ngram_reference(stream, 5, min_n, max_n))


def test_ngram_requests_are_independent():
  rng = random.Random(3)
  streams = {rid: random_stream(rng, 80, vocab=3) for rid in ("a", "b", "c")}
  p = NgramProposer(1, 3)
  for length in range(1, 81):
    for rid, stream in streams.items():
      want = ngram_reference(stream[:length], 4, 1, 3)
      assert p.propose(rid, stream[:length], 4) == want


def test_ngram_bad_sizes():
  with pytest.raises(ValueError):
    NgramProposer(0, 3)
  with pytest.raises(ValueError):
    NgramProposer(4, 3)


# ---------------------------------------------------------------------------------------------
# SuffixProposer


def test_suffix_repeats_own_text():
  p = SuffixProposer()
  text = list(range(1, 11))
  ctx = text + text + [1, 2, 3]
  assert p.propose("r", ctx, 5) == [4, 5, 6, 7, 8]
  assert p.propose("r", ctx + [4, 5], 3) == [6, 7, 8]
  assert p.propose("r", ctx + [4, 5, 6, 7, 8, 9, 10], 4) == [1, 2, 3, 4]
  assert p.propose("new", [1, 2, 3], 4) == []  # nothing seen before


def test_suffix_k_zero_or_negative():
  p = SuffixProposer()
  assert p.propose("r", [1, 2, 1, 2], 0) == []
  assert p.propose("r", [1, 2, 1, 2, 1], -3) == []
  assert p.propose("r", [1, 2, 1, 2, 1], 1) == [2]


def test_suffix_uses_shared_cache_after_finish():
  p = SuffixProposer()
  out = list(range(100, 130))
  assert p.propose("b", [1, 2, 3] + out[:6], 4) == []
  p.propose("a", [7, 8] + out, 4)
  p.finish("a", out)
  assert "a" not in p._state and len(p._cached) == 1
  p.forget("b")
  assert p.propose("b", [1, 2, 3] + out[:6], 4) == out[6:10]
  # a match (8 tokens) and its proposal fit in max_depth (24) tokens
  assert p.propose("b", [1, 2, 3] + out[:8], 30) == out[8:24]
  assert p.propose("b", [1, 2, 3] + out[:20], 30) == out[20:]  # ends where the output ended
  assert p.propose("c", [5, out[0]], 3) == out[1:4]


def test_suffix_prefers_longer_match_ties_to_own():
  p = SuffixProposer()
  p.finish("old", [10, 11, 12, 13])
  # both match [10, 11, 12]: the request's own text wins
  assert p.propose("a", [10, 11, 12, 20, 5, 10, 11, 12], 1) == [20]
  # own matches [11, 12] only, the cache [10, 11, 12]: the cache wins
  assert p.propose("b", [11, 12, 20, 0, 10, 11, 12], 1) == [13]


def test_suffix_falls_back_when_winner_proposes_nothing():
  p = SuffixProposer(min_prob=0.5)
  p.finish("old", [2, 5, 6])
  # own match [1, 2] is followed by 7, 8, 9 (1/3 each < 0.5): the shorter cached match is used
  assert p.propose("r", [1, 2, 7, 1, 2, 8, 1, 2, 9, 1, 2], 2) == [5, 6]


def test_suffix_min_prob_stops_low_confidence_branches():
  ctx = [1, 2, 5, 1, 2, 6, 1, 2, 5, 0, 1]
  # [1] -> 2 always; [1, 2] -> 5 (2/3) or 6; [1, 2, 5] -> 1 or 0 (1/2 each, 0 is latest)
  assert SuffixProposer(min_prob=0.7).propose("r", ctx, 3) == [2]
  assert SuffixProposer(min_prob=0.6).propose("r", ctx, 3) == [2, 5]
  assert SuffixProposer(min_prob=0.5).propose("r", ctx, 3) == [2, 5, 0]
  assert SuffixProposer(min_prob=0.5).propose("r", ctx, 2) == [2, 5]
  # a first step below min_prob proposes nothing
  assert SuffixProposer(min_prob=0.9).propose("r", [3, 1, 3, 2, 3], 3) == []
  assert SuffixProposer(min_prob=0.5).propose("r", [3, 1, 3, 2, 3], 1) == [2]


def test_suffix_depth_leaves_room_for_the_proposal():
  p = SuffixProposer(max_depth=4)
  ctx = [1, 2, 3, 4, 5, 6] * 3
  # matches are capped at 4 - min(k, 2) tokens, the path at the rest of the depth
  assert p.propose("r", ctx, 1) == [1]
  assert p.propose("r", ctx, 10) == [1, 2]
  assert p.propose("r", ctx, 10) == suffix_own_reference(ctx, 10, 4, 0.1)


def test_suffix_eviction_bound():
  p = SuffixProposer(max_cached_requests=2)
  outs = [[100 + 10 * i + j for j in range(6)] for i in range(5)]
  for i, out in enumerate(outs):
    p.finish(f"r{i}", out)
    assert len(p._cached) == min(i + 1, 2)
  assert p.propose("q0", [0, 100, 101], 2) == []  # evicted
  assert p.propose("q3", [0, 130, 131], 2) == [132, 133]
  assert p.propose("q4", [0, 140, 141], 2) == [142, 143]
  # the shared trie holds exactly the cached outputs: evicted nodes were deleted
  assert trie_counts(p._shared) == substring_counts(outs[3:], 24)
  check_trie(p._shared)


def test_suffix_shared_trie_add_remove_random():
  rng = random.Random(7)
  depth, cache = 5, 3
  p = SuffixProposer(max_depth=depth, max_cached_requests=cache)
  finished: list[list[int]] = []
  for i in range(12):
    out = random_stream(rng, rng.randint(0, 40), vocab=4)
    p.finish(f"r{i}", out)
    if out:
      finished.append(out)
    assert trie_counts(p._shared) == substring_counts(finished[-cache:], depth)
    check_trie(p._shared)
  for out in finished[-cache:]:  # each cached output is found again
    assert p.propose("q", out[:-1], 1) != [] or len(out) < 2
    p.forget("q")


def test_suffix_shared_trie_recycles_nodes():
  rng = random.Random(11)
  p = SuffixProposer(max_depth=8, max_cached_requests=4)
  peak = 0
  for i in range(60):
    p.finish(f"r{i}", random_stream(rng, 50, vocab=6))
    peak = max(peak, p._shared.num_nodes)
  check_trie(p._shared)
  assert len(p._shared.count) <= peak  # evicted nodes are reused, the arrays stay bounded


def test_suffix_token_range():
  p = SuffixProposer()
  with pytest.raises(ValueError):
    p.propose("r", [1, -2, 3], 2)
  with pytest.raises(ValueError):
    p.finish("r", [1, 2**31])


def test_suffix_no_cache():
  p = SuffixProposer(max_cached_requests=0)
  p.finish("a", [1, 2, 3, 4])
  assert not p._cached and p.propose("b", [9, 1, 2], 2) == []


def test_suffix_forget_and_rewritten_context():
  p = SuffixProposer()
  assert p.propose("r", [1, 2, 1], 2) == [2, 1]
  p.forget("r")
  assert "r" not in p._state
  assert p.propose("r", [3, 4, 3], 2) == [4, 3]
  assert p.propose("r", [5, 5], 2) == [5]  # shorter: re-indexed
  assert p.propose("r", [5, 6, 9, 6], 2) == [9, 6]  # changed: re-indexed


@pytest.mark.parametrize("depth,min_prob", [(24, 0.1), (6, 0.1), (4, 0.4), (3, 0.0)])
def test_suffix_incremental_equals_brute_force_and_fresh(depth, min_prob):
  for seed in range(6):
    rng = random.Random(seed * 31 + depth)
    stream = random_stream(rng, 150, vocab=rng.randint(2, 5))
    p = SuffixProposer(max_depth=depth, min_prob=min_prob)
    length = 0
    while length < len(stream):
      length += rng.randint(0, 3)
      ctx = stream[:length]
      k = rng.randint(0, 8)
      want = suffix_own_reference(ctx, k, depth, min_prob)
      assert p.propose("r", ctx, k) == want, (seed, length, k)
      if length % 17 == 0:
        fresh = SuffixProposer(max_depth=depth, min_prob=min_prob)
        assert fresh.propose("x", ctx, k) == want
    p.propose("r", stream, 1)  # k = 0 returns before indexing
    own = p._state["r"].trie
    check_trie(own)
    assert trie_counts(own) == substring_counts([stream], depth)


def test_suffix_numpy_context():
  p = SuffixProposer()
  out = p.propose("r", np.array([4, 5, 6, 4, 5], np.int32), 3)
  assert out == [6, 4, 5] and all(type(t) is int for t in out)
  p.finish("r", np.array([7, 8, 9]))
  out = p.propose("s", [7, 8], 1)
  assert out == [9] and type(out[0]) is int


def test_suffix_bad_args():
  with pytest.raises(ValueError):
    SuffixProposer(max_depth=1)
  with pytest.raises(ValueError):
    SuffixProposer(max_cached_requests=-1)
  with pytest.raises(ValueError):
    SuffixProposer(min_prob=1.5)


def test_shared_trie_match_is_longest():
  trie = _SuffixTrie(8)
  trie.add([1, 2, 3, 4, 5])
  assert trie.match([9, 2, 3], 7)[0] == 2
  assert trie.match([1, 2, 3, 4], 7)[0] == 4
  assert trie.match([1, 2, 3, 4], 3)[0] == 3
  assert trie.match([2, 3, 4, 5], 7) == (0, -1)  # 5 is never followed
  assert trie.match([], 7) == (0, -1)


# ---------------------------------------------------------------------------------------------
# make_proposer, the protocol, and cost sanity


def test_make_proposer():
  p = make_proposer("ngram", prompt_lookup_min=2, prompt_lookup_max=4)
  assert isinstance(p, NgramProposer) and (p.min_n, p.max_n) == (2, 4)
  assert isinstance(make_proposer("suffix", prompt_lookup_min=1, prompt_lookup_max=3),
                    SuffixProposer)
  assert make_proposer("none", prompt_lookup_min=1, prompt_lookup_max=3) is None
  draft = make_proposer("draft", prompt_lookup_min=1, prompt_lookup_max=3)
  assert isinstance(draft, DraftModelProposer) and draft.on_device
  assert not p.on_device
  with pytest.raises(ValueError, match="medusa"):
    make_proposer("medusa", prompt_lookup_min=1, prompt_lookup_max=3)


def test_proposers_follow_the_protocol():
  for p in (NgramProposer(1, 3), SuffixProposer()):
    proposer: Proposer = p
    assert proposer.propose("r", [1, 2, 1], 2) == [2, 1]
    proposer.finish("r", [1])
    proposer.forget("r")


def test_no_jax_import():
  import serving.spec_decode as package
  import serving.spec_decode.proposers as module

  for source in (open(module.__file__).read(), open(package.__file__).read()):
    assert "import jax" not in source and "from jax" not in source


@pytest.mark.parametrize("make", [lambda: NgramProposer(1, 5), lambda: SuffixProposer()])
def test_long_context_incremental_runs(make):
  """4000 calls as a 4000-token context grows one token a time (cost sanity, no timing)."""
  rng = random.Random(0)
  stream = random_stream(rng, 4000, vocab=50)
  p = make()
  proposed = 0
  for length in range(1, len(stream) + 1):
    proposed += len(p.propose("r", stream[:length] if length < 64 else _View(stream, length), 8))
  assert proposed > 0
  p.finish("r", stream)
  p.finish("r2", stream[::-1])
  if isinstance(p, SuffixProposer):  # learnt from the finished outputs
    assert p.propose("q", stream[100:120], 8) != []


class _View:
  """A read-only prefix of a list, without the O(len) copy of slicing it (the test's own cost
  stays O(new tokens) per call, like the engine's)."""

  def __init__(self, items: list[int], length: int):
    self.items, self.length = items, length

  def __len__(self):
    return self.length

  def __getitem__(self, index):
    if isinstance(index, slice):
      start, stop, step = index.indices(self.length)
      return self.items[start:stop:step]
    if index < 0:
      index += self.length
    if not 0 <= index < self.length:
      raise IndexError(index)
    return self.items[index]
