"""DeepSeek-V3 (MLA over a latent KV cache, DeepSeek MoE) through the engine against
transformers (float32).

The tiny models (tests/tiny_models.py): `deepseek_v3` (q LoRA, interleaved RoPE, one
dense layer then grouped routing with a correction bias and a shared expert) and
`deepseek_v3_yarn` (a direct q projection as in V2-Lite, rotate-half RoPE, YaRN with
mscale_all_dim in the softmax scale, no shared experts). A ragged batch of prompts
up to 45 tokens (longer ones chunked: the prefill budget is 32) runs concurrently;
64 greedy tokens must equal a greedy loop over the torch model and the first step's
top-20 logprobs its log-softmax within 1e-4. Scanned and unrolled layers (the dense
layer is static only when unrolled). Also: the start-up capacity line reports latent
bytes per token, and a config with an unsupported value or a missing key is refused.
"""

from __future__ import annotations

import numpy as np
import pytest

from serving.config import EngineConfig
from serving.entrypoints.engine_builder import build_engine
from serving.models.model_config import ModelConfig
from serving.runner.kv_cache import kv_bytes_per_token
from serving.types import SamplingParams
from tiny_models import FAMILIES, assert_matches_torch, run_requests, save_tiny_model

PROMPT_LENS = [3, 11, 20, 45]  # 45 > max_num_batched_tokens: chunked prefill
NEW_TOKENS = 64
LOGPROB_TOL = 1e-4


def engine_config(**kw) -> EngineConfig:
  base = dict(max_num_seqs=4, max_model_len=128, page_size=8, num_pages=72,
              max_num_batched_tokens=32, attention_block_tokens=16, unroll_layers=False,
              compilation_cache=False)
  return EngineConfig.of(**{**base, **kw})


@pytest.mark.slow
@pytest.mark.parametrize("family,unroll", [("deepseek_v3", False), ("deepseek_v3", True),
                                           ("deepseek_v3_yarn", True)])
def test_matches_transformers(family, unroll, tmp_path):
  model = save_tiny_model(family, str(tmp_path))
  engine = build_engine(str(tmp_path), engine_config(unroll_layers=unroll))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 256, n).tolist() for n in PROMPT_LENS]
  params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=20)
  assert_matches_torch(model, prompts, run_requests(engine, prompts, params), NEW_TOKENS,
                       LOGPROB_TOL)


def test_latent_cache_bytes(tmp_path, capfd):
  save_tiny_model("deepseek_v3", str(tmp_path))
  # Nothing runs: one bucket each keeps the warm-up short (13.5 -> 5.3 CPU-s cold); the
  # pool and the start-up line do not depend on the buckets.
  engine = build_engine(str(tmp_path), engine_config(prefill_buckets=(32,), decode_buckets=(4,)))
  startup = capfd.readouterr().err
  cfg = engine.runner.model_cfg
  per_token = 3 * (32 + 8) * 4  # layers x (kv_lora_rank + qk_rope_head_dim) x float32
  assert kv_bytes_per_token(cfg, "float32") == per_token
  assert kv_bytes_per_token(cfg, "bfloat16") == per_token // 2
  kv = engine.runner.state.kv
  assert kv.k.shape[2:] == (1, 40) and kv.v.size == 0
  assert engine.runner.kv_pool_bytes() == kv.k.shape[0] // 3 * 8 * per_token
  assert f"{per_token} B/token, float32; latent cache, 3 layers x 40 per token" in startup


def test_unsupported_config_refused():
  raw = FAMILIES["deepseek_v3"]().to_dict()
  with pytest.raises(ValueError, match="hidden_act"):
    ModelConfig.from_hf_config({**raw, "hidden_act": "gelu"})
  with pytest.raises(ValueError, match="kv_lora_rank"):
    ModelConfig.from_hf_config({k: v for k, v in raw.items() if k != "kv_lora_rank"})
  with pytest.raises(ValueError, match="rope type"):
    ModelConfig.from_hf_config({**raw, "rope_parameters": {"rope_type": "dynamic",
                                                           "rope_theta": 1e4}})


@pytest.mark.slow
def test_pallas_kernel_backend_matches_transformers(tmp_path):
  """Decode rows through the latent Pallas kernel (interpret mode) in the engine."""
  model = save_tiny_model("deepseek_v3", str(tmp_path))
  engine = build_engine(str(tmp_path), engine_config(attention_backend="pallas_interpret",
                                                     max_num_seqs=2))
  assert engine.runner.backend == "pallas_interpret"
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, 256, n).tolist() for n in (7, 36)]
  params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=20)
  assert_matches_torch(model, prompts, run_requests(engine, prompts, params), 16, LOGPROB_TOL)


def test_config_round_trips_through_the_orbax_metadata():
  from checkpoints.orbax_io import config_from_dict, config_to_dict

  for family in ("deepseek_v3", "deepseek_v3_yarn"):
    cfg = ModelConfig.from_hf_config(FAMILIES[family]().to_dict())
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_lora_refused_before_placement(tmp_path):
  save_tiny_model("deepseek_v3", str(tmp_path))
  with pytest.raises(ValueError, match="LoRA adapters on a multi-head latent attention"):
    build_engine(str(tmp_path), engine_config(max_loras=1))


def test_latent_pages_move_between_pools():
  """Disaggregated serving's page export / import (kv_cache.read_pages / write_pages) on a
  latent pool: the rows come back, the empty value pool stays empty."""
  import jax.numpy as jnp

  from serving.runner.kv_cache import create_kv_cache, read_pages, write_pages

  cfg = ModelConfig.from_hf_config(FAMILIES["deepseek_v3"]().to_dict())
  src = create_kv_cache(cfg, num_pages=6, page_size=4, dtype="float32")
  rows = jnp.arange(src.k.size, dtype=jnp.float32).reshape(src.k.shape)
  src = type(src)(k=rows, v=src.v, num_pages=6, dtype="float32")
  pages = jnp.asarray([2, 5], jnp.int32)
  k, v = read_pages(src, pages)
  assert k.shape == (3, 2, 4, 1, 40) and v.shape == (3, 2, 4, 1, 0)
  dst = write_pages(create_kv_cache(cfg, num_pages=6, page_size=4, dtype="float32"),
                    jnp.asarray([1, 3], jnp.int32), k, v)
  np.testing.assert_array_equal(np.asarray(read_pages(dst, jnp.asarray([1, 3]))[0]),
                                np.asarray(k))
