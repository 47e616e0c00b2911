"""Expert-parallel MoE: the model's experts callback as a `shard_map` over experts.

`layers.moe_mlp` routes tokens and hands the expert matmuls to a callback
`experts(x[T,D], weights[T,k], ids[T,k], (we_gate, we_up, we_down[, be_gate,
be_up])) -> [T, D]` (the activation is the config's: GPT-OSS's clamped
SwiGLU runs on every shard; the gate / up biases split like their columns).
Under a mesh whose rules split experts over `ep` and/or expert columns over
`tp`, `expert_parallel(cfg)` runs `layers.moe_experts` per
device: every device routes all tokens (replicated), computes its local
experts' column slice, and one psum over those axes adds the partial
outputs. Outside a mesh, or when experts are replicated, it computes every
expert locally. Decided at trace time, like `head_parallel`.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from serving.models import layers
from serving.models.model_config import ModelConfig
from serving.models.quantized import is_quantized
from sharding import rules
from sharding.mesh import axis_size


def expert_parallel(cfg: ModelConfig):
  """The experts callback for `causal_lm.forward` under the tracing mesh (see module doc)."""

  activation = layers.expert_activation(cfg)

  def experts_fn(x, weights, ids, experts):
    mesh = jax.sharding.get_abstract_mesh()
    axes = None if mesh.empty else rules.resolve_rules(cfg, mesh)
    if axes is None or not (axes["expert"] or axes["expert_mlp"]):
      return layers.moe_experts(x, weights, ids, *experts, activation=activation
                                ).astype(x.dtype)
    return _sharded(mesh, axes["expert"], axes["expert_mlp"], x, weights, ids, experts,
                    activation)

  return experts_fn


def _sharded(mesh, ep_axis: str | None, tp_axis: str | None, x: jax.Array,
             weights: jax.Array, ids: jax.Array, experts: tuple[jax.Array, ...],
             activation) -> jax.Array:
  """`moe_experts` as a shard_map: experts over `ep_axis`, their columns over `tp_axis`.

  Tokens and routing are replicated; each device's output is a partial sum
  (other experts' pairs and other columns are zero there), psum'd once.
  `experts`: (we_gate, we_up, we_down[, be_gate, be_up]).
  """
  gate_up = _spec(experts[0], ep_axis, None, tp_axis, mesh)
  down = _spec(experts[2], ep_axis, tp_axis, None, mesh)
  biases = (P(ep_axis, tp_axis),) * (len(experts) - 3)  # [E, M] like the gate columns
  axes = tuple(a for a in (ep_axis, tp_axis) if a)

  def local(x, weights, ids, *experts):
    first = jax.lax.axis_index(ep_axis) * experts[0].shape[0] if ep_axis else 0
    out = layers.moe_experts(x, weights, ids, *experts, first_expert=first,
                             activation=activation)
    return jax.lax.psum(out, axes)

  out = jax.shard_map(local, mesh=mesh,
                      in_specs=(P(), P(), P(), gate_up, gate_up, down, *biases),
                      out_specs=P())(x, weights, ids, *experts)
  return out.astype(x.dtype)


def _spec(w, ep_axis: str | None, in_axis: str | None, out_axis: str | None, mesh):
  """Spec of an expert weight [E, In, Out]: a PartitionSpec, or a quantized weight's
  specs, which must split In exactly as asked (whole groups per device)."""
  if not is_quantized(w):
    return P(ep_axis, in_axis, out_axis)
  spec = rules.weight_spec(w, (ep_axis,), in_axis, out_axis, axis_size(mesh, in_axis))
  if in_axis is not None and spec.q[-1] is None:
    raise ValueError(f"expert columns per tp shard ({w.in_features // axis_size(mesh, in_axis)}) "
                     f"must be a multiple of the quantization group ({w.group_size}); use a "
                     "smaller group or another tp")
  return spec
