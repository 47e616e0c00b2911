"""Weight / KV quantization benchmark through `serving.LLM` (the standard workload).

For each format (the preset's `default`, f32, bf16, int8, int4; also fp8, gguf, int8+kv8,
bf16w, gguf+bf16, gguf+bf16+q8, gguf+q8; any with `-avx2`: the native kernels'
AVX2 path forced) one `LLM` is built in this process —
its load + warm-up time is reported separately as "start-up" (compile time;
the persistent compilation cache makes reruns cheaper) — and
then the formats are measured round-robin, `--reps` rounds, so every figure
is taken side by side with its comparison on the same noisy machine:

- batch-1 decode tok/s: one 128-token prompt, `(max_tokens=129) - (max_tokens=1)`
  wall time over the 128 extra tokens (prefill cancels out);
- 32-concurrent output tok/s: 32 distinct 128-token prompts, 128 output tokens
  each, `ignore_eos`, greedy, prefix caching off.

Medians over the rounds are printed as a table, written as a run record
(benchmarks/results/<date>-quant_bench.json; `--no-record` skips it) and as JSON
with every round (`--output`).

  PYTHONPATH=. python benchmarks/quant_bench.py [--formats f32,bf16,int8,int4,int8+kv8] \
    [--reps 3] [--b1_only] [--output results.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import jax
import numpy as np

from kernels_cpu import library
from serving import LLM, SamplingParams
from serving.tools import run_record

FORMATS = {
    # The model preset's own engine options (what `xlaserve serve --model=...` runs).
    "default": dict(),
    "f32": dict(dtype="float32", weight_dtype="float32"),
    "bf16": dict(dtype="bfloat16", weight_dtype="bfloat16"),
    "int8": dict(dtype="float32", quantization="int8", weight_dtype="float32"),
    "int4": dict(dtype="float32", quantization="int4", weight_dtype="float32"),
    "fp8": dict(dtype="float32", quantization="fp8", weight_dtype="float32"),
    # A GGUF's blocks as stored (the default model: Q4_1 layers, Q8_0 tied head).
    "gguf": dict(dtype="float32", quantization="gguf", weight_dtype="float32",
                 cpu_activation_bits=32),
    # int8 without the native matvec (kernels_cpu), for the comparison.
    "int8-xla": dict(dtype="float32", quantization="int8", weight_dtype="float32"),
    "int8+kv8": dict(dtype="float32", quantization="int8", kv_cache_dtype="int8",
                     weight_dtype="float32"),
    "bf16w": dict(dtype="float32", weight_dtype="bfloat16"),
    # The GGUF's blocks for small decode batches (native kernel, float activations) and a
    # bf16 copy for prefill and larger batches (quantized_dense_copy).
    "gguf+bf16": dict(dtype="float32", quantization="gguf", weight_dtype="bfloat16",
                      quantized_dense_copy=True, cpu_activation_bits=32),
    # The same, the Q4 / Q8_0 blocks multiplying activations rounded to 16 or 8 bits.
    "gguf+bf16+q16": dict(dtype="float32", quantization="gguf", weight_dtype="bfloat16",
                          quantized_dense_copy=True, cpu_activation_bits=16),
    "gguf+bf16+q8": dict(dtype="float32", quantization="gguf", weight_dtype="bfloat16",
                         quantized_dense_copy=True, cpu_activation_bits=8),
    "gguf+q8": dict(dtype="float32", quantization="gguf", weight_dtype="float32",
                    cpu_activation_bits=8),
}


def build(fmt: str, args) -> tuple[LLM, float]:
  """The LLM of format `fmt`; a `-avx2` suffix: any format with the native kernels' AVX2
  path forced (kernels_cpu/library.py `XLASERVE_NATIVE_ISA`)."""
  # Programs are traced at warm-up, so the native kernels' switches hold per LLM.
  os.environ["XLASERVE_NATIVE"] = "0" if fmt.endswith("-xla") else "1"
  os.environ["XLASERVE_NATIVE_ISA"] = "avx2" if fmt.endswith("-avx2") else "auto"
  library.isa.cache_clear()
  jax.clear_caches()  # a function traced under the other switches keeps its targets
  start = time.perf_counter()
  llm = LLM(args.model, **FORMATS[fmt.removesuffix("-avx2")], max_num_seqs=args.concurrency,
            max_model_len=args.prompt_len + args.output_len + 16,
            max_num_batched_tokens=args.prompt_len * 2, enable_prefix_caching=False)
  return llm, time.perf_counter() - start


def prompts(llm: LLM, n: int, length: int) -> list[list[int]]:
  """n distinct prompts of `length` token ids (distinct first tokens: no shared prefix)."""
  rng = np.random.default_rng(0)
  vocab = llm.engine.runner.vocab_size
  return [[int(t) for t in rng.integers(100, min(vocab, 30000), size=length)] for _ in range(n)]


def timed(llm: LLM, batch: list[list[int]], max_tokens: int) -> float:
  params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
  start = time.perf_counter()
  outs = llm.generate(batch, params)
  elapsed = time.perf_counter() - start
  assert all(len(o.token_ids) == max_tokens for o in outs)
  return elapsed


def measure(llm: LLM, args) -> dict[str, float]:
  one = prompts(llm, 1, args.prompt_len)
  t1 = timed(llm, one, 1)
  tn = timed(llm, one, args.output_len + 1)
  out = {"decode_b1_tok_s": args.output_len / max(tn - t1, 1e-9), "ttft_b1_s": t1}
  if not args.b1_only:
    many = prompts(llm, args.concurrency, args.prompt_len)
    tc = timed(llm, many, args.output_len)
    out[f"throughput_c{args.concurrency}_tok_s"] = args.concurrency * args.output_len / tc
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--formats", default="f32,bf16,int8,int4")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--concurrency", type=int, default=32)
  ap.add_argument("--prompt_len", type=int, default=128)
  ap.add_argument("--output_len", type=int, default=128)
  ap.add_argument("--b1_only", action="store_true", help="skip the concurrent workload")
  ap.add_argument("--output", default=None, help="write the results as JSON here")
  run_record.add_flags(ap)
  args = ap.parse_args()
  formats = args.formats.split(",")
  llms, startup = {}, {}
  for fmt in formats:
    llms[fmt], startup[fmt] = build(fmt, args)
    print(f"[{fmt}] start-up (load + compile) {startup[fmt]:.1f}s", flush=True)
    measure(llms[fmt], argparse.Namespace(**{**vars(args), "output_len": 4}))  # warm caches
  runs: dict[str, list[dict[str, float]]] = {f: [] for f in formats}
  for rep in range(args.reps):
    for fmt in formats:
      runs[fmt].append(measure(llms[fmt], args))
      print(f"[{fmt}] rep {rep}: {runs[fmt][-1]}", flush=True)
  results = {}
  for fmt in formats:
    med = {k: statistics.median(r[k] for r in runs[fmt]) for k in runs[fmt][0]}
    results[fmt] = {**med, "startup_s": startup[fmt],
                    "weight_bytes": _weight_bytes(llms[fmt]), "runs": runs[fmt]}
  _report(results, args)


def _weight_bytes(llm: LLM) -> int:
  from serving.models.quantized import params_nbytes
  return params_nbytes(llm.engine.runner.params)


def _report(results: dict, args) -> None:
  key = f"throughput_c{args.concurrency}_tok_s"
  base = results[next(iter(results))]
  print(f"\n{'format':10} {'weights MiB':>11} {'decode b1 tok/s':>16} {'x':>5} "
        f"{'c' + str(args.concurrency) + ' tok/s':>10} {'x':>5} {'start-up s':>10}")
  for fmt, r in results.items():
    conc = (f"{r[key]:10.1f} {r[key] / base[key]:5.2f}" if key in r else f"{'-':>10} {'-':>5}")
    print(f"{fmt:10} {r['weight_bytes'] / 2**20:11.1f} {r['decode_b1_tok_s']:16.1f} "
          f"{r['decode_b1_tok_s'] / base['decode_b1_tok_s']:5.2f} {conc} {r['startup_s']:10.1f}")
  meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
          "machine": f"{platform.machine()} {platform.processor()} ({jax.default_backend()})",
          "jax": jax.__version__, "args": vars(args)}
  if args.output:
    with open(args.output, "w", encoding="utf-8") as f:
      json.dump({"meta": meta, "results": results}, f, indent=1)
  run_record.record_args("quant_bench", args, {"backend": jax.default_backend(),
                                               "formats": results}, skip=("output",))


if __name__ == "__main__":
  main()
