"""Pre-quantized HF checkpoints (GPTQ, AWQ, FP8) loaded as QuantizedWeights.

A tiny random transformers model is quantized by the reference packers of
hf_quant_testutil.py (written from each format's spec) and saved as a HF
directory with a `quantization_config`. The loaded weights must dequantize to
exactly the packer's reference, and the engine serving the directory (no
`quantization=` option) must match transformers run on the dequantized float
weights. Malformed and unsupported checkpoints raise ValueError.
"""

import json
import os

import numpy as np
import pytest
import torch
from ckpt_testutil import tiny_model
from hf_quant_testutil import (
  awq_format,
  compressed_fp8_format,
  fp8_block_format,
  gptq_format,
  write_quantized_dir,
)
from safetensors.torch import load_file, save_file

from checkpoints import load_checkpoint, load_quantized
from checkpoints.quantizers import quantize_params
from serving.config import EngineConfig
from serving.entrypoints.engine_builder import build_engine
from serving.models.quantized import LINEAR_KEYS, QuantizedWeight, is_quantized
from serving.types import SamplingParams
from tiny_models import VOCAB, save_tiny_model, torch_greedy

KEYS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w_gate",
        "up_proj": "w_up", "down_proj": "w_down"}
FORMATS = {
    "gptq4-v1-asym-g32": (gptq_format(), "int4"),
    "gptq4-v1-sym-g32": (gptq_format(sym=True), "int4"),
    "gptq4-v2-asym-g64": (gptq_format(group=64, v1=False), "int4"),
    "gptq4-v1-actorder-g32": (gptq_format(act_order=True), "int4"),
    "gptq4-v2-actorder-sym-g64": (gptq_format(group=64, v1=False, sym=True, act_order=True),
                                  "int4"),
    "gptq4-v1-group-1": (gptq_format(group=-1), "int4"),
    "gptq8-v1-sym-g32": (gptq_format(bits=8, sym=True), "int8"),
    "gptq8-v2-asym-g32": (gptq_format(bits=8, v1=False), "int8"),
    "gptq2-v2-asym-g32": (gptq_format(bits=2, v1=False), "int4"),
    "awq-g32": (awq_format(), "int4"),
    "awq-g64": (awq_format(group=64), "int4"),
    "fp8-block32": (fp8_block_format((32, 32)), "fp8"),
    "fp8-block48x32": (fp8_block_format((48, 32)), "fp8"),  # partial output blocks
    "ct-fp8-tensor": (compressed_fp8_format("tensor"), "fp8"),
    "ct-fp8-channel": (compressed_fp8_format("channel"), "fp8"),
    "ct-fp8-block32": (compressed_fp8_format("block", (32, 32)), "fp8"),
}


def _quantized_dir(tmp_path, fmt, family="llama", quantize_head=False, model=None):
  float_dir, qdir = str(tmp_path / "float"), str(tmp_path / "quant")
  if model is None:
    save_tiny_model(family, float_dir)
  else:
    model.save_pretrained(float_dir)
  ref_model, refs = write_quantized_dir(float_dir, qdir, fmt, quantize_head=quantize_head)
  return qdir, ref_model, refs


def _logical_rows(qw: QuantizedWeight) -> np.ndarray:
  """A QuantizedWeight's dequantized [Out, In] with its inputs in their true order."""
  rows = np.asarray(qw.dequantize())
  if qw.perm is not None:
    out = np.empty_like(rows)
    out[:, np.asarray(qw.perm)] = rows
    return out
  return rows


EXPERT_KEYS = {"gate_proj": "we_gate", "up_proj": "we_up", "down_proj": "we_down"}


def _check_exact(params, refs):
  for name, ref in refs.items():
    parts = name.split(".")
    if ".experts." in name:  # model.layers.{i}.mlp.experts.{e}.{proj}.weight
      leaf = params["layers"][EXPERT_KEYS[parts[6]]][int(parts[2])]
      expert = int(parts[5])
      got = _logical_rows(leaf[expert]) if is_quantized(leaf) else leaf[expert].T
      np.testing.assert_array_equal(got, ref, err_msg=name)
      continue
    if name == "lm_head.weight":
      qw = params["lm_head"]
    else:
      qw = params["layers"][KEYS[parts[4]]][int(parts[2])]
    assert is_quantized(qw), name
    np.testing.assert_array_equal(_logical_rows(qw), ref, err_msg=name)


@pytest.mark.parametrize("name", list(FORMATS))
def test_dequantize_equals_packer_reference(name, tmp_path):
  fmt, kind = FORMATS[name]
  qdir, _, refs = _quantized_dir(tmp_path, fmt)
  loaded = load_checkpoint(qdir)
  layers = loaded.params["layers"]
  for key in LINEAR_KEYS:  # stacked [L, ...] like the float leaves
    assert is_quantized(layers[key]) and layers[key].kind == kind, key
    assert layers[key].q.shape[0] == loaded.config.num_layers
    if "actorder" not in name:
      assert layers[key].perm is None, key
  if "actorder" in name:  # w_down's 128 inputs span several groups, shuffled
    assert layers["w_down"].perm is not None
  assert not is_quantized(loaded.params["lm_head"])  # not quantized in the checkpoint
  assert loaded.params["embed"].dtype == np.float32  # float16 in the file, float32 params
  _check_exact(loaded.params, refs)


def test_gptq_quantized_lm_head_and_qwen2_bias(tmp_path):
  """GPTQ with `lm_head: true` (the head kept as int4) on qwen2 (float q/k/v biases); the
  vocabulary is a multiple of 8 (GPTQ packs the head's zero points along it)."""
  qdir, _, refs = _quantized_dir(tmp_path, gptq_format(act_order=True, lm_head=True),
                                 quantize_head=True, model=tiny_model("qwen2", vocab_size=264))
  loaded = load_checkpoint(qdir, dtype="auto")  # torch_dtype float16 -> float32 params
  assert loaded.params["lm_head"].kind == "int4"
  assert loaded.params["layers"]["bq"].dtype == np.float32
  _check_exact(loaded.params, refs)


@pytest.mark.parametrize("act_order", [False, True])
def test_moe_experts(act_order, tmp_path):
  """qwen3_moe with GPTQ experts: kept as [L, E, ...] int4 weights, or, with act-order
  perms (no grouped-matmul path), dequantized exactly to float leaves."""
  qdir, _, refs = _quantized_dir(tmp_path, gptq_format(act_order=act_order),
                                 model=tiny_model("qwen3_moe", vocab_size=264,
                                                  moe_intermediate_size=64))
  assert any(".experts." in n for n in refs)
  loaded = load_checkpoint(qdir)
  layers = loaded.params["layers"]
  assert layers["wq"].kind == "int4"
  assert is_quantized(layers["we_gate"]) != act_order
  if not act_order:
    assert layers["we_gate"].q.shape[:2] == (loaded.config.num_layers, 4)  # [L, E, ...]
  _check_exact(loaded.params, refs)


def test_requested_quantization_keeps_checkpoint_codes(tmp_path):
  """`quantization="int8"` on a GPTQ dir: the GPTQ leaves stay, only the head is rounded."""
  qdir, _, refs = _quantized_dir(tmp_path, gptq_format())
  loaded = load_quantized(qdir, "int8")
  params = quantize_params(loaded.params, "int8")
  assert params["layers"]["wq"].kind == "int4" and params["lm_head"].kind == "int8"
  _check_exact(params, refs)


def _engine_config():
  return EngineConfig.of(max_num_seqs=2, max_model_len=64, page_size=8, num_pages=32,
                      max_num_batched_tokens=32, attention_block_tokens=16, unroll_layers=False,
                      compilation_cache=False)


@pytest.mark.parametrize("name,family", [("gptq4-v1-actorder-g32", "qwen2"),
                                         ("awq-g32", "llama"), ("fp8-block32", "llama"),
                                         ("ct-fp8-channel", "llama"),
                                         ("gptq8-v2-asym-g32", "llama"),
                                         ("awq-g32", "qwen3_moe")])  # quantized experts
def test_engine_matches_transformers_on_dequantized_weights(name, family, tmp_path):
  qdir, ref_model, _ = _quantized_dir(tmp_path, FORMATS[name][0], family=family)
  engine = build_engine(qdir, _engine_config())  # no quantization= option
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in (5, 19)]
  params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
  results = {i: [] for i in range(len(prompts))}
  for i, p in enumerate(prompts):
    engine.add_request(f"r{i}", p, params, results[i].append)
  engine.run_until_idle()
  for i, prompt in enumerate(prompts):
    outs = results[i]
    tokens = sum((o.token_ids for o in outs), [])
    first = sum((o.logprobs or [] for o in outs), [])[0]
    ref_tokens, ref_lp = torch_greedy(ref_model, prompt, 8)
    assert tokens == ref_tokens
    ids = [t for t, _ in first.top]
    np.testing.assert_allclose([lp for _, lp in first.top], ref_lp[ids], atol=1e-4)


# -- malformed and unsupported checkpoints -----------------------------------------------


def _edit(qdir, tensors=None, config=None):
  path = os.path.join(qdir, "model.safetensors")
  if tensors is not None:
    sd = load_file(path)
    tensors(sd)
    save_file(sd, path)
  if config is not None:
    with open(os.path.join(qdir, "config.json")) as f:
      cfg = json.load(f)
    config(cfg["quantization_config"])
    with open(os.path.join(qdir, "config.json"), "w") as f:
      json.dump(cfg, f)


QPROJ = "model.layers.1.self_attn.q_proj"


@pytest.mark.parametrize("case,fmt,tensors,config,match", [
    ("missing qzeros", gptq_format(), lambda sd: sd.pop(f"{QPROJ}.qzeros"), None,
     "missing qzeros"),
    ("qweight shape", gptq_format(), lambda sd: sd.update(
        {f"{QPROJ}.qweight": sd[f"{QPROJ}.qweight"][:4].contiguous()}), None, "qweight has shape"),
    ("scales shape", awq_format(), lambda sd: sd.update(
        {f"{QPROJ}.scales": sd[f"{QPROJ}.scales"][:, :8].contiguous()}), None, "scales has shape"),
    ("gptq 3 bits", gptq_format(), None, lambda qc: qc.update(bits=3), "bits=3"),
    ("awq gemv", awq_format(), None, lambda qc: qc.update(version="gemv"), "version gemm"),
    ("marlin", gptq_format(), None, lambda qc: qc.update(checkpoint_format="marlin"),
     "checkpoint_format"),
    ("bitsandbytes", gptq_format(), None, lambda qc: qc.update(quant_method="bitsandbytes"),
     "quant_method='bitsandbytes'.*supported: gptq"),
    ("uneven act-order groups", gptq_format(act_order=True), lambda sd: sd.update(
        {f"{QPROJ}.g_idx": torch.zeros_like(sd[f"{QPROJ}.g_idx"])}), None,
     "g_idx does not assign exactly 32"),
    ("fp8 scale shape", fp8_block_format(), lambda sd: sd.update(
        {f"{QPROJ}.weight_scale_inv": torch.ones(3, 5)}), None, "weight_scale_inv has shape"),
    ("fp8 missing scale", compressed_fp8_format(), lambda sd: sd.pop(f"{QPROJ}.weight_scale"),
     None, "missing weight_scale"),
    ("int compressed-tensors", compressed_fp8_format(), None,
     lambda qc: qc["config_groups"]["group_0"]["weights"].update(type="int", num_bits=4),
     "8-bit float weights"),
])
def test_malformed_checkpoint_raises(case, fmt, tensors, config, match, tmp_path):
  qdir, _, _ = _quantized_dir(tmp_path, fmt)
  _edit(qdir, tensors, config)
  with pytest.raises(ValueError, match=match):
    load_checkpoint(qdir)
