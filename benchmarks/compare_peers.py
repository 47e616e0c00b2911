"""Side by side with the peers: xlaserve vs llama.cpp's server vs transformers generate.

    pip install -e ".[bench]"
    python benchmarks/compare_peers.py --levels 1,32 --repeats 3

Same model (the SmolLM2-135M-Instruct GGUF from `checkpoints.resolve_model_path`),
same prompts (random words that encode to exactly `--input_len` tokens), same
output length (`ignore_eos`, greedy) for everyone, in one run:

  1. Starts `xlaserve serve` and `python -m llama_cpp.server` (2 threads,
     `--interrupt_requests False` so that a new request does not cut the one
     streaming) and records each one's time from start to ready.
  2. For each repeat, sweeps the concurrency levels against each server,
     alternating which goes first (bench_serve: SSE, fresh connection per request).
  3. Runs transformers `generate` in a subprocess per dtype (float32, bfloat16):
     one request alone (TTFT, decode tok/s) and one static batch of the top level.
  4. Writes medians and ratios (ours / peer) between the markers of
     docs/performance.md and everything to `--json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from serving.tools import bench, bench_serve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BEGIN, END = "<!-- compare_peers:begin -->", "<!-- compare_peers:end -->"


def parse_args() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="smollm2-135m-instruct")
  p.add_argument("--levels", default="1,32", help="concurrency levels")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--min_prompts", type=int, default=4, help="fewest requests at a level")
  p.add_argument("--input_len", type=int, default=128)
  p.add_argument("--output_len", type=int, default=128)
  p.add_argument("--ours", action="append", default=None, metavar="NAME=FLAGS",
                 help="an xlaserve variant: a name and its serve flags (repeatable), e.g. "
                 "'int8=--quantization=int8'; default: one 'xlaserve' with the preset's flags")
  p.add_argument("--hf_dtypes", default="bfloat16,float32", help="'' skips transformers")
  p.add_argument("--attach", action="append", default=[], metavar="NAME=URL",
                 help="an xlaserve already serving at URL (not started, not restarted)")
  p.add_argument("--skip_llama_cpp", action="store_true")
  p.add_argument("--skip_servers", action="store_true", help="transformers only")
  p.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                 help="time a second start of each server (warm compilation cache)")
  p.add_argument("--merge", action="store_true",
                 help="merge into the results already in --json (e.g. two partial runs)")
  p.add_argument("--json", default="/tmp/compare_peers.json")
  p.add_argument("--doc", default=os.path.join(ROOT, "docs", "performance.md"))
  p.add_argument("--hf_worker", default=None, help=argparse.SUPPRESS)
  return p.parse_args()


def start_server(name: str, cmd: list[str], log_dir: str = "/tmp") -> tuple:
  """Starts a server process -> (process, its start time)."""
  log = open(os.path.join(log_dir, f"compare_{name}.log"), "w")  # noqa: SIM115 (with the proc)
  start = time.perf_counter()
  return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), start


def ready_after(proc, start: float, base_url: str) -> float:
  """Seconds from `start` until `base_url` answers (kills the process on a timeout)."""
  try:
    bench_serve.wait_ready(base_url, timeout_s=1800)
  except TimeoutError:
    proc.terminate()
    raise
  return time.perf_counter() - start


def restart_time(name: str, spec: dict) -> float:
  """Start-to-ready of a fresh process (the compilation cache is warm by now)."""
  proc, start = start_server(f"{name}_restart", spec["cmd"])
  try:
    return ready_after(proc, start, spec["url"])
  finally:
    proc.terminate()
    proc.wait(timeout=60)


def servers(args, gguf: str) -> dict[str, dict]:
  """Commands, URLs and request extras of the servers under test."""
  out = {}
  for attach in args.attach:
    name, _, url = attach.partition("=")
    out[name] = {"cmd": None, "url": url, "extra": bench.DEFAULT_EXTRA_BODY, "ours": True}
  for i, variant in enumerate(args.ours or ([] if args.attach else ["xlaserve="])):
    name, _, extra_flags = variant.partition("=")
    port = 18110 + i
    cmd = [sys.executable, "-m", "serving.launcher", "serve", f"--model={args.model}",
           f"--http_port={port}", "--grpc_port=-1", *extra_flags.split()]
    out[name] = {"cmd": cmd, "url": f"http://127.0.0.1:{port}", "extra": bench.DEFAULT_EXTRA_BODY,
                 "ours": True}
  if not args.skip_llama_cpp:
    llama = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_threads", "2",
             "--n_threads_batch", "2", "--n_ctx", "2048", "--port", "18101",
             "--interrupt_requests", "False"]
    out["llama.cpp"] = {"cmd": llama, "url": "http://127.0.0.1:18101",
                        "extra": {"min_tokens": args.output_len}}
  return out


def run_servers(args, prompts: list[str], specs: dict[str, dict]) -> dict[str, dict]:
  """Starts every server, runs the alternating sweeps, stops them -> results per server."""
  levels = [int(x) for x in args.levels.split(",")]
  results = {name: {"ready_s": None, "runs": []} for name in specs}
  procs = {}
  try:
    for name, spec in specs.items():  # all start together: cold compiles overlap
      if spec["cmd"]:
        procs[name] = start_server(name, spec["cmd"])
    for name, spec in specs.items():
      if name in procs:
        results[name]["ready_s"] = ready_after(*procs[name], spec["url"])
      else:
        results[name]["ready_s"] = bench_serve.wait_ready(spec["url"], timeout_s=1800) and None
      spec["target"] = bench_serve.Target(spec["url"], bench_serve.first_model_id(spec["url"]),
                                          spec["extra"])
      bench_serve.run_sweep(spec["target"], prompts[:2], 4, [1], min_prompts=1,
                            log=lambda _: None)  # warm-up
      print(f"{name}: ready ({results[name]['ready_s']} s)", flush=True)
    names = list(specs)
    for rep in range(args.repeats):
      for name in names if rep % 2 == 0 else names[::-1]:
        print(f"repeat {rep + 1}: {name}", flush=True)
        offset = (rep * 7919) % len(prompts)  # different prompts each repeat
        rotated = prompts[offset:] + prompts[:offset]
        sweep = bench_serve.run_sweep(specs[name]["target"], rotated, args.output_len, levels,
                                      min_prompts=args.min_prompts)
        results[name]["runs"].append(sweep["levels"])
  finally:
    for proc, _ in procs.values():
      proc.terminate()
      proc.wait(timeout=60)
  for name, spec in specs.items():
    if not args.restart or not spec["cmd"]:
      continue
    results[name]["ready_warm_s"] = restart_time(name, spec)
    print(f"{name}: restart to ready in {results[name]['ready_warm_s']:.1f} s", flush=True)
  return results


def hf_worker(spec: str) -> None:
  """Subprocess body: transformers generate on the GGUF -> one JSON line on stdout."""
  import torch
  import transformers

  cfg = json.loads(spec)
  torch.set_num_threads(2)
  dtype = getattr(torch, cfg["dtype"])
  gguf = cfg["gguf"]
  model = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=dtype).eval()
  out = {"dtype": cfg["dtype"], "single": [], "batch": []}
  n = cfg["output_len"]
  with torch.inference_mode():
    for rep in range(cfg["repeats"]):
      ids = torch.tensor([cfg["prompts"][rep]])
      t0 = time.perf_counter()
      model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
      ttft = time.perf_counter() - t0
      t0 = time.perf_counter()
      model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
      total = time.perf_counter() - t0
      out["single"].append({"ttft_s": ttft, "decode_tok_s": (n - 1) / max(total - ttft, 1e-9)})
      batch = torch.tensor(cfg["prompts"][rep:rep + cfg["batch"]])
      t0 = time.perf_counter()
      model.generate(batch, max_new_tokens=n, min_new_tokens=n, do_sample=False)
      elapsed = time.perf_counter() - t0
      out["batch"].append({"output_tok_s": batch.shape[0] * n / elapsed, "elapsed_s": elapsed})
  print(json.dumps(out), flush=True)


def run_hf(args, gguf: str, prompt_ids: list[list[int]], dtype: str, batch: int) -> dict:
  spec = json.dumps({"gguf": gguf, "dtype": dtype, "output_len": args.output_len,
                     "repeats": args.repeats, "batch": batch, "prompts": prompt_ids})
  proc = subprocess.run([sys.executable, __file__, "--hf_worker", spec], capture_output=True,
                        text=True, cwd=ROOT, timeout=3600)
  if proc.returncode != 0:
    return {"dtype": dtype, "error": proc.stderr[-2000:]}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def med(values) -> float:
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else float("nan")


def server_figures(res: dict, levels: list[int]) -> dict[str, float]:
  """Medians over repeats of a server's figures."""
  top = levels[-1]
  by_level = lambda c, key: med(r[key] for run in res["runs"] for r in run if r["concurrency"] == c)
  figs = {"ready_s": res.get("ready_warm_s", res["ready_s"])}
  if 1 in levels:
    figs["decode_b1_tok_s"] = 1.0 / by_level(1, "tpot_p50")
    figs["ttft_b1_s"] = by_level(1, "ttft_p50")
  figs[f"c{top}_output_tok_s"] = by_level(top, "output_tok_s")
  figs[f"c{top}_ttft_p95_s"] = by_level(top, "ttft_p95")
  figs["errors"] = sum(r["errors"] for run in res["runs"] for r in run)
  return figs


def hf_figures(res: dict, top: int) -> dict[str, float]:
  if "error" in res:
    return {}
  return {"decode_b1_tok_s": med(s["decode_tok_s"] for s in res["single"]),
          "ttft_b1_s": med(s["ttft_s"] for s in res["single"]),
          f"c{top}_output_tok_s": med(b["output_tok_s"] for b in res["batch"])}


def table(figs: dict[str, dict], top: int, date: str, args) -> str:
  """Markdown: one row a figure, one column a system, ratios ours / peer."""
  names = list(figs)
  rows = [("decode tok/s, 1 request (1 / TPOT p50)", "decode_b1_tok_s", True),
          ("TTFT, 1 request, p50 (s)", "ttft_b1_s", False),
          (f"output tok/s, {top} concurrent", f"c{top}_output_tok_s", True),
          (f"TTFT p95 at {top} concurrent (s)", f"c{top}_ttft_p95_s", False),
          ("restart to ready, warm cache (s)" if args.restart else "start to ready (s)", "ready_s",
           False)]
  ours = [n for n in names if n in args.ours_names]
  peers = [n for n in names if n not in ours]
  head = ["figure", *names, *(f"{o} / {p}" for o in ours for p in peers)]
  lines = [f"Measured {date}: {args.input_len}-token prompts, {args.output_len} output tokens, "
           f"greedy, ignore_eos; medians of {args.repeats} alternating repeats; "
           f"xlaserve variants: {', '.join(args.ours or ['xlaserve= (preset)'])}.", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for label, key, _ in rows:
    vals = [figs[n].get(key) for n in names]
    ratios = [_ratio(figs[o].get(key), figs[p].get(key)) for o in ours for p in peers]
    lines.append("| " + " | ".join([label, *(_fmt(v) for v in vals), *ratios]) + " |")
  lines.append("")
  lines.append("Ratios are ours / peer (above 1 is better for tok/s, worse for seconds). "
               f"transformers runs one static batch of {top} (no server); its 'TTFT' is a "
               "one-token generate.")
  return "\n".join(lines)


def _fmt(v) -> str:
  if v is None or v != v:
    return "–"
  return f"{v:.3f}" if v < 1 else f"{v:.1f}"


def _ratio(a, b) -> str:
  if a is None or b is None or a != a or b != b or b == 0:
    return "–"
  return f"{a / b:.2f}×"


def write_doc(path: str, text: str) -> None:
  """Replaces the text between the markers (appends a section when they are absent)."""
  doc = open(path, encoding="utf-8").read() if os.path.exists(path) else "# Performance\n"
  block = f"{BEGIN}\n{text}\n{END}"
  if BEGIN in doc and END in doc:
    doc = doc[:doc.index(BEGIN)] + block + doc[doc.index(END) + len(END):]
  else:
    doc = doc.rstrip() + "\n\n## Side by side with the peers\n\n" + block + "\n"
  with open(path, "w", encoding="utf-8") as f:
    f.write(doc)


def main() -> None:
  args = parse_args()
  if args.hf_worker:
    hf_worker(args.hf_worker)
    return
  import checkpoints

  gguf = checkpoints.resolve_model_path(args.model)
  tok = bench.load_tokenizer(args.model)
  levels = [int(x) for x in args.levels.split(",")]
  pairs = bench.make_prompts(tok, max(512, 4 * sum(levels)), args.input_len)
  date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
  specs = {} if args.skip_servers else servers(args, gguf)
  args.ours_names = [n for n, s in specs.items() if s.get("ours")]
  saved = _load(args.json) if args.merge else {}
  results = run_servers(args, [t for t, _ in pairs], specs) if specs else {}
  saved.setdefault("servers", {}).update(results)
  saved.setdefault("figures", {}).update(
      {name: server_figures(res, levels) for name, res in results.items()})
  for dtype in filter(None, args.hf_dtypes.split(",")):
    print(f"transformers {dtype}", flush=True)
    hf = run_hf(args, gguf, [ids for _, ids in pairs[:args.repeats + levels[-1]]], dtype,
                levels[-1])
    saved.setdefault("transformers", {})[dtype] = hf
    saved["figures"][f"transformers {dtype}"] = hf_figures(hf, levels[-1])
  saved["ours_names"] = sorted(set(saved.get("ours_names", [])) | set(args.ours_names))
  saved["runs"] = saved.get("runs", []) + [{"date": date, "args": {
      k: v for k, v in vars(args).items() if k != "ours_names"}}]
  with open(args.json, "w", encoding="utf-8") as f:
    json.dump(saved, f, indent=1)
  args.ours_names = saved["ours_names"]
  text = table(saved["figures"], levels[-1], date, args)
  print(text, flush=True)
  write_doc(args.doc, text)


def _load(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)

if __name__ == "__main__":
  main()
