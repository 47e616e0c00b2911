"""Checkpoint loading: one entry point for every format the engine serves.

`load_checkpoint(model)` accepts
  1. a preset name from configs/ (e.g. `smollm2-135m-instruct`), resolved to
     the file its pip package ships (`checkpoints.presets`);
  2. an orbax directory written by `save_orbax` (it has a marker file);
  3. a Hugging Face directory (config.json + safetensors, `checkpoints.hf`);
  4. a `.gguf` file (`checkpoints.gguf`),
and returns a `LoadedModel(config, params, tokenizer, source)` with the params
pytree of docs/structure.md as numpy arrays (float32 or bfloat16).
Unsupported architectures, dtypes and quantization types raise ValueError
naming the unsupported thing.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from checkpoints import gguf as gguf_io
from checkpoints import hf, presets
from checkpoints.layout import LoadedModel, ParamsBuilder, resolve_dtype
from checkpoints.orbax_io import MARKER_FILE, is_orbax_dir, load_orbax, save_orbax
from checkpoints.tokenizer import Tokenizer
from serving.models.layout import param_shapes
from serving.models.model_config import ModelConfig

__all__ = ["LoadedModel", "ParamsBuilder", "load_checkpoint", "load_gguf", "load_hf_dir",
           "param_shapes", "resolve_model_path", "save_orbax", "load_orbax"]


def resolve_model_path(model: str) -> str:
  """A preset name -> its checkpoint path; other strings are returned as paths."""
  if presets.get_preset(model) is not None and not os.path.exists(model):
    return presets.resolve_preset(model)
  return model


def load_checkpoint(model: str, dtype: Any = np.float32) -> LoadedModel:
  """Loads a preset, orbax dir, HF dir or GGUF file (see module docstring).

  `dtype`: float32 or bfloat16 (numpy/ml_dtypes type or name), or "auto": the
  stored dtype for orbax, bfloat16 for a HF dir whose config says so, else
  float32 (GGUF dequantizes to float32).
  """
  auto = isinstance(dtype, str) and dtype == "auto"
  if not auto:
    resolve_dtype(dtype)
  path = resolve_model_path(model)
  if os.path.isdir(path) and is_orbax_dir(path):
    return load_orbax(path, dtype=None if auto else dtype)
  if os.path.isdir(path):
    if not hf.is_hf_dir(path):
      raise ValueError(f"unsupported model directory {path}: no config.json (HF) and no "
                       f"{MARKER_FILE} (orbax)")
    if auto:
      raw, _ = hf.load_hf_config(path)
      dtype = "bfloat16" if "bfloat16" in (raw.get("dtype"), raw.get("torch_dtype")) else "float32"
    return load_hf_dir(path, dtype)
  if os.path.isfile(path):
    if not path.endswith(".gguf"):
      raise ValueError(f"unsupported checkpoint file {path}: expected a .gguf file")
    return load_gguf(path, np.float32 if auto else dtype)
  raise FileNotFoundError(f"{model!r} is not a preset ({presets.list_presets()}), "
                          "a directory or a .gguf file")


def load_hf_dir(path: str, dtype: Any = np.float32) -> LoadedModel:
  """A Hugging Face directory: config.json, safetensors, tokenizer files."""
  _, config = hf.load_hf_config(path)
  params = hf.load_hf_params(path, config, dtype)
  tokenizer = None
  if os.path.exists(os.path.join(path, "tokenizer.json")):
    tokenizer = Tokenizer.from_hf_dir(path, extra_eos_ids=config.eos_token_ids)
  return LoadedModel(config=_merge_eos(config, tokenizer), params=params, tokenizer=tokenizer,
                     source=os.path.abspath(path))


def load_gguf(path: str, dtype: Any = np.float32) -> LoadedModel:
  """A GGUF file: metadata config, dequantized params, embedded tokenizer."""
  reader = gguf_io.read_gguf(path)
  config = ModelConfig.from_hf_config(gguf_io.gguf_hf_config(reader))
  params = gguf_io.load_gguf_params(reader, config, dtype)
  tokenizer = Tokenizer.from_gguf_metadata(reader, extra_eos_ids=config.eos_token_ids)
  return LoadedModel(config=_merge_eos(config, tokenizer), params=params, tokenizer=tokenizer,
                     source=os.path.abspath(path))


def _merge_eos(config: ModelConfig, tokenizer: Tokenizer | None) -> ModelConfig:
  """config.eos_token_ids followed by the tokenizer's other end-of-generation ids."""
  if tokenizer is None:
    return config
  extra = sorted(set(tokenizer.eos_token_ids) - set(config.eos_token_ids))
  return dataclasses.replace(config, eos_token_ids=(*config.eos_token_ids, *extra))
