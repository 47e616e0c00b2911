"""Decode speed of two models through the engine, one run, rounds alternating.

    python benchmarks/decode_compare.py MODEL_A MODEL_B [--batches 1,8] [--rounds 3]

A MODEL is a HF directory, or `tiny:FAMILY` for a tiny random model of one of
tests/tiny_models.py's families, optionally with config overrides:
`tiny:llama:num_hidden_layers=8,head_dim=16`. Each model gets one engine; the rounds
alternate between them (so machine noise hits both alike). A round per batch size B
adds B requests (`--input_len` random prompt tokens, `--output_len` greedy tokens,
ignore_eos) and times decoding: from the moment every request has its first token to
the last token, B * (output_len - 1) tokens over that span (the steps then are pure
decode). Prints one JSON object: per model and B, the median decode tokens/s, every
round's figure and the model's KV bytes per token. Timings on a shared machine are
noisy: compare only within one run.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from serving.config import EngineConfig
from serving.entrypoints.engine_builder import build_engine
from serving.runner.kv_cache import kv_bytes_per_token
from serving.types import SamplingParams


def model_path(spec: str) -> str:
  """A HF directory as given, or a `tiny:FAMILY[:key=value,...]` model written to a
  temporary directory (tests/tiny_models.py's settings plus the overrides)."""
  if not spec.startswith("tiny:"):
    return spec
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
  import tiny_models

  family, _, overrides = spec[len("tiny:"):].partition(":")
  values = dict(kv.split("=", 1) for kv in overrides.split(",") if kv)
  base = tiny_models.FAMILIES[family]

  def config():
    cfg = base()
    for key, value in values.items():
      setattr(cfg, key, ast.literal_eval(value))
    return cfg

  name = f"{family}_{len(tiny_models.FAMILIES)}"
  tiny_models.FAMILIES[name] = config
  path = tempfile.mkdtemp(prefix=f"decode_compare_{family}_")
  tiny_models.save_tiny_model(name, path)
  return path


def decode_tok_s(engine, batch: int, input_len: int, output_len: int, seed: int) -> float:
  """One round: B requests at once; decode tokens per second once all have started."""
  rng = np.random.default_rng(seed)
  first, last = {}, {}

  def sink(rid):
    def on_output(out):
      now = time.perf_counter()
      first.setdefault(rid, now)
      last[rid] = now
    return on_output

  params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
  for i in range(batch):
    engine.add_request(f"r{seed}-{i}", rng.integers(0, 256, input_len).tolist(), params,
                       sink(i))
  engine.run_until_idle()
  return batch * (output_len - 1) / (max(last.values()) - max(first.values()))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("models", nargs=2)
  ap.add_argument("--batches", default="1,8")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--input_len", type=int, default=16)
  ap.add_argument("--output_len", type=int, default=128)
  args = ap.parse_args()
  batches = [int(b) for b in args.batches.split(",")]
  max_len = -(-(args.input_len + args.output_len + 1) // 16) * 16
  config = EngineConfig.of(max_num_seqs=max(batches), max_model_len=max_len, page_size=16,
                           max_num_batched_tokens=256, compilation_cache=False)
  engines = {m: build_engine(model_path(m), config) for m in args.models}
  runs = {m: {b: [] for b in batches} for m in args.models}
  for engine in engines.values():  # warm-up: every batch size's programs
    for b in batches:
      decode_tok_s(engine, b, args.input_len, args.output_len, seed=args.rounds)
  for r in range(args.rounds):
    for b in batches:
      for m, engine in engines.items():
        runs[m][b].append(decode_tok_s(engine, b, args.input_len, args.output_len, seed=r))
  print(json.dumps({m: {"kv_bytes_per_token": kv_bytes_per_token(
      engines[m].runner.model_cfg, engines[m].runner.kv_dtype_name), **{
      f"b{b}": {"median_tok_s": statistics.median(v), "rounds": v} for b, v in per.items()}}
      for m, per in runs.items()}, indent=1))


if __name__ == "__main__":
  main()
