"""Weights made ready for a `ModelRunner`: `prepare_weights` -> `PreparedWeights`.

Loaders (checkpoints/) return params as stored; the runner's programs take
them in the form the engine config asks for. `prepare_weights(params,
model_cfg, engine_cfg, mesh=, draft=)` makes that form on the host, before
anything reaches a device, in this order:
  1. `check_supported` refuses what the runner cannot serve: a draft model
     without speculative_method="draft" (or the method without one), a draft
     model on a mesh, LoRA adapters with pipeline stages;
  2. the model config is resolved for `max_model_len`
     (`ModelConfig.for_max_model_len`: LongRoPE's factor set); on a mesh
     (tp*ep*dp*pp > 1, or one given), the params are adapted to its
     `sharding.Placement` (KV heads repeated for tp, layers padded for pp
     stages) and the config with them;
  3. `quantization` quantizes them (checkpoints/quantizers.py);
  4. on one device only (a mesh places the params as loaded): the dense copies
     of quantized weights (`quantized_dense_copy`), the native kernel's
     activation bits (`cpu_activation_bits`) and, where its integer tiles run on
     AVX-512 VNNI, its column-tiled layout (`cpu_weight_tiles`),
     serving/models/quantized.py;
  5. unrolled layers (`unroll_layers`, the CPU default) are unstacked, except
     across pipeline stages, which split the stacked layers;
  6. the draft model: its vocabulary checked against the target's, its layers
     unstacked like the target's.
`PreparedWeights` holds the result with the resolved dtypes and the model
config the programs compile for. Its `place()` / `place_draft()` put the params
on the device(s); the runner calls them, so that it sizes the KV cache from the
memory the target's weights leave (`capacity_pages`) before the draft's weights
go on the device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

import kernels_cpu
import sharding
from checkpoints.quantizers import quantize_params
from serving.config import EngineConfig
from serving.models import causal_lm
from serving.models.model_config import ModelConfig
from serving.models.quantized import (
  is_quantized,
  tile_for_native,
  with_activation_bits,
  with_full_copies,
)
from serving.runner.draft_model import check_vocabulary
from serving.runner.executable_store import enable_jax_cache

Params = dict[str, Any]


def resolve_dtypes(engine_cfg: EngineConfig, platform: str) -> tuple[str, str]:
  """(compute dtype, kv dtype) names after resolving "auto"."""
  dtype = engine_cfg.model.dtype
  if dtype == "auto":
    dtype = "float32" if platform == "cpu" else "bfloat16"
  kv = engine_cfg.cache.kv_cache_dtype
  if kv == "auto":
    kv = dtype
  return dtype, kv


def resolve_weight_dtype(engine_cfg: EngineConfig, compute_dtype: str) -> str:
  """Dtype of the unquantized weights: `weight_dtype`, or the compute dtype for "auto".

  Matmuls cast activations to the weight dtype and accumulate in float32
  (`layers.linear`), so bfloat16 weights under float32 compute read half the
  bytes and take XLA:CPU's faster bf16 dot, while norms, attention and the
  residual stream stay float32.
  """
  return compute_dtype if engine_cfg.model.weight_dtype == "auto" else engine_cfg.model.weight_dtype


def put_params(params: Params, dtype) -> Params:
  """Device-puts a params tree: float leaves as `dtype`, quantized leaves as stored."""
  def put(a):
    if is_quantized(a):
      return jax.tree.map(jnp.asarray, a)
    return jnp.asarray(a, dtype=dtype)

  return jax.tree.map(put, params, is_leaf=is_quantized)


@dataclasses.dataclass(frozen=True, eq=False)
class DraftWeights:
  """Speculative decoding's draft model, prepared like the target (layers unstacked alike)."""

  params: Params
  config: ModelConfig


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedWeights:
  """What `prepare_weights` hands a `ModelRunner` (module doc)."""

  params: Params  # final layout; host arrays (or on the mesh already: a sharded restore)
  model_cfg: ModelConfig  # adapted to the placement: what the programs compile for
  source_cfg: ModelConfig  # as loaded, before tp repeats KV heads: what adapters must fit
  engine_cfg: EngineConfig
  placement: sharding.Placement | None  # None: one device
  dtype: str  # compute dtype
  kv_dtype: str
  weight_dtype: str  # the unquantized weights' dtype
  draft: DraftWeights | None = None

  @property
  def mesh(self) -> jax.sharding.Mesh | None:
    return self.placement.mesh if self.placement is not None else None

  def place(self) -> Params:
    """The params on the device(s): float leaves as `weight_dtype`, quantized ones as
    stored; on a mesh each device receives only its slices (sharding/placement.py)."""
    weight_dtype = jnp.dtype(self.weight_dtype)
    if self.placement is not None:
      return self.placement.place_params(self.params, weight_dtype)
    return put_params(self.params, weight_dtype)

  def place_draft(self) -> Params:
    """The draft model's params on the (one) device, as `place()` puts the target's."""
    if self.draft is None:
      raise ValueError("no draft model was prepared (speculative_method is not 'draft')")
    return put_params(self.draft.params, jnp.dtype(self.weight_dtype))


def check_supported(engine_cfg: EngineConfig, placement: sharding.Placement | None,
                    has_draft: bool) -> None:
  """Refuses, before anything is transformed or placed, what the runner cannot serve."""
  if has_draft != (engine_cfg.speculative.speculative_method == "draft"):
    raise ValueError("a draft model is needed exactly when speculative_method='draft'")
  if placement is not None and has_draft:
    raise NotImplementedError("a draft model on a mesh (tp/ep/dp > 1) is not supported yet; "
                              "use speculative_method='ngram' or 'suffix' there")
  if placement is not None and placement.stages > 1 and engine_cfg.lora.max_loras:
    raise NotImplementedError("LoRA adapters with pipeline stages (pp > 1) are not "
                              "supported yet; use tp")


def unrolled(engine_cfg: EngineConfig, platform: str) -> bool:
  """Whether the layers run unrolled: `unroll_layers`, by default on CPU only."""
  unroll = engine_cfg.model.unroll_layers
  return unroll if unroll is not None else platform == "cpu"


def prepare_weights(params: Params, model_cfg: ModelConfig, engine_cfg: EngineConfig, *,
                    mesh: jax.sharding.Mesh | None = None,
                    draft: tuple[Params, ModelConfig] | None = None) -> PreparedWeights:
  """Loaded params (and the draft model's (params, config)) -> `PreparedWeights`.

  `mesh`: where the runner will run; None takes `sharding.mesh_for(engine_cfg.parallel)`,
  itself None (one device) when tp*ep*dp*pp == 1. Steps: module doc.
  """
  mesh = mesh if mesh is not None else sharding.mesh_for(engine_cfg.parallel)
  model_cfg = model_cfg.for_max_model_len(engine_cfg.scheduler.max_model_len)
  placement = sharding.Placement(mesh, model_cfg) if mesh is not None else None
  check_supported(engine_cfg, placement, draft is not None)
  if model_cfg.mla is not None and engine_cfg.lora.max_loras:
    raise ValueError("LoRA adapters on a multi-head latent attention (DeepSeek) model are not "
                     "supported; max_loras must be 0")
  served_cfg = model_cfg
  if placement is not None:
    compilation = engine_cfg.compilation
    enable_jax_cache(compilation.compilation_cache, compilation.compilation_cache_dir)
    params, served_cfg = placement.adapt(params), placement.model_cfg
  platform = jax.default_backend()
  dtype, kv_dtype = resolve_dtypes(engine_cfg, platform)
  weight_dtype = resolve_weight_dtype(engine_cfg, dtype)
  unroll = unrolled(engine_cfg, platform)
  params = _transform(params, engine_cfg, jnp.dtype(weight_dtype), one_device=placement is None,
                      unstack=unroll and (placement is None or placement.stages == 1))
  draft_weights = None
  if draft is not None:
    draft_params, draft_cfg = draft
    draft_cfg = draft_cfg.for_max_model_len(engine_cfg.scheduler.max_model_len)
    check_vocabulary(draft_cfg.vocab_size, served_cfg.vocab_size)
    draft_weights = DraftWeights(causal_lm.unstack_layers(draft_params) if unroll else draft_params,
                                 draft_cfg)
  return PreparedWeights(params=params, model_cfg=served_cfg, source_cfg=model_cfg,
                         engine_cfg=engine_cfg, placement=placement, dtype=dtype,
                         kv_dtype=kv_dtype, weight_dtype=weight_dtype, draft=draft_weights)


def _transform(params: Params, engine_cfg: EngineConfig, weight_dtype, *, one_device: bool,
               unstack: bool) -> Params:
  """Steps 3-5 of the module doc, on the host."""
  if engine_cfg.model.quantization not in (None, "auto"):  # auto: kept as loaded
    params = quantize_params(params, engine_cfg.model.quantization)
  if engine_cfg.cpu.quantized_dense_copy and one_device:  # a mesh splits no copy
    params = with_full_copies(params, weight_dtype)
  # The native kernel runs on one device only: a mesh places the params as loaded.
  if engine_cfg.cpu.cpu_activation_bits != 32 and one_device:
    params = with_activation_bits(params, engine_cfg.cpu.cpu_activation_bits)
    if (engine_cfg.cpu.cpu_weight_tiles and jax.default_backend() == "cpu"
        and kernels_cpu.matvec.tiles()):
      params = tile_for_native(params)
  if unstack:
    params = causal_lm.unstack_layers(params)
  return params
