"""A dense attention callback for model-level tests: one sequence at positions 0..T-1.

`dense_attend(cfg)` is the model's `attend(layer, q, k, v, kv, sinks=None)`
computed from scratch with transformers' eager semantics (no KV cache: `kv`
passes through): causal, each layer's window from `cfg.layer_window` (a key is
visible when it is among the last `window` positions, the query's own
included), and with `sinks` [N] a per-head logit that joins the softmax and is
then dropped. `dense_logits` runs a model's whole forward with it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from serving.models import causal_lm
from serving.models.model_config import ModelConfig


def dense_attend(cfg: ModelConfig):
  """The dense reference attention callback of `cfg` (see module doc)."""
  windows = jnp.asarray([cfg.layer_window(i) or 0 for i in range(cfg.num_layers)], jnp.int32)

  def attend(layer, q, k, v, kv, sinks=None):
    t, n, h = q.shape
    group = n // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)  # [T, N, H]
    scores = jnp.einsum("tnh,snh->nts", q.astype(jnp.float32), k.astype(jnp.float32))
    scores = scores * h ** -0.5
    pos = jnp.arange(t)
    window = windows[layer]
    visible = (pos[None, :] <= pos[:, None]) & (
        (window == 0) | (pos[None, :] > pos[:, None] - window))  # [T, S]
    scores = jnp.where(visible[None], scores, -jnp.inf)
    if sinks is not None:  # [N] -> a last column [N, T, 1], dropped after the softmax
      sink = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, None], (n, t, 1))
      probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    else:
      probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("nts,snh->tnh", probs, v.astype(jnp.float32)).astype(q.dtype), kv

  return attend


def dense_logits(params, cfg: ModelConfig, ids: list[int], experts_fn=None) -> jax.Array:
  """The model's logits [T, V] for one sequence `ids`, with `dense_attend` (traceable:
  params may be jax arrays on a mesh, `experts_fn` the expert-parallel callback)."""
  params = jax.tree.map(jnp.asarray, params)
  hidden, _ = causal_lm.forward(params, cfg, jnp.asarray(ids), jnp.arange(len(ids)), None,
                                dense_attend(cfg), experts_fn=experts_fn)
  return causal_lm.logits(params, cfg, hidden)
