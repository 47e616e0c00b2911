"""A DeepSeek-V3 checkpoint in block-scaled FP8 (as released: `weight_scale_inv` per
[16, 16] block here) through the existing FP8 loader and the engine.

Every linear is stored FP8, the MLA projections included (hf_quant_testutil.LINEARS);
the routed experts, `o_proj` stay FP8 in the params, the MLA projections, the dense MLP
and the shared expert are dequantized at load. The reference is transformers on the
dequantized weights: greedy tokens equal, first-step logprobs within 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest
from hf_quant_testutil import fp8_block_format, write_quantized_dir

from serving.config import EngineConfig
from serving.entrypoints.engine_builder import build_engine
from serving.models.quantized import is_quantized
from serving.types import SamplingParams
from tiny_models import assert_matches_torch, run_requests, save_tiny_model


@pytest.mark.slow
def test_fp8_block_checkpoint_matches_transformers(tmp_path):
  float_dir, qdir = str(tmp_path / "float"), str(tmp_path / "fp8")
  save_tiny_model("deepseek_v3", float_dir)
  ref_model, _ = write_quantized_dir(float_dir, qdir, fp8_block_format((16, 16)))
  engine = build_engine(qdir, EngineConfig.of(
      max_num_seqs=2, max_model_len=64, page_size=8, num_pages=24, max_num_batched_tokens=32,
      attention_block_tokens=16, compilation_cache=False))
  layers = engine.runner.params["layers"]
  layer = layers[1] if isinstance(layers, list) else layers
  for key in ("wo", "we_gate", "we_down"):
    assert is_quantized(layer[key]) and layer[key].kind == "fp8", key
  for key in ("wq_b", "wkv_a", "w_uk", "w_gate"):
    assert not is_quantized(layer[key]), key
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, 256, n).tolist() for n in (5, 37)]
  params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5)
  assert_matches_torch(ref_model, prompts, run_requests(engine, prompts, params), 16, 1e-4)
