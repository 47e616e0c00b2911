"""Disaggregated serving: prefill engines and decode engines, KV pages moved between them.

With `prefill_workers = P` and `decode_workers = D` (EngineConfig) the builder
(serving/entrypoints/engine_builder.py) makes P + D whole `LLMEngine`s, each
with its own runner on its own device group, scheduler, KV pool and engine
thread. `DisaggregatedEngine` is an `EngineClient`
(serving/engine/client.py) like `ReplicatedEngine`, so the front ends (`LLM`,
HTTP, gRPC) serve it unchanged; `replica_stats()` / `replica_roles` give each
worker's stats and role, `transfer_stats()` the KV transfer counters. A
request's life:

  1. **Prefill.** The router sends the prompt to the least loaded live
     prefill engine as a one-token request (`<id>/prefill`). Its full pages
     stay in that engine's prefix cache when it finishes.
  2. **Transfer** (`KVTransfer`), chunk by chunk of `kv_transfer_pages`
     pages, each a call on the engine threads between their steps
     (`LLMEngine.call_soon`), so both engines keep serving meanwhile: the
     prefill engine pins the prompt's cached full pages
     (`match_prefix(count=False)`) and gathers one chunk
     (`runner.export_pages`); the decode engine takes pages for it
     (`allocator.adopt`: a page it already caches under the same prefix hash
     is reused, not written), moves the chunk to its device(s) and writes
     it (`runner.import_pages`: `jax.device_put`, device to device where the
     backend can) and
     commits the pages under the prompt's prefix hashes.
  3. **Decode.** The request, with its original id and sampling parameters,
     goes to the decode engine, whose prefix cache now holds every full page
     of the prompt: it computes only the last partial page (fewer than
     `page_size` tokens) and decodes. The transfer's page references are
     dropped at the request's first output (by then the request holds its
     own).

Routing: prefill by load; decode to the engine holding the longest routed
prefix (`ReplicaRouter`, as for dp) or else the least loaded. Prompts shorter
than one page, requests with a LoRA adapter (their pages hash under the
adapter) and requests with penalties (which skip the prefix cache) are
prefilled by the decode engine itself.

Failure: a failed prefill or a failed transfer chunk (a prefill engine that
dies mid-transfer, a decode engine out of pages, a page shape mismatch) fails
that request alone with an error output, and both sides drop the transfer's
references: the decode side's fully written pages stay as ordinary
evictable prefix-cache pages, a chunk never written is freed unpublished. A
dead prefill engine takes no more requests; while none is live, decode
engines prefill for themselves, so the server keeps serving (`health()`
stays green while a decode engine serves; `dead_workers()` names the dead).
An abort during the transfer stops it at the next chunk.

Hybrid-attention models whose sliding-window layers keep their own page group
(`LLMEngine.window`, docs/engine.md "Hybrid attention") are refused: a transfer
moves the full-attention pages only, and the window pages would need their own
chunks (the prompt's last window) and ids on both sides.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence

from serving.config import EngineConfig
from serving.engine.client import EngineDeadError
from serving.engine.kv_transfer import import_chunk
from serving.engine.llm_engine import LLMEngine
from serving.engine.replicas import ReplicaRouter, merge_stats
from serving.types import EngineStats, RequestOutput, SamplingParams

log = logging.getLogger(__name__)
OutputCallback = Callable[[RequestOutput], None]


def _recomputes_prompt(params: SamplingParams) -> bool:
  """Requests with penalties skip the prefix cache (their penalty state is rebuilt from
  a prefill at 0; scheduler.py), so moving their pages would buy nothing."""
  return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
          or params.frequency_penalty != 0.0)


@dataclasses.dataclass
class KVTransfer:
  """One request on its way from a prefill engine to a decode engine."""

  request_id: str
  prompt_ids: list[int]
  params: SamplingParams
  on_output: OutputCallback
  prefill: int  # prefill engine index
  decode: int  # decode engine index
  src_pages: list[int] = dataclasses.field(default_factory=list)  # pinned on the prefill side
  hashes: list[bytes] = dataclasses.field(default_factory=list)
  dst_pages: list[int] = dataclasses.field(default_factory=list)  # held on the decode side
  chunks_done: int = 0
  aborted: bool = False
  stage: str = "prefill"  # prefill -> transfer -> decode


HYBRID_REFUSAL = ("prefill / decode workers do not serve hybrid-attention models (sliding-window "
                  "layers with their own KV pages) yet: serve this model without "
                  "prefill_workers / decode_workers")


class DisaggregatedEngine:
  """Prefill engines and decode engines as one `EngineClient` (module doc)."""

  def __init__(self, prefill: Sequence[LLMEngine], decode: Sequence[LLMEngine], *,
               config: EngineConfig):
    if not prefill or not decode:
      raise ValueError("disaggregated serving needs at least one prefill and one decode engine")
    if any(e.window is not None for e in [*prefill, *decode]):
      raise ValueError(HYBRID_REFUSAL)
    self.prefill, self.decode = list(prefill), list(decode)
    first = self.decode[0]
    self.config, self.tokenizer, self.model_name = config, first.tokenizer, first.model_name
    self.page_size = first.config.cache.page_size
    self.chunk_pages = first.config.parallel.kv_transfer_pages
    self.num_programs = sum(e.num_programs for e in self.engines)
    self.router = ReplicaRouter(len(self.decode), self.page_size,
                                balance_slack=max(1, first.config.scheduler.max_num_seqs // 4),
                                max_blocks=first.allocator.num_usable)
    self._lock = threading.Lock()
    self._prefill_loads = [0] * len(self.prefill)
    self._decode_loads = [0] * len(self.decode)
    self._owner: dict[str, KVTransfer | int] = {}  # in transfer, or its decode engine
    self.transfers_total = 0  # requests whose KV pages moved
    self.transfer_failures_total = 0
    self.pages_transferred_total = 0

  @property
  def engines(self) -> list[LLMEngine]:
    return self.prefill + self.decode

  @property
  def num_slots(self) -> int:
    """Decode slots over the decode engines."""
    return sum(e.num_slots for e in self.decode)

  @property
  def max_model_len(self) -> int:
    return self.decode[0].max_model_len

  # ---- requests (any thread) ----

  def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                  on_output: OutputCallback, lora: str | None = None) -> None:
    """Validates and routes a request (LLMEngine.add_request's errors)."""
    dec0 = self.decode[0]
    ids = dec0.prompt_ids(prompt)
    dec0.validate(ids, params)  # the decode engine's limits, before any work is done
    if params.structured_outputs is not None:
      dec0.check_structured_outputs(params)
    with self._lock:
      if request_id in self._owner:
        raise ValueError(f"duplicate request id {request_id!r}")
      live = [e.health() is None for e in self.decode]
      route = self.router.choose(ids, self._decode_loads, live)
      self.router.record(route)
      self._decode_loads[route.replica] += 1
      prefill = self._pick_prefill()
      direct = (prefill is None or lora is not None or _recomputes_prompt(params)
                or (len(ids) - 1) // self.page_size == 0)
      if direct:
        self._owner[request_id] = route.replica
      else:
        transfer = KVTransfer(request_id, ids, params, on_output, prefill, route.replica)
        self._owner[request_id] = transfer
        self._prefill_loads[prefill] += 1
    if direct:
      try:
        self._submit_decode(request_id, ids, params, on_output, route.replica, lora=lora)
      except BaseException:
        self._forget(request_id)
        raise
      return
    try:
      self.prefill[prefill].add_request(f"{request_id}/prefill", ids, SamplingParams(
          max_tokens=1, temperature=0.0, ignore_eos=True),
          lambda out: self._on_prefilled(transfer, out))
    except EngineDeadError:  # it died since it was picked: the decode worker prefills
      with self._lock:
        self._prefill_loads[prefill] -= 1
        self._owner[request_id] = route.replica
      try:
        self._submit_decode(request_id, ids, params, on_output, route.replica)
      except BaseException:
        self._forget(request_id)
        raise
    except BaseException:
      self._forget(request_id)
      raise

  def _pick_prefill(self) -> int | None:
    live = [i for i, e in enumerate(self.prefill) if e.health() is None]
    return min(live, key=lambda i: (self._prefill_loads[i], i)) if live else None

  def _submit_decode(self, request_id: str, ids: list[int], params: SamplingParams,
                     on_output: OutputCallback, replica: int, lora: str | None = None,
                     release: Callable[[], None] | None = None) -> None:
    def on_decode_output(out: RequestOutput) -> None:  # the decode engine's thread
      nonlocal release
      if release is not None:  # the request holds its pages now: drop the transfer's
        release()
        release = None
      if out.finished:
        self._forget(request_id)
      on_output(out)

    self.decode[replica].add_request(request_id, ids, params, on_decode_output, lora=lora)

  def _forget(self, request_id: str) -> None:
    with self._lock:
      owner = self._owner.pop(request_id, None)
      if owner is None:
        return
      if isinstance(owner, KVTransfer):
        if owner.stage == "prefill":
          self._prefill_loads[owner.prefill] -= 1
        self._decode_loads[owner.decode] -= 1
      else:
        self._decode_loads[owner] -= 1

  # ---- the transfer (engine threads) ----

  def _on_prefilled(self, t: KVTransfer, out: RequestOutput) -> None:
    if not out.finished:
      return
    with self._lock:
      self._prefill_loads[t.prefill] -= 1
      t.stage = "transfer"
    if out.finish_reason == "abort" or t.aborted:
      self._end(t, RequestOutput(t.request_id, t.prompt_ids, "", [], finish_reason="abort"))
      return
    if out.finish_reason == "error":
      self._fail(t, f"prefill failed: {out.error}")
      return
    src = self.prefill[t.prefill]
    src.call_soon(lambda: src.allocator.match_prefix(t.prompt_ids, count=False)
                  ).add_done_callback(lambda f: self._on_pinned(t, f))

  def _on_pinned(self, t: KVTransfer, future) -> None:
    if future.exception() is not None:
      self._fail(t, f"prefill worker failed: {future.exception()}")
      return
    t.src_pages, t.hashes = future.result()
    self._next_chunk(t)

  def _next_chunk(self, t: KVTransfer) -> None:
    if t.aborted:
      self._release_both(t)
      self._end(t, RequestOutput(t.request_id, t.prompt_ids, "", [], finish_reason="abort"))
      return
    start = t.chunks_done * self.chunk_pages
    if start >= len(t.src_pages):
      self._handoff(t)
      return
    pages = t.src_pages[start:start + self.chunk_pages]
    src = self.prefill[t.prefill]
    src.call_soon(lambda: src.runner.export_pages(pages)).add_done_callback(
        lambda f: self._on_exported(t, start, f))

  def _on_exported(self, t: KVTransfer, start: int, future) -> None:
    if future.exception() is not None:
      self._fail(t, f"KV transfer from prefill worker {t.prefill} failed: "
                    f"{future.exception()}")
      return
    k, v = future.result()
    dst = self.decode[t.decode]
    dst.call_soon(lambda: self._import(dst, t, start, k, v)).add_done_callback(
        lambda f: self._on_imported(t, f))

  @staticmethod
  def _import(engine: LLMEngine, t: KVTransfer, start: int, k, v) -> None:
    """On the decode engine's thread: pages for one chunk (the prompt's pages from
    `start` on), written and committed (the cross-process receiver's write too)."""
    t.dst_pages.extend(import_chunk(engine, t.hashes, t.prompt_ids, start, k, v))

  def _on_imported(self, t: KVTransfer, future) -> None:
    if future.exception() is not None:
      self._fail(t, f"KV transfer into decode worker {t.decode} failed: {future.exception()}")
      return
    t.chunks_done += 1
    self._next_chunk(t)

  def _handoff(self, t: KVTransfer) -> None:
    """Every chunk is in: the prefill side lets go, the decode engine takes the request."""
    self._release_src(t)
    with self._lock:
      t.stage = "decode"
      self.transfers_total += 1
      self.pages_transferred_total += len(t.dst_pages)
      if self._owner.get(t.request_id) is t:
        self._owner[t.request_id] = t.decode
    dst, held = self.decode[t.decode], list(t.dst_pages)
    t.dst_pages = []
    release = (lambda: dst.call_soon(lambda: dst.allocator.release(held))) if held else None
    try:
      self._submit_decode(t.request_id, t.prompt_ids, t.params, t.on_output, t.decode,
                          release=release)
    except Exception as e:  # noqa: BLE001 -- the decode engine died meanwhile
      if release is not None:
        release()
      self._end(t, RequestOutput(t.request_id, t.prompt_ids, "", [], finish_reason="error",
                                 error=f"decode worker failed: {e}"))

  def _fail(self, t: KVTransfer, why: str) -> None:
    log.error("request %s: %s", t.request_id, why)
    with self._lock:
      self.transfer_failures_total += 1
    self._release_both(t)
    self._end(t, RequestOutput(t.request_id, t.prompt_ids, "", [], finish_reason="error",
                               error=why))

  def _release_both(self, t: KVTransfer) -> None:
    self._release_src(t)
    held, t.dst_pages = t.dst_pages, []
    if held:
      dst = self.decode[t.decode]
      dst.call_soon(lambda: dst.allocator.release(held))

  def _release_src(self, t: KVTransfer) -> None:
    pinned, t.src_pages = t.src_pages, []
    if pinned:  # a dead prefill engine fails this call: its pages went with it
      src = self.prefill[t.prefill]
      src.call_soon(lambda: src.allocator.release(pinned))

  def _end(self, t: KVTransfer, out: RequestOutput) -> None:
    self._forget(t.request_id)
    t.on_output(out)

  def abort(self, request_id: str) -> None:
    with self._lock:
      owner = self._owner.get(request_id)
    if isinstance(owner, KVTransfer):
      owner.aborted = True
      if owner.stage == "prefill":
        self.prefill[owner.prefill].abort(f"{request_id}/prefill")
    elif owner is not None:
      self.decode[owner].abort(request_id)

  def check_structured_outputs(self, params: SamplingParams) -> None:
    self.decode[0].check_structured_outputs(params)

  # ---- the prefix cache: each worker's own ----

  def reset_prefix_cache(self) -> int:
    return sum(e.reset_prefix_cache() for e in self.engines)

  def prefix_cache_hashes(self) -> list[list[bytes]]:
    return [e.prefix_cache_hashes()[0] for e in self.engines]

  # ---- LoRA adapters: served by the decode engines (prefilled there too) ----

  def load_lora(self, name: str, path: str):
    return [e.load_lora(name, path) for e in self.decode][0]

  def remove_lora(self, name: str) -> None:
    for e in self.decode:
      e.remove_lora(name)

  def get_lora(self, name: str):
    return self.decode[0].get_lora(name)

  def list_loras(self):
    return self.decode[0].list_loras()

  # ---- the loops ----

  def has_unfinished(self) -> bool:
    with self._lock:
      if self._owner:
        return True
    return any(e.has_unfinished() for e in self.engines)

  def step(self) -> None:
    """One step of every engine with work (the caller's thread, e.g. `LLM`)."""
    for e in self.engines:
      if e.has_unfinished() and e.dead is None:
        try:
          e.step()
        except Exception as err:  # noqa: BLE001 -- as the engine's own loop: it stops
          log.exception("engine step failed; the engine stops")
          e.die(f"engine failed: {type(err).__name__}: {err}")

  def run_until_idle(self) -> None:
    while self.has_unfinished():
      self.step()

  def start(self) -> None:
    for e in self.engines:
      e.start()

  @property
  def runs_in_background(self) -> bool:
    """True while any worker's loop runs in its own thread."""
    return any(e.runs_in_background for e in self.engines)

  def health(self) -> str | None:
    """None while every decode engine serves (dead prefill engines only cost speed:
    the decode engines then prefill for themselves)."""
    for i, e in enumerate(self.decode):
      reason = e.health()
      if reason is not None:
        return f"decode worker {i}: {reason}"
    return None

  def dead_workers(self) -> dict[str, str]:
    """'prefill i' / 'decode i' -> why it cannot serve, for every engine that cannot."""
    out = {}
    for role, engines in (("prefill", self.prefill), ("decode", self.decode)):
      for i, e in enumerate(engines):
        reason = e.health()
        if reason is not None:
          out[f"{role} {i}"] = reason
    return out

  def shutdown(self, timeout_s: float = 10.0) -> None:
    for e in self.engines:
      e.shutdown(timeout_s)

  def stats(self) -> EngineStats:
    """The decode engines' stats (what a request sees end to end); prompt tokens are
    counted where the request entered, the decode side."""
    return merge_stats([e.stats() for e in self.decode])

  def replica_stats(self) -> list[EngineStats]:
    """Every engine's stats: prefill workers first, then decode workers
    (`replica_roles`)."""
    return [e.stats() for e in self.engines]

  def transfer_stats(self) -> dict[str, int]:
    """The KV transfer counters (/metrics: xlaserve_kv_transfer*)."""
    with self._lock:
      return {"kv_transfers_total": self.transfers_total,
              "kv_transfer_failures_total": self.transfer_failures_total,
              "kv_transfer_pages_total": self.pages_transferred_total}

  @property
  def replica_roles(self) -> list[str]:
    """The role of each `replica_stats` entry ("prefill" / "decode")."""
    return ["prefill"] * len(self.prefill) + ["decode"] * len(self.decode)
