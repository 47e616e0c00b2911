"""Quality of every weight / KV format on the default model (SmolLM2-135M-Instruct).

For each format: teacher-forced mean KL (and greedy agreement) against the
float32 model on tests/data/quality_sample.txt, and free-running greedy
agreement: 32 greedy tokens for each of the 12 chat prompts in
tests/data/heldout_prompts.json through a whole engine, compared with the
float32 engine's (identical continuations, and the mean share of tokens
before the first difference). The float32 reference is the GGUF's Q4_1
weights dequantized (what the file holds). Uses the tests' helpers
(tests/quant_testutil.py).

    PYTHONPATH=.:tests python benchmarks/quant_quality.py --output quality.json
    PYTHONPATH=.:tests python benchmarks/quant_quality.py --formats int8,int8-channel
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import gguf
import numpy as np
import quant_testutil as qt

import checkpoints
from checkpoints import gguf as gguf_io
from checkpoints import load_quantized, quantizers
from checkpoints.quantize import gguf_quantized_weight, stack_blocks
from serving.models import quantized as quant
from serving.runner.model_runner import ModelRunner

PRESET = "smollm2-135m-instruct"


def _gguf_blocks(rows: np.ndarray, qtype) -> quant.QuantizedWeight:
  """`[Out, In]` float rows as gguf-py's `qtype` blocks, served as stored."""
  rows = np.ascontiguousarray(rows, np.float32)
  raw = gguf_io.RawTensor(name="w", ggml_type=qtype, shape=rows.shape,
                          data=gguf.quants.quantize(rows, qtype))
  return gguf_quantized_weight(raw)


def _gguf_requantized(loaded, qtype):
  """Every linear as gguf-py's `qtype` blocks of the float weights; the tied head as
  Q8_0 (llama.cpp's mixes keep the output at 8 bits or Q6_K)."""
  layers, n = loaded.params["layers"], loaded.config.num_layers
  stacked = {k: (stack_blocks([_gguf_blocks(np.swapaxes(v[i], -1, -2), qtype) for i in range(n)])
                 if k in quant.LINEAR_KEYS else v) for k, v in layers.items()}
  embed = _gguf_blocks(loaded.params["embed"], gguf_io.Q.Q8_0)
  return dataclasses.replace(loaded, params={**loaded.params, "layers": stacked, "embed": embed})


def formats(smollm):
  """name -> (LoadedModel, engine options), built lazily."""
  with_params = lambda p: dataclasses.replace(smollm, params=p)
  return {
      "float32": lambda: (smollm, {}),
      "bf16-weights": lambda: (smollm, dict(weight_dtype="bfloat16")),
      "int8": lambda: (load_quantized(PRESET, "int8"), dict(quantization="int8")),
      "int8-channel": lambda: (with_params(quantizers.quantize_params(
          smollm.params, "int8", group_size=0)), {}),
      "int4-g32": lambda: (with_params(quantizers.quantize_params(
          smollm.params, "int4", group_size=32)), {}),
      "int4-g64": lambda: (with_params(quantizers.quantize_params(
          smollm.params, "int4", group_size=64)), {}),
      "int4-g64-gptq": lambda: (with_params(_gptq(smollm)), {}),
      "gguf-q4_1": lambda: (load_quantized(PRESET, "gguf"), dict(quantization="gguf")),
      # The same blocks, decode rows' activations rounded for the CPU integer tiles.
      "gguf-q4_1-act16": lambda: (load_quantized(PRESET, "gguf"),
                                  dict(quantization="gguf", cpu_activation_bits=16)),
      "gguf-q4_1-act8": lambda: (load_quantized(PRESET, "gguf"),
                                 dict(quantization="gguf", cpu_activation_bits=8)),
      "q8_0": lambda: (_gguf_requantized(smollm, gguf_io.Q.Q8_0), {}),
      "q5_0": lambda: (_gguf_requantized(smollm, gguf_io.Q.Q5_0), {}),
      "q5_1": lambda: (_gguf_requantized(smollm, gguf_io.Q.Q5_1), {}),
      "fp8": lambda: (smollm, dict(quantization="fp8")),
      "kv-int8": lambda: (smollm, dict(kv_cache_dtype="int8")),
      "kv-fp8": lambda: (smollm, dict(kv_cache_dtype="fp8")),
  }


def _gptq(smollm):
  from serving.tools.gptq import calibrated_int4
  return calibrated_int4(smollm, group_size=64)


def prefix_share(ref: list[list[int]], got: list[list[int]]) -> float:
  """Mean share of tokens before the first difference."""
  shares = []
  for a, b in zip(ref, got, strict=True):
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    shares.append(n / len(a))
  return float(np.mean(shares))


def evaluate(loaded, engine_kw, tokens):
  cfg = qt.eval_config(**engine_kw)
  runner = ModelRunner.from_params(loaded.params, loaded.config, cfg, num_pages=cfg.cache.num_pages)
  logits = qt.teacher_forced_logits(runner, tokens)
  nbytes = quant.params_nbytes(runner.params)
  fmt = quant.weight_formats(runner.params, runner.weight_dtype_name)
  del runner
  return logits, nbytes, fmt, qt.free_running(qt.engine_for(loaded, **engine_kw))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--formats", default="", help="comma-separated subset (default: all)")
  ap.add_argument("--output", default="", help="write the results as JSON here")
  args = ap.parse_args()
  smollm = checkpoints.load_checkpoint(PRESET)
  tokens = qt.sample_tokens(smollm.tokenizer)
  table = formats(smollm)
  names = [n for n in args.formats.split(",") if n] or list(table)
  ref_logits, _, _, ref_free = evaluate(smollm, {}, tokens)
  rows = []
  for name in names:
    start = time.time()
    loaded, kw = table[name]()
    logits, nbytes, fmt, free = evaluate(loaded, kw, tokens)
    row = dict(format=name, weights=fmt, mib=round(nbytes / 2**20, 1),
               **qt.compare(ref_logits, logits), identical=qt.identical(ref_free, free),
               prefix=prefix_share(ref_free, free), seconds=round(time.time() - start, 1))
    rows.append(row)
    print(json.dumps(row), file=sys.stderr, flush=True)
  print("| format | weights | MiB | mean KL | max KL | teacher-forced agreement | "
        "identical 32-token continuations | tokens before first difference |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['format']} | {r['weights']} | {r['mib']} | {r['kl']:.5f} | {r['kl_max']:.4f} "
          f"| {r['agree']:.1%} | {r['identical']}/12 | {r['prefix']:.1%} |")
  if args.output:
    with open(args.output, "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
