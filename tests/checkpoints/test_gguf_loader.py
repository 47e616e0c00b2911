"""GGUF: block formats against independent numpy decoders; whole models; the real file."""

import dataclasses
import os

import gguf
import numpy as np
import pytest
from ckpt_testutil import (
  add_tokenizer,
  assert_params_equal,
  expected_params,
  gguf_from_model,
  tiny_model,
)

from checkpoints import gguf as gguf_io
from checkpoints import load_checkpoint
from checkpoints.gguf_reader import GGUFFile, metadata_value
from serving.models.model_config import ModelConfig

Q = gguf.GGMLQuantizationType
ROWS, COLS = 6, 512


# -- independent block decoders (from ggml-quants.c), one block at a time ------------------

def _f16(b):
  return np.float32(np.frombuffer(bytes(b), np.float16)[0])


def _nibbles(qs):
  return np.concatenate([qs & 0xF, qs >> 4]).astype(np.float32)


def decode_q8_0(b):
  return _f16(b[:2]) * np.frombuffer(bytes(b[2:34]), np.int8).astype(np.float32)


def decode_q4_0(b):
  return _f16(b[:2]) * (_nibbles(b[2:18]) - 8)


def decode_q4_1(b):
  return _f16(b[:2]) * _nibbles(b[4:20]) + _f16(b[2:4])


def _scale_min_k4(j, s):
  if j < 4:
    return s[j] & 63, s[j + 4] & 63
  return (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


def decode_q4_k(b):
  d, dmin, scales, qs = _f16(b[0:2]), _f16(b[2:4]), b[4:16].astype(int), b[16:144]
  out = []
  for chunk in range(4):
    q = qs[32 * chunk:32 * chunk + 32]
    sc1, m1 = _scale_min_k4(2 * chunk, scales)
    sc2, m2 = _scale_min_k4(2 * chunk + 1, scales)
    out.append(d * sc1 * (q & 0xF) - dmin * m1)
    out.append(d * sc2 * (q >> 4) - dmin * m2)
  return np.concatenate(out)


def decode_q6_k(b):
  ql, qh = b[0:128].astype(int), b[128:192].astype(int)
  sc = np.frombuffer(bytes(b[192:208]), np.int8).astype(np.float32)
  d = _f16(b[208:210])
  y = np.zeros(256, np.float32)
  for half in range(2):
    l_, h_, s_, o = ql[64 * half:], qh[32 * half:], sc[8 * half:], 128 * half
    for l in range(32):
      i = l // 16
      q1 = ((l_[l] & 0xF) | (((h_[l] >> 0) & 3) << 4)) - 32
      q2 = ((l_[l + 32] & 0xF) | (((h_[l] >> 2) & 3) << 4)) - 32
      q3 = ((l_[l] >> 4) | (((h_[l] >> 4) & 3) << 4)) - 32
      q4 = ((l_[l + 32] >> 4) | (((h_[l] >> 6) & 3) << 4)) - 32
      y[o + l], y[o + l + 32] = d * s_[i] * q1, d * s_[i + 2] * q2
      y[o + l + 64], y[o + l + 96] = d * s_[i + 4] * q3, d * s_[i + 6] * q4
  return y


DECODERS = {Q.Q8_0: decode_q8_0, Q.Q4_0: decode_q4_0, Q.Q4_1: decode_q4_1,
            Q.Q4_K: decode_q4_k, Q.Q6_K: decode_q6_k}


def decode_blocks(raw: np.ndarray, qtype) -> np.ndarray:
  block, size = gguf.GGML_QUANT_SIZES[qtype]
  rows = raw.reshape(raw.shape[0], -1, size)
  return np.stack([np.concatenate([DECODERS[qtype](blk) for blk in row]) for row in rows])


def _hand_blocks(rng, qtype) -> np.ndarray:
  """Random bytes with finite float16 scales, for types gguf-py cannot quantize."""
  block, size = gguf.GGML_QUANT_SIZES[qtype]
  raw = rng.integers(0, 256, (ROWS, COLS // block, size), dtype=np.uint8)
  scale_at = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}[qtype]
  for at in scale_at:
    raw[..., at:at + 2] = rng.uniform(-0.05, 0.05, raw.shape[:2] + (1,)).astype(
        np.float16).view(np.uint8)
  return raw.reshape(ROWS, -1)


@pytest.fixture(scope="module")
def quant_file(tmp_path_factory):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
  path = str(tmp_path_factory.mktemp("q") / "quant.gguf")
  w = gguf.GGUFWriter(path, "llama")
  stored = {}
  for qtype in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
    stored[qtype] = gguf.quants.quantize(x, qtype)
    w.add_tensor(f"t.{qtype.name}", stored[qtype], raw_dtype=qtype)
  for qtype in (Q.Q4_K, Q.Q6_K):
    stored[qtype] = _hand_blocks(rng, qtype)
    w.add_tensor(f"t.{qtype.name}", stored[qtype], raw_dtype=qtype)
  w.add_tensor("t.IQ2_XXS", np.zeros((ROWS, COLS // 256 * 66), np.uint8), raw_dtype=Q.IQ2_XXS)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path, x, stored


def _tensor(reader, name):
  return next(t for t in reader.tensors if t.name == name)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_block_dequantization(quant_file, qtype):
  path, x, stored = quant_file
  t = _tensor(GGUFFile(path), f"t.{qtype.name}")
  assert t.tensor_type == qtype and t.shape == (COLS, ROWS)
  got = gguf_io.dequantize_tensor(t)
  want = decode_blocks(stored[qtype], qtype)
  assert got.shape == (ROWS, COLS)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):  # round trip of real data stays close
    np.testing.assert_allclose(got, x, atol=np.abs(x).max() / (6 if qtype == Q.Q8_0 else 3))
  raw = gguf_io.raw_tensor(GGUFFile(path), f"t.{qtype.name}")
  assert raw.ggml_type == qtype and raw.shape == (ROWS, COLS)
  np.testing.assert_array_equal(raw.data, stored[qtype])


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda q: q.name)
def test_float_types(quant_file, qtype):
  path, x, stored = quant_file
  got = gguf_io.dequantize_tensor(_tensor(GGUFFile(path), f"t.{qtype.name}"))
  if qtype == Q.BF16:
    want = (stored[qtype].view(np.uint16).astype(np.uint32) << 16).view(np.float32)
  else:
    want = stored[qtype].astype(np.float32)
  np.testing.assert_array_equal(got, want.reshape(ROWS, COLS))


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_five_bit_round_trip(quant_file, qtype):
  path, x, _ = quant_file
  got = gguf_io.dequantize_tensor(_tensor(GGUFFile(path), f"t.{qtype.name}"))
  assert got.shape == x.shape
  np.testing.assert_allclose(got, x, atol=np.abs(x).max() / 12)


def test_unsupported_quant_type(quant_file):
  t = _tensor(GGUFFile(quant_file[0]), "t.IQ2_XXS")
  with pytest.raises(ValueError, match="IQ2_XXS"):
    gguf_io.dequantize_tensor(t)


def test_fast_reader_matches_gguf_py(quant_file):
  path = quant_file[0]
  ours, ref = GGUFFile(path), gguf.GGUFReader(path)
  for key in ref.fields:
    if not key.startswith("GGUF."):
      assert metadata_value(ours, key) == metadata_value(ref, key), key
  for a, b in zip(ours.tensors, ref.tensors, strict=True):
    assert (a.name, a.tensor_type, a.shape) == (b.name, b.tensor_type, tuple(b.shape))
    np.testing.assert_array_equal(a.data, b.data)


# -- whole models ---------------------------------------------------------------------------

@pytest.mark.parametrize("model_type,arch", [("llama", "llama"), ("qwen2", "qwen2"),
                                             ("qwen3", "qwen3"), ("qwen3_moe", "qwen3moe"),
                                             ("mixtral", "llama"), ("phi3", "phi3")])
def test_model_round_trip(tmp_path, model_type, arch):
  """HF weights -> GGUF laid out like llama.cpp (Q/K permuted for llama) -> our params."""
  model = tiny_model(model_type, seed=3)
  path = str(tmp_path / "m.gguf")
  gguf_from_model(model, path, arch)
  loaded = load_checkpoint(path)
  assert loaded.config.model_type == model_type
  assert loaded.config.num_kv_heads == 2 and loaded.config.vocab_size == 261
  assert_params_equal(loaded.params, expected_params(model))
  assert loaded.tokenizer.decode(loaded.tokenizer.encode(" the")) == " the"


def test_split_gguf(tmp_path):
  model = tiny_model("qwen3", seed=4)
  gguf_from_model(model, str(tmp_path / "m.gguf"), "qwen3", split_max_tensors=7)
  splits = sorted(p.name for p in tmp_path.iterdir())
  assert len(splits) > 2 and splits[0] == f"m-00001-of-{len(splits):05d}.gguf"
  for name in (splits[0], splits[-1]):
    assert_params_equal(load_checkpoint(str(tmp_path / name)).params, expected_params(model))


@pytest.mark.parametrize("orig,factor", [(64, 8.0), (8192, 32.0)])
def test_llama3_rope_freqs_become_rope_scaling(tmp_path, orig, factor):
  """Llama 3.x GGUFs carry rope scaling as a rope_freqs tensor; we recover the config."""
  rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor,
          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": orig}
  model = tiny_model("llama", head_dim=128 if orig == 8192 else 16, rope_parameters=rope)
  path = str(tmp_path / "l3.gguf")
  gguf_from_model(model, path, "llama")
  loaded = load_checkpoint(path)
  want = ModelConfig.from_hf_config(model.config.to_dict()).rope_scaling
  assert want is not None and loaded.config.rope_scaling == want
  assert_params_equal(loaded.params, expected_params(model))


def test_phi3_gguf_config_equals_hf(tmp_path):
  """llama.cpp's Phi-3 metadata (rope dims, original context, sliding window, attention
  factor) and rope_factors_long / _short tensors give the config the HF directory gives
  (floats as float32, which the file stores and the rotary math uses)."""
  model = tiny_model("phi3", seed=5)
  path = str(tmp_path / "phi3.gguf")
  gguf_from_model(model, path, "phi3")
  got = load_checkpoint(path).config
  want = ModelConfig.from_hf_config(model.config.to_dict())
  assert want.partial_rotary_factor == 0.75 and want.sliding_window == 16
  got_rs, want_rs = got.rope_scaling, want.rope_scaling
  for name in ("short_factor", "long_factor", "attention_factor"):
    np.testing.assert_array_equal(np.float32(getattr(got_rs, name)),
                                  np.float32(getattr(want_rs, name)), err_msg=name)
  assert got_rs.original_max_position_embeddings == want_rs.original_max_position_embeddings
  assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)
  same = dict(bos_token_id=None, eos_token_ids=(), rope_scaling=None, rms_norm_eps=0.0)
  assert dataclasses.replace(got, **same) == dataclasses.replace(want, **same)


def test_unsupported_architecture(tmp_path):
  path = str(tmp_path / "phi.gguf")
  w = gguf.GGUFWriter(path, "phi2")
  add_tokenizer(w)
  w.add_tensor("token_embd.weight", np.zeros((261, 8), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(ValueError, match="phi2"):
    load_checkpoint(path)


# -- the real default model -----------------------------------------------------------------

def test_real_gguf_config_and_shapes(smollm):
  cfg = smollm.config
  assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
          cfg.vocab_size, cfg.head_dim) == ("llama", 30, 576, 9, 3, 49152, 64)
  assert cfg.tie_word_embeddings and "lm_head" not in smollm.params
  assert cfg.intermediate_size == 1536 and cfg.rope_theta == 100000.0
  layers = smollm.params["layers"]
  assert layers["wq"].shape == (30, 576, 576) and layers["wk"].shape == (30, 576, 192)
  assert layers["w_down"].shape == (30, 1536, 576) and smollm.params["embed"].shape == (49152, 576)
  assert all(v.dtype == np.float32 for v in layers.values())
  assert cfg.bos_token_id == 1 and 2 in cfg.eos_token_ids


@pytest.fixture(scope="module")
def transformers_qk(smollm_path, tmp_path_factory):
  """transformers' GGUF loader run on a file holding a few of the real raw Q/K tensors."""
  transformers = pytest.importorskip("transformers")
  import torch
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

  src = GGUFFile(smollm_path)
  # Few layers: transformers' name mapping costs O(layers * modules).
  names = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.1.attn_k.weight",
           "blk.2.attn_q.weight"]
  path = str(tmp_path_factory.mktemp("qk") / "qk.gguf")
  w = gguf.GGUFWriter(path, "llama")
  w.add_uint32("llama.block_count", 3)
  for key in ("context_length", "embedding_length", "feed_forward_length",
              "attention.head_count", "attention.head_count_kv", "vocab_size",
              "rope.dimension_count"):
    w.add_uint32(f"llama.{key}", metadata_value(src, f"llama.{key}"))
  for name in names:
    raw = gguf_io.raw_tensor(src, name, unpermute=False)
    w.add_tensor(name, np.ascontiguousarray(raw.data), raw_dtype=raw.ggml_type)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  parsed = load_gguf_checkpoint(path, return_tensors=False)["config"]
  config = transformers.LlamaConfig(**{k: v for k, v in parsed.items() if k[0] != "_"})
  with torch.device("meta"):
    model = transformers.LlamaForCausalLM(config)
  tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
  return {k: v.float().numpy() for k, v in tensors.items()}


@pytest.mark.parametrize("layer,proj", [(0, "q"), (0, "k"), (1, "k"), (2, "q")])
def test_real_qk_unpermute_matches_transformers(smollm, smollm_path, transformers_qk, layer,
                                                proj):
  want = transformers_qk[f"model.layers.{layer}.self_attn.{proj}_proj.weight"]  # [out, in]
  np.testing.assert_array_equal(smollm.params["layers"][f"w{proj}"][layer], want.T)
  name = gguf_io.gguf_tensor_name(f"w{proj}", layer)
  assert name == f"blk.{layer}.attn_{proj}.weight"
  raw = gguf_io.raw_tensor(GGUFFile(smollm_path), name)
  from_raw = gguf.quants.dequantize(raw.data, raw.ggml_type)
  np.testing.assert_array_equal(from_raw, want)


def test_real_tensor_types(smollm_path):
  types = {t.tensor_type for t in GGUFFile(smollm_path).tensors}
  assert types == {Q.F32, Q.Q4_1, Q.Q8_0}
  assert os.path.getsize(smollm_path) > 50e6
