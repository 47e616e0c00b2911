"""The engine loop: schedule, run, postprocess, emit — one thread.

Lifecycle of `step()`:
  1. Take requests added / aborted from other threads (inbox under a lock).
  2. `scheduler.schedule()` -> StepPlan (host only).
  3. `runner.execute(plan=...)` dispatches it (asynchronous: returns at once).
  4. Postprocess the *previous* step while the device computes this one:
     `runner.fetch(...)` -> StepResult, append tokens, advance output
     grammars, detokenize, check stop strings, emit deltas.
  3a. With the tiered prefix cache (serving/engine/kv_offload.py), between 2 and 3:
     the pages the schedule evicted are gathered for the host tier and the
     plan's tier hits reloaded into their device pages; after 3 the copies
     started by the previous step land in the host tier. A disk tier's pages are
     read ahead by a reader thread; a step with nothing to run waits briefly for
     those reads instead of spinning.
  5. If this step samples requests with an output constraint, their token
     masks depend on the tokens just appended: the runner ran its forward
     passes in 3 and waits; the engine fills the masks now (while the device
     still computes) and hands them over with `runner.sample(...)`.

A speculative step (docs/spec_decode.md) needs the latest tokens on the host to
propose drafts, so when the back-off (serving/spec_decode/backoff.py) lets the
engine speculate, step 4 comes first: postprocess, then schedule with drafts.
The step after a speculative one also waits for it: each row kept a number of
drafts the host learns only from its result.

The engine owns no device and loads nothing: it is given a `Runner`
(runner_api.py), a tokenizer and an `EngineConfig`. Front ends call
`add_request(...)` with an `on_output` callback that receives delta
`RequestOutput`s on the engine thread; `LLM` and the async front ends
(serving/entrypoints/) build on this.

Failures (docs/reliability.md): a step whose runner call raises fails the
requests it names (`StepError`), or all of that step, and rolls the others
back to the queue; waiting requests are never touched. Anything else —
`RunnerDeadError`, an exception escaping the loop — kills the engine: every
request ends with an error, `add_request` raises `EngineDeadError`, and
`health()` says why. `health()` also reports a step running longer than
`config.scheduler.step_timeout_s` (a wedged device call), so the server can give up on it.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from serving.config import EngineConfig
from serving.engine.client import EngineDeadError
from serving.engine.kv_events import KVEventRecorder
from serving.engine.kv_offload import HostPagePool, KVOffload, PageStore
from serving.engine.lora_slots import LoraSlots
from serving.engine.output_processor import OutputProcessor
from serving.engine.page_allocator import PageAllocator, WindowPages
from serving.engine.runner_api import Runner, RunnerDeadError, StepError
from serving.engine.scheduler import Scheduler
from serving.spec_decode import SpecBackoff, make_proposer
from serving.structured_output import GrammarCompiler, fill_draft_masks, fill_masks
from serving.types import (
  EngineStats,
  LoraAdapter,
  RequestOutput,
  SamplingParams,
  Sequence,
  SpecDecodeCounters,
  StepPlan,
)

log = logging.getLogger(__name__)
OutputCallback = Callable[[RequestOutput], None]
LoraLoader = Callable[[str], tuple[int, Any]]
T = TypeVar("T")


def release_free_heap() -> None:
  """Returns the C heap's free pages to the system (glibc `malloc_trim`; elsewhere a
  no-op). A burst of requests leaves host buffers freed but mapped (inputs, outputs,
  XLA:CPU temporaries): without this an idle server keeps the RSS of its busiest
  moment (docs/performance.md)."""
  global _malloc_trim
  if _malloc_trim is None:
    try:
      _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
      _malloc_trim = False
  if _malloc_trim:
    _malloc_trim(0)


_malloc_trim = None
IDLE_TRIM_S = 0.5  # idle time after a burst before its freed heap goes back (release_free_heap)


class LLMEngine:
  """Continuous-batching engine over one runner (see module doc); an `EngineClient`
  (serving/engine/client.py), as are the composite engines built from it."""

  def __init__(self, *, runner: Runner, tokenizer: Any, config: EngineConfig,
               model_name: str = "", lora_loader: LoraLoader | None = None,
               structured_output: bool = True, kv_disk: PageStore | None = None):
    """`lora_loader(path) -> (rank, weights)` reads and validates an adapter for this
    runner (serving/entrypoints/engine_builder.py); needed by `load_lora`.
    `structured_output=False` refuses requests with `structured_outputs` (a runner
    that cannot sample after `execute`, e.g. multi-process lock-step). `kv_disk`: the
    tiered prefix cache's disk tier (serving/engine/kv_disk_store.py), with
    `kv_offload_disk_dir`."""
    self.runner, self.tokenizer, self.config = runner, tokenizer, config
    self.model_name = model_name
    self.lora_loader = lora_loader
    if runner.state_slots and config.cache.enable_prefix_caching:
      # A cached prefix's pages hold the full-attention layers' K/V, not the linear
      # layers' states at that position (serving/runner/state_cache.py).
      log.info("prefix caching off: the model's linear-attention layers keep per-sequence "
               "states that cached pages do not hold")
      config = self.config = config.replace(enable_prefix_caching=False)
    self.allocator = PageAllocator(runner.num_pages, config.cache.page_size,
                                   config.cache.enable_prefix_caching)
    self.kv_events: KVEventRecorder | None = None
    group = runner.window_group  # a hybrid model's sliding-window layers: their own pages
    self.window = None if group is None else WindowPages(
        group.num_pages, config.cache.page_size, group.window, config.cache.enable_prefix_caching)
    if group is not None:  # one sequence's window and two prefill chunks must fit
      ps, chunk = config.cache.page_size, config.scheduler.max_num_batched_tokens
      need = min(-(-(group.window + 2 * chunk) // ps) + 2, config.max_pages_per_seq)
      if group.num_pages - 1 < need:
        raise ValueError(f"the sliding-window page group has {group.num_pages - 1} pages; one "
                         f"sequence can need {need} (window {group.window}, chunks of {chunk})")
    if (kv_disk is not None) != (config.cache.kv_offload_disk_dir is not None):
      raise ValueError("kv_disk (the disk tier's store) goes with kv_offload_disk_dir")
    self.offload = (_make_offload(runner, config, kv_disk) if config.cache.kv_offload_host_gb
                    else None)
    if self.offload is not None:
      self.allocator.listeners.append(self.offload)
    self.lora_slots = LoraSlots(config.lora.max_loras) if config.lora.max_loras else None
    proposer = make_proposer(config.speculative.speculative_method,
                             prompt_lookup_min=config.speculative.prompt_lookup_min,
                             prompt_lookup_max=config.speculative.prompt_lookup_max)
    self.scheduler = Scheduler(config, self.allocator, self.lora_slots, proposer, self.window,
                               self.offload)
    self.spec = SpecBackoff(enabled=config.speculative.enabled,
                            max_batch=config.speculative.speculative_max_batch)
    self.spec_counters = SpecDecodeCounters()
    self._loras: dict[str, LoraAdapter] = {}  # registered adapters by name
    self._lora_ids = itertools.count(1)
    self._lora_names: dict[int, str] = {}  # every adapter id ever registered -> its name
    self.outputs = OutputProcessor(tokenizer)
    self.grammars = GrammarCompiler(tokenizer, runner.vocab_size) if structured_output else None
    self.num_programs = runner.warm_up()
    release_free_heap()  # warm-up's host buffers: freed, not kept as resident memory
    self._lock = threading.Lock()
    self._inbox: list[tuple[Sequence, OutputCallback]] = []
    self._aborts: list[str] = []
    self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
    self._seqs: dict[str, Sequence] = {}
    self._inflight: tuple[StepPlan, Any] | None = None
    self._last_result_at: float | None = None  # when the latest step's result came back
    seed = config.scheduler.seed if config.scheduler.seed is not None else secrets.randbits(63)
    self._rng = np.random.default_rng(seed)
    self._thread: threading.Thread | None = None
    self._stop = threading.Event()
    self._wake = threading.Event()
    self._step_started: float | None = None  # monotonic time the running step began
    self.dead: str | None = None  # why the engine cannot serve, once it cannot
    self.prompt_tokens_total = 0

  @property
  def num_slots(self) -> int:
    """Requests decoded at once (`max_num_seqs`)."""
    return self.config.scheduler.max_num_seqs

  @property
  def max_model_len(self) -> int:
    return self.config.scheduler.max_model_len

  # ---- requests (any thread) ----

  def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                  on_output: OutputCallback, lora: str | None = None) -> None:
    """Validates and queues a request; raises ValueError with a message if invalid.

    `lora` names a registered adapter (`add_lora`); None serves the base model.
    A `params.structured_outputs` constraint is compiled here (cached when the
    front end checked it already: `check_structured_outputs`).
    """
    ids = self.prompt_ids(prompt)
    self.validate(ids, params)
    adapter = self.get_lora(lora) if lora is not None else None
    grammar = None
    if params.structured_outputs is not None:
      grammar = self._compiler().grammar(params.structured_outputs)
    seed = params.seed if params.seed is not None else int(self._rng.integers(2**31))
    eos = frozenset(self.tokenizer.eos_token_ids)
    seq = Sequence(request_id=request_id, prompt_ids=ids, params=params, eos_ids=eos, seed=seed,
                   lora=adapter, grammar=grammar)
    with self._lock:
      if self.dead is not None:
        raise EngineDeadError(self.dead)
      if request_id in self._seqs or any(s.request_id == request_id for s, _ in self._inbox):
        raise ValueError(f"duplicate request id {request_id!r}")
      self._inbox.append((seq, on_output))
    self._wake.set()

  def check_structured_outputs(self, params: SamplingParams) -> None:
    """Compiles `params.structured_outputs` if set; ValueError naming the field if it is
    bad. Front ends call it in a worker thread (it can take a while for a big schema);
    `add_request` then finds it cached."""
    if params.structured_outputs is not None:
      self._compiler().check(params.structured_outputs)

  def _compiler(self) -> GrammarCompiler:
    if self.grammars is None:
      raise ValueError("structured_outputs are not supported by this engine (multi-process "
                       "serving); serve without them or on one process")
    return self.grammars

  # ---- LoRA adapters (any thread) ----

  def add_lora(self, name: str, path: str, rank: int, weights) -> LoraAdapter:
    """Registers an adapter under `name` (validated weights from checkpoints.lora).

    It takes a runner slot only while requests use it (lora_slots.py). A name
    already registered raises ValueError: unload it first.
    """
    if self.lora_slots is None:
      raise ValueError("LoRA is not enabled on this engine (start it with max_loras >= 1)")
    if not name or name == self.model_name:
      raise ValueError(f"LoRA adapter name {name!r} must be non-empty and differ from the "
                       "base model's")
    with self._lock:
      if name in self._loras:
        raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
      adapter = LoraAdapter(name=name, lora_id=next(self._lora_ids), path=path, rank=rank,
                            weights=weights)
      self._loras[name] = adapter
      self._lora_names[adapter.lora_id] = name
    log.info("LoRA adapter %r registered (rank %d, %s)", name, rank, path)
    return adapter

  def load_lora(self, name: str, path: str) -> LoraAdapter:
    """Reads an adapter with `lora_loader` and registers it (`add_lora`).

    Raises ValueError (checkpoints.lora.LoraError among them) for an adapter that
    cannot be served, with a message saying why.
    """
    if self.lora_loader is None:
      raise ValueError("LoRA is not enabled on this engine (start it with max_loras >= 1)")
    with self._lock:
      if name in self._loras:
        raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
    rank, weights = self.lora_loader(path)
    return self.add_lora(name, path, rank, weights)

  def remove_lora(self, name: str) -> None:
    """Unregisters an adapter: new requests cannot name it; running ones finish with it."""
    with self._lock:
      if self._loras.pop(name, None) is None:
        raise KeyError(f"no LoRA adapter named {name!r}")
    log.info("LoRA adapter %r unregistered", name)

  def get_lora(self, name: str) -> LoraAdapter:
    with self._lock:
      adapter = self._loras.get(name)
    if adapter is None:
      raise ValueError(f"no LoRA adapter named {name!r}")
    return adapter

  def list_loras(self) -> list[LoraAdapter]:
    with self._lock:
      return list(self._loras.values())

  def lora_name(self, lora_id: int) -> str | None:
    """The name adapter `lora_id` was registered under (also once unloaded), or None."""
    with self._lock:
      return self._lora_names.get(lora_id)

  def abort(self, request_id: str) -> None:
    with self._lock:
      self._aborts.append(request_id)
    self._wake.set()

  def call_soon(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
    """Runs `fn()` on the engine thread between steps (after that step's new requests
    are queued); its result or exception lands in the returned future. A call that
    raises `RunnerDeadError` also kills the engine; a dead engine fails every call.
    Disaggregated serving moves KV pages with these (serving/engine/disaggregated.py)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    with self._lock:
      if self.dead is not None:
        future.set_exception(EngineDeadError(self.dead))
        return future
      self._calls.append((fn, future))
    self._wake.set()
    return future

  def prompt_ids(self, prompt: str | list[int]) -> list[int]:
    """The prompt as token ids (text is tokenized); ValueError if it is empty."""
    if isinstance(prompt, str):
      if not prompt:
        raise ValueError("prompt must not be empty")
      ids = self.tokenizer.encode(prompt, add_special_tokens=True)
    else:
      ids = [int(t) for t in prompt]
    if not ids:
      raise ValueError("prompt must not be empty")
    return ids

  def validate(self, ids: list[int], params: SamplingParams) -> None:
    """Raises ValueError, with the reason, for a request this engine cannot serve."""
    params.validate()
    vocab = self.runner.vocab_size
    if any(t < 0 or t >= vocab for t in ids):
      raise ValueError(f"prompt token ids must be in [0, {vocab})")
    if any(t >= vocab for t in params.stop_token_ids):
      raise ValueError(f"stop_token_ids must be in [0, {vocab})")
    limit = self.config.scheduler.max_model_len
    if len(ids) >= limit:
      raise ValueError(f"prompt has {len(ids)} tokens; the maximum context length is {limit} "
                       "tokens including at least one generated token")
    if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
      raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                       f"the maximum context length of {limit} tokens")
    total = len(ids) + (params.max_tokens or limit - len(ids))
    need = -(-total // self.config.cache.page_size)
    if need > self.allocator.num_usable:
      raise ValueError(f"request needs {need} KV pages but the cache holds only "
                       f"{self.allocator.num_usable}; lower max_tokens or the prompt length")

  # ---- the loop (engine thread) ----

  def has_unfinished(self) -> bool:
    with self._lock:
      return bool(self._inbox or self._seqs or self._inflight or self._calls)

  def step(self) -> None:
    """One iteration: admit, schedule, dispatch, postprocess the previous step."""
    self._step_started = time.monotonic()
    try:
      self._step()
    finally:
      self._step_started = None
      if self.kv_events is not None:
        self.kv_events.flush()

  def _step(self) -> None:
    self._drain_inbox()
    speculate = self.spec.wants_step(len(self.scheduler.running))
    # Drafts are proposed from the latest tokens; and after a speculative step the host
    # cannot tell where its rows stand (how many tokens each kept) until it is fetched.
    if self._inflight is not None and (speculate or self._inflight[0].speculative):
      previous, self._inflight = self._inflight, None
      self._postprocess(*previous)
    plan = self.scheduler.schedule(speculate=speculate)
    if speculate and not plan.speculative:  # nothing proposed: a step that gained nothing
      self.spec.record(len(plan.decodes), 0)
    if self.offload is not None:  # before the step writes (and donates) the pool
      for reload in self.offload.before_step(plan):
        self.scheduler.drop_reload(plan, reload)
    inflight = None
    needs_masks = bool(plan.constrained)  # the runner sees the same when it executes
    if not plan.empty:
      try:
        inflight = (plan, self.runner.execute(plan=plan))
      except Exception as e:  # the plan was not (fully) dispatched
        self._fail_step(plan, e)
    previous, self._inflight = self._inflight, inflight
    if previous is not None:
      self._postprocess(*previous)
    elif inflight is None and self.offload is not None:  # maybe waiting for a disk read
      self.offload.wait_for_reads(0.005)
    if inflight is not None and needs_masks:
      self._sample_constrained(*inflight)
    if self.offload is not None:  # after the outputs: host copies never delay a token
      self.offload.after_dispatch()

  def _sample_constrained(self, plan: StepPlan, handle: Any) -> None:
    """Fills the token masks of the step's constrained requests and lets the runner sample.

    The grammars have just taken the previous step's tokens. A request whose
    grammar cannot go on fails alone; a failure of the runner fails the step.
    """
    seqs = [s for s in plan.sampled if s.grammar is not None and s.finish_reason is None]
    try:
      by_id, dead = self._token_masks(plan, seqs)
      for seq in dead:
        why = seq.grammar.error or "no token can continue it"
        self._finish(seq, "error", error=f"structured output failed: {why}")
      self.runner.sample(handle=handle, masks=by_id)
    except Exception as e:  # the masks or the sampling: a failed step, not a dead engine
      self._inflight = None
      self._fail_step(plan, e)

  def _token_masks(self, plan: StepPlan, seqs: list[Sequence]
                   ) -> tuple[dict[str, np.ndarray], list[Sequence]]:
    """Each constrained request's mask (one per position for a row verifying drafts, the
    n-th assuming drafts 1..n), and the requests whose grammar cannot go on."""
    vocab = self.runner.vocab_size
    drafts = {r.seq.request_id: r.drafts for r in plan.decodes} if plan.speculative else {}
    single = [s for s in seqs if s.request_id not in drafts]
    rows = [s for s in seqs if s.request_id in drafts]
    by_id, dead = {}, []
    for group, (masks, refused) in (
        (single, fill_masks([s.grammar for s in single], vocab)),
        (rows, fill_draft_masks([s.grammar for s in rows], [drafts[s.request_id] for s in rows],
                                self.config.speculative.num_speculative_tokens + 1, vocab))):
      dead += [group[i] for i in refused]
      by_id.update({s.request_id: masks[i] for i, s in enumerate(group) if i not in refused})
    return by_id, dead

  def _drain_inbox(self) -> None:
    with self._lock:
      inbox, self._inbox = self._inbox, []
      aborts, self._aborts = self._aborts, []
    for seq, cb in inbox:
      self._seqs[seq.request_id] = seq
      self.outputs.add(seq, cb)
      self.scheduler.add(seq)
      self.prompt_tokens_total += len(seq.prompt_ids)
    for rid in aborts:
      seq = self._seqs.get(rid)
      if seq is not None:
        self._finish(seq, "abort")
    self._run_calls()

  def _run_calls(self) -> None:
    with self._lock:
      calls, self._calls = self._calls, []
    for i, (fn, future) in enumerate(calls):
      try:
        future.set_result(fn())
      except Exception as e:
        future.set_exception(e)
        if isinstance(e, RunnerDeadError):  # the device is gone: so is the engine
          with self._lock:
            self._calls[:0] = calls[i + 1:]
          raise

  def _postprocess(self, plan: StepPlan, handle: Any) -> None:
    try:
      result = self.runner.fetch(handle=handle)
    except Exception as e:
      self._fail_step(plan, e)
      return
    if plan.speculative:
      self._count_speculation(plan, result)
    self._time_step(plan, result)
    for seq, run in self.scheduler.postprocess(plan, result):
      try:
        self._take_run(seq, run)
      except Exception as e:  # e.g. an undecodable token: fail this request only
        log.exception("output processing failed for request %s", seq.request_id)
        self._finish(seq, "error", error=f"output processing failed: {e}")
        continue
      if seq.finish_reason is not None:
        self._finish(seq, seq.finish_reason)
      else:
        self.outputs.emit(seq)

  def _take_run(self, seq: Sequence, run: list) -> None:
    """Feeds a step's tokens of one request (the scheduler appended them) to its grammar
    and output; a stop string or a complete grammar ends the request there, dropping
    the run's later tokens.

    The grammar follows every token of the run, also when the scheduler has already
    finished the request at the run's last one (EOS, a stop id, max_tokens): a
    speculative run can complete the grammar before that token (a kept draft, then an
    EOS the grammar allows), and the request then ends where the grammar completed.
    """
    for i, sampled in enumerate(run):
      complete = self._follow_grammar(seq, sampled.token_id)
      if self.outputs.on_token(seq, sampled) or complete:
        del seq.output_ids[len(seq.output_ids) - len(run) + i + 1:]
        if seq.finish_reason is None:
          self.scheduler.finish(seq, "stop")
        else:  # the run went on to a later stop condition: this one came first
          if i < len(run) - 1 and seq.stop_reason == run[-1].token_id:
            seq.stop_reason = None  # the stop id is dropped with the run's tail
          seq.finish_reason = "stop"
        return

  def _time_step(self, plan: StepPlan, result) -> None:
    """The back-off's timing of decode-only steps: tokens over the time since the
    previous step's result (a plain step's device time overlaps the host's work, a
    speculative step's does not: each pays what it costs)."""
    now = time.monotonic()
    last, self._last_result_at = self._last_result_at, now
    if last is None or plan.prefills or not plan.decodes:
      return
    tokens = sum(len(result.tokens.get(r.seq.request_id, ())) for r in plan.decodes)
    self.spec.record_time(plan.speculative, tokens, now - last)

  def _count_speculation(self, plan: StepPlan, result) -> None:
    """Acceptance counters (metrics) and the back-off's view of a speculative step."""
    kept_total = 0
    for row in plan.decodes:
      rid = row.seq.request_id
      proposed = result.num_drafts.get(rid, 0)
      kept = max(0, len(result.tokens.get(rid, ())) - 1)
      self.spec_counters.record(proposed, kept)
      kept_total += kept
    self.spec.record(len(plan.decodes), kept_total)

  @staticmethod
  def _follow_grammar(seq: Sequence, token: int) -> bool:
    """Advances the sequence's output grammar by its new token; True once the grammar
    is complete (the output is whole: the request stops). Raises ValueError for a token
    the grammar refuses (the request then fails)."""
    if seq.grammar is None:
      return False
    if not seq.grammar.accept(token):
      raise ValueError(f"token {token} violates the output constraint "
                       f"({seq.grammar.error or 'refused'})")
    return seq.grammar.terminated

  def _fail_step(self, plan: StepPlan, error: Exception) -> None:
    """Fails the requests of a step that raised: those it names, else all of the step.

    `scheduler.fail` rolls every sequence of the step back to the queue (pages
    freed, no prefix hash published); the blameless ones are recomputed. A lost
    device (`RunnerDeadError`) is not a step failure: it propagates and kills
    the engine.
    """
    if isinstance(error, RunnerDeadError):
      raise error
    named = set(error.request_ids) if isinstance(error, StepError) else None
    log.error("step failed (%s): %s", "requests " + ", ".join(sorted(named)) if named else
              "whole step", error)
    for seq in self.scheduler.fail(plan):
      if named is None or seq.request_id in named:
        self._finish(seq, "error", error=f"step failed: {error}")

  def _finish(self, seq: Sequence, reason, error: str | None = None) -> None:
    self.scheduler.finish(seq, reason)
    seq.grammar = None
    self.outputs.emit(seq, reason, error=error)
    self._seqs.pop(seq.request_id, None)

  def flush_evictions(self) -> None:
    """Starts the host-tier copy of pages evicted outside a step (a KV import's `adopt`),
    before the import overwrites them; nothing without the tiered prefix cache."""
    if self.offload is not None:
      self.offload.flush_evictions()

  def run_until_idle(self) -> None:
    """Steps until every request has finished (the caller's thread)."""
    while self.has_unfinished():
      self.step()

  def start(self) -> None:
    """Runs the step loop in the engine thread from now on (idempotent)."""
    if self._thread is None:
      self._thread = threading.Thread(target=self._loop, name="xlaserve-engine", daemon=True)
      self._thread.start()

  @property
  def runs_in_background(self) -> bool:
    """True between `start()` and `shutdown()`: the engine thread owns the loop."""
    return self._thread is not None

  def _loop(self) -> None:
    # Since when the loop has had nothing to do (None: trimmed since); start-up's
    # buffers count as a burst.
    idle_since: float | None = time.monotonic()
    while not self._stop.is_set():
      if self.has_unfinished():
        idle_since = time.monotonic()
        try:
          self.step()
        except Exception as e:  # the state is not trusted any more: stop serving
          log.exception("engine step failed; the engine stops")
          self.die(f"engine failed: {type(e).__name__}: {e}")
          return
      else:
        # Idle for IDLE_TRIM_S after a burst: hand the heap it freed back to the system
        # (not at once: some of it is freed after the last step, e.g. by the threads that
        # send the responses; trimmed at once, a server kept ~0.1 GB more).
        if idle_since is not None and time.monotonic() - idle_since >= IDLE_TRIM_S:
          idle_since = None
          release_free_heap()
        self._wake.wait(0.05)
        self._wake.clear()

  def die(self, reason: str) -> None:
    """Stops serving for good: every request (queued or running) ends with `reason`."""
    with self._lock:
      if self.dead is None:
        self.dead = reason
      inbox, self._inbox = self._inbox, []
      calls, self._calls = self._calls, []
    self._inflight = None
    for _, future in calls:
      future.set_exception(EngineDeadError(reason))
    for seq, cb in inbox:
      self.outputs.add(seq, cb)
      self._seqs[seq.request_id] = seq
    for seq in list(self._seqs.values()):
      try:
        self._finish(seq, "error", error=reason)
      except Exception:  # noqa: BLE001 -- keep failing the others
        log.exception("could not fail request %s", seq.request_id)

  def health(self) -> str | None:
    """None while the engine can serve; otherwise why not (dead, loop gone, wedged step)."""
    if self.dead is not None:
      return self.dead
    if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
      return "the engine loop has stopped"
    started = self._step_started
    if started is not None and time.monotonic() - started > self.config.scheduler.step_timeout_s:
      return (f"a step has been running for {time.monotonic() - started:.0f} s "
              f"(step_timeout_s={self.config.scheduler.step_timeout_s:g}): the device looks wedged")
    return None

  def shutdown(self, timeout_s: float = 10.0) -> None:
    """Stops the loop (waiting up to `timeout_s` for the current step) and the runner."""
    self._stop.set()
    self._wake.set()
    stopped = True
    if self._thread is not None:
      self._thread.join(timeout=timeout_s)
      stopped = not self._thread.is_alive()
      self._thread = None
    if self.offload is not None:
      if stopped and self.dead is None:
        written = self.offload.spill_to_disk()  # a restart warms its prefix cache from them
        if written:
          log.info("KV offload: %d host-tier pages written to the disk tier", written)
      self.offload.close()
    self.runner.close()
    if self.kv_events is not None:
      self.kv_events.publisher.close()

  # ---- the prefix cache, from other threads ----

  def attach_kv_events(self, recorder: KVEventRecorder) -> None:
    """Publishes the prefix cache's changes through `recorder` from now on, one batch per
    step (serving/engine/kv_events.py); `shutdown` closes its publisher. Before `start`.
    The full-attention pages only: the prefix a router matches."""
    self.kv_events = recorder
    self.allocator.listeners.append(recorder)

  def _on_engine_thread(self, fn: Callable[[], T]) -> T:
    """`fn()` on the engine thread between steps when the loop runs in the background
    (TimeoutError after `step_timeout_s`: a wedged step), else here (the caller steps the
    engine); its events are published either way."""
    if self.runs_in_background:
      return self.call_soon(fn).result(timeout=self.config.scheduler.step_timeout_s)
    try:
      return fn()
    finally:
      if self.kv_events is not None:
        self.kv_events.flush()

  def reset_prefix_cache(self) -> int:
    """Forgets every cached prefix (vLLM's reset_prefix_cache; held pages stay with their
    requests), publishing AllBlocksCleared. -> how many prefixes were dropped."""
    def clear() -> int:
      if self.window is not None:
        self.window.allocator.clear_cache()
      return self.allocator.clear_cache()
    return self._on_engine_thread(clear)

  def prefix_cache_hashes(self) -> list[list[bytes]]:
    """The prefix hashes the cache holds now, one list (this engine's): what a KV event
    subscriber rebuilds (docs/kv_events.md)."""
    return [self._on_engine_thread(self.allocator.cached_hashes)]

  def stats(self) -> EngineStats:
    s, a = self.scheduler, self.allocator
    return EngineStats(
        num_running=len(s.running), num_waiting=len(s.waiting), kv_cache_usage=self.kv_cache_usage,
        num_pages_total=a.num_usable, num_pages_free=a.num_free,
        num_preemptions_total=s.num_preemptions, prompt_tokens_total=self.prompt_tokens_total,
        generation_tokens_total=self.outputs.generation_tokens_total,
        prefix_cache_queries_total=a.stats.queries, prefix_cache_hits_total=a.stats.hits,
        prefill_tokens_computed_total=s.prefill_tokens_computed,
        lora_running=self.lora_slots.running_by_adapter() if self.lora_slots else {},
        lora_waiting=s.waiting_by_adapter(),
        lora_swaps_total=self.lora_slots.num_swaps if self.lora_slots else 0,
        max_lora=self.config.lora.max_loras, page_size=a.page_size,
        kv_events_dropped_total=(self.kv_events.publisher.dropped_batches
                                 if self.kv_events is not None else 0),
        spec_decode=dataclasses.replace(self.spec_counters,
                                        accepted_per_pos=list(self.spec_counters.accepted_per_pos)),
        kv_offload=self.offload.snapshot() if self.offload is not None else None)

  @property
  def kv_cache_usage(self) -> float:
    """Fraction of the KV pages in use: of a hybrid model's two page groups, the fuller
    one's (the first to run out decides when requests are preempted)."""
    if self.window is None:
      return self.allocator.usage
    return max(self.allocator.usage, self.window.allocator.usage)

  def replica_stats(self) -> list[EngineStats]:
    """One engine, one row (EngineClient: composite engines give one per member)."""
    return [self.stats()]

  @property
  def replica_roles(self) -> list[str]:
    return ["both"]

  def transfer_stats(self) -> dict[str, int]:
    """No KV moves between engines here: no counters."""
    return {}


def _make_offload(runner: Runner, config: EngineConfig, disk: PageStore | None = None
                  ) -> KVOffload:
  """The tiered prefix cache's host tier (its memory reserved now) over `runner`; a
  ValueError naming what it cannot serve."""
  if not config.cache.enable_prefix_caching:
    raise ValueError("kv_offload_host_gb needs the prefix cache (enable_prefix_caching; "
                     "models with linear-attention layers serve without it)")
  if runner.window_group is not None:
    raise ValueError("the tiered prefix cache (kv_offload_host_gb) does not move a hybrid "
                     "model's sliding-window pages yet: serve it without kv_offload_host_gb")
  specs = runner.kv_page_specs()
  page_bytes = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in specs)
  pages = config.cache.host_tier_pages(page_bytes)
  if pages < 1:
    raise ValueError(f"kv_offload_host_gb={config.cache.kv_offload_host_gb:g} holds no KV page "
                     f"({page_bytes} bytes each)")
  return KVOffload(runner, HostPagePool(pages, specs), page_size=config.cache.page_size,
                   chunk_pages=config.parallel.kv_transfer_pages, disk=disk)
