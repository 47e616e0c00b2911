"""Structured output benchmark: the per-token cost of constraints, through the server.

    PYTHONPATH=. python benchmarks/structured_bench.py [--repeats 3] [--json out.json]

One `xlaserve serve` (default preset, prefix caching off); the standard
workload (random-word prompts of 128 tokens, 128 output tokens, greedy,
`ignore_eos`, one fresh connection per request), in rounds that alternate
the order of:
  * `1 plain` / `1 json`: one request at a time, unconstrained or constrained
    by SCHEMA (a JSON schema whose shortest document is longer than 128
    tokens, so a constrained request runs its 128 tokens like a plain one);
  * `32 plain` / `32 half json`: 32 concurrent, none or half of them
    constrained by SCHEMA.
Medians of output tok/s and TPOT p50 per case, and the ratio to the plain
case at the same concurrency, are printed and written to `--json`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile

# At least 40 short strings: longer than 128 tokens, so max_tokens ends every request.
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "words": {"type": "array", "minItems": 40, "maxItems": 60,
              "items": {"type": "string", "maxLength": 12}},
    "score": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["title", "words", "score"], "additionalProperties": False}
# case -> (concurrency, share of the requests constrained)
CASES = {"1 plain": (1, 0.0), "1 json": (1, 1.0), "32 plain": (32, 0.0),
         "32 half json": (32, 0.5)}


async def level(base_url: str, model: str, prompts: list[str], output_len: int,
                concurrency: int, share: float) -> dict:
  """`concurrency` clients, `share` of them sending SCHEMA-constrained requests."""
  from serving.tools import bench_serve

  plain = bench_serve.Target(base_url, model, {"ignore_eos": True})
  json_t = bench_serve.Target(base_url, model, {"ignore_eos": True,
                                                "structured_outputs": {"json": SCHEMA}})
  n_json, c_json = round(len(prompts) * share), round(concurrency * share)
  return await bench_serve.run_groups([(json_t, prompts[:n_json], c_json),
                                      (plain, prompts[n_json:], concurrency - c_json)],
                                     output_len)


def bench(args) -> dict:
  from serving.tools import bench, bench_serve

  tok = bench.load_tokenizer("smollm2-135m-instruct")
  work = tempfile.mkdtemp(prefix="structured_bench_")
  proc = bench_serve.launch_server([], args.port, os.path.join(work, "server.log"))
  url = f"http://127.0.0.1:{args.port}"
  results: dict[str, list[dict]] = {c: [] for c in CASES}
  try:
    bench_serve.wait_ready(url)
    model = bench_serve.first_model_id(url)
    for rep in range(args.repeats):
      order = list(CASES) if rep % 2 == 0 else list(reversed(CASES))
      for case in order:
        concurrency, share = CASES[case]
        n = concurrency * (2 if concurrency > 1 else args.single_requests)
        prompts = [p for p, _ in bench.make_prompts(tok, n, args.input_len,
                                                    seed=rep * 100 + len(results[case]))]
        res = asyncio.run(level(url, model, prompts, args.output_len, concurrency, share))
        results[case].append(res)
        print(f"round {rep} {case:13s} {res['output_tok_s']:7.1f} tok/s  TPOT p50 "
              f"{res['tpot_p50'] * 1e3:6.1f} ms  errors {res['errors']}", flush=True)
  finally:
    proc.terminate()
    proc.wait(timeout=60)
  summary = {}
  for case, runs in results.items():
    tok_s = statistics.median(r["output_tok_s"] for r in runs)
    summary[case] = {"output_tok_s": tok_s,
                     "tpot_p50": statistics.median(r["tpot_p50"] for r in runs),
                     "ttft_p50": statistics.median(r["ttft_p50"] for r in runs),
                     "errors": sum(r["errors"] for r in runs)}
  for case, s in summary.items():
    base = summary["1 plain" if case.startswith("1 ") else "32 plain"]
    s["vs_plain"] = s["output_tok_s"] / base["output_tok_s"]
    print(f"{case:13s} {s['output_tok_s']:7.1f} tok/s  x{s['vs_plain']:.3f}  TPOT p50 "
          f"{s['tpot_p50'] * 1e3:.1f} ms  TTFT p50 {s['ttft_p50']:.2f} s", flush=True)
  return summary


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--single_requests", type=int, default=3,
                 help="requests per round at concurrency 1")
  p.add_argument("--input_len", type=int, default=128)
  p.add_argument("--output_len", type=int, default=128)
  p.add_argument("--port", type=int, default=8320)
  p.add_argument("--json", default=None)
  from serving.tools import bench_serve, run_record
  run_record.add_flags(p)
  args = p.parse_args()
  result = bench(args)
  bench_serve.save_record(args.json, args, result)
  run_record.record_args("structured_bench", args, result, skip=("json", "port"))


if __name__ == "__main__":
  main()
