"""Soak test: the server under steady streaming load for a set time, checked for drift.

Starts `xlaserve serve` (or attaches to a running server with `--url` and
`--pid`), runs `--concurrency` clients that each stream completions back to
back for `--duration_s` seconds (a `--cancel_fraction` of them cancelled
mid-stream), samples the server's RSS and `/metrics` every `--sample_s`
seconds, then waits for the server to go idle and reports:

  errors           requests that got a non-200 status, an error event or a transport error
  latency drift    median time per output token in the last 20% of the run / the first 20%
  RSS drift        RSS at the end - RSS after warm-up (the first 10% of the run)
  pages in use     KV pages still held once every request has finished (must be 0)

The report is JSON (stdout and `--output`); the exit code is 1 when a bound
is broken (`--max_rss_growth_mib`, `--max_latency_drift`, any error, pages
left in use). For the record run it for 30 minutes with `--record` (a run record in
benchmarks/results/<date>-soak.json); CI runs 60 s (tests/ops/test_ops_load.py):

  python benchmarks/soak.py --duration_s=1800 --concurrency=8 --record
  python benchmarks/soak.py --url=http://127.0.0.1:8000 --pid=1234 --duration_s=60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SERVER_FLAGS = ("--max_num_seqs=8 --max_model_len=256 --num_pages=96 "
                        "--max_num_batched_tokens=64 --unroll_layers=false --dtype=float32 "
                        "--weight_dtype=float32")
PROMPTS = ("Write a short poem about the sea.", "Explain what a hash table is.",
           "List three uses of copper.", "The capital of France is",
           "Translate 'good morning' into Spanish.", "Once upon a time, in a small village,",
           "Give me a recipe for pancakes.", "Why is the sky blue?")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--url", help="attach to this server instead of starting one")
  ap.add_argument("--pid", type=int, help="the attached server's pid (for RSS)")
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--server_flags", default=DEFAULT_SERVER_FLAGS,
                  help="engine flags for the server this script starts")
  ap.add_argument("--duration_s", type=float, default=60.0)
  ap.add_argument("--concurrency", type=int, default=8)
  ap.add_argument("--min_tokens", type=int, default=4)
  ap.add_argument("--max_tokens", type=int, default=32)
  ap.add_argument("--cancel_fraction", type=float, default=0.1)
  ap.add_argument("--sample_s", type=float, default=5.0)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--max_rss_growth_mib", type=float, default=256.0)
  ap.add_argument("--max_latency_drift", type=float, default=2.0)
  ap.add_argument("--output", help="also write the JSON report here")
  ap.add_argument("--record", action="store_true",
                  help="also write a run record into --results_dir (the record run)")
  ap.add_argument("--results_dir", default=None,
                  help="where run records go (default: benchmarks/results)")
  return ap.parse_args(argv)


def rss_mib(pid: int | None) -> float | None:
  if pid is None:
    return None
  with open(f"/proc/{pid}/status", encoding="ascii") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return None


def scrape(client: httpx.Client) -> dict[str, float]:
  """Sample name -> value (labels summed) from /metrics."""
  from prometheus_client.parser import text_string_to_metric_families

  out: dict[str, float] = {}
  for family in text_string_to_metric_families(client.get("/metrics").text):
    for s in family.samples:
      out[s.name] = out.get(s.name, 0.0) + s.value
  return out


class Recorder:
  """Per-request results and periodic server samples, in run time (seconds from start)."""

  def __init__(self):
    self.requests: list[dict] = []
    self.samples: list[dict] = []
    self.errors: list[str] = []


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, rng: random.Random,
                      rec: Recorder, t0: float) -> None:
  max_tokens = rng.randint(args.min_tokens, args.max_tokens)
  cancel = rng.random() < args.cancel_fraction
  body = {"model": args.served_model_name, "prompt": rng.choice(PROMPTS), "stream": True,
          "max_tokens": max_tokens, "temperature": 0.8, "seed": rng.randint(0, 2**31 - 1)}
  start = time.monotonic()
  first = None
  chunks = 0
  try:
    async with client.stream("POST", "/v1/completions", json=body) as r:
      if r.status_code != 200:
        rec.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        return
      async for line in r.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
          continue
        event = json.loads(line[6:])
        if "error" in event:
          rec.errors.append(f"error event: {event['error'].get('message')}")
          return
        if event["choices"][0]["text"]:
          chunks += 1
          first = first or time.monotonic()
        if cancel and chunks >= 2:
          break
  except httpx.HTTPError as e:
    rec.errors.append(f"{type(e).__name__}: {e}")
    return
  end = time.monotonic()
  rec.requests.append({"t": end - t0, "ttft": (first or end) - start, "e2e": end - start,
                       "chunks": chunks, "cancelled": cancel})


async def load(args: argparse.Namespace, rec: Recorder) -> None:
  t0 = time.monotonic()
  stop_at = t0 + args.duration_s
  limits = httpx.Limits(max_connections=args.concurrency + 4)

  async def worker(i: int) -> None:
    rng = random.Random(args.seed * 1000 + i)
    async with httpx.AsyncClient(base_url=args.url, timeout=300, limits=limits) as client:
      while time.monotonic() < stop_at:
        await one_request(client, args, rng, rec, t0)

  async def sampler() -> None:
    with httpx.Client(base_url=args.url, timeout=30) as client:
      while time.monotonic() < stop_at:
        m = await asyncio.to_thread(scrape, client)
        rec.samples.append({"t": time.monotonic() - t0, "rss_mib": rss_mib(args.pid),
                            "kv_usage": m.get("xlaserve_kv_cache_usage_perc"),
                            "running": m.get("xlaserve_num_requests_running"),
                            "waiting": m.get("xlaserve_num_requests_waiting")})
        await asyncio.sleep(args.sample_s)

  await asyncio.gather(sampler(), *(worker(i) for i in range(args.concurrency)))


def median_tpot(reqs: list[dict]) -> float | None:
  vals = [(r["e2e"] - r["ttft"]) / (r["chunks"] - 1) for r in reqs if r["chunks"] > 1]
  return statistics.median(vals) if vals else None


def report(args: argparse.Namespace, rec: Recorder, final: dict[str, float],
           rss_end: float | None, wall_s: float) -> dict:
  dur = args.duration_s
  early = [r for r in rec.requests if r["t"] <= 0.2 * dur]
  late = [r for r in rec.requests if r["t"] >= 0.8 * dur]
  tpot_early, tpot_late = median_tpot(early), median_tpot(late)
  warm = [s["rss_mib"] for s in rec.samples if s["t"] >= 0.1 * dur and s["rss_mib"] is not None]
  rss_start = warm[0] if warm else None
  ttfts = sorted(r["ttft"] for r in rec.requests)
  pages_in_use = round(final["xlaserve_kv_cache_pages_total"]
                       - final["xlaserve_kv_cache_pages_free"])
  out = {
      "duration_s": dur, "wall_s": round(wall_s, 1), "concurrency": args.concurrency,
      "requests": len(rec.requests) + len(rec.errors),
      "completed": sum(not r["cancelled"] for r in rec.requests),
      "cancelled": sum(r["cancelled"] for r in rec.requests),
      "errors": len(rec.errors), "error_samples": rec.errors[:5],
      "text_chunks": sum(r["chunks"] for r in rec.requests),
      "ttft_p50_s": _q(ttfts, 0.5), "ttft_p95_s": _q(ttfts, 0.95),
      "tpot_p50_first20_s": _round(tpot_early), "tpot_p50_last20_s": _round(tpot_late),
      "latency_drift": _round(tpot_late / tpot_early) if tpot_early and tpot_late else None,
      "rss_start_mib": _round(rss_start), "rss_end_mib": _round(rss_end),
      "rss_max_mib": _round(max(warm)) if warm else None,
      "rss_drift_mib": _round(rss_end - rss_start) if rss_start and rss_end else None,
      "pages_in_use_end": pages_in_use,
      "kv_usage_end": final["xlaserve_kv_cache_usage_perc"],
      "running_end": final["xlaserve_num_requests_running"],
      "waiting_end": final["xlaserve_num_requests_waiting"],
  }
  out["passed"] = bool(
      out["errors"] == 0 and pages_in_use == 0 and out["running_end"] == 0
      and out["waiting_end"] == 0 and out["requests"] > 0
      and (out["rss_drift_mib"] is None or out["rss_drift_mib"] < args.max_rss_growth_mib)
      and (out["latency_drift"] is None or out["latency_drift"] < args.max_latency_drift))
  return out


def _q(xs: list[float], q: float) -> float | None:
  return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else None


def _round(x: float | None) -> float | None:
  return None if x is None else round(x, 4)


def wait_idle(url: str, timeout_s: float = 120) -> dict[str, float]:
  deadline = time.monotonic() + timeout_s
  with httpx.Client(base_url=url, timeout=30) as client:
    while True:
      m = scrape(client)
      idle = (m["xlaserve_num_requests_running"] == 0 and m["xlaserve_num_requests_waiting"] == 0
              and m["xlaserve_kv_cache_usage_perc"] == 0)
      if idle or time.monotonic() > deadline:
        return m
      time.sleep(0.5)


def start_server(args: argparse.Namespace) -> subprocess.Popen:
  """`xlaserve serve` on a free loopback port; returns once it prints its ready line."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  cmd = [sys.executable, "-m", "serving.launcher", "serve", f"--model={args.model}",
         f"--http_port={port}", "--grpc_port=-1", *args.server_flags.split()]
  proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
  for line in proc.stdout:
    sys.stderr.write(line)
    if line.startswith("xlaserve ready"):
      break
  if proc.poll() is not None:
    raise SystemExit(f"server exited with {proc.returncode}")
  threading.Thread(target=lambda: [sys.stderr.write(line) for line in proc.stdout],
                   daemon=True).start()  # keep reading: a full pipe would block the server
  args.url, args.pid = f"http://127.0.0.1:{port}", proc.pid
  return proc


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  proc = start_server(args) if args.url is None else None
  try:
    with httpx.Client(base_url=args.url, timeout=30) as client:
      args.served_model_name = client.get("/v1/models").json()["data"][0]["id"]
    rec = Recorder()
    start = time.monotonic()
    asyncio.run(load(args, rec))
    final = wait_idle(args.url)
    out = report(args, rec, final, rss_mib(args.pid), time.monotonic() - start)
  finally:
    if proc is not None:
      proc.send_signal(signal.SIGTERM)
      proc.wait(120)
  text = json.dumps(out, indent=2)
  print(text)
  if args.output:
    with open(args.output, "w", encoding="utf-8") as f:
      f.write(text + "\n")
  if args.record:  # imported here: CI runs this script without the package on its path
    from serving.tools import run_record

    args.results_dir = args.results_dir or run_record.RESULTS_DIR
    run_record.record_args("soak", args, out,
                           skip=("url", "pid", "output", "served_model_name"))
  return 0 if out["passed"] else 1


if __name__ == "__main__":
  sys.exit(main())
