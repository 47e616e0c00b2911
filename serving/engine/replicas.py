"""Data parallelism: whole engine replicas behind one cache-aware router.

With `dp` > 1 (EngineConfig) the builder (serving/entrypoints/engine_builder.py)
makes `dp` complete `LLMEngine`s, each with its own runner on its own
`tp * ep` devices, its own scheduler, KV page pool, prefix cache and engine
thread; they share only the tokenizer. Throughput then grows with the
replicas, unlike a `dp` mesh axis inside one engine (which runs the same batch
on every replica). `ReplicatedEngine` is an `EngineClient`
(serving/engine/client.py) like one `LLMEngine`, so every front end (`LLM`,
`AsyncEngine`, HTTP, gRPC, batch) serves it unchanged: every request is sent
to one replica and everything else (LoRA adapters, start, shutdown) to all of
them; `replica_stats()` gives each replica's own stats.

Routing (`ReplicaRouter`), after SGLang's cache-aware router: the router
remembers the page-aligned prompt blocks it sent to each replica (chained
hashes, as the prefix cache keys them; least recently used forgotten beyond
the replica's page count). A request goes to the replica that already holds
the longest prefix of it, unless that replica has more than `balance_slack`
requests in flight beyond the least loaded one; otherwise (no prefix held,
or too uneven) to the least loaded replica, ties to the one routed to least.
The router's record is a prediction (a replica may have evicted a block
since), which costs only a prefix-cache miss when wrong.

Failure: each replica fails only its own requests (`LLMEngine` semantics).
A dead replica takes no new requests, and `health()` names it, so a server
reports itself unhealthy and exits non-zero as it would with one engine;
requests already on the other replicas are failed by that shutdown, not by
the replica that died.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Sequence

from serving.config import EngineConfig
from serving.engine.client import EngineDeadError
from serving.engine.llm_engine import LLMEngine
from serving.types import (
  EngineStats,
  KVOffloadStats,
  KVTierStats,
  RequestOutput,
  SamplingParams,
  SpecDecodeCounters,
)


@dataclasses.dataclass(frozen=True)
class Route:
  """The router's choice for one request."""

  replica: int
  hashes: list[int]  # the prompt's full-page block hashes
  by_prefix: bool  # sent where its prefix is held (else to the least loaded replica)


class ReplicaRouter:
  """Picks the replica for each request from its prompt blocks and the replicas' loads."""

  def __init__(self, num_replicas: int, page_size: int, *, balance_slack: int,
               max_blocks: int):
    if num_replicas < 1:
      raise ValueError(f"num_replicas={num_replicas} must be at least 1")
    self.num_replicas, self.page_size = num_replicas, page_size
    self.balance_slack, self.max_blocks = balance_slack, max_blocks
    # Per replica: block hash -> None, least recently routed first.
    self._blocks = [collections.OrderedDict() for _ in range(num_replicas)]
    self.routed = [0] * num_replicas  # requests sent to each replica
    self.prefix_routed = 0  # requests sent where their prefix was (the rest by load)

  def block_hashes(self, token_ids: Sequence[int]) -> list[int]:
    """Chained hashes of the prompt's full pages: block i's hash covers tokens 0..i."""
    out, h, ps = [], 0, self.page_size
    for start in range(0, len(token_ids) - ps + 1, ps):
      h = hash((h, tuple(token_ids[start:start + ps])))
      out.append(h)
    return out

  def held_blocks(self, replica: int, hashes: list[int]) -> int:
    """How many leading blocks of `hashes` were routed to `replica` (and not forgotten)."""
    held = self._blocks[replica]
    n = 0
    for h in hashes:
      if h not in held:
        break
      n += 1
    return n

  def choose(self, token_ids: Sequence[int], loads: Sequence[int],
             live: Sequence[bool]) -> Route:
    """Where a prompt goes (nothing recorded until `record`). Raises EngineDeadError
    when no replica is live."""
    candidates = [i for i in range(self.num_replicas) if live[i]]
    if not candidates:
      raise EngineDeadError("every engine replica has stopped")
    least = min(candidates, key=lambda i: (loads[i], self.routed[i], i))
    hashes = self.block_hashes(token_ids)
    best, held = least, 0
    for i in candidates:
      n = self.held_blocks(i, hashes)
      if n > held or (n == held and n > 0 and loads[i] < loads[best]):
        best, held = i, n
    if held and loads[best] - loads[least] <= self.balance_slack:
      return Route(best, hashes, by_prefix=True)
    return Route(least, hashes, by_prefix=False)

  def record(self, route: Route) -> None:
    """Counts an admitted request and remembers its blocks on its replica."""
    self.routed[route.replica] += 1
    self.prefix_routed += route.by_prefix
    blocks = self._blocks[route.replica]
    for h in route.hashes:
      blocks[h] = None
      blocks.move_to_end(h)
    while len(blocks) > self.max_blocks:
      blocks.popitem(last=False)


# EngineStats fields merge_stats does not add up: usage (over all pages), per-adapter counts
# and spec decode counters (merged), and per-engine settings (the largest).
_NOT_SUMMED = ("kv_cache_usage", "lora_running", "lora_waiting", "spec_decode", "max_lora",
               "page_size", "kv_offload", "kv_events_dropped_total")


def merge_stats(parts: Sequence[EngineStats]) -> EngineStats:
  """One engine's view of several replicas' stats: counts summed, usage over all pages."""
  total = sum(s.num_pages_total for s in parts)
  free = sum(s.num_pages_free for s in parts)
  lora: collections.Counter[str] = collections.Counter()
  lora_waiting: collections.Counter[str] = collections.Counter()
  spec = SpecDecodeCounters()
  for s in parts:
    lora.update(s.lora_running)
    lora_waiting.update(s.lora_waiting)
    spec.num_drafts += s.spec_decode.num_drafts
    spec.num_draft_tokens += s.spec_decode.num_draft_tokens
    spec.num_accepted_tokens += s.spec_decode.num_accepted_tokens
    per_pos = s.spec_decode.accepted_per_pos
    spec.accepted_per_pos.extend([0] * (len(per_pos) - len(spec.accepted_per_pos)))
    for i, n in enumerate(per_pos):
      spec.accepted_per_pos[i] += n
  summed = {f.name: sum(getattr(s, f.name) for s in parts)
            for f in dataclasses.fields(EngineStats)
            if f.name not in _NOT_SUMMED}
  return EngineStats(**summed, kv_cache_usage=(1.0 - free / total) if total else 0.0,
                     lora_running=dict(lora), lora_waiting=dict(lora_waiting), spec_decode=spec,
                     max_lora=max((s.max_lora for s in parts), default=0),
                     page_size=max((s.page_size for s in parts), default=0),
                     kv_events_dropped_total=max((s.kv_events_dropped_total for s in parts),
                                                 default=0),
                     kv_offload=_merge_offload([s.kv_offload for s in parts]))


def _merge_offload(parts: Sequence[KVOffloadStats | None]) -> KVOffloadStats | None:
  """The tiered prefix caches' counters summed (None when no engine has one)."""
  parts = [p for p in parts if p is not None]
  if not parts:
    return None
  return KVOffloadStats(**{f.name: _sum_counters([getattr(p, f.name) for p in parts])
                           for f in dataclasses.fields(KVOffloadStats)})


def _sum_counters(values: list):
  """Numbers summed; `KVTierStats` field by field (a tier some engines lack: None
  where all lack it); a flag set if any is set."""
  values = [v for v in values if v is not None]
  if not values:
    return None
  if isinstance(values[0], KVTierStats):
    return KVTierStats(**{f.name: _sum_counters([getattr(v, f.name) for v in values])
                          for f in dataclasses.fields(KVTierStats)})
  if isinstance(values[0], bool):
    return any(values)
  return sum(values)


class ReplicatedEngine:
  """Several `LLMEngine` replicas as one `EngineClient` (module doc); `replicas[i]` are
  whole engines, built and warmed up by the caller."""

  def __init__(self, replicas: Sequence[LLMEngine], *, config: EngineConfig,
               balance_slack: int | None = None):
    """`config`: the EngineConfig asked for (its `dp` is the replica count); each
    replica's own config has dp=1. `balance_slack`: in-flight requests a replica may
    have beyond the least loaded one and still get a request for its prefix (default:
    a quarter of a replica's decode slots, at least 1)."""
    if not replicas:
      raise ValueError("a ReplicatedEngine needs at least one replica")
    self.replicas = list(replicas)
    first = self.replicas[0]
    self.config, self.tokenizer, self.model_name = config, first.tokenizer, first.model_name
    self.num_programs = sum(r.num_programs for r in self.replicas)
    slots = first.config.scheduler.max_num_seqs
    slack = balance_slack if balance_slack is not None else max(1, slots // 4)
    self.router = ReplicaRouter(len(self.replicas), first.config.cache.page_size,
                                balance_slack=slack,
                                max_blocks=first.allocator.num_usable)
    self._lock = threading.Lock()
    self._loads = [0] * len(self.replicas)  # requests in flight per replica
    self._owner: dict[str, int] = {}  # request id -> replica, until it finishes

  # ---- model information ----

  @property
  def num_slots(self) -> int:
    """Decode slots over all replicas."""
    return sum(r.num_slots for r in self.replicas)

  @property
  def max_model_len(self) -> int:
    return self.replicas[0].max_model_len

  # ---- requests (any thread) ----

  def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                  on_output: Callable[[RequestOutput], None], lora: str | None = None) -> None:
    """Validates, routes and queues a request (LLMEngine.add_request's errors)."""
    ids = self.replicas[0].prompt_ids(prompt)  # tokenized once, here, for the router
    with self._lock:
      if request_id in self._owner:
        raise ValueError(f"duplicate request id {request_id!r}")
      live = [r.health() is None for r in self.replicas]
      route = self.router.choose(ids, self._loads, live)
      replica = route.replica
      self._owner[request_id] = replica
      self._loads[replica] += 1

    def on_replica_output(out: RequestOutput) -> None:  # the replica's engine thread
      if out.finished:
        self._release(request_id)
      on_output(out)

    try:
      self.replicas[replica].add_request(request_id, ids, params, on_replica_output, lora=lora)
    except BaseException:
      self._release(request_id)
      raise
    with self._lock:
      self.router.record(route)

  def _release(self, request_id: str) -> None:
    with self._lock:
      replica = self._owner.pop(request_id, None)
      if replica is not None:
        self._loads[replica] -= 1

  def abort(self, request_id: str) -> None:
    with self._lock:
      replica = self._owner.get(request_id)
    if replica is not None:
      self.replicas[replica].abort(request_id)

  def check_structured_outputs(self, params: SamplingParams) -> None:
    self.replicas[0].check_structured_outputs(params)

  def replica_of(self, request_id: str) -> int | None:
    """The replica serving an unfinished request (None once finished or unknown)."""
    with self._lock:
      return self._owner.get(request_id)

  # ---- the prefix cache: each replica's own ----

  def reset_prefix_cache(self) -> int:
    return sum(r.reset_prefix_cache() for r in self.replicas)

  def prefix_cache_hashes(self) -> list[list[bytes]]:
    return [r.prefix_cache_hashes()[0] for r in self.replicas]

  # ---- LoRA adapters: every replica holds the same set ----

  def load_lora(self, name: str, path: str):
    adapters = [r.load_lora(name, path) for r in self.replicas]
    return adapters[0]

  def remove_lora(self, name: str) -> None:
    for r in self.replicas:
      r.remove_lora(name)

  def get_lora(self, name: str):
    return self.replicas[0].get_lora(name)

  def list_loras(self):
    return self.replicas[0].list_loras()

  # ---- the loops ----

  def has_unfinished(self) -> bool:
    return any(r.has_unfinished() for r in self.replicas)

  def step(self) -> None:
    """One step of every replica with work (the caller's thread, e.g. `LLM`)."""
    for r in self.replicas:
      if r.has_unfinished():
        r.step()

  def run_until_idle(self) -> None:
    while self.has_unfinished():
      self.step()

  def start(self) -> None:
    for r in self.replicas:
      r.start()

  @property
  def runs_in_background(self) -> bool:
    """True while any replica's loop runs in its own thread."""
    return any(r.runs_in_background for r in self.replicas)

  def health(self) -> str | None:
    """None while every replica can serve; otherwise which one cannot, and why."""
    for i, r in enumerate(self.replicas):
      reason = r.health()
      if reason is not None:
        return f"replica {i}: {reason}"
    return None

  def shutdown(self, timeout_s: float = 10.0) -> None:
    for r in self.replicas:
      r.shutdown(timeout_s)

  def stats(self) -> EngineStats:
    return merge_stats(self.replica_stats())

  def replica_stats(self) -> list[EngineStats]:
    """Each replica's stats, in replica order."""
    return [r.stats() for r in self.replicas]

  @property
  def replica_roles(self) -> list[str]:
    """Every replica prefills and decodes its own requests."""
    return ["both"] * len(self.replicas)

  def transfer_stats(self) -> dict[str, int]:
    """Replicas move no KV pages between them: no counters."""
    return {}
