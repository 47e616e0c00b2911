"""Load client for `xlaserve bench serve`: any OpenAI-compatible `/v1/completions`.

Lifecycle of a sweep (`run_sweep`):
  1. For each concurrency level `c`, `c` workers share a queue of prompts
     (closed loop; `rounds * c` requests, at least `min_prompts`), or with a
     request rate, requests arrive as a Poisson process.
  2. Every request streams (SSE) over a fresh HTTP/1.1 connection (llama.cpp's
     server drops idle keep-alives): the time of each content event gives
     TTFT, inter-token latencies (ITL) and TPOT.
  3. `summarize` turns the records into output tok/s and p50 / p95 / p99 of
     TTFT, TPOT, ITL and end-to-end latency, plus the error count.
  4. `find_knee` picks the level after which throughput stops rising
     (< `gain` more) while latency keeps growing; `plot` draws throughput and
     p95 TTFT against concurrency.

The client is a few asyncio streams rather than an HTTP library: it shares
two cores with the server under test, so it should cost as little as possible.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass
class RequestRecord:
  """What one streamed request did (times in seconds from its send)."""

  ok: bool
  ttft: float = 0.0
  latency: float = 0.0
  output_tokens: int = 0
  prompt_tokens: int = 0
  itls: list[float] = dataclasses.field(default_factory=list)
  error: str = ""
  finish_reason: str | None = None

  @property
  def tpot(self) -> float:
    return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclasses.dataclass(frozen=True)
class Target:
  """An endpoint: base URL (`http://host:port`), model id and extra body fields."""

  base_url: str
  model: str
  extra_body: dict[str, Any] = dataclasses.field(default_factory=dict)
  timeout_s: float = 600.0


def completion_body(target: Target, prompt: str, output_len: int) -> dict[str, Any]:
  """The standard workload's request: greedy, `output_len` tokens, streamed with usage."""
  body = {"model": target.model, "prompt": prompt, "max_tokens": output_len,
          "temperature": 0.0, "stream": True}
  body.update(target.extra_body)
  return body


async def _read_chunked(reader: asyncio.StreamReader):
  """Yields the payload of an HTTP/1.1 chunked body as it arrives."""
  while True:
    size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
    if size == 0:
      return
    data = await reader.readexactly(size)
    await reader.readexactly(2)
    yield data


async def _open(url: urllib.parse.SplitResult, body: bytes, path: str):
  reader, writer = await asyncio.open_connection(url.hostname, url.port or 80)
  head = (f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
          f"Accept: text/event-stream\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n")
  writer.write(head.encode() + body)
  await writer.drain()
  status = (await reader.readline()).decode("latin-1").split()
  headers = {}
  while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
    k, _, v = line.decode("latin-1").partition(":")
    headers[k.strip().lower()] = v.strip()
  return reader, writer, int(status[1]) if len(status) > 1 else 0, headers


async def _body_chunks(reader: asyncio.StreamReader, headers: dict[str, str]):
  if headers.get("transfer-encoding", "").lower() == "chunked":
    async for data in _read_chunked(reader):
      yield data
    return
  while data := await reader.read(65536):
    yield data


def _event_tokens(event: dict[str, Any], rec: RequestRecord) -> int:
  """Content tokens carried by one SSE event (0 for a usage-only or empty event)."""
  usage = event.get("usage")
  if usage:
    rec.prompt_tokens = usage.get("prompt_tokens", 0)
    rec.output_tokens = max(rec.output_tokens, usage.get("completion_tokens", 0))
  n = 0
  for choice in event.get("choices") or []:
    rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
    if choice.get("text") or (choice.get("delta") or {}).get("content"):
      n += 1
  return n


async def stream_request(target: Target, prompt: str, output_len: int) -> RequestRecord:
  """Sends one streaming completion; records TTFT and the gap between content events."""
  url = urllib.parse.urlsplit(target.base_url)
  body = json.dumps(completion_body(target, prompt, output_len)).encode()
  start = time.perf_counter()
  rec = RequestRecord(ok=False)
  try:
    async with asyncio.timeout(target.timeout_s):
      reader, writer, status, headers = await _open(url, body, url.path.rstrip("/") +
                                                    "/v1/completions")
      try:
        await _consume(reader, headers, status, start, rec)
      finally:
        writer.close()
    if rec.ok and not rec.prompt_tokens and rec.finish_reason == "length":
      rec.output_tokens = output_len  # no usage: a "length" finish ran to max_tokens
  except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
    rec.ok, rec.error = False, rec.error or f"{type(e).__name__}: {e}"
  rec.latency = time.perf_counter() - start
  return rec


async def _consume(reader, headers, status: int, start: float, rec: RequestRecord) -> None:
  buf, last, events = b"", None, 0
  async for data in _body_chunks(reader, headers):
    if status != 200:
      buf += data
      continue
    buf = (buf + data).replace(b"\r\n", b"\n")  # sse-starlette ends lines with CRLF
    while b"\n\n" in buf:
      raw, buf = buf.split(b"\n\n", 1)
      payload = raw.strip().removeprefix(b"data:").strip()
      if not payload or payload == b"[DONE]" or not raw.strip().startswith(b"data:"):
        continue
      n = _event_tokens(json.loads(payload), rec)
      if n:
        now = time.perf_counter() - start
        if last is None:
          rec.ttft = now
        else:
          rec.itls.append(now - last)
        last, events = now, events + n
  if status != 200:
    rec.error = f"HTTP {status}: {buf[:200].decode('utf-8', 'replace')}"
    return
  rec.output_tokens = max(rec.output_tokens, events)
  rec.ok = events > 0


async def run_level(target: Target, prompts: Sequence[str], output_len: int, concurrency: int,
                    request_rate: float | None = None, seed: int = 0) -> tuple[list, float]:
  """Runs all prompts at `concurrency` (or Poisson `request_rate`) -> (records, seconds)."""
  queue: asyncio.Queue[str] = asyncio.Queue()
  for p in prompts:
    queue.put_nowait(p)
  records: list[RequestRecord] = []

  async def worker() -> None:
    while not queue.empty():
      records.append(await stream_request(target, queue.get_nowait(), output_len))

  start = time.perf_counter()
  if request_rate:
    rng, tasks = random.Random(seed), []
    for p in prompts:
      tasks.append(asyncio.create_task(stream_request(target, p, output_len)))
      await asyncio.sleep(rng.expovariate(request_rate))
    records = list(await asyncio.gather(*tasks))
  else:
    await asyncio.gather(*(worker() for _ in range(concurrency)))
  return records, time.perf_counter() - start


async def run_groups(groups: Sequence[tuple[Target, Sequence[str], int]],
                     output_len: int) -> dict[str, Any]:
  """Runs groups of (target, prompts, concurrency) at the same time (a group with
  concurrency 0 is skipped); returns one `summarize` over all their requests."""
  start = time.perf_counter()
  done = await asyncio.gather(*(run_level(t, ps, output_len, c) for t, ps, c in groups if c))
  return summarize([r for recs, _ in done for r in recs], time.perf_counter() - start)


def _pcts(values: Sequence[float], prefix: str) -> dict[str, float]:
  if not values:
    return {f"{prefix}_p{q}": float("nan") for q in (50, 95, 99)}
  arr = np.asarray(values, np.float64)
  return {f"{prefix}_p{q}": float(np.percentile(arr, q)) for q in (50, 95, 99)}


def summarize(records: Sequence[RequestRecord], elapsed: float) -> dict[str, Any]:
  """Output tok/s and latency percentiles (seconds) of one level."""
  ok = [r for r in records if r.ok]
  out_tokens = sum(r.output_tokens for r in ok)
  row = {"requests": len(records), "errors": len(records) - len(ok), "elapsed_s": elapsed,
         "output_tokens": out_tokens, "prompt_tokens": sum(r.prompt_tokens for r in ok),
         "output_tok_s": out_tokens / elapsed if elapsed > 0 else 0.0,
         "request_s": len(ok) / elapsed if elapsed > 0 else 0.0}
  row.update(_pcts([r.ttft for r in ok], "ttft"))
  row.update(_pcts([r.tpot for r in ok if r.output_tokens > 1], "tpot"))
  row.update(_pcts([x for r in ok for x in r.itls], "itl"))
  row.update(_pcts([r.latency for r in ok], "e2e"))
  errors = sorted({r.error for r in records if not r.ok})
  if errors:
    row["error_examples"] = errors[:3]
  return row


def find_knee(levels: Sequence[dict[str, Any]], gain: float = 0.10) -> int | None:
  """The concurrency after which output tok/s rises by less than `gain` (None: no levels).

  `levels` are summaries with a `concurrency` key, in increasing order. The
  knee is the last level worth its latency: past it throughput is flat (or
  falls) while TTFT keeps growing. With throughput still rising at the top
  level, the knee is the top level (the sweep did not reach it).
  """
  if not levels:
    return None
  for cur, nxt in zip(levels, levels[1:], strict=False):
    if nxt["output_tok_s"] < cur["output_tok_s"] * (1.0 + gain):
      return cur["concurrency"]
  return levels[-1]["concurrency"]


def level_prompts(prompts: Sequence[str], concurrency: int, rounds: int, min_prompts: int,
                  offset: int) -> list[str]:
  """`max(rounds * c, min_prompts)` prompts taken round-robin from `offset`."""
  n = max(rounds * concurrency, min_prompts)
  return [prompts[(offset + i) % len(prompts)] for i in range(n)]


def run_sweep(target: Target, prompts: Sequence[str], output_len: int,
              concurrencies: Sequence[int], *, rounds: int = 1, min_prompts: int = 4,
              request_rate: float | None = None, log=print) -> dict[str, Any]:
  """Runs every concurrency level against `target` -> {levels, knee_concurrency}."""
  levels, offset = [], 0
  for c in concurrencies:
    batch = level_prompts(prompts, c, rounds, min_prompts, offset)
    offset += len(batch)
    records, elapsed = asyncio.run(run_level(target, batch, output_len, c, request_rate))
    row = {"concurrency": c, "request_rate": request_rate, **summarize(records, elapsed)}
    levels.append(row)
    log(f"  c={c:3d}: {row['output_tok_s']:7.1f} out tok/s  TTFT p50 {row['ttft_p50']:.3f} "
        f"p95 {row['ttft_p95']:.3f} s  TPOT p50 {row['tpot_p50'] * 1e3:.1f} ms  "
        f"errors {row['errors']}")
  return {"levels": levels, "knee_concurrency": find_knee(levels)}


def plot(results: dict[str, list[dict[str, Any]]], path: str, title: str = "") -> str:
  """PNG of output tok/s and p95 TTFT against concurrency, one line per target."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import ScalarFormatter

  fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(11, 4.2))
  for name, levels in results.items():
    xs = [r["concurrency"] for r in levels]
    ax_t.plot(xs, [r["output_tok_s"] for r in levels], marker="o", label=name)
    ax_l.plot(xs, [r["ttft_p95"] for r in levels], marker="o", label=name)
  for ax, label in ((ax_t, "output tok/s"), (ax_l, "TTFT p95 (s)")):
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel(label)
    ax.grid(True, alpha=0.3)
    ax.legend()
  fig.suptitle(title or "throughput and p95 TTFT against concurrency")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def save_record(path: str | None, args: Any, result: Any) -> None:
  """Writes a benchmark's result with the date, machine and arguments (no-op without path)."""
  import datetime
  import os
  import platform

  if not path:
    return
  record = {"date": datetime.date.today().isoformat(),
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "args": vars(args), "result": result}
  with open(path, "w") as f:
    json.dump(record, f, indent=1)


def launch_server(flags: Sequence[str], port: int, log_path: str, tree: str | None = None):
  """`xlaserve serve` (HTTP on `port`, no gRPC, prefix caching off unless `flags` say)
  as a subprocess of this Python, its output to `log_path`; pair with `wait_ready`.
  `tree`: a checkout of xlaserve to serve from (its directory first on PYTHONPATH; for
  before/after comparisons in one run), else the one this Python imports."""
  import subprocess
  import sys

  log = open(log_path, "w")  # noqa: SIM115 -- the child writes it until it exits
  cmd = [sys.executable, "-m", "serving.launcher", "serve", f"--http_port={port}",
         "--grpc_port=-1", "--enable_prefix_caching=false", *flags]
  env = None
  if tree is not None:
    tree = os.path.abspath(tree)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [tree, *filter(None, [os.environ.get("PYTHONPATH")])])}
  return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tree)


def wait_ready(base_url: str, timeout_s: float = 600.0, path: str = "/v1/models") -> float:
  """Polls `path` until it answers 200; returns the seconds waited (raises on timeout)."""
  import urllib.request

  start = time.perf_counter()
  while time.perf_counter() - start < timeout_s:
    try:
      with urllib.request.urlopen(base_url.rstrip("/") + path, timeout=2) as r:
        if r.status == 200:
          return time.perf_counter() - start
    except OSError:
      pass
    time.sleep(0.1)
  raise TimeoutError(f"{base_url} not ready after {timeout_s:.0f} s")


def first_model_id(base_url: str) -> str:
  """The first model id `GET /v1/models` lists."""
  import urllib.request

  with urllib.request.urlopen(base_url.rstrip("/") + "/v1/models", timeout=10) as r:
    return json.loads(r.read())["data"][0]["id"]
