"""Random PEFT LoRA adapters for tests, written by `peft` itself from a torch model.

`save_random_adapter(base, path, rank=..., targets=...)` wraps a copy of a
`transformers` model with `peft.get_peft_model` (random A *and* B, so the
adapter changes the output), saves it as a PEFT adapter directory
(`adapter_config.json` + `adapter_model.safetensors`) and returns the peft
model: the reference the engine is compared with. `write_peft_adapter` writes
the same format from numpy alone, for any model shape (the default model's).
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import safetensors.numpy

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# Phi-3's modules: fused q/k/v and gate/up projections.
FUSED_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
FUSED_ATTENTION_TARGETS = ("qkv_proj", "o_proj")


def save_random_adapter(base, path: str, *, rank: int, seed: int,
                        targets=ALL_TARGETS, alpha: float | None = None,
                        rslora: bool = False, scale: float = 1.0):
  """Writes a random adapter for `base` to `path`; returns base+adapter (eval, f32)."""
  import peft  # only here: write_peft_adapter needs neither peft nor torch
  import torch

  torch.manual_seed(seed)
  config = peft.LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                           target_modules=list(targets), lora_dropout=0.0,
                           init_lora_weights=False, use_rslora=rslora)
  model = peft.get_peft_model(copy.deepcopy(base), config)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "lora_" in name:
        p.mul_(scale)
  model.save_pretrained(path)
  return model.eval()


HF_NAMES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
            "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
            "w_down": "mlp.down_proj"}


def write_peft_adapter(path: str, dims: dict[str, tuple[int, int]], num_layers: int, *,
                       rank: int, seed: int, std: float = 0.05, alpha: float | None = None,
                       dtype=np.float32, tensors: dict | None = None, **config) -> str:
  """A PEFT-format adapter written from the format's description (no peft, no torch):
  `dims` maps our module keys to (In, Out); lora_A [r, In], lora_B [Out, r] for every
  layer. `tensors` adds or replaces raw entries (for malformed-file tests)."""
  os.makedirs(path, exist_ok=True)
  rng = np.random.default_rng(seed)
  out = {}
  for layer in range(num_layers):
    for key, (d_in, d_out) in dims.items():
      prefix = f"base_model.model.model.layers.{layer}.{HF_NAMES[key]}"
      out[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, d_in)) * std).astype(dtype)
      out[f"{prefix}.lora_B.weight"] = (rng.standard_normal((d_out, rank)) * std).astype(dtype)
  out.update(tensors or {})
  safetensors.numpy.save_file({k: v for k, v in out.items() if v is not None},
                              os.path.join(path, "adapter_model.safetensors"))
  cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
         "target_modules": sorted({HF_NAMES[k].split(".")[-1] for k in dims}),
         "bias": "none", "use_rslora": False, **config}
  with open(os.path.join(path, "adapter_config.json"), "w") as f:
    json.dump(cfg, f)
  return path
