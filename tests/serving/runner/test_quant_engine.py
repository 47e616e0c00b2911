"""Quantized serving end to end on a tiny model: convert -> orbax -> LLM (unrolled layers)."""

import subprocess

import pytest
from frontend_procs import launcher_cmd, subprocess_env

from serving import LLM, SamplingParams
from serving.models import quantized as quant

ENGINE = dict(max_num_seqs=2, max_model_len=128, num_pages=32, max_num_batched_tokens=32,
              dtype="float32")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  tiny_models = pytest.importorskip("tiny_models")
  path = tmp_path_factory.mktemp("tiny") / "smollm2"
  tiny_models.save_tiny_model("smollm2", str(path))  # tied embedding, hidden 96
  return path


@pytest.mark.slow  # xlaserve convert, then a server over its output
def test_convert_int4_then_serve_with_int8_kv(tiny_dir, tmp_path, capsys):
  out = tmp_path / "orbax-int4"
  cmd = launcher_cmd("convert", f"--model={tiny_dir}", f"--output={out}", "--quantization=int4")
  r = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  llm = LLM(str(out), kv_cache_dtype="int8", **ENGINE)  # pre-quantized: no flag needed
  report = capsys.readouterr().err
  assert "Weights:" in report and "B/token (int8)" in report
  params = llm.engine.runner.params
  assert isinstance(params["layers"], list)  # unrolled on CPU
  wq = params["layers"][0]["wq"]
  assert quant.is_quantized(wq) and (wq.kind, wq.group_size) == ("int4", 32)  # 96 % 64 != 0
  assert quant.is_quantized(params["embed"])
  greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
  out_q = llm.generate(["hello world"], greedy)[0]
  assert len(out_q.token_ids) == 8
  ref = LLM(str(tiny_dir), **ENGINE).generate(["hello world"], greedy)[0]
  assert out_q.token_ids[:2] == ref.token_ids[:2]


def test_dense_copy_and_integer_activations_serve(tiny_dir, capsys):
  """`quantized_dense_copy`: prefill and batches over 8 rows multiply the copy (float32
  here, so the same values), small batches the codes: the same greedy tokens as plain
  int4. `cpu_activation_bits` marks the nibble weights for the VNNI tiles: 16 bits keep
  the float tiles' greedy tokens here, 8 bits run."""
  greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
  prompts = ["hello world", "the quick brown fox jumps"]
  plain = LLM(str(tiny_dir), quantization="int4", cpu_activation_bits=32,
              **ENGINE).generate(prompts, greedy)
  both = LLM(str(tiny_dir), quantization="int4", quantized_dense_copy=True,
             weight_dtype="float32", cpu_activation_bits=32, **ENGINE)
  assert "float32 copies for prefill and large batches" in capsys.readouterr().err
  wq = both.engine.runner.params["layers"][0]["wq"]
  assert wq.full is not None and wq.full.shape == wq.q.shape[:-1] + (wq.in_features,)
  assert [o.token_ids for o in both.generate(prompts, greedy)] == [o.token_ids for o in plain]
  q16 = LLM(str(tiny_dir), quantization="int4", cpu_activation_bits=16, **ENGINE)
  assert q16.engine.runner.params["layers"][0]["wq"].activation_bits == 16
  assert [o.token_ids for o in q16.generate(prompts, greedy)] == [o.token_ids for o in plain]
  q8 = LLM(str(tiny_dir), quantization="int4", cpu_activation_bits=8, **ENGINE)
  assert q8.engine.runner.params["layers"][0]["wq"].activation_bits == 8
  assert all(len(o.token_ids) == 8 for o in q8.generate(prompts, greedy))
