"""Greedy output does not depend on the batch: one set of weights for every step.

The default model with its default engine options (GGUF blocks as stored,
the native CPU kernels for every row count, multi-step decode): 12 held-out
prompts of different lengths (two longer than one prefill chunk, so they are
chunked) generate 32 greedy tokens alone, inside a batch of 36 (the 12 among
24 others, all submitted at once so prefill chunks and decode batches mix
them), and at tp=2. All three must agree token for token, 12/12: the results
of one row may differ between these runs only by float summation order, and
on these prompts that never flips a greedy choice.

The tp=2 engine compiles only the programs its run calls. A sharded runner
has no native kernels and no executable store: every bucket is another
unrolled 30-layer XLA compile (its warm-up was most of this test's time). The
12 prompts at once, recorded on the default buckets: every prefill step fills
the 512-token bucket, decode batches hold 12, 2 or 1 rows, no step runs
multi-step decoding (12 rows are over `decode_steps_max_batch`, and the last
rows have fewer than 4 tokens left) and prefill samples 32 rows. `TP2` keeps
exactly those buckets (16 slots: the 12 fit, and prefill samples 16 rows), so
the run plans the same steps and each row takes the same path. Warm-up over
every bucket is tested elsewhere (tests/serving/engine/test_engine.py, and on
a mesh tests/sharding/test_tp_parity.py).

Runs in a worker with two CPU devices (tests/sharding/shard_testutil.py).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "sharding"))
import shard_testutil as stu  # noqa: E402

pytestmark = pytest.mark.slow  # three engines of the default model in a worker

MAX_TOKENS = 32
# The default engine options, with a smaller KV pool than a server sizes for itself.
ENGINE = dict(num_pages=512, compilation_cache=False)
# The tp=2 engine: the default options with only the buckets its run uses (module doc).
TP2 = dict(tp=2, max_num_seqs=16, prefill_buckets=(512,), decode_buckets=(1, 4, 16),
           num_decode_steps=1)
TOPICS = ("the history of the printing press", "how a bicycle gear works",
          "why the sky is blue", "the rules of chess for beginners", "a recipe for bread",
          "how vaccines train the immune system", "the water cycle", "what a compiler does",
          "the causes of the French Revolution", "how bees make honey")
LONG = ("Summarise the following notes in two sentences. " +
        " ".join(f"Note {i}: the committee met on day {i} and discussed budget line {i * 7} "
                 f"and the schedule for phase {i % 5}." for i in range(40)))


def held_out_prompts() -> list[str]:
  """12 prompts: ten short questions of different lengths, two longer than a chunk."""
  short = [f"Explain {t} in a few sentences." + " Be precise." * (i % 4)
           for i, t in enumerate(TOPICS)]
  return [*short, LONG, LONG.replace("Summarise", "List the key dates of")]


def other_prompts() -> list[str]:
  """24 further prompts that share the batch with the held-out ones."""
  return [f"Write a short poem about the number {n}." + " Use rhyme." * (n % 3)
          for n in range(24)]


def test_greedy_tokens_do_not_depend_on_batch_or_tp():
  got = stu.run_worker(__file__, devices=2, timeout=900, fast_compile=False)
  alone, batched, tp2 = got["alone"], got["batched"], got["tp2"]
  assert len(alone) == 12
  assert all(len(t) == MAX_TOKENS for t in alone)
  same_batch = sum(a == b for a, b in zip(alone, batched, strict=True))
  same_tp = sum(a == b for a, b in zip(alone, tp2, strict=True))
  assert (same_batch, same_tp) == (12, 12), got


def _worker() -> None:
  from serving.entrypoints.llm import LLM
  from serving.types import SamplingParams

  params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
  held, others = held_out_prompts(), other_prompts()

  def tokens(outputs):
    return [list(o.token_ids) for o in outputs]

  llm = LLM(**ENGINE)
  alone = [tokens(llm.generate([p], params))[0] for p in held]
  mixed = [p for pair in zip(others[:12], held, strict=True) for p in pair] + others[12:]
  out = tokens(llm.generate(mixed, params))
  batched = [out[mixed.index(p)] for p in held]
  llm.engine.shutdown()
  tp2 = tokens(LLM(**TP2, **ENGINE).generate(held, params))
  print(stu.json.dumps({"alone": alone, "batched": batched, "tp2": tp2}))


if __name__ == "__main__":
  stu.worker_setup()
  _worker()
