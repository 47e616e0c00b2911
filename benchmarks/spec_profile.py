"""Where a speculative step's time goes at batch 1: engines in one process, prompts alternated.

    PYTHONPATH=. python benchmarks/spec_profile.py [--case copy|free] [--rounds 2]
        [--num_prompts 3] [--sync] [--config NAME=KEY=VALUE,KEY=VALUE ...]

Each `--config` builds one `LLM` (the default preset, prefix caching off,
`max_model_len` 2048, `--num_pages` pages; KEY=VALUE are engine options, e.g.
`k6=speculative_method=ngram,num_speculative_tokens=6`); without any, plain
single-step, plain multi-step and ngram with the default k. All engines live in
this process; every prompt of `spec_bench.py`'s case (`copy`: repeat / edit a
passage, 192 tokens; `free`: open-ended, 128 tokens, `ignore_eos`) runs on each
in turn, the order alternating per prompt and round, greedy, one request at a time.

Per config it prints output tok/s over wall time and over this process's CPU
time (both threads of the native kernels count; on a shared machine the CPU
figure moves much less with the other jobs than the wall one), and per step kind
(`prefill`, `spec`: a verify step, `decode`: a plain or multi-step one) the
count, the tokens, the host's time in `execute` (building the inputs and
dispatching) and in `fetch` (waiting for the device and reading the tokens), and
the ngram proposer's time. `--sync` waits for every program the runner calls
(`_prefill`, `_decode`, `_multi_decode`, `_sample`, `_verify`, `_verify_sample`)
and records its wall and CPU time: the device cost of each part of a step (the
host's dispatch no longer overlaps the device then, so tok/s drops). Acceptance
and tokens per verify step come from the engine's counters.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PROGRAMS = ("_prefill", "_decode", "_multi_decode", "_sample", "_verify", "_verify_sample")
DEFAULT_CONFIGS = ("plain1=num_decode_steps=1", "plain4=num_decode_steps=4",
                   "ngram=speculative_method=ngram")


def parse_config(text: str) -> tuple[str, dict]:
  """`NAME=KEY=VALUE,KEY=VALUE` -> (NAME, {KEY: VALUE}) with ints parsed."""
  name, _, rest = text.partition("=")
  options = {}
  for item in filter(None, rest.split(",")):
    key, _, value = item.partition("=")
    options[key] = int(value) if value.lstrip("-").isdigit() else value
  return name, options


class StepTimer:
  """Wraps one engine's runner and proposer with timers (module doc); totals per key."""

  def __init__(self, llm, sync: bool):
    import jax

    self.seconds: dict[str, float] = collections.defaultdict(float)
    self.counts: collections.Counter = collections.Counter()
    engine, runner = llm.engine, llm.engine.runner
    kinds: dict[int, str] = {}
    execute, fetch = runner.execute, runner.fetch

    def timed_execute(*, plan):
      start = time.perf_counter()
      handle = execute(plan=plan)
      kind = "prefill" if plan.prefills else ("spec" if plan.speculative else "decode")
      kinds[id(handle)] = kind
      self.add("execute:" + kind, time.perf_counter() - start)
      return handle

    def timed_fetch(*, handle):
      kind = kinds.pop(id(handle))
      start = time.perf_counter()
      result = fetch(handle=handle)
      self.add("fetch:" + kind, time.perf_counter() - start)
      self.counts["tokens:" + kind] += sum(len(t) for t in result.tokens.values())
      return result

    runner.execute, runner.fetch = timed_execute, timed_fetch
    proposer = engine.scheduler.proposer
    if proposer is not None and not proposer.on_device:
      proposer.propose = self.wrap("propose", proposer.propose, None)
    if sync:
      for name in PROGRAMS:
        setattr(runner, name, self.wrap(name, getattr(runner, name), jax.block_until_ready))

  def add(self, key: str, seconds: float) -> None:
    self.seconds[key] += seconds
    self.counts[key] += 1

  def wrap(self, key: str, fn, wait):
    """fn timed under `key` (wall) and `key` + " cpu" (process CPU), waited on by `wait`."""

    def timed(*args, **kwargs):
      start, cpu = time.perf_counter(), time.process_time()
      out = fn(*args, **kwargs)
      if wait is not None:
        wait(out)
      self.add(key, time.perf_counter() - start)
      self.add(key + " cpu", time.process_time() - cpu)
      return out

    return timed


def workload(tok, case: str, num_prompts: int):
  """The prompts and sampling parameters of spec_bench.py's `case`."""
  from benchmarks import spec_bench
  from serving.types import SamplingParams

  if case == "copy":
    return (spec_bench.copy_prompts(tok)[:num_prompts],
            SamplingParams(max_tokens=192, temperature=0.0))
  prompts = [spec_bench.chat(tok, p) for p in spec_bench.FREE_PROMPTS[:num_prompts]]
  return prompts, SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)


def report(name: str, llm, timer: StepTimer, wall: float, cpu: float, tokens: int) -> None:
  """Prints one config's totals (module doc)."""
  print(f"== {name}: {tokens / wall:.1f} tok/s wall, {tokens / cpu:.1f} tok/s CPU "
        f"({tokens} tokens, {wall:.2f} s wall, {cpu:.2f} s CPU)")
  for key in sorted(k for k in timer.counts if k.startswith("tokens:")):
    print(f"    {key:26s} {timer.counts[key]}")
  for key in sorted(timer.seconds):
    n = timer.counts[key]
    print(f"    {key:26s} n={n:5d} total={timer.seconds[key] * 1e3:9.1f} ms "
          f"per={timer.seconds[key] / n * 1e3:7.2f} ms")
  counters = llm.engine.spec_counters
  if counters.num_draft_tokens:
    print(f"    acceptance {counters.num_accepted_tokens / counters.num_draft_tokens:.3f}, "
          f"tokens per verify {1 + counters.num_accepted_tokens / counters.num_drafts:.2f}, "
          f"back-off pauses (acceptance, speed) {llm.engine.spec.num_pauses}, "
          f"{llm.engine.spec.num_slow_pauses}")


def main() -> None:
  """Runs the profile (module doc)."""
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--case", choices=("copy", "free"), default="copy")
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--num_prompts", type=int, default=3)
  ap.add_argument("--num_pages", type=int, default=300)
  ap.add_argument("--sync", action="store_true")
  ap.add_argument("--config", action="append", default=[])
  args = ap.parse_args()

  from serving.entrypoints.llm import LLM

  configs = dict(parse_config(c) for c in (args.config or DEFAULT_CONFIGS))
  llms = {name: LLM(enable_prefix_caching=False, max_model_len=2048,
                    num_pages=args.num_pages, **options) for name, options in configs.items()}
  names = list(llms)
  prompts, params = workload(llms[names[0]].get_tokenizer(), args.case, args.num_prompts)
  timers = {}
  for name, llm in llms.items():
    llm.generate(prompts[0], params)  # warm: the first request's one-off costs
    timers[name] = StepTimer(llm, args.sync)
  wall, cpu, tokens = (collections.Counter() for _ in range(3))
  for r in range(args.rounds):
    for i, prompt in enumerate(prompts):
      order = names if (r + i) % 2 == 0 else names[::-1]
      for name in order:
        start, c = time.perf_counter(), time.process_time()
        out = llms[name].generate(prompt, params)[0]
        wall[name] += time.perf_counter() - start
        cpu[name] += time.process_time() - c
        tokens[name] += len(out.token_ids)
    print(f"after round {r}: tok/s wall / CPU",
          {n: f"{tokens[n] / wall[n]:.1f} / {tokens[n] / cpu[n]:.1f}" for n in names},
          f"load {os.getloadavg()[0]:.1f}", flush=True)
  for name in names:
    report(name, llms[name], timers[name], wall[name], cpu[name], tokens[name])


if __name__ == "__main__":
  main()
