"""LoRA parity against `transformers` + `peft` (float32), every family.

For a tiny random model of each family, three random PEFT adapters of two
ranks (4 and 8; one with rsLoRA, one on attention only) are served at once
with requests of the base model in the same batches (3 slots, prompts of
several lengths, chunked prefill): each request's first-step top logprobs
must equal peft's log-softmax within 1e-4, and 12 greedy tokens must be
identical to a greedy loop over the peft model. MoE families take adapters
on their attention projections (experts have no slots); Phi-3's adapters are
on its fused qkv_proj / gate_up_proj modules.
"""

import numpy as np
import pytest
from lora_testutil import (
  ALL_TARGETS,
  ATTENTION_TARGETS,
  FUSED_ATTENTION_TARGETS,
  FUSED_TARGETS,
  save_random_adapter,
)
from tiers import fast_first

from serving.config import EngineConfig
from serving.entrypoints.engine_builder import build_engine
from serving.types import SamplingParams
from tiny_models import SWEEP_FAMILIES, VOCAB, save_tiny_model, torch_greedy

NUM_TOKENS = 12
LOGPROB_TOL = 1e-4
MOE = {"mixtral", "qwen3_moe", "gpt_oss"}
FUSED = {"phi3", "phi3_mini"}  # adapters on qkv_proj / gate_up_proj



@pytest.mark.parametrize("family", fast_first(SWEEP_FAMILIES, fast=("llama",)))
def test_lora_matches_peft(family, tmp_path, request):
  base = save_tiny_model(family, str(tmp_path / "base"))
  attention = FUSED_ATTENTION_TARGETS if family in FUSED else ATTENTION_TARGETS
  full = attention if family in MOE else (FUSED_TARGETS if family in FUSED else ALL_TARGETS)
  specs = {"a4": dict(rank=4, targets=full),
           "b8": dict(rank=8, targets=attention),
           "c8": dict(rank=8, targets=full, rslora=True, alpha=4.0)}
  refs = {None: base}
  for i, (name, kw) in enumerate(specs.items()):
    refs[name] = save_random_adapter(base, str(tmp_path / name), seed=10 + i, scale=0.5, **kw)
  config = EngineConfig.of(max_num_seqs=8, max_model_len=96, page_size=8, num_pages=96,
                        max_num_batched_tokens=32, attention_block_tokens=16,
                        unroll_layers=family == "smollm2", compilation_cache=False,
                        max_loras=3, max_lora_rank=8)
  engine = build_engine(str(tmp_path / "base"), config,
                        lora_modules={n: str(tmp_path / n) for n in specs})
  rng = np.random.default_rng(1)
  requests = [(lora, rng.integers(0, VOCAB, n).tolist())
              for lora, n in [(None, 5), ("a4", 11), ("b8", 20), ("c8", 37), ("a4", 3),
                              (None, 37), ("c8", 9)]]
  params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
  results = {i: [] for i in range(len(requests))}
  for i, (lora, prompt) in enumerate(requests):
    engine.add_request(f"r{i}", prompt, params, results[i].append, lora=lora)
  engine.run_until_idle()
  for i, (lora, prompt) in enumerate(requests):
    outs = results[i]
    tokens = sum((o.token_ids for o in outs), [])
    first = outs[0].logprobs[0]
    ref_tokens, ref_lp = torch_greedy(refs[lora], prompt, NUM_TOKENS)
    assert tokens == ref_tokens, f"request {i} (adapter {lora})"
    top_ids = [t for t, _ in first.top]
    np.testing.assert_allclose([lp for _, lp in first.top], ref_lp[top_ids], atol=LOGPROB_TOL)
  # The adapters matter: each changes the base model's first-step distribution.
  prompt = requests[0][1]
  base_lp = torch_greedy(base, prompt, 1)[1]
  for name in specs:
    assert np.abs(torch_greedy(refs[name], prompt, 1)[1] - base_lp).max() > 1e-2, name
  assert engine.stats().lora_swaps_total == 3
  assert engine.allocator.num_free == engine.allocator.num_usable


def test_prefix_cache_is_keyed_by_adapter(tmp_path):
  """The same prompt on the base model, then under an adapter, then again: the adapter's
  first run must not reuse the base model's cached pages (its output would be wrong),
  its second run reuses its own."""
  base = save_tiny_model("llama", str(tmp_path / "base"))
  ref = save_random_adapter(base, str(tmp_path / "a"), rank=4, seed=3, scale=0.5)
  config = EngineConfig.of(max_num_seqs=2, max_model_len=96, page_size=8, num_pages=48,
                        max_num_batched_tokens=32, attention_block_tokens=16,
                        unroll_layers=False, compilation_cache=False, max_loras=1,
                        max_lora_rank=4, enable_prefix_caching=True)
  engine = build_engine(str(tmp_path / "base"), config, lora_modules={"a": str(tmp_path / "a")})
  prompt = np.random.default_rng(5).integers(0, VOCAB, 41).tolist()  # five full pages
  params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
  hits = []
  for lora in (None, "a", "a"):
    outs, before = [], engine.stats().prefix_cache_hits_total
    engine.add_request(f"{lora}-{len(hits)}", prompt, params, outs.append, lora=lora)
    engine.run_until_idle()
    hits.append(engine.stats().prefix_cache_hits_total - before)
    tokens = sum((o.token_ids for o in outs), [])
    assert tokens == torch_greedy(ref if lora else base, prompt, 6)[0], lora
  assert hits == [0, 0, 40]
