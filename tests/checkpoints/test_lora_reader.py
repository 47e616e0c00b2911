"""The PEFT LoRA reader (checkpoints/lora.py): layout, scaling, and every refusal.

Adapters are written from the format's description (tests/lora_testutil.py);
the parity test (tests/serving/models/test_lora_parity.py) covers files
written by `peft` itself.
"""

from __future__ import annotations

import json
import math
import os

import ml_dtypes
import numpy as np
import pytest
from lora_testutil import write_peft_adapter

from checkpoints.lora import LoraError, load_lora_adapter, module_dims
from serving.models.model_config import ModelConfig

CFG = ModelConfig(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
MOE = ModelConfig(model_type="mixtral", vocab_size=300, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32)
DIMS = module_dims(CFG)
PREFIX = "base_model.model.model.layers"


def write(tmp_path, name="a", **kw):
  return write_peft_adapter(str(tmp_path / name), kw.pop("dims", DIMS), kw.pop("layers", 2),
                            rank=kw.pop("rank", 4), seed=0, **kw)


def test_layout_and_scaling(tmp_path):
  path = write(tmp_path, rank=4, alpha=8)
  w = load_lora_adapter(path, CFG, max_rank=8)
  assert w.rank == 4 and w.scaling == 2.0
  assert sorted(w.layers) == [0, 1] and w.targets == tuple(sorted(DIMS))
  from safetensors.numpy import load_file
  raw = load_file(os.path.join(path, "adapter_model.safetensors"))
  a, b = w.layers[1]["wo"]
  np.testing.assert_array_equal(a, raw[f"{PREFIX}.1.self_attn.o_proj.lora_A.weight"].T)
  np.testing.assert_allclose(b, 2.0 * raw[f"{PREFIX}.1.self_attn.o_proj.lora_B.weight"].T)
  assert a.shape == (64, 4) and b.shape == (4, 64)


def test_rslora_and_bfloat16(tmp_path):
  path = write(tmp_path, rank=4, alpha=8, use_rslora=True, dtype=ml_dtypes.bfloat16)
  w = load_lora_adapter(path, CFG, max_rank=4)
  assert math.isclose(w.scaling, 8 / 2)  # alpha / sqrt(r)
  assert w.layers[0]["wq"][0].dtype == np.float32


def test_some_modules_and_layers_only(tmp_path):
  path = write(tmp_path, dims={"wq": DIMS["wq"], "w_down": DIMS["w_down"]}, layers=1)
  w = load_lora_adapter(path, CFG, max_rank=8)
  assert list(w.layers) == [0] and w.targets == ("w_down", "wq")


def test_moe_attention_adapter_loads(tmp_path):
  path = write(tmp_path, dims={k: v for k, v in module_dims(MOE).items()})
  assert load_lora_adapter(path, MOE, max_rank=8).targets == ("wk", "wo", "wq", "wv")


def _bad(tmp_path, name, **tensors):
  return write(tmp_path, name=name, tensors=tensors)


@pytest.mark.parametrize("case,why", [
    ("rank", "exceeds the server's max_lora_rank=2"),
    ("shape", "does not fit the base model"),
    ("half", "must both be present"),
    ("nan", "NaN or infinite"),
    ("int", "2-D float tensor"),
    ("embed", "embeddings, the LM head"),
    ("layer", "layer 7 but the model has 2"),
    ("expert", "cannot take an adapter"),
    ("dora", "use_dora"),
    ("bias", "bias"),
    ("pattern", "rank_pattern"),
    ("empty", "holds no LoRA tensors"),
    ("truncated", "cannot read the safetensors file"),
    ("json", "not valid JSON"),
    ("noweights", "no adapter_model.safetensors"),
    ("notdir", "is not a directory"),
])
def test_refusals(tmp_path, case, why):
  q = f"{PREFIX}.0.self_attn.q_proj"
  cfg, max_rank = CFG, 8
  if case == "rank":
    path, max_rank = write(tmp_path), 2
  elif case == "shape":
    path = _bad(tmp_path, case, **{f"{q}.lora_A.weight": np.zeros((4, 63), np.float32)})
  elif case == "half":
    path = _bad(tmp_path, case, **{f"{q}.lora_B.weight": None})
  elif case == "nan":
    path = _bad(tmp_path, case, **{f"{q}.lora_A.weight": np.full((4, 64), np.nan, np.float32)})
  elif case == "int":
    path = _bad(tmp_path, case, **{f"{q}.lora_A.weight": np.zeros((4, 64), np.int32)})
  elif case == "embed":
    path = _bad(tmp_path, case, **{"base_model.model.model.embed_tokens.lora_embedding_A":
                                   np.zeros((4, 300), np.float32)})
  elif case == "layer":
    path = _bad(tmp_path, case, **{f"{PREFIX}.7.self_attn.q_proj.lora_A.weight":
                                   np.zeros((4, 64), np.float32)})
  elif case == "expert":
    cfg = MOE
    path = write(tmp_path, name=case, dims={"wq": DIMS["wq"]}, tensors={
        f"{PREFIX}.0.block_sparse_moe.experts.0.w1.lora_A.weight": np.zeros((4, 64), np.float32)})
  elif case in ("dora", "bias", "pattern"):
    extra = {"dora": {"use_dora": True}, "bias": {"bias": "all"},
             "pattern": {"rank_pattern": {"q_proj": 2}}}[case]
    path = write(tmp_path, name=case, **extra)
  elif case == "empty":
    path = write(tmp_path, name=case, dims={})
  elif case == "truncated":
    path = write(tmp_path, name=case)
    file = os.path.join(path, "adapter_model.safetensors")
    data = open(file, "rb").read()
    open(file, "wb").write(data[:len(data) // 2])
  elif case == "json":
    path = write(tmp_path, name=case)
    open(os.path.join(path, "adapter_config.json"), "w").write("{not json")
  elif case == "noweights":
    path = write(tmp_path, name=case)
    os.remove(os.path.join(path, "adapter_model.safetensors"))
  else:
    path = str(tmp_path / "missing")
  with pytest.raises(LoraError, match=why.replace("(", r"\(")):
    load_lora_adapter(path, cfg, max_rank=max_rank)


def test_config_must_be_an_object(tmp_path):
  path = write(tmp_path)
  with open(os.path.join(path, "adapter_config.json"), "w") as f:
    json.dump([1, 2], f)
  with pytest.raises(LoraError, match="expected a JSON object"):
    load_lora_adapter(path, CFG, max_rank=8)


def _fused(rng, rank: int, d_in: int, d_out: int) -> dict[str, np.ndarray]:
  return {"A": rng.standard_normal((rank, d_in)).astype(np.float32),
          "B": rng.standard_normal((d_out, rank)).astype(np.float32)}


def test_fused_phi3_modules_split_into_their_parts(tmp_path):
  """Phi-3's qkv_proj / gate_up_proj adapters: one A shared by the parts, B's rows cut
  at q | k | v and gate | up (so each part's update is exactly its rows of B A x)."""
  rng = np.random.default_rng(1)
  qkv, gate_up = _fused(rng, 4, 64, 64 + 2 * 32), _fused(rng, 4, 64, 2 * 128)
  tensors = {f"{PREFIX}.0.self_attn.qkv_proj.lora_{h}.weight": qkv[h] for h in "AB"}
  tensors |= {f"{PREFIX}.0.mlp.gate_up_proj.lora_{h}.weight": gate_up[h] for h in "AB"}
  path = write(tmp_path, dims={}, layers=0, rank=4, alpha=8, tensors=tensors)
  w = load_lora_adapter(path, CFG, max_rank=4)
  assert w.targets == ("w_gate", "w_up", "wk", "wq", "wv")
  for key, (module, lo, hi) in {"wq": (qkv, 0, 64), "wk": (qkv, 64, 96),
                                "wv": (qkv, 96, 128), "w_gate": (gate_up, 0, 128),
                                "w_up": (gate_up, 128, 256)}.items():
    a, b = w.layers[0][key]
    np.testing.assert_array_equal(a, module["A"].T)
    np.testing.assert_allclose(b, 2.0 * module["B"][lo:hi].T, err_msg=key)


def test_fused_and_separate_module_refused(tmp_path):
  rng = np.random.default_rng(2)
  qkv = _fused(rng, 4, 64, 128)
  tensors = {f"{PREFIX}.0.self_attn.qkv_proj.lora_{h}.weight": qkv[h] for h in "AB"}
  path = write(tmp_path, dims={"wk": DIMS["wk"]}, layers=1, rank=4, tensors=tensors)
  with pytest.raises(LoraError, match="layer 0 wk: adapted twice"):
    load_lora_adapter(path, CFG, max_rank=4)


def test_fused_module_shape_checked(tmp_path):
  rng = np.random.default_rng(3)
  qkv = _fused(rng, 4, 64, 96)  # this model's q, k and v take 128 rows
  tensors = {f"{PREFIX}.0.self_attn.qkv_proj.lora_{h}.weight": qkv[h] for h in "AB"}
  path = write(tmp_path, dims={}, layers=0, rank=4, tensors=tensors)
  with pytest.raises(LoraError, match=r"shape \(96, 4\) .*expected \(128, 4\)"):
    load_lora_adapter(path, CFG, max_rank=4)
