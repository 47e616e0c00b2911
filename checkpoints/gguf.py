"""GGUF files (llama.cpp): metadata -> HF-style config, tensors -> params.

1. `read_gguf(path)` opens the file with `Any` (memory-mapped).
2. `gguf_hf_config(reader)` turns `{arch}.*` metadata into a HF config dict
   (architectures llama, incl. Mixtral-style MoE, qwen2, qwen3, qwen3moe, phi3:
   its fused attn_qkv / ffn_up (gate rows, then up rows) are split into our
   leaves, its rope_factors_long / _short tensors become LongRoPE scaling;
   gemma2, gemma3: their windows, soft caps, attention scale and RoPE bases
   as llama.cpp reads them).
3. `load_gguf_params(reader, cfg)` dequantizes each tensor to float with
   `gguf.quants.dequantize` (types in `SUPPORTED_TYPES`) and copies it into the
   params tree. For llama-arch files the Q/K rows are un-permuted: llama.cpp's
   converter reorders each head's rows from HF's rotate-half layout to
   interleaved pairs; `unpermute_rows` reverses it exactly as transformers'
   `LlamaTensorProcessor` does, so our weights equal transformers' load of
   the same file. Gemma norms are stored as `1 + w`; we subtract the 1.
4. `raw_tensor(reader, name)` gives a tensor's quantized blocks untouched
   (name, ggml type, logical shape, bytes) for quantized serving paths; the
   Q/K un-permutation moves whole rows, so it applies to raw blocks too, as
   does cutting a Phi-3 fused tensor into its parts (`gguf_tensor_slot`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import gguf
import numpy as np

from checkpoints.gguf_reader import GGUFFile, metadata_value, open_gguf
from checkpoints.layout import Params, ParamsBuilder
from serving.models import phi3, registry
from serving.models.model_config import ModelConfig

Q = gguf.GGMLQuantizationType
# Types we dequantize (each checked against an independent decoder in tests,
# or a gguf-py decoder of the same k-quant family).
SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                             Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})
# general.architecture -> HF model_type (llama with experts becomes mixtral).
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                 "phi3": "phi3", "gemma2": "gemma2", "gemma3": "gemma3_text"}
# Phi-3's fused tensors (rows as in HF: q, k, v; gate, up) -> the params keys they split into.
_PHI3_FUSED = {"attn_qkv.weight": ("wq", "wk", "wv"), "ffn_up.weight": ("w_gate", "w_up")}
# Tensors folded into the config (rope_scaling), not params.
_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# Architectures whose converter stores RMSNorm weights as `1 + w` (llama.cpp's
# convert_hf_to_gguf adds 1 to every `*norm.weight` of Gemma 2/3); we keep HF's `w`.
NORM_PLUS_ONE = frozenset({"gemma2", "gemma3"})
# llama.cpp's fixed sliding-window patterns (every n-th layer full) and its attention scale
# rule: query_pre_attn_scalar is hidden / heads for the 27B models (this layer count), else
# head_dim (google/gemma_pytorch config.py).
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

_TOP = {"token_embd.weight": ("embed", False), "output_norm.weight": ("final_norm", False),
        "output.weight": ("lm_head", True)}
_BLOCK = {
    "attn_norm.weight": ("attn_norm", False), "ffn_norm.weight": ("mlp_norm", False),
    "attn_q.weight": ("wq", True), "attn_k.weight": ("wk", True),
    "attn_v.weight": ("wv", True), "attn_output.weight": ("wo", True),
    "attn_q.bias": ("bq", False), "attn_k.bias": ("bk", False), "attn_v.bias": ("bv", False),
    "attn_q_norm.weight": ("q_norm", False), "attn_k_norm.weight": ("k_norm", False),
    "post_attention_norm.weight": ("post_attn_norm", False),
    "post_ffw_norm.weight": ("post_mlp_norm", False),
    "ffn_gate.weight": ("w_gate", True), "ffn_up.weight": ("w_up", True),
    "ffn_down.weight": ("w_down", True), "ffn_gate_inp.weight": ("router", True),
    # [E, M, D] / [E, D, M] -> swap the last two axes.
    "ffn_gate_exps.weight": ("we_gate", True), "ffn_up_exps.weight": ("we_up", True),
    "ffn_down_exps.weight": ("we_down", True),
}
_BLK_RE = re.compile(r"blk\.(\d+)\.(.+)")


@dataclasses.dataclass(frozen=True)
class RawTensor:
  """A GGUF tensor's stored blocks, not dequantized.

  `shape` is the logical numpy shape (rows first, e.g. [out, in] for a
  Linear weight); `data` is uint8 `[*shape[:-1], shape[-1] // block_size *
  type_size]` for block types (a read-only view of the file for plain ones).
  """

  name: str
  ggml_type: gguf.GGMLQuantizationType
  shape: tuple[int, ...]
  data: np.ndarray

  @property
  def block_size(self) -> int:
    return gguf.GGML_QUANT_SIZES[self.ggml_type][0]

  @property
  def type_size(self) -> int:
    return gguf.GGML_QUANT_SIZES[self.ggml_type][1]


def read_gguf(path: str) -> GGUFFile:
  """Parses the header and memory-maps the tensors (split models: all splits)."""
  return open_gguf(path)


field = metadata_value


def gguf_hf_config(reader: Any) -> dict[str, Any]:
  """A HF-style config dict from GGUF metadata; unsupported files raise ValueError."""
  arch = field(reader, "general.architecture")
  registry.family_for_gguf(arch)  # an unsupported architecture raises ValueError here
  g = lambda key, default=None: field(reader, f"{arch}.{key}", default)
  names = {t.name for t in reader.tensors}
  scaling = g("rope.scaling.type")
  if scaling not in (None, "none") and not (scaling == "linear" and arch in NORM_PLUS_ONE):
    raise ValueError(f"unsupported GGUF rope scaling {arch}.rope.scaling.type={scaling!r}")
  heads = g("attention.head_count")
  if isinstance(heads, list):
    raise ValueError(f"unsupported GGUF: per-layer {arch}.attention.head_count")
  hidden = g("embedding_length")
  head_dim = g("attention.key_length") or (g("rope.dimension_count") if arch == "llama" else None)
  experts = g("expert_count", 0) or 0
  model_type = "mixtral" if arch == "llama" and experts else ARCHITECTURES[arch]
  tokens = field(reader, "tokenizer.ggml.tokens")
  cfg = {
      "model_type": model_type,
      "vocab_size": g("vocab_size") or (len(tokens) if tokens else None),
      "hidden_size": hidden,
      "intermediate_size": g("feed_forward_length", 0),
      "num_hidden_layers": g("block_count"),
      "num_attention_heads": heads,
      "num_key_value_heads": g("attention.head_count_kv") or heads,
      "head_dim": head_dim or hidden // heads,
      "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
      "rope_theta": float(g("rope.freq_base", 10000.0)),
      "max_position_embeddings": g("context_length", 4096),
      "tie_word_embeddings": "output.weight" not in names,
      "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
      "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
  }
  if experts:
    cfg.update(num_local_experts=experts, num_experts_per_tok=g("expert_used_count"),
               moe_intermediate_size=g("expert_feed_forward_length") or cfg["intermediate_size"],
               norm_topk_prob=bool(g("expert_weights_norm", True)))
  freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
  if freqs is not None:
    cfg["rope_scaling"] = rope_scaling_from_factors(dequantize_tensor(freqs), cfg["head_dim"],
                                                    cfg["rope_theta"])
  if arch == "qwen2":
    cfg["attention_bias"] = any(n.endswith("attn_q.bias") for n in names)
  if arch == "phi3":
    cfg.update(_phi3_config(reader, cfg))
  if arch in NORM_PLUS_ONE:
    cfg.update(_gemma_config(reader, arch, cfg))
  return cfg


def _phi3_config(reader: Any, cfg: dict[str, Any]) -> dict[str, Any]:
  """Phi-3's extra HF config keys from llama.cpp's metadata and rope factor tensors
  (convert_hf_to_gguf.py's Phi3MiniModel writes them)."""
  g = lambda key, default=None: field(reader, f"phi3.{key}", default)
  head_dim = cfg["head_dim"]
  extra = {"partial_rotary_factor": g("rope.dimension_count", head_dim) / head_dim,
           "sliding_window": g("attention.sliding_window") or None,
           "original_max_position_embeddings": g("rope.scaling.original_context_length",
                                                 cfg["max_position_embeddings"])}
  tensors = {t.name: t for t in reader.tensors}
  if "rope_factors_long.weight" in tensors:
    extra["rope_scaling"] = {
        "rope_type": "longrope",
        "long_factor": dequantize_tensor(tensors["rope_factors_long.weight"]).tolist(),
        "short_factor": dequantize_tensor(tensors["rope_factors_short.weight"]).tolist(),
        "attention_factor": float(g("rope.scaling.attn_factor", 1.0))}
  return extra


def _gemma_config(reader: Any, arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
  """The Gemma 2/3 keys of a HF config from `{arch}.*` metadata, read as llama.cpp does."""
  g = lambda key, default=None: field(reader, f"{arch}.{key}", default)
  layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
  out = {
      "sliding_window": g("attention.sliding_window"),
      "final_logit_softcapping": g("final_logit_softcapping"),
      "query_pre_attn_scalar": (cfg["hidden_size"] // heads if layers == _GEMMA_27B_LAYERS[arch]
                                else cfg["head_dim"]),
      "sliding_window_pattern": _GEMMA_PATTERN[arch],
  }
  pattern = g("attention.sliding_window_pattern")
  if isinstance(pattern, list):  # per layer: true = sliding window
    out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
  elif pattern:
    out["sliding_window_pattern"] = int(pattern)
  if arch == "gemma2":
    out["attn_logit_softcapping"] = g("attn_logit_softcapping")
  else:  # the sliding layers' base (llama.cpp: 10000 unless the file says)
    out["rope_local_base_freq"] = float(g("rope.freq_base_swa", 10000.0))
  if g("rope.scaling.type") == "linear":
    out["rope_scaling"] = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
  return out


def check_tensor_type(t: Any) -> None:
  if t.tensor_type not in SUPPORTED_TYPES:
    raise ValueError(f"unsupported GGUF tensor type {t.tensor_type.name} for tensor {t.name!r} "
                     f"(supported: {sorted(q.name for q in SUPPORTED_TYPES)})")


def dequantize_tensor(t: Any) -> np.ndarray:
  """A reader tensor as float32 (numpy, logical shape: rows first)."""
  check_tensor_type(t)
  shape = tuple(int(d) for d in reversed(t.shape))
  fast = _FAST_DEQUANT.get(t.tensor_type)
  out = fast(np.asarray(t.data)) if fast else gguf.quants.dequantize(t.data, t.tensor_type)
  return out.reshape(shape)


def _blocks(data: np.ndarray, type_size: int) -> np.ndarray:
  return data.reshape(-1, type_size)


def _f16_col(blocks: np.ndarray, at: int) -> np.ndarray:
  return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
  # Low nibbles are elements 0..15 of a block, high nibbles 16..31.
  return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)


def _dequant_q8_0(data: np.ndarray) -> np.ndarray:
  b = _blocks(data, 34)
  return _f16_col(b, 0) * b[:, 2:].view(np.int8).astype(np.float32)


def _dequant_q4_0(data: np.ndarray) -> np.ndarray:
  b = _blocks(data, 18)
  return _f16_col(b, 0) * (_nibbles(b[:, 2:]) - 8.0)


def _dequant_q4_1(data: np.ndarray) -> np.ndarray:
  b = _blocks(data, 20)
  return _f16_col(b, 0) * _nibbles(b[:, 4:]) + _f16_col(b, 2)


# Whole-tensor vectorized decoders for the common block types (gguf-py's work
# in groups of rows and is several times slower); others use gguf.quants.
_FAST_DEQUANT = {Q.Q8_0: _dequant_q8_0, Q.Q4_0: _dequant_q4_0, Q.Q4_1: _dequant_q4_1}


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undoes llama.cpp's Q/K row permutation (interleaved pairs -> rotate-half).

  `w` is [n_head * head_dim, ...] (weights, biases, or raw block rows).
  """
  half = w.shape[0] // n_head // 2
  return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_params(reader: Any, cfg: ModelConfig, dtype: Any = np.float32,
                     skip_tensors: frozenset[str] = frozenset()) -> Params:
  """Dequantizes every tensor into the params tree (one tensor in flight); tensors named
  in `skip_tensors` (their blocks are kept quantized by the caller) are left unwritten."""
  builder = ParamsBuilder(cfg, dtype)
  arch = field(reader, "general.architecture")
  permute = arch == "llama"
  for t in reader.tensors:
    m = _BLK_RE.fullmatch(t.name)
    if arch == "phi3" and m and m.group(2) in _PHI3_FUSED:
      _put_phi3_fused(builder, cfg, t, int(m.group(1)), _PHI3_FUSED[m.group(2)], skip_tensors)
      continue
    key, layer, transpose = _route(t.name, cfg)
    if key is None:
      continue
    check_tensor_type(t)
    if t.name in skip_tensors:
      builder.skip(key, layer)
      continue
    w = dequantize_tensor(t)
    if permute and key in ("wq", "bq", "wk", "bk"):
      w = unpermute_rows(w, cfg.num_heads if key in ("wq", "bq") else cfg.num_kv_heads)
    if arch in NORM_PLUS_ONE and key.endswith("norm"):
      w = w - np.float32(1.0)  # stored as 1 + w (see NORM_PLUS_ONE)
    if transpose:
      w = np.swapaxes(w, -1, -2)
    builder.put(key, w, layer, source=t.name)
  return builder.finish()


def _put_phi3_fused(builder: ParamsBuilder, cfg: ModelConfig, t: Any, layer: int,
                    keys: tuple[str, ...], skip_tensors: frozenset[str]) -> None:
  """A Phi-3 fused tensor [out, in], split by rows into `keys` ([in, out] each)."""
  check_tensor_type(t)
  if t.name in skip_tensors:
    for key in keys:
      builder.skip(key, layer)
    return
  w = dequantize_tensor(t)
  parts = phi3.split_qkv(w, cfg) if keys[0] == "wq" else phi3.split_gate_up(w, cfg)
  for key, part in zip(keys, parts, strict=True):
    builder.put(key, part.T, layer, source=t.name)


def raw_tensor(reader: Any, name: str, unpermute: bool = True,
               rows: slice | None = None) -> RawTensor:
  """The quantized blocks of tensor `name`; llama Q/K rows un-permuted by default; with
  `rows`, only those rows (whole rows of blocks: a Phi-3 fused tensor's part)."""
  t = next((t for t in reader.tensors if t.name == name), None)
  if t is None:
    raise KeyError(f"no tensor {name!r} in GGUF file")
  shape = tuple(int(d) for d in reversed(t.shape))
  data = np.asarray(t.data)
  if rows is not None:
    data = data[rows]
    shape = (data.shape[0], *shape[1:])
  m = _BLK_RE.fullmatch(name)
  part = m.group(2) if m else ""
  if unpermute and field(reader, "general.architecture") == "llama" and part.startswith(
      ("attn_q.", "attn_k.")):
    heads = field(reader, "llama.attention.head_count")
    if part.startswith("attn_k."):
      heads = field(reader, "llama.attention.head_count_kv") or heads
    data = unpermute_rows(data, heads)
  return RawTensor(name=name, ggml_type=t.tensor_type, shape=shape, data=data)


def gguf_tensor_name(key: str, layer: int | None = None) -> str:
  """The GGUF tensor holding params leaf `key` (of `layer`), e.g. ("wq", 0) -> blk.0.attn_q.weight.

  Raw blocks are stored [out, in] (HF layout), the transpose of the params leaf.
  """
  if layer is None:
    names = [n for n, (k, _) in _TOP.items() if k == key]
  else:
    names = [f"blk.{layer}.{n}" for n, (k, _) in _BLOCK.items() if k == key]
  if not names:
    raise KeyError(f"no GGUF tensor for params key {key!r}")
  return names[0]


def gguf_tensor_slot(cfg: ModelConfig, key: str, layer: int | None = None
                     ) -> tuple[str, slice | None]:
  """The GGUF tensor holding params leaf `key` (of `layer`) and its rows there (None: the
  whole tensor): Phi-3's q/k/v and gate/up are row blocks of attn_qkv and ffn_up."""
  if cfg.family == "phi3" and layer is not None:
    for part, keys in _PHI3_FUSED.items():
      if key in keys:
        return f"blk.{layer}.{part}", phi3.fused_rows(cfg)[key]
  return gguf_tensor_name(key, layer), None


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int
                        ) -> np.ndarray:
  """Per-frequency divisors of Llama-3 rope scaling (what llama.cpp stores as rope_freqs)."""
  freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
  wavelen = 2 * np.pi / freqs
  orig = original_max_position_embeddings
  smooth = (orig / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
  mid = 1.0 / ((1 - smooth) / factor + smooth)
  return np.where(wavelen < orig / high_freq_factor, 1.0,
                  np.where(wavelen > orig / low_freq_factor, factor, mid))


def rope_scaling_from_factors(factors: np.ndarray, head_dim: int, theta: float) -> dict | None:
  """Recovers Llama-3 `rope_scaling` from a GGUF `rope_freqs` tensor.

  The factor is the largest divisor; low/high frequency factors are Llama 3's
  (1, 4); the original context comes from a smoothly scaled frequency (or the
  usual 8192). The recovered parameters must reproduce every stored factor.
  """
  factors = np.asarray(factors, np.float64).reshape(-1)
  factor = float(factors.max())
  if factor <= 1.0 + 1e-6:
    return None
  low, high = 1.0, 4.0
  wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  smooth = (1 / factors - 1 / factor) / (1 - 1 / factor)
  mid = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
  candidates = [round(float(w * (s * (high - low) + low))) for w, s in
                zip(wavelen[mid][:1], smooth[mid][:1], strict=True)] + [8192]
  for orig in candidates:
    scaling = dict(rope_type="llama3", factor=factor, low_freq_factor=low,
                   high_freq_factor=high, original_max_position_embeddings=orig)
    want = llama3_rope_factors(head_dim, theta, **{k: v for k, v in scaling.items()
                                                  if k != "rope_type"})
    if want.shape == factors.shape and np.allclose(want, factors, rtol=1e-4, atol=1e-5):
      return scaling
  raise ValueError("unsupported GGUF rope_freqs.weight: the factors are not Llama-3 rope "
                   "scaling with low/high frequency factors (1, 4)")


def _route(name: str, cfg: ModelConfig) -> tuple[str | None, int | None, bool]:
  """(params key, layer, transpose) for a GGUF tensor name."""
  if name in _CONFIG_TENSORS:  # folded into config.rope_scaling
    return None, None, False
  if name in _TOP:
    key, transpose = _TOP[name]
    if key == "lm_head" and cfg.tie_word_embeddings:
      return None, None, False
    return key, None, transpose
  m = _BLK_RE.fullmatch(name)
  if m is None or m.group(2) not in _BLOCK:
    raise ValueError(f"unsupported GGUF tensor {name!r} for a {cfg.model_type} model")
  key, transpose = _BLOCK[m.group(2)]
  return key, int(m.group(1)), transpose
