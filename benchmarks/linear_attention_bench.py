"""Decode speed of a linear-attention model against a plain-attention one, one run.

    python benchmarks/linear_attention_bench.py MODEL_A MODEL_B [--batches 1,8] [--rounds 3]

Each model (a HF directory) gets one engine; the rounds alternate between them
(so machine noise hits both alike). A round per batch size B adds B requests
(16-token prompts, 128 greedy tokens, ignore_eos) and times decoding: from the
moment every request has its first token to the last token, B * 127 tokens over
that span (the steps then are pure decode). Prints one JSON object: per model and
B, the median decode tokens/s and every round's figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from serving.config import EngineConfig
from serving.entrypoints.engine_builder import build_engine
from serving.types import SamplingParams

PROMPT, OUTPUT = 16, 128


def decode_tok_s(engine, batch: int, seed: int) -> float:
  """One round: B requests at once; decode tokens per second once all have started."""
  rng = np.random.default_rng(seed)
  first, last = {}, {}

  def sink(rid):
    def on_output(out):
      now = time.perf_counter()
      first.setdefault(rid, now)
      last[rid] = now
    return on_output

  params = SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True)
  for i in range(batch):
    engine.add_request(f"r{seed}-{i}", rng.integers(0, 256, PROMPT).tolist(), params,
                       sink(i))
  engine.run_until_idle()
  return batch * (OUTPUT - 1) / (max(last.values()) - max(first.values()))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("models", nargs=2)
  ap.add_argument("--batches", default="1,8")
  ap.add_argument("--rounds", type=int, default=3)
  args = ap.parse_args()
  batches = [int(b) for b in args.batches.split(",")]
  config = EngineConfig.of(max_num_seqs=max(batches), max_model_len=256, page_size=16,
                           num_pages=256, max_num_batched_tokens=256, compilation_cache=False)
  engines = {m: build_engine(m, config) for m in args.models}
  runs = {m: {b: [] for b in batches} for m in args.models}
  for r in range(args.rounds):
    for b in batches:
      for m, engine in engines.items():
        runs[m][b].append(decode_tok_s(engine, b, seed=r))
  print(json.dumps({m: {f"b{b}": {"median_tok_s": statistics.median(v), "rounds": v}
                        for b, v in per.items()} for m, per in runs.items()}, indent=1))


if __name__ == "__main__":
  main()
