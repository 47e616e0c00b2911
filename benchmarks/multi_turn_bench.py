"""Multi-turn chat against the tiered prefix cache: tiers off, host tier, host + disk.

    PYTHONPATH=. python benchmarks/multi_turn_bench.py [--conversations 48] [--turns 5]
        [--system_tokens 1024] [--user_tokens 128] [--output_tokens 32] [--pool_share 0.25]
        [--arrival think|closed] [--think_s 20] [--stagger_s S]
        [--configs off,host,disk] [--repeats 1] [--json out.json]

The workload: `--conversations` chats share one system prompt of
`--system_tokens` tokens; every turn sends the whole history (the system
prompt, every earlier user message and answer) plus a new user message of
`--user_tokens` random tokens, and asks for `--output_tokens` greedy tokens
(`ignore_eos`). The chats run interleaved. `--arrival think` (the default, as
users chat and as SGLang's and vLLM's multi-turn benchmarks run it): the
conversations start `--stagger_s` apart (default `--think_s` / conversations,
so the first turns arrive at the steady rate) and each sends its next turn a
think time after its answer came back (uniform in 0.5-1.5 x `--think_s`,
seeded: the same schedule for every config). The offered load is set by the
schedule (about conversations / think time turns per second), so at a load the
machine sustains a turn's TTFT is its own prefill work (the history recomputed
or reloaded), not a queue for a slot. `--arrival closed`: all start at once
(`--stagger_s` apart) and each sends its next turn as soon as its last answer
is complete — a throughput test where most of a turn's TTFT is waiting for a
slot. Token ids are drawn from a seeded generator, so every config sees the
same prompts (answers are the model's own: greedy, identical across configs —
checked).

The device pool holds `--pool_share` (default a quarter) of the KV of all
conversations at their last turn (the shared system prompt counted once), but
at least one full-length request. The host tier is sized to hold all of it
(`--host_gb`, default: that size + 25%); the disk tier (`host+disk`) gets a
host tier of `--disk_host_share` of that and the rest on disk, so that pages
really pass through it (it needs serving/engine/kv_disk_store.py).

Each config is one in-process engine on the same loaded model (built, warmed
up, then measured); with `--repeats` > 1 the order alternates. Reported per
config: TTFT p50 / p95 (from submitting a turn to its first token), also over
the returning turns only (turn 2 on: every config computes a first turn), the
total time and the turns completed per second, prompt tokens computed by
prefill, the device prefix cache's token hit rate, each tier's page hit rate
(pages found / pages asked of it) and the share of all prompt tokens each tier
served. Medians over repeats. A run record goes to
benchmarks/results/ (`--no-record` skips it).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import queue
import shutil
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from checkpoints.presets import engine_defaults  # noqa: E402
from serving.config import EngineConfig, expected_platform, merge_engine_options  # noqa: E402
from serving.entrypoints.engine_builder import build_engine, load_model  # noqa: E402
from serving.runner.kv_cache import kv_bytes_per_token  # noqa: E402
from serving.runner.weights import resolve_dtypes  # noqa: E402
from serving.tools import run_record  # noqa: E402
from serving.types import SamplingParams  # noqa: E402


def parse_args() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default="smollm2-135m-instruct")
  p.add_argument("--conversations", type=int, default=48)
  p.add_argument("--turns", type=int, default=5)
  p.add_argument("--system_tokens", type=int, default=1024)
  p.add_argument("--user_tokens", type=int, default=128)
  p.add_argument("--output_tokens", type=int, default=32)
  p.add_argument("--pool_share", type=float, default=0.25)
  p.add_argument("--page_size", type=int, default=16)
  p.add_argument("--max_num_seqs", type=int, default=16)
  p.add_argument("--max_num_batched_tokens", type=int, default=512)
  p.add_argument("--host_gb", type=float, default=None)
  p.add_argument("--disk_host_share", type=float, default=0.25)
  p.add_argument("--arrival", choices=("think", "closed"), default="think")
  p.add_argument("--think_s", type=float, default=20.0)
  p.add_argument("--stagger_s", type=float, default=None)
  p.add_argument("--configs", default="off,host,disk")
  p.add_argument("--repeats", type=int, default=1)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", default=None)
  run_record.add_flags(p)
  args = p.parse_args()
  if args.stagger_s is None:  # think: the first turns arrive at the steady state's rate
    args.stagger_s = args.think_s / args.conversations if args.arrival == "think" else 0.0
  return args


def sizes(args, per_token_bytes: int) -> dict:
  """Token counts of the workload and the pool / tier sizes derived from them."""
  longest = args.system_tokens + args.turns * (args.user_tokens + args.output_tokens)
  max_len = -(-longest // 256) * 256
  unique = args.system_tokens + args.conversations * args.turns * (
      args.user_tokens + args.output_tokens)
  per_seq = max_len // args.page_size
  pages = max(int(unique * args.pool_share) // args.page_size, per_seq) + 1
  host_gb = args.host_gb or 1.25 * unique * per_token_bytes / 2**30
  return dict(max_model_len=max_len, unique_tokens=unique, num_pages=pages, host_gb=host_gb)


def engine_config(args, model: str, size: dict, tiers: str, disk_dir: str) -> EngineConfig:
  opts = dict(max_num_seqs=args.max_num_seqs, max_model_len=size["max_model_len"],
              page_size=args.page_size, num_pages=size["num_pages"],
              max_num_batched_tokens=args.max_num_batched_tokens, kv_transfer_pages=32)
  if tiers == "host":
    opts["kv_offload_host_gb"] = size["host_gb"]
  elif tiers == "disk":
    opts.update(kv_offload_host_gb=size["host_gb"] * args.disk_host_share,
                kv_offload_disk_dir=disk_dir, kv_offload_disk_gb=2 * size["host_gb"])
  return EngineConfig.of(**merge_engine_options(engine_defaults(model), opts,
                                                expected_platform()))


def arrivals(args) -> tuple[list[float], list[list[float]]]:
  """The think-time schedule, the same for every config: when each conversation starts
  (`--stagger_s` apart) and, per turn, the pause after its answer before the next
  (uniform in [0.5, 1.5] x `--think_s`, seeded)."""
  rng = np.random.default_rng(args.seed + 1)
  starts = [c * args.stagger_s for c in range(args.conversations)]
  think = (args.think_s * rng.uniform(0.5, 1.5, (args.conversations, args.turns))).tolist()
  return starts, think


def run_chats(engine, args, vocab: int) -> dict:
  """Runs the workload on a started engine; per-turn TTFTs, outputs, the wall time.

  `--arrival closed`: every conversation starts at once (or `--stagger_s` apart) and
  sends its next turn as soon as its answer is complete. `--arrival think`: each
  conversation starts at its scheduled time and sends its next turn a think time after
  its answer came back (`arrivals`), so the offered load is set by the schedule."""
  rng = np.random.default_rng(args.seed)
  system = rng.integers(3, vocab, args.system_tokens).tolist()
  users = [[rng.integers(3, vocab, args.user_tokens).tolist() for _ in range(args.turns)]
           for _ in range(args.conversations)]
  history = [list(system) for _ in range(args.conversations)]
  outputs = [[] for _ in range(args.conversations)]
  events: queue.Queue = queue.Queue()
  ttft: list[float] = []
  params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)

  def submit(c: int, turn: int) -> None:
    history[c] += users[c][turn]
    sent, got = time.perf_counter(), []

    def on_output(out, c=c, sent=sent, got=got):
      if out.token_ids and not got:
        ttft.append((turn, time.perf_counter() - sent))
      got.extend(out.token_ids)
      if out.finished:
        events.put((c, turn, got, out.error))

    engine.add_request(f"c{c}t{turn}", list(history[c]), params, on_output)

  start = time.perf_counter()
  starts, think = arrivals(args)
  if args.arrival == "think":
    due = [(t, c, 0) for c, t in enumerate(starts)]  # (when, conversation, turn)
  else:
    due = []
    for c in range(args.conversations):
      submit(c, 0)
      if args.stagger_s:
        time.sleep(args.stagger_s)
  heapq.heapify(due)
  remaining = args.conversations * args.turns
  while remaining:
    now = time.perf_counter() - start
    while due and due[0][0] <= now:
      _, c, turn = heapq.heappop(due)
      submit(c, turn)
    try:
      c, turn, got, error = events.get(timeout=max(due[0][0] - now, 0) if due else 3600)
    except queue.Empty:
      continue
    if error:
      raise RuntimeError(f"conversation {c} turn {turn} failed: {error}")
    remaining -= 1
    outputs[c].append(got)
    history[c] += got
    if turn + 1 < args.turns:
      if args.arrival == "think":
        heapq.heappush(due, (time.perf_counter() - start + think[c][turn], c, turn + 1))
      else:
        submit(c, turn + 1)
  return dict(total_s=time.perf_counter() - start, ttft=ttft, outputs=outputs)


def measure(engine, args, vocab: int) -> dict:
  before, load = engine.stats(), os.getloadavg()[0]
  run = run_chats(engine, args, vocab)
  after = engine.stats()
  queries = after.prefix_cache_queries_total - before.prefix_cache_queries_total
  hits = after.prefix_cache_hits_total - before.prefix_cache_hits_total
  ttft = [t for _, t in run["ttft"]]
  later = [t for turn, t in run["ttft"] if turn > 0]  # returning turns: the tiers' case
  row = dict(ttft_p50=statistics.median(ttft), ttft_p95=float(np.percentile(ttft, 95)),
             ttft_p50_later=statistics.median(later),
             ttft_p95_later=float(np.percentile(later, 95)), total_s=run["total_s"],
             turns_per_s=len(ttft) / run["total_s"],
             prefill_tokens=(after.prefill_tokens_computed_total
                             - before.prefill_tokens_computed_total),
             device_hit_rate=hits / max(queries, 1), outputs=run["outputs"],
             load_avg=(load + os.getloadavg()[0]) / 2)  # the machine's 1-min load: noise
  tiers = after.kv_offload
  if tiers is not None:
    for name in ("host", "disk"):
      t = getattr(tiers, name)
      if t is not None:
        row[f"{name}_hit_rate"] = t.hits / max(t.hits + t.misses, 1)
        row[f"{name}_hits"] = t.hits
        row[f"{name}_token_share"] = t.hits * args.page_size / max(queries, 1)
    row.update(pages_offloaded=tiers.pages_offloaded, pages_reloaded=tiers.pages_reloaded,
               offload_ms_per_chunk=1e3 * tiers.offload_seconds / max(tiers.offload_chunks, 1),
               reload_ms_per_step=1e3 * tiers.reload_seconds / max(tiers.reload_steps, 1))
  return row


def main() -> None:
  args = parse_args()
  configs = args.configs.split(",")
  base = engine_config(args, args.model, dict(max_model_len=4096, num_pages=None, host_gb=0),
                       "off", "")
  loaded = load_model(args.model, base)
  _, kv_dtype = resolve_dtypes(base, jax.default_backend())
  size = sizes(args, kv_bytes_per_token(loaded.config, kv_dtype))
  print(f"workload: {args.conversations} conversations x {args.turns} turns, system "
        f"{args.system_tokens}, user {args.user_tokens}, output {args.output_tokens} tokens; "
        f"{size['unique_tokens']} tokens of KV in all; device pool {size['num_pages'] - 1} pages "
        f"x {args.page_size}; host tier {size['host_gb']:.2f} GiB", flush=True)
  disk_dir = tempfile.mkdtemp(prefix="kv_disk_")
  results: dict[str, list[dict]] = {c: [] for c in configs}
  try:
    for r in range(args.repeats):
      for tiers in (configs if r % 2 == 0 else configs[::-1]):
        shutil.rmtree(disk_dir, ignore_errors=True)
        os.makedirs(disk_dir)
        engine = build_engine(loaded, engine_config(args, args.model, size, tiers, disk_dir))
        engine.start()
        try:
          row = measure(engine, args, loaded.config.vocab_size)
        finally:
          engine.shutdown()
        results[tiers].append(row)
        print(f"[{r}] {tiers}: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else
                                             f"{k}={v}" for k, v in row.items()
                                             if k != "outputs"), flush=True)
  finally:
    shutil.rmtree(disk_dir, ignore_errors=True)
  report(args, size, results)


def report(args, size: dict, results: dict[str, list[dict]]) -> None:
  first = next(iter(results.values()))[0]["outputs"]
  same = all(row["outputs"] == first for rows in results.values() for row in rows)
  keys = ("ttft_p50", "ttft_p95", "ttft_p50_later", "total_s", "prefill_tokens",
          "device_hit_rate", "host_hit_rate", "disk_hit_rate", "host_token_share",
          "disk_token_share", "ttft_p95_later", "turns_per_s", "pages_offloaded",
          "pages_reloaded", "offload_ms_per_chunk", "reload_ms_per_step", "load_avg")
  summary = {c: {k: statistics.median(row[k] for row in rows) for k in keys if k in rows[0]}
             for c, rows in results.items()}
  print(f"\noutputs identical across configs: {same}")
  print(f"{'config':8}" + "".join(f"{k:>17}" for k in keys[:9]))
  for c, s in summary.items():
    print(f"{c:8}" + "".join(f"{s[k]:17.3f}" if k in s else f"{'-':>17}" for k in keys[:9]))
  if "off" in summary and "host" in summary:
    off, host = summary["off"], summary["host"]
    print(f"TTFT p50 off / host: {off['ttft_p50'] / host['ttft_p50']:.2f}x (returning turns "
          f"{off['ttft_p50_later'] / host['ttft_p50_later']:.2f}x); p95 "
          f"{off['ttft_p95'] / host['ttft_p95']:.2f}x")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(args=vars(args), size=size, identical=same, summary=summary), f, indent=1)
  run_record.record_args("multi_turn_bench", args,
                         dict(size=size, outputs_identical=same, summary=summary), skip=("json",))


if __name__ == "__main__":
  main()
