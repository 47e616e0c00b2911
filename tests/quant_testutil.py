"""Teacher-forced evaluation of a runner for quantization quality tests.

`teacher_forced_logits` runs the whole sample as one prefill through the
runner's own paged KV cache (so KV quantization is exercised on write and
read) and returns the next-token logits of every position; `compare` reports
mean KL(reference || candidate) and greedy agreement.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from serving.config import EngineConfig
from serving.models import causal_lm
from serving.runner import model_runner as runner_lib
from serving.runner import steps

SAMPLE_PATH = os.path.join(os.path.dirname(__file__), "data", "quality_sample.txt")


def sample_tokens(tokenizer) -> np.ndarray:
  with open(SAMPLE_PATH, encoding="utf-8") as f:
    return np.asarray(tokenizer.encode(f.read(), add_special_tokens=True), np.int32)


def eval_config(**kw) -> EngineConfig:
  """A small engine config for one 512-token teacher-forced pass (scanned layers)."""
  base = dict(max_num_seqs=1, max_model_len=512, page_size=16, num_pages=34,
              max_num_batched_tokens=512, unroll_layers=False, compilation_cache=False)
  return EngineConfig.of(**{**base, **kw})


@functools.partial(jax.jit, static_argnames=("cfg", "backend", "block_tokens", "act_dtype"))
def _forward(params, kv, tokens, kv_index, table, n, *, cfg, backend, block_tokens,
             act_dtype):
  meta = dict(kv_index=kv_index, block_tables=table,
              cu_q_lens=jnp.stack([0, n]).astype(jnp.int32), kv_lens=n[None])
  attend = steps.attend_fn(backend, cfg, "prefill", meta, block_tokens)
  positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
  hidden, _ = causal_lm.forward(params, cfg, tokens, positions, kv, attend, act_dtype=act_dtype)
  return causal_lm.logits(params, cfg, hidden)


def teacher_forced_logits(runner: runner_lib.ModelRunner, tokens: np.ndarray) -> np.ndarray:
  """Logits [T, V] (float32) of every position of `tokens`, one prefill, pages 1..n."""
  ec = runner.engine_cfg
  t = len(tokens)
  padded = np.zeros((ec.scheduler.max_num_batched_tokens,), np.int32)
  padded[:t] = tokens
  pos = np.arange(len(padded))
  ps = ec.cache.page_size
  kv_index = np.where(pos < t, (1 + pos // ps) * ps + pos % ps, 0).astype(np.int32)
  table = np.zeros((1, ec.block_table_width), np.int32)
  used = -(-t // ps)
  table[0, :used] = np.arange(1, used + 1)
  out = _forward(runner.params, runner.state.kv, padded, kv_index, table, np.int32(t),
                 cfg=runner.model_cfg, backend=runner.backend,
                 block_tokens=ec.cache.attention_block_tokens,
                 act_dtype=jnp.dtype(runner.dtype_name))
  return np.asarray(out[:t], np.float32)


def compare(ref_logits: np.ndarray, logits: np.ndarray) -> dict[str, float]:
  """Mean KL(ref || cand) of next-token distributions and greedy (argmax) agreement."""
  lp = jax.nn.log_softmax(jnp.asarray(ref_logits), axis=-1)
  lq = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
  kl = jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)
  agree = np.mean(np.argmax(ref_logits, -1) == np.argmax(logits, -1))
  return {"kl": float(jnp.mean(kl)), "kl_max": float(jnp.max(kl)), "agree": float(agree)}


PROMPTS_PATH = os.path.join(os.path.dirname(__file__), "data", "heldout_prompts.json")
FREE_TOKENS = 32


def heldout_prompts() -> list[str]:
  """12 chat prompts, not used to choose any quantization setting."""
  import json

  with open(PROMPTS_PATH, encoding="utf-8") as f:
    return json.load(f)


def free_running(llm, max_tokens: int = FREE_TOKENS) -> list[list[int]]:
  """Greedy continuations of `heldout_prompts()` (chat template) through `llm`'s engine."""
  from serving import SamplingParams

  params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
  outs = llm.chat([[{"role": "user", "content": p}] for p in heldout_prompts()], params)
  return [list(o.token_ids) for o in outs]


def engine_for(loaded, **engine_kw):
  """An `LLM` serving `loaded` with the default-model test config plus `engine_kw`."""
  from server_procs import DEFAULT_MODEL_TEST_CONFIG

  from serving import LLM
  from serving.entrypoints.engine_builder import build_engine

  config = EngineConfig.of(**{**DEFAULT_MODEL_TEST_CONFIG, **engine_kw})
  return LLM(engine=build_engine(loaded, config))


def identical(reference: list[list[int]], candidate: list[list[int]]) -> int:
  """How many continuations equal the reference token for token."""
  return sum(a == b for a, b in zip(reference, candidate, strict=True))
