"""Side by side with the peers: xlaserve vs llama.cpp's servers vs transformers generate.

    pip install -e ".[bench]"
    python benchmarks/compare_peers.py --levels 1,32 --repeats 3

Same model (the SmolLM2-135M-Instruct GGUF from `checkpoints.resolve_model_path`),
same prompts (random words that encode to exactly `--input_len` tokens), same
output length (`ignore_eos`, greedy) for everyone, in one run:

  1. Measures the memory copy bandwidth once (numpy, a 1 GiB float32 array copied
     five times, best run; GB/s counts the bytes read plus the bytes written, i.e.
     2 x the array size per copy).
  2. Starts, all together, and records each one's time from start to ready:
     - `xlaserve serve` (one per `--ours` variant; `--xlaserve_kv_tokens N` sizes its
       KV cache to N tokens with `--num_pages`);
     - "llama-server": llama.cpp's native C++ server (`--llama_server PATH`, default
       `benchmarks/llama_server.py`'s `find_or_build()`, which builds it from the
       llama.cpp that llama-cpp-python vendors), 2 threads, `--parallel <top level>`
       slots and `-c <top level x (input_len + output_len + 64)>` KV tokens; requests
       carry `ignore_eos`;
     - "llama-cpp-python": the Python wrapper `python -m llama_cpp.server` (2 threads,
       `--interrupt_requests False` so that a new request does not cut the one
       streaming; one request at a time); requests carry `min_tokens` (skipped when
       the `llama_cpp` package is not installed).
     Once each is ready and warmed, records its resident memory (RSS of the process
     and its children, psutil) and its KV cache capacity in tokens (xlaserve: its
     start-up log line 'KV cache: N pages x P tokens = T tokens'; llama-server: -c;
     llama-cpp-python: --n_ctx), so memory can be compared at the same KV capacity.
  3. For each repeat, sweeps the concurrency levels against each server,
     alternating which goes first (bench_serve: SSE, fresh connection per request);
     records each server's RSS again after the sweeps.
  4. Runs transformers `generate` in a subprocess per dtype (float32, bfloat16):
     one request alone (TTFT, decode tok/s) and one static batch of the top level.
  5. Prints medians and ratios (ours / peer) as a table, writes a run record
     (benchmarks/results/<date>-compare_peers.json: date, machine, commit, command,
     setup, every system's medians and per-repeat figures; `--no-record` skips it,
     `--results_dir` puts it elsewhere) and the raw results to `--json`. It edits no
     docs: docs/performance.md quotes the records.

MBU (model bandwidth utilisation) counts weight bytes only: bytes of weights read
per decode step (xlaserve: its start-up log line 'Weights: X MiB'; llama.cpp: the
GGUF file size) x decode steps per second / the copy bandwidth of step 1. One
request: steps/s = decode tok/s (1 / TPOT p50). At the top level the weights are
read once per step for all the requests in it, so steps/s ~ output tok/s / level
(this counts prefill time too, so it is a lower bound). KV cache and activation
reads are left out; the copy bandwidth counts read + write traffic, so MBU is
the weight-read rate as a share of the machine's measured copy traffic rate.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.parse

from serving.tools import bench, bench_serve, run_record

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_server  # noqa: E402 (benchmarks/ is not a package)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
  p.add_argument("--skip_llama_cpp", action="store_true",
                 help="skip the llama-cpp-python row (python -m llama_cpp.server)")
  p.add_argument("--skip_llama_server", action="store_true",
                 help="skip the llama-server row (llama.cpp's native C++ server)")
  p.add_argument("--llama_server", default=None, metavar="PATH",
                 help="llama-server binary (default: llama_server.find_or_build(), which "
                 "takes one on PATH or builds one into ~/.cache/xlaserve/llama-server)")
  p.add_argument("--xlaserve_kv_tokens", type=int, default=None, metavar="N",
                 help="size each started xlaserve's KV cache to N tokens "
                 "(--num_pages=ceil(N / page_size) + 1), e.g. llama-server's -c")
  p.add_argument("--copy_gib", type=float, default=1.0,
                 help="size of the array the bandwidth probe copies (GiB)")
  p.add_argument("--skip_servers", action="store_true", help="transformers only")
  p.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                 help="time a second start of each server (warm compilation cache)")
  p.add_argument("--merge", action="store_true",
                 help="merge into the results already in --json (e.g. two partial runs)")
  p.add_argument("--json", default="/tmp/compare_peers.json", help="raw results (every request)")
  run_record.add_flags(p)
  p.add_argument("--hf_worker", default=None, help=argparse.SUPPRESS)
  return p.parse_args()


def start_server(name: str, cmd: list[str]) -> tuple:
  """Starts a server process -> (process, its start time)."""
  log = open(log_path(name), "w")  # noqa: SIM115 (with the proc)
  start = time.perf_counter()
  proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
  proc.log_path = log.name
  return proc, start


def port_in_use(url: str) -> bool:
  """Whether something already listens on `url`'s port: a server started there would fail
  to bind while the other one answered its requests (an --attach URL on llama-server's
  port gave the attached xlaserve's figures to the llama-server row once)."""
  parsed = urllib.parse.urlparse(url)
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.settimeout(1.0)
    return sock.connect_ex((parsed.hostname or "127.0.0.1", parsed.port or 80)) == 0


def ready_after(proc, start: float, base_url: str, timeout_s: float = 1800) -> float:
  """Seconds from `start` until `base_url` answers (raises if the process exits first;
  kills it on a timeout)."""
  while True:
    if proc.poll() is not None:
      raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before it was ready "
                         f"(its log: {getattr(proc, 'log_path', '?')})")
    try:
      bench_serve.wait_ready(base_url, timeout_s=1)
      return time.perf_counter() - start
    except TimeoutError:
      if time.perf_counter() - start > timeout_s:
        proc.terminate()
        raise


def restart_time(name: str, spec: dict) -> float:
  """Start-to-ready of a fresh process (the compilation cache is warm by now)."""
  proc, start = start_server(f"{name}_restart", spec["cmd"])
  try:
    return ready_after(proc, start, spec["url"])
  finally:
    proc.terminate()
    proc.wait(timeout=60)


def xlaserve_page_size(model: str, flags: list[str]) -> int:
  """Tokens per KV page of an xlaserve variant: its --page_size, else the preset's."""
  from checkpoints import presets

  for flag in flags:
    if flag.startswith("--page_size="):
      return int(flag.split("=", 1)[1])
  return int(presets.engine_defaults(model).get("page_size", 16))


def servers(args, gguf: str) -> dict[str, dict]:
  """Commands, URLs, request extras and memory facts of the servers under test.

  Keys: cmd (None: attached), url, extra (request body fields), ours, kind
  (xlaserve | llama-server | llama-cpp-python), kv_tokens (KV capacity known
  before start, else parsed from the log) and weight_bytes (bytes of weights read
  per decode step; xlaserve: parsed from its log).
  """
  top = int(args.levels.split(",")[-1])
  out = {}
  for attach in args.attach:
    name, _, url = attach.partition("=")
    out[name] = {"cmd": None, "url": url, "extra": bench.DEFAULT_EXTRA_BODY, "ours": True,
                 "kind": "xlaserve"}
  for i, variant in enumerate(args.ours or ([] if args.attach else ["xlaserve="])):
    name, _, extra_flags = variant.partition("=")
    port = 18110 + i
    flags = extra_flags.split()
    if args.xlaserve_kv_tokens and not any(f.startswith("--num_pages=") for f in flags):
      page = xlaserve_page_size(args.model, flags)
      flags.append(f"--num_pages={math.ceil(args.xlaserve_kv_tokens / page) + 1}")
    cmd = [sys.executable, "-m", "serving.launcher", "serve", f"--model={args.model}",
           f"--http_port={port}", "--grpc_port=-1", *flags]
    out[name] = {"cmd": cmd, "url": f"http://127.0.0.1:{port}", "extra": bench.DEFAULT_EXTRA_BODY,
                 "ours": True, "kind": "xlaserve"}
  if not args.skip_llama_server:
    binary = args.llama_server or llama_server.find_or_build()
    ctx = top * (args.input_len + args.output_len + 64)
    cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", "18102", "-t", "2", "-tb", "2",
           "--parallel", str(top), "-c", str(ctx), "--no-webui"]
    # llama-server's /v1/completions: max_tokens -> n_predict; ignore_eos keeps it going.
    out["llama-server"] = {"cmd": cmd, "url": "http://127.0.0.1:18102",
                           "extra": {"ignore_eos": True,
                                     "stream_options": {"include_usage": True}},
                           "kind": "llama-server", "kv_tokens": ctx,
                           "weight_bytes": os.path.getsize(gguf)}
  if not args.skip_llama_cpp:
    if importlib.util.find_spec("llama_cpp") is None:
      print("llama-cpp-python is not installed (pip install 'llama-cpp-python[server]'): "
            "skipping its row", flush=True)
    else:
      llama = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_threads", "2",
               "--n_threads_batch", "2", "--n_ctx", "2048", "--port", "18101",
               "--interrupt_requests", "False"]
      out["llama-cpp-python"] = {"cmd": llama, "url": "http://127.0.0.1:18101",
                                 "extra": {"min_tokens": args.output_len},
                                 "kind": "llama-cpp-python", "kv_tokens": 2048,
                                 "weight_bytes": os.path.getsize(gguf)}
  return out


def log_path(name: str) -> str:
  return os.path.join("/tmp", f"compare_{name}.log")


IDLE_WAIT_S = 1.0  # xlaserve hands a burst's freed heap back after 0.5 s idle (llm_engine)


def rss_once_idle(pid: int) -> float | None:
  """rss_gb a moment after the last request: the resident memory of a server at rest."""
  time.sleep(IDLE_WAIT_S)
  return rss_gb(pid)


def rss_gb(pid: int) -> float | None:
  """Resident memory of a process and all its children (GB, 1e9 bytes)."""
  import psutil

  try:
    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
  except psutil.NoSuchProcess:
    return None
  total = 0
  for p in procs:
    try:
      total += p.memory_info().rss
    except psutil.NoSuchProcess:
      pass
  return total / 1e9


KV_LINE = re.compile(r"KV cache: (\d+) pages x (\d+) tokens = (\d+) tokens")
WEIGHTS_LINE = re.compile(r"Weights: ([\d.]+) MiB")


def xlaserve_memory_facts(name: str) -> dict:
  """KV capacity (tokens) and weight bytes from an xlaserve's start-up log."""
  try:
    with open(log_path(name), encoding="utf-8", errors="replace") as f:
      text = f.read()
  except OSError:
    return {}
  facts = {}
  if m := KV_LINE.search(text):
    facts["kv_tokens"] = int(m.group(3))
  if m := WEIGHTS_LINE.search(text):
    facts["weight_bytes"] = int(float(m.group(1)) * 2**20)
  return facts


def run_servers(args, prompts: list[str], specs: dict[str, dict]) -> dict[str, dict]:
  """Starts every server, runs the alternating sweeps, stops them -> results per server."""
  levels = [int(x) for x in args.levels.split(",")]
  results = {name: {"ready_s": None, "runs": [], "kind": spec.get("kind")}
             for name, spec in specs.items()}
  procs = {}
  for name, spec in specs.items():
    if spec["cmd"] and port_in_use(spec["url"]):
      raise SystemExit(f"{name}: {spec['url']} already answers (an --attach server or a "
                       "leftover process): its figures would be that server's")
  try:
    for name, spec in specs.items():  # all start together: cold compiles overlap
      if spec["cmd"]:
        procs[name] = start_server(name, spec["cmd"])
    with concurrent.futures.ThreadPoolExecutor(max(1, len(procs))) as pool:  # each its own time
      ready = {name: pool.submit(ready_after, *procs[name], specs[name]["url"]) for name in procs}
      for name, future in ready.items():
        results[name]["ready_s"] = future.result()
    for name, spec in specs.items():
      if name not in procs:
        bench_serve.wait_ready(spec["url"], timeout_s=1800)
      spec["target"] = bench_serve.Target(spec["url"], bench_serve.first_model_id(spec["url"]),
                                          spec["extra"])
      bench_serve.run_sweep(spec["target"], prompts[:2], 4, [1], min_prompts=1,
                            log=lambda _: None)  # warm-up
      res = results[name]
      res["kv_tokens"], res["weight_bytes"] = spec.get("kv_tokens"), spec.get("weight_bytes")
      if spec.get("kind") == "xlaserve" and name in procs:
        res.update(xlaserve_memory_facts(name))
      res["rss_ready_gb"] = rss_once_idle(procs[name][0].pid) if name in procs else None
      print(f"{name}: ready ({res['ready_s']} s); RSS {_fmt(res['rss_ready_gb'])} GB; "
            f"KV capacity {res['kv_tokens']} tokens; weights read per step "
            f"{_fmt((res['weight_bytes'] or float('nan')) / 2**20)} MiB", flush=True)
    kv = {n: r["kv_tokens"] for n, r in results.items() if r["kv_tokens"]}
    if kv:
      print("KV cache capacity (tokens): " + ", ".join(f"{n} {t}" for n, t in kv.items()) +
            ("" if args.xlaserve_kv_tokens or "llama-server" not in kv else
             f"; --xlaserve_kv_tokens {kv['llama-server']} would give xlaserve llama-server's"),
            flush=True)
    names = list(specs)
    for rep in range(args.repeats):
      for name in names if rep % 2 == 0 else names[::-1]:
        print(f"repeat {rep + 1}: {name}", flush=True)
        offset = (rep * 7919) % len(prompts)  # different prompts each repeat
        rotated = prompts[offset:] + prompts[:offset]
        sweep = bench_serve.run_sweep(specs[name]["target"], rotated, args.output_len, levels,
                                      min_prompts=args.min_prompts)
        results[name]["runs"].append(sweep["levels"])
    for name, (proc, _) in procs.items():
      results[name]["rss_after_gb"] = rss_once_idle(proc.pid)
      print(f"{name}: RSS after the run {_fmt(results[name]['rss_after_gb'])} GB", flush=True)
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


def measure_copy_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
  """GB/s of a numpy copy of a `gib` GiB float32 array, best of `repeats`; counts the
  bytes read plus the bytes written (2 x the array size per copy)."""
  return bench.measure_bandwidth(nbytes=int(gib * 2**30), repeats=repeats)


def mbu(weight_bytes, steps_per_s, copy_gb_s) -> float | None:
  """Weight bytes read per second as a share of the copy bandwidth."""
  if not weight_bytes or not copy_gb_s or steps_per_s is None or steps_per_s != steps_per_s:
    return None
  return weight_bytes * steps_per_s / (copy_gb_s * 1e9)


def server_figures(res: dict, levels: list[int], copy_gb_s: float | None = None
                   ) -> dict[str, float]:
  """Medians over repeats of a server's figures, its memory and MBU."""
  top = levels[-1]
  by_level = lambda c, key: med(r[key] for run in res["runs"] for r in run if r["concurrency"] == c)
  figs = {"ready_s": res.get("ready_warm_s", res["ready_s"])}
  if 1 in levels:
    figs["decode_b1_tok_s"] = 1.0 / by_level(1, "tpot_p50")
    figs["ttft_b1_s"] = by_level(1, "ttft_p50")
    figs["mbu_b1"] = mbu(res.get("weight_bytes"), figs["decode_b1_tok_s"], copy_gb_s)
  figs[f"c{top}_output_tok_s"] = by_level(top, "output_tok_s")
  figs[f"c{top}_ttft_p50_s"] = by_level(top, "ttft_p50")
  figs[f"c{top}_ttft_p95_s"] = by_level(top, "ttft_p95")
  figs[f"c{top}_mbu"] = mbu(res.get("weight_bytes"), figs[f"c{top}_output_tok_s"] / top,
                            copy_gb_s)
  weight_bytes = res.get("weight_bytes")
  figs["weights_mib"] = weight_bytes / 2**20 if weight_bytes else None
  figs["kv_tokens"] = res.get("kv_tokens")
  figs["rss_ready_gb"] = res.get("rss_ready_gb")
  figs["rss_after_gb"] = res.get("rss_after_gb")
  figs["copy_gb_s"] = copy_gb_s
  figs["errors"] = sum(r["errors"] for run in res["runs"] for r in run)
  return figs


def hf_figures(res: dict, top: int) -> dict[str, float]:
  if "error" in res:
    return {}
  return {"decode_b1_tok_s": med(s["decode_tok_s"] for s in res["single"]),
          "ttft_b1_s": med(s["ttft_s"] for s in res["single"]),
          f"c{top}_output_tok_s": med(b["output_tok_s"] for b in res["batch"])}


def table(figs: dict[str, dict], top: int, date: str, args, copy_gb_s=None) -> str:
  """Markdown: one row a figure, one column a system, ratios ours / peer."""
  names = list(figs)
  rows = [("decode tok/s, 1 request (1 / TPOT p50)", "decode_b1_tok_s", _fmt),
          ("TTFT, 1 request, p50 (s)", "ttft_b1_s", _fmt),
          ("MBU, 1 request (weights x decode tok/s / copy GB/s)", "mbu_b1", _pct),
          (f"output tok/s, {top} concurrent", f"c{top}_output_tok_s", _fmt),
          (f"TTFT p50 at {top} concurrent (s)", f"c{top}_ttft_p50_s", _fmt),
          (f"TTFT p95 at {top} concurrent (s)", f"c{top}_ttft_p95_s", _fmt),
          (f"MBU at {top} concurrent (weights x output tok/s / {top} / copy GB/s)",
           f"c{top}_mbu", _pct),
          ("weights read per decode step (MiB)", "weights_mib", _fmt),
          ("KV cache capacity (tokens)", "kv_tokens", _int),
          ("RSS ready + warmed (GB)", "rss_ready_gb", _fmt),
          ("RSS after the run (GB)", "rss_after_gb", _fmt),
          ("restart to ready, warm cache (s)" if args.restart else "start to ready (s)", "ready_s",
           _fmt)]
  ours = [n for n in names if n in args.ours_names]
  peers = [n for n in names if n not in ours]
  head = ["figure", *names, *(f"{o} / {p}" for o in ours for p in peers)]
  lines = [f"Measured {date}: {args.input_len}-token prompts, {args.output_len} output tokens, "
           f"greedy, ignore_eos; medians of {args.repeats} alternating repeats; "
           f"xlaserve variants: {', '.join(args.ours or ['xlaserve= (preset)'])}"
           + (f", KV cache {args.xlaserve_kv_tokens} tokens" if args.xlaserve_kv_tokens else "")
           + (f"; memory copy {copy_gb_s:.1f} GB/s (read + write)" if copy_gb_s else "") + ".",
           "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for label, key, fmt in rows:
    vals = [figs[n].get(key) for n in names]
    if all(v is None or v != v for v in vals):
      continue
    ratios = [_ratio(figs[o].get(key), figs[p].get(key)) for o in ours for p in peers]
    lines.append("| " + " | ".join([label, *(fmt(v) for v in vals), *ratios]) + " |")
  lines.append("")
  lines.append("Ratios are ours / peer (above 1 is better for tok/s and MBU, worse for seconds "
               "and GB). llama-server is llama.cpp's C++ server (`--parallel` slots); "
               "llama-cpp-python its Python wrapper `llama_cpp.server` (one request at a "
               f"time). transformers runs one static batch of {top} (no server); its 'TTFT' "
               "is a one-token generate. MBU counts weight bytes only (xlaserve: its "
               "'Weights' log line; llama.cpp: the GGUF file) against a numpy copy's "
               "read + write GB/s; at "
               f"{top} concurrent, steps/s ~ output tok/s / {top}. RSS includes child "
               "processes.")
  return "\n".join(lines)


def _fmt(v) -> str:
  if v is None or v != v:
    return "–"
  return f"{v:.3f}" if v < 1 else f"{v:.1f}"


def _pct(v) -> str:
  return "–" if v is None or v != v else f"{100 * v:.1f} %"


def _int(v) -> str:
  return "–" if v is None or v != v else f"{v:.0f}"


def _ratio(a, b) -> str:
  if a is None or b is None or a != a or b != b or b == 0:
    return "–"
  return f"{a / b:.2f}×"


PER_REPEAT_KEYS = ("output_tok_s", "ttft_p50", "ttft_p95", "tpot_p50", "errors")


def record_setup(args, date: str) -> dict:
  """What the run measured, for its record."""
  return {"model": args.model, "measured": date, "levels": args.levels,
          "repeats": args.repeats, "input_len": args.input_len, "output_len": args.output_len,
          "xlaserve_variants": args.ours or ["xlaserve="], "attached": args.attach,
          "xlaserve_kv_tokens": args.xlaserve_kv_tokens, "hf_dtypes": args.hf_dtypes,
          "llama_server": not args.skip_llama_server, "llama_cpp_python": not args.skip_llama_cpp,
          "restart": args.restart}


def record_figures(saved: dict) -> dict:
  """Medians per system and each repeat's sweep, for the run record."""
  per_repeat = {name: [[{"concurrency": row["concurrency"], **{k: row.get(k) for k in
                                                             PER_REPEAT_KEYS}}
                        for row in run] for run in res.get("runs", [])]
                for name, res in saved.get("servers", {}).items()}
  return {"copy_gb_s": saved.get("copy_gb_s"), "ours": saved.get("ours_names", []),
          "systems": saved.get("figures", {}), "per_repeat": per_repeat,
          "ready_s": {name: {"first_start": res.get("ready_s"),
                             "restart": res.get("ready_warm_s")}
                      for name, res in saved.get("servers", {}).items()}}


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
  copy_gb_s = measure_copy_bandwidth(args.copy_gib) if specs else None
  if copy_gb_s:
    print(f"memory copy bandwidth: {copy_gb_s:.1f} GB/s (read + write, "
          f"{args.copy_gib:g} GiB float32, best of 5)", flush=True)
  results = run_servers(args, [t for t, _ in pairs], specs) if specs else {}
  saved.setdefault("servers", {}).update(results)
  saved.setdefault("figures", {}).update(
      {name: server_figures(res, levels, copy_gb_s) for name, res in results.items()})
  if copy_gb_s:
    saved["copy_gb_s"] = copy_gb_s
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
  text = table(saved["figures"], levels[-1], date, args, saved.get("copy_gb_s"))
  print(text, flush=True)
  if args.record:
    run_record.write_record("compare_peers", run_record.command_line(), record_setup(args, date),
                            record_figures(saved), results_dir=args.results_dir)


def _load(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)

if __name__ == "__main__":
  main()
