"""Reference packers for pre-quantized HF checkpoints (GPTQ, AWQ, FP8), written from the specs.

Each packer quantizes a float `[Out, In]` weight round-to-nearest the way its
quantizer's grid is defined (GPTQ's min/max grid, AutoAWQ's
`pseudo_quantize_tensor`, absmax/448 for FP8), packs the codes into that
format's tensors, and returns them with its own dequantized `[Out, In]`
reference. `write_quantized_dir` turns a tiny model's float HF directory into one of a
format (config.json with `quantization_config`, the other tensors stored
float16 as real checkpoints do) plus a float directory of the reference
weights, and returns transformers' model of the latter: the numerical
reference for our engine.
"""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FP8_MAX = 448.0
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           # DeepSeek's MLA projections (released FP8 checkpoints quantize them too)
           "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def _pack_words(codes: np.ndarray, bits: int) -> np.ndarray:
  """[..., n, 32/bits] codes -> int32 [..., n]: code j at bits j*bits."""
  per = 32 // bits
  shifts = np.arange(per, dtype=np.uint32) * bits
  words = np.bitwise_or.reduce(codes.astype(np.uint32) << shifts, axis=-1)
  return words.astype(np.uint32).view(np.int32)


def gptq_pack(w: np.ndarray, *, bits: int = 4, group: int = 32, sym: bool = False,
              v1: bool = True, act_order: bool = False, seed: int = 0):
  """AutoGPTQ-style tensors of `w` [Out, In] and their dequantized [Out, In] reference."""
  out_dim, in_dim = w.shape
  g = in_dim if group == -1 else group
  groups, per, maxq = in_dim // g, 32 // bits, (1 << bits) - 1
  order = np.random.default_rng(seed).permutation(in_dim) if act_order else np.arange(in_dim)
  g_idx = np.empty(in_dim, np.int32)
  g_idx[order] = np.arange(in_dim) // g  # input order[j] is quantized j-th
  codes = np.zeros((in_dim, out_dim), np.int64)
  scales = np.zeros((groups, out_dim), np.float16)
  zeros = np.zeros((groups, out_dim), np.int64)
  for k in range(groups):
    cols = np.nonzero(g_idx == k)[0]
    x = w[:, cols].astype(np.float32)
    xmin, xmax = np.minimum(x.min(1), 0), np.maximum(x.max(1), 0)
    if sym:
      xmax = np.maximum(np.abs(xmin), xmax)
      xmin = np.where(xmin < 0, -xmax, xmin)
    scale = (xmax - xmin) / maxq
    scale = np.where(scale == 0, 1, scale).astype(np.float16)
    s = scale.astype(np.float32)
    zero = np.full(out_dim, (maxq + 1) // 2) if sym else np.rint(-xmin / s).astype(np.int64)
    codes[cols] = np.clip(np.rint(x / s[:, None]) + zero[:, None], 0, maxq).astype(np.int64).T
    scales[k], zeros[k] = scale, zero
  ref = (scales.astype(np.float32)[g_idx].T
         * (codes.T - zeros[g_idx].T).astype(np.float32))  # [Out, In]
  if v1:
    assert zeros.min() >= 1, "GPTQ v1 cannot store a zero point of 0"
  stored = (zeros - 1) & maxq if v1 else zeros
  tensors = {
      "qweight": _pack_words(codes.reshape(in_dim // per, per, out_dim).swapaxes(1, 2), bits),
      "qzeros": _pack_words(stored.reshape(groups, out_dim // per, per), bits),
      "scales": scales,
      "g_idx": g_idx,
  }
  return tensors, ref


def awq_pack(w: np.ndarray, *, group: int = 32):
  """AutoAWQ GEMM tensors of `w` [Out, In] (zero point) and the dequantized reference."""
  out_dim, in_dim = w.shape
  x = w.astype(np.float32).reshape(out_dim, in_dim // group, group)  # [Out, G, g]
  lo, hi = x.min(-1), x.max(-1)
  scales = (np.maximum(hi - lo, 1e-5) / 15).astype(np.float16)  # [Out, G]
  s = scales.astype(np.float32)
  zeros = np.clip(-np.rint(lo / s), 0, 15).astype(np.int64)
  codes = np.clip(np.rint(x / s[..., None]) + zeros[..., None], 0, 15).astype(np.int64)
  ref = ((codes - zeros[..., None]) * s[..., None]).reshape(out_dim, in_dim).astype(np.float32)
  codes = codes.reshape(out_dim, in_dim).T  # [In, Out]

  def pack(c):  # [R, Out] -> int32 [R, Out/8], nibble j = output 8k + AWQ_ORDER[j]
    return _pack_words(c.reshape(c.shape[0], -1, 8)[..., list(AWQ_ORDER)], 4)

  return {"qweight": pack(codes), "qzeros": pack(zeros.T), "scales": scales.T.copy()}, ref


def fp8_pack(w: np.ndarray, *, strategy: str, block: tuple[int, int] | None = None):
  """float8_e4m3fn codes of `w` [Out, In] with a per-tensor, per-channel or block scale."""
  x = w.astype(np.float32)
  out_dim, in_dim = x.shape
  if strategy == "tensor":
    scale = np.array([np.abs(x).max() / FP8_MAX], np.float32)
    full = np.full_like(x, scale[0])
  elif strategy == "channel":
    scale = (np.abs(x).max(1, keepdims=True) / FP8_MAX).astype(np.float32)  # [Out, 1]
    full = np.broadcast_to(scale, x.shape)
  else:
    bo, bi = block
    nb = (-(-out_dim // bo), -(-in_dim // bi))
    scale = np.zeros(nb, np.float32)
    for r in range(nb[0]):
      for c in range(nb[1]):
        scale[r, c] = np.abs(x[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi]).max() / FP8_MAX
    full = np.repeat(np.repeat(scale, bo, 0), bi, 1)[:out_dim, :in_dim]
  q = np.clip(x / full, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
  ref = q.astype(np.float32) * full
  name = "weight_scale_inv" if strategy == "block" else "weight_scale"
  return {"weight": q, name: scale}, ref


# -- formats: (quantization_config, packer of one linear) ---------------------------------


def gptq_format(bits=4, group=32, sym=False, v1=True, act_order=False, lm_head=False):
  qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
        "sym": sym, "checkpoint_format": "gptq" if v1 else "gptq_v2", "lm_head": lm_head,
        "true_sequential": True}
  return qc, lambda w, seed: gptq_pack(w, bits=bits, group=group, sym=sym, v1=v1,
                                       act_order=act_order, seed=seed)


def awq_format(group=32):
  qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
        "version": "gemm", "modules_to_not_convert": None}
  return qc, lambda w, seed: awq_pack(w, group=group)


def fp8_block_format(block=(32, 32)):
  qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)}
  return qc, lambda w, seed: fp8_pack(w, strategy="block", block=block)


def compressed_fp8_format(strategy="channel", block=None):
  qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                        "dynamic": False, "block_structure": block and list(block)},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                  "symmetric": True, "dynamic": False}}}}

  def pack(w, seed):
    tensors, ref = fp8_pack(w, strategy=strategy, block=block)
    if "weight_scale_inv" in tensors:  # compressed-tensors names every scale weight_scale
      tensors["weight_scale"] = tensors.pop("weight_scale_inv")
    tensors["input_scale"] = np.array([0.01], np.float32)  # static activation scale: ignored
    return tensors, ref

  return qc, pack


def _torch(a: np.ndarray) -> torch.Tensor:
  if a.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
    return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8)).view(torch.float8_e4m3fn)
  return torch.from_numpy(np.ascontiguousarray(a))


def write_quantized_dir(float_dir: str, path: str, fmt, *, quantize_head: bool = False):
  """Writes the float HF dir `float_dir` quantized with `fmt` = (quantization_config, packer)
  to `path`, and its reference as a float HF dir `path + "-ref"` (the dequantized weights;
  the other tensors rounded to float16 as stored). Returns (reference transformers model,
  float32 and eval; {tensor name: reference [Out, In]})."""
  qc, packer = fmt
  ref_dir = path + "-ref"
  shutil.copytree(float_dir, ref_dir)
  os.makedirs(path, exist_ok=True)
  with safe_open(os.path.join(float_dir, "model.safetensors"), framework="np") as f:
    sd = {k: f.get_tensor(k).astype(np.float32) for k in f.keys()}  # noqa: SIM118
  tensors, ref_sd, refs = {}, {}, {}
  for seed, (name, value) in enumerate(sorted(sd.items())):
    module = name.rsplit(".", 1)[0]
    quantize = (name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS
                or (quantize_head and name == "lm_head.weight"))
    if quantize:
      packed, ref = packer(value, seed)
      for suffix, arr in packed.items():
        tensors[f"{module}.{suffix}"] = _torch(arr)
      refs[name] = ref
      ref_sd[name] = torch.from_numpy(np.ascontiguousarray(ref))
    else:
      half = value.astype(np.float16)
      tensors[name] = torch.from_numpy(half)
      ref_sd[name] = torch.from_numpy(half.astype(np.float32))
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  save_file(ref_sd, os.path.join(ref_dir, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(float_dir, "config.json")) as f:
    config = json.load(f)
  config.update(quantization_config=qc, torch_dtype="float16", dtype="float16")
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    if os.path.exists(os.path.join(float_dir, name)):
      shutil.copy(os.path.join(float_dir, name), path)
  ref = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
  return ref.eval(), refs
