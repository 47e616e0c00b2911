"""Speculative decoding benchmark: a plain server against a speculating one, through HTTP.

    PYTHONPATH=. python benchmarks/spec_bench.py [--method ngram] [--num_speculative_tokens 8]
        [--repeats 3] [--quick] [--json out.json]

Two `xlaserve serve` (default preset, prefix caching off, `--max_model_len`
2048), both up (an idle server takes no CPU): a plain one
(`--speculative_method=none`, on `--port`) and one with `--method` and its
flags (docs/spec_decode.md; on the next port). Each round runs every case on
both, alternating which server goes first and the order of the cases. Every request is
greedy, streamed over a fresh connection, with `stream_options.include_usage`
(a speculative step may stream several tokens in one event: the usage is the
token count). The cases:
  * `copy` (one request at a time): 6 chat-templated prompts (the model is
    instruct-tuned; the template is applied here, and the text sent to
    `/v1/completions`) asking to repeat or lightly edit a passage of this
    repository (functions of serving/engine/*.py, paragraphs of docs/*.md)
    that the answer copies; 192 output tokens at most, the model stops at
    EOS (tok/s counts the tokens produced);
  * `free` (one at a time): 6 open-ended chat prompts, 128 tokens, `ignore_eos`;
  * `32 concurrent`: the standard workload (random-word prompts of 128
    tokens, 128 output tokens, `ignore_eos`), 64 requests 32 at a time.
The server's `xlaserve_spec_decode_*_total` counters (`/metrics`), read before
and after each case, give its acceptance rate (accepted / draft tokens).
Medians of output tok/s and TPOT p50 per case and server, the ratio
speculative / plain and the acceptance rate are printed and written to
`--json`. `--quick` (a smoke run): 1 round, 2 prompts per case, 8 concurrent,
32 output tokens.

A sweep (`--config NAME=FLAGS`, repeated; e.g. `--config "plain=--num_decode_steps=1"
--config "k4=--speculative_method=ngram --num_speculative_tokens=4"`) runs one server
per config instead of the two, all up and alternated the same way; each case then
reports every config's tok/s against the fastest config without speculation
(`best plain`). `--server_flags` go to every server; `--cases` picks cases (copy, free,
concurrent). `--config NAME@TREE=FLAGS` serves that config from another checkout
(e.g. a worktree of the commit before a change), for a before/after in one run.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import os
import statistics
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC_METRICS = ("xlaserve_spec_decode_num_drafts_total",
                "xlaserve_spec_decode_num_draft_tokens_total",
                "xlaserve_spec_decode_num_accepted_tokens_total")
SNIPPET_TOKENS = 900  # a passage to copy is cut to this many tokens (the prompt fits 2048)
# (kind, file, which passage of it, instruction): the copy workload.
COPY_TASKS = (
    ("code", "serving/engine/page_allocator.py", 0,
     "Repeat the following Python code exactly, with no commentary:"),
    ("doc", "docs/engine.md", 0,
     "Rewrite this text with every 'engine' replaced by 'server', changing nothing else:"),
    ("untyped", "serving/engine/scheduler.py", 0,
     "Copy this function, adding type hints to its parameters and return value:"),
    ("doc", "docs/structure.md", 1, "Repeat the following text exactly:"),
    ("code", "serving/engine/output_processor.py", 0,
     "Copy this code, adding a short comment above every `if` statement:"),
    ("doc", "docs/performance.md", 1,
     "Copy this text as a Markdown bulleted list, one sentence per bullet, keeping the "
     "wording:"),
)
FREE_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works, with an example.",
    "Describe the water cycle to a ten-year-old.",
    "Write a letter to a friend recommending a book you enjoyed, and say why.",
    "Explain the difference between a virus and a bacterium.",
    "Give some advice to someone who is starting to learn the guitar.",
)


# ---- prompts ------------------------------------------------------------------


def _functions(path: str) -> tuple[list[str], list[ast.AST]]:
  with open(os.path.join(ROOT, path)) as f:
    source = f.read()
  nodes = [n for n in ast.walk(ast.parse(source))
           if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
  return source.splitlines(), sorted(nodes, key=lambda n: n.lineno)


def code_passage(path: str, which: int, untyped: bool = False) -> str:
  """The `which`-th function of 25-60 lines in `path` (its first 50 lines if none);
  `untyped`: with its annotations removed (re-printed by `ast.unparse`)."""
  lines, nodes = _functions(path)
  fits = [n for n in nodes if 25 <= n.end_lineno - n.lineno + 1 <= 60]
  if not fits:
    return "\n".join(lines[:50])
  node = fits[which % len(fits)]
  if untyped:
    for arg in ast.walk(node):
      if isinstance(arg, ast.arg):
        arg.annotation = None
    node.returns = None
    return ast.unparse(node)
  start = node.lineno - 1 - len(node.decorator_list)
  return textwrap.dedent("\n".join(lines[start:node.end_lineno]))


def doc_passage(path: str, which: int, min_lines: int = 24) -> str:
  """Consecutive prose paragraphs of a Markdown file (no headings, code or tables)
  from the `which`-th run of `min_lines` lines."""
  with open(os.path.join(ROOT, path)) as f:
    text = f.read()
  paragraphs, fenced = [], False
  for para in text.split("\n\n"):
    if "```" in para:
      fenced ^= para.count("```") % 2 == 1
      continue
    stripped = para.strip()
    if fenced or not stripped or stripped.startswith(("#", "|", "```", "    ")):
      continue
    paragraphs.append(stripped)
  runs, cur = [], []
  for para in paragraphs:
    cur.append(para)
    if sum(p.count("\n") + 1 for p in cur) >= min_lines:
      runs.append("\n\n".join(cur))
      cur = []
  if cur:
    runs.append("\n\n".join(cur))
  return runs[which % len(runs)] if runs else text[:2000]


def _cut(tok, text: str, max_tokens: int) -> str:
  """`text` without its last lines until it encodes to at most `max_tokens` tokens."""
  lines = text.splitlines()
  while len(lines) > 1 and len(tok.encode("\n".join(lines))) > max_tokens:
    lines.pop()
  return "\n".join(lines)


def chat(tok, message: str) -> str:
  return tok.apply_chat_template([{"role": "user", "content": message}],
                                 add_generation_prompt=True)


def copy_prompts(tok) -> list[str]:
  out = []
  for kind, path, which, instruction in COPY_TASKS:
    if kind == "doc":
      passage, fence = doc_passage(path, which), ""
    else:
      passage, fence = code_passage(path, which, untyped=kind == "untyped"), "```python\n"
    passage = _cut(tok, passage, SNIPPET_TOKENS)
    body = f"{fence}{passage}\n```" if fence else passage
    out.append(chat(tok, f"{instruction}\n\n{body}"))
  return out


# ---- servers ------------------------------------------------------------------


def spec_counters(url: str) -> dict[str, float] | None:
  """The spec_decode counters of `/metrics`, summed over labels (None: not served)."""
  import urllib.request

  try:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
      text = r.read().decode("utf-8", "replace")
  except OSError:
    return None
  totals: dict[str, float] = {}
  for line in text.splitlines():
    if not line or line.startswith("#"):
      continue
    if "}" in line:
      name, rest = line[:line.index("{")], line[line.rindex("}") + 1:].split()
    else:
      name, *rest = line.split()
    if name in SPEC_METRICS and rest:
      totals[name] = totals.get(name, 0.0) + float(rest[0])
  return totals or None


def _tail(path: str, n: int = 40) -> str:
  with open(path, errors="replace") as f:
    return "".join(f.readlines()[-n:])


def start_server(flags: list[str], port: int, log_path: str, timeout_s: float = 900.0,
                 tree: str | None = None):
  """`bench_serve.launch_server`, waited for; raises with the log's tail if it exits."""
  from serving.tools import bench_serve

  proc = bench_serve.launch_server(flags, port, log_path, tree=tree)
  deadline = time.monotonic() + timeout_s
  while True:
    if proc.poll() is not None:
      raise RuntimeError(f"server exited with status {proc.returncode}; log tail:\n"
                         f"{_tail(log_path)}")
    try:
      bench_serve.wait_ready(f"http://127.0.0.1:{port}", timeout_s=5.0)
      return proc
    except TimeoutError:
      if time.monotonic() > deadline:
        proc.terminate()
        proc.wait(timeout=60)
        raise


class Server:
  """One `xlaserve serve` of the benchmark, up until `stop()`."""

  def __init__(self, name: str, flags: list[str], port: int, work: str,
               tree: str | None = None):
    from serving.tools import bench_serve

    self.name, self.flags = name, flags
    self.log_path = os.path.join(work, f"{name}.log")
    t0 = time.perf_counter()
    self.proc = start_server(flags, port, self.log_path, tree=tree)
    self.url = f"http://127.0.0.1:{port}"
    print(f"{name} server up in {time.perf_counter() - t0:.0f} s ({' '.join(flags)}); "
          f"log {self.log_path}", flush=True)
    self.model = bench_serve.first_model_id(self.url)

  def run(self, case: str, spec: tuple, rep: int) -> dict:
    """One round of one case -> bench_serve's summary, with the spec counters' change."""
    from serving.tools import bench_serve

    concurrency, prompts_of, output_len, extra = spec
    target = bench_serve.Target(self.url, self.model, {**USAGE, **extra})
    before = spec_counters(self.url)
    res = asyncio.run(bench_serve.run_groups([(target, prompts_of(rep), concurrency)],
                                             output_len))
    after = spec_counters(self.url)
    if before and after:
      res["spec"] = {k.removeprefix("xlaserve_spec_decode_").removesuffix("_total"):
                     after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_METRICS}
    print(f"{self.name:5s} round {rep} {case:13s} {res['output_tok_s']:7.1f} tok/s  TPOT p50 "
          f"{res['tpot_p50'] * 1e3:6.1f} ms  {res['output_tokens']:5d} tokens  "
          f"accept {_fmt_rate(_rate(res.get('spec')))}  errors {res['errors']}", flush=True)
    if self.proc.poll() is not None:
      raise RuntimeError(f"{self.name} server exited with status {self.proc.returncode}; "
                         f"log tail:\n{_tail(self.log_path)}")
    if res["errors"]:
      print(f"  errors: {res.get('error_examples')}", flush=True)
    return res

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.terminate()
      self.proc.wait(timeout=60)


USAGE = {"stream_options": {"include_usage": True}}


def run_rounds(servers: list[Server], cases: dict, repeats: int) -> dict:
  """Rounds over the servers, alternating which goes first and the order of the cases
  (drift of the machine falls on both alike) -> {server: {case: [run, ...]}}."""
  from serving.tools import bench_serve

  for server in servers:  # a warm-up request each
    warm = bench_serve.Target(server.url, server.model, USAGE)
    first = next(iter(cases.values()))
    asyncio.run(bench_serve.run_groups([(warm, first[1](0)[:1], 1)], 8))
  results = {s.name: {c: [] for c in cases} for s in servers}
  for rep in range(repeats):
    order = list(cases) if rep % 2 == 0 else list(reversed(cases))
    for case in order:
      for server in servers if rep % 2 == 0 else list(reversed(servers)):
        results[server.name][case].append(server.run(case, cases[case], rep))
  return results


def _rate(spec: dict | None) -> float | None:
  if not spec or not spec.get("num_draft_tokens"):
    return None
  return spec["num_accepted_tokens"] / spec["num_draft_tokens"]


def _fmt_rate(rate: float | None) -> str:
  return "    -" if rate is None else f"{rate:5.3f}"


def _summary(runs: list[dict]) -> dict:
  out = {"output_tok_s": statistics.median(r["output_tok_s"] for r in runs),
         "tpot_p50": statistics.median(r["tpot_p50"] for r in runs),
         "ttft_p50": statistics.median(r["ttft_p50"] for r in runs),
         "output_tokens": statistics.median(r["output_tokens"] for r in runs),
         "errors": sum(r["errors"] for r in runs)}
  specs = [r["spec"] for r in runs if "spec" in r]
  if specs:
    spec = {k: sum(s[k] for s in specs) for k in specs[0]}
    out["spec"] = spec
    out["acceptance_rate"] = _rate(spec)
    if spec.get("num_drafts"):
      out["accepted_per_draft"] = spec["num_accepted_tokens"] / spec["num_drafts"]
  return out


# ---- benchmark ----------------------------------------------------------------


def bench(args) -> dict:
  from serving.tools import bench

  tok = bench.load_tokenizer("smollm2-135m-instruct")
  if tok is None:
    raise SystemExit("cannot load the tokenizer of smollm2-135m-instruct")
  n_single = 2 if args.quick else args.num_prompts or len(COPY_TASKS)
  concurrency = 8 if args.quick else args.concurrency
  copy = copy_prompts(tok)[:n_single]
  free = [chat(tok, p) for p in FREE_PROMPTS][:n_single]
  copy_len, free_len, out_len = ((32, 32, 32) if args.quick else
                                 (args.copy_tokens, args.free_tokens, args.output_len))
  n_conc = concurrency * (1 if args.quick else 2)
  # case -> (concurrency, round -> prompts, max_tokens, extra body)
  cases = {
      "copy": (1, lambda rep: copy, copy_len, {}),
      "free": (1, lambda rep: free, free_len, {"ignore_eos": True}),
      f"{concurrency} concurrent": (
          concurrency,
          lambda rep: [p for p, _ in bench.make_prompts(tok, n_conc, args.input_len,
                                                        seed=rep * 100)],
          out_len, {"ignore_eos": True}),
  }
  if args.cases:
    wanted = set(args.cases.split(","))
    cases = {name: case for name, case in cases.items() if name.split()[-1] in wanted}
  common = [f"--max_model_len={args.max_model_len}", "--enable_prefix_caching=false",
            *args.server_flags.split()]
  if args.config:
    return sweep(args, cases, common)
  spec_flags = [f"--speculative_method={args.method}",
                f"--num_speculative_tokens={args.num_speculative_tokens}"]
  for flag in ("prompt_lookup_min", "prompt_lookup_max", "speculative_max_batch",
               "speculative_model"):
    if getattr(args, flag) is not None:
      spec_flags.append(f"--{flag}={getattr(args, flag)}")
  work = tempfile.mkdtemp(prefix="spec_bench_")
  # Both up at once (an idle server costs nothing), so that rounds can alternate them.
  servers = [Server("plain", [*common, "--speculative_method=none"], args.port, work)]
  try:
    servers.append(Server("spec", [*common, *spec_flags], args.port + 1, work))
    runs = run_rounds(servers, cases, args.repeats)
  finally:
    for server in servers:
      server.stop()

  summary: dict = {"method": args.method, "spec_flags": spec_flags, "cases": {}}
  print(f"\n{'case':14s} {'plain tok/s':>11s} {'spec tok/s':>10s} {'spec/plain':>10s} "
        f"{'plain TPOT':>10s} {'spec TPOT':>9s} {'accept':>6s}")
  for case in cases:
    plain = _summary(runs["plain"][case])
    row = {"plain": plain}
    spec = _summary(runs["spec"][case]) if "spec" in runs else None
    if spec is not None:
      row.update(spec=spec, ratio=spec["output_tok_s"] / plain["output_tok_s"]
                 if plain["output_tok_s"] else None, acceptance_rate=spec.get("acceptance_rate"))
    summary["cases"][case] = row
    spec_tok = f"{spec['output_tok_s']:10.1f}" if spec else f"{'-':>10s}"
    ratio = f"{'x' + format(row['ratio'], '.3f') if row.get('ratio') else '-':>10s}"
    spec_tpot = f"{spec['tpot_p50'] * 1e3:6.1f} ms" if spec else f"{'-':>9s}"
    print(f"{case:14s} {plain['output_tok_s']:11.1f} {spec_tok} {ratio} "
          f"{plain['tpot_p50'] * 1e3:7.1f} ms {spec_tpot} {_fmt_rate(row.get('acceptance_rate'))}",
          flush=True)
  return summary


def sweep(args, cases: dict, common: list[str]) -> dict:
  """One server per `--config NAME=FLAGS`, all up, rounds alternating them -> per case
  and config: the medians, the ratio to the fastest config that does not speculate."""
  configs = [c.split("=", 1) for c in args.config]
  trees = {}  # NAME@TREE: that config's server runs the checkout at TREE
  for config in configs:
    if "@" in config[0]:
      name, tree = config[0].split("@", 1)
      config[0], trees[name] = name, tree
  work = tempfile.mkdtemp(prefix="spec_bench_")
  servers: list[Server] = []
  try:
    for i, (name, flags) in enumerate(configs):
      servers.append(Server(name, [*common, *flags.split()], args.port + i, work,
                            tree=trees.get(name)))
    runs = run_rounds(servers, cases, args.repeats)
  finally:
    for server in servers:
      server.stop()
  plain = [name for name, flags in configs if "--speculative_method=" not in flags
           or "--speculative_method=none" in flags]
  summary: dict = {"configs": dict(configs), "common_flags": common, "cases": {}}
  for case in cases:
    rows = {name: _summary(runs[name][case]) for name, _ in configs}
    best = max(plain, key=lambda n: rows[n]["output_tok_s"]) if plain else configs[0][0]
    print(f"\n{case} (ratio to the fastest plain config, {best}; medians of "
          f"{args.repeats} rounds)")
    print(f"{'config':16s} {'tok/s':>7s} {'ratio':>7s} {'TPOT p50':>9s} {'accept':>6s}")
    for name, row in rows.items():
      base = rows[best]["output_tok_s"]
      row["ratio_to_best_plain"] = row["output_tok_s"] / base if base else None
      print(f"{name:16s} {row['output_tok_s']:7.1f} {row['ratio_to_best_plain']:7.3f} "
            f"{row['tpot_p50'] * 1e3:6.1f} ms {_fmt_rate(row.get('acceptance_rate'))}",
            flush=True)
    summary["cases"][case] = {"best_plain": best, "configs": rows}
  return summary


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--method", default="ngram", help="--speculative_method of the spec server")
  p.add_argument("--num_speculative_tokens", type=int, default=8)
  p.add_argument("--prompt_lookup_min", type=int, default=None)
  p.add_argument("--prompt_lookup_max", type=int, default=None)
  p.add_argument("--speculative_max_batch", type=int, default=None)
  p.add_argument("--speculative_model", default=None, help="the draft model (--method draft)")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--num_prompts", type=int, default=None,
                 help="prompts of the copy and free cases (default: all 6)")
  p.add_argument("--concurrency", type=int, default=32)
  p.add_argument("--copy_tokens", type=int, default=192, help="max_tokens of a copy request")
  p.add_argument("--free_tokens", type=int, default=128)
  p.add_argument("--input_len", type=int, default=128, help="concurrent case's prompt tokens")
  p.add_argument("--output_len", type=int, default=128, help="concurrent case's output tokens")
  p.add_argument("--max_model_len", type=int, default=2048)
  p.add_argument("--quick", action="store_true",
                 help="smoke run: 1 round, 2 prompts per case, 8 concurrent, 32 tokens")
  p.add_argument("--config", action="append", default=[],
                 help="NAME=FLAGS or NAME@TREE=FLAGS (served from the checkout at TREE): "
                      "a sweep's server (repeat; module doc)")
  p.add_argument("--server_flags", default="", help="flags for every server")
  p.add_argument("--cases", default=None, help="comma-separated: copy, free, concurrent")
  p.add_argument("--port", type=int, default=8330)
  p.add_argument("--json", default=None)
  from serving.tools import bench_serve, run_record
  run_record.add_flags(p)
  args = p.parse_args()
  if args.quick:
    args.repeats = 1
  result = bench(args)
  bench_serve.save_record(args.json, args, result)
  run_record.record_args("spec_bench", args, result, skip=("json", "port"))


if __name__ == "__main__":
  main()
