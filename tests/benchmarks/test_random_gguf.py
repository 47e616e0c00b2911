"""benchmarks/random_gguf.py: the random-weight GGUFs load with our GGUF loader as the shape
says, carry the default model's tokenizer, and hold the values the writer generated."""

import os
import sys

import gguf
import numpy as np
import pytest

from checkpoints import gguf as gguf_io
from checkpoints import load_checkpoint, loader, presets

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import llama_server  # noqa: E402 (benchmarks/ is not a package)
import random_gguf  # noqa: E402

TINY = random_gguf.LlamaShape("tiny", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)
# Largest error of one element: Q8_0 half a step of amax / 127; Q4_0 a step of amax / 8.
STEP = {gguf.GGMLQuantizationType.Q8_0: 1 / 127, gguf.GGMLQuantizationType.Q4_0: 1 / 7}


@pytest.fixture(scope="module")
def default_gguf():
  try:
    return presets.resolve_preset(random_gguf.TOKENIZER_SOURCE)
  except FileNotFoundError as e:
    pytest.skip(str(e))


@pytest.fixture(scope="module")
def default(default_gguf):
  """Our LoadedModel of the default model (whose tokenizer the random files copy)."""
  return load_checkpoint(default_gguf)


@pytest.mark.parametrize("qtype", list(STEP), ids=lambda q: q.name)
def test_written_file_loads_with_the_shape(tmp_path, default_gguf, default, qtype):
  path = str(tmp_path / "tiny.gguf")
  random_gguf.write_gguf(path, TINY, qtype, default_gguf, seed=3)
  model = loader.load_gguf(path)
  cfg = model.config
  assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
          cfg.intermediate_size) == (64, 2, 4, 2, 16, 128)
  assert cfg.vocab_size == default.config.vocab_size == 49152
  assert cfg.tie_word_embeddings
  assert (cfg.rope_theta, cfg.rms_norm_eps) == (TINY.rope_theta, pytest.approx(TINY.rms_eps))
  text = "Random weights, the default model's tokenizer."
  assert model.tokenizer.encode(text) == default.tokenizer.encode(text)
  assert model.config.eos_token_ids == default.config.eos_token_ids
  np.testing.assert_array_equal(model.params["layers"]["attn_norm"], 1.0)
  np.testing.assert_array_equal(model.params["final_norm"], 1.0)
  reader = gguf_io.read_gguf(path)
  for name in ("token_embd.weight", "blk.1.ffn_down.weight"):
    (tensor,) = [t for t in reader.tensors if t.name == name]
    assert tensor.tensor_type == qtype
    want = random_gguf.tensor_values(name, dict(random_gguf.tensor_specs(TINY, 49152))[name], 3)
    got = gguf_io.dequantize_tensor(tensor).reshape(want.shape)
    assert 0.015 < want.std() < 0.025
    np.testing.assert_allclose(got, want, atol=np.abs(want).max() * STEP[qtype] + 1e-6)


def test_ensure_model_writes_once_and_checks_its_arguments(tmp_path, monkeypatch, default_gguf):
  monkeypatch.setitem(random_gguf.SHAPES, "tiny", TINY)
  path = random_gguf.ensure_model("tiny", "q8_0", str(tmp_path), log=lambda _: None)
  assert path == random_gguf.model_path(str(tmp_path), "tiny", "q8_0")
  assert os.listdir(tmp_path) == [os.path.basename(path)]  # no partial file left
  mtime = os.path.getmtime(path)
  assert random_gguf.ensure_model("tiny", "q8_0", str(tmp_path)) == path
  assert os.path.getmtime(path) == mtime  # reused, not rewritten
  with pytest.raises(ValueError, match="llama-quantize"):
    random_gguf.ensure_model("tiny", "q4_k_m", str(tmp_path))
  with pytest.raises(ValueError, match="unknown format"):
    random_gguf.ensure_model("tiny", "q3_k", str(tmp_path))
  with pytest.raises(ValueError, match="unknown shape"):
    random_gguf.ensure_model("7b", "q4_0", str(tmp_path))


def test_params_count_matches_the_written_tensors():
  specs = random_gguf.tensor_specs(TINY, 1000)
  assert TINY.params(1000) == sum(int(np.prod(shape)) for _, shape in specs)
  assert 1.0e9 < random_gguf.SHAPES["1b"].params(49152) < 1.15e9
  assert 2.9e9 < random_gguf.SHAPES["3b"].params(49152) < 3.1e9


def test_q4_k_m_through_llama_quantize(tmp_path, monkeypatch, default_gguf):
  """Needs the llama-quantize that `benchmarks/llama_server.py llama-quantize` builds."""
  binary = os.path.expanduser(os.path.join(llama_server.DEFAULT_CACHE, "bin", "llama-quantize"))
  if not os.access(binary, os.X_OK):
    pytest.skip(f"{binary} is not built (python benchmarks/llama_server.py llama-quantize)")
  shape = random_gguf.LlamaShape("k", hidden=256, layers=2, heads=4, kv_heads=2, ffn=512)
  monkeypatch.setitem(random_gguf.SHAPES, "k", shape)
  path = random_gguf.ensure_model("k", "q4_k_m", str(tmp_path), binary, log=lambda _: None)
  assert os.listdir(tmp_path) == [os.path.basename(path)]  # the F16 file is gone
  types = {t.tensor_type for t in gguf_io.read_gguf(path).tensors}
  assert types == {gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K,
                   gguf.GGMLQuantizationType.F32}
  cfg = loader.load_gguf(path).config
  assert (cfg.hidden_size, cfg.num_layers, cfg.intermediate_size) == (256, 2, 512)
