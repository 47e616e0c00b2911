"""Scaling: xlaserve vs llama-server on random-weight Llama-3.2 1B / 3B GGUFs.

    python benchmarks/scaling.py                       # all: 1b,3b x q4_0,q4_k_m,q8_0 (hours)
    python benchmarks/scaling.py --shapes 1b --formats q4_0 --levels 1,8 --prompt_lens 128 \\
        --repeats 1                                    # a quick look
    python benchmarks/scaling.py --estimate_only       # the expected duration, then exit

For each (shape, format), in turn:

  1. The GGUF: `random_gguf.ensure_model` (cached under `--cache_dir`; written on first
     use: Q4_0 / Q8_0 by gguf-py, Q4_K_M from an F16 file by the built `llama-quantize`).
  2. Both servers start on that one file, both up for the whole measurement:
     - xlaserve as a new user runs it, `xlaserve serve --model=FILE` with no tuning flag:
       only its ports, `--num_pages` for the KV capacity below and, when the longest
       request is past the engine's default `max_model_len`, `--max_model_len`;
     - llama-server (llama.cpp's C++ server, `benchmarks/llama_server.py`): `-t 2 -tb 2
       --parallel <top level> -c <KV capacity> --kv-unified` (one KV pool shared by the
       slots, as xlaserve's pages are, so a long prompt fits whatever the slot count).
     KV capacity, the same for both: the most tokens any level holds at once,
     max over prompt lengths of level x (prompt + output + 64), rounded up to 256.
     A server that does not become ready (exits: its log's tail is printed, e.g. out
     of memory; or `--start_timeout`) is recorded with its error and the other is
     still measured.
  3. Warm-up: one short request each and, with long prompts, one long request each.
     RSS (the process and its children) ready + warmed.
  4. `--repeats` rounds, alternating which server goes first; each round runs, per
     prompt length, the concurrency sweep (`bench_serve.run_sweep`: streaming, a fresh
     connection per request, greedy, `ignore_eos`, `--output_len` tokens): `--levels`
     for prompts up to 1,024 tokens, `--long_levels` (default 1) for longer ones. Every
     request of a server gets a prompt it has not seen (prefix caches do not help).
     RSS again after the rounds. The servers are stopped (and killed if they linger)
     whatever happens.
  5. Figures per server: decode tok/s at 1 (1 / TPOT p50), TTFT alone (p50 at 1),
     output tok/s and TTFT p50 at each level, per prompt length; medians over rounds.

It prints a table of ratios xlaserve / llama-server per file (with the issue's targets)
and one of the figures, and writes a run record (benchmarks/results/<date>-scaling.json)
with every figure, per-round sweeps, the commands and the files' tensor types. Shared
measuring code comes from compare_peers.py (server start, readiness, RSS, log facts).
The machine is shared: compare ratios from one run, not absolute figures across runs.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import math
import os
import signal
import socket
import sys
import time

from serving.tools import bench, bench_serve, run_record

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_peers  # noqa: E402 (benchmarks/ is not a package)
import llama_server  # noqa: E402
import random_gguf  # noqa: E402

OURS, PEER = "xlaserve", "llama-server"
LONG_PROMPT = 1024  # prompts longer than this run at --long_levels
# The targets for these models: figure -> (ratio bound, "min" or "max").
TARGETS = {"decode_b1": (1.0, "min"), "c16_output": (1.5, "min"), "ttft_128": (1.0, "max"),
           "ttft_4096": (1.0, "max"), "rss": (1.3, "max")}
# Rough speeds of this 2-core machine for the duration estimate (llama-server on the
# 1B Q4_0 file: 45 tok/s decode, 93 tok/s prefill, 31 out tok/s at 16 concurrent).
_EST_BANDWIDTH = 25e9  # bytes/s of weights read per decode step
_EST_PREFILL_FLOPS = 2.0e11
_EST_DECODE_FLOPS = 1.2e11
_EST_WRITE_PARAMS_S = 40e6  # parameters written per second (random + quantize)
_EST_START_S = 120.0  # start, load and warm-up compiles of one xlaserve
_BYTES_PER_PARAM = {"q4_0": 4.5 / 8, "q4_k_m": 4.9 / 8, "q8_0": 8.5 / 8, "f16": 2.0, "f32": 4.0}
INTEGER_FIGURES = ("kv_tokens", "failed_requests")
VOCAB = 49152  # the tokenizer source's vocabulary


def parse_args(argv=None) -> argparse.Namespace:
  """The command line (module docstring)."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", default="1b,3b", help=f"of {sorted(random_gguf.SHAPES)}")
  p.add_argument("--formats", default="q4_0,q4_k_m,q8_0", help=f"of {sorted(random_gguf.FORMATS)}")
  p.add_argument("--levels", default="1,8,16,32", help="concurrency levels, short prompts")
  p.add_argument("--long_levels", default="1",
                 help=f"concurrency levels for prompts longer than {LONG_PROMPT} tokens")
  p.add_argument("--prompt_lens", default="128,4096", help="prompt lengths (tokens)")
  p.add_argument("--output_len", type=int, default=128)
  p.add_argument("--repeats", type=int, default=3, help="rounds, alternating the servers")
  p.add_argument("--min_prompts", type=int, default=4, help="fewest requests at a short level")
  p.add_argument("--long_min_prompts", type=int, default=1,
                 help="fewest requests at a long-prompt level")
  p.add_argument("--cache_dir", default=random_gguf.DEFAULT_CACHE, help="the GGUF files")
  p.add_argument("--llama_server", default=None, metavar="PATH",
                 help="llama-server binary (default: llama_server.find_or_build())")
  p.add_argument("--llama_quantize", default=None, metavar="PATH",
                 help="llama-quantize binary, for K-quants (default: built with llama-server)")
  p.add_argument("--start_timeout", type=float, default=1200.0,
                 help="seconds a server may take to become ready")
  p.add_argument("--request_timeout", type=float, default=1800.0, help="seconds per request")
  p.add_argument("--port", type=int, default=18140,
                 help="first port tried (xlaserve, then llama-server)")
  p.add_argument("--estimate_only", action="store_true", help="print the estimate and exit")
  p.add_argument("--json", default="/tmp/scaling.json", help="raw results (every sweep)")
  run_record.add_flags(p)
  args = p.parse_args(argv)
  args.shape_list = _split(args.shapes)
  args.format_list = _split(args.formats)
  for shape in args.shape_list:
    if shape not in random_gguf.SHAPES:
      p.error(f"unknown shape {shape!r}; known: {sorted(random_gguf.SHAPES)}")
  for fmt in args.format_list:
    if fmt not in random_gguf.FORMATS:
      p.error(f"unknown format {fmt!r}; known: {sorted(random_gguf.FORMATS)}")
  args.level_list = [int(x) for x in _split(args.levels)]
  args.long_level_list = [int(x) for x in _split(args.long_levels)]
  args.prompt_len_list = [int(x) for x in _split(args.prompt_lens)]
  if not args.level_list or not args.prompt_len_list or args.repeats < 1:
    p.error("--levels, --prompt_lens and --repeats must not be empty / zero")
  return args


def _split(text: str) -> list[str]:
  return [x.strip() for x in text.split(",") if x.strip()]


def levels_for(args, prompt_len: int) -> list[int]:
  """The concurrency levels a prompt length runs at."""
  return args.long_level_list if prompt_len > LONG_PROMPT else args.level_list


def kv_capacity(args) -> int:
  """KV tokens both servers hold: the most any level needs at once, rounded up to 256."""
  need = max(max(levels_for(args, n)) * (n + args.output_len + 64) for n in args.prompt_len_list)
  return -(-need // 256) * 256


def max_request_len(args) -> int:
  """The longest prompt + output, rounded up to 256 tokens."""
  return -(-(max(args.prompt_len_list) + args.output_len) // 256) * 256


def requests_per_round(args, prompt_len: int) -> int:
  """Requests one server gets in one round at `prompt_len` (bench_serve.level_prompts)."""
  least = args.min_prompts if prompt_len <= LONG_PROMPT else args.long_min_prompts
  return sum(max(c, least) for c in levels_for(args, prompt_len))


# ---- the duration estimate ----

def estimate_file_s(args, shape_key: str, fmt: str, cached: bool) -> float:
  """Seconds one file takes: writing it (unless cached), both starts, warm-ups, the rounds
  of both servers; both assumed as fast as llama-server on this machine (a slower
  server makes it longer)."""
  shape = random_gguf.SHAPES[shape_key]
  params = shape.params(VOCAB)
  flops_per_token = 2 * params
  step_s = lambda c: params * _BYTES_PER_PARAM[fmt] / _EST_BANDWIDTH + (
      c * flops_per_token / _EST_DECODE_FLOPS)
  def prefill_s(n: int) -> float:  # matmuls plus causal attention (QK and PV)
    return (n * flops_per_token + 2 * shape.layers * n * n * shape.hidden) / _EST_PREFILL_FLOPS

  total = 0.0 if cached else params * (2 if random_gguf.FORMATS[fmt][1] else 1) / (
      _EST_WRITE_PARAMS_S)
  total += _EST_START_S
  for n in args.prompt_len_list:
    total += 2 * (prefill_s(n) + 4 * step_s(1))  # warm-ups
    least = args.min_prompts if n <= LONG_PROMPT else args.long_min_prompts
    per_round = 0.0
    for c in levels_for(args, n):
      waves = math.ceil(max(c, least) / c)
      per_round += waves * (c * prefill_s(n) + args.output_len * step_s(c))
    total += 2 * args.repeats * per_round
  return total


def print_estimate(args) -> float:
  """Prints the expected duration per file and in all -> total seconds."""
  total = 0.0
  for shape_key in args.shape_list:
    for fmt in args.format_list:
      cached = os.path.isfile(random_gguf.model_path(args.cache_dir, shape_key, fmt))
      s = estimate_file_s(args, shape_key, fmt, cached)
      total += s
      print(f"  {shape_key} {fmt}: ~{s / 60:.0f} min" + ("" if cached else " (incl. writing "
                                                          "the GGUF)"), flush=True)
  print(f"expected duration: ~{total / 60:.0f} min ({total / 3600:.1f} h), if xlaserve is as "
        "fast as llama-server (slower makes it longer; a busy machine too)", flush=True)
  return total


# ---- servers ----

def free_port(start: int, taken: set[int]) -> int:
  """The first port from `start` that nothing listens on and is not in `taken`."""
  for port in range(start, start + 200):
    if port in taken:
      continue
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
      if s.connect_ex(("127.0.0.1", port)) != 0:
        return port
  raise RuntimeError(f"no free port in {start}..{start + 199}")


def server_specs(args, path: str, binary: str) -> dict[str, dict]:
  """Commands and URLs of both servers for one file (module doc, step 2)."""
  from serving.config import SchedulerOptions

  kv = kv_capacity(args)
  page = compare_peers.xlaserve_page_size(path, [])
  port = free_port(args.port, set())
  flags = [f"--num_pages={math.ceil(kv / page) + 1}"]
  if max_request_len(args) > SchedulerOptions.max_model_len:
    flags.append(f"--max_model_len={max_request_len(args)}")
  ours = [sys.executable, "-m", "serving.launcher", "serve", f"--model={path}",
          f"--http_port={port}", "--grpc_port=-1", *flags]
  peer_port = free_port(port + 1, {port})
  top = max(max(levels_for(args, n)) for n in args.prompt_len_list)
  peer = [binary, "-m", path, "--host", "127.0.0.1", "--port", str(peer_port), "-t", "2",
          "-tb", "2", "--parallel", str(top), "-c", str(kv), "--kv-unified", "--no-webui"]
  return {OURS: {"cmd": ours, "url": f"http://127.0.0.1:{port}",
                 "extra": bench.DEFAULT_EXTRA_BODY, "kv_tokens": None},
          PEER: {"cmd": peer, "url": f"http://127.0.0.1:{peer_port}",
                 "extra": {"ignore_eos": True, "stream_options": {"include_usage": True}},
                 "kv_tokens": kv, "weight_bytes": os.path.getsize(path)}}


def log_tail(proc, lines: int = 25) -> str:
  """The last lines of a server's log (compare_peers.start_server writes it)."""
  try:
    with open(proc.log_path, encoding="utf-8", errors="replace") as f:
      return "".join(f.readlines()[-lines:])
  except OSError:
    return ""


def exit_reason(code: int) -> str:
  """Words for a server's exit code (a negative code is the signal that ended it)."""
  if code == -signal.SIGKILL:
    return "killed (SIGKILL: out of memory?)"
  if code < 0:
    return f"ended by signal {-code}"
  return f"exited with {code}"


def stop(proc, timeout_s: float = 30.0) -> None:
  """Ends a server and every process it started (terminate, then kill what lingers)."""
  import psutil

  try:
    procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
  except psutil.NoSuchProcess:
    procs = []
  for p in procs:
    try:
      p.terminate()
    except psutil.NoSuchProcess:
      pass
  _, alive = psutil.wait_procs(procs, timeout=timeout_s)
  for p in alive:
    try:
      p.kill()
    except psutil.NoSuchProcess:
      pass
  proc.wait(timeout=timeout_s)


def wait_all(procs: dict, specs: dict[str, dict], timeout_s: float) -> dict:
  """Waits for the started servers together -> {name: ready seconds, or the error text}.
  A server that exits or times out is reported, never raised."""
  pool = concurrent.futures.ThreadPoolExecutor(len(procs))
  try:
    futures = {name: pool.submit(compare_peers.ready_after, *procs[name], specs[name]["url"],
                                 timeout_s) for name in procs}
    ready = {}
    for name, future in futures.items():
      proc = procs[name][0]
      try:
        ready[name] = future.result()
      except TimeoutError:
        ready[name] = f"not ready after {timeout_s:.0f} s (log: {proc.log_path})"
      except RuntimeError:
        proc.wait(timeout=60)
        ready[name] = (f"{exit_reason(proc.returncode)} before it was ready (log: "
                       f"{proc.log_path}); its last lines:\n{log_tail(proc)}")
    return ready
  finally:  # on an interrupt, do not wait for the pollers: stopping the servers ends them
    pool.shutdown(wait=False, cancel_futures=True)


# ---- one file ----

class Prompts:
  """Distinct prompts per length; round r of every server takes the same slice."""

  def __init__(self, args, tokenizer):
    self.per_round = {n: requests_per_round(args, n) for n in args.prompt_len_list}
    self.texts = {n: [t for t, _ in bench.make_prompts(tokenizer, 2 + args.repeats * k, n,
                                                       seed=n)]
                  for n, k in self.per_round.items()}

  def warmup(self, prompt_len: int, server_index: int) -> str:
    return self.texts[prompt_len][server_index]

  def round(self, prompt_len: int, rnd: int) -> list[str]:
    k = self.per_round[prompt_len]
    return self.texts[prompt_len][2 + rnd * k:2 + (rnd + 1) * k]


def warm_up(target, prompts: Prompts, args, index: int) -> None:
  """One request of each prompt length (4 output tokens): compiles and page faults stay
  out of the figures. Raises RuntimeError when one fails (e.g. a prompt refused)."""
  for n in args.prompt_len_list:
    sweep = bench_serve.run_sweep(target, [prompts.warmup(n, index)], 4, [1], min_prompts=1,
                                  log=lambda _: None)
    (row,) = sweep["levels"]
    if row["errors"]:
      raise RuntimeError(f"the {n}-token warm-up request failed: {row.get('error_examples')}")


def measure_file(args, path: str, binary: str, prompts: Prompts, tag: str) -> dict:
  """Both servers on one file (module doc, steps 2-4) -> {server: results}."""
  specs = server_specs(args, path, binary)
  results = {name: {"cmd": spec["cmd"], "error": None, "runs": collections.defaultdict(list)}
             for name, spec in specs.items()}
  started = {}
  try:
    for name, spec in specs.items():  # both start together: their loads overlap
      started[name] = compare_peers.start_server(f"scaling_{tag}_{name}", spec["cmd"])
    ready = wait_all(started, specs, args.start_timeout)
    procs = {name: proc for name, (proc, _) in started.items()}
    live = []
    for i, name in enumerate(specs):
      if isinstance(ready[name], str):
        results[name]["error"] = ready[name]
        print(f"{name} FAILED to start: {ready[name]}", flush=True)
        continue
      results[name]["ready_s"] = ready[name]
      try:
        prepare(args, name, specs[name], procs[name], prompts, i, results[name], tag)
      except (OSError, ValueError, KeyError, RuntimeError) as e:  # e.g. /v1/models refused
        results[name]["error"] = (f"warm-up failed: {type(e).__name__}: {e} (log: "
                                  f"{procs[name].log_path}); its last lines:\n"
                                  f"{log_tail(procs[name])}")
        print(f"{name} FAILED: {results[name]['error']}", flush=True)
        continue
      live.append(name)
    check_kv(results)
    for rnd in range(args.repeats):
      for name in live if rnd % 2 == 0 else live[::-1]:
        if results[name]["error"]:
          continue
        run_round(args, specs[name]["target"], procs[name], prompts, rnd, name, results[name])
    for name in live:
      results[name]["rss_after_gb"] = compare_peers.rss_once_idle(procs[name].pid)
  finally:
    for proc, _ in started.values():
      stop(proc)
  return results


def check_kv(results: dict) -> None:
  """Warns when the servers' KV capacities differ by more than a page (RSS is compared at
  equal capacity: a different default page size would show here)."""
  ours, peer = results[OURS].get("kv_tokens"), results[PEER].get("kv_tokens")
  if ours and peer and abs(ours - peer) > 64:
    print(f"WARNING: KV capacity differs: xlaserve {ours} tokens, llama-server {peer}",
          flush=True)


def prepare(args, name: str, spec: dict, proc, prompts: Prompts, index: int, res: dict,
            tag: str) -> None:
  """A ready server: its Target, a warm-up, its KV capacity, weights and RSS."""
  spec["target"] = bench_serve.Target(spec["url"], bench_serve.first_model_id(spec["url"]),
                                      spec["extra"], timeout_s=args.request_timeout)
  warm_up(spec["target"], prompts, args, index)
  res["kv_tokens"], res["weight_bytes"] = spec["kv_tokens"], spec.get("weight_bytes")
  if name == OURS:
    res.update(compare_peers.xlaserve_memory_facts(f"scaling_{tag}_{name}"))
  res["rss_ready_gb"] = compare_peers.rss_once_idle(proc.pid)
  print(f"{name}: ready in {res['ready_s']:.0f} s; RSS {res['rss_ready_gb']:.2f} GB; KV "
        f"{res['kv_tokens']} tokens", flush=True)


def run_round(args, target, proc, prompts: Prompts, rnd: int, name: str, res: dict) -> None:
  """One round of one server: every prompt length's sweep; a server that dies is marked."""
  for n in args.prompt_len_list:
    print(f"round {rnd + 1}: {name}, {n}-token prompts", flush=True)
    least = args.min_prompts if n <= LONG_PROMPT else args.long_min_prompts
    sweep = bench_serve.run_sweep(target, prompts.round(n, rnd), args.output_len,
                                  levels_for(args, n), min_prompts=least)
    res["runs"][n].append(sweep["levels"])
    for row in sweep["levels"]:
      if row["errors"]:
        print(f"  {row['errors']} failed requests at {row['concurrency']}: "
              f"{row.get('error_examples')}", flush=True)
    if proc.poll() is not None:
      res["error"] = (f"{exit_reason(proc.returncode)} during round {rnd + 1} (log: "
                      f"{proc.log_path}); its last lines:\n{log_tail(proc)}")
      print(f"{name} FAILED: {res['error']}", flush=True)
      return


# ---- figures ----

def server_figures(res: dict, args) -> dict:
  """Medians over rounds: per prompt length n, `p{n}_decode_b1_tok_s`, `p{n}_ttft_b1_s`,
  `p{n}_c{c}_output_tok_s`, `p{n}_c{c}_ttft_p50_s`; memory; errors."""
  figs = {"error": res["error"], "ready_s": res.get("ready_s"),
          "kv_tokens": res.get("kv_tokens"), "rss_ready_gb": res.get("rss_ready_gb"),
          "rss_after_gb": res.get("rss_after_gb"),
          "weights_mib": res["weight_bytes"] / 2**20 if res.get("weight_bytes") else None,
          "failed_requests": sum(row["errors"] for runs in res["runs"].values()
                                 for run in runs for row in run)}
  for n, runs in res["runs"].items():
    at = lambda c, key, runs=runs: compare_peers.med(
        row[key] for run in runs for row in run if row["concurrency"] == c)
    for c in levels_for(args, n):
      if c == 1:
        tpot = at(1, "tpot_p50")
        figs[f"p{n}_decode_b1_tok_s"] = 1.0 / tpot if tpot == tpot and tpot > 0 else None
        figs[f"p{n}_ttft_b1_s"] = at(1, "ttft_p50")
      figs[f"p{n}_c{c}_output_tok_s"] = at(c, "output_tok_s")
      figs[f"p{n}_c{c}_ttft_p50_s"] = at(c, "ttft_p50")
  return figs


def figure_rows(args) -> list[tuple[str, str, str | None]]:
  """(label, figure key, target key) of the tables, in order."""
  rows = []
  for n in args.prompt_len_list:
    for c in levels_for(args, n):
      if c == 1:
        rows.append((f"decode tok/s at 1, {n}-token prompt", f"p{n}_decode_b1_tok_s",
                     "decode_b1" if n <= LONG_PROMPT else None))
        rows.append((f"TTFT alone, {n}-token prompt (s)", f"p{n}_ttft_b1_s", f"ttft_{n}"))
      else:
        rows.append((f"output tok/s at {c}, {n}-token prompts", f"p{n}_c{c}_output_tok_s",
                     f"c{c}_output" if n <= LONG_PROMPT else None))
        rows.append((f"TTFT p50 at {c}, {n}-token prompts (s)", f"p{n}_c{c}_ttft_p50_s", None))
  rows += [("RSS ready + warmed (GB)", "rss_ready_gb", "rss"),
           ("RSS after the run (GB)", "rss_after_gb", "rss"),
           ("KV capacity (tokens)", "kv_tokens", None),
           ("weights read per step (MiB)", "weights_mib", None),
           ("start to ready (s)", "ready_s", None),
           ("failed requests", "failed_requests", None)]
  return rows


def _ratio(ours, peer, target: str | None) -> str:
  text = compare_peers._ratio(ours, peer)
  if target not in TARGETS or text == "–":
    return text
  bound, kind = TARGETS[target]
  met = ours / peer >= bound if kind == "min" else ours / peer <= bound
  return f"{text} {'✓' if met else '✗'}"


def tables(figures: dict[str, dict], args, date: str) -> str:
  """Markdown: ratios per file (one row a file), then every figure of every file."""
  rows = [r for r in figure_rows(args) if r[2] in TARGETS or "output_tok_s" in r[1]]
  head = ["file", *(label for label, _, _ in rows)]
  targets = ", ".join(f"{k} {'≥' if kind == 'min' else '≤'} {bound}"
                      for k, (bound, kind) in TARGETS.items())
  lines = [f"Measured {date}: random-weight Llama-3.2-shaped GGUFs, {args.output_len} output "
           f"tokens, greedy, ignore_eos; medians of {args.repeats} alternating rounds; "
           f"xlaserve / llama-server (✓ / ✗: the issue's target {targets}).", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for key, figs in figures.items():
    ours, peer = figs.get(OURS, {}), figs.get(PEER, {})
    cells = [_ratio(ours.get(k), peer.get(k), t) for _, k, t in rows]
    lines.append("| " + " | ".join([key, *cells]) + " |")
  lines += ["", "| file | figure | xlaserve | llama-server | ratio |", "|---|---|---|---|---|"]
  for key, figs in figures.items():
    ours, peer = figs.get(OURS, {}), figs.get(PEER, {})
    for name, f in ((OURS, ours), (PEER, peer)):
      if f.get("error"):
        lines.append(f"| {key} | {name} failed | {f['error'].splitlines()[0]} | | |")
    for label, k, _ in figure_rows(args):
      a, b = ours.get(k), peer.get(k)
      if a is None and b is None:
        continue
      fmt = compare_peers._int if k in INTEGER_FIGURES else compare_peers._fmt
      lines.append(f"| {key} | {label} | {fmt(a)} | {fmt(b)} | {compare_peers._ratio(a, b)} |")
  lines += ["", "The machine is shared: figures are noisy; compare the ratios of one run. "
            "RSS includes child processes; llama-server's KV pool is unified (--kv-unified)."]
  return "\n".join(lines)


def tensor_types(path: str) -> dict[str, int]:
  """How many tensors of each type a GGUF holds (e.g. a Q4_K_M file's Q4_K and Q6_K)."""
  from checkpoints import gguf_reader

  counts = collections.Counter(t.tensor_type.name for t in gguf_reader.open_gguf(path).tensors)
  return dict(sorted(counts.items()))


# ---- main ----

def main(argv=None) -> None:
  """Runs the benchmark (module docstring)."""
  args = parse_args(argv)
  print_estimate(args)
  if args.estimate_only:
    return
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the servers get stopped
  binary = args.llama_server or llama_server.find_or_build()
  quantize_bin = args.llama_quantize
  if not quantize_bin and any(random_gguf.FORMATS[f][1] for f in args.format_list):
    quantize_bin = llama_server.find_or_build_tool("llama-quantize")
  date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
  tokenizer = bench.load_tokenizer(random_gguf.TOKENIZER_SOURCE)
  prompts = Prompts(args, tokenizer)
  raw, figures, files = {}, {}, {}
  for shape_key in args.shape_list:
    for fmt in args.format_list:
      key = f"{shape_key} {fmt}"
      print(f"== {key}", flush=True)
      try:
        path = random_gguf.ensure_model(shape_key, fmt, args.cache_dir, quantize_bin,
                                        log=lambda msg: print(msg, flush=True))
      except (OSError, ValueError, RuntimeError) as e:
        print(f"{key}: FAILED to write the GGUF: {e}", flush=True)
        files[key] = {"error": f"{type(e).__name__}: {e}"}
        continue
      files[key] = {"path": path, "bytes": os.path.getsize(path),
                    "tensor_types": tensor_types(path)}
      raw[key] = measure_file(args, path, binary, prompts, f"{shape_key}_{fmt}")
      figures[key] = {name: server_figures(res, args) for name, res in raw[key].items()}
      with open(args.json, "w", encoding="utf-8") as f:  # after every file: partial results
        json.dump({"date": date, "files": files, "raw": raw, "figures": figures}, f, indent=1)
  print(tables(figures, args, date), flush=True)
  if args.record:
    setup = {"measured": date, "shapes": args.shape_list, "formats": args.format_list,
             "levels": args.level_list, "long_levels": args.long_level_list,
             "prompt_lens": args.prompt_len_list, "output_len": args.output_len,
             "repeats": args.repeats, "min_prompts": args.min_prompts,
             "long_min_prompts": args.long_min_prompts, "kv_tokens": kv_capacity(args),
             "files": files,
             "commands": {key: {name: res["cmd"] for name, res in r.items()}
                          for key, r in raw.items()}}
    per_round = {key: {name: {str(n): [[{k: row.get(k) for k in compare_peers.PER_REPEAT_KEYS}
                                        | {"concurrency": row["concurrency"]} for row in run]
                                       for run in runs] for n, runs in res["runs"].items()}
                       for name, res in r.items()} for key, r in raw.items()}
    run_record.write_record("scaling", run_record.command_line(), setup,
                                   {"files": figures, "per_round": per_round},
                                   results_dir=args.results_dir)


if __name__ == "__main__":
  main()
