"""The engine loop: schedule, run, postprocess, emit — one thread.

Lifecycle of `step()`:
  1. Take requests added / aborted from other threads (inbox under a lock).
  2. `scheduler.schedule()` -> StepPlan (host only).
  3. Dispatch the plan's prefill chunks and decode batch to the runner
     (asynchronous: returns device arrays at once).
  4. Postprocess the *previous* step's results while the device computes this
     one: append tokens, detokenize, check stop strings, emit deltas.

Front ends call `add_request(...)` with an `on_output` callback that receives
delta `RequestOutput`s on the engine thread; `LLM` (llm.py) and the async
front ends (async_engine.py) build on this.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
from collections.abc import Callable

import jax
import numpy as np

from serving.config import EngineConfig
from serving.engine_io import build_decode_input, build_prefill_input, capacity_pages
from serving.output_processor import OutputProcessor
from serving.page_allocator import PageAllocator
from serving.runner import ModelRunner
from serving.scheduler import Scheduler, Sequence, StepPlan
from serving.types import RequestOutput, SamplingParams

log = logging.getLogger(__name__)
OutputCallback = Callable[[RequestOutput], None]


@dataclasses.dataclass
class EngineStats:
  num_running: int
  num_waiting: int
  kv_cache_usage: float
  num_pages_total: int
  num_pages_free: int
  num_preemptions_total: int
  prompt_tokens_total: int
  generation_tokens_total: int
  prefix_cache_queries_total: int
  prefix_cache_hits_total: int
  prefill_tokens_computed_total: int


class LLMEngine:
  """Continuous-batching engine over one model (see module doc)."""

  def __init__(self, model, config: EngineConfig | None = None, **engine_kwargs):
    import checkpoints

    config = config or EngineConfig(**engine_kwargs)
    _enable_compilation_cache(config)
    if hasattr(model, "params"):
      loaded = model
    elif config.quantization:  # GGUF blocks of the matching type stay quantized
      from checkpoints.quantize import load_quantized
      loaded = load_quantized(model, config.quantization)
    else:
      loaded = checkpoints.load_checkpoint(model)
    self.model_name = model if isinstance(model, str) else loaded.source
    self.config, self.model_config, self.tokenizer = config, loaded.config, loaded.tokenizer
    num_pages = config.num_pages or capacity_pages(loaded.config, config)
    self.runner = ModelRunner(loaded.params, loaded.config, config, num_pages=num_pages)
    del loaded
    self.allocator = PageAllocator(num_pages, config.page_size, config.enable_prefix_caching)
    self.scheduler = Scheduler(config, self.allocator)
    self.outputs = OutputProcessor(self.tokenizer)
    self._log_capacity()
    self.num_programs = self.runner.warm_up()
    self._lock = threading.Lock()
    self._inbox: list[tuple[Sequence, OutputCallback]] = []
    self._aborts: list[str] = []
    self._seqs: dict[str, Sequence] = {}
    self._inflight: tuple[StepPlan, list] | None = None
    self._rng = np.random.default_rng(config.seed)
    self._thread: threading.Thread | None = None
    self._stop = threading.Event()
    self._wake = threading.Event()
    self.prompt_tokens_total = 0

  # ---- requests (any thread) ----

  def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                  on_output: OutputCallback) -> None:
    """Validates and queues a request; raises ValueError with a message if invalid."""
    ids = self._prompt_ids(prompt)
    self._validate(ids, params)
    seed = params.seed if params.seed is not None else int(self._rng.integers(2**31))
    eos = frozenset(self.tokenizer.eos_token_ids)
    seq = Sequence(request_id=request_id, prompt_ids=ids, params=params, eos_ids=eos, seed=seed)
    with self._lock:
      if request_id in self._seqs or any(s.request_id == request_id for s, _ in self._inbox):
        raise ValueError(f"duplicate request id {request_id!r}")
      self._inbox.append((seq, on_output))
    self._wake.set()

  def abort(self, request_id: str) -> None:
    with self._lock:
      self._aborts.append(request_id)
    self._wake.set()

  def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
      if not prompt:
        raise ValueError("prompt must not be empty")
      ids = self.tokenizer.encode(prompt, add_special_tokens=True)
    else:
      ids = [int(t) for t in prompt]
    if not ids:
      raise ValueError("prompt must not be empty")
    return ids

  def _validate(self, ids: list[int], params: SamplingParams) -> None:
    params.validate()
    vocab = self.model_config.vocab_size
    if any(t < 0 or t >= vocab for t in ids):
      raise ValueError(f"prompt token ids must be in [0, {vocab})")
    limit = self.config.max_model_len
    if len(ids) >= limit:
      raise ValueError(f"prompt has {len(ids)} tokens; the maximum context length is {limit} "
                       "tokens including at least one generated token")
    if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
      raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                       f"the maximum context length of {limit} tokens")
    total = len(ids) + (params.max_tokens or limit - len(ids))
    need = -(-total // self.config.page_size)
    if need > self.allocator.num_usable:
      raise ValueError(f"request needs {need} KV pages but the cache holds only "
                       f"{self.allocator.num_usable}; lower max_tokens or the prompt length")

  # ---- the loop (engine thread) ----

  def has_unfinished(self) -> bool:
    with self._lock:
      return bool(self._inbox or self._seqs or self._inflight)

  def step(self) -> None:
    """One iteration: admit, schedule, dispatch, postprocess the previous step."""
    self._drain_inbox()
    plan = self.scheduler.schedule()
    handles = self._dispatch(plan) if not plan.empty else None
    if self._inflight is not None:
      self._postprocess(*self._inflight)
    self._inflight = (plan, handles) if handles is not None else None

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

  def _dispatch(self, plan: StepPlan) -> list:
    handles = []
    for chunk in plan.prefills:
      out = self.runner.prefill(build_prefill_input(chunk, self.runner), sample=chunk.sample)
      if chunk.sample:
        handles.append(out)
    if plan.decodes:
      handles.append(self.runner.decode(build_decode_input(plan.decodes, self.runner)))
    return handles

  def _postprocess(self, plan: StepPlan, handles: list) -> None:
    outs = jax.device_get(handles)
    sampled = [c for c in plan.prefills if c.sample]
    prefill_outs = outs[:len(sampled)]
    decode_out = outs[-1] if plan.decodes else None
    prefill_tokens = [int(o.tokens[0]) for o in prefill_outs]
    decode_tokens = [int(t) for t in decode_out.tokens[:len(plan.decodes)]] if plan.decodes else []
    appended = self.scheduler.postprocess(plan, prefill_tokens, decode_tokens)
    rows = {id(c.seq): (o, 0) for c, o in zip(sampled, prefill_outs, strict=True)}
    rows.update({id(seq): (decode_out, i) for i, seq in enumerate(plan.decodes)})
    for seq, token in appended:
      out, row = rows[id(seq)]
      try:
        if self.outputs.on_token(seq, token, out, row):
          self.scheduler.finish(seq, "stop")
      except Exception as e:  # e.g. an undecodable token: fail this request only
        log.exception("output processing failed for request %s", seq.request_id)
        self._finish(seq, "error", error=f"output processing failed: {e}")
        continue
      if seq.finish_reason is not None:
        self._finish(seq, seq.finish_reason)
      else:
        self.outputs.emit(seq)

  def _finish(self, seq: Sequence, reason, error: str | None = None) -> None:
    self.scheduler.finish(seq, reason)
    self.outputs.emit(seq, reason, error=error)
    self._seqs.pop(seq.request_id, None)

  def run_until_idle(self) -> None:
    """Steps until every request has finished (the caller's thread)."""
    while self.has_unfinished():
      self.step()

  def start(self) -> None:
    if self._thread is None:
      self._thread = threading.Thread(target=self._loop, name="xlaserve-engine", daemon=True)
      self._thread.start()

  def _loop(self) -> None:
    while not self._stop.is_set():
      if self.has_unfinished():
        try:
          self.step()
        except Exception:  # a broken step must not leave requests hanging
          log.exception("engine step failed; failing in-flight requests")
          self._fail_all("engine error")
      else:
        self._wake.wait(0.05)
        self._wake.clear()

  def _fail_all(self, message: str) -> None:
    self._inflight = None
    for seq in list(self._seqs.values()):
      self._finish(seq, "error", error=message)

  def shutdown(self) -> None:
    self._stop.set()
    self._wake.set()
    if self._thread is not None:
      self._thread.join(timeout=10)
      self._thread = None

  def stats(self) -> EngineStats:
    s, a = self.scheduler, self.allocator
    return EngineStats(
        num_running=len(s.running), num_waiting=len(s.waiting), kv_cache_usage=a.usage,
        num_pages_total=a.num_usable, num_pages_free=a.num_free,
        num_preemptions_total=s.num_preemptions, prompt_tokens_total=self.prompt_tokens_total,
        generation_tokens_total=self.outputs.generation_tokens_total,
        prefix_cache_queries_total=a.stats.queries, prefix_cache_hits_total=a.stats.hits,
        prefill_tokens_computed_total=s.prefill_tokens_computed)

  def _log_capacity(self) -> None:
    from serving.kv_cache import kv_bytes_per_token
    c, a = self.config, self.allocator
    per_tok = kv_bytes_per_token(self.model_config, self.runner.kv_dtype_name)
    tokens = a.num_usable * c.page_size
    msg = (f"KV cache: {a.num_usable} pages x {c.page_size} tokens = {tokens} tokens "
           f"({tokens * per_tok / 2**30:.2f} GiB, {per_tok} B/token, {self.runner.kv_dtype_name}); "
           f"max concurrency at max_model_len={c.max_model_len}: "
           f"{tokens / c.max_model_len:.1f} requests")
    log.info(msg)
    print(msg, file=sys.stderr, flush=True)
    from serving.quant import params_nbytes
    weights = params_nbytes(self.runner.params)
    fmt = self.config.quantization or self.runner.weight_dtype_name
    msg = (f"Weights: {weights / 2**20:.1f} MiB ({fmt}, compute {self.runner.dtype_name}); "
           f"KV cache {per_tok} B/token "
           f"({self.runner.kv_dtype_name})")
    log.info(msg)
    print(msg, file=sys.stderr, flush=True)


def _enable_compilation_cache(config: EngineConfig) -> None:
  """JAX's persistent cache for sharded runners; one device uses the executable store
  (serving/executable_store.py), which must not see executables from JAX's cache."""
  import sharding

  if sharding.ParallelConfig.of(config).num_devices <= 1:
    return
  if config.compilation_cache and not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", config.compilation_cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
