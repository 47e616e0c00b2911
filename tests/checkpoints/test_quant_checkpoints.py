"""Quantized checkpoints: GGUF blocks as QuantizedWeights, orbax round trip, convert."""

import dataclasses
from unittest import mock

import gguf
import jax
import numpy as np
import pytest
from ckpt_testutil import tiny_model

import kernels_cpu
from checkpoints import gguf as gguf_io
from checkpoints import load_hf_dir, load_orbax, load_quantized, quantizers, save_orbax
from checkpoints.layout import LoadedModel
from checkpoints.quantize import gguf_quantized_weight
from serving.models import quantized as quant

Q = gguf.GGMLQuantizationType


def _as_linear(qw):
  """A QuantizedWeight's logical [In, Out] matrix (numpy float32)."""
  return np.swapaxes(np.asarray(qw.dequantize()), -1, -2)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_block_types_match_gguf_dequantization(qtype):
  w = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)  # [Out, In]
  blocks = gguf.quants.quantize(w, qtype)
  raw = gguf_io.RawTensor(name="blk.0.ffn_up.weight", ggml_type=qtype, shape=w.shape,
                          data=blocks)
  qw = gguf_quantized_weight(raw)
  assert qw.group_size == 32 and qw.kind == ("int8" if qtype == Q.Q8_0 else "int4")
  assert (qw.offset is not None) == (qtype == Q.Q4_1)
  assert qw.nbytes <= blocks.nbytes  # the blocks' own bytes, no float copy
  want = gguf.quants.dequantize(blocks, qtype).reshape(w.shape)
  np.testing.assert_array_equal(np.asarray(qw.dequantize()), want)


def test_smollm_blocks_kept(smollm_path, smollm):
  """Q4_1 layers (Q/K un-permuted) and the Q8_0 tied embedding equal the float load."""
  loaded = load_quantized(smollm_path, "int4")
  layers = loaded.params["layers"]
  for key in ("wq", "wk", "w_down"):
    assert layers[key].kind == "int4" and layers[key].q.shape[0] == smollm.config.num_layers
    np.testing.assert_array_equal(_as_linear(layers[key][1]), smollm.params["layers"][key][1])
  emb = loaded.params["embed"]
  np.testing.assert_array_equal(np.asarray(emb.dequantize()), smollm.params["embed"])
  # int8 keeps only Q8_0 tensors: the Q4_1 layers stay float for the runner to quantize.
  int8 = load_quantized(smollm_path, "int8")
  assert not quant.is_quantized(int8.params["layers"]["wq"])
  assert quant.is_quantized(int8.params["embed"])


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_orbax_round_trip_quantized(method, tmp_path):
  path = tmp_path / "hf"
  tiny_model("llama").save_pretrained(path)
  loaded = load_hf_dir(str(path))
  params = quantizers.quantize_params(loaded.params, method, group_size=32)
  save_orbax(LoadedModel(config=loaded.config, params=params, tokenizer=None,
                         source=loaded.source), str(tmp_path / "ckpt"))
  back = load_orbax(str(tmp_path / "ckpt"), dtype="bfloat16")
  for key in ("wq", "w_down"):
    a, b = params["layers"][key], back.params["layers"][key]
    assert quant.is_quantized(b) and (b.kind, b.group_size) == (a.kind, a.group_size)
    for f in ("q", "scale", "offset"):
      x, y = getattr(a, f), getattr(b, f)
      assert (x is None) == (y is None)
      if x is not None:
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
  assert str(back.params["final_norm"].dtype) == "bfloat16"
  from checkpoints.sharded import restore_sharded
  with pytest.raises(ValueError, match="quantized weights"):
    restore_sharded(str(tmp_path / "ckpt"), mesh=None)


# GGUF types beyond Q8_0/Q4_0/Q4_1: gguf-py quantizes Q5_0/Q5_1; K-quants (no
# quantizer there) are random blocks with finite f16 super-scales. Either way
# gguf-py's own dequantization is the reference.
_F16_AT = {Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
_KIND = {Q.Q5_0: "int5", Q.Q5_1: "int5", Q.Q4_K: "int4", Q.Q5_K: "int5", Q.Q6_K: "int6"}


def random_blocks(qtype, rows: int, cols: int, seed: int = 0, scale: float = 0.05) -> np.ndarray:
  """uint8 [rows, bytes per row] of `qtype` blocks: random codes and sub-scales, f16
  super-scales uniform in +-scale."""
  rng = np.random.default_rng(seed)
  size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
  blocks = rng.integers(0, 256, (rows, cols // size, nbytes), dtype=np.uint8)
  for at in _F16_AT[qtype]:
    d = rng.uniform(-scale, scale, (rows, cols // size)).astype(np.float16)
    blocks[..., at:at + 2] = d[..., None].view(np.uint8)
  return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(_KIND))
def test_five_six_bit_and_k_quant_types_match_gguf_dequantization(qtype):
  rows, cols = 6, 512
  if qtype in (Q.Q5_0, Q.Q5_1):
    w = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    blocks = gguf.quants.quantize(w, qtype)
  else:
    blocks = random_blocks(qtype, rows, cols)
  raw = gguf_io.RawTensor(name="blk.0.ffn_up.weight", ggml_type=qtype, shape=(rows, cols),
                          data=blocks)
  qw = gguf_quantized_weight(raw)
  assert qw.kind == _KIND[qtype] and qw.super_size == (256 if "K" in qtype.name else 0)
  # The file's bits: only the 6-bit sub-scales of Q4_K/Q5_K are unpacked to a byte.
  assert qw.nbytes <= blocks.nbytes * 1.03, (qw.nbytes, blocks.nbytes)
  want = gguf.quants.dequantize(blocks, qtype).reshape(rows, cols)
  np.testing.assert_array_equal(np.asarray(qw.dequantize()), want)
  # The matmul runs on the same values (jitted, dequantized inside).
  x = np.random.default_rng(2).standard_normal((3, cols)).astype(np.float32)
  np.testing.assert_allclose(np.asarray(qw.matmul(x)), x @ want.T, rtol=1e-4, atol=1e-4)


def write_quantized_gguf(model, path: str, arch: str, block_type) -> None:
  """`model` as a GGUF whose linear tensors (2-D, and MoE experts 3-D) are blocks:
  `block_type(name, shape)` -> (GGML type, uint8 blocks) or None to keep float32."""
  from ckpt_testutil import _add_arch_metadata, _add_phi3, _block_tensors, add_tokenizer

  cfg = model.config
  sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
  w = gguf.GGUFWriter(path, arch)
  _add_arch_metadata(w, arch, cfg)
  add_tokenizer(w)
  if arch == "phi3":
    _add_phi3(w, cfg)

  def add(name, value):
    blocks = block_type(name, value) if value.ndim >= 2 else None
    if blocks is None:
      w.add_tensor(name, np.ascontiguousarray(value))
    else:
      w.add_tensor(name, blocks[1], raw_dtype=blocks[0])

  add("token_embd.weight", sd["model.embed_tokens.weight"])
  w.add_tensor("output_norm.weight", sd["model.norm.weight"])
  if not cfg.tie_word_embeddings:
    add("output.weight", sd["lm_head.weight"])
  for i in range(cfg.num_hidden_layers):
    for name, value in _block_tensors(sd, i, cfg, arch):
      add(f"blk.{i}.{name}", value)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def _runner_logits(loaded, tokens, **engine):
  from quant_testutil import eval_config, teacher_forced_logits

  from serving.runner.model_runner import ModelRunner

  ec = eval_config(max_model_len=64, num_pages=8, max_num_batched_tokens=64, **engine)
  return teacher_forced_logits(ModelRunner.from_params(loaded.params, loaded.config, ec), tokens)


def test_mixed_k_quant_file_served_as_stored(tmp_path):
  """A Q4_K_M-like file (Q4_K layers, Q6_K / Q5_K for some, Q6_K head, Q8_0 table):
  `quantization="gguf"` keeps every block, per layer where types differ, and the
  runner's logits equal the float model's (gguf-py's dequantization)."""
  from checkpoints import load_gguf

  model = tiny_model("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=261)
  types = {"blk.0.ffn_down.weight": Q.Q6_K, "blk.1.attn_v.weight": Q.Q5_K,
           "output.weight": Q.Q6_K}
  seed = iter(range(1000))

  def block_type(name, value):
    if name == "token_embd.weight":
      return Q.Q8_0, gguf.quants.quantize(value, Q.Q8_0)
    qtype = types.get(name, Q.Q4_K)
    return qtype, random_blocks(qtype, *value.shape, next(seed), scale=0.004)

  path = str(tmp_path / "mixed.gguf")
  write_quantized_gguf(model, path, "llama", block_type)
  decoded = []
  dequantize = gguf_io.dequantize_tensor
  with mock.patch.object(gguf_io, "dequantize_tensor",
                         lambda t: decoded.append(t.name) or dequantize(t)):
    kept = load_quantized(path, "gguf")
  # blocks served as stored are never decoded to float (start-up time): only the norms are
  assert decoded and all(n.endswith("norm.weight") for n in decoded), decoded
  layers = kept.params["layers"]
  assert isinstance(layers, list)  # ffn_down and attn_v differ across layers
  assert [lp["w_down"].kind for lp in layers] == ["int6", "int4"]
  assert [lp["wv"].kind for lp in layers] == ["int4", "int5"]
  assert kept.params["lm_head"].kind == "int6" and kept.params["embed"].kind == "int8"
  tokens = np.arange(3, 60, dtype=np.int32) % model.config.vocab_size
  want = _runner_logits(load_gguf(path), tokens)
  got = _runner_logits(kept, tokens, cpu_activation_bits=32)
  # Same weights; the per-layer (unrolled) and scanned forwards sum in other orders.
  np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-3)
  assert (got.argmax(-1) == want.argmax(-1)).all()
  # The K-quants' integer tiles (marked by hand: `with_activation_bits` keeps K-quants on
  # the float tiles), activations rounded to 16 bits in a 57-row prefill: off by the
  # rounding, 2^-16 of each group's largest, grown through the layers of these large
  # random weights (logits span ~280; measured 6e-4 of it, and 2.7e-3 for the same
  # weights as Q8_0 blocks on their integer tiles).
  marked = jax.tree.map(
      lambda w: (dataclasses.replace(w, activation_bits=16)
                 if quant.is_quantized(w) and quant.kquant_format(w) else w),
      kept.params, is_leaf=quant.is_quantized)
  assert marked["lm_head"].activation_bits == 16
  rounded = _runner_logits(dataclasses.replace(kept, params=marked), tokens)
  if kernels_cpu.library.vnni():  # the integer tiles ran
    assert not np.array_equal(rounded, got)
  assert np.abs(rounded - want).max() < 2e-3 * np.abs(want).max()
  assert (rounded.argmax(-1) == want.argmax(-1)).all()
  # int4 keeps only the Q4_K tensors; the others are re-quantized by the runner.
  int4 = load_quantized(path, "int4").params["layers"]  # per layer: w_down Q6_K, Q4_K
  assert quant.is_quantized(int4[0]["wq"]) and int4[0]["wq"].super_size == 256
  assert not quant.is_quantized(int4[0]["w_down"]) and quant.is_quantized(int4[1]["w_down"])
  assert not quant.is_quantized(int4[1]["wv"])
  with pytest.raises(ValueError, match="not a .gguf file"):
    load_quantized(str(tmp_path), "gguf")
  # `xlaserve convert --quantization=gguf` stores the per-layer blocks as they are.
  save_orbax(kept, str(tmp_path / "ckpt"))
  back = load_orbax(str(tmp_path / "ckpt"))
  assert [lp["w_down"].kind for lp in back.params["layers"]] == ["int6", "int4"]
  same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                      kept.params, back.params)
  assert all(jax.tree.leaves(same))


def test_moe_experts_kept_from_gguf(tmp_path):
  """A MoE GGUF with Q8_0 attention and Q4_0 / Q5_1 experts: the [E, Out, In] expert
  blocks stay quantized and the logits equal the float load's."""
  from checkpoints import load_gguf

  model = tiny_model("qwen3_moe", moe_intermediate_size=64, head_dim=16)

  def block_type(name, value):
    if "_exps" in name:
      qtype = Q.Q5_1 if "down" in name else Q.Q4_0
    elif name.startswith("blk.") and "gate_inp" not in name:
      qtype = Q.Q8_0
    else:
      return None
    return qtype, gguf.quants.quantize(value, qtype)

  path = str(tmp_path / "moe.gguf")
  write_quantized_gguf(model, path, "qwen3moe", block_type)
  kept = load_quantized(path, "gguf")
  layers = kept.params["layers"]
  assert (layers["we_gate"].kind, layers["we_down"].kind, layers["wq"].kind) == (
      "int4", "int5", "int8")
  assert layers["we_gate"].shape == (2, 4, 64, 64)  # [L, E, D, M]
  assert not quant.is_quantized(layers["router"])
  tokens = np.arange(3, 60, dtype=np.int32) % model.config.vocab_size
  got, want = _runner_logits(kept, tokens), _runner_logits(load_gguf(path), tokens)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_phi3_fused_blocks_kept_per_part(tmp_path):
  """A Q8_0 Phi-3 GGUF under quantization="gguf": each part of the fused attn_qkv and
  ffn_up tensors keeps its rows of blocks (never decoded), equal to the float load's
  split, and the runner's logits equal the float model's."""
  from checkpoints import load_gguf

  model = tiny_model("phi3")

  def block_type(name, value):
    return Q.Q8_0, gguf.quants.quantize(value, Q.Q8_0)

  path = str(tmp_path / "phi3-q8.gguf")
  write_quantized_gguf(model, path, "phi3", block_type)
  kept, floats = load_quantized(path, "gguf"), load_gguf(path)
  assert kept.config == floats.config and kept.config.family == "phi3"
  for key in ("wq", "wk", "wv", "w_gate", "w_up", "w_down"):
    w = kept.params["layers"][key]
    assert quant.is_quantized(w) and w.kind == "int8", key
    np.testing.assert_array_equal(_as_linear(w), floats.params["layers"][key], err_msg=key)
  tokens = np.arange(3, 40, dtype=np.int32) % model.config.vocab_size
  np.testing.assert_allclose(_runner_logits(kept, tokens), _runner_logits(floats, tokens),
                             rtol=1e-4, atol=1e-4)
