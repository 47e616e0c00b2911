"""Phi-3 / Phi-4-mini against `transformers` (float32): greedy tokens and logprobs.

Tiny random-weight `Phi3ForCausalLM`s (tests/tiny_models.py): "phi3" has
Phi-4-mini's shape (RoPE on 3/4 of each head, LongRoPE, tied embeddings),
"phi3_mini" Phi-3-mini-4k's (plain RoPE); both get a 16-token sliding window,
which every prompt here exceeds. A ragged batch runs through the real engine
(paged KV cache, chunked prefill, continuous batching): 64 greedy tokens must
equal a greedy loop over the torch model, and the first step's top-20
logprobs its log-softmax within 1e-4.

LongRoPE: transformers picks the short or the long factor set per call from
the sequence length (long past `original_max_position_embeddings`, 128 here);
the engine fixes the set by `max_model_len` (long iff it exceeds 128, as vLLM
does). Each regime is checked where both pick the same set, and a prompt
outside it shows the fixed choice is really in force.
"""

import numpy as np
import pytest

from serving.config import EngineConfig
from serving.entrypoints.engine_builder import build_engine
from serving.types import SamplingParams
from tiny_models import VOCAB, save_tiny_model, torch_greedy

GEN = 64
LOGPROB_TOL = 1e-4
ORIGINAL_CONTEXT = 128  # tiny "phi3"'s original_max_position_embeddings


def engine_config(max_model_len: int) -> EngineConfig:
  return EngineConfig.of(max_num_seqs=4, max_model_len=max_model_len, page_size=8,
                         num_pages=128, max_num_batched_tokens=32, attention_block_tokens=16,
                         unroll_layers=False, compilation_cache=False)


def run_engine(engine, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
  """Greedy GEN tokens per prompt (one batch), with the top-20 logprobs of each step."""
  params = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True, logprobs=20)
  results = {i: [] for i in range(len(prompts))}
  for i, p in enumerate(prompts):
    engine.add_request(f"r{i}", p, params, results[i].append)
  engine.run_until_idle()
  return [(sum((o.token_ids for o in outs), []), sum((o.logprobs or [] for o in outs), []))
          for outs in results.values()]


def first_step_error(logprobs: list, ref_lp: np.ndarray) -> float:
  """Largest gap between the engine's first-step top-20 logprobs and the reference's."""
  top = logprobs[0].top
  return float(np.max(np.abs(np.array([lp for _, lp in top]) - ref_lp[[i for i, _ in top]])))


def prompts_of(lengths: list[int]) -> list[list[int]]:
  rng = np.random.default_rng(0)
  return [rng.integers(0, VOCAB, n).tolist() for n in lengths]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["phi3", "phi3_mini"])
def test_short_context_matches_transformers(family, tmp_path):
  """max_model_len 128: LongRoPE's short set, as transformers uses up to 128 tokens."""
  model = save_tiny_model(family, str(tmp_path))
  engine = build_engine(str(tmp_path), engine_config(ORIGINAL_CONTEXT))
  prompts = prompts_of([17, 30, 45, 60])  # > the window; 45 and 60 > a 32-token chunk
  for prompt, (tokens, logprobs) in zip(prompts, run_engine(engine, prompts), strict=True):
    ref_tokens, ref_lp = torch_greedy(model, prompt, GEN)
    assert tokens == ref_tokens
    assert first_step_error(logprobs, ref_lp) < LOGPROB_TOL


@pytest.mark.slow
def test_long_context_matches_transformers(tmp_path):
  """max_model_len 256: the long set, as transformers uses past 128 tokens; a short
  prompt then differs from transformers (which would use the short set for it)."""
  model = save_tiny_model("phi3", str(tmp_path))
  engine = build_engine(str(tmp_path), engine_config(256))
  prompts = prompts_of([129, 170, 40])
  outs = run_engine(engine, prompts)
  for prompt, (tokens, logprobs) in zip(prompts[:2], outs[:2], strict=True):
    ref_tokens, ref_lp = torch_greedy(model, prompt, GEN)
    assert tokens == ref_tokens
    assert first_step_error(logprobs, ref_lp) < LOGPROB_TOL
  _, short_ref_lp = torch_greedy(model, prompts[2], 1)
  assert first_step_error(outs[2][1], short_ref_lp) > 3 * LOGPROB_TOL
