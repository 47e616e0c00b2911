"""`xlaserve bench`: offline throughput, serving load sweeps and the roofline.

    xlaserve bench offline  --num_prompts=32 --input_len=128 --output_len=128 [--naive]
    xlaserve bench serve    --base_url=http://127.0.0.1:8000 --concurrency=1,2,4,8,16,32,64
    xlaserve bench roofline --input_len=128 --output_len=128

The standard workload: `input_len`-token distinct prompts (random words that
re-encode to exactly `input_len` tokens), `output_len` output tokens,
`ignore_eos`, greedy. Engine options are the launcher's flags (`--dtype`,
`--max_num_seqs`, `--quantization`, ...). Results print as one JSON object
and go to `--result_json` when given; `--record` also writes them as a run
record (benchmarks/results/<date>-bench_<subcommand>.json, with the date, the
machine, the commit and the command; serving/tools/run_record.py); `serve`
also draws `--plot`.

`offline` runs the prompts through `LLM.generate` (continuous batching);
`--naive` runs them one request at a time. `--breakdown` times each step's
parts (host scheduling, device prefill / decode / sampling, detokenization);
`--profile_dir` records a `jax.profiler` trace and lists its costliest ops.
`serve` drives any OpenAI-compatible endpoint (serving/tools/bench_serve.py).
`roofline` measures the machine (memory copy bandwidth, matmul peaks) and the
model's bytes and FLOPs per token, then the fraction a run achieved (MBU for
batch-1 decode, MFU for prefill and the batched workload).
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Sequence
from typing import Any

from absl import flags

from serving.tools import bench_serve, run_record

FLAGS = flags.FLAGS
SUBCOMMANDS = ("offline", "serve", "roofline")

flags.DEFINE_integer("num_prompts", 32, "bench: prompts in the workload.")
flags.DEFINE_integer("input_len", 128, "bench: tokens per prompt.")
flags.DEFINE_integer("output_len", 128, "bench: output tokens per request (ignore_eos).")
flags.DEFINE_integer("prompt_seed", 0, "bench: seed of the random prompts.")
flags.DEFINE_bool("naive", False, "bench offline: one request at a time.")
flags.DEFINE_bool("breakdown", False, "bench offline: time host / device / detokenize parts.")
flags.DEFINE_string("profile_dir", None, "bench offline: write a jax.profiler trace here.")
flags.DEFINE_string("result_json", None, "bench: write the results here as JSON.")
flags.DEFINE_bool("record", False, "bench: also write a run record (JSON: date, machine, "
                  "commit, command, figures) into --record_dir.")
flags.DEFINE_string("record_dir", None, "bench: where --record writes (default: the "
                    "checkout's benchmarks/results).")
flags.DEFINE_string("base_url", "http://127.0.0.1:8000", "bench serve: endpoint base URL.")
flags.DEFINE_string("served_model", None, "bench serve: model id (default: first of /v1/models).")
flags.DEFINE_string("tokenizer", None, "bench serve: model whose tokenizer sizes the prompts "
                    "(default: --model; words stand in for tokens if it cannot be loaded).")
flags.DEFINE_list("concurrency", ["1", "2", "4", "8", "16", "32", "64"],
                  "bench serve: concurrency levels.")
flags.DEFINE_float("request_rate", None, "bench serve: Poisson request rate instead of "
                   "closed-loop concurrency (requests/s).")
flags.DEFINE_integer("rounds", 1, "bench serve: requests per worker at each level.")
flags.DEFINE_integer("min_prompts", 4, "bench serve: fewest requests at a level.")
flags.DEFINE_string("extra_body", None, "bench serve: JSON merged into each request body "
                    '(default: {"ignore_eos": true, "stream_options": {"include_usage": true}}).')
flags.DEFINE_string("plot", None, "bench serve: PNG of throughput and p95 TTFT.")
flags.DEFINE_string("label", None, "bench serve: name of the endpoint in the plot.")

DEFAULT_EXTRA_BODY = {"ignore_eos": True, "stream_options": {"include_usage": True}}
_WORD = re.compile(r"^ [a-z]{3,12}$")


# ---- the workload ----

def make_prompts(tokenizer: Any, n: int, input_len: int, seed: int = 0) -> list[tuple[str, list]]:
  """`n` distinct random-word texts with exactly `input_len` tokens each -> (text, ids).

  Without a tokenizer (None), each word stands for one token (ids empty).
  """
  rng = random.Random(seed)
  words = _vocab_words(tokenizer) if tokenizer is not None else _FALLBACK_WORDS
  out = []
  for _ in range(n):
    picked = [rng.choice(words) for _ in range(input_len)]
    if tokenizer is None:
      out.append(("".join(picked).strip(), []))
      continue
    text, ids = _fit(tokenizer, picked, input_len, words, rng)
    out.append((text, ids))
  return out


def _fit(tokenizer, picked: list[str], n: int, words: list[str], rng) -> tuple[str, list]:
  """Drops words until the text encodes to at most `n` tokens, then cuts the ids to `n`."""
  encode = lambda ws: tokenizer.encode("".join(ws).strip(), add_special_tokens=False)
  ids = encode(picked)
  while len(ids) > n and len(picked) > 1:
    picked.pop()
    ids = encode(picked)
  while len(ids) < n:
    picked.append(rng.choice(words))
    ids = encode(picked)
  if len(ids) == n:
    return "".join(picked).strip(), ids
  return tokenizer.decode(ids[:n]), ids[:n]


def _vocab_words(tokenizer) -> list[str]:
  """Single-token lowercase words (" word") of the vocabulary."""
  words = []
  for i in range(min(tokenizer.vocab_size, 50_000)):
    w = tokenizer.decode([i])
    if _WORD.match(w):
      words.append(w)
  return words or _FALLBACK_WORDS


_FALLBACK_WORDS = [f" {w}" for w in (
    "time person year way day thing man world life hand part child eye woman place work week "
    "case point number group problem fact river stone light water cloud music paper garden "
    "window table river city story answer market").split()]


def load_tokenizer(model: str):
  """The tokenizer of a preset, GGUF file or HF dir; None when it cannot be loaded."""
  import os

  import checkpoints
  from checkpoints import gguf as gguf_io
  from checkpoints.tokenizer import Tokenizer

  try:
    path = checkpoints.resolve_model_path(model)
    if path.endswith(".gguf") and os.path.isfile(path):
      return Tokenizer.from_gguf_metadata(gguf_io.read_gguf(path))
    if os.path.isdir(path):
      return Tokenizer.from_hf_dir(path)
  except (OSError, ValueError, KeyError):
    return None
  return None


def standard_params(output_len: int):
  from serving.types import SamplingParams

  return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)


# ---- offline ----

def run_offline(llm, prompts: Sequence[list[int]], output_len: int, naive: bool = False,
                warm_up: bool = True) -> dict[str, Any]:
  """Times `llm.generate` over the prompts (all at once, or one at a time if `naive`)."""
  params = standard_params(output_len)
  if warm_up:  # first-call effects stay out of the figure
    llm.generate([list(prompts[0])], standard_params(min(4, output_len)))
  start = time.perf_counter()
  if naive:
    outs = [llm.generate([list(p)], params)[0] for p in prompts]
  else:
    outs = llm.generate([list(p) for p in prompts], params)
  elapsed = time.perf_counter() - start
  out_tokens = sum(len(o.token_ids) for o in outs)
  in_tokens = sum(len(p) for p in prompts)
  return {"mode": "naive" if naive else "batched", "num_prompts": len(prompts),
          "elapsed_s": elapsed, "output_tokens": out_tokens, "prompt_tokens": in_tokens,
          "output_tok_s": out_tokens / elapsed, "total_tok_s": (out_tokens + in_tokens) / elapsed}


def time_single(llm, prompt: list[int], output_len: int) -> dict[str, float]:
  """TTFT and decode tok/s of one request alone (streamed through the engine)."""
  start = time.perf_counter()
  ttft, n = None, 0
  for out in llm.stream(list(prompt), standard_params(output_len)):
    n += len(out.token_ids)
    if ttft is None and out.token_ids:
      ttft = time.perf_counter() - start
  total = time.perf_counter() - start
  return {"ttft_s": ttft or total, "decode_tok_s": (n - 1) / max(total - (ttft or 0), 1e-9),
          "tpot_s": (total - (ttft or 0)) / max(n - 1, 1), "output_tokens": n}


class StepTimer:
  """A `Runner` around the model's that times each part of a step, for a breakdown.

  Parts: building the step's arrays (`inputs`), each prefill chunk and the
  decode batch on the device (synchronised, sampling included), reading the
  samples back (`fetch`); `other_host` is the rest of the wall time: the
  scheduler, detokenization and the engine loop. Synchronising every device
  call removes the engine's host/device overlap while timing.
  """

  PARTS = ("inputs", "prefill", "decode", "sample", "fetch")

  def __init__(self, runner):
    self.runner, self.totals, self.steps = runner, dict.fromkeys(self.PARTS, 0.0), 0
    self.num_pages, self.vocab_size = runner.num_pages, runner.vocab_size
    self.window_group = runner.window_group
    self.state_slots = runner.state_slots

  def warm_up(self) -> int:
    return self.runner.warm_up()

  def reset(self) -> None:
    """Zeroes the totals (after first-call effects)."""
    self.totals, self.steps = dict.fromkeys(self.PARTS, 0.0), 0

  def execute(self, *, plan):
    import jax

    from serving.runner.inputs import StepInputs, build_step_inputs

    t0 = time.perf_counter()
    inputs = build_step_inputs(plan, self.runner.engine_cfg,
                               window=self.runner.window_group is not None)
    self.totals["inputs"] += time.perf_counter() - t0
    parts = [("prefill", StepInputs([p], [rid], None, [], constrained=inputs.constrained))
             for p, rid in zip(inputs.prefills, inputs.prefill_ids, strict=True)]
    if inputs.decode is not None or inputs.verify is not None:  # plain or speculative
      parts.append(("decode", StepInputs([], [], inputs.decode, inputs.decode_ids,
                                         constrained=inputs.constrained, verify=inputs.verify,
                                         drafts=inputs.drafts)))
    handles = []
    for name, part in parts:
      t0 = time.perf_counter()
      handles.append(jax.block_until_ready(self.runner.run(part)))
      self.totals[name] += time.perf_counter() - t0
    self.steps += 1
    return _merge_handles(handles)

  def sample(self, *, handle, masks):
    t0 = time.perf_counter()
    try:
      self.runner.sample(handle=handle, masks=masks)
    finally:
      self.totals["sample"] += time.perf_counter() - t0

  def fetch(self, *, handle):
    t0 = time.perf_counter()
    try:
      return self.runner.fetch(handle=handle)
    finally:
      self.totals["fetch"] += time.perf_counter() - t0

  def close(self) -> None:
    self.runner.close()

  def report(self, elapsed: float) -> dict[str, Any]:
    parts = dict(self.totals)
    parts["other_host"] = elapsed - sum(parts.values())
    return {"steps": self.steps, "elapsed_s": elapsed,
            "ms_per_step": {k: 1e3 * v / max(self.steps, 1) for k, v in parts.items()},
            "share": {k: v / elapsed for k, v in parts.items()}}


def _merge_handles(handles):
  """One StepHandle from the handles of a step's separately run calls."""
  from serving.runner.model_runner import StepHandle

  merged = StepHandle(calls=[], logprobs={})
  for h in handles:
    merged.calls += h.calls
    merged.logprobs.update(h.logprobs)
    merged.num_drafts.update(h.num_drafts)
    if h.done is not None:
      merged.done = h.done
  return merged


def summarize_trace(profile_dir: str, top: int = 15) -> list[dict[str, Any]]:
  """The costliest event names of the newest perfetto trace under `profile_dir`."""
  import glob
  import gzip
  import os

  paths = glob.glob(os.path.join(profile_dir, "**", "*.trace.json.gz"), recursive=True)
  paths += glob.glob(os.path.join(profile_dir, "**", "perfetto_trace.json.gz"), recursive=True)
  if not paths:
    return []
  with gzip.open(max(paths, key=os.path.getmtime), "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  totals: dict[str, list] = {}
  for e in events:
    if e.get("ph") == "X" and "dur" in e:
      t = totals.setdefault(e.get("name", "?"), [0.0, 0])
      t[0] += float(e["dur"]) / 1e3
      t[1] += 1
  rows = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
  return [{"name": k[:80], "total_ms": v[0], "count": v[1]} for k, v in rows]


def offline_main() -> dict[str, Any]:
  llm, runners, start_s = _build_llm(timed=FLAGS.breakdown)
  prompts = [ids for _, ids in make_prompts(llm.get_tokenizer(), FLAGS.num_prompts,
                                            FLAGS.input_len, FLAGS.prompt_seed)]
  result = {"engine_start_s": start_s, "engine": engine_summary(llm, runners)}
  if FLAGS.breakdown:
    llm.generate([prompts[0]], standard_params(4))  # first-call effects, before the timers
    timer = runners.timer
    timer.reset()
    result["offline"] = run_offline(llm, prompts, FLAGS.output_len, FLAGS.naive, warm_up=False)
    result["breakdown"] = timer.report(result["offline"]["elapsed_s"])
  elif FLAGS.profile_dir:
    import jax

    with jax.profiler.trace(FLAGS.profile_dir, create_perfetto_trace=True):
      result["offline"] = run_offline(llm, prompts, FLAGS.output_len, FLAGS.naive)
    result["profile_top_ops"] = summarize_trace(FLAGS.profile_dir)
  else:
    result["offline"] = run_offline(llm, prompts, FLAGS.output_len, FLAGS.naive)
  if llm.engine.config.speculative.enabled:
    result["spec_decode"] = spec_decode_summary(llm.engine.stats().spec_decode)
  return result


def spec_decode_summary(counters) -> dict[str, Any]:
  """Speculative decoding's figures: drafts, kept drafts, acceptance rate (per position)."""
  drafts = counters.num_draft_tokens
  return {"num_drafts": counters.num_drafts, "num_draft_tokens": drafts,
          "num_accepted_tokens": counters.num_accepted_tokens,
          "acceptance_rate": counters.num_accepted_tokens / drafts if drafts else None,
          "accepted_per_draft": (counters.num_accepted_tokens / counters.num_drafts
                                 if counters.num_drafts else None),
          "acceptance_per_position": [n / counters.num_drafts if counters.num_drafts else None
                                      for n in counters.accepted_per_pos]}


class BuiltRunners:
  """`build_engine(wrap_runner=...)` that keeps the runners it is handed: the bench reads
  the model's facts and its step timers from the runners it built, not through the
  engine (an `EngineClient`, which exposes no runner). `timed`: each in a StepTimer."""

  def __init__(self, timed: bool = False):
    self.timed = timed
    self.model_runners: list[Any] = []  # ModelRunners, in the order the engines were built
    self.timers: list[StepTimer] = []

  def __call__(self, runner):
    self.model_runners.append(runner)
    if not self.timed:
      return runner
    self.timers.append(StepTimer(runner))
    return self.timers[-1]

  @property
  def model_runner(self):
    """The first engine's ModelRunner (with dp or workers: every one holds the model)."""
    return self.model_runners[0]

  @property
  def timer(self) -> StepTimer:
    """The first engine's step timer (timed builds only)."""
    return self.timers[0]


def _build_llm(timed: bool = False):
  """The engine of the flags behind `LLM`, the runners it was built with (in StepTimers
  when `timed`), and the seconds it took."""
  from serving.entrypoints.engine_builder import build_engine
  from serving.entrypoints.flags import engine_config_from_flags
  from serving.entrypoints.llm import LLM

  start = time.perf_counter()
  runners = BuiltRunners(timed)
  engine = build_engine(FLAGS.model, engine_config_from_flags(), wrap_runner=runners)
  return LLM(engine=engine), runners, time.perf_counter() - start


def engine_summary(llm, runners: BuiltRunners) -> dict[str, Any]:
  """The engine's settings and its model runner's dtypes (a result's `engine` entry)."""
  r = runners.model_runner
  c = llm.engine.config
  return {"model": llm.engine.model_name, "dtype": r.dtype_name,
          "weight_dtype": r.weight_dtype_name, "kv_dtype": r.kv_dtype_name,
          "quantization": c.model.quantization, "max_num_seqs": c.scheduler.max_num_seqs,
          "max_num_batched_tokens": c.scheduler.max_num_batched_tokens,
          "attention_block_tokens": c.cache.attention_block_tokens,
          "unroll_layers": c.model.unroll_layers, "programs": llm.engine.num_programs,
          "speculative_method": c.speculative.speculative_method,
          "num_speculative_tokens": (c.speculative.num_speculative_tokens
                                     if c.speculative.enabled else None)}


# ---- serve ----

def serve_main() -> dict[str, Any]:
  base = FLAGS.base_url.rstrip("/")
  bench_serve.wait_ready(base, timeout_s=900)
  model = FLAGS.served_model or bench_serve.first_model_id(base)
  extra = json.loads(FLAGS.extra_body) if FLAGS.extra_body else DEFAULT_EXTRA_BODY
  target = bench_serve.Target(base, model, extra)
  levels = [int(c) for c in FLAGS.concurrency]
  n = max(FLAGS.num_prompts, sum(max(FLAGS.rounds * c, FLAGS.min_prompts) for c in levels))
  tok = load_tokenizer(FLAGS.tokenizer or FLAGS.model)
  prompts = [t for t, _ in make_prompts(tok, n, FLAGS.input_len, FLAGS.prompt_seed)]
  sweep = bench_serve.run_sweep(target, prompts, FLAGS.output_len, levels, rounds=FLAGS.rounds,
                                min_prompts=FLAGS.min_prompts, request_rate=FLAGS.request_rate)
  result = {"target": {"base_url": base, "model": model, "extra_body": extra}, **sweep}
  if FLAGS.plot:
    result["plot"] = bench_serve.plot({FLAGS.label or model: sweep["levels"]}, FLAGS.plot)
  return result


# ---- roofline ----

def measure_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
  """Memory copy bandwidth in GB/s (bytes read + written), best of `repeats`."""
  import numpy as np

  a = np.ones(nbytes // 4, np.float32)
  b = np.empty_like(a)
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    np.copyto(b, a)
    best = min(best, time.perf_counter() - t0)
  return 2 * a.nbytes / best / 1e9


def measure_matmul(dtype: str, n: int = 2048, repeats: int = 3) -> float:
  """jax matmul GFLOP/s of an n x n x n product; bf16 inputs accumulate in f32."""
  import jax
  import jax.numpy as jnp

  x = jnp.ones((n, n), dtype) * 0.5
  f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  f(x, x).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    f(x, x).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2 * n**3 / best / 1e9


def model_costs(model_cfg, weight_bytes: int, kv_bytes_per_token: int) -> dict[str, float]:
  """Matmul FLOPs per token (weights; attention per key) and bytes read per decode step."""
  c = model_cfg
  d, h = c.hidden_size, c.head_dim
  per_layer = d * c.num_heads * h * 2 + d * c.num_kv_heads * h * 2 + 3 * d * c.intermediate_size
  linear = c.num_layers * per_layer
  return {"linear_params": linear, "lm_head_params": d * c.vocab_size,
          "flops_per_token": 2.0 * (linear + d * c.vocab_size),
          "prefill_flops_per_token": 2.0 * linear,
          "attn_flops_per_key": 4.0 * c.num_layers * c.num_heads * h,
          "weight_bytes": float(weight_bytes), "kv_bytes_per_token": float(kv_bytes_per_token)}


def roofline(llm, model_runner, prompt: list[int], batch_prompts: Sequence[list[int]],
             output_len: int) -> dict[str, Any]:
  """Machine peaks, model costs (`model_runner`: the engine's ModelRunner) and the
  achieved MBU / MFU of three runs."""
  from serving.models.quantized import params_nbytes
  from serving.runner.kv_cache import kv_bytes_per_token

  r = model_runner
  costs = model_costs(r.model_cfg, params_nbytes(r.params),
                      kv_bytes_per_token(r.model_cfg, r.kv_dtype_name))
  machine = {"copy_gb_s": measure_bandwidth(), "matmul_f32_gflop_s": measure_matmul("float32"),
             "matmul_bf16_f32acc_gflop_s": measure_matmul("bfloat16")}
  peak = machine["matmul_bf16_f32acc_gflop_s" if r.weight_dtype_name == "bfloat16"
                 else "matmul_f32_gflop_s"]
  time_single(llm, prompt, 4)  # first-call effects
  single = time_single(llm, prompt, output_len)
  n_in, ctx = len(prompt), len(prompt) + output_len / 2
  step_bytes = costs["weight_bytes"] + ctx * costs["kv_bytes_per_token"]
  decode_flops = costs["flops_per_token"] + ctx * costs["attn_flops_per_key"]
  prefill_flops = n_in * costs["prefill_flops_per_token"] + 2 * costs["lm_head_params"] + (
      n_in * n_in / 2 * costs["attn_flops_per_key"])
  batched = run_offline(llm, batch_prompts, output_len)
  total_flops = batched["prompt_tokens"] * costs["prefill_flops_per_token"] + batched[
      "output_tokens"] * decode_flops
  achieved = {
      "decode_b1_tok_s": single["decode_tok_s"],
      "decode_b1_gb_s": step_bytes * single["decode_tok_s"] / 1e9,
      "decode_b1_mbu": step_bytes * single["decode_tok_s"] / 1e9 / machine["copy_gb_s"],
      "decode_b1_ceiling_tok_s": machine["copy_gb_s"] * 1e9 / step_bytes,
      "prefill_ttft_s": single["ttft_s"],
      "prefill_gflop_s": prefill_flops / single["ttft_s"] / 1e9,
      "prefill_mfu": prefill_flops / single["ttft_s"] / 1e9 / peak,
      f"batch{len(batch_prompts)}_output_tok_s": batched["output_tok_s"],
      f"batch{len(batch_prompts)}_gflop_s": total_flops / batched["elapsed_s"] / 1e9,
      f"batch{len(batch_prompts)}_mfu": total_flops / batched["elapsed_s"] / 1e9 / peak,
      f"batch{len(batch_prompts)}_ceiling_output_tok_s": peak * 1e9 * batched["output_tokens"]
      / total_flops}
  return {"machine": machine, "model": costs, "peak_used_gflop_s": peak, "achieved": achieved}


def roofline_main() -> dict[str, Any]:
  llm, runners, start_s = _build_llm()
  prompts = [ids for _, ids in make_prompts(llm.get_tokenizer(), FLAGS.num_prompts + 1,
                                            FLAGS.input_len, FLAGS.prompt_seed)]
  result = roofline(llm, runners.model_runner, prompts[0], prompts[1:], FLAGS.output_len)
  return {"engine_start_s": start_s, "engine": engine_summary(llm, runners), **result}


# ---- entry point ----

def main(argv: Sequence[str]) -> int:
  """`argv`: ["bench", SUBCOMMAND] (the launcher passes its positional arguments)."""
  args = [a for a in argv if a != "bench"]
  if len(args) != 1 or args[0] not in SUBCOMMANDS:
    from absl import app

    raise app.UsageError(f"usage: xlaserve bench {{{'|'.join(SUBCOMMANDS)}}} [--flags]")
  result = {"offline": offline_main, "serve": serve_main, "roofline": roofline_main}[args[0]]()
  result = {"command": args[0], "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            **result}
  text = json.dumps(result, indent=1, default=str)
  print(text, flush=True)
  if FLAGS.result_json:
    with open(FLAGS.result_json, "w", encoding="utf-8") as f:
      f.write(text + "\n")
  if FLAGS.record:
    setup = {"subcommand": args[0], "model": FLAGS.model, "num_prompts": FLAGS.num_prompts,
             "input_len": FLAGS.input_len, "output_len": FLAGS.output_len}
    run_record.write_record(f"bench_{args[0]}", run_record.command_line(), setup,
                            json.loads(text), results_dir=FLAGS.record_dir)
  return 0
