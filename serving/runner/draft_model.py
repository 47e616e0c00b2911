"""The draft model of speculative decoding: a smaller model that proposes on the device.

`DraftModel` holds a second model with the target's tokenizer (its vocabulary
may be smaller, never larger) and its own KV page pool. The pool has as many
pages as the target's and is indexed by the same page ids, so a sequence's
block table serves both models and the scheduler accounts for one set of
pages. The draft's K/V is written

  * by every prefill chunk, beside the target's (`prefill`);
  * by `propose`, which runs inside a speculative step before verification:
    it first re-runs the row's two latest known positions (p-1, p) — the
    target may have kept all drafts last time, so the draft never saw the
    token at p-1; recomputing a position with its own token writes the same
    K/V, so this is always safe — then feeds its own greedy tokens for
    positions p+1.. and returns the k drafts, which never leave the device.

Drafts are the draft model's argmax (a deterministic proposal), which the
verifier's rejection sampling keeps exact for any sampling parameters
(sampling/speculative.py). K/V the draft wrote for rejected drafts lies past
the sequence's length and is rewritten before it is read.

Letters: B rows, S = k + 1 positions per row, W block-table width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import sharding
from serving.models import causal_lm
from serving.models.model_config import ModelConfig
from serving.runner.executable_store import ExecutableStore, StepProgram
from serving.runner.kv_cache import KVCache, create_kv_cache
from serving.runner.sampling.reductions import argmax
from serving.runner.steps import PrefillInput, VerifyInput, attend_fn, prefill_meta


def draft_prefill_step(params, kv: KVCache, inp: PrefillInput, *, cfg: ModelConfig, backend: str,
                       act_dtype, block_tokens: int) -> KVCache:
  """Writes the draft's K/V of a step's prefill chunks (the target's `PrefillInput`)."""
  attend = attend_fn(backend, cfg, "prefill", prefill_meta(inp), block_tokens)
  _, kv = causal_lm.forward(params, cfg, inp.tokens, inp.positions, kv, attend,
                            act_dtype=act_dtype, experts_fn=sharding.expert_parallel(cfg))
  return kv


def draft_propose_step(params, kv: KVCache, last_tokens: jax.Array, inp: VerifyInput, *,
                       cfg: ModelConfig, backend: str, act_dtype,
                       block_tokens: int) -> tuple[KVCache, jax.Array]:
  """Greedy drafts [B, S-1] for a speculative step's rows (module doc)."""
  b, s = inp.kv_index.shape
  num_slots = last_tokens.shape[0] - 1  # the last slot is the padding rows' dummy
  real = inp.decode_slots < num_slots
  p = inp.positions

  def run(kv, tokens, positions, kv_index, valid):
    """One forward of R rows, each a decode row at its own position -> (kv, argmax [R])."""
    tables = jnp.repeat(inp.block_tables, tokens.shape[0] // b, axis=0)
    meta = dict(kv_index=kv_index, block_tables=tables,
                seq_lens=jnp.where(valid, positions + 1, 0))
    attend = attend_fn(backend, cfg, "decode", meta, block_tokens)
    hidden, kv = causal_lm.forward(params, cfg, tokens, positions, kv, attend,
                                   act_dtype=act_dtype, experts_fn=sharding.expert_parallel(cfg))
    return kv, argmax(causal_lm.logits(params, cfg, hidden).astype(jnp.float32))

  # Catch up: positions p-1 and p as 2B rows; the draft after p comes from row p.
  latest = last_tokens[inp.decode_slots]
  tokens = jnp.stack([inp.prev_tokens, latest], axis=1).reshape(-1)  # [B, 2] -> [2B]
  positions = jnp.stack([jnp.maximum(p - 1, 0), p], axis=1).reshape(-1)
  index = jnp.stack([inp.prev_kv_index, inp.kv_index[:, 0]], axis=1).reshape(-1)
  valid = jnp.stack([real & (p > 0), real], axis=1).reshape(-1)
  kv, best = run(kv, tokens, positions, index, valid)
  drafts = jnp.zeros((b, s - 1), jnp.int32).at[:, 0].set(best.reshape(b, 2)[:, 1])

  def step(j, carry):  # draft j (1-based) at position p + j proposes draft j + 1
    kv, drafts = carry
    token = jax.lax.dynamic_index_in_dim(drafts, j - 1, axis=1, keepdims=False)
    index = jax.lax.dynamic_index_in_dim(inp.kv_index, j, axis=1, keepdims=False)
    kv, best = run(kv, token, p + j, index, real & (j < inp.num_drafts))
    return kv, drafts.at[:, j].set(best)

  kv, drafts = jax.lax.fori_loop(1, s - 1, step, (kv, drafts))
  return kv, drafts


class DraftModel:
  """The draft model's weights, K/V pool and compiled steps (module doc)."""

  def __init__(self, params, model_cfg: ModelConfig, *, num_pages: int, page_size: int,
               kv_dtype: str, act_dtype, backend: str, block_tokens: int,
               store: ExecutableStore | None):
    """`params`: the draft's weights, already on the device (as the runner puts its own)."""
    self.model_cfg = model_cfg
    self.params = params
    self.kv = create_kv_cache(model_cfg, num_pages, page_size, kv_dtype)
    kw = dict(cfg=model_cfg, backend=backend, act_dtype=act_dtype, block_tokens=block_tokens)
    static = repr(sorted(kw.items()))
    self._prefill = StepProgram(
        "draft_prefill", jax.jit(functools.partial(draft_prefill_step, **kw), donate_argnums=(1,)),
        static=static, num_fixed=2, store=store)
    self._propose = StepProgram(
        "draft_propose", jax.jit(functools.partial(draft_propose_step, **kw),
                                 donate_argnums=(1,)),
        static=static, num_fixed=3, store=store)
    self.steps = (self._prefill, self._propose)

  def prefill(self, inp: PrefillInput) -> None:
    self.kv = self._prefill(self.params, self.kv, inp)

  def propose(self, inp: VerifyInput, last_tokens: jax.Array) -> jax.Array:
    """Drafts [B, S-1] (device array) for a speculative step; `last_tokens` the target's."""
    self.kv, drafts = self._propose(self.params, self.kv, last_tokens, inp)
    return drafts

  def programs(self, prefills: list[PrefillInput], verifies: list[VerifyInput],
               last_tokens: jax.Array) -> list[tuple[StepProgram, tuple]]:
    """(step, arguments) of every draft program, for the runner's warm-up."""
    return ([(self._prefill, (self.params, self.kv, inp)) for inp in prefills]
            + [(self._propose, (self.params, self.kv, last_tokens, inp)) for inp in verifies])

  def arrays(self) -> list:
    return jax.tree.leaves((self.params, self.kv))


def check_vocabulary(draft_vocab: int, target_vocab: int) -> None:
  """A draft proposes token ids; they must all be ids of the target."""
  if draft_vocab > target_vocab:
    raise ValueError(f"the draft model's vocabulary ({draft_vocab}) is larger than the target's "
                     f"({target_vocab}); speculative decoding needs the target's tokenizer")

