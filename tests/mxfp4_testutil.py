"""MXFP4 test data: a round-to-nearest packer and a tiny GPT-OSS checkpoint with MXFP4 experts.

`pack_mxfp4` writes the layout transformers' `integrations/mxfp4.py`
(`convert_moe_packed_tensors`) reads: per row of 32 inputs, 16 bytes of FP4
E2M1 codes (input 2j in byte j's low nibble, 2j + 1 in the high one) and an
E8M0 exponent byte. `save_tiny_mxfp4_model` quantizes the tiny GPT-OSS
model's experts with it and returns the torch model carrying the weights
transformers' own dequantization gives: the reference the engine must match.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from tiny_models import save_tiny_model

_MAGNITUDES = np.asarray(FP4_VALUES[:8], np.float32)  # codes 0..7; bit 3 is the sign


def pack_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """w [..., Out, In] float -> (blocks uint8 [..., Out, In/32, 16], scales uint8
  [..., Out, In/32]): each group's exponent the smallest with max|w| / 2^e <= 6, each
  value the nearest FP4 code (ties to the lower magnitude)."""
  groups = w.astype(np.float32).reshape(*w.shape[:-1], -1, 32)  # [..., Out, G, 32]
  amax = np.abs(groups).max(axis=-1)
  exp = np.ceil(np.log2(np.maximum(amax, 2.0 ** -126) / 6.0)).astype(np.int32)
  exp = np.clip(exp, -127, 127)
  scaled = np.abs(groups) / np.exp2(exp.astype(np.float32))[..., None]
  codes = np.abs(scaled[..., None] - _MAGNITUDES).argmin(axis=-1).astype(np.uint8)
  codes |= (groups < 0).astype(np.uint8) << 3
  blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., Out, G, 16]
  return np.ascontiguousarray(blocks), np.ascontiguousarray(exp + 127, np.uint8)


def dequantize_reference(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """transformers' `convert_moe_packed_tensors` in float32: [E, Out, G, 16] -> [E, In, Out]."""
  out = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                   dtype=torch.float32)
  return out.numpy()


def save_tiny_mxfp4_model(path: str, seed: int = 0):
  """The tiny GPT-OSS model with its experts stored as MXFP4 blocks (config.json gains
  `quantization_config: {quant_method: mxfp4}`); returns the torch model whose experts
  are transformers' dequantization of those blocks."""
  model = save_tiny_model("gpt_oss", path, seed)
  file = os.path.join(path, "model.safetensors")
  tensors = load_file(file)
  for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
    # HF layout [E, In, Out] -> the checkpoint's output-major rows [E, Out, In]
    blocks, scales = pack_mxfp4(np.swapaxes(tensors.pop(name), 1, 2))
    tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    layer = int(name.split(".")[2])
    experts = model.model.layers[layer].mlp.experts
    param = experts.gate_up_proj if name.endswith("gate_up_proj") else experts.down_proj
    with torch.no_grad():
      param.copy_(torch.from_numpy(dequantize_reference(blocks, scales)))
  save_file(tensors, file, metadata={"format": "pt"})
  with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
    config = json.load(f)
  config["quantization_config"] = {
      "quant_method": "mxfp4",
      "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                 "model.embed_tokens", "lm_head"]}
  with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)
  return model
