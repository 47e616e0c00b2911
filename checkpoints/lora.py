"""PEFT LoRA adapters: read and validate `adapter_config.json` + `adapter_model.safetensors`.

`load_lora_adapter(path, model_cfg, max_rank=..., targets=...)` returns a
`LoraWeights` on the host: per layer and target module, `a [In, r]` and
`b [r, Out]` in float32 with the adapter's scaling (`lora_alpha / r`, or
`lora_alpha / sqrt(r)` with rsLoRA) already folded into `b`, in the params
layout of serving/models/layout.py (`x @ w`, HF module names mapped to ours;
Phi-3's fused `qkv_proj` / `gate_up_proj` adapters split into the parts'
slots, each with the shared A and its rows of B).

Everything an adapter could get wrong is refused with a `LoraError` that says
what: a missing or malformed config, a PEFT type other than LoRA, DoRA,
trained biases, `modules_to_save`, per-module rank or alpha patterns, a rank
above the server's `max_lora_rank`, modules the server has no slots for
(embeddings, the LM head, MoE experts), layers past the model's, shapes that
do not match the base model, non-float or non-finite tensors, and A without
B. The tensors are read with `safetensors` (no code runs from the file).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np
from safetensors import safe_open

from serving.models.model_config import ModelConfig

# HF module name -> params key (serving/models/layout.py).
HF_MODULES = {
    "self_attn.q_proj": "wq", "self_attn.k_proj": "wk", "self_attn.v_proj": "wv",
    "self_attn.o_proj": "wo", "mlp.gate_proj": "w_gate", "mlp.up_proj": "w_up",
    "mlp.down_proj": "w_down",
}
# Fused HF modules (Phi-3) -> the params keys their output rows split into, in order: one
# shared A, B's rows cut per key (exact: B A x stacks the parts' updates).
FUSED_MODULES = {"self_attn.qkv_proj": ("wq", "wk", "wv"), "mlp.gate_up_proj": ("w_gate", "w_up")}
_TENSOR_RE = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(.+)\.lora_([AB])"
                        r"(?:\.[^.]+)?\.weight$")
_CONFIG = "adapter_config.json"
_WEIGHTS = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20


class LoraError(ValueError):
  """An adapter that cannot be served (the message says why)."""


@dataclasses.dataclass
class LoraWeights:
  """A validated adapter on the host (see module doc)."""

  rank: int
  scaling: float
  layers: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]]  # layer -> key -> (a, b*scaling)

  @property
  def targets(self) -> tuple[str, ...]:
    return tuple(sorted({k for mods in self.layers.values() for k in mods}))

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes + b.nbytes for mods in self.layers.values() for a, b in mods.values())


def module_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
  """(In, Out) of every module an adapter may target, for `cfg`."""
  d, h = cfg.hidden_size, cfg.head_dim
  nh, kh = cfg.num_heads * h, cfg.num_kv_heads * h
  dims = {"wq": (d, nh), "wk": (d, kh), "wv": (d, kh), "wo": (nh, d)}
  if not cfg.is_moe:
    f = cfg.intermediate_size
    dims.update(w_gate=(d, f), w_up=(d, f), w_down=(f, d))
  return dims


def read_adapter_config(path: str) -> dict:
  file = os.path.join(path, _CONFIG)
  if not os.path.isfile(file):
    raise LoraError(f"{path}: no {_CONFIG} (a PEFT LoRA adapter directory is expected)")
  if os.path.getsize(file) > MAX_CONFIG_BYTES:
    raise LoraError(f"{file} is larger than {MAX_CONFIG_BYTES} bytes")
  try:
    with open(file, encoding="utf-8") as f:
      config = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise LoraError(f"{file}: not valid JSON ({e})") from e
  if not isinstance(config, dict):
    raise LoraError(f"{file}: expected a JSON object")
  return config


def adapter_scaling(config: dict, max_rank: int) -> tuple[int, float]:
  """(rank, scaling) from a PEFT config, refusing what the server does not serve."""
  def refuse(why: str):
    raise LoraError(f"{_CONFIG}: {why}")

  peft_type = config.get("peft_type", "LORA")
  if peft_type != "LORA":
    refuse(f"peft_type {peft_type!r} is not LORA")
  for key, allowed in (("use_dora", (False, None)), ("bias", ("none", None)),
                       ("fan_in_fan_out", (False, None)), ("modules_to_save", (None, [])),
                       ("rank_pattern", (None, {})), ("alpha_pattern", (None, {})),
                       ("layers_to_transform", (None,)), ("layers_pattern", (None, [], ""))):
    if config.get(key) not in allowed:
      refuse(f"{key}={config.get(key)!r} is not supported")
  r = config.get("r")
  if not isinstance(r, int) or isinstance(r, bool) or r < 1:
    refuse(f"r={r!r} must be a positive integer")
  if r > max_rank:
    refuse(f"rank {r} exceeds the server's max_lora_rank={max_rank}")
  alpha = config.get("lora_alpha", r)
  if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
    refuse(f"lora_alpha={alpha!r} must be a finite number")
  rslora = config.get("use_rslora", False)
  return r, float(alpha) / (math.sqrt(r) if rslora else r)


def load_lora_adapter(path: str, model_cfg: ModelConfig, *, max_rank: int) -> LoraWeights:
  """Reads and validates a PEFT LoRA adapter directory (see module doc)."""
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise LoraError(f"LoRA adapter path {path!r} is not a directory")
  rank, scaling = adapter_scaling(read_adapter_config(path), max_rank)
  file = os.path.join(path, _WEIGHTS)
  if not os.path.isfile(file):
    raise LoraError(f"{path}: no {_WEIGHTS}")
  dims = module_dims(model_cfg)
  halves: dict[tuple[int, tuple[str, ...]], dict[str, np.ndarray]] = {}
  try:
    with safe_open(file, framework="np") as f:
      for name in f.keys():  # noqa: SIM118  (safe_open handles are not iterable)
        layer, keys, half = _route(name, model_cfg, dims)
        _check_shape(tuple(f.get_slice(name).get_shape()), half, rank, _dims_of(keys, dims),
                     name)
        halves.setdefault((layer, keys), {})[half] = _checked_tensor(f.get_tensor(name), name)
  except LoraError:
    raise
  except Exception as e:  # noqa: BLE001 -- a corrupt or truncated file
    raise LoraError(f"{file}: cannot read the safetensors file ({e})") from e
  if not halves:
    raise LoraError(f"{file}: holds no LoRA tensors")
  layers: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
  for (layer, keys), ab in sorted(halves.items()):
    if set(ab) != {"A", "B"}:
      raise LoraError(f"layer {layer} {'/'.join(keys)}: lora_A and lora_B must both be present")
    a, b = ab["A"], ab["B"]  # PEFT: A [r, In], B [Out, r] (shapes checked before reading)
    a = np.ascontiguousarray(a.T)
    start = 0
    for key in keys:
      if key in layers.get(layer, {}):
        raise LoraError(f"layer {layer} {key}: adapted twice (fused and separate modules)")
      stop = start + dims[key][1]
      layers.setdefault(layer, {})[key] = (a, np.ascontiguousarray(b[start:stop].T
                                                                   * np.float32(scaling)))
      start = stop
  return LoraWeights(rank=rank, scaling=scaling, layers=layers)


def _route(name: str, cfg: ModelConfig, dims: dict) -> tuple[int, tuple[str, ...], str]:
  """(layer, params keys the module's output splits into, "A" | "B") of a tensor name."""
  m = _TENSOR_RE.match(name)
  if m is None:
    raise LoraError(f"tensor {name!r}: not a LoRA weight of a decoder layer's projection "
                    "(embeddings, the LM head and modules_to_save are not supported)")
  layer, module, half = int(m.group(1)), m.group(2), m.group(3)
  keys = FUSED_MODULES.get(module) or ((HF_MODULES[module],) if module in HF_MODULES else ())
  if not keys or not all(k in dims for k in keys):
    supported = ", ".join([*(k for k, v in HF_MODULES.items() if v in dims),
                           *(k for k, v in FUSED_MODULES.items() if set(v) <= set(dims))])
    raise LoraError(f"tensor {name!r}: module {module!r} cannot take an adapter on this "
                    f"model (supported: {supported})")
  if layer >= cfg.num_layers:
    raise LoraError(f"tensor {name!r}: layer {layer} but the model has {cfg.num_layers}")
  return layer, keys, half


def _dims_of(keys: tuple[str, ...], dims: dict) -> tuple[int, int]:
  """(In, Out) of a module whose output is the concatenation of `keys`' outputs."""
  return dims[keys[0]][0], sum(dims[k][1] for k in keys)


def _check_shape(shape: tuple, half: str, rank: int, dims: tuple[int, int], name: str) -> None:
  """Before the tensor is read: PEFT's lora_A is [r, In], lora_B [Out, r]."""
  d_in, d_out = dims
  expected = (rank, d_in) if half == "A" else (d_out, rank)
  if shape != expected:
    raise LoraError(f"tensor {name!r}: shape {shape} does not fit the base model with rank "
                    f"{rank} (expected {expected})")


def _checked_tensor(x: np.ndarray, name: str) -> np.ndarray:
  if x.ndim != 2 or not np.issubdtype(x.dtype, np.floating) and x.dtype.name != "bfloat16":
    raise LoraError(f"tensor {name!r}: expected a 2-D float tensor, got {x.dtype} {x.shape}")
  x = x.astype(np.float32)
  if not np.isfinite(x).all():
    raise LoraError(f"tensor {name!r}: holds NaN or infinite values")
  return x
