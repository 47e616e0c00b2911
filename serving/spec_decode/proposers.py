"""Host-side draft proposers: guess a request's next tokens from text it has seen.

Speculative decoding verifies k guessed tokens in one step of the target model;
this module makes the guesses for the methods that need no model (the draft
model method runs on the device, in the runner). Each proposer keeps state per
request, keyed by request id, and is fed the request's whole context (prompt +
output so far) at every call; the context only grows between calls, so each
call indexes only the tokens added since the last one. `forget` drops a
request's state (it finished, or was preempted and will be recomputed);
`finish` is `forget` plus, for the suffix proposer, learning from its output.
A context that shrank, or whose last indexed token changed, is re-indexed from
scratch (a cheap guard; other rewrites of the context must be announced with
`forget`). Not thread-safe: the engine thread owns a proposer.

`NgramProposer` (prompt lookup decoding, vLLM's "ngram"): the longest n in
[min_n, max_n] whose last n tokens occurred earlier in the context; the k
tokens that followed the most recent such occurrence. Per request, one dict
per n maps each n-gram to the end of its latest occurrence. Cost: O(max_n^2)
per new token (the n-gram tuples) plus O(max_n^2 + k) per call; memory
O(len * (max_n - min_n + 1)) dict entries.

`SuffixProposer` (suffix decoding, as in Arctic Inference / vLLM's "suffix"):
a trie of all substrings of length <= max_depth with their occurrence counts,
one over the request's own context and one shared over the outputs of the
last `max_cached_requests` finished requests. The longest suffix of the context
that occurred before (with a continuation) is found in each; from the matched
node the proposal follows the most frequent child while its conditional
frequency, count(child) / count(continuations of the node), is >= min_prob,
for up to k tokens. A match and its proposal must fit in max_depth tokens, so
matches are capped at max_depth - min(k, max_depth // 2). The longer match wins,
ties to the request's own trie; if the winner proposes nothing the other is
tried. Cost: O(max_depth) per new token of the own trie (~20 us in CPython, so
the first call on a 16k-token prompt takes ~0.3 s); O(max_depth log max_depth)
per call to match the shared trie, plus O(k); O(len * max_depth) to add or
evict a finished output. Memory: up to len * max_depth nodes per trie, ~130
bytes each (~50 MiB for a 16k-token context with max_depth 24), in int arrays
and one dict of ints that the garbage collector never traverses.
"""

from __future__ import annotations

import array
import collections
from collections.abc import Sequence
from typing import Protocol

__all__ = ["DraftModelProposer", "NgramProposer", "Proposer", "SuffixProposer", "make_proposer"]


class Proposer(Protocol):
  """What the engine calls on a proposer of draft tokens.

  `on_device`: the drafts are proposed inside the runner's step (a draft model,
  later EAGLE-style heads); the scheduler then only reserves their positions and
  `propose` is never called.
  """

  on_device: bool

  def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
    """Up to k guessed next tokens for the request whose whole context is `tokens`
    (prompt + output so far; it only grows between calls for one id until `forget`)."""
    ...

  def forget(self, request_id: str) -> None:
    """Drops the request's state (finished, aborted, or preempted to be recomputed)."""
    ...

  def finish(self, request_id: str, output_tokens: Sequence[int]) -> None:
    """The request finished with `output_tokens`: learn from them (if the method does)
    and drop its state."""
    ...


class _Context:
  """A request's context as indexed so far: a private copy of its tokens (ints)."""

  __slots__ = ("tokens",)

  def __init__(self):
    self.tokens: list[int] = []

  def new_tokens(self, tokens: Sequence[int]) -> list[int] | None:
    """The tokens added since the last call, or None if the context was rewritten
    (shorter, or its last indexed token differs): the caller then starts afresh."""
    have = len(self.tokens)
    if len(tokens) < have or (have and tokens[have - 1] != self.tokens[-1]):
      return None
    return [int(t) for t in tokens[have:]]


class _NgramState:
  """Per-request index of NgramProposer: the context, and per n the latest end of each n-gram."""

  __slots__ = ("ctx", "latest")

  def __init__(self, num_n: int):
    self.ctx = _Context()
    # latest[n - min_n]: n-gram tuple -> end (exclusive) of its latest occurrence that ends
    # before the last position of the context (so the current suffix never matches itself).
    self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(num_n)]


class DraftModelProposer:
  """The draft model's place on the host: its drafts are proposed on the device, in the
  runner's speculative step (serving/runner/draft_model.py), so there is nothing to do
  here but say so."""

  on_device = True

  def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
    raise RuntimeError("the draft model proposes on the device, not on the host")

  def forget(self, request_id: str) -> None:
    """Nothing kept per request."""

  def finish(self, request_id: str, output_tokens: Sequence[int]) -> None:
    """Nothing kept per request."""


class NgramProposer:
  """Prompt lookup decoding: copies what followed the latest earlier occurrence of the
  context's longest matching suffix n-gram (see module doc)."""

  on_device = False

  def __init__(self, min_n: int, max_n: int):
    """`min_n`..`max_n`: the suffix lengths tried, longest first (1 <= min_n <= max_n)."""
    if not 1 <= min_n <= max_n:
      raise ValueError(f"ngram sizes need 1 <= min_n <= max_n, got min_n={min_n}, "
                       f"max_n={max_n}")
    self.min_n, self.max_n = min_n, max_n
    self._state: dict[str, _NgramState] = {}

  def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix
    n-gram (n in [min_n, max_n]); [] if none occurred or k <= 0."""
    if k <= 0:
      return []
    state = self._index(request_id, tokens)
    ctx = state.ctx.tokens
    length = len(ctx)
    for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
      end = state.latest[n - self.min_n].get(tuple(ctx[length - n:]))
      if end is not None:
        return ctx[end:end + k]
    return []

  def forget(self, request_id: str) -> None:
    """Drops the request's index."""
    self._state.pop(request_id, None)

  def finish(self, request_id: str, output_tokens: Sequence[int]) -> None:
    """Same as `forget`: this method learns nothing across requests."""
    self.forget(request_id)

  def _index(self, request_id: str, tokens: Sequence[int]) -> _NgramState:
    """The request's state with every n-gram ending before the last position indexed."""
    state = self._state.get(request_id)
    new = None if state is None else state.ctx.new_tokens(tokens)
    if new is None:
      state = self._state[request_id] = _NgramState(self.max_n - self.min_n + 1)
      new = [int(t) for t in tokens]
    ctx = state.ctx.tokens
    # Ends indexed so far: up to len(ctx) - 1 (the old last position was left out).
    first_end = len(ctx)
    ctx.extend(new)
    min_n = self.min_n
    for n in range(min_n, self.max_n + 1):
      latest = state.latest[n - min_n]
      for end in range(max(first_end, n), len(ctx)):
        latest[tuple(ctx[end - n:end])] = end
    return state


# Suffix trie edges are keyed by (parent node << _SHIFT) | token, so token ids must be below
# 2**_SHIFT (vocabulary ids are).
_SHIFT = 31
_TOKEN_LIMIT = 1 << _SHIFT


class _SuffixTrie:
  """Counts of every substring (up to `depth` long) of some token sequences.

  Flat, so that the garbage collector never walks it (a dict of dicts would make every full
  collection traverse millions of nodes): nodes are ints (0 is the root, the empty string),
  one dict of ints maps (node << _SHIFT | token) to the child, and int32 arrays hold per node:
    count  occurrences of the node's string (sequence positions it starts at)
    cont   occurrences followed by a token (the sum of the children's counts)
    best   the child with the largest count (ties: the one that reached it last), or -1
    token  the token on the edge into the node
  A `removable` trie (the shared one) also links each node's children in a doubly linked list
  (first, next, prev: to rescan and unlink them) and recycles deleted nodes through `free`.
  """

  __slots__ = ("best", "cont", "count", "depth", "edges", "first", "free", "next", "prev",
               "removable", "token")

  def __init__(self, depth: int, removable: bool = False):
    self.depth, self.removable = depth, removable
    self.edges: dict[int, int] = {}
    self.count, self.cont = array.array("i", [0]), array.array("i", [0])
    self.best, self.token = array.array("i", [-1]), array.array("i", [-1])
    size = 1 if removable else 0
    self.first, self.next, self.prev = (array.array("i", [-1] * size),
                                        array.array("i", [-1] * size),
                                        array.array("i", [-1] * size))
    self.free = array.array("i")

  @property
  def num_nodes(self) -> int:
    """Live nodes, the root included."""
    return len(self.count) - len(self.free)

  def children(self, node: int) -> list[int]:
    """The node's children (a scan of all edges unless the trie is removable)."""
    if not self.removable:
      return [c for key, c in self.edges.items() if key >> _SHIFT == node]
    out, child = [], self.first[node]
    while child >= 0:
      out.append(child)
      child = self.next[child]
    return out

  def _new(self, parent: int, token: int) -> int:
    """A new child of `parent` under `token`, counted once."""
    if not self.removable:
      node = len(self.count)
      self.count.append(1)
      self.cont.append(0)
      self.best.append(-1)
      self.token.append(token)
    else:
      head = self.first[parent]
      if self.free:
        node = self.free.pop()
        self.count[node], self.cont[node], self.best[node], self.token[node] = 1, 0, -1, token
        self.first[node], self.next[node], self.prev[node] = -1, head, -1
      else:
        node = len(self.count)
        for arr, value in ((self.count, 1), (self.cont, 0), (self.best, -1),
                           (self.token, token), (self.first, -1), (self.next, head),
                           (self.prev, -1)):
          arr.append(value)
      if head >= 0:
        self.prev[head] = node
      self.first[parent] = node
    self.edges[(parent << _SHIFT) | token] = node
    return node

  def extend(self, active: list[int], token: int) -> list[int]:
    """Appends `token` to a sequence whose suffixes of lengths 0..len(active)-1 are the
    nodes `active` (active[0] is the root); returns the new such list (< depth long)."""
    edges, count, cont, best, new = self.edges, self.count, self.cont, self.best, self._new
    out = [0]
    append = out.append
    for node in active:
      child = edges.get((node << _SHIFT) | token)
      if child is None:
        child = new(node, token)
        c = 1
      else:
        c = count[child] = count[child] + 1
      cont[node] += 1
      b = best[node]
      if b != child and (b < 0 or c >= count[b]):
        best[node] = child
      append(child)
    del out[self.depth:]  # a node at full depth is never extended
    return out

  def add(self, tokens: Sequence[int]) -> None:
    """Counts all substrings (up to depth long) of one more sequence."""
    active = [0]
    for t in tokens:
      active = self.extend(active, t)

  def remove(self, tokens: Sequence[int]) -> None:
    """Uncounts a sequence given to `add`; nodes left with no occurrence are deleted."""
    if not self.removable:
      raise RuntimeError("remove() needs a trie made with removable=True")
    edges, count, cont, best = self.edges, self.count, self.cont, self.best
    depth = self.depth
    best[0] = -1  # the root's is never used: not worth rescanning its many children
    for start in range(len(tokens)):
      window = tokens[start:start + depth]
      node = 0
      for i, t in enumerate(window):
        child = edges[(node << _SHIFT) | t]
        count[child] -= 1
        cont[node] -= 1
        if count[child] == 0:
          # This window was its only occurrence: its subtree is the chain of the window's rest.
          self._unlink(node, child)
          del edges[(node << _SHIFT) | t]
          dead = child
          for t2 in window[i + 1:]:
            self.free.append(dead)
            dead = edges.pop((dead << _SHIFT) | t2)
          self.free.append(dead)
        if node and best[node] == child:
          self._rebest(node)
        if count[child] == 0:
          break
        node = child

  def _unlink(self, parent: int, child: int) -> None:
    prev, nxt = self.prev[child], self.next[child]
    if prev >= 0:
      self.next[prev] = nxt
    else:
      self.first[parent] = nxt
    if nxt >= 0:
      self.prev[nxt] = prev

  def _rebest(self, node: int) -> None:
    """Recomputes the node's most frequent child after a count went down."""
    count = self.count
    best, best_count, child = -1, 0, self.first[node]
    while child >= 0:
      if count[child] > best_count:
        best, best_count = child, count[child]
      child = self.next[child]
    self.best[node] = best

  def match(self, tokens: Sequence[int], max_len: int) -> tuple[int, int]:
    """The longest suffix of `tokens`, at most max_len long, that occurs followed by some
    token: (its length, its node), or (0, -1). Binary search: if a suffix occurs with a
    continuation, so does each shorter one."""
    edges, cont = self.edges, self.cont
    lo, lo_node, hi = 0, -1, min(max_len, len(tokens))
    while lo < hi:
      mid = (lo + hi + 1) // 2
      node: int | None = 0
      for t in tokens[len(tokens) - mid:]:
        node = edges.get((node << _SHIFT) | t)
        if node is None:
          break
      if node is not None and cont[node] > 0:
        lo, lo_node = mid, node
      else:
        hi = mid - 1
    return lo, lo_node

  def path(self, node: int, k: int, min_prob: float) -> list[int]:
    """Up to k tokens from `node`, each the most frequent child, while the child's share of
    the node's continuations is >= min_prob."""
    count, cont, best, token = self.count, self.cont, self.best, self.token
    out: list[int] = []
    while len(out) < k:
      c = cont[node]
      if c <= 0:
        break
      b = best[node]
      if count[b] < min_prob * c:
        break
      out.append(token[b])
      node = b
    return out


class _SuffixState:
  """Per-request state of SuffixProposer: the context, its trie, and the trie nodes of its
  suffixes of lengths 0..max_depth-1."""

  __slots__ = ("active", "ctx", "trie")

  def __init__(self, depth: int):
    self.ctx = _Context()
    self.trie = _SuffixTrie(depth)
    self.active: list[int] = [0]  # the root


class SuffixProposer:
  """Suffix decoding: follows the most frequent continuation of the context's longest
  matching suffix, in its own text or in recently finished outputs (see module doc)."""

  on_device = False

  def __init__(self, max_depth: int = 24, max_cached_requests: int = 64,
               min_prob: float = 0.1):
    """`max_depth`: the longest substring counted (a match plus its proposal fit in it, and
    the match is capped at max_depth - min(k, max_depth // 2) to leave the proposal room);
    `max_cached_requests`: finished outputs kept in the shared trie (oldest evicted; 0: none);
    `min_prob`: a proposal stops before a token seen after fewer than this share of the
    occurrences of the text before it."""
    if max_depth < 2:
      raise ValueError(f"suffix max_depth must be >= 2, got {max_depth}")
    if max_cached_requests < 0:
      raise ValueError(f"suffix max_cached_requests must be >= 0, got {max_cached_requests}")
    if not 0.0 <= min_prob <= 1.0:
      raise ValueError(f"suffix min_prob must be in [0, 1], got {min_prob}")
    self.max_depth, self.max_cached_requests, self.min_prob = (
        max_depth, max_cached_requests, min_prob)
    self._state: dict[str, _SuffixState] = {}
    self._shared = _SuffixTrie(max_depth, removable=True)
    self._cached: collections.deque[list[int]] = collections.deque()

  def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
    """Up to k tokens continuing the longest suffix of `tokens` seen before (in the request's
    own context or in cached outputs); [] if none or k <= 0."""
    if k <= 0:
      return []
    state = self._index(request_id, tokens)
    depth = self.max_depth
    cap = depth - min(k, depth // 2)  # the longest match considered (< depth)
    own, active = state.trie, state.active
    own_len, own_node = 0, -1
    for m in range(min(len(active) - 1, cap), 0, -1):
      if own.cont[active[m]] > 0:  # an occurrence before the current (last) one
        own_len, own_node = m, active[m]
        break
    shared_len, shared_node = 0, -1
    if self._cached:
      shared_len, shared_node = self._shared.match(state.ctx.tokens, cap)
    order = [(own, own_node), (self._shared, shared_node)]
    if shared_len > own_len:
      order.reverse()
    for trie, node in order:
      if node > 0:
        path = trie.path(node, k, self.min_prob)
        if path:
          return path
    return []

  def forget(self, request_id: str) -> None:
    """Drops the request's own trie."""
    self._state.pop(request_id, None)

  def finish(self, request_id: str, output_tokens: Sequence[int]) -> None:
    """Adds the request's output to the shared trie (evicting the oldest beyond
    max_cached_requests) and drops its own trie."""
    self.forget(request_id)
    if self.max_cached_requests == 0 or len(output_tokens) == 0:
      return
    output = _checked([int(t) for t in output_tokens])
    while len(self._cached) >= self.max_cached_requests:  # evict first: fewer nodes at peak
      self._shared.remove(self._cached.popleft())
    self._shared.add(output)
    self._cached.append(output)

  def _index(self, request_id: str, tokens: Sequence[int]) -> _SuffixState:
    """The request's state with its whole context counted in its own trie."""
    state = self._state.get(request_id)
    new = None if state is None else state.ctx.new_tokens(tokens)
    if new is None:
      state = self._state[request_id] = _SuffixState(self.max_depth)
      new = [int(t) for t in tokens]
    _checked(new)
    trie, active = state.trie, state.active
    for t in new:
      active = trie.extend(active, t)
    state.active = active
    state.ctx.tokens.extend(new)
    return state


def _checked(tokens: list[int]) -> list[int]:
  """`tokens`, if all are ids the suffix trie can key (0 <= id < 2**31); else ValueError."""
  if tokens and (min(tokens) < 0 or max(tokens) >= _TOKEN_LIMIT):
    raise ValueError(f"token ids must be in [0, {_TOKEN_LIMIT}) for suffix decoding")
  return tokens


def make_proposer(method: str, *, prompt_lookup_min: int,
                  prompt_lookup_max: int) -> Proposer | None:
  """The proposer of a speculative decoding method: "ngram" (sizes
  prompt_lookup_min..prompt_lookup_max), "suffix", or "draft" (a marker: the draft
  model proposes on the device, in the runner); None for "none". ValueError for
  other methods."""
  if method == "ngram":
    return NgramProposer(prompt_lookup_min, prompt_lookup_max)
  if method == "suffix":
    return SuffixProposer()
  if method == "draft":
    return DraftModelProposer()
  if method == "none":
    return None
  raise ValueError(f"unknown speculative decoding method {method!r} "
                   "(expected 'ngram', 'suffix', 'draft' or 'none')")
