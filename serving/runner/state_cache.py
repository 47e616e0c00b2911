"""State slots: the fixed-size per-sequence cache of linear-attention layers.

A model with Gated DeltaNet layers (serving/models/qwen3_next.py) keeps, beside
the KV pages of its full-attention layers, two arrays indexed by **state slot**:

  conv [R+1, G, J, Kc-1, F]      each slot's last Kc-1 conv inputs per linear layer
  rec  [R+1, G, J, NV, dk, dv]   each slot's recurrent state (float32)

The state slot of a running sequence is its decode slot (the scheduler gives one
to every running sequence and takes it back on finish and preemption); slot R is
the dummy slot padding rows and chunks write to, as page 0 is for K/V. Both
arrays live in `DeviceState.states` and are donated into every step like the KV
pages; a step gathers its sequences' states, updates them (prefill: the chunked
rule from each chunk's slot state, zero for a sequence's first chunk; decode: the
recurrent step) and scatters them back, touching no other slot.

Failure and rollback: a step writes the states of exactly its own sequences. A
step that fails is rolled back by the scheduler (`Scheduler.fail`): its
sequences lose their pages and slots and are recomputed from position 0, and a
first chunk starts from zero states (`PrefillInput.reset`), so a half-updated
state is never read; preemption is the same path. Prefix caching is off for
these models (llm_engine.py, one log line): a cached prefix's pages would give
the full-attention layers their K/V, but not the linear layers their state at
that position.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from serving.models.gated_delta import StateCarry
from serving.models.model_config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StateSlots:
  conv: jax.Array  # [R+1, G, J, Kc-1, F]
  rec: jax.Array  # [R+1, G, J, NV, dk, dv] float32


def state_shapes(cfg: ModelConfig, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """The conv and recurrent state shapes of `num_slots` slots (the dummy included)."""
  nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
  dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
  lead = (num_slots, cfg.num_layers, cfg.linear_layers_per_block)
  return ((*lead, cfg.linear_conv_kernel - 1, 2 * nk * dk + nv * dv), (*lead, nv, dk, dv))


def create_state_slots(cfg: ModelConfig, num_slots: int) -> StateSlots | None:
  """Zeroed states of `num_slots` slots; None for a model without linear layers."""
  if not cfg.has_state_slots:
    return None
  conv, rec = state_shapes(cfg, num_slots)
  return StateSlots(conv=jnp.zeros(conv, jnp.float32), rec=jnp.zeros(rec, jnp.float32))


def prefill_carry(kv, states: StateSlots, cfg: ModelConfig, slots, cu, reset) -> StateCarry:
  """What a prefill step's layers thread: the pool and the chunks' slots (`slots` [C],
  `cu` [C+1], `reset` [C])."""
  return StateCarry(kv=kv, conv=states.conv, rec=states.rec, slots=slots, cu=cu, reset=reset,
                    chunk=cfg.linear_chunk_size)


def decode_carry(kv, states: StateSlots, cfg: ModelConfig, slots) -> StateCarry:
  """What a decode step's layers thread: the pool and each row's slot [B]."""
  return StateCarry(kv=kv, conv=states.conv, rec=states.rec, slots=slots,
                    chunk=cfg.linear_chunk_size)


def split(carry: StateCarry):
  """A step's result carry -> (kv, StateSlots)."""
  return carry.kv, StateSlots(conv=carry.conv, rec=carry.rec)


def carry_attend(attend):
  """The attention callback over a `StateCarry`: it reads and writes only the pool."""
  def wrapped(layer, q, k, v, carry: StateCarry, **extras):
    out, kv = attend(layer, q, k, v, carry.kv, **extras)
    return out, dataclasses.replace(carry, kv=kv)
  return wrapped


def check_engine(cfg: ModelConfig, config) -> None:
  """ValueError naming an engine option a state-slot model does not support yet (checked
  before anything is placed): speculative decoding (a rejected draft would need the
  states rolled back per token), pipeline stages, LoRA, KV page transfer between engines
  (it moves no states)."""
  if not cfg.has_state_slots:
    return
  refused = [name for name, on in (
      ("speculative decoding", config.speculative.enabled),
      ("pipeline stages (pp > 1)", config.parallel.pp > 1),
      ("LoRA adapters", bool(config.lora.max_loras)),
      ("prefill / decode workers", bool(config.parallel.prefill_workers
                                        or config.parallel.decode_workers))) if on]
  if refused:
    raise ValueError(f"{cfg.model_type} has linear-attention state slots; not supported with: "
                     f"{', '.join(refused)}")
