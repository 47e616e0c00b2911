"""Qwen3-Next against `transformers` in float32, through the real engine.

Tiny random models (tests/tiny_models.py: two blocks of three Gated DeltaNet
layers and one gated full-attention layer; MoE with a shared expert, and dense)
serve a ragged batch concurrently: 64 greedy tokens per request must equal a
greedy loop over the torch model, and the first step's top-20 logprobs its
log-softmax within 1e-4. Prompts are both shorter and longer than the scheduler's
prefill chunk (32 tokens: a long prompt's linear-layer states carry across steps'
chunks through its state slot) and, in a second configuration taking whole
prompts per step, longer than the delta rule's 64-token block (the state carries
across blocks within a chunk).

Two configurations compile only the buckets their runs call (recorded on the
default buckets). Whole prompts per step: one 256-token prefill, then 4-row
decodes, so the 16- to 128-token prefill buckets and the 1- and 2-row decode
buckets never ran; it keeps the one bucket of each and plans the same steps.
Unrolled layers with multi-step decoding: the multi-step program ran at 4 rows
only (14 calls); its 1- and 2-row programs, 8 unrolled layers x 4 steps each,
were 41 of the 110 CPU-seconds its warm-up compiled. It keeps the 4-row decode
bucket, so its six single-step decode calls of 1-2 rows (and its prefill
chunks) are padded to 4 rows, the padding every serving batch takes; the
other configurations run 1- and 2-row decodes.
"""

import numpy as np
import pytest

from serving.config import EngineConfig
from serving.entrypoints.engine_builder import build_engine
from serving.types import SamplingParams
from tiny_models import VOCAB, assert_matches_torch, run_requests, save_tiny_model

PROMPT_LENS = [3, 11, 40, 100]
NUM_TOKENS = 64
LOGPROB_TOL = 1e-4


def engine_config(**kw) -> EngineConfig:
  base = dict(max_num_seqs=4, max_model_len=192, page_size=4, num_pages=256,
              max_num_batched_tokens=32, attention_block_tokens=16, unroll_layers=False,
              compilation_cache=False)
  return EngineConfig.of(**{**base, **kw})


def prompts() -> list[list[int]]:
  rng = np.random.default_rng(0)
  return [rng.integers(0, VOCAB, n).tolist() for n in PROMPT_LENS]


@pytest.mark.slow
@pytest.mark.parametrize("family,options", [
    ("qwen3_next", {}), ("qwen3_next_dense", {}), ("qwen3_5", {}),
    # whole prompts: 2 blocks of 64; the buckets its run calls (module doc)
    ("qwen3_next", dict(max_num_batched_tokens=256, prefill_buckets=(256,),
                        decode_buckets=(4,))),
    # per-block dicts; one decode bucket (module doc)
    ("qwen3_next", dict(unroll_layers=True, num_decode_steps=4, decode_buckets=(4,)))])
def test_qwen3_next_matches_transformers(family, options, tmp_path):
  model = save_tiny_model(family, str(tmp_path))
  engine = build_engine(str(tmp_path), engine_config(**options))
  params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=20)
  batch = prompts()
  assert_matches_torch(model, batch, run_requests(engine, batch, params), NUM_TOKENS,
                       LOGPROB_TOL)
