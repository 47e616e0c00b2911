"""LoRA in the forward pass: the per-row low-rank update of a linear layer, pure JAX.

A LoRA adapter adds `(x @ A) @ B * scaling` to the output of a linear layer.
The runner keeps up to S adapters resident in device *slots*: for every
target module of every layer, `a [In, S, R]` and `b [S, R, Out]`, with the
adapter's scaling folded into `b` and its rank padded to the slot rank R with
zeros (exact: the padded columns contribute nothing). The layout makes
`a` an `[In, S*R]` matrix and `b` an `[S*R, Out]` one without a copy. Each token row of a
batch names its slot in `rows` (-1: no adapter), so one compiled program
serves any mix of adapters; loading an adapter rewrites a slot's contents,
never a shape.

Two formulations of the batched update (`lora_delta`), measured in docs/lora.md:
  * "dense" (the default): x times every slot's A at once (`[T, S*R]`, one
    skinny matmul), rows masked to their own slot, then one matmul against
    every slot's B. No gather; cost grows with S*R, which serving keeps small.
  * "gather": each row gathers its own A and B (`[In, T, R]`, `[T, R, Out]`),
    the Punica/S-LoRA "BGMV" form; its traffic grows with T*(In+Out)*R.

Matmuls take the slots' dtype (bfloat16 slots under bfloat16 weights) and
accumulate in float32, like the base projections.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

# Modules an adapter may target (params keys of serving/models/layout.py).
ATTENTION_TARGETS = ("wq", "wk", "wv", "wo")
MLP_TARGETS = ("w_gate", "w_up", "w_down")
LORA_METHODS = ("dense", "gather")


def lora_targets(is_moe: bool) -> tuple[str, ...]:
  """Target modules the model has slots for: MoE experts take no adapter."""
  return ATTENTION_TARGETS if is_moe else ATTENTION_TARGETS + MLP_TARGETS


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoraBatch:
  """The adapters of one forward pass.

  `weights` mirrors the params' `layers`: a list of per-layer dicts, or one dict
  of stacked `[L, ...]` arrays, mapping a target module to `(a, b)`. `rows` [T]
  int32 is each token row's slot, -1 for none.
  """

  weights: Any
  rows: jax.Array
  method: str = dataclasses.field(default="dense", metadata=dict(static=True))


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, rows: jax.Array,
               method: str = "dense") -> jax.Array:
  """The LoRA update of each row: x [T, In] -> [T, Out] float32 (zero where rows < 0).

  a [In, S, R], b [S, R, Out] (scaling folded in); see the module doc for the methods.
  """
  d_in, s, r = a.shape
  if method == "dense":
    xa = dot_f32(x, a.reshape(d_in, s * r)).reshape(-1, s, r)  # [T, S, R]
    mine = rows[:, None] == jnp.arange(s, dtype=rows.dtype)[None, :]  # [T, S]
    xa = jnp.where(mine[..., None], xa, 0.0).reshape(-1, s * r)
    return dot_f32(xa, b.reshape(s * r, -1))
  if method == "gather":
    slot = jnp.maximum(rows, 0)
    xa = jnp.einsum("ti,itr->tr", x.astype(a.dtype), a[:, slot],
                    preferred_element_type=jnp.float32)
    xa = jnp.where(rows[:, None] >= 0, xa, 0.0).astype(b.dtype)
    return jnp.einsum("tr,tro->to", xa, b[slot], preferred_element_type=jnp.float32)
  raise ValueError(f"LoRA method {method!r} not in {LORA_METHODS}")


def dot_f32(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [T, K] @ w [K, N] in w's dtype, accumulated in float32."""
  return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def apply_lora(y: jax.Array, x: jax.Array, layer_lora: dict | None, rows: jax.Array | None,
               name: str, method: str = "dense") -> jax.Array:
  """y + the LoRA update of module `name` when this layer has slots for it.

  Computed for every batch, adapters or not: skipping it with a `lax.cond` when
  no row has an adapter made every batch slower on XLA:CPU (docs/lora.md).
  """
  if layer_lora is None or name not in layer_lora:
    return y
  a, b = layer_lora[name]
  return (y.astype(jnp.float32) + lora_delta(x, a, b, rows, method)).astype(y.dtype)
