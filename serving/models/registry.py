"""The model families and how checkpoints name them.

A family is one module file under serving/models/ that defines
`config_from_hf(raw: dict) -> ModelConfig` and its flax nnx model class
`Model` (a `causal_lm.CausalLM`). `FAMILIES` maps each family to the names
checkpoints use for it: Hugging Face `architectures` and `model_type`, and
GGUF `general.architecture`. Adding a family is one entry here plus its
module (docs/models.md).
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import Any


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family: its module and the checkpoint names that select it."""

  name: str  # the module serving/models/<name>.py
  architectures: tuple[str, ...]  # HF config.json "architectures"
  model_types: tuple[str, ...]  # HF config.json "model_type"
  gguf_architectures: tuple[str, ...] = ()  # GGUF general.architecture

  @property
  def module(self) -> ModuleType:
    return importlib.import_module(f"serving.models.{self.name}")

  def config_from_hf(self, raw: dict[str, Any]):
    return self.module.config_from_hf(raw)


FAMILIES = (
    Family("llama",
           architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                          "Qwen3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"),
           model_types=("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"),
           gguf_architectures=("llama", "qwen2", "qwen3", "qwen3moe")),
    Family("phi3", architectures=("Phi3ForCausalLM",), model_types=("phi3",),
           gguf_architectures=("phi3",)),
    Family("gpt_oss", architectures=("GptOssForCausalLM",), model_types=("gpt_oss",)),
    Family("gemma", architectures=("Gemma2ForCausalLM", "Gemma3ForCausalLM"),
           model_types=("gemma2", "gemma3_text"), gguf_architectures=("gemma2", "gemma3")),
    Family("deepseek", architectures=("DeepseekV3ForCausalLM",), model_types=("deepseek_v3",)),
    Family("qwen3_next", architectures=("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM",
                                        "Qwen3_5ForConditionalGeneration"),
           model_types=("qwen3_next", "qwen3_5_text", "qwen3_5")),
)
_BY_NAME = {f.name: f for f in FAMILIES}


def supported_architectures() -> list[str]:
  return sorted(a for f in FAMILIES for a in f.architectures)


def family_for_hf(raw: dict[str, Any]) -> Family:
  """The family of a HF config dict: by `model_type`, else by `architectures`."""
  model_type = raw.get("model_type")
  for family in FAMILIES:
    if model_type in family.model_types:
      return family
  archs = raw.get("architectures") or []
  for family in FAMILIES:
    if any(a in family.architectures for a in archs):
      return family
  raise ValueError(f"unsupported architecture: model_type={model_type!r}, "
                   f"architectures={archs}; supported architectures: "
                   f"{supported_architectures()}")


def family_for_gguf(arch: str) -> Family:
  """The family of a GGUF file's `general.architecture`."""
  for family in FAMILIES:
    if arch in family.gguf_architectures:
      return family
  supported = sorted(a for f in FAMILIES for a in f.gguf_architectures)
  raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {supported}")


def family(name: str) -> Family:
  """The family called `name` (ModelConfig.family)."""
  if name not in _BY_NAME:
    raise ValueError(f"unknown model family {name!r}; known: {sorted(_BY_NAME)}")
  return _BY_NAME[name]
