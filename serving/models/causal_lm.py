"""Models as flax nnx modules, and the pure entry points the jitted steps call.

Each family (serving/models/<family>.py) defines a layer module and a
`Model(CausalLM)` whose `layer_class` it is. Modules are built abstract from
the `ModelConfig` (every `nnx.Param` holds a `jax.ShapeDtypeStruct`), so
their graph definition — structure plus config — is static and cached per
config. The weights live outside the module as the pure state `nnx.split`
yields (`state_of`): the params dict `{"embed", "final_norm", "lm_head"?,
"layers"}`, whose leaves are arrays or quantized weights
(serving/models/quantized.py). Loaders, placement, sharding rules,
quantization and LoRA all work on that dict; a step binds it to the module
at trace time (`nnx.merge`), so the compiled program is what a plain
function over the dict would give.

`layers` is a list of per-layer dicts (unrolled) or one dict of stacked
`[L', ...]` weights (a `lax.scan` over one bound layer; fast to compile).
Layer ids are global (a Python int when unrolled outside a pipeline, so
per-layer settings stay static; traced otherwise): a pipeline stage passes
its own layers, its first layer's id and its own slice of the KV cache, and
its attention callback subtracts that id for the pages. Attention is a callback
`attend(layer, q[T,N,H], k[T,K,H], v[T,K,H], kv, **extras) -> (out[T,N,H], kv)`
that owns the KV cache write and the paged read, so the same forward serves
prefill chunks and decode batches; `extras` carries a layer's own attention
weights (sinks).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from serving.models import layers as L
from serving.models import registry
from serving.models.lora import LoraBatch
from serving.models.model_config import ModelConfig

Params = dict[str, Any]


def param(*shape: int) -> nnx.Param:
  """An abstract parameter of `shape` (its value comes from the params dict)."""
  return nnx.Param(jax.ShapeDtypeStruct(shape, jnp.float32))


def value(p: nnx.Param | None) -> Any:
  """A bound parameter's array (or quantized weight); None for an absent one."""
  return None if p is None else p.get_value()


class DecoderLayer(nnx.Module):
  """One decoder layer; families subclass it. Its `nnx.Param` attributes are the
  per-layer keys of the params dict (docs/structure.md)."""

  def __init__(self, cfg: ModelConfig):
    self.cfg = cfg

  def __call__(self, h: jax.Array, positions: jax.Array, rope: Any, layer: jax.Array, kv: Any,
               attend: L.AttendFn, *, experts_fn: L.ExpertsFn | None = None,
               lora: L.LayerLora = None) -> tuple[jax.Array, Any]:
    """h [T, D] at `positions` [T] -> (h, kv); `rope` is `CausalLM.rope()`."""
    raise NotImplementedError


class CausalLM(nnx.Module):
  """The embedding, final norm and head of a decoder-only model; families set
  `layer_class` and override what differs (embedding scale, norm, logit cap)."""

  layer_class: type[DecoderLayer] = DecoderLayer

  def __init__(self, cfg: ModelConfig):
    self.cfg = cfg
    self.embed = param(cfg.vocab_size, cfg.hidden_size)
    self.final_norm = param(cfg.hidden_size)
    self.lm_head = None if cfg.tie_word_embeddings else param(cfg.hidden_size, cfg.vocab_size)

  def embed_tokens(self, tokens: jax.Array, act_dtype) -> jax.Array:
    """Embedding rows [T, D] in the activation dtype."""
    return L.embed_tokens(value(self.embed), tokens).astype(act_dtype)

  def norm(self, x: jax.Array) -> jax.Array:
    """The final norm over the last layer's output."""
    return L.rms_norm(x, value(self.final_norm), self.cfg.rms_norm_eps)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden [B, D] (final-normed) -> logits [B, V] in float32."""
    if self.lm_head is None:
      return L.tied_head_logits(value(self.embed), hidden)
    return L.linear(hidden, value(self.lm_head)).astype(jnp.float32)

  def rope(self) -> Any:
    """The rotary tables the layers take (a constant pytree): inverse frequencies."""
    return jnp.asarray(L.rope_inv_freq(self.cfg))


def model_class(cfg: ModelConfig) -> type[CausalLM]:
  return registry.family(cfg.family).module.Model


@functools.lru_cache(maxsize=64)
def _graphs(cfg: ModelConfig) -> tuple[Any, Any]:
  """The static graph definitions of cfg's model (without layers) and of one layer."""
  cls = model_class(cfg)
  return nnx.graphdef(cls(cfg)), nnx.graphdef(cls.layer_class(cfg))


def _state(tree: dict[str, Any]) -> nnx.State:
  return nnx.State({k: nnx.Param(v) for k, v in tree.items()})


def bind(params: Params, cfg: ModelConfig) -> CausalLM:
  """The model module with the top-level weights of `params` (not the layers)."""
  top = {k: v for k, v in params.items() if k != "layers"}
  return nnx.merge(_graphs(cfg)[0], _state(top))


def bind_layer(lp: dict[str, Any], cfg: ModelConfig) -> DecoderLayer:
  """One decoder layer module with the weights `lp` (one layer's dict)."""
  return nnx.merge(_graphs(cfg)[1], _state(lp))


def state_of(module: nnx.Module) -> Params:
  """The pure params dict of a module (`nnx.split`'s state as plain values)."""
  return nnx.to_pure_dict(nnx.state(module))


def param_shapes(cfg: ModelConfig) -> Params:
  """Shape of every params leaf for `cfg`: the model's, plus a leading L on layers."""
  cls = model_class(cfg)
  shapes = jax.tree.map(lambda s: s.shape, state_of(cls(cfg)))
  layer = jax.tree.map(lambda s: (cfg.num_layers, *s.shape), state_of(cls.layer_class(cfg)))
  return {**shapes, "layers": layer}


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            kv: Any, attend: L.AttendFn, *, act_dtype=jnp.float32,
            experts_fn: L.ExpertsFn | None = None,
            lora: LoraBatch | None = None) -> tuple[jax.Array, Any]:
  """Runs the model. tokens/positions [T] -> (final-normed hidden [T, D], kv).

  `lora` (serving/models/lora.py): resident adapters, laid out like `layers`,
  and each token row's slot.
  """
  model = bind(params, cfg)
  x = model.embed_tokens(tokens, act_dtype)
  x, kv = run_layers(params["layers"], cfg, x, positions, kv, attend, experts_fn=experts_fn,
                     lora=lora)
  return model.norm(x), kv


def run_layers(layers: Any, cfg: ModelConfig, x: jax.Array, positions: jax.Array, kv: Any,
               attend: L.AttendFn, *, experts_fn: L.ExpertsFn | None = None,
               lora: LoraBatch | None = None,
               layer_offset: int | jax.Array = 0) -> tuple[jax.Array, Any]:
  """The decoder layers `layers` (see module doc) over h [T, D] -> (h, kv).

  Layer ids (what the modules and `attend` see) are global: `layer_offset` plus
  the index within `layers` (a pipeline stage's first layer id; 0 otherwise).
  """
  rope = model_class(cfg)(cfg).rope()

  def layer_fn(carry, xs):
    h, kv = carry
    lp, layer, lora_lp = xs
    layer_lora = None if lora is None else (lora_lp, lora.rows, lora.method)
    out = bind_layer(lp, cfg)(h, positions, rope, layer, kv, attend, experts_fn=experts_fn,
                              lora=layer_lora)
    return out, None

  if isinstance(layers, (list, tuple)):
    # Unrolled over per-layer arrays: fastest on XLA:CPU (no per-layer weight copies).
    for i, lp in enumerate(layers):
      lora_lp = None if lora is None else lora.weights[i]
      (x, kv), _ = layer_fn((x, kv), (lp, layer_offset + i, lora_lp))
    return x, kv
  ids = layer_offset + jnp.arange(jax.tree.leaves(layers)[0].shape[0], dtype=jnp.int32)
  lora_layers = None if lora is None else lora.weights
  (x, kv), _ = jax.lax.scan(layer_fn, (x, kv), (layers, ids, lora_layers))
  return x, kv


def embed_tokens(params: Params, cfg: ModelConfig, tokens: jax.Array, act_dtype) -> jax.Array:
  """The model's input embedding of `tokens` [T] -> [T, D] in `act_dtype`."""
  return bind(params, cfg).embed_tokens(tokens, act_dtype)


def final_norm(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
  return bind(params, cfg).norm(x)


def logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
  """hidden [B, D] -> logits [B, V] in float32."""
  return bind(params, cfg).logits(hidden)


def unstack_layers(params: Params) -> Params:
  """Stacked `layers` {name: [L, ...]} -> a list of per-layer dicts (unrolled forward)."""
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):  # already per layer (e.g. GGUF layers of mixed types)
    return params
  n = jax.tree.leaves(layers)[0].shape[0]
  return {**params, "layers": [{k: v[i] for k, v in layers.items()} for i in range(n)]}
