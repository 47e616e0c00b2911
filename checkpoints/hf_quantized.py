"""Hugging Face checkpoints already quantized with GPTQ, AWQ or FP8, kept as stored.

A HF directory whose config.json has a `quantization_config` is loaded here
(`load_hf_quantized_params`, called by `checkpoints.loader.load_hf_dir`).
Every quantized linear (q/k/v/o/gate/up/down projections, and `lm_head` when
the checkpoint quantized it) becomes a `serving.models.quantized.QuantizedWeight`
holding the checkpoint's own codes and scales, re-laid out but never rounded
again (no float round trip); everything else (norms, embeddings, biases, an
unquantized head, modules the quantizer skipped) loads as in checkpoints/hf.py.
Per-layer weights are stacked `[L, ...]` like the float leaves; layers whose
layouts differ are returned as a list of per-layer dicts (run unrolled).

Formats (docs/quantization.md, "Pre-quantized Hugging Face checkpoints"):

- GPTQ (`quant_method: "gptq"`, AutoGPTQ / GPTQModel, bits 2, 4 or 8):
  `qweight` int32 `[In*b/32, Out]` (32/b codes an int32 along the input axis,
  lowest bits first), `qzeros` int32 `[G, Out*b/32]` (packed along the output
  axis), `scales` `[G, Out]`, `g_idx` int32 `[In]`; `w[i, o] = scales[g_idx[i], o]
  * (code[i, o] - zero[g_idx[i], o])`. `checkpoint_format: "gptq"` (v1) stores
  zero - 1. With act-order the inputs are stored sorted by group and `perm`
  says which input each stored column is.
- AWQ (`quant_method: "awq"`, `version: "gemm"`, 4 bits): `qweight` int32
  `[In, Out/8]` and `qzeros` `[G, Out/8]` packed along the output axis, the
  8 nibbles of an int32 holding outputs [0, 2, 4, 6, 1, 3, 5, 7]; `scales`
  `[G, Out]`; value `scales * (code - zero)`.
- FP8 (`quant_method: "fp8"`, HF FineGrainedFP8 / DeepSeek style, and
  `"compressed-tensors"` with float 8-bit weights): `weight` float8_e4m3fn
  `[Out, In]` with `weight_scale_inv` / `weight_scale` per tensor, per output
  channel or per `[bo, bi]` block. Static activation scales (`input_scale`) and
  KV-cache scales (`k_scale` / `v_scale`) are ignored: serving is weight-only.

DeepSeek-V3 FP8 (block-scaled, as released): the routed experts, `o_proj` and a
direct `q_proj` stay FP8; the MLA projections (q_a / q_b / kv_a / kv_b, which
are split or padded into the params layout), the dense MLP and the shared
experts are dequantized to float at load (serving/models/deepseek.py).

MoE expert projections of a quantized checkpoint stay quantized, one `[E, ...]`
weight per layer (dequantized inside the step before the grouped matmul);
with act-order perms they are dequantized to float leaves instead (the
grouped matmul has no permuted-input path). Anything
else (other methods, bit widths, AWQ GEMV, packed int compressed-tensors,
Marlin formats, per-module `dynamic` overrides) raises ValueError naming
what is supported.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open

from checkpoints import hf
from checkpoints.layout import Params, ParamsBuilder
from checkpoints.quantize import stack_blocks
from checkpoints.quantizers import pack_int4
from serving.models import deepseek
from serving.models.model_config import ModelConfig
from serving.models.quantized import QuantizedWeight

SUPPORTED = ("gptq (bits 2/4/8, checkpoint_format gptq or gptq_v2, any group_size, act-order), "
             "awq (version gemm, 4 bits), fp8 (float8_e4m3fn weights with per-tensor, "
             "per-channel or block scales), compressed-tensors (float-quantized / "
             "naive-quantized 8-bit float weights)")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ int32 holds output 8k + AWQ_ORDER[j]
# Tensor-name suffixes that belong to a quantized linear module.
_INT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
_FP8_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale")
_IGNORED_SUFFIXES = ("input_scale", "k_scale", "v_scale")  # activation / KV-cache scales
_FP8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class Scheme:
  """A checkpoint's quantization, as parsed from its `quantization_config`."""

  method: str  # "gptq" | "awq" | "fp8"
  bits: int = 8
  group_size: int = 0  # gptq/awq: inputs per group; -1: one group over the input
  v1_zeros: bool = False  # gptq v1: stored zeros are zero - 1
  block: tuple[int, int] | None = None  # fp8: (out, in) block of one scale


def parse_quantization_config(qc: dict[str, Any]) -> Scheme:
  """The `quantization_config` of a HF config.json -> a `Scheme`; unsupported -> ValueError."""
  if not isinstance(qc, dict):
    raise ValueError(f"quantization_config must be a JSON object, got {qc!r}")
  method = str(qc.get("quant_method", "")).lower()
  if method == "gptq":
    return _gptq_scheme(qc)
  if method == "awq":
    return _awq_scheme(qc)
  if method == "fp8":
    block = qc.get("weight_block_size")
    return Scheme("fp8", block=_block(block) if block else None)
  if method == "compressed-tensors":
    return _compressed_tensors_scheme(qc)
  raise ValueError(f"unsupported quantization_config quant_method={qc.get('quant_method')!r}; "
                   f"supported: {SUPPORTED}")


def _gptq_scheme(qc):
  bits = qc.get("bits")
  if bits not in (2, 4, 8):
    raise ValueError(f"unsupported GPTQ bits={bits!r} (supported: 2, 4, 8; 3-bit packing "
                     "is not)")
  fmt = qc.get("checkpoint_format") or "gptq"
  if fmt not in ("gptq", "gptq_v2") or qc.get("is_marlin_format"):
    raise ValueError(f"unsupported GPTQ checkpoint_format={fmt!r} (supported: gptq, gptq_v2)")
  if qc.get("dynamic"):
    raise ValueError("GPTQ per-module `dynamic` overrides are not supported")
  group = _group(qc, "GPTQ")
  return Scheme("gptq", bits=bits, group_size=group, v1_zeros=fmt == "gptq")


def _awq_scheme(qc):
  bits = qc.get("bits", qc.get("w_bit"))
  version = str(qc.get("version", "gemm")).lower()
  if bits != 4 or version != "gemm":
    raise ValueError(f"unsupported AWQ bits={bits!r} version={qc.get('version')!r} (supported: "
                     "4 bits, version gemm)")
  return Scheme("awq", bits=4, group_size=_group(qc, "AWQ", key_alt="q_group_size"))


def _group(qc, what, key_alt=None):
  group = qc.get("group_size", qc.get(key_alt) if key_alt else None)
  if not isinstance(group, int) or (group != -1 and group <= 0):
    raise ValueError(f"unsupported {what} group_size={group!r} (a positive int or -1)")
  return group


def _block(block) -> tuple[int, int]:
  if (not isinstance(block, (list, tuple)) or len(block) != 2
      or not all(isinstance(b, int) and b > 0 for b in block)):
    raise ValueError(f"unsupported FP8 block size {block!r} (expected [out, in])")
  return int(block[0]), int(block[1])


def _compressed_tensors_scheme(qc):
  fmt = qc.get("format")
  groups = qc.get("config_groups") or {}
  if not groups:
    raise ValueError("compressed-tensors quantization_config has no config_groups")
  block = None
  for name, group in groups.items():
    weights = (group or {}).get("weights") or {}
    gfmt = group.get("format") or fmt
    ok = (gfmt in ("float-quantized", "naive-quantized") and weights.get("type") == "float"
          and weights.get("num_bits") == 8
          and weights.get("strategy") in ("tensor", "channel", "block"))
    if not ok:
      raise ValueError(
          f"unsupported compressed-tensors config group {name!r} (format={gfmt!r}, weights "
          f"type={weights.get('type')!r} num_bits={weights.get('num_bits')!r} strategy="
          f"{weights.get('strategy')!r}); supported: 8-bit float weights (float-quantized), "
          "strategy tensor, channel or block")
    if weights.get("strategy") == "block":
      block = _block(weights.get("block_structure"))
  return Scheme("fp8", block=block)


class _Builder(ParamsBuilder):
  """A `ParamsBuilder` whose quantized slots are filled outside it."""

  def filled_elsewhere(self, key: str, layer: int | None, expert: int | None = None) -> None:
    self._todo.discard((key, layer, expert))


def load_hf_quantized_params(path: str, cfg: ModelConfig, quantization_config: dict[str, Any],
                             dtype: Any = np.float32) -> Params:
  """The params of a pre-quantized HF directory: QuantizedWeights for quantized linears."""
  scheme = parse_quantization_config(quantization_config)
  builder = _Builder(cfg, dtype)
  modules: dict[str, dict[str, np.ndarray]] = {}
  for name, dtype_name, read in _iter_tensors(path):
    module, _, suffix = name.rpartition(".")
    if suffix in _IGNORED_SUFFIXES:
      continue
    quantized_part = (suffix in _INT_SUFFIXES if scheme.method != "fp8"
                      else suffix in _FP8_SUFFIXES or (suffix == "weight"
                                                       and dtype_name in _FP8_DTYPES))
    if scheme.method == "fp8" and suffix == "weight" and dtype_name.startswith("F8"):
      if dtype_name not in _FP8_DTYPES:
        raise ValueError(f"{name}: unsupported FP8 dtype {dtype_name} (supported: F8_E4M3)")
    if quantized_part:
      modules.setdefault(module, {})[suffix] = read()
    else:
      hf.put_tensor(builder, cfg, name, read)

  kept: dict[str, dict[int | None, QuantizedWeight]] = {}
  experts: dict[tuple[str, int], dict[int, QuantizedWeight]] = {}
  for module, tensors in modules.items():
    if cfg.family == deepseek.FAMILY and deepseek.dequantized_at_load(module, cfg):
      _put_dequantized(builder, cfg, scheme, module, tensors)
      continue
    slot = hf.linear_slot(module)
    if slot is None:
      raise ValueError(f"quantized tensors {sorted(tensors)} of {module!r} do not belong to a "
                       "linear layer this loader knows")
    key, layer, expert = slot
    if key == "lm_head" and cfg.tie_word_embeddings:
      continue
    dst = builder.params["layers"][key] if layer is not None else builder.params.get(key)
    if dst is None:
      raise ValueError(f"{module!r} maps to {key!r}, which this {cfg.model_type} config does "
                       "not have")
    in_dim, out_dim = dst.shape[-2:]
    weight = quantized_weight(scheme, tensors, in_dim, out_dim, module)
    if expert is not None:
      experts.setdefault((key, layer), {})[expert] = weight
    else:
      kept.setdefault(key, {})[layer] = weight
      builder.filled_elsewhere(key, layer)
  for (key, layer), by_expert in experts.items():
    _experts_of_layer(builder, kept, key, layer, by_expert, cfg.num_experts)
  params = builder.finish()
  return _assemble(params, kept, cfg)


def _put_dequantized(builder: _Builder, cfg: ModelConfig, scheme: Scheme, module: str,
                     tensors: dict[str, np.ndarray]) -> None:
  """A quantized linear the family keeps in float (DeepSeek's MLA projections, split or
  padded at load): dequantized to float32 `[Out, In]` and routed like a float tensor."""
  if scheme.method != "fp8":
    raise ValueError(f"{module!r}: a {cfg.model_type} checkpoint loads quantized as fp8 only, "
                     f"not {scheme.method}")
  _need(tensors, ("weight",), module, "FP8")
  out_dim, in_dim = tensors["weight"].shape
  rows = np.asarray(quantized_weight(scheme, tensors, in_dim, out_dim, module).dequantize())
  hf.put_tensor(builder, cfg, f"{module}.weight", lambda: rows)


def _experts_of_layer(builder: _Builder, kept: dict, key: str, layer: int,
                      by_expert: dict[int, QuantizedWeight], num_experts: int) -> None:
  """One layer's expert projections: a quantized `[E, ...]` weight when every expert is
  there with one layout and no act-order perm (the grouped matmul dequantizes them in
  the step), else float leaves (exact in float32)."""
  weights = [by_expert.get(e) for e in range(num_experts)]
  together = None
  if all(w is not None and w.perm is None for w in weights):
    together = stack_blocks(weights)
  if together is not None:
    kept.setdefault(key, {})[layer] = together
    for e in range(num_experts):
      builder.filled_elsewhere(key, layer, e)
    return
  for e, w in by_expert.items():
    builder.put(key, _logical(w), layer, e, source=f"layer {layer} expert {e}")


def _logical(w: QuantizedWeight) -> np.ndarray:
  """The float32 logical `[In, Out]` matrix of a QuantizedWeight (inputs in true order)."""
  rows = np.asarray(w.dequantize())  # [Out, In], stored input order
  if w.perm is not None:
    rows = rows[:, np.argsort(np.asarray(w.perm))]
  return rows.T


def _assemble(params: Params, kept: dict[str, dict[int | None, QuantizedWeight]],
              cfg: ModelConfig) -> Params:
  """Puts the kept weights into the params: stacked per key, else per layer."""
  params = dict(params)
  if None in kept.get("lm_head", {}):
    params["lm_head"] = kept.pop("lm_head")[None]
  stacked = dict(params["layers"])
  per_layer: dict[str, list] = {}
  for key, by_layer in kept.items():
    values = [by_layer.get(i, stacked[key][i]) for i in range(cfg.num_layers)]
    together = None
    if len(by_layer) == cfg.num_layers:
      together = stack_blocks(_common_perm(values))
    if together is not None:
      stacked[key] = together
    else:
      per_layer[key] = values
  if per_layer:
    params["layers"] = [{k: (per_layer[k][i] if k in per_layer else v[i])
                         for k, v in stacked.items()} for i in range(cfg.num_layers)]
  else:
    params["layers"] = stacked
  return params


def _common_perm(weights: list[QuantizedWeight]) -> list[QuantizedWeight]:
  """If some layers have act-order perms and others not, gives the others the identity."""
  if all(w.perm is None for w in weights) or all(w.perm is not None for w in weights):
    return weights
  ident = lambda w: np.arange(w.in_features, dtype=np.int32)
  return [w if w.perm is not None else dataclasses.replace(w, perm=ident(w)) for w in weights]


def quantized_weight(scheme: Scheme, tensors: dict[str, np.ndarray], in_dim: int, out_dim: int,
                     module: str = "") -> QuantizedWeight:
  """One quantized linear's checkpoint tensors (by name suffix) -> a QuantizedWeight of
  logical shape `[in_dim, out_dim]`."""
  if scheme.method == "gptq":
    return _gptq(scheme, tensors, in_dim, out_dim, module)
  if scheme.method == "awq":
    return _awq(scheme, tensors, in_dim, out_dim, module)
  return _fp8(scheme, tensors, in_dim, out_dim, module)


def _need(tensors, names, module, what):
  missing = [n for n in names if n not in tensors]
  if missing:
    raise ValueError(f"{what} module {module!r} is missing {', '.join(missing)} "
                     f"(has {', '.join(sorted(tensors))})")


def _check(arr, shape, dtypes, name):
  if tuple(arr.shape) != tuple(shape):
    raise ValueError(f"{name} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
  if arr.dtype not in [np.dtype(d) for d in dtypes]:
    raise ValueError(f"{name} has dtype {arr.dtype}, expected one of "
                     f"{[np.dtype(d).name for d in dtypes]}")


def _groups(scheme, in_dim, module, what):
  g = in_dim if scheme.group_size == -1 else scheme.group_size
  if in_dim % g:
    raise ValueError(f"{what} {module!r}: group_size {g} does not divide the input dim {in_dim}")
  return g, in_dim // g


_SCALE_DTYPES = (np.float16, np.float32, ml_dtypes.bfloat16)


def unpack_int32(packed: np.ndarray, bits: int, axis: int) -> np.ndarray:
  """int32 words -> codes (uint8), the 32/bits codes of each word lowest bits first, laid
  out consecutively along `axis` (0: rows, 1: columns) of a 2-D array."""
  per = 32 // bits
  words = np.ascontiguousarray(packed).view(np.uint32)
  shifts = (np.arange(per, dtype=np.uint32) * bits)
  mask = np.uint32((1 << bits) - 1)
  if axis == 0:  # [R, C] -> [R, per, C] -> [R*per, C]
    codes = (words[:, None, :] >> shifts[None, :, None]) & mask
    return codes.reshape(-1, words.shape[1]).astype(np.uint8)
  codes = (words[:, :, None] >> shifts[None, None, :]) & mask  # [R, C, per]
  return codes.reshape(words.shape[0], -1).astype(np.uint8)


def _gptq(scheme, t, in_dim, out_dim, module):
  _need(t, ("qweight", "qzeros", "scales"), module, "GPTQ")
  bits = scheme.bits
  per = 32 // bits
  g, groups = _groups(scheme, in_dim, module, "GPTQ")
  if in_dim % per or out_dim % per:
    raise ValueError(f"GPTQ {module!r}: {bits}-bit packing needs dims divisible by {per}, got "
                     f"[{in_dim}, {out_dim}]")
  _check(t["qweight"], (in_dim // per, out_dim), (np.int32,), f"{module}.qweight")
  _check(t["qzeros"], (groups, out_dim // per), (np.int32,), f"{module}.qzeros")
  _check(t["scales"], (groups, out_dim), _SCALE_DTYPES, f"{module}.scales")
  codes = unpack_int32(t["qweight"], bits, axis=0)  # [In, Out]
  zeros = unpack_int32(t["qzeros"], bits, axis=1).astype(np.int32)  # [G, Out]
  if scheme.v1_zeros:
    zeros = zeros + 1
  perm = None
  if "g_idx" in t:
    g_idx = np.asarray(t["g_idx"])
    _check(g_idx, (in_dim,), (np.int32, np.int64), f"{module}.g_idx")
    want = np.arange(in_dim) // g
    if not np.array_equal(g_idx, want):  # act-order: store the inputs sorted by group
      perm = np.argsort(g_idx, kind="stable").astype(np.int32)
      if not np.array_equal(g_idx[perm], want):
        counts = np.bincount(np.clip(g_idx, 0, None), minlength=groups)
        raise ValueError(
            f"GPTQ {module!r}: g_idx does not assign exactly {g} inputs to each of the "
            f"{groups} groups (counts {counts[:8].tolist()}..., min {g_idx.min()}, max "
            f"{g_idx.max()}); only such act-order layouts can be stored group-contiguous")
      codes = codes[perm]
  return _int_weight(codes.T, t["scales"].T, zeros.T, bits, g, perm, module)


def _awq(scheme, t, in_dim, out_dim, module):
  _need(t, ("qweight", "qzeros", "scales"), module, "AWQ")
  g, groups = _groups(scheme, in_dim, module, "AWQ")
  if out_dim % 8:
    raise ValueError(f"AWQ {module!r}: output dim {out_dim} is not a multiple of 8")
  _check(t["qweight"], (in_dim, out_dim // 8), (np.int32,), f"{module}.qweight")
  _check(t["qzeros"], (groups, out_dim // 8), (np.int32,), f"{module}.qzeros")
  _check(t["scales"], (groups, out_dim), _SCALE_DTYPES, f"{module}.scales")
  order = np.argsort(AWQ_ORDER)  # output 8k + j sits in nibble order[j]

  def unpack(packed):  # [R, Out/8] -> [R, Out] in true output order
    nib = unpack_int32(packed, 4, axis=1).reshape(packed.shape[0], -1, 8)
    return nib[..., order].reshape(packed.shape[0], -1)

  codes, zeros = unpack(t["qweight"]), unpack(t["qzeros"]).astype(np.int32)
  return _int_weight(codes.T, t["scales"].T, zeros.T, 4, g, None, module)


def _int_weight(codes, scale, zero, bits, g, perm, module):
  """Codes `[Out, In]` (unsigned, stored order), scale / zero `[Out, G]` -> int4 or int8."""
  scale = np.ascontiguousarray(scale)
  if bits <= 4:  # 2- and 4-bit codes both fit a nibble: value = scale * (code - zero)
    if zero.max(initial=0) > 255 or zero.min(initial=0) < 0:
      raise ValueError(f"{module!r}: zero points outside 0..255")
    symmetric = bits == 4 and bool(np.all(zero == 8))  # (code - 8) * scale: no zero needed
    if g % 2:
      raise ValueError(f"{module!r}: int4 storage needs an even group size, got {g}")
    return QuantizedWeight(q=pack_int4(codes, g), scale=scale,
                           zero=None if symmetric else zero.astype(np.uint8), perm=perm,
                           kind="int4", group_size=g)
  # 8-bit: int8 holds code - 128, and the zero point shifts by the same 128.
  q = (codes.astype(np.int16) - 128).astype(np.int8)
  if np.all(zero == 128):
    return QuantizedWeight(q=q, scale=scale, perm=perm, kind="int8", group_size=g)
  shifted = zero - 128
  if shifted.max(initial=0) > 127 or shifted.min(initial=0) < -128:
    raise ValueError(f"{module!r}: 8-bit zero points outside 0..255 (a GPTQ v1 zero of 256)")
  return QuantizedWeight(q=q, scale=scale, zero=shifted.astype(np.int8), perm=perm, kind="int8",
                         group_size=g)


def _fp8(scheme, t, in_dim, out_dim, module):
  scale_name = "weight_scale_inv" if "weight_scale_inv" in t else "weight_scale"
  _need(t, ("weight", scale_name), module, "FP8")
  w = t["weight"]
  if w.dtype != np.dtype(ml_dtypes.float8_e4m3fn):
    raise ValueError(f"FP8 {module!r}.weight has dtype {w.dtype}, expected float8_e4m3fn")
  _check(w, (out_dim, in_dim), (ml_dtypes.float8_e4m3fn,), f"{module}.weight")
  s = np.asarray(t[scale_name])
  if s.dtype not in [np.dtype(d) for d in _SCALE_DTYPES]:
    raise ValueError(f"{module}.{scale_name} has dtype {s.dtype}, expected a float")
  s = s.astype(np.float32)  # f16 / bf16 -> f32 is exact
  if scheme.block is not None:
    bo, bi = scheme.block
    want = (-(-out_dim // bo), -(-in_dim // bi))
    if s.shape == want and s.size > 1:
      if in_dim % bi:
        raise ValueError(f"FP8 {module!r}: the block's input size {bi} must divide the input "
                         f"dim {in_dim} (partial input blocks are not supported)")
      rows = np.repeat(s, bo, axis=0)[:out_dim]  # each block row's scale for its bo rows
      return QuantizedWeight(q=w, scale=np.ascontiguousarray(rows), kind="fp8", group_size=bi)
  if s.size == 1:  # per tensor
    return QuantizedWeight(q=w, scale=np.full((out_dim,), s.reshape(()), np.float32), kind="fp8")
  if s.shape in ((out_dim,), (out_dim, 1)):  # per output channel
    return QuantizedWeight(q=w, scale=np.ascontiguousarray(s.reshape(out_dim)), kind="fp8")
  blocks = "" if scheme.block is None else f", or {want} for blocks of {scheme.block}"
  raise ValueError(f"{module}.{scale_name} has shape {s.shape}; expected [1] (per tensor), "
                   f"[{out_dim}, 1] (per channel){blocks}")


# -- reading ------------------------------------------------------------------------------


def _iter_tensors(path: str):
  """Yields (name, safetensors dtype string, read) for every tensor of a HF dir; float8
  tensors (which safetensors' numpy reader refuses) are read from the file's bytes."""
  for file in hf.safetensors_files(path):
    header = _header(file)
    with safe_open(file, framework="np") as f:
      for name in f.keys():  # noqa: SIM118  (safe_open handles are not iterable)
        info = header[name]
        dt = info["dtype"]
        if dt in _FP8_DTYPES:
          read: Callable[[], np.ndarray] = (
              lambda file=file, info=info, base=header["__base__"]: _read_raw(file, info, base))
        else:
          read = lambda f=f, name=name: f.get_tensor(name)
        yield name, dt, read


def _header(file: str) -> dict[str, Any]:
  """A safetensors file's JSON header (safe_open has validated it) plus its data offset."""
  with open(file, "rb") as fh:
    (n,) = struct.unpack("<Q", fh.read(8))
    header = json.loads(fh.read(n))
  header["__base__"] = 8 + n
  return header


def _read_raw(file: str, info: dict[str, Any], base: int) -> np.ndarray:
  start, end = info["data_offsets"]
  dtype = np.dtype(_FP8_DTYPES[info["dtype"]])
  shape = tuple(info["shape"])
  if end - start != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
    raise ValueError(f"{file}: tensor byte range does not match its shape {shape}")
  with open(file, "rb") as fh:
    fh.seek(base + start)
    data = fh.read(end - start)
  return np.frombuffer(data, np.uint8).view(dtype).reshape(shape).copy()

