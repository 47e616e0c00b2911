"""Multi-LoRA benchmarks: the batched update's two formulations, and serving with adapters.

    PYTHONPATH=. python benchmarks/lora_bench.py kernels
    PYTHONPATH=. python benchmarks/lora_bench.py serve [--repeats 3] [--json out.json]

`kernels`: `serving.models.lora.lora_delta` alone, "dense" vs "gather", jitted,
on the default model's widest projection (576 -> 1536) at S slots and rank R,
for decode batches and a prefill chunk (every row a different slot; medians
of many runs).

`serve`: one `xlaserve serve` (default preset) with four random rank-16
adapters (`--lora_modules`, `--max_loras=4`) and one without LoRA, both up at
once; the standard workload (random-word prompts of 128 tokens, 128 output
tokens, greedy, `ignore_eos`, one fresh connection per request) at 32
concurrent, in rounds that alternate the order of:
  * `no-lora server`: the server started without LoRA (max_loras=0);
  * `0 adapters`: the LoRA server, every request on the base model;
  * `1 adapter`: every request on adapter a;
  * `4 adapters`: 8 requests on each of a, b, c, d at once.
Medians of output tok/s and TTFT / TPOT p50 per case, and the ratio to the
no-LoRA server, are printed, written as a run record (benchmarks/results/<date>-
lora_bench_<what>.json; `--no-record` skips it) and to `--json`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench_kernels(args) -> dict:
  import jax
  import jax.numpy as jnp

  from serving.models.lora import lora_delta

  d_in, d_out, slots, rank = 576, 1536, args.slots, args.rank
  rng = np.random.default_rng(0)
  dtype = jnp.dtype(args.dtype)
  a = jnp.asarray(rng.standard_normal((d_in, slots, rank)), dtype)
  b = jnp.asarray(rng.standard_normal((slots, rank, d_out)), dtype)
  out = {}
  for t in (1, 8, 32, 64, 512):
    x = jnp.asarray(rng.standard_normal((t, d_in)), jnp.float32)
    rows = jnp.asarray(np.arange(t) % (slots + 1) - 1, jnp.int32)  # -1 (none) and every slot
    times = {}
    for method in ("dense", "gather"):
      fn = jax.jit(lambda x, a, b, r, m=method: lora_delta(x, a, b, r, m))
      jax.block_until_ready(fn(x, a, b, rows))
      samples = []
      for _ in range(args.runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(x, a, b, rows))
        samples.append(time.perf_counter() - start)
      times[method] = statistics.median(samples) * 1e6
    out[t] = times
    print(f"T={t:4d}  dense {times['dense']:8.1f} us   gather {times['gather']:8.1f} us   "
          f"gather/dense {times['gather'] / times['dense']:.2f}", flush=True)
  return {"slots": slots, "rank": rank, "in": d_in, "out": d_out, "dtype": args.dtype,
          "us": out}


def write_adapters(root: str, rank: int) -> dict[str, str]:
  from checkpoints import load_checkpoint
  from checkpoints.lora import module_dims

  sys.path.insert(0, os.path.join(ROOT, "tests"))
  from lora_testutil import write_peft_adapter

  cfg = load_checkpoint("smollm2-135m-instruct").config
  return {name: write_peft_adapter(os.path.join(root, name), module_dims(cfg), cfg.num_layers,
                                   rank=rank, seed=i, std=0.02)
          for i, name in enumerate("abcd")}


async def level(base_url: str, models: list[str], prompts: list[str], output_len: int,
                concurrency: int) -> dict:
  from serving.tools import bench_serve

  share = concurrency // len(models)
  return await bench_serve.run_groups(
      [(bench_serve.Target(base_url, m, {"ignore_eos": True}),
        prompts[i * share:(i + 1) * share], share) for i, m in enumerate(models)], output_len)


def bench_serve_cases(args) -> dict:
  from serving.tools import bench, bench_serve

  tok = bench.load_tokenizer("smollm2-135m-instruct")
  work = tempfile.mkdtemp(prefix="lora_bench_")
  adapters = write_adapters(work, args.rank)
  modules = ",".join(f"{n}={p}" for n, p in adapters.items())
  procs = {
      "lora": (bench_serve.launch_server(
          [f"--lora_modules={modules}", "--max_loras=4", f"--max_lora_rank={args.rank}"],
          args.port, os.path.join(work, "lora.log")), args.port),
      "nolora": (bench_serve.launch_server([], args.port + 1, os.path.join(work, "nolora.log")),
                 args.port + 1)}
  try:
    for _, port in procs.values():
      bench_serve.wait_ready(f"http://127.0.0.1:{port}")
    model = bench_serve.first_model_id(f"http://127.0.0.1:{args.port}")
    cases = {"no-lora server": ("nolora", [model]), "0 adapters": ("lora", [model]),
             "1 adapter": ("lora", ["a"]), "4 adapters": ("lora", ["a", "b", "c", "d"])}
    results: dict[str, list[dict]] = {c: [] for c in cases}
    for rep in range(args.repeats):
      order = list(cases) if rep % 2 == 0 else list(reversed(cases))
      for case in order:
        server, models = cases[case]
        prompts = [p for p, _ in bench.make_prompts(tok, args.concurrency, args.input_len,
                                                    seed=rep * 100 + len(results[case]))]
        url = f"http://127.0.0.1:{procs[server][1]}"
        res = asyncio.run(level(url, models, prompts, args.output_len, args.concurrency))
        results[case].append(res)
        print(f"round {rep} {case:15s} {res['output_tok_s']:7.1f} tok/s  "
              f"errors {res['errors']}", flush=True)
  finally:
    for proc, _ in procs.values():
      proc.terminate()
      proc.wait(timeout=60)
  base = statistics.median(r["output_tok_s"] for r in results["no-lora server"])
  summary = {}
  for case, runs in results.items():
    tok_s = statistics.median(r["output_tok_s"] for r in runs)
    summary[case] = {"output_tok_s": tok_s, "vs_no_lora": tok_s / base,
                     "ttft_p50": statistics.median(r["ttft_p50"] for r in runs),
                     "tpot_p50": statistics.median(r["tpot_p50"] for r in runs),
                     "errors": sum(r["errors"] for r in runs)}
    print(f"{case:15s} {tok_s:7.1f} tok/s  x{tok_s / base:.3f}  "
          f"TTFT p50 {summary[case]['ttft_p50']:.2f} s  TPOT p50 "
          f"{summary[case]['tpot_p50'] * 1e3:.1f} ms", flush=True)
  return summary


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("what", choices=("kernels", "serve"))
  p.add_argument("--slots", type=int, default=4)
  p.add_argument("--rank", type=int, default=16)
  p.add_argument("--dtype", default="float32", help="kernels: the slots' dtype")
  p.add_argument("--runs", type=int, default=200)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--concurrency", type=int, default=32)
  p.add_argument("--input_len", type=int, default=128)
  p.add_argument("--output_len", type=int, default=128)
  p.add_argument("--port", type=int, default=8310)
  p.add_argument("--json", default=None)
  from serving.tools import bench_serve, run_record
  run_record.add_flags(p)
  args = p.parse_args()
  result = bench_kernels(args) if args.what == "kernels" else bench_serve_cases(args)
  bench_serve.save_record(args.json, args, result)
  run_record.record_args(f"lora_bench_{args.what}", args, result, skip=("json", "port"))


if __name__ == "__main__":
  main()
