"""Hugging Face safetensors read slice by slice, straight onto a mesh.

`checkpoints.load_checkpoint` streams a HF directory tensor by tensor into
full host arrays (host peak: the whole params plus one tensor), which the
runner then slices per device. `load_hf_sharded(path, mesh)` skips the
full host copy: every params leaf is a `jax.make_array_from_callback` whose
callback reads, for one device's index, only that block of each layer's
(and expert's) tensor with `safe_open(...).get_slice` and transposes it to
our `[in, out]` layout. Host memory stays at one device block; with several
processes each reads only the blocks of its own devices.

The shardings are those of an orbax restore (`checkpoint.restore_shardings`).
Names come from checkpoints/hf.py's tables; the fused transformers-5 expert
layout (`experts.gate_up_proj`) is not sliceable here: load it with
`load_checkpoint`. Phi-3's fused `qkv_proj` / `gate_up_proj` are: each part
is a row range (serving/models/phi3.py `fused_rows`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import jax
import numpy as np
from safetensors import safe_open

from checkpoints import hf
from checkpoints.layout import LoadedModel, merge_eos, resolve_dtype
from checkpoints.sharded import restore_shardings
from checkpoints.tokenizer import Tokenizer
from serving.models import phi3
from serving.models.layout import param_shapes
from serving.models.model_config import ModelConfig

Params = dict[str, Any]
_EXPERT_NAMES = {"we_gate": ("w1", "gate_proj"), "we_up": ("w3", "up_proj"),
                 "we_down": ("w2", "down_proj")}


def load_hf_sharded(path: str, mesh: jax.sharding.Mesh, dtype: Any = np.float32) -> LoadedModel:
  """A HF directory's params placed on `mesh`, each device reading only its block."""
  _, cfg = hf.load_hf_config(path)
  dt = resolve_dtype(dtype)
  with contextlib.ExitStack() as stack:
    reader = _Reader(path, cfg, stack)
    shardings, shapes = restore_shardings(cfg, mesh), param_shapes(cfg)
    params: Params = {}
    for key, shape in shapes.items():
      if key != "layers":
        params[key] = _leaf(shape, shardings[key], dt, reader.top_level(key))
    params["layers"] = {key: _leaf(shape, shardings["layers"][key], dt, reader.layer(key))
                        for key, shape in shapes["layers"].items()}
  tokenizer = None
  if os.path.exists(os.path.join(path, "tokenizer.json")):
    tokenizer = Tokenizer.from_hf_dir(path, extra_eos_ids=cfg.eos_token_ids)
  return LoadedModel(config=merge_eos(cfg, tokenizer), params=params, tokenizer=tokenizer,
                     source=os.path.abspath(path))


def _leaf(shape, sharding, dtype, read_block) -> jax.Array:
  def callback(index):
    index = tuple(slice(*s.indices(n)) for s, n in zip(index, shape, strict=True))
    return np.asarray(read_block(index), dtype)

  return jax.make_array_from_callback(tuple(shape), sharding, callback, dtype=dtype)


class _Reader:
  """Maps params leaves to HF tensor names and reads blocks of them."""

  def __init__(self, path: str, cfg: ModelConfig, stack: contextlib.ExitStack):
    self.cfg, self.files = cfg, {}
    for file in hf.safetensors_files(path):
      handle = stack.enter_context(safe_open(file, framework="np"))
      for name in handle.keys():  # noqa: SIM118  (safe_open handles are not iterable)
        self.files[name] = handle
    if any(".experts.gate_up_proj" in n for n in self.files):
      raise ValueError(f"{path}: fused expert tensors (experts.gate_up_proj) cannot be read "
                       "per device; use checkpoints.load_checkpoint")
    self.layer_names = {key: (suffix, transpose) for suffix, (key, transpose) in hf._LAYER.items()
                        if f"model.layers.0.{suffix}" in self.files}
    self.moe_prefix = ("block_sparse_moe" if "model.layers.0.block_sparse_moe.gate.weight"
                       in self.files else "mlp")
    # Phi-3: each part of a fused projection is a row range of it, so it reads per block too.
    self.fused_parts = {key: (suffix, phi3.fused_rows(cfg)[key])
                        for suffix, keys in hf._FUSED_DENSE.items()
                        if f"model.layers.0.{suffix}" in self.files for key in keys}

  def _block(self, name: str, transpose: bool, index: tuple[slice, ...]) -> np.ndarray:
    """Our [in, out] block `index` of HF tensor `name` (stored [out, in] when transposed)."""
    sl = self.files[name].get_slice(name)
    return sl[tuple(reversed(index))].T if transpose else sl[index]

  def top_level(self, key: str):
    name, transpose = next((n, t) for n, (k, t) in hf._TOP_LEVEL.items() if k == key)
    return lambda index: self._block(name, transpose, index)

  def layer(self, key: str):
    """read(index) for a stacked [L, ...] leaf (experts: [L, E, ...])."""

    def read(index):
      rows = []
      for layer in range(*index[0].indices(self.cfg.num_layers)):
        if key in _EXPERT_NAMES:
          experts = range(*index[1].indices(self.cfg.num_experts))
          rows.append(np.stack([self._block(self._expert_name(key, layer, e), True, index[2:])
                                for e in experts]))
        elif key in self.fused_parts:
          suffix, part = self.fused_parts[key]
          cols = slice(part.start + index[2].start, part.start + index[2].stop)
          rows.append(self._block(f"model.layers.{layer}.{suffix}", True, (index[1], cols)))
        else:
          suffix, transpose = self.layer_names[key]
          rows.append(self._block(f"model.layers.{layer}.{suffix}", transpose, index[1:]))
      return np.stack(rows)

    return read

  def _expert_name(self, key: str, layer: int, expert: int) -> str:
    mixtral, qwen = _EXPERT_NAMES[key]
    leaf = mixtral if self.moe_prefix == "block_sparse_moe" else qwen
    return f"model.layers.{layer}.{self.moe_prefix}.experts.{expert}.{leaf}.weight"
