"""Disaggregated prefill / decode on a real (tiny random Llama) model, in one process.

`build_engine` with prefill_workers=1, decode_workers=1 builds two engines on
the one CPU device; KV pages move between their runners (`export_pages` /
`import_pages`, 2 pages per chunk here so long prompts take several chunks).
- Greedy output equals one engine's, token for token, for prompts from under
  a page to several chunks, with nothing compiled after warm-up; the decode
  engine computes only each prompt's last partial page; no page stays
  referenced on either side.
- The runner's page copy is exact for float32, bfloat16 and int8 KV, and an
  import of another layout is refused.
- The prefill worker's device lost during the second chunk's export (a
  runner that raises `RunnerDeadError`, as a killed worker's would) fails
  that request alone; the decode side holds nothing; the pair serves on.
"""

from __future__ import annotations

import numpy as np
import pytest
from compile_watch import compile_events
from runner_faults import FaultyRunner

from serving.config import EngineConfig
from serving.entrypoints.engine_builder import build_engine
from serving.types import SamplingParams
from tiny_models import save_tiny_model

ENGINE = dict(max_num_seqs=4, max_model_len=96, page_size=8, num_pages=48,
              max_num_batched_tokens=64, prefill_buckets=(64,), decode_buckets=(4,),
              unroll_layers=False, compilation_cache=False, kv_transfer_pages=2)
PROMPTS = [[5, 6, 7], list(range(10, 19)), list(range(20, 61)), list(range(20, 61)) + [3]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tiny_pd"))
  save_tiny_model("llama", path)
  return path


def generate(engine, prompts, max_tokens=8) -> list[list[int]]:
  outs = [[] for _ in prompts]
  for i, p in enumerate(prompts):
    engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                   ignore_eos=True), outs[i].append)
  engine.run_until_idle()
  assert all(o[-1].finished for o in outs)
  return [[t for o in out for t in o.token_ids] if out[-1].finish_reason != "error"
          else out[-1].error for out in outs]


def referenced(engine) -> list[int]:
  a = engine.allocator
  a.check()
  return [p for p in range(1, a.num_pages) if a.refcount(p)]


@pytest.fixture(scope="module")
def single(tiny_dir):
  return generate(build_engine(tiny_dir, EngineConfig.of(**ENGINE)), PROMPTS)


def test_pair_matches_one_engine(tiny_dir, single):
  pd = build_engine(tiny_dir, EngineConfig.of(**ENGINE, prefill_workers=1, decode_workers=1))
  with compile_events() as events:
    assert generate(pd, PROMPTS) == single
  assert events == [], f"compiled after warm-up: {sorted(set(events))}"
  assert pd.transfers_total == 3 and pd.pages_transferred_total == 1 + 5 + 5
  # Only the partial last pages: 3 of "short", 1 + 1 + 2 of the others.
  assert pd.decode[0].stats().prefill_tokens_computed_total == 3 + 1 + 1 + 2
  assert referenced(pd.prefill[0]) == [] and referenced(pd.decode[0]) == []


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_runner_page_copy_is_exact(tiny_dir, kv_dtype):
  import checkpoints
  from serving.runner.model_runner import ModelRunner

  loaded = checkpoints.load_checkpoint(tiny_dir)
  cfg = EngineConfig.of(**{**ENGINE, "kv_cache_dtype": kv_dtype})
  src, dst = (ModelRunner.from_params(loaded.params, loaded.config, cfg, num_pages=16,
                                      kv_transfer=True)
              for _ in range(2))
  rng = np.random.default_rng(0)
  k, v = src.export_pages([1, 2])
  assert k.shape == (loaded.config.num_layers, 2, *src.state.kv.k.shape[1:])
  noise = rng.integers(0, 200, size=k.shape).astype(k.dtype)  # any stored bytes
  dst.import_pages([5, 3], noise, noise + 1)
  back_k, back_v = dst.export_pages([5, 3])
  np.testing.assert_array_equal(back_k, noise)
  np.testing.assert_array_equal(back_v, noise + 1)
  with pytest.raises(ValueError, match="do not fit this cache"):
    dst.import_pages([4], noise[:, :1, :, :1], noise[:, :1, :, :1])
  with pytest.raises(ValueError, match="a KV transfer moves"):
    dst.export_pages([1, 2, 3])  # more than kv_transfer_pages


def test_prefill_worker_lost_mid_transfer(tiny_dir, single):
  made = []

  def wrap(runner):  # the first runner built is the prefill worker's
    faulty = FaultyRunner(runner, dead_export_from=1) if not made else runner
    made.append(faulty)
    return faulty

  pd = build_engine(tiny_dir, EngineConfig.of(**ENGINE, prefill_workers=1, decode_workers=1),
                    wrap_runner=wrap)
  got = generate(pd, [PROMPTS[2]])
  assert "prefill worker" in got[0]  # the error, not tokens
  assert pd.prefill[0].dead is not None and pd.health() is None
  assert referenced(pd.decode[0]) == []
  assert generate(pd, PROMPTS) == single  # the decode engine prefills for itself now
  assert referenced(pd.decode[0]) == []
