"""`ModelRunner`: weights and device state on the device(s), and the jitted steps.

It implements the engine's `Runner` interface (serving/engine/runner_api.py).
Lifecycle:
  1. `ModelRunner(prepare_weights(params, model_cfg, engine_cfg))` (or
     `ModelRunner.from_params(...)`) takes weights made ready on the host
     (weights.py: quantized, unstacked, adapted to a mesh when tp*ep*dp*pp > 1),
     puts them on the device(s) (sharding/placement.py on a mesh), sizes and
     allocates the KV page pool and the per-slot sampler state.
  2. `warm_up()` compiles every (bucket) program once — prefill per token
     bucket, decode and sampling per batch bucket — and logs how many; the
     executable store (executable_store.py) makes restarts cheap: it loads
     compiled steps without tracing them.
  3. `execute(plan=...)` builds the plan's fixed-shape inputs (inputs.py) and
     dispatches them (`run`): asynchronous, it returns device arrays at once;
     `fetch(handle=...)` waits for them and returns a typed `StepResult`.

The runner never makes policy: the scheduler decides what runs. Device
state (`steps.DeviceState`: KV pages, each decode slot's last sampled token,
penalty counters) is donated into every step, so it is updated in place.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import psutil

import sharding
from serving.config import EngineConfig
from serving.models.model_config import ModelConfig
from serving.models.quantized import params_nbytes, weight_formats
from serving.runner import attention, lora_state, sampling
from serving.runner.draft_model import DraftModel
from serving.runner.executable_store import ExecutableStore, StepProgram
from serving.runner.inputs import StepInputs, build_prefill_input, build_step_inputs
from serving.runner.kv_cache import (
  KVLayout,
  create_kv_cache,
  kv_bytes_per_token,
  kv_layout,
  layout_note,
  read_pages,
  window_group_pages,
  write_pages,
)
from serving.runner.state_cache import check_engine, create_state_slots
from serving.runner.steps import (
  DecodeInput,
  DeviceState,
  PrefillInput,
  VerifyInput,
  decode_step,
  multi_decode_step,
  prefill_step,
  sample_step,
  verify_sample_step,
  verify_step,
)
from serving.runner.weights import PreparedWeights, prepare_weights, resolve_dtypes
from serving.types import (
  RunnerDeadError,
  SampledToken,
  StepError,
  StepPlan,
  StepResult,
  TokenLogprob,
  WindowGroup,
)

log = logging.getLogger(__name__)


def capacity_pages(model_cfg: ModelConfig, config: EngineConfig,
                   draft_cfg: ModelConfig | None = None) -> int:
  """KV pages (of the full-attention group) from the memory budget, capped at what
  max_num_seqs can use (a draft model's pool has as many pages, so its bytes count
  too; so do a hybrid model's sliding-window pages, kv_cache.window_group_pages)."""
  _, kv_dtype = resolve_dtypes(config, jax.default_backend())
  group_bytes = _group_page_bytes(model_cfg, config, kv_dtype)
  if draft_cfg is not None:
    group_bytes[0] += config.cache.page_size * kv_bytes_per_token(draft_cfg, kv_dtype)
  budget = _kv_budget(config)
  # Linear-attention state slots (state_cache.py) come out of the same budget.
  budget -= (config.scheduler.max_num_seqs + 1) * model_cfg.state_bytes_per_sequence()
  cap = config.scheduler.max_num_seqs * config.max_pages_per_seq + 1
  pages = min(_pages_within(budget, group_bytes, model_cfg, config), cap)
  if pages < config.max_pages_per_seq + 1:
    raise ValueError(f"KV budget of {budget / 2**30:.2f} GiB holds {pages} pages; one request at "
                     f"max_model_len={config.scheduler.max_model_len} needs "
                     f"{config.max_pages_per_seq + 1}. "
                     "Raise kv_cache_memory_fraction or lower max_model_len.")
  return pages


def _group_page_bytes(cfg: ModelConfig, config: EngineConfig, kv_dtype: str) -> list[int]:
  """Bytes of one page in every layer of each group: [full] or [full, sliding window]."""
  per_layer = config.cache.page_size * kv_bytes_per_token(cfg, kv_dtype) // cfg.num_layers
  layout = kv_layout(cfg, config, 2)
  if layout is None:
    return [per_layer * cfg.num_layers]
  sliding = sum(layout.sliding)
  return [per_layer * (cfg.num_layers - sliding), per_layer * sliding]


def _pages_within(budget: float, group_bytes: list[int], cfg: ModelConfig,
                  config: EngineConfig) -> int:
  """The most full-group pages whose pool (with the window group it implies) fits."""
  if len(group_bytes) == 1:
    return int(budget // group_bytes[0])
  full, sliding = group_bytes
  most = window_group_pages(cfg.sliding_window, config, 2 ** 40)  # the group's size cap
  pages = int((budget - most * sliding) // full)
  if pages >= most:
    return pages
  return int(budget // (full + sliding))  # fewer full pages than that: both groups alike


def _kv_budget(config: EngineConfig) -> float:
  """Bytes the KV pools may take: the memory fraction of what the device has free."""
  device = jax.local_devices()[0]
  stats = device.memory_stats() if device.platform != "cpu" else None
  if stats and "bytes_limit" in stats:
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return free * config.cache.kv_cache_memory_fraction
  return psutil.virtual_memory().available * config.cache.kv_cache_memory_fraction


@dataclasses.dataclass
class SamplerCall:
  """One sampler call of a step: the request id of each row (padding rows follow,
  unnamed) and its output — None until it runs. A call whose rows include a
  constrained request waits for its token masks (`ModelRunner.sample`) and keeps
  its logits and inputs until then."""

  ids: list[str]
  out: sampling.SampleOutput | sampling.VerifyOutput | None = None
  logits: jax.Array | None = None
  slots: np.ndarray | None = None
  tensors: sampling.SamplingTensors | None = None
  # A speculative step's verify call: its drafts [B, S-1] and their counts [B].
  drafts: jax.Array | np.ndarray | None = None
  num_drafts: np.ndarray | None = None

  @property
  def mask_shape(self) -> tuple[int, ...]:
    """[B] (or [B, S] for a verify call) rows of token masks, less the mask width."""
    return tuple(self.logits.shape[:-1])


@dataclasses.dataclass
class StepHandle:
  """An executed step: its sampler calls (prefill chunks', then the decode batch's)."""

  calls: list[SamplerCall]
  logprobs: dict[str, int]  # request id -> top alternatives wanted (absent: no logprobs)
  num_drafts: dict[str, int] = dataclasses.field(default_factory=dict)  # speculative rows
  # The step's last output (ready when the whole step has run): what `fetch` waits for
  # when nothing is sampled (prefill chunks that end no prompt).
  done: jax.Array | None = None

  @property
  def awaiting_masks(self) -> bool:
    return any(c.out is None for c in self.calls)


class ModelRunner:
  """Holds weights and device state; runs bucketed, jitted steps (see module doc)."""

  def __init__(self, weights: PreparedWeights, *, num_pages: int | None = None,
               kv_transfer: bool = False):
    """`weights`: from `prepare_weights` (weights.py), with the engine config and, for
    speculative_method="draft", the draft model. `kv_transfer`: warm up `export_pages`
    / `import_pages` too (a disaggregated prefill or decode worker,
    serving/engine/disaggregated.py)."""
    ec, cfg, placement = weights.engine_cfg, weights.model_cfg, weights.placement
    check_engine(cfg, ec)  # before anything is placed
    self.state_slots = cfg.has_state_slots  # linear-attention states per decode slot
    # The tiered prefix cache moves pages as transfers do (serving/engine/kv_offload.py).
    self.kv_offload = ec.cache.kv_offload_host_gb > 0
    self.kv_transfer = kv_transfer or self.kv_offload
    self.mesh = weights.mesh  # sharded when tp*ep*dp*pp > 1 or a mesh was given
    self.source_cfg = weights.source_cfg  # before tp repeats KV heads: what adapters must fit
    self.model_cfg, self.engine_cfg = cfg, ec
    self.vocab_size = cfg.vocab_size
    self.dtype_name, self.kv_dtype_name = weights.dtype, weights.kv_dtype
    self.weight_dtype_name = weights.weight_dtype
    self.backend = attention.resolve_backend(ec.model.attention_backend, jax.default_backend())
    self.params = weights.place()  # before the KV pool is sized from the memory left
    draft_cfg = weights.draft.config if weights.draft is not None else None
    self.num_pages = num_pages or ec.cache.num_pages or capacity_pages(cfg, ec, draft_cfg)
    # A hybrid model's sliding-window layers: their own, smaller page group (kv_cache.py).
    self.kv_layout: KVLayout | None = kv_layout(cfg, ec, self.num_pages)
    if (note := layout_note(cfg, ec)) is not None:
      log.info(note)
    if self.kv_offload and self.kv_layout is not None:
      raise ValueError("the tiered prefix cache (kv_offload_host_gb) does not move a hybrid "
                       "model's sliding-window pages yet: serve it without kv_offload_host_gb")
    if kv_transfer and self.kv_layout is not None:
      raise ValueError("KV page transfer (prefill / decode workers) does not move a hybrid "
                       "model's sliding-window pages yet")
    self.window_group = None if self.kv_layout is None else WindowGroup(
        self.kv_layout.window, self.kv_layout.window_pages)
    self.state = self._initial_state(placement)
    self.mask_width = (cfg.vocab_size + 31) // 32  # int32 words of a token mask row
    self._all_allowed: dict[int, jax.Array] = {}
    self._kv_replicas = placement.kv_replicas if placement is not None else 1
    self.lora_dtype = jnp.dtype(weights.weight_dtype)  # adapters: stored like the weights
    self.lora, self._write_lora = self._lora_slots(placement)
    # Warm starts load the compiled steps from disk instead of tracing them.
    compilation = ec.compilation
    self._store = ExecutableStore.for_runner(compilation.compilation_cache,
                                             compilation.compilation_cache_dir,
                                             placement is not None)
    self._build_programs(placement)
    self._read_pages = self._write_pages = None  # jitted on first use (export_pages)
    self.draft = self._draft_model(weights)
    self._log_capacity()

  @classmethod
  def from_params(cls, params, model_cfg: ModelConfig, engine_cfg: EngineConfig, *,
                  num_pages: int | None = None, mesh: jax.sharding.Mesh | None = None,
                  draft: tuple[dict, ModelConfig] | None = None,
                  kv_transfer: bool = False) -> ModelRunner:
    """A runner over params as loaded: `prepare_weights` (weights.py), then the runner.
    `draft`: the draft model's (params, config) for speculative_method="draft"."""
    weights = prepare_weights(params, model_cfg, engine_cfg, mesh=mesh, draft=draft)
    return cls(weights, num_pages=num_pages, kv_transfer=kv_transfer)

  def _build_programs(self, placement: sharding.Placement | None) -> None:
    """The jitted steps as `StepProgram`s; their `static` strings key the executable store."""
    kw = dict(cfg=self.model_cfg, backend=self.backend, act_dtype=jnp.dtype(self.dtype_name),
              block_tokens=self.engine_cfg.cache.attention_block_tokens)
    jit = jax.jit if placement is None else functools.partial(placement.jit, state=self.state)
    # On a mesh the samplers run over a flat mesh of the same devices (their inputs are all
    # replicated), so every layout over those devices shares them through the compilation
    # cache; their slot state is put back on this mesh's shardings (no copy).
    slot_jit = jax.jit if placement is None else placement.replicated_jit
    self._slot_shardings = None if placement is None else jax.tree.map(
        lambda a: a.sharding, self.state.slot_state())
    static = repr(sorted(kw.items()))

    def forward(name: str, step) -> StepProgram:
      """Arguments: params, LoRA slots, state (donated), the step's input."""
      return StepProgram(name, jit(functools.partial(step, **kw), donate_argnums=(2,)),
                         static=static, num_fixed=3, store=self._store)

    def sampler(name: str, step) -> StepProgram:
      """Arguments: the state's `slot_state()` (donated), logits, the rest of the sampler's
      input (`_run_sampler`)."""
      return StepProgram(name, slot_jit(step, donate_argnums=(0,)), static="", num_fixed=1,
                         store=self._store)

    self._prefill = forward("prefill", prefill_step)
    self._decode = forward("decode", decode_step)
    self._sample = sampler("sample", sample_step)
    # Multi-step decoding: k decode + sample iterations per call, per multi-step bucket.
    self._multi_decode = forward("multi_decode", multi_decode_step)
    # Speculative decoding: the verify forward per batch bucket, and its sampler.
    self._verify = forward("verify", verify_step)
    self._verify_sample = sampler("verify_sample", verify_sample_step)

  def _draft_model(self, weights: PreparedWeights) -> DraftModel | None:
    """Speculative decoding's draft model on the device (its pool: the target's page
    count), or None without one."""
    if weights.draft is None:
      return None
    ec = self.engine_cfg
    return DraftModel(weights.place_draft(), weights.draft.config, num_pages=self.num_pages,
                      page_size=ec.cache.page_size, kv_dtype=self.kv_dtype_name,
                      act_dtype=jnp.dtype(self.dtype_name), backend=self.backend,
                      block_tokens=ec.cache.attention_block_tokens, store=self._store)

  def _initial_state(self, placement) -> DeviceState:
    ec, cfg = self.engine_cfg, self.model_cfg
    slots = ec.scheduler.max_num_seqs + 1  # + the dummy slot padding rows write to
    kv_sharding = placement.kv_sharding if placement is not None else None
    state = DeviceState(
        kv=create_kv_cache(cfg, self.num_pages, ec.cache.page_size, self.kv_dtype_name,
                           kv_sharding, self.kv_layout),
        last_tokens=jnp.zeros((slots,), jnp.int32),
        prompt_mask=jnp.zeros((slots, cfg.vocab_size), jnp.bool_),
        output_counts=jnp.zeros((slots, cfg.vocab_size), jnp.int32),
        states=create_state_slots(cfg, slots))
    if placement is None:
      return state
    rest = placement.replicate(dataclasses.replace(state, kv=None))
    return dataclasses.replace(rest, kv=state.kv)

  def _lora_slots(self, placement):
    """The LoRA slots (zero) and their jitted slot write; (None, None) when LoRA is off."""
    ec = self.engine_cfg
    if not ec.lora.max_loras:
      return None, None
    unrolled = isinstance(self.params["layers"], (list, tuple))
    zeros = lora_state.lora_zeros(self.model_cfg, ec.lora.max_loras, ec.lora.max_lora_rank,
                                  unrolled, self.lora_dtype)
    if placement is None:
      return jax.tree.map(jnp.asarray, zeros), jax.jit(lora_state.write_slot, donate_argnums=0)
    shardings = jax.tree.map(
        lambda spec: jax.sharding.NamedSharding(self.mesh, spec),
        sharding.rules.lora_specs(zeros, self.model_cfg, self.mesh),
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    lora = jax.tree.map(sharding.placement.place, zeros, shardings)
    write = jax.jit(sharding.placement.in_mesh(lora_state.write_slot, self.mesh),
                    donate_argnums=0, out_shardings=shardings)
    return lora, write

  def load_lora(self, slot: int, weights) -> None:
    """Writes an adapter (checkpoints.lora.LoraWeights; None: zeros) into LoRA slot `slot`."""
    ec = self.engine_cfg
    if self.lora is None or not 0 <= slot < ec.lora.max_loras:
      raise ValueError(f"no LoRA slot {slot} (max_loras={ec.lora.max_loras})")
    contents = lora_state.slot_contents(
        weights, self.source_cfg, ec.lora.max_lora_rank, isinstance(self.lora, list),
        self.lora_dtype, self._kv_replicas)
    self.lora = self._write_lora(self.lora, jnp.int32(slot), contents)

  # ---- the Runner interface ----

  def execute(self, *, plan: StepPlan) -> StepHandle:
    """Builds every input of the plan first, then dispatches them (asynchronous)."""
    return self.run(build_step_inputs(plan, self.engine_cfg, window=self.window_group is not None))

  def sample(self, *, handle: StepHandle, masks: dict[str, np.ndarray]) -> None:
    """Runs the sampler calls that wait for token masks (a step with constrained rows).

    `masks`: request id -> [ceil(V / 32)] int32 packed mask of the tokens it may
    sample; rows without one are unconstrained.
    """
    for call in handle.calls:
      if call.out is None:
        self.sample_call(call, self.mask_rows(call, masks))

  def mask_rows(self, call: SamplerCall, masks: dict[str, np.ndarray]) -> np.ndarray:
    """The [B, ceil(V / 32)] mask input of a waiting sampler call ([B, S, ceil(V / 32)]
    for a verify call: one mask per position); all ones by default."""
    allowed = np.full((*call.mask_shape, self.mask_width), -1, np.int32)
    for i, rid in enumerate(call.ids):
      if rid in masks:
        allowed[i] = masks[rid]
    return allowed

  def sample_call(self, call: SamplerCall, allowed: np.ndarray) -> None:
    """Runs one waiting sampler call with its mask input."""
    with self._device_errors():
      if call.drafts is not None:
        call.out = self._run_sampler(self._verify_sample, call.logits, call.drafts,
                                     call.num_drafts, call.slots, call.tensors, allowed)
      else:
        call.out = self._run_sampler(self._sample, call.logits, call.slots, call.tensors,
                                     allowed)
    call.logits = call.slots = call.tensors = call.drafts = call.num_drafts = None

  def fetch(self, *, handle: StepHandle) -> StepResult:
    """Waits for the step's samples and reads them per request. A step that samples
    nothing (prefill chunks ending no prompt) is waited for all the same: the engine
    dispatches the next step before fetching this one, so it keeps at most two steps
    on the device, and a long prompt's chunks do not queue up ahead of the decode
    steps of other requests (nor count, all together, as one step's time)."""
    if handle.awaiting_masks:
      raise RuntimeError("fetch of a step whose constrained rows were never sampled")
    with self._device_errors():
      if handle.done is not None:
        jax.block_until_ready(handle.done)
      outs = jax.device_get([c.out for c in handle.calls])
    tokens: dict[str, list[SampledToken]] = {}
    for call, out in zip(handle.calls, outs, strict=True):
      for row, rid in enumerate(call.ids):
        n = handle.logprobs.get(rid)
        if isinstance(out, sampling.VerifyOutput):  # the kept drafts, then one more
          tokens[rid] = [_sampled(out.tokens[row, j], out.logprob[row, j], out.top_ids[row, j],
                                  out.top_logprobs[row, j], n)
                         for j in range(int(out.num_accepted[row]) + 1)]
        elif out.tokens.ndim == 2:  # a multi-step call: the row's k tokens
          tokens[rid] = [_sampled(out.tokens[row, j], out.logprob[row, j], out.top_ids[row, j],
                                  out.top_logprobs[row, j], n)
                         for j in range(out.tokens.shape[1])]
        else:
          tokens[rid] = [_sampled(out.tokens[row], out.logprob[row], out.top_ids[row],
                                  out.top_logprobs[row], n)]
    return StepResult(tokens=tokens, num_drafts=handle.num_drafts)

  def close(self) -> None:
    """Nothing to release: device memory goes with the runner."""

  # ---- KV pages between engines (disaggregated prefill / decode) ----

  def export_pages(self, pages: list[int]) -> tuple[jax.Array, jax.Array]:
    """The K and V of `pages` (at most `kv_transfer_pages`) in every layer, as stored:
    two [L, kv_transfer_pages, page_size, K, H'] arrays on this runner's device(s),
    slot i holding pages[i] (the slots past them: the dummy page). Computed before
    this returns, so a lost device fails here, not in the importer."""
    padded = self._chunk(pages)
    with self._device_errors():
      return jax.block_until_ready(self._read_pages(self.state.kv, padded))

  def gather_pages(self, pages: list[int]) -> tuple[jax.Array, jax.Array]:
    """`export_pages` without waiting: the gather is dispatched (before any later step
    that donates the pool, so it reads the pages as they are now) and its copy to the
    host started; `np.asarray` on the result waits for it (the tiered prefix cache)."""
    padded = self._chunk(pages)
    with self._device_errors():
      k, v = self._read_pages(self.state.kv, padded)
    for a in (k, v):
      a.copy_to_host_async()
    return k, v

  def kv_page_specs(self) -> list[tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of one page's stored K and V (every layer): a slot of
    `export_pages`' output."""
    kv = self.state.kv
    layers = kv.k.shape[0] // kv.num_pages
    return [((layers, *a.shape[1:]), np.dtype(a.dtype)) for a in (kv.k, kv.v)]

  def kv_page_spec(self) -> tuple[tuple[int, ...], str, str]:
    """What one page of `export_pages` output is, for a transfer's handshake: its shape
    [L, page_size, K, H'], its stored dtype, and the model it belongs to."""
    cfg, kv = self.model_cfg, self.state.kv
    model = (f"layers={cfg.num_layers} hidden={cfg.hidden_size} kv={cfg.num_kv_heads}x"
             f"{cfg.head_dim} vocab={cfg.vocab_size} kv_cache={self.kv_dtype_name}")
    return (kv.k.shape[0] // kv.num_pages, *kv.k.shape[1:]), str(kv.k.dtype), model

  def import_pages(self, pages: list[int], k: jax.Array | np.ndarray,
                   v: jax.Array | np.ndarray) -> None:
    """Writes slot i of `export_pages` output (another runner's, same model and layout)
    into page pages[i]; a 0 skips the slot (it goes to the dummy page). Device arrays
    move straight to this runner's device(s) (`jax.device_put`: device to device
    where the backend can, e.g. between GPUs: `_to_pool_device`); host arrays may
    hold just len(pages) slots (zero-padded here to the chunk) or the whole chunk.
    Fixed shapes: nothing compiles after warm-up."""
    padded = self._chunk(pages)
    kv = self.state.kv
    allowed = {len(padded)} if isinstance(k, jax.Array) else {len(pages), len(padded)}
    slots = k.shape[1] if k.ndim > 1 and k.shape[1] in allowed else len(padded)
    expect = (kv.k.shape[0] // kv.num_pages, slots, *kv.k.shape[1:])
    if k.shape != expect or v.shape != expect:
      raise ValueError(f"KV pages of shape {k.shape} / {v.shape} do not fit this cache "
                       f"(expected {expect}): a different model or layout")
    if slots < len(padded):
      k, v = (_pad_slots(a, len(padded)) for a in (k, v))
    with self._device_errors():
      k, v = (self._to_pool_device(a) for a in (k, v))
      kv = self._write_pages(kv, padded, k, v)
    self.state = dataclasses.replace(self.state, kv=kv)

  def _to_pool_device(self, a: jax.Array | np.ndarray) -> jax.Array | np.ndarray:
    """Transfer data where the pool's write wants it. On a mesh: replicated over it
    (`device_put`, device to device). On one device: as it is when it already lives
    there (or on the host); from another device through the host, since a committed
    array would make the next steps see a differently placed pool and recompile."""
    if self.mesh is not None:
      return jax.device_put(a, jax.sharding.NamedSharding(self.mesh, jax.P()))
    if isinstance(a, jax.Array) and a.devices() != self.state.kv.k.devices():
      return np.asarray(a)
    return a

  def _chunk(self, pages: list[int]) -> np.ndarray:
    """The page ids of one transfer chunk, padded with the dummy page to its fixed size."""
    chunk = self.engine_cfg.parallel.kv_transfer_pages
    if not 0 < len(pages) <= chunk or not all(0 <= p < self.num_pages for p in pages):
      raise ValueError(f"a KV transfer moves 1..{chunk} pages in [0, {self.num_pages}), "
                       f"not {pages}")
    if self._read_pages is None:
      # On a mesh the pool keeps its shardings (as every step's output does);
      # on one device the output follows the input, as the steps' outputs do.
      pinned = None if self.mesh is None else jax.tree.map(lambda a: a.sharding, self.state.kv)
      self._read_pages = jax.jit(read_pages)
      self._write_pages = jax.jit(write_pages, donate_argnums=0, out_shardings=pinned)
    padded = np.zeros(chunk, np.int32)
    padded[:len(pages)] = pages
    return padded

  @contextlib.contextmanager
  def _device_errors(self):
    """A device call that failed after the state was donated to it leaves no state to
    run on: that is `RunnerDeadError`; other failures propagate as they are."""
    try:
      yield
    except Exception as e:
      if any(a.is_deleted() for a in self._donated()):
        raise RunnerDeadError(f"device state lost in a failed step: {e}") from e
      raise

  def _donated(self) -> list:
    """The arrays steps donate: lost if a step fails after taking them."""
    extra = self.draft.arrays() if self.draft is not None else []
    return jax.tree.leaves((self.state, self.lora)) + extra

  def run(self, inputs: StepInputs) -> StepHandle:
    """Dispatches a step's prefill chunks, then its decode batch (asynchronous)."""
    with self._device_errors():
      return self._run(inputs)

  def _run(self, inputs: StepInputs) -> StepHandle:
    for slot, adapter in inputs.lora_loads:
      try:
        self.load_lora(slot, adapter.weights)
      except Exception as e:
        if any(a.is_deleted() for a in jax.tree.leaves(self.lora)):
          raise
        raise StepError(f"could not load LoRA adapter {adapter.name!r}: {e}",
                        inputs.lora_users.get(slot, [])) from e
    # A step with constrained rows samples after `sample()` brings their masks.
    defer = bool(inputs.constrained)
    calls, logprobs, logits = [], {}, None
    for inp, ids in zip(inputs.prefills, inputs.prefill_ids, strict=True):
      logits = self.run_prefill(inp)
      if ids:
        calls.append(self._sampler_call(list(ids), logits, inp.sample_slots, inp.sampling,
                                        defer))
        logprobs.update({rid: int(inp.sampling.num_logprobs[i]) for i, rid in enumerate(ids)})
    num_drafts = {}
    if inputs.verify is not None:
      inp = inputs.verify
      calls.append(self.run_verify(inp, inputs.drafts, list(inputs.decode_ids), defer))
      wanted = inp.sampling.num_logprobs
      logprobs.update({rid: int(wanted[i]) for i, rid in enumerate(inputs.decode_ids)})
      num_drafts = {rid: int(inp.num_drafts[i]) for i, rid in enumerate(inputs.decode_ids)}
    if inputs.decode_later is not None:
      if defer:
        raise ValueError("a multi-step decode cannot wait for token masks")
      calls.append(SamplerCall(list(inputs.decode_ids),
                               out=self.run_multi_decode(inputs.decode, inputs.decode_later,
                                                         inputs.decode_later_window)))
      wanted = inputs.decode.sampling.num_logprobs
      logprobs.update({rid: int(wanted[i]) for i, rid in enumerate(inputs.decode_ids)})
    elif inputs.decode is not None:
      logits = self.run_decode(inputs.decode)
      calls.append(self._sampler_call(list(inputs.decode_ids), logits,
                                      inputs.decode.decode_slots, inputs.decode.sampling, defer))
      wanted = inputs.decode.sampling.num_logprobs
      logprobs.update({rid: int(wanted[i]) for i, rid in enumerate(inputs.decode_ids)})
    return StepHandle(calls=calls, logprobs={k: n for k, n in logprobs.items() if n >= 0},
                      num_drafts=num_drafts, done=logits if not calls else None)

  def _sampler_call(self, ids: list[str], logits: jax.Array, slots: np.ndarray,
                    tensors: sampling.SamplingTensors, defer: bool) -> SamplerCall:
    if defer:
      return SamplerCall(ids, logits=logits, slots=slots, tensors=tensors)
    out = self._run_sampler(self._sample, logits, slots, tensors,
                            self._unconstrained(slots.shape[0]))
    return SamplerCall(ids, out=out)

  def _run_sampler(self, program: StepProgram,
                   *args) -> sampling.SampleOutput | sampling.VerifyOutput:
    """Runs a sampler program on the state's slot part (donated) and `args`; returns its
    output."""
    slots, out = program(self.state.slot_state(), *args)
    if self._slot_shardings is not None:  # back from the sampler's flat mesh
      slots = jax.device_put(slots, self._slot_shardings)
    self.state = self.state.with_slot_state(slots)
    return out

  def _unconstrained(self, *rows: int) -> jax.Array:
    """All-ones token masks for B rows (or [B, S] positions), kept on the device (one per
    shape)."""
    mask = self._all_allowed.get(rows)
    if mask is None:
      ones = np.full((*rows, self.mask_width), -1, np.int32)
      # On one device it stays there (device_put: jnp.asarray would compile a staging
      # program per shape); a mesh's programs take it from the host.
      mask = self._all_allowed[rows] = ones if self.mesh is not None else jax.device_put(ones)
    return mask

  def run_prefill(self, inp: PrefillInput) -> jax.Array:
    """Runs a prefill call (and the draft model's); returns the sampler rows' logits [C, V]."""
    self.state, logits = self._prefill(self.params, self.lora, self.state, inp)
    if self.draft is not None:
      self.draft.prefill(inp)
    return logits

  def run_verify(self, inp: VerifyInput, drafts: np.ndarray, ids: list[str],
                 defer: bool = False) -> SamplerCall:
    """Runs a speculative step: drafts (the host's, or the draft model's), the verify
    forward and, unless it waits for token masks (`defer`), its sampler, which keeps
    drafts and draws the next token per row."""
    if self.draft is not None:
      drafts = self.draft.propose(inp, self.state.last_tokens)
    self.state, logits = self._verify(self.params, self.lora, self.state, inp, drafts)
    call = SamplerCall(ids, logits=logits, slots=inp.decode_slots, tensors=inp.sampling,
                       drafts=drafts, num_drafts=inp.num_drafts)
    if not defer:
      self.sample_call(call, self._unconstrained(*call.mask_shape))
    return call

  def run_decode(self, inp: DecodeInput) -> jax.Array:
    """Runs a decode batch; returns its logits [B, V]."""
    self.state, logits = self._decode(self.params, self.lora, self.state, inp)
    return logits

  def run_multi_decode(self, inp: DecodeInput, later: np.ndarray,
                       later_window: np.ndarray | None = None) -> sampling.SampleOutput:
    """Runs a multi-step decode batch (steps.multi_decode_step): its [B, k] samples."""
    self.state, out = self._multi_decode(self.params, self.lora, self.state, inp, later,
                                         self._unconstrained(later.shape[0]), later_window)
    return out

  # ---- compilation ----

  def warm_up(self) -> int:
    """Compiles (or loads) every bucket's program; returns the count.

    Programs: one prefill per token bucket (a step's chunks in one call), one
    decode and one sampler per batch bucket (prefill calls share the samplers).
    With an executable store they are loaded in parallel threads and compiled
    only when missing, without running anything; without one, each is run once
    on dummy inputs. When the store holds them all (a warm start), the first
    bucket of each step is loaded before this returns and the others in
    background threads: a step that needs one still loading waits for it, and
    nothing compiles.
    """
    start = time.perf_counter()
    if self.lora is not None:  # compiles the slot write; slot 0 stays zero
      self.load_lora(0, None)
    programs = self._bucket_programs()
    sched = self.engine_cfg.scheduler
    for b in sorted({1, *sched.decode_batch_buckets, *sched.multi_step_batch_buckets}):
      self._unconstrained(b)  # the all-ones mask inputs
    for b in self.engine_cfg.verify_batch_buckets:
      self._unconstrained(b, self.engine_cfg.speculative.num_speculative_tokens + 1)
    background = 0
    if self._store is not None and all(step.is_stored(*args) for step, args in programs):
      # Warm start: the first program of each step now, the rest in the background.
      first = {id(step): i for i, (step, _) in reversed(list(enumerate(programs)))}
      now = [p for i, p in enumerate(programs) if first[id(p[0])] == i]
      later = [p for i, p in enumerate(programs) if first[id(p[0])] != i]
      with concurrent.futures.ThreadPoolExecutor(_load_threads()) as pool:
        list(pool.map(lambda p: p[0].prepare(*p[1]), now))
      loader = concurrent.futures.ThreadPoolExecutor(_load_threads(), "load-executables")
      for step, args in later:
        step.load_in_background(loader, *args)
      loader.shutdown(wait=False)  # runs what was submitted, then its threads exit
      background = len(later)
    elif self._store is not None:
      with concurrent.futures.ThreadPoolExecutor(_load_threads()) as pool:
        list(pool.map(lambda p: p[0].try_load(*p[1]), programs))
      for step, args in programs:
        step.prepare(*args)
    else:
      for step, args in programs:
        if step in (self._prefill, self._decode, self._verify, self._multi_decode):
          jax.block_until_ready(self._run_dummy(step, args))  # + samplers and drafts
    steps = (self._prefill, self._decode, self._sample, self._multi_decode)
    spec = (self._verify, self._verify_sample) + (self.draft.steps if self.draft else ())
    n = len(programs) if self._store is not None else sum(
        s.num_programs() for s in steps + spec)
    if self.kv_transfer:  # the page export / import programs, on the dummy page
      self.import_pages([0], *self.export_pages([0]))
      n += 2
    log.info("%d programs (%d compiled, %d loaded from the executable store, %d loading in "
             "the background) in %.1fs", n, sum(s.compiled for s in steps + spec),
             sum(s.loaded for s in steps + spec), background, time.perf_counter() - start)
    return n

  def _bucket_programs(self) -> list[tuple[StepProgram, tuple]]:
    """(step, arguments) of every program serving can run; logits as abstract values."""
    ec, vocab = self.engine_cfg, self.model_cfg.vocab_size
    out = []
    for t in ec.scheduler.prefill_token_buckets:
      out.append((self._prefill, (self.params, self.lora, self.state, self.dummy_prefill(t))))
    for b in ec.scheduler.decode_batch_buckets:
      out.append((self._decode, (self.params, self.lora, self.state, self.dummy_decode(b))))
    for b in ec.scheduler.multi_step_batch_buckets:
      inp = self.dummy_decode(b)
      later = np.zeros((b, ec.scheduler.num_decode_steps - 1), np.int32)
      allowed = jax.ShapeDtypeStruct((b, self.mask_width), jnp.int32)
      later_window = later if self.window_group is not None else None
      out.append((self._multi_decode, (self.params, self.lora, self.state, inp, later,
                                       allowed, later_window)))
    for b in sorted({1, *ec.scheduler.decode_batch_buckets}):
      inp = self.dummy_decode(b)
      logits = jax.ShapeDtypeStruct((b, vocab), jnp.float32)
      allowed = jax.ShapeDtypeStruct((b, self.mask_width), jnp.int32)
      out.append((self._sample, (self.state.slot_state(), logits, inp.decode_slots, inp.sampling,
                                 allowed)))
    s = ec.speculative.num_speculative_tokens + 1
    verifies = [self.dummy_verify(b) for b in ec.verify_batch_buckets]
    for inp in verifies:
      b = inp.decode_slots.shape[0]
      drafts = np.zeros((b, s - 1), np.int32)
      out.append((self._verify, (self.params, self.lora, self.state, inp, drafts)))
      logits = jax.ShapeDtypeStruct((b, s, vocab), jnp.float32)
      allowed = jax.ShapeDtypeStruct((b, s, self.mask_width), jnp.int32)
      out.append((self._verify_sample, (self.state.slot_state(), logits, drafts, inp.num_drafts,
                                        inp.decode_slots, inp.sampling, allowed)))
    if self.draft is not None:
      prefills = [self.dummy_prefill(t) for t in ec.scheduler.prefill_token_buckets]
      out += self.draft.programs(prefills, verifies, self.state.last_tokens)
    return out

  def _run_dummy(self, step: StepProgram, args: tuple) -> jax.Array:
    """Runs a prefill or decode program on its dummy input, then its sampler."""
    if step is self._verify:
      return self.run_verify(args[3], args[4], []).out.tokens
    if step is self._multi_decode:
      return self.run_multi_decode(args[3], args[4], args[6]).tokens
    inp = args[-1]
    if step is self._prefill:
      logits, slots = self.run_prefill(inp), inp.sample_slots
    else:
      logits, slots = self.run_decode(inp), inp.decode_slots
    out = self._run_sampler(self._sample, logits, slots, inp.sampling,
                            self._unconstrained(slots.shape[0]))
    return out.tokens

  def dummy_prefill(self, t: int) -> PrefillInput:
    """A padding-only prefill call of T tokens: writes into page 0 and the dummy slot."""
    return build_prefill_input([], self.engine_cfg, bucket=t,
                               window=self.window_group is not None)[0]

  def dummy_verify(self, b: int) -> VerifyInput:
    """A padding-only speculative batch of B rows."""
    ec = self.engine_cfg
    z, s = np.zeros((b,), np.int32), ec.speculative.num_speculative_tokens + 1
    window = self.window_group is not None
    return VerifyInput(decode_slots=np.full((b,), ec.scheduler.max_num_seqs, np.int32), positions=z,
                       num_drafts=z, kv_index=np.zeros((b, s), np.int32),
                       block_tables=np.zeros((b, ec.block_table_width), np.int32),
                       lora_slots=np.full((b,), -1, np.int32), prev_tokens=z, prev_kv_index=z,
                       sampling=sampling.SamplingTensors.build([], [], [], b),
                       window_kv_index=np.zeros((b, s), np.int32) if window else None,
                       window_block_tables=(np.zeros((b, ec.block_table_width), np.int32)
                                            if window else None))

  def dummy_decode(self, b: int) -> DecodeInput:
    """A padding-only decode batch of B rows."""
    ec = self.engine_cfg
    z, w = np.zeros((b,), np.int32), ec.block_table_width
    window = self.window_group is not None
    return DecodeInput(decode_slots=np.full((b,), ec.scheduler.max_num_seqs, np.int32), positions=z,
                       kv_index=z, block_tables=np.zeros((b, w), np.int32), seq_lens=z,
                       lora_slots=np.full((b,), -1, np.int32),
                       sampling=sampling.SamplingTensors.build([], [], [], b),
                       window_kv_index=z if window else None,
                       window_block_tables=np.zeros((b, w), np.int32) if window else None)

  def kv_pool_bytes(self) -> int:
    """Bytes of the KV pools (the target's; both groups of a hybrid model)."""
    kv = self.state.kv
    return kv.k.nbytes + kv.v.nbytes

  def _log_capacity(self) -> None:
    c = self.engine_cfg
    per_tok = kv_bytes_per_token(self.model_cfg, self.kv_dtype_name)
    tokens = (self.num_pages - 1) * c.cache.page_size
    fmt = weight_formats(self.params, self.weight_dtype_name)
    groups = ""
    if self.kv_layout is not None:  # hybrid: what each group holds, its own bytes
      layout, full = self.kv_layout, per_tok // self.model_cfg.num_layers
      sliding = sum(layout.sliding)
      groups = (f"; {self.model_cfg.num_layers - sliding} full-attention layers x "
                f"{layout.num_pages - 1} pages, {sliding} sliding-window layers (window "
                f"{layout.window}) x {layout.window_pages - 1} pages; {full} B/token/layer")
      per_tok = full * (self.model_cfg.num_layers - sliding)  # what a token of context costs
    if self.model_cfg.mla is not None:  # MLA: one latent row per token per layer, no K/V
      groups = (f"; latent cache, {self.model_cfg.num_layers} layers x "
                f"{self.model_cfg.mla.latent_dim} per token")
    for msg in (f"KV cache: {self.num_pages - 1} pages x {c.cache.page_size} tokens = "
                f"{tokens} tokens "
                f"({self.kv_pool_bytes() / 2**30:.2f} GiB, {per_tok} B/token, "
                f"{self.kv_dtype_name}{groups}); "
                f"max concurrency at max_model_len={c.scheduler.max_model_len}: "
                f"{tokens / c.scheduler.max_model_len:.1f} requests" + self._offload_note(),
                f"Weights: {params_nbytes(self.params) / 2**20:.1f} MiB ({fmt}, compute "
                f"{self.dtype_name}); KV cache {per_tok} B/token ({self.kv_dtype_name})"
                + self._state_note()):
      print(msg, file=sys.stderr, flush=True)  # not logged too: the launcher shows logs on stderr


  def _offload_note(self) -> str:
    """The capacity line's tiered prefix cache: the host memory reserved for it."""
    c = self.engine_cfg.cache
    if not self.kv_offload:
      return ""
    page_bytes = sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in self.kv_page_specs())
    pages = c.host_tier_pages(page_bytes)
    disk = (f", disk tier {c.kv_offload_disk_gb:g} GiB in {c.kv_offload_disk_dir}"
            if c.kv_offload_disk_dir is not None else "")
    return (f"; offload: host tier {pages} pages = {pages * c.page_size} tokens "
            f"({pages * page_bytes / 2**30:.2f} GiB reserved){disk}")

  def _state_note(self) -> str:
    """The capacity line's linear-attention state slots (state_cache.py), if any."""
    cfg = self.model_cfg
    if not cfg.has_state_slots:
      return ""
    per_seq, states = cfg.state_bytes_per_sequence(), self.state.states
    total = states.conv.nbytes + states.rec.nbytes
    layers = cfg.num_layers * cfg.linear_layers_per_block
    return (f"; linear-attention state {per_seq} B/sequence ({layers} layers) x "
            f"{states.conv.shape[0]} slots ({total / 2**20:.2f} MiB)")


def _load_threads() -> int:
  """Threads that load stored executables (XLA deserializes them with the GIL released;
  more threads than cores only contend)."""
  return max(1, min(4, os.cpu_count() or 1))


def _sampled(token, logprob, top_ids, top_logprobs, n: int | None) -> SampledToken:
  """One sampled token as the engine sees it; with its logprobs when `n` is not None."""
  token = int(token)
  if n is None:
    return SampledToken(token_id=token)
  top = [(int(i), float(lp)) for i, lp in zip(top_ids[:n], top_logprobs[:n], strict=True)]
  return SampledToken(token_id=token, logprob=TokenLogprob(token, float(logprob), top))


def _pad_slots(a: np.ndarray, slots: int) -> np.ndarray:
  """Host pages [L, n, ...] zero-padded to [L, slots, ...] (the padding goes to the dummy
  page: zeros, never stale memory that a masked read could turn into NaN)."""
  out = np.zeros((a.shape[0], slots, *a.shape[2:]), a.dtype)
  out[:, :a.shape[1]] = a
  return out
