"""GPT-OSS checkpoints whose experts are MXFP4 (`quant_method: "mxfp4"`), kept as stored.

OpenAI's GPT-OSS releases store each layer's expert projections as OCP MXFP4:

  model.layers.{i}.mlp.experts.gate_up_proj_blocks  uint8 [E, 2M, D/32, 16]
  model.layers.{i}.mlp.experts.gate_up_proj_scales  uint8 [E, 2M, D/32]
  model.layers.{i}.mlp.experts.down_proj_blocks     uint8 [E, D, M/32, 16]
  model.layers.{i}.mlp.experts.down_proj_scales     uint8 [E, D, M/32]

rows output-major (`[E, Out, In]`), 32 inputs a block: 16 bytes of FP4 E2M1
codes (input 2j in byte j's low nibble, 2j + 1 in its high nibble) and one
E8M0 exponent. gate_up's rows interleave gate (even) and up (odd). Each
becomes a `QuantizedWeight(kind="mxfp4")` over the same bytes, stacked
`[L, E, ...]`: we_gate takes the even rows, we_up the odd ones, we_down all
(a row selection: no byte is re-encoded). Everything else (attention, router,
norms, embeddings, the expert biases) loads as in checkpoints/hf.py. The
experts are dequantized inside the step before the grouped matmul
(`llama.moe_experts`), as transformers' `convert_moe_packed_tensors` would.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from checkpoints import hf
from checkpoints.layout import Params, ParamsBuilder
from serving.models.model_config import ModelConfig
from serving.models.quantized import EXPERT_KEYS, MXFP4_GROUP, QuantizedWeight

_MXFP4_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_"
                       r"(blocks|scales)")


def is_mxfp4(quantization_config: dict[str, Any]) -> bool:
  """Whether a `quantization_config` is MXFP4 (GPT-OSS)."""
  return str(quantization_config.get("quant_method", "")).lower() == "mxfp4"


def load_hf_mxfp4_params(path: str, cfg: ModelConfig, dtype: Any = np.float32) -> Params:
  """The params of a GPT-OSS HF dir with MXFP4 experts (see module doc)."""
  if cfg.model_type != "gpt_oss" or not cfg.is_moe:
    raise ValueError(f"MXFP4 checkpoints are supported for GPT-OSS experts only, not "
                     f"{cfg.model_type!r}")
  builder = ParamsBuilder(cfg, dtype, absent=frozenset(EXPERT_KEYS))
  experts = _ExpertSlots(cfg)
  for name, read in hf.iter_safetensors(path):
    if m := _MXFP4_RE.fullmatch(name):
      experts.put(int(m.group(1)), m.group(2), m.group(3), read(), name)
    else:
      hf.put_tensor(builder, cfg, name, read)
  params = builder.finish()
  params["layers"].update(experts.finish())
  return params


class _ExpertSlots:
  """Preallocated `[L, E, Out, ...]` codes and scales of the three expert weights."""

  def __init__(self, cfg: ModelConfig):
    L, E, D, M = cfg.num_layers, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for dim in (D, M):
      if dim % MXFP4_GROUP:
        raise ValueError(f"MXFP4 experts need dims divisible by {MXFP4_GROUP}, got {dim}")
    # key -> (out rows, in features)
    self.dims = {"we_gate": (M, D), "we_up": (M, D), "we_down": (D, M)}
    self.arrays = {key: {"blocks": np.empty((L, E, o, i // 2), np.uint8),
                         "scales": np.empty((L, E, o, i // MXFP4_GROUP), np.uint8)}
                   for key, (o, i) in self.dims.items()}
    self.todo = {(key, part, layer) for key in self.dims for part in ("blocks", "scales")
                 for layer in range(L)}
    self.cfg = cfg

  def put(self, layer: int, proj: str, part: str, value: np.ndarray, name: str) -> None:
    """One checkpoint tensor (blocks [E, Out, G, 16] or scales [E, Out, G]) -> its slots."""
    if not 0 <= layer < self.cfg.num_layers:
      raise ValueError(f"{name!r}: layer {layer} out of range")
    if value.dtype != np.uint8:
      raise ValueError(f"{name!r} has dtype {value.dtype}, expected uint8")
    key = "we_down" if proj == "down_proj" else "we_gate"
    out, inp = self.dims[key]
    rows = out if proj == "down_proj" else 2 * out
    groups = inp // MXFP4_GROUP
    want = (self.cfg.num_experts, rows, groups, 16) if part == "blocks" else (
        self.cfg.num_experts, rows, groups)
    if tuple(value.shape) != want:
      raise ValueError(f"{name!r} has shape {tuple(value.shape)}, expected {want}")
    # blocks [E, Out, G, 16] -> [E, Out, In/2]; scales stay [E, Out, G]
    value = value.reshape(*want[:2], -1)
    if proj == "down_proj":
      self._fill("we_down", part, layer, value)
    else:  # gate rows even, up rows odd
      self._fill("we_gate", part, layer, value[:, 0::2])
      self._fill("we_up", part, layer, value[:, 1::2])

  def _fill(self, key: str, part: str, layer: int, value: np.ndarray) -> None:
    self.arrays[key][part][layer] = value
    self.todo.discard((key, part, layer))

  def finish(self) -> dict[str, QuantizedWeight]:
    """The three stacked MXFP4 weights; raises if a layer's tensor never came."""
    if self.todo:
      key, part, layer = sorted(self.todo)[0]
      raise ValueError(f"MXFP4 checkpoint is missing {len(self.todo)} expert tensors, e.g. "
                       f"layer {layer} {part} of {key}")
    return {key: QuantizedWeight(q=a["blocks"], scale=a["scales"], kind="mxfp4",
                                 group_size=MXFP4_GROUP) for key, a in self.arrays.items()}
