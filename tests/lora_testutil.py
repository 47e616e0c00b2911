"""Random PEFT LoRA adapters for tests, written by `peft` itself from a torch model.

`save_random_adapter(base, path, rank=..., targets=...)` wraps a copy of a
`transformers` model with `peft.get_peft_model` (random A *and* B, so the
adapter changes the output), saves it as a PEFT adapter directory
(`adapter_config.json` + `adapter_model.safetensors`) and returns the peft
model: the reference the engine is compared with.
"""

from __future__ import annotations

import copy

import peft
import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def save_random_adapter(base: torch.nn.Module, path: str, *, rank: int, seed: int,
                        targets=ALL_TARGETS, alpha: float | None = None,
                        rslora: bool = False, scale: float = 1.0) -> torch.nn.Module:
  """Writes a random adapter for `base` to `path`; returns base+adapter (eval, f32)."""
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
