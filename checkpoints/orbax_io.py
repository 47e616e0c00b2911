"""Our own checkpoint format: params in orbax, config and tokenizer beside them.

Layout of a directory written by `save_orbax`:

  MARKER_FILE (xlaserve_checkpoint.json)  format tag, version, ModelConfig, dtype
  params/                                  orbax PyTree checkpoint (OCDBT, no zstd),
                                           restored with `ocp.StandardCheckpointer`
  tokenizer/                               tokenizer.json + tokenizer_config.json

Weight-quantized params (`serving.models.quantized.QuantizedWeight` leaves) are saved
as plain `{q, scale[, offset]}` dicts with their kinds and group sizes in the
marker's "quantization" entry (checkpoints/quantize.py), and come back as
QuantizedWeights. Loading needs no dequantization or transposes, and `load_orbax` can restore
straight onto devices: pass `abstract_params` (a tree of
`jax.ShapeDtypeStruct` with shardings) or just `shardings` (a tree of
`jax.sharding.Sharding` matching the params).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from checkpoints.layout import LoadedModel, Params, resolve_dtype
from checkpoints.quantize import from_saveable, to_saveable
from checkpoints.tokenizer import Tokenizer
from serving.models.model_config import ROPE_SCALINGS, MlaConfig, ModelConfig
from serving.models.quantized import is_quantized

MARKER_FILE = "xlaserve_checkpoint.json"
FORMAT = "xlaserve-orbax"
VERSION = 1


def is_orbax_dir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, MARKER_FILE))


def save_orbax(loaded: LoadedModel, out_dir: str) -> str:
  """Writes `loaded` to `out_dir` (created; an existing checkpoint is replaced)."""
  out_dir = os.path.abspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  marker = os.path.join(out_dir, MARKER_FILE)
  if os.path.exists(marker):
    os.remove(marker)  # an interrupted save must not look complete
  params, quant_spec = to_saveable(loaded.params)  # quantized leaves -> plain dicts
  leaves = [x for x in _leaves(params) if str(x.dtype) in ("float32", "bfloat16")]
  # The PyTree handler under StandardCheckpointer, with zstd off: on a 135M
  # model this saves ~4x and restores ~2x faster (decompression is CPU-bound).
  import orbax.checkpoint as ocp  # here, not at the top: a GGUF start never pays its import

  handler = ocp.PyTreeCheckpointHandler(use_compression=False)
  with ocp.Checkpointer(handler) as ckptr:
    ckptr.save(os.path.join(out_dir, "params"), args=ocp.args.PyTreeSave(params),
               force=True)
  if loaded.tokenizer is not None:
    loaded.tokenizer.save(os.path.join(out_dir, "tokenizer"))
  meta = {"format": FORMAT, "version": VERSION, "config": config_to_dict(loaded.config),
          "dtype": str(leaves[0].dtype) if leaves else "float32", "source": loaded.source}
  if quant_spec:
    meta["quantization"] = quant_spec  # {leaf path: {kind, group_size}}
  with open(marker, "w", encoding="utf-8") as f:
    json.dump(meta, f, indent=1)
  return out_dir


def load_orbax(path: str, dtype: Any = None, abstract_params: Params | None = None,
               shardings: Params | None = None) -> LoadedModel:
  """Restores a `save_orbax` directory (numpy params unless given shardings)."""
  path = os.path.abspath(path)
  with open(os.path.join(path, MARKER_FILE), encoding="utf-8") as f:
    meta = json.load(f)
  if meta.get("format") != FORMAT or meta.get("version") != VERSION:
    raise ValueError(f"unsupported checkpoint format {meta.get('format')!r} version "
                     f"{meta.get('version')!r} in {path} (expected {FORMAT!r} v{VERSION})")
  config = config_from_dict(meta["config"])
  params_dir = os.path.join(path, "params")
  import orbax.checkpoint as ocp  # here, not at the top: a GGUF start never pays its import

  with ocp.StandardCheckpointer() as ckptr:
    if abstract_params is None and shardings is not None:
      abstract_params = _abstract_from_metadata(ckptr.metadata(params_dir), shardings, dtype)
    params = ckptr.restore(params_dir, abstract_params)
  params = from_saveable(params, meta.get("quantization") or {})
  if abstract_params is None and dtype is not None:
    dt = resolve_dtype(dtype)
    params = _tree_map(lambda x: x if is_quantized(x) or x.dtype == dt else x.astype(dt), params)
  tok_dir = os.path.join(path, "tokenizer")
  tokenizer = (Tokenizer.from_hf_dir(tok_dir, extra_eos_ids=config.eos_token_ids)
               if os.path.isdir(tok_dir) else None)
  return LoadedModel(config=config, params=params, tokenizer=tokenizer, source=path)


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
  """A ModelConfig as JSON-able data (the rope scaling tagged with its `rope_type`)."""
  d = dataclasses.asdict(cfg)
  d["eos_token_ids"] = list(cfg.eos_token_ids)
  if cfg.rope_scaling is not None:
    d["rope_scaling"] = {"rope_type": cfg.rope_scaling.rope_type, **d["rope_scaling"]}
  return d


def config_from_dict(d: dict[str, Any]) -> ModelConfig:
  """`config_to_dict`'s inverse (a rope scaling without `rope_type` is llama3's)."""
  d = dict(d)
  if d.get("rope_scaling"):
    rs = dict(d["rope_scaling"])
    cls = ROPE_SCALINGS[rs.pop("rope_type", "llama3")]
    d["rope_scaling"] = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in rs.items()})
  d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
  d = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}  # JSON lists
  if d.get("mla"):  # DeepSeek's latent attention settings
    d["mla"] = MlaConfig(**d["mla"])
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  return ModelConfig(**{k: v for k, v in d.items() if k in known})


def _abstract_from_metadata(metadata: Any, shardings: Params, dtype: Any) -> Params:
  import jax  # noqa: PLC0415  (only needed for device restores)

  tree = getattr(getattr(metadata, "item_metadata", metadata), "tree", metadata)
  dt = None if dtype is None else resolve_dtype(dtype)
  return jax.tree.map(
      lambda m, s: jax.ShapeDtypeStruct(m.shape, dt or m.dtype, sharding=s), tree, shardings,
      is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))


def _leaves(tree: Params) -> list[Any]:
  out = []
  for v in (tree.values() if isinstance(tree, dict) else tree):
    out.extend(_leaves(v) if isinstance(v, (dict, list, tuple)) else [v])
  return out


def _tree_map(fn, tree: Params) -> Params:
  """fn over the arrays of nested dicts / lists, stopping at quantized leaves."""
  if isinstance(tree, (list, tuple)):
    return [_tree_map(fn, v) for v in tree]
  if isinstance(tree, dict):
    return {k: _tree_map(fn, v) for k, v in tree.items()}
  return fn(tree)
