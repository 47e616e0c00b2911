"""The device side: jitted, pure prefill and decode steps over the paged cache.

Lifecycle:
  1. `ModelRunner(params, model_cfg, engine_cfg)` puts the weights on the
     device(s), sizes and allocates the KV page pool and the sampler state.
  2. `warm_up()` compiles every (bucket) program once — prefill per token
     bucket, decode and sampling per batch bucket — and logs how many; the
     executable store (serving/executable_store.py) makes restarts cheap:
     it loads compiled steps without tracing them.
  3. The engine calls `prefill(PrefillInput)` / `decode(DecodeInput)` with
     host numpy arrays already padded to a bucket. Each call dispatches
     asynchronously and returns device arrays (`SampleOutput`); the engine
     reads them only after dispatching the next step (host/device overlap).

The runner never makes policy: the scheduler decides what runs. Device
state (`DeviceState`: KV pages, each slot's last sampled token, penalty
counters) is donated into every step, so it is updated in place.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import sharding
from serving import attention, sampling
from serving.config import EngineConfig
from serving.executable_store import ExecutableStore, StepProgram
from serving.kv_cache import KVCache, create_kv_cache, write_kv
from serving.model_config import ModelConfig
from serving.models import llama
from serving.quant import has_quantized, put_params, quantize_params
from serving.types import MAX_LOGPROBS

log = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DeviceState:
  kv: KVCache
  last_tokens: jax.Array  # [S+1] int32: each slot's latest sampled token (slot S = dummy)
  prompt_mask: jax.Array  # [S+1, V] bool: token occurs in the slot's prompt
  output_counts: jax.Array  # [S+1, V] int32: times the slot generated each token


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillInput:
  """One sequence's prefill chunk, padded to a token bucket T and width W."""

  tokens: np.ndarray  # [T] int32
  positions: np.ndarray  # [T] int32
  slot_mapping: np.ndarray  # [T] int32 page*page_size+offset; padding -> page 0
  is_output: np.ndarray  # [T] bool: token was generated (recompute after preemption)
  num_tokens: np.ndarray  # [] int32 valid rows
  block_table: np.ndarray  # [1, W] int32
  kv_len: np.ndarray  # [1] int32 tokens in the cache after this chunk
  slot: np.ndarray  # [] int32 decode slot of the sequence
  reset: np.ndarray  # [] bool: first chunk, clear the slot's penalty state
  sampling: sampling.SamplingTensors  # [1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeInput:
  """One decode step over B rows (padded) and block-table width W."""

  slots: np.ndarray  # [B] int32 (padding rows -> dummy slot S)
  positions: np.ndarray  # [B] int32 position of the input token
  slot_mapping: np.ndarray  # [B] int32
  block_tables: np.ndarray  # [B, W] int32
  seq_lens: np.ndarray  # [B] int32 (positions + 1; 0 for padding)
  sampling: sampling.SamplingTensors  # [B]


def _attend_fn(backend, cfg: ModelConfig, num_pages: int, kind: str, meta, block_tokens: int):
  """Builds the per-layer attention callback for llama.forward."""
  scale = cfg.head_dim ** -0.5

  def attend(layer, q, k, v, kv):
    kv = write_kv(kv, layer, k, v, meta["slot_mapping"])
    tables = meta["block_tables"] + layer * num_pages
    kw = dict(scale=scale, sliding_window=cfg.sliding_window)
    if backend == "xla":
      kw["block_tokens"] = block_tokens
    if kind == "decode":
      return attention.decode_attention(backend, q, kv, tables, meta["seq_lens"], **kw)
    return attention.ragged_attention(backend, q, kv, tables, meta["cu_q_lens"],
                                      meta["kv_lens"], **kw)

  # Under a mesh, kernels run per head shard (no gather of the KV cache);
  # the XLA path lets jit partition it.
  return attend if backend == "xla" else sharding.head_parallel(attend, cfg)


def prefill_step(params, state: DeviceState, inp: PrefillInput, *, cfg: ModelConfig,
                 backend: str, act_dtype, block_tokens: int) -> tuple[DeviceState, jax.Array]:
  """Pure prefill of one chunk -> (state, logits [1, V] after its last valid row)."""
  t = inp.tokens.shape[0]
  meta = dict(slot_mapping=inp.slot_mapping, block_tables=inp.block_table,
              cu_q_lens=jnp.stack([0, inp.num_tokens]).astype(jnp.int32), kv_lens=inp.kv_len)
  attend = _attend_fn(backend, cfg, state.kv.num_pages, "prefill", meta, block_tokens)
  hidden, kv = llama.forward(params, cfg, inp.tokens, inp.positions, state.kv, attend,
                             act_dtype=act_dtype)
  last = jax.lax.dynamic_slice_in_dim(hidden, inp.num_tokens - 1, 1)  # [1, D]
  logits = llama.logits(params, cfg, last)
  # Penalty state of the slot: cleared on the first chunk, then fed by this chunk.
  valid = jnp.arange(t) < inp.num_tokens
  pm = jnp.where(inp.reset, False, state.prompt_mask[inp.slot])
  oc = jnp.where(inp.reset, 0, state.output_counts[inp.slot])
  pm = pm.at[inp.tokens].max(valid & ~inp.is_output)
  oc = oc.at[inp.tokens].add((valid & inp.is_output).astype(jnp.int32))
  state = dataclasses.replace(state, kv=kv, prompt_mask=state.prompt_mask.at[inp.slot].set(pm),
                              output_counts=state.output_counts.at[inp.slot].set(oc))
  return state, logits


def decode_step(params, state: DeviceState, inp: DecodeInput, *, cfg: ModelConfig,
                backend: str, act_dtype, block_tokens: int) -> tuple[DeviceState, jax.Array]:
  """Pure decode of one token per row -> (state, logits [B, V]).

  Input tokens come from `state.last_tokens` (sampled by the previous step).
  """
  tokens = state.last_tokens[inp.slots]
  meta = dict(slot_mapping=inp.slot_mapping, block_tables=inp.block_tables,
              seq_lens=inp.seq_lens)
  attend = _attend_fn(backend, cfg, state.kv.num_pages, "decode", meta, block_tokens)
  hidden, kv = llama.forward(params, cfg, tokens, inp.positions, state.kv, attend,
                             act_dtype=act_dtype)
  return dataclasses.replace(state, kv=kv), llama.logits(params, cfg, hidden)


def sample_step(state: DeviceState, logits: jax.Array, slots: jax.Array,
                tensors: sampling.SamplingTensors) -> tuple[DeviceState, sampling.SampleOutput]:
  """Samples one token per row [B] of slots and records it in the slot state.

  Jitted per batch bucket only (not per context width), which keeps the
  number of compiled sampler programs small.
  """
  # rows=: the per-slot penalty rows are gathered only when a row has a penalty.
  out = sampling.sample(logits, tensors, state.prompt_mask, state.output_counts, rows=slots,
                        num_top=MAX_LOGPROBS)
  state = dataclasses.replace(
      state, last_tokens=state.last_tokens.at[slots].set(out.tokens),
      output_counts=state.output_counts.at[slots, out.tokens].add(1))
  return state, out


def resolve_dtypes(engine_cfg: EngineConfig, platform: str) -> tuple[str, str]:
  """(compute dtype, kv dtype) names after resolving "auto"."""
  dtype = engine_cfg.dtype
  if dtype == "auto":
    dtype = "float32" if platform == "cpu" else "bfloat16"
  kv = engine_cfg.kv_cache_dtype
  if kv == "auto":
    kv = dtype
  return dtype, kv


def resolve_weight_dtype(engine_cfg: EngineConfig, compute_dtype: str) -> str:
  """Dtype of the unquantized weights: `weight_dtype`, or the compute dtype for "auto".

  Matmuls cast activations to the weight dtype and accumulate in float32
  (`llama.linear`), so bfloat16 weights under float32 compute read half the
  bytes and take XLA:CPU's faster bf16 dot, while norms, attention and the
  residual stream stay float32.
  """
  return compute_dtype if engine_cfg.weight_dtype == "auto" else engine_cfg.weight_dtype


class ModelRunner:
  """Holds weights and device state; runs bucketed, jitted steps (see module doc)."""

  def __init__(self, params, model_cfg: ModelConfig, engine_cfg: EngineConfig, *,
               num_pages: int, mesh: jax.sharding.Mesh | None = None):
    # Sharded when tp*ep*dp > 1 or a mesh is given (sharding/placement.py).
    self.mesh = mesh if mesh is not None else sharding.mesh_for(engine_cfg)
    placement = sharding.Placement(self.mesh, model_cfg) if self.mesh is not None else None
    if placement is not None and (engine_cfg.quantization or has_quantized(params)):
      raise NotImplementedError("quantized weights on a mesh (tp/ep/dp > 1) are not supported "
                                "yet; serve them on one device or without quantization")
    if placement is not None:
      params, model_cfg = placement.adapt(params), placement.model_cfg
    self.model_cfg, self.engine_cfg = model_cfg, engine_cfg
    platform = jax.default_backend()
    self.dtype_name, self.kv_dtype_name = resolve_dtypes(engine_cfg, platform)
    self.weight_dtype_name = resolve_weight_dtype(engine_cfg, self.dtype_name)
    self.backend = attention.resolve_backend(engine_cfg.attention_backend, platform)
    dtype = jnp.dtype(self.dtype_name)
    if engine_cfg.quantization:  # on the host, before anything reaches the device
      params = quantize_params(params, engine_cfg.quantization)
    unroll = engine_cfg.unroll_layers
    if unroll if unroll is not None else platform == "cpu":
      params = llama.unstack_layers(params)
    weight_dtype = jnp.dtype(self.weight_dtype_name)
    if placement is not None:
      self.params = placement.place_params(params, weight_dtype)
    else:
      self.params = put_params(params, weight_dtype)  # quantized leaves keep their dtypes
    self.num_pages = num_pages
    slots, vocab = engine_cfg.max_num_seqs + 1, model_cfg.vocab_size
    kv_sharding = placement.kv_sharding if placement is not None else None
    self.state = DeviceState(
        kv=create_kv_cache(model_cfg, num_pages, engine_cfg.page_size, self.kv_dtype_name,
                           kv_sharding),
        last_tokens=jnp.zeros((slots,), jnp.int32),
        prompt_mask=jnp.zeros((slots, vocab), jnp.bool_),
        output_counts=jnp.zeros((slots, vocab), jnp.int32))
    if placement is not None:
      kv, rest = self.state.kv, placement.replicate(dataclasses.replace(self.state, kv=None))
      self.state = dataclasses.replace(rest, kv=kv)
    kw = dict(cfg=model_cfg, backend=self.backend, act_dtype=dtype,
              block_tokens=engine_cfg.attention_block_tokens)
    if placement is not None:
      jit = functools.partial(placement.jit, state=self.state)
    else:
      jit = jax.jit
    # Warm starts load the compiled steps from disk instead of tracing them.
    store = ExecutableStore.for_runner(engine_cfg.compilation_cache,
                                       engine_cfg.compilation_cache_dir, placement is not None)
    self._store = store
    static = repr(sorted(kw.items()))
    self._prefill = StepProgram("prefill", jit(functools.partial(prefill_step, **kw),
                                               donate_argnums=(1,)),
                                static=static, num_fixed=2, store=store)
    self._decode = StepProgram("decode", jit(functools.partial(decode_step, **kw),
                                             donate_argnums=(1,)),
                               static=static, num_fixed=2, store=store)
    self._sample = StepProgram("sample", jit(sample_step, donate_argnums=(0,)), static="",
                               num_fixed=1, store=store)

  @property
  def dummy_slot(self) -> int:
    return self.engine_cfg.max_num_seqs

  def prefill(self, inp: PrefillInput, sample: bool = True) -> sampling.SampleOutput | None:
    """Runs a chunk; samples the next token only for a sequence's last chunk."""
    self.state, logits = self._prefill(self.params, self.state, inp)
    if not sample:
      return None
    self.state, out = self._sample(self.state, logits, inp.slot[None], inp.sampling)
    return out

  def decode(self, inp: DecodeInput) -> sampling.SampleOutput:
    self.state, logits = self._decode(self.params, self.state, inp)
    self.state, out = self._sample(self.state, logits, inp.slots, inp.sampling)
    return out

  def warm_up(self) -> int:
    """Compiles (or loads) every bucket's program; returns the count.

    Programs: one prefill per token bucket, one decode and one sampler per
    batch bucket (+ the single-row sampler prefill uses). With an executable
    store they are loaded in parallel threads and compiled only when missing,
    without running anything; without one, each is run once on dummy inputs.
    """
    start = time.perf_counter()
    programs = self._bucket_programs()
    if self._store is not None:
      with concurrent.futures.ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        list(pool.map(lambda p: p[0].try_load(*p[1]), programs))
      for step, args in programs:
        step.prepare(*args)
    else:
      ec = self.engine_cfg
      for t in ec.prefill_token_buckets:
        jax.block_until_ready(self.prefill(self.dummy_prefill(t)))
      for b in ec.decode_batch_buckets:
        jax.block_until_ready(self.decode(self.dummy_decode(b)))
    steps = (self._prefill, self._decode, self._sample)
    n = sum(s.num_programs() for s in steps)
    log.info("compiled %d programs (%d prefill, %d decode, %d sampler; %d loaded from the "
             "executable store) in %.1fs", n, *(s.num_programs() for s in steps),
             sum(s.loaded for s in steps), time.perf_counter() - start)
    return n

  def _bucket_programs(self) -> list[tuple[StepProgram, tuple]]:
    """(step, arguments) of every program serving can run; logits as abstract values."""
    ec, vocab = self.engine_cfg, self.model_cfg.vocab_size
    out = []
    for t in ec.prefill_token_buckets:
      inp = self.dummy_prefill(t)
      out.append((self._prefill, (self.params, self.state, inp)))
    rows = sorted({1, *ec.decode_batch_buckets})
    for b in ec.decode_batch_buckets:
      out.append((self._decode, (self.params, self.state, self.dummy_decode(b))))
    for b in rows:
      inp = self.dummy_decode(b)
      logits = jax.ShapeDtypeStruct((b, vocab), jnp.float32)
      out.append((self._sample, (self.state, logits, inp.slots, inp.sampling)))
    return out

  def dummy_prefill(self, t: int) -> PrefillInput:
    """A padding-only chunk: writes into dummy page 0 and the dummy slot."""
    z, w = np.zeros((t,), np.int32), self.engine_cfg.block_table_width
    return PrefillInput(tokens=z, positions=z, slot_mapping=z, is_output=np.zeros(t, bool),
                        num_tokens=np.int32(1), block_table=np.zeros((1, w), np.int32),
                        kv_len=np.ones((1,), np.int32), slot=np.int32(self.dummy_slot),
                        reset=np.bool_(True),
                        sampling=sampling.SamplingTensors.build([], [], [], 1))

  def dummy_decode(self, b: int) -> DecodeInput:
    z, w = np.zeros((b,), np.int32), self.engine_cfg.block_table_width
    return DecodeInput(slots=np.full((b,), self.dummy_slot, np.int32), positions=z,
                       slot_mapping=z, block_tables=np.zeros((b, w), np.int32), seq_lens=z,
                       sampling=sampling.SamplingTensors.build([], [], [], b))
