"""Hugging Face checkpoint directories: config.json + safetensors -> params.

Reads `config.json` (plus `generation_config.json` EOS ids), then streams the
weights tensor by tensor with `safetensors.safe_open` from a single
`model.safetensors` or the shards listed in `model.safetensors.index.json`,
copying each into the preallocated params tree (host memory: the params plus
one tensor). Weight names covered:

  model.embed_tokens / model.norm / lm_head
  model.layers.{i}.input_layernorm / post_attention_layernorm
  model.layers.{i}.self_attn.{q,k,v,o}_proj.weight, {q,k,v}_proj.bias (Qwen2)
  model.layers.{i}.self_attn.{q,k}_norm (Qwen3, Gemma 3)
  Gemma 2/3: post_attention_layernorm is the attention output's norm, pre_ / post_
    feedforward_layernorm the MLP's (serving/models/gemma.py `HF_LAYER_NAMES`)
  model.layers.{i}.mlp.{gate,up,down}_proj (dense)
  Mixtral:   block_sparse_moe.gate, block_sparse_moe.experts.{e}.w1/w3/w2
  Qwen3-MoE: mlp.gate, mlp.experts.{e}.gate_proj/up_proj/down_proj
  Phi-3:     self_attn.qkv_proj [(N+2K)*H, D] -> wq / wk / wv, mlp.gate_up_proj [2F, D]
             (gate rows first) -> w_gate / w_up (serving/models/phi3.py)
  fused (transformers 5 in-memory layout, `save_original_format=False`):
    {mlp,block_sparse_moe}.experts.gate_up_proj [E, 2M, D] (gate rows first),
    {mlp,block_sparse_moe}.experts.down_proj [E, D, M]
  GPT-OSS:   self_attn.o_proj.bias, self_attn.sinks, mlp.router.{weight,bias},
    mlp.experts.gate_up_proj [E, D, 2M] (gate / up columns interleaved) and its
    bias [E, 2M], mlp.experts.down_proj [E, M, D] and its bias [E, D]; MXFP4
    experts (`*_blocks` / `*_scales`) load in checkpoints/hf_mxfp4.py
  DeepSeek-V3: MLA projections, kv_b_proj split into w_uk / w_uv, shared experts,
    e_score_correction_bias (serving/models/deepseek.py `put_tensor`)

Linear weights are transposed to [in, out]. Tied embeddings: any `lm_head`
tensor in the file is ignored. A config with a `quantization_config` (GPTQ,
AWQ, FP8) is loaded by checkpoints/hf_quantized.py, which routes the float
tensors through `put_tensor` and finds each linear's slot with `linear_slot`.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
from safetensors import safe_open

from checkpoints import hf_qwen3_next
from checkpoints.layout import Params, ParamsBuilder
from serving.models import deepseek, gemma, phi3, qwen3_next
from serving.models.model_config import ModelConfig

_TOP_LEVEL = {
    "model.embed_tokens.weight": ("embed", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
}
# Per-layer names (after "model.layers.{i}.") -> (params key, transpose).
_LAYER = {
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.o_proj.bias": ("bo", False),
    "self_attn.sinks": ("sinks", False),
    "mlp.router.weight": ("router", True),
    "mlp.router.bias": ("router_bias", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
    "mlp.gate.weight": ("router", True),
    "block_sparse_moe.gate.weight": ("router", True),
}
# Phi-3's fused dense projections -> the params keys of their row blocks, in order.
_FUSED_DENSE = {"self_attn.qkv_proj.weight": ("wq", "wk", "wv"),
                "mlp.gate_up_proj.weight": ("w_gate", "w_up")}
_EXPERT_KEYS = {"w1": "we_gate", "w3": "we_up", "w2": "we_down",
                "gate_proj": "we_gate", "up_proj": "we_up", "down_proj": "we_down"}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(w[123]|gate_proj|up_proj|"
                        r"down_proj)\.weight")
_FUSED_RE = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)(?:\.weight)?")
# GPT-OSS's expert tensors: [E, D, 2M] / [E, M, D] ([in, out] already) and their biases.
_GPT_OSS_EXPERT_RE = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")
# Buffers some checkpoints carry that are not parameters.
_IGNORED_RE = re.compile(r".*rotary_emb\.inv_freq$")


def is_hf_dir(path: str) -> bool:
  return os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json"))


def load_hf_config(path: str) -> tuple[dict[str, Any], ModelConfig]:
  """The raw `config.json` dict (EOS extended by generation_config) and its ModelConfig."""
  with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
    raw = json.load(f)
  if "text_config" in raw and "num_hidden_layers" not in raw:
    outer = raw
    raw = {**raw["text_config"], "architectures": raw.get("architectures")}
    if outer.get("quantization_config") and not raw.get("quantization_config"):
      raw["quantization_config"] = outer["quantization_config"]
  gen_path = os.path.join(path, "generation_config.json")
  if os.path.exists(gen_path):
    with open(gen_path, encoding="utf-8") as f:
      gen_eos = json.load(f).get("eos_token_id")
    eos = _as_list(raw.get("eos_token_id"))
    eos += [i for i in _as_list(gen_eos) if i not in eos]
    raw = {**raw, "eos_token_id": eos}
  return raw, ModelConfig.from_hf_config(raw)


def load_hf_params(path: str, cfg: ModelConfig, dtype: Any = np.float32) -> Params:
  """Streams the safetensors weights of `path` into the params tree."""
  if cfg.family == qwen3_next.FAMILY:  # its blocks gather several HF layers
    return hf_qwen3_next.load_params(iter_safetensors(path), cfg, dtype)
  builder = ParamsBuilder(cfg, dtype)
  for name, read in iter_safetensors(path):
    put_tensor(builder, cfg, name, read)
  return builder.finish()


def safetensors_files(path: str) -> list[str]:
  """The weight files of a HF dir: the index's shards, or model.safetensors."""
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index, encoding="utf-8") as f:
      weight_map = json.load(f)["weight_map"]
    shards = sorted(set(weight_map.values()))
    for s in shards:  # file names in this directory only: no "../x", "/etc/x" or "sub/x"
      if not isinstance(s, str) or os.path.basename(s) != s or s in ("", ".", ".."):
        raise ValueError(f"{index}: shard name {s!r} is not a file name in the model "
                         "directory")
    return [os.path.join(path, s) for s in shards]
  single = os.path.join(path, "model.safetensors")
  if os.path.exists(single):
    return [single]
  shards = sorted(glob.glob(os.path.join(path, "model-*-of-*.safetensors")))
  if shards:
    return shards
  if glob.glob(os.path.join(path, "*.bin")) or glob.glob(os.path.join(path, "*.pth")):
    raise ValueError(f"unsupported checkpoint format in {path}: only safetensors are "
                     "supported (found PyTorch .bin/.pth files)")
  raise FileNotFoundError(f"no model.safetensors or shards in {path}")


def iter_safetensors(path: str) -> Iterator[tuple[str, Any]]:
  """Yields (name, read) per tensor; `read()` loads just that tensor as numpy."""
  for file in safetensors_files(path):
    with safe_open(file, framework="np") as f:
      for name in f.keys():  # noqa: SIM118  (safe_open handles are not iterable)
        yield name, (lambda f=f, name=name: f.get_tensor(name))


def linear_slot(module: str) -> tuple[str, int | None, int | None] | None:
  """A linear module's name (its weight's name without `.weight`) -> (params key, layer,
  expert), e.g. "model.layers.3.self_attn.q_proj" -> ("wq", 3, None); None if the module
  is not a linear layer of ours (norms, embeddings, routers, unknown names)."""
  if module == "lm_head":
    return "lm_head", None, None
  m = _LAYER_RE.fullmatch(module)
  if m is None:
    return None
  layer, rest = int(m.group(1)), m.group(2)
  entry = _LAYER.get(f"{rest}.weight")
  if entry is not None and entry[1] and entry[0] != "router":
    return entry[0], layer, None
  if em := _EXPERT_RE.fullmatch(f"{rest}.weight"):
    return _EXPERT_KEYS[em.group(2)], layer, int(em.group(1))
  return None


def layer_names(cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
  """Per-layer HF tensor names -> (params key, transpose) for `cfg`'s family."""
  if cfg.family == gemma.FAMILY:
    return {**_LAYER, **gemma.HF_LAYER_NAMES}
  return _LAYER


def put_tensor(builder: ParamsBuilder, cfg: ModelConfig, name: str, read) -> None:
  """Routes one HF tensor into the params tree."""
  if _IGNORED_RE.match(name):
    return
  if name in _TOP_LEVEL:
    key, transpose = _TOP_LEVEL[name]
    if key == "lm_head" and cfg.tie_word_embeddings:
      return
    value = read()
    builder.put(key, value.T if transpose else value, source=name)
    return
  m = _LAYER_RE.fullmatch(name)
  if m is None:
    raise ValueError(f"unsupported tensor {name!r} in a {cfg.model_type} checkpoint")
  layer, rest = int(m.group(1)), m.group(2)
  table = layer_names(cfg)
  if cfg.family == deepseek.FAMILY:
    deepseek.put_tensor(builder, cfg, layer, rest, read)
  elif cfg.family == "gpt_oss" and (gm := _GPT_OSS_EXPERT_RE.fullmatch(rest)):
    _put_gpt_oss_experts(builder, gm.group(1), bool(gm.group(2)), read(), layer, name)
  elif rest in table:
    key, transpose = table[rest]
    value = read()
    builder.put(key, value.T if transpose else value, layer, source=name)
  elif rest in _FUSED_DENSE:
    _put_fused(builder, cfg, rest, read(), layer, name)
  elif em := _EXPERT_RE.fullmatch(rest):
    builder.put(_EXPERT_KEYS[em.group(2)], read().T, layer, int(em.group(1)), source=name)
  elif fm := _FUSED_RE.fullmatch(rest):
    value = read()
    if fm.group(1) == "down_proj":  # [E, D, M] -> [E, M, D]
      builder.put("we_down", value.transpose(0, 2, 1), layer, source=name)
    else:  # [E, 2M, D]: gate rows then up rows -> two [E, D, M]
      gate, up = np.split(value, 2, axis=1)
      builder.put("we_gate", gate.transpose(0, 2, 1), layer, source=name)
      builder.put("we_up", up.transpose(0, 2, 1), layer, source=name)
  else:
    raise ValueError(f"unsupported tensor {name!r} in a {cfg.model_type} checkpoint")


def _put_fused(builder: ParamsBuilder, cfg: ModelConfig, rest: str, value: np.ndarray,
               layer: int, name: str) -> None:
  """A Phi-3 fused projection [out, in], split into its params leaves ([in, out] each)."""
  parts = (phi3.split_qkv(value, cfg) if rest == "self_attn.qkv_proj.weight"
           else phi3.split_gate_up(value, cfg))
  for key, part in zip(_FUSED_DENSE[rest], parts, strict=True):
    builder.put(key, part.T, layer, source=name)
def _put_gpt_oss_experts(builder: ParamsBuilder, proj: str, bias: bool, value: np.ndarray,
                         layer: int, name: str) -> None:
  """GPT-OSS expert tensors of one layer: gate_up's interleaved columns (gate even, up
  odd) split into we_gate / we_up (be_gate / be_up); down_proj as is."""
  if proj == "down_proj":
    builder.put("be_down" if bias else "we_down", value, layer, source=name)
    return
  gate, up = value[..., 0::2], value[..., 1::2]  # [E, (D,) 2M] -> two [E, (D,) M]
  builder.put("be_gate" if bias else "we_gate", np.ascontiguousarray(gate), layer, source=name)
  builder.put("be_up" if bias else "we_up", np.ascontiguousarray(up), layer, source=name)


def _as_list(value: Any) -> list[int]:
  if value is None:
    return []
  return list(value) if isinstance(value, (list, tuple)) else [value]
