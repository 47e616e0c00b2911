"""TTFT and ITL of prefill / decode across processes vs one server vs the in-process pair.

    python benchmarks/pd_bench.py --requests=12 --concurrency=4 --rounds=3

Starts, side by side on this machine (default model, float32, the tests' small
engine options, prefix caching on everywhere):
  * `one`: one server (`--kv_role=both`, today's serving);
  * `inproc`: one server with in-process workers (`--prefill_workers=1
    --decode_workers=N`, serving/engine/disaggregated.py);
  * `pd`: a `--kv_role=prefill` server, two `--kv_role=decode` servers and the
    reference proxy (serving/tools/pd_proxy.py), the client talking to the proxy.
Each round sends the same fresh set of distinct prompts (streamed, greedy,
`ignore_eos`) to each setup in turn, alternating, at a fixed concurrency;
TTFT / ITL p50 / p99 and output tok/s are over every round's requests
(serving/tools/bench_serve.py's client). The decode servers' transfer counters
give the effective pull bandwidth (bytes pulled / seconds in `KVReceiver.pull`:
handshake, HTTP round trips and the waits for each engine's step between its
own steps included), the wire bandwidth (bytes / seconds inside
`TransferConnection.pull` alone) and the pull time per request. Bytes count
whole fixed-shape chunks (`--kv_transfer_pages` slots, padding included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from serving.tools import bench_serve  # noqa: E402

ENGINE = ["--max_num_seqs=8", "--max_model_len=512", "--num_pages=192",
          "--max_num_batched_tokens=128", "--unroll_layers=false", "--dtype=float32",
          "--weight_dtype=float32", "--quantization=none", "--enable_prefix_caching=true",
          "--served_model_name=m"]
WORDS = ("river stone cloud lantern orbit maple signal harbor quiet ember garden copper "
         "violet meadow silver thunder canyon velvet falcon glacier").split()


def _free_port() -> int:
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _server(logdir: str, name: str, procs: list, *flags: str) -> str:
  """Starts one server and waits for it (one at a time: servers starting together race on
  the shared compilation cache) -> its URL."""
  port = _free_port()
  procs.append(bench_serve.launch_server([*ENGINE, *flags], port,
                                         os.path.join(logdir, f"{name}.log")))
  url = f"http://127.0.0.1:{port}"
  bench_serve.wait_ready(url)
  return url


def _proxy(prefill: str, decode: list[str]) -> tuple[subprocess.Popen, str]:
  port = _free_port()
  proc = subprocess.Popen([sys.executable, "-m", "serving.tools.pd_proxy", f"--port={port}",
                           f"--prefill={prefill}", f"--decode={','.join(decode)}"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  return proc, f"http://127.0.0.1:{port}"


def _prompts(n: int, words: int, seed: int) -> list[str]:
  rng = random.Random(seed)
  return [f"Request {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(words))
          for i in range(n)]


def _stats(url: str) -> dict:
  with urllib.request.urlopen(f"{url}/v1/kv_transfer/stats", timeout=10) as r:
    return json.loads(r.read())


def run(args: argparse.Namespace) -> dict:
  """Starts the setups, runs the alternating rounds -> the figures."""
  logdir = tempfile.mkdtemp(prefix="pd_bench_")
  print(f"server logs: {logdir}", flush=True)
  procs: list[subprocess.Popen] = []
  try:
    one_url = _server(logdir, "one", procs)
    inproc_url = _server(logdir, "inproc", procs, "--prefill_workers=1",
                         f"--decode_workers={args.inproc_decode}")
    prefill_url = _server(logdir, "prefill", procs, "--kv_role=prefill")
    decode_urls = [_server(logdir, f"decode{i}", procs, "--kv_role=decode") for i in range(2)]
    proxy, proxy_url = _proxy(prefill_url, decode_urls)
    procs.append(proxy)
    bench_serve.wait_ready(proxy_url, path="/health")
    setups = {"one": one_url, "inproc": inproc_url, "pd": proxy_url}
    records = {name: [] for name in setups}
    elapsed = dict.fromkeys(setups, 0.0)
    warm = _prompts(args.concurrency, args.prompt_words, seed=10_000)
    for url in setups.values():  # first requests: connections, handshakes
      asyncio.run(bench_serve.run_level(bench_serve.Target(url, "m"), warm, 4,
                                        args.concurrency))
    before = [_stats(u) for u in decode_urls]
    for r in range(args.rounds):
      prompts = _prompts(args.requests, args.prompt_words, seed=r)
      order = list(setups) if r % 2 == 0 else list(reversed(setups))
      for name in order:
        recs, secs = asyncio.run(bench_serve.run_level(
            bench_serve.Target(setups[name], "m"), prompts, args.output_tokens,
            args.concurrency))
        records[name] += recs
        elapsed[name] += secs
    after = [_stats(u) for u in decode_urls]
    result = {name: bench_serve.summarize(records[name], elapsed[name]) for name in setups}
    result["transfer"] = _transfer(before, after)
    return result
  finally:
    for p in procs:
      p.terminate()
    for p in procs:
      try:
        p.wait(60)
      except subprocess.TimeoutExpired:
        p.kill()


def _transfer(before: list[dict], after: list[dict]) -> dict:
  def delta(key: str) -> float:
    return sum(a[key] - b[key] for a, b in zip(after, before, strict=True))

  pulls, secs, nbytes = delta("pulls_total"), delta("pull_seconds_total"), delta("bytes_total")
  wire = delta("wire_seconds_total")
  return {"pulls": pulls, "failures": delta("pull_failures_total"), "pages": delta("pages_total"),
          "bytes": nbytes, "mb_per_s": nbytes / secs / 1e6 if secs else 0.0,
          "wire_mb_per_s": nbytes / wire / 1e6 if wire else 0.0,
          "ms_per_pull": 1e3 * secs / pulls if pulls else 0.0}


def _table(result: dict) -> str:
  rows = ["| setup | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | output tok/s | errors |",
          "|---|---|---|---|---|---|---|"]
  for name in ("one", "inproc", "pd"):
    s = result[name]
    rows.append(f"| {name} | {s['ttft_p50'] * 1e3:.0f} ms | {s['ttft_p99'] * 1e3:.0f} ms | "
                f"{s['itl_p50'] * 1e3:.1f} ms | {s['itl_p99'] * 1e3:.1f} ms | "
                f"{s['output_tok_s']:.1f} | {s['errors']} |")
  t = result["transfer"]
  rows.append(f"\ntransfer: {t['pulls']:.0f} pulls, {t['pages']:.0f} pages, "
              f"{t['bytes'] / 1e6:.1f} MB, {t['mb_per_s']:.1f} MB/s effective, "
              f"{t['wire_mb_per_s']:.0f} MB/s on the wire (jax pulls alone), "
              f"{t['ms_per_pull']:.1f} ms per pull, {t['failures']:.0f} failures")
  return "\n".join(rows)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--requests", type=int, default=12, help="prompts per round")
  parser.add_argument("--concurrency", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--prompt_words", type=int, default=96)
  parser.add_argument("--output_tokens", type=int, default=32)
  parser.add_argument("--inproc_decode", type=int, default=1,
                      help="decode workers of the in-process pair")
  parser.add_argument("--out", default=None, help="write the figures as JSON here")
  args = parser.parse_args()
  start = time.perf_counter()
  result = run(args)
  result["wall_s"] = time.perf_counter() - start
  print(_table(result))
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"args": vars(args), "result": result}, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
