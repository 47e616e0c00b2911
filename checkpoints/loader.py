"""The loaders: a model name -> `LoadedModel` (see the package doc for the formats)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from checkpoints import gguf as gguf_io
from checkpoints import hf, hf_mxfp4, hf_quantized, presets, quantize
from checkpoints.layout import LoadedModel, merge_eos, resolve_dtype
from checkpoints.orbax_io import MARKER_FILE, is_orbax_dir, load_orbax
from checkpoints.tokenizer import Tokenizer
from serving.models.model_config import ModelConfig
from serving.models.quantized import METHODS, is_quantized


def resolve_model_path(model: str) -> str:
  """A preset name -> its checkpoint path; other strings are returned as paths."""
  if presets.get_preset(model) is not None and not os.path.exists(model):
    return presets.resolve_preset(model)
  return model


def checkpoint_format(model: str, quantization: str | None = None) -> str:
  """How `model` (a preset name or a path) loads: "orbax", "hf" or "gguf", found without
  reading any weights (a HF directory's config.json is read: its architecture must be
  supported). With `quantization`, also that the method applies to this format. Raises
  the FileNotFoundError / ValueError that loading would."""
  if quantization is not None and quantization not in METHODS:
    raise ValueError(f"unsupported quantization {quantization!r}; supported: {METHODS}")
  path = resolve_model_path(model)
  if quantization == "gguf" and not (os.path.isfile(path) and path.endswith(".gguf")):
    raise ValueError(f"quantization='gguf' serves a GGUF file's blocks as stored; {model!r} "
                     "is not a .gguf file (use int8, int4 or fp8)")
  if os.path.isdir(path):
    if is_orbax_dir(path):
      fmt = "orbax"
    elif hf.is_hf_dir(path):
      hf.load_hf_config(path)  # an unsupported architecture raises here
      fmt = "hf"
    else:
      raise ValueError(f"unsupported model directory {path}: no config.json (HF) and no "
                       f"{MARKER_FILE} (orbax)")
  elif os.path.isfile(path):
    if not path.endswith(".gguf"):
      raise ValueError(f"unsupported checkpoint file {path}: expected a .gguf file")
    fmt = "gguf"
  else:
    raise FileNotFoundError(f"{model!r} is not a preset ({presets.list_presets()}), "
                            "a directory or a .gguf file")
  return fmt


def load_checkpoint(model: str, dtype: Any = np.float32) -> LoadedModel:
  """Loads a preset, orbax dir, HF dir or GGUF file (see module docstring).

  `dtype`: float32 or bfloat16 (numpy/ml_dtypes type or name), or "auto": the
  stored dtype for orbax, bfloat16 for a HF dir whose config says so, else
  float32 (GGUF dequantizes to float32).
  """
  auto = isinstance(dtype, str) and dtype == "auto"
  if not auto:
    resolve_dtype(dtype)
  fmt, path = checkpoint_format(model), resolve_model_path(model)
  if fmt == "orbax":
    return load_orbax(path, dtype=None if auto else dtype)
  if fmt == "hf":
    if auto:
      raw, _ = hf.load_hf_config(path)
      dtype = "bfloat16" if "bfloat16" in (raw.get("dtype"), raw.get("torch_dtype")) else "float32"
    return load_hf_dir(path, dtype)
  return load_gguf(path, np.float32 if auto else dtype)


def load_quantized(model: str, method: str) -> LoadedModel:
  """Loads `model` for serving with weight quantization `method`: GGUF blocks of the
  matching type stay as stored (checkpoints/quantize.py), anything else loads as usual
  and is quantized by the runner."""
  if checkpoint_format(model, method) == "gguf":
    return load_gguf_quantized(resolve_model_path(model), method)
  return load_checkpoint(model)


def load_hf_dir(path: str, dtype: Any = np.float32) -> LoadedModel:
  """A Hugging Face directory: config.json, safetensors, tokenizer files. With a
  `quantization_config` (GPTQ, AWQ, FP8) its quantized linears load as QuantizedWeights
  holding the stored codes (checkpoints/hf_quantized.py); GPT-OSS's MXFP4 experts
  likewise (checkpoints/hf_mxfp4.py)."""
  raw, config = hf.load_hf_config(path)
  if raw.get("quantization_config") and hf_mxfp4.is_mxfp4(raw["quantization_config"]):
    params = hf_mxfp4.load_hf_mxfp4_params(path, config, dtype)
  elif raw.get("quantization_config"):
    params = hf_quantized.load_hf_quantized_params(path, config, raw["quantization_config"],
                                                   dtype)
  else:
    params = hf.load_hf_params(path, config, dtype)
  tokenizer = None
  if os.path.exists(os.path.join(path, "tokenizer.json")):
    tokenizer = Tokenizer.from_hf_dir(path, extra_eos_ids=config.eos_token_ids)
  return LoadedModel(config=merge_eos(config, tokenizer), params=params, tokenizer=tokenizer,
                     source=os.path.abspath(path))


def load_gguf(path: str, dtype: Any = np.float32, reader: Any = None,
              skip_tensors: frozenset[str] = frozenset()) -> LoadedModel:
  """A GGUF file: metadata config, dequantized params, embedded tokenizer (`reader`: the
  file already opened with `gguf_io.read_gguf`; `skip_tensors`: names left undecoded,
  whose params the caller replaces)."""
  reader = reader if reader is not None else gguf_io.read_gguf(path)
  config = ModelConfig.from_hf_config(gguf_io.gguf_hf_config(reader))
  params = gguf_io.load_gguf_params(reader, config, dtype, skip_tensors)
  tokenizer = Tokenizer.from_gguf_metadata(reader, extra_eos_ids=config.eos_token_ids)
  return LoadedModel(config=merge_eos(config, tokenizer), params=params, tokenizer=tokenizer,
                     source=os.path.abspath(path))


def load_gguf_quantized(path: str, method: str) -> LoadedModel:
  """A GGUF file with the blocks of `quantize.KEEP_TYPES[method]` kept (module doc, step 2).

  Layers whose kept weights differ in layout (a Q4_K_M file mixes Q4_K and
  Q6_K across layers) are returned as a list of per-layer dicts, which the
  forward runs unrolled.
  """
  reader = gguf_io.read_gguf(path)
  keep = quantize.KEEP_TYPES[method]
  # The head stays 8-bit under int8 and int4: only a Q8_0 table is kept there.
  head_keep = keep if method == "gguf" else (
      {gguf_io.Q.Q8_0} if method in ("int8", "int4") else set())
  types = {t.name: t.tensor_type for t in reader.tensors}
  cfg = ModelConfig.from_hf_config(gguf_io.gguf_hf_config(reader))
  kept_names = _kept_tensor_names(cfg, method, keep, head_keep, types)
  loaded = load_gguf(path, reader=reader, skip_tensors=kept_names)  # the others dequantized
  cfg, params = loaded.config, loaded.params
  def kept(name: str, rows: slice | None = None):
    return quantize.gguf_quantized_weight(gguf_io.raw_tensor(reader, name, rows=rows))

  stacked = dict(params["layers"])
  per_layer: dict[str, list] = {}
  for key in quantize.kept_keys(cfg):
    slots = [gguf_io.gguf_tensor_slot(cfg, key, i) for i in range(cfg.num_layers)]
    if not any(types.get(n) in keep for n, _ in slots):
      continue
    weights = [kept(n, rows) if types.get(n) in keep else stacked[key][i]
               for i, (n, rows) in enumerate(slots)]
    together = (quantize.stack_blocks(weights)
                if all(is_quantized(w) for w in weights) else None)
    if together is not None:
      stacked[key] = together
    else:
      per_layer[key] = weights
  if per_layer:
    layers = [{k: (per_layer[k][i] if k in per_layer else v[i]) for k, v in stacked.items()}
              for i in range(cfg.num_layers)]
  else:
    layers = stacked
  params = {**params, "layers": layers}
  for key in ("embed", "lm_head"):
    name = gguf_io.gguf_tensor_name(key)
    if key in params and name in kept_names:
      params[key] = kept(name)
  return LoadedModel(config=cfg, params=params, tokenizer=loaded.tokenizer, source=loaded.source)


def _kept_tensor_names(cfg: ModelConfig, method: str, keep: set, head_keep: set,
                       types: dict[str, Any]) -> frozenset[str]:
  """The GGUF tensors whose blocks `load_gguf_quantized` keeps (so never dequantized)."""
  names = {n for key in quantize.kept_keys(cfg)
           for n, _ in (gguf_io.gguf_tensor_slot(cfg, key, i) for i in range(cfg.num_layers))
           if types.get(n) in keep}
  for key in ("embed", "lm_head"):
    name = gguf_io.gguf_tensor_name(key)
    is_head = key == "lm_head" or cfg.tie_word_embeddings  # an untied table is no matmul
    if types.get(name) in head_keep and (is_head or method == "gguf"):
      names.add(name)
  return frozenset(names)
