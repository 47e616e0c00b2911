"""Smoke of the benchmark harness (serving/tools/bench.py, bench_serve.py).

Not a benchmark: no wall-clock assertions. `serve` runs against the fake
engine behind the real HTTP server; `offline` against a tiny random model.
"""

from __future__ import annotations

import os

import pytest
from frontend_fake import InProcessServer, fake_engine

from serving.tools import bench, bench_serve
from tiny_models import save_tiny_model

pytestmark = pytest.mark.slow  # the benchmark harness end to end


def test_find_knee():
  rows = lambda *tps: [{"concurrency": 2**i, "output_tok_s": t} for i, t in enumerate(tps)]
  assert bench_serve.find_knee(rows(10, 19, 30, 31, 29)) == 4
  assert bench_serve.find_knee(rows(10, 20, 40)) == 4  # still rising: the top level
  assert bench_serve.find_knee([]) is None


def test_serve_sweep_against_fake_endpoint(tmp_path):
  engine = fake_engine(max_num_seqs=4, max_model_len=256, num_pages=64, step_s=0.001)
  prompts = [t for t, _ in bench.make_prompts(None, 8, 16, seed=1)]
  assert len(set(prompts)) == 8
  with InProcessServer(engine) as server:
    model = bench_serve.first_model_id(server.http)
    target = bench_serve.Target(server.http, model, bench.DEFAULT_EXTRA_BODY, timeout_s=30)
    sweep = bench_serve.run_sweep(target, prompts, 8, [1, 2], min_prompts=2, log=lambda _: None)
    bad = bench_serve.Target(server.http, "no-such-model", timeout_s=30)
    failed = bench_serve.run_sweep(bad, prompts, 8, [1], min_prompts=1, log=lambda _: None)
  levels = sweep["levels"]
  assert [r["concurrency"] for r in levels] == [1, 2]
  for row in levels:
    assert row["errors"] == 0 and row["output_tokens"] == 8 * row["requests"]
    assert row["ttft_p50"] > 0 and row["itl_p95"] >= 0 and row["output_tok_s"] > 0
  assert sweep["knee_concurrency"] in (1, 2)
  assert failed["levels"][0]["errors"] == 1 and "HTTP 404" in failed["levels"][0][
      "error_examples"][0]
  png = bench_serve.plot({"fake": levels}, str(tmp_path / "sweep.png"))
  with open(png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory):
  """The bench's LLM with its runner inside a StepTimer (as `--breakdown` builds it), and
  the runners it was built with."""
  from serving.config import EngineConfig
  from serving.entrypoints.engine_builder import build_engine
  from serving.entrypoints.llm import LLM

  path = str(tmp_path_factory.mktemp("bench_tiny"))
  save_tiny_model("llama", path)
  config = EngineConfig.of(max_num_seqs=4, max_model_len=64, page_size=8, num_pages=40,
                        max_num_batched_tokens=32, attention_block_tokens=16,
                        unroll_layers=False, compilation_cache=False)
  runners = bench.BuiltRunners(timed=True)
  return LLM(engine=build_engine(path, config, wrap_runner=runners)), runners


def test_offline_naive_breakdown_and_costs(tiny_bench):
  tiny_llm, runners = tiny_bench
  pairs = bench.make_prompts(tiny_llm.get_tokenizer(), 4, 16, seed=0)
  prompts = [ids for _, ids in pairs]
  assert all(len(p) == 16 for p in prompts) and len({tuple(p) for p in prompts}) == 4
  timer = runners.timer
  assert timer.runner is runners.model_runner
  summary = bench.engine_summary(tiny_llm, runners)
  assert summary["max_num_seqs"] == 4 and summary["programs"] == tiny_llm.engine.num_programs
  batched = bench.run_offline(tiny_llm, prompts, 8, warm_up=False)
  report = timer.report(batched["elapsed_s"])
  naive = bench.run_offline(tiny_llm, prompts[:2], 8, naive=True)
  assert batched["output_tokens"] == 32 and naive["output_tokens"] == 16
  assert batched["total_tok_s"] > batched["output_tok_s"] > 0
  assert report["steps"] > 0 and report["ms_per_step"]["decode"] > 0
  assert report["ms_per_step"]["prefill"] > 0 and report["ms_per_step"]["inputs"] > 0
  single = bench.time_single(tiny_llm, prompts[0], 8)
  assert single["output_tokens"] == 8 and single["ttft_s"] > 0
  costs = bench.model_costs(runners.model_runner.model_cfg, 1000, 10)
  assert costs["flops_per_token"] > costs["prefill_flops_per_token"] > 0
  assert bench.measure_bandwidth(nbytes=4 * 2**20, repeats=1) > 0


def test_breakdown_with_speculation(tmp_path):
  """The step timer runs speculative steps (their verify call is timed as decode) and the
  figures report the drafts; the tokens are those of the same engine untimed."""
  from serving.config import EngineConfig
  from serving.entrypoints.engine_builder import build_engine
  from serving.entrypoints.llm import LLM

  save_tiny_model("llama", str(tmp_path))
  config = EngineConfig.of(max_num_seqs=2, max_model_len=64, page_size=8, num_pages=40,
                        max_num_batched_tokens=16, attention_block_tokens=16,
                        unroll_layers=False, compilation_cache=False, num_speculative_tokens=3,
                        speculative_method="draft", speculative_model=str(tmp_path))
  runners = bench.BuiltRunners(timed=True)
  timed = LLM(engine=build_engine(str(tmp_path), config, wrap_runner=runners))
  plain = LLM(engine=build_engine(str(tmp_path), config))
  prompts = [[5, 6, 7, 8], [9, 10, 11]]
  out = bench.run_offline(timed, prompts, 12, warm_up=False)
  assert out["output_tokens"] == 24
  params = bench.standard_params(12)
  assert ([o.token_ids for o in timed.generate(prompts, params)]
          == [o.token_ids for o in plain.generate(prompts, params)])
  figures = bench.spec_decode_summary(timed.engine.stats().spec_decode)
  assert figures["acceptance_rate"] == 1.0  # the model drafts for itself
  assert runners.timer.report(1.0)["ms_per_step"]["decode"] > 0


def test_summarize_trace_reads_perfetto_json(tmp_path):
  import gzip
  import json

  os.makedirs(tmp_path / "plugins" / "profile" / "run")
  events = [{"ph": "X", "name": "dot", "dur": 2000}, {"ph": "X", "name": "dot", "dur": 1000},
            {"ph": "X", "name": "fusion", "dur": 500}, {"ph": "M", "name": "meta"}]
  with gzip.open(tmp_path / "plugins" / "profile" / "run" / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  top = bench.summarize_trace(str(tmp_path))
  assert top[0] == {"name": "dot", "total_ms": 3.0, "count": 2} and top[1]["name"] == "fusion"
