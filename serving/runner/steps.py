"""The jitted steps as pure functions: device state in, device state out.

`prefill_step` runs a step's prefill chunks in one call and returns the
logits after the last row of each chunk that samples; `decode_step` runs one
token per decode slot; `sample_step` samples from logits and records the
tokens in the per-slot state; `multi_decode_step` runs k decode + sample
iterations in one call (multi-step decoding). The runner (model_runner.py) jits each once per
bucket and donates the state.

Letters: T prefill tokens (a bucket), C prefill chunks (padded), B decode
rows (a bucket), W block-table width, R decode slots (max_num_seqs; row R is
the dummy slot padding writes to), V vocabulary, D model dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import sharding
from serving.models import causal_lm
from serving.models.lora import LoraBatch
from serving.models.model_config import ModelConfig
from serving.runner import attention, mla_attention, native_decode, sampling, state_cache
from serving.runner.kv_cache import NO_WINDOW, KVCache, layer_pages, write_kv
from serving.types import MAX_LOGPROBS


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DeviceState:
  kv: KVCache
  last_tokens: jax.Array  # [R+1] int32: each decode slot's latest sampled token (R: dummy)
  prompt_mask: jax.Array  # [R+1, V] bool: token occurs in the slot's prompt
  output_counts: jax.Array  # [R+1, V] int32: times the slot generated each token
  # Linear-attention models: each slot's conv / recurrent states (state_cache.py).
  states: state_cache.StateSlots | None = None

  def slot_state(self) -> DeviceState:
    """The sampler programs' part (kv and `states` left out): a sampler then depends on
    the slot count, vocabulary and batch bucket only, not on the KV pool or the model, so
    engines that differ in those share its executables (the compilation cache)."""
    return dataclasses.replace(self, kv=None, states=None)

  def with_slot_state(self, slots: DeviceState) -> DeviceState:
    """This state with the sampler's part replaced by `slots` (a `slot_state()`)."""
    return dataclasses.replace(slots, kv=self.kv, states=self.states)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillInput:
  """A step's prefill chunks in one call: C chunk rows (padded), their tokens packed
  back to back in T rows (a bucket), padding after.

  Sampler rows: the chunks that sample come first (`sample_rows`, `sample_slots`,
  `sampling`); the other rows are padding that writes to the dummy slot.
  """

  tokens: np.ndarray  # [T] int32
  positions: np.ndarray  # [T] int32
  kv_index: np.ndarray  # [T] int32 KV index page*page_size+offset; padding -> page 0
  is_output: np.ndarray  # [T] bool: token was generated (recompute after preemption)
  token_slots: np.ndarray  # [T] int32 decode slot of each token's sequence (padding: dummy)
  lora_rows: np.ndarray  # [T] int32 each token's LoRA slot (-1: none, and padding)
  cu_q_lens: np.ndarray  # [C+1] int32 chunk c owns rows cu_q_lens[c]:cu_q_lens[c+1]
  kv_lens: np.ndarray  # [C] int32 tokens in the cache after each chunk (0: padding)
  block_tables: np.ndarray  # [C, W] int32
  decode_slots: np.ndarray  # [C] int32 each chunk's row of per-request state (padding: dummy)
  reset: np.ndarray  # [C] bool: first chunk of its sequence, clear the slot's penalty state
  blocks: attention.QueryBlocks  # the rows regrouped per chunk (the XLA attention path)
  sample_rows: np.ndarray  # [C] int32 packed row whose logits each sampler row takes
  sample_slots: np.ndarray  # [C] int32 decode slot each sampler row writes (padding: dummy)
  sampling: sampling.SamplingTensors  # [C]
  # A hybrid model's sliding-window page group (kv_cache.py): its KV indices and tables.
  window_kv_index: np.ndarray | None = None  # [T] int32
  window_block_tables: np.ndarray | None = None  # [C, W] int32 (0 behind the window)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeInput:
  """One decode step over B rows (padded) and block-table width W."""

  decode_slots: np.ndarray  # [B] int32 (padding rows -> the dummy slot, max_num_seqs)
  positions: np.ndarray  # [B] int32 position of the input token
  kv_index: np.ndarray  # [B] int32
  block_tables: np.ndarray  # [B, W] int32
  seq_lens: np.ndarray  # [B] int32 (positions + 1; 0 for padding)
  lora_slots: np.ndarray  # [B] int32 each row's LoRA slot (-1: none, and padding)
  sampling: sampling.SamplingTensors  # [B]
  window_kv_index: np.ndarray | None = None  # [B] int32: the sliding-window group's
  window_block_tables: np.ndarray | None = None  # [B, W] int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VerifyInput:
  """One speculative step over B rows (padded) of S = num_speculative_tokens + 1 positions.

  Row b's input tokens are its latest token (on the device, in `last_tokens`)
  at `positions[b]`, then its drafts (a separate argument of `verify_step`:
  host proposals or the draft model's output) at the next positions.
  """

  decode_slots: np.ndarray  # [B] int32 (padding rows -> the dummy slot)
  positions: np.ndarray  # [B] int32 position of the latest token
  num_drafts: np.ndarray  # [B] int32 drafts to verify (0..S-1; 0 for padding)
  kv_index: np.ndarray  # [B, S] int32; positions past num_drafts -> page 0
  block_tables: np.ndarray  # [B, W] int32
  lora_slots: np.ndarray  # [B] int32 (-1: none, and padding)
  # The token before the latest and its KV index: where a draft model resumes.
  prev_tokens: np.ndarray  # [B] int32
  prev_kv_index: np.ndarray  # [B] int32
  sampling: sampling.SamplingTensors  # [B]; step = output index of position 0
  window_kv_index: np.ndarray | None = None  # [B, S] int32: the sliding-window group's
  window_block_tables: np.ndarray | None = None  # [B, W] int32


def attend_fn(backend, cfg: ModelConfig, kind: str, meta, block_tokens: int,
              window: tuple[jax.Array | int, int] | None = None,
              layer_offset: int | jax.Array = 0):
  """Builds the per-layer attention callback for causal_lm.forward.

  Layer ids are global; `layer_offset` is the first layer of the KV pool this
  callback sees (a pipeline stage's), subtracted for the pages.

  `window` (prefill only): (start, T) when the callback sees rows [start, start + T')
  of a T-row step (a pipeline microbatch, sharding/pipeline.py): `meta` describes the
  whole step but `kv_index` only these rows; the attention runs over T rows with the
  others' queries zero and returns these rows.
  """
  def attend(layer, q, k, v, kv, sinks=None):
    if cfg.mla is not None:  # a latent cache: k is the latent row, no v (mla_attention.py)
      return mla_attention.attend(backend, kind, meta, layer - layer_offset, q, k, kv,
                                  scale=cfg.scale, value_dim=cfg.mla.kv_lora_rank,
                                  block_tokens=block_tokens, window=window)
    index, tables = layer_pages(kv, layer - layer_offset, meta)
    kv = write_kv(kv, layer - layer_offset, k, v, index)
    kw = dict(scale=cfg.scale, sliding_window=layer_window(cfg, layer))
    if cfg.attn_soft_cap is not None:
      kw["soft_cap"] = cfg.attn_soft_cap
    if sinks is not None:
      kw["sinks"] = sinks.astype(jnp.float32)
    if backend == "xla":
      kw["block_tokens"] = block_tokens
    if kind == "decode":
      return attention.decode_attention(backend, q, kv, tables, meta["seq_lens"], **kw)
    if kind == "verify":  # q [B*T, N, H] -> [B, T, N, H]
      q_lens = meta["q_lens"]
      out, kv = attention.verify_attention(backend, q.reshape(*q_lens.shape, *q.shape[1:]), kv,
                                           tables, q_lens, **kw)
      return out.reshape(q.shape), kv
    blocks = meta.get("blocks") if backend == "xla" else None
    if window is None:
      return attention.ragged_attention(backend, q, kv, tables, meta["cu_q_lens"],
                                        meta["kv_lens"], blocks=blocks, **kw)
    start, total = window
    whole = jax.lax.dynamic_update_slice_in_dim(
        jnp.zeros((total, *q.shape[1:]), q.dtype), q, start, axis=0)
    out, kv = attention.ragged_attention(backend, whole, kv, tables, meta["cu_q_lens"],
                                         meta["kv_lens"], blocks=blocks, **kw)
    return jax.lax.dynamic_slice_in_dim(out, start, q.shape[0], axis=0), kv

  # Under a mesh, kernels run per head shard (no gather of the KV cache);
  # the XLA path lets jit partition it.
  if backend == "xla" or cfg.mla is not None:
    return attend
  return sharding.head_parallel(attend, cfg)


def layer_window(cfg: ModelConfig, layer) -> int | jax.Array | None:
  """The sliding window of `layer` for the attention call: static (an int or None)
  when every layer has the same one or the layer id is a Python int (unrolled
  layers); under a scan over layers of different kinds, a traced int32 looked up
  by layer (NO_WINDOW for full-attention layers)."""
  windows = cfg.layer_windows
  if len(set(windows)) == 1:
    return windows[0]
  if isinstance(layer, int):
    return windows[layer]
  table = jnp.asarray([NO_WINDOW if w is None else w for w in windows], jnp.int32)
  return table[layer]


def model_forward(params, lora, kv: KVCache, tokens: jax.Array, positions: jax.Array,
                  lora_rows: jax.Array, meta: dict, kind: str, *, cfg: ModelConfig,
                  backend: str, act_dtype, block_tokens: int) -> tuple[jax.Array, KVCache]:
  """`causal_lm.forward` with the attention of a `kind` step over its `meta`
  -> (final-normed hidden [T, D], kv).

  The layers run through `sharding.pipeline_layers`: plain on one stage (a step there in
  one native call where it fits, native_decode.py); over
  the mesh's `pp` stages otherwise, with the step's rows cut into microbatches.
  Decode and verify metadata is per row (cut with the rows); a prefill step's
  chunk metadata is shared by its microbatches, each writing its own rows' K/V
  (`attend_fn`'s `window`).
  """
  x = causal_lm.embed_tokens(params, cfg, tokens, act_dtype)
  total = tokens.shape[0]
  shared = None
  if kind == "prefill":  # the KV indices are per row, the rest per chunk
    shared = {k: v for k, v in meta.items() if k not in ROW_META}
    meta = {k: v for k, v in meta.items() if k in ROW_META}

  def stage(layers, x, rows, shared, kv, active, start):
    positions, meta, lora_rows = rows
    if (active is True and backend == "xla" and x.shape[0] == total
        and native_decode.runs_native(layers, cfg, kv, x, lora)):
      rows_meta = (meta if kind == "decode" else native_decode.verify_rows(meta)
                   if kind == "verify" else native_decode.prefill_rows({**shared, **meta},
                                                                      positions))
      return native_decode.run_layers(layers, cfg, x, positions, rows_meta, kv)
    if active is not True:  # an idle pipeline tick writes only the dummy page
      meta = {**meta, "kv_index": jnp.where(active, meta["kv_index"], 0)}
    window = None
    if shared is not None:
      meta = {**shared, **meta}
      window = None if x.shape[0] == total else (start, total)
    offset = sharding.layer_offset(layers)
    attend = attend_fn(backend, cfg, kind, meta, block_tokens, window, offset)
    if cfg.has_state_slots:  # kv is a StateCarry: the layers' states with the pool
      attend = state_cache.carry_attend(attend)
    return causal_lm.run_layers(layers, cfg, x, positions, kv, attend,
                                experts_fn=sharding.expert_parallel(cfg),
                                lora=lora_batch(lora, lora_rows), layer_offset=offset)

  x, kv = sharding.pipeline_layers(stage, params["layers"], x, (positions, meta, lora_rows),
                                   shared, kv)
  return causal_lm.final_norm(params, cfg, x), kv


ROW_META = ("kv_index", "window_kv_index")  # a prefill step's per-row attention metadata


def with_window(meta: dict, inp) -> dict:
  """`meta` plus the input's sliding-window group index and tables, where it has them."""
  if inp.window_kv_index is None:
    return meta
  return {**meta, "window_kv_index": inp.window_kv_index,
          "window_block_tables": inp.window_block_tables}


def lora_batch(lora, rows: jax.Array) -> LoraBatch | None:
  """The forward's LoRA argument: the slots (None when LoRA is off) and each row's slot."""
  return None if lora is None else LoraBatch(weights=lora, rows=rows)


def prefill_meta(inp: PrefillInput) -> dict:
  """The attention callback's view of a prefill call (attend_fn)."""
  return with_window(dict(kv_index=inp.kv_index, block_tables=inp.block_tables,
                          cu_q_lens=inp.cu_q_lens, kv_lens=inp.kv_lens, blocks=inp.blocks), inp)


def prefill_step(params, lora, state: DeviceState, inp: PrefillInput, *, cfg: ModelConfig,
                 backend: str, act_dtype, block_tokens: int) -> tuple[DeviceState, jax.Array]:
  """Pure prefill of a step's chunks -> (state, logits [C, V] of the sampler rows).

  `lora`: the runner's LoRA slots (lora_state.py), or None when LoRA is off.
  """
  kv = state.kv
  if state.states is not None:
    kv = state_cache.prefill_carry(kv, state.states, cfg, inp.decode_slots, inp.cu_q_lens,
                                   inp.reset)
  hidden, kv = model_forward(params, lora, kv, inp.tokens, inp.positions, inp.lora_rows,
                             prefill_meta(inp), "prefill", cfg=cfg, backend=backend,
                             act_dtype=act_dtype, block_tokens=block_tokens)
  if state.states is not None:
    kv, states = state_cache.split(kv)
    state = dataclasses.replace(state, states=states)
  logits = causal_lm.logits(params, cfg, hidden[inp.sample_rows])
  # Penalty state of the chunks' slots: cleared on a first chunk, then fed by the tokens.
  valid = jnp.arange(inp.tokens.shape[0]) < inp.cu_q_lens[-1]
  slots = inp.decode_slots
  pm = state.prompt_mask.at[slots].set(state.prompt_mask[slots] & ~inp.reset[:, None])
  oc = state.output_counts.at[slots].set(jnp.where(inp.reset[:, None], 0,
                                                   state.output_counts[slots]))
  pm = pm.at[inp.token_slots, inp.tokens].max(valid & ~inp.is_output)
  oc = oc.at[inp.token_slots, inp.tokens].add((valid & inp.is_output).astype(jnp.int32))
  return dataclasses.replace(state, kv=kv, prompt_mask=pm, output_counts=oc), logits


def decode_step(params, lora, state: DeviceState, inp: DecodeInput, *, cfg: ModelConfig,
                backend: str, act_dtype, block_tokens: int) -> tuple[DeviceState, jax.Array]:
  """Pure decode of one token per row -> (state, logits [B, V]).

  Input tokens come from `state.last_tokens` (sampled by the previous step).
  """
  tokens = state.last_tokens[inp.decode_slots]
  meta = with_window(dict(kv_index=inp.kv_index, block_tables=inp.block_tables,
                          seq_lens=inp.seq_lens), inp)
  kv = state.kv
  if state.states is not None:
    kv = state_cache.decode_carry(kv, state.states, cfg, inp.decode_slots)
  hidden, kv = model_forward(params, lora, kv, tokens, inp.positions, inp.lora_slots,
                             meta, "decode", cfg=cfg, backend=backend, act_dtype=act_dtype,
                             block_tokens=block_tokens)
  if state.states is not None:
    kv, states = state_cache.split(kv)
    state = dataclasses.replace(state, states=states)
  return dataclasses.replace(state, kv=kv), causal_lm.logits(params, cfg, hidden)


def multi_decode_step(params, lora, state: DeviceState, inp: DecodeInput,
                      later_kv_index: jax.Array, allowed: jax.Array,
                      later_window_index: jax.Array | None = None, *, cfg: ModelConfig,
                      backend: str, act_dtype, block_tokens: int
                      ) -> tuple[DeviceState, sampling.SampleOutput]:
  """k = later_kv_index.shape[1] + 1 decode + sample iterations in one call
  -> (state, SampleOutput with [B, k] fields: each row's k tokens in order).

  Iteration i decodes each row at `positions + i` from the token iteration i - 1
  sampled (`last_tokens`), writing its KV at `later_kv_index[:, i - 1]` (the
  first at `inp.kv_index`); the block tables already hold the pages of all k
  positions. Padding rows stay at length 0 and write to page 0. Sampling
  draws output index `step + i`, as k single steps would. `allowed`: the
  all-ones mask (multi-step rows have no output constraint). `later_window_index`
  [B, k-1]: the same positions in a hybrid model's sliding-window group.
  """
  kw = dict(cfg=cfg, backend=backend, act_dtype=act_dtype, block_tokens=block_tokens)
  real = inp.seq_lens > 0
  # The k iterations are one loop body, not k unrolled copies: a program of k decode
  # forwards and k samplers held ~3x the host memory once loaded (86-117 MB a bucket for
  # the default model, the largest of a server's programs) and took 1.5x as long to compile.
  kv_index = jnp.concatenate([inp.kv_index[:, None], later_kv_index], axis=1).T  # [k, B]
  window_index = (None if later_window_index is None else jnp.concatenate(
      [inp.window_kv_index[:, None], later_window_index], axis=1).T)

  def iteration(state, xs):
    i, kv_i, window_i = xs
    step = dataclasses.replace(
        inp, positions=inp.positions + i, kv_index=kv_i, window_kv_index=window_i,
        seq_lens=jnp.where(real, inp.seq_lens + i, 0),
        sampling=dataclasses.replace(inp.sampling, step=inp.sampling.step + i))
    state, logits = decode_step(params, lora, state, step, **kw)
    return sample_step(state, logits, inp.decode_slots, step.sampling, allowed)

  steps = jnp.arange(kv_index.shape[0], dtype=inp.positions.dtype)
  state, outs = jax.lax.scan(iteration, state, (steps, kv_index, window_index))
  return state, jax.tree.map(lambda f: jnp.moveaxis(f, 0, 1), outs)  # [k, B] -> [B, k]


def verify_step(params, lora, state: DeviceState, inp: VerifyInput, drafts: jax.Array, *,
                cfg: ModelConfig, backend: str, act_dtype,
                block_tokens: int) -> tuple[DeviceState, jax.Array]:
  """Scores every row's latest token and drafts [B, S-1] at once -> (state, logits [B, S, V]).

  Position j of a row attends to the row's keys up to itself
  (attention.verify_attention): the step writes the K/V of all S positions
  first, so position j sees the drafts before it (causal). K/V of
  drafts that verification rejects stays past the sequence's length, is never
  read, and is overwritten when those positions are computed again.
  """
  b, s1 = drafts.shape
  s = s1 + 1
  tokens = jnp.concatenate([state.last_tokens[inp.decode_slots][:, None], drafts], axis=1)
  positions = inp.positions[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]  # [B, S]
  real = (inp.decode_slots < state.last_tokens.shape[0] - 1)[:, None]
  used = real & (jnp.arange(s)[None, :] <= inp.num_drafts[:, None])
  meta = dict(kv_index=inp.kv_index.reshape(-1), block_tables=inp.block_tables,
              q_lens=jnp.where(used, positions + 1, 0))
  if inp.window_kv_index is not None:
    meta.update(window_kv_index=inp.window_kv_index.reshape(-1),
                window_block_tables=inp.window_block_tables)
  hidden, kv = model_forward(params, lora, state.kv, tokens.reshape(-1), positions.reshape(-1),
                             jnp.repeat(inp.lora_slots, s), meta, "verify", cfg=cfg,
                             backend=backend, act_dtype=act_dtype, block_tokens=block_tokens)
  logits = causal_lm.logits(params, cfg, hidden)  # [B*S, V]
  return dataclasses.replace(state, kv=kv), logits.reshape(b, s, -1)


def verify_sample_step(state: DeviceState, logits: jax.Array, drafts: jax.Array,
                       num_drafts: jax.Array, slots: jax.Array,
                       tensors: sampling.SamplingTensors,
                       allowed: jax.Array) -> tuple[DeviceState, sampling.VerifyOutput]:
  """Keeps or rejects each row's drafts (sampling/speculative.py) and records the
  emitted tokens in the slot state: the last one feeds the next step.

  `allowed` [B, S, ceil(V / 32)] int32: token masks per position (all ones
  without a constraint), as `sample_step`'s.
  """
  out = sampling.verify(logits, drafts, num_drafts, tensors, state.prompt_mask,
                        state.output_counts, rows=slots, allowed=allowed, num_top=MAX_LOGPROBS)
  b, s = out.tokens.shape
  last = out.tokens[jnp.arange(b), out.num_accepted]
  emitted = (jnp.arange(s)[None, :] <= out.num_accepted[:, None]).astype(jnp.int32)
  state = dataclasses.replace(
      state, last_tokens=state.last_tokens.at[slots].set(last),
      output_counts=state.output_counts.at[slots[:, None], out.tokens].add(emitted))
  return state, out


def sample_step(state: DeviceState, logits: jax.Array, slots: jax.Array,
                tensors: sampling.SamplingTensors,
                allowed: jax.Array) -> tuple[DeviceState, sampling.SampleOutput]:
  """Samples one token per row [B] of decode slots and records it in the slot state.

  `allowed` [B, ceil(V / 32)] int32: each row's packed token mask (structured
  output); all ones (-1) for rows without a constraint.

  Jitted per batch bucket only (not per context width), which keeps the
  number of compiled sampler programs small.
  """
  # rows=: the per-slot penalty rows are gathered only when a row has a penalty.
  out = sampling.sample(logits, tensors, state.prompt_mask, state.output_counts, rows=slots,
                        allowed=allowed, num_top=MAX_LOGPROBS)
  state = dataclasses.replace(
      state, last_tokens=state.last_tokens.at[slots].set(out.tokens),
      output_counts=state.output_counts.at[slots, out.tokens].add(1))
  return state, out
