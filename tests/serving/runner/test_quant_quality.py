"""Quality gate of weight / KV quantization on the default model (SmolLM2-135M).

Each format runs the shipped sample (tests/data/quality_sample.txt, ~400
tokens of English and code) teacher-forced as one prefill through the
runner's paged cache (scanned layers: fast compiles) and is compared with the
float32 model: mean KL of the next-token distributions and greedy agreement.
The float32 reference is the GGUF's own Q4_1 weights dequantized, so int4
with the file's group of 32 reproduces it, while group 64 re-quantizes a
4-bit grid. int4 g64 is gated as `xlaserve convert` makes it: GPTQ on the
shipped calibration text (serving/tools/calibration_text.py, not this sample);
plain rounding (what `--quantization=int4` does at load) is kept as a
looser regression case. Measured values (2026-12-03) are in the comments.
"""

import numpy as np
import pytest
import quant_testutil as qt

import checkpoints
from checkpoints import load_quantized, quantizers
from serving.models import quantized as quant
from serving.runner.model_runner import ModelRunner
from serving.tools.gptq import calibrated_int4

pytestmark = pytest.mark.slow  # quantized default model against float32

PRESET = "smollm2-135m-instruct"
_RESULTS: dict[str, tuple[np.ndarray, dict]] = {}


@pytest.fixture(scope="module")
def smollm():
  try:
    return checkpoints.load_checkpoint(PRESET)
  except FileNotFoundError as e:
    pytest.skip(str(e))


@pytest.fixture(scope="module")
def tokens(smollm):
  return qt.sample_tokens(smollm.tokenizer)


def _evaluate(name, make_params, smollm, tokens, **kw):
  """Logits and params byte counts of one format (cached for the module); `make_params()`
  gives its params, called only on the first evaluation (quantizing takes seconds)."""
  if name not in _RESULTS:
    cfg = qt.eval_config(**kw)
    runner = ModelRunner.from_params(make_params(), smollm.config, cfg,
                                     num_pages=cfg.cache.num_pages)
    nbytes = {"total": quant.params_nbytes(runner.params),
              "layers": quant.params_nbytes(runner.params["layers"])}
    _RESULTS[name] = (qt.teacher_forced_logits(runner, tokens), nbytes)
  return _RESULTS[name]


@pytest.fixture(scope="module")
def reference(smollm, tokens):
  return _evaluate("float32", lambda: smollm.params, smollm, tokens)


# name, engine options, params transform, max mean KL, min greedy agreement.
CASES = [
    ("int8", dict(quantization="int8"), None, 0.0005, 0.97),  # KL 0.00001, agree 1.0
    ("int4-g64", dict(quantization="int4"), "gptq", 0.09, 0.84),  # 0.070, 0.88 (GPTQ)
    ("int4-g64-rtn", dict(quantization="int4"), "rtn", 0.35, 0.7),  # 0.255, 0.77 (rounding)
    ("fp8", dict(quantization="fp8"), None, 0.06, 0.85),  # 0.039, 0.90
    ("kv-int8", dict(kv_cache_dtype="int8"), None, 0.003, 0.95),  # 0.00095, 0.975
    ("kv-fp8", dict(kv_cache_dtype="fp8"), None, 0.01, 0.95),  # 0.0052, 0.977
]


def _int4_g64(smollm, how):
  """int4 group 64 by GPTQ (as `xlaserve convert` stores it) or by plain rounding."""
  if how == "gptq":
    return calibrated_int4(smollm, group_size=64)
  return quantizers.quantize_params(smollm.params, "int4", group_size=64)


@pytest.mark.parametrize("name,kw,how,max_kl,min_agree", CASES, ids=[c[0] for c in CASES])
def test_quality_vs_float32(name, kw, how, max_kl, min_agree, smollm, tokens, reference):
  # The runner keeps already-quantized leaves; the others quantize at load.
  params = (lambda: smollm.params) if how is None else (lambda: _int4_g64(smollm, how))
  logits, _ = _evaluate(name, params, smollm, tokens, **kw)
  stats = qt.compare(reference[0], logits)
  print(f"{name}: {stats}")
  assert stats["kl"] < max_kl and stats["agree"] >= min_agree, stats


def test_gguf_blocks_served_as_is(smollm, tokens, reference):
  """Q4_1 layers + Q8_0 embedding kept as blocks: the float32 model up to rounding."""
  loaded = load_quantized(PRESET, "int4")
  layer = loaded.params["layers"]["wq"]
  assert (layer.kind, layer.group_size, layer.offset is not None) == ("int4", 32, True)
  assert (loaded.params["embed"].kind, loaded.params["embed"].group_size) == ("int8", 32)
  logits, nbytes = _evaluate("gguf-int4", lambda: loaded.params, smollm, tokens,
                            quantization="int4")
  assert nbytes["total"] < 0.2 * reference[1]["total"]
  stats = qt.compare(reference[0], logits)
  print(f"gguf-int4: {stats}")
  assert stats["kl"] < 1e-4 and stats["agree"] >= 0.99, stats


def test_weight_bytes(smollm, tokens, reference):
  """int8 is ~1/2 of bf16 plus a float16 scale and min per 32; int4 layers ~1/4 plus
  group scales and mins."""
  bf16 = {k: v // 2 for k, v in reference[1].items()}  # every float32 leaf at 2 bytes
  # Both were evaluated by test_quality_vs_float32 when it ran first: nothing quantized again.
  int8 = _evaluate("int8", lambda: quantizers.quantize_params(smollm.params, "int8"), smollm,
                   tokens, quantization="int8")[1]
  int4 = _evaluate("int4-g64-rtn", lambda: _int4_g64(smollm, "rtn"), smollm, tokens,
                   quantization="int4")[1]
  # 1 byte a weight + a float16 scale and min per 32 weights = 0.5625 of 2 bytes.
  assert 0.55 < int8["total"] / bf16["total"] < 0.57
  # 0.5 byte a weight + float16 scale and min per 64 weights = 0.5625 of 2 bytes.
  assert 0.25 < int4["layers"] / bf16["layers"] < 0.29
  assert int4["total"] < 0.35 * bf16["total"]  # LM head (tied embedding) stays int8


def test_int8_free_running_on_heldout_prompts(smollm, default_llm):
  """int8 groups (the default quantizer) keep >= 10 of 12 32-token greedy
  continuations of held-out chat prompts identical to the float32 engine's."""
  reference = qt.free_running(default_llm)
  int8 = qt.free_running(qt.engine_for(load_quantized(PRESET, "int8"), quantization="int8"))
  assert qt.identical(reference, int8) >= 10
