"""The tiered prefix cache on real models: pages really leave the device and come back.

- A tiny random Llama, a multi-turn workload whose conversations do not fit the
  device pool: greedy outputs with the host tier are token-identical to the tier
  off, for float32, bfloat16 and int8 KV (pages moved as stored, codes and
  scales), while the tier serves prefix hits (pages reloaded, fewer prefill
  tokens computed); nothing compiles after warm-up.
- A restarted engine with the disk tier serves a conversation's next turn from
  the files its predecessor left (disk hits), with the same output.
- The same on the default model (SmolLM2-135M, slow).
"""

from __future__ import annotations

import numpy as np
import pytest
from compile_watch import compile_events

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.entrypoints.engine_builder import build_engine
from serving.types import SamplingParams
from tiny_models import VOCAB, save_tiny_model

ENGINE = dict(max_num_seqs=4, max_model_len=256, page_size=8, num_pages=40,
              max_num_batched_tokens=64, prefill_buckets=(64,), decode_buckets=(4,),
              attention_block_tokens=16, unroll_layers=False, compilation_cache=False,
              kv_transfer_pages=4)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tiny_offload"))
  save_tiny_model("llama", path)
  return path


def chat(engine: LLMEngine, vocab: int, n: int = 6, turns: int = 5, system: int = 40,
         user: int = 10, max_tokens: int = 5, replay: list[list[int]] = ()
         ) -> list[list[int]]:
  """`n` interleaved conversations over one shared system prompt; each turn sends the
  whole history plus a new user message. -> every turn's output, in order. `replay`:
  the outputs of the first turns (as an earlier call returned them), taken as answered
  and not sent."""
  rng = np.random.default_rng(1)
  shared = [int(t) for t in rng.integers(3, vocab, system)]
  history = [list(shared) for _ in range(n)]
  outs = []
  for turn in range(turns):
    got: dict[int, list[int]] = {c: [] for c in range(n)}
    for c in range(n):
      history[c] += [int(t) for t in rng.integers(3, vocab, user + c % 3)]
      if turn * n + c < len(replay):
        got[c] = list(replay[turn * n + c])
        continue
      engine.add_request(f"c{c}t{turn}", list(history[c]),
                         SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                         lambda out, c=c, got=got: got[c].extend(out.token_ids))
    engine.run_until_idle()
    for c in range(n):
      outs.append(got[c])
      history[c] += got[c]
  engine.allocator.check()
  return outs[len(replay):]


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_host_tier_outputs_match_tier_off(tiny_dir, kv_dtype):
  off = build_engine(tiny_dir, EngineConfig.of(**ENGINE, kv_cache_dtype=kv_dtype))
  want = chat(off, VOCAB)
  on = build_engine(tiny_dir, EngineConfig.of(**ENGINE, kv_cache_dtype=kv_dtype,
                                               kv_offload_host_gb=0.01))
  with compile_events() as events:
    assert chat(on, VOCAB) == want
  assert events == [], f"compiled after warm-up: {sorted(set(events))}"
  tier = on.stats().kv_offload
  assert tier.pages_offloaded > 0 and tier.pages_reloaded > 0 and tier.reload_failures == 0
  assert (on.stats().prefill_tokens_computed_total
          < off.stats().prefill_tokens_computed_total)


def test_restart_serves_the_next_turn_from_disk(tiny_dir, tmp_path):
  want = chat(build_engine(tiny_dir, EngineConfig.of(**ENGINE)), VOCAB)
  tiers = dict(kv_offload_host_gb=0.01, kv_offload_disk_dir=str(tmp_path),
               kv_offload_disk_gb=0.1)
  first = build_engine(tiny_dir, EngineConfig.of(**ENGINE, **tiers))
  assert chat(first, VOCAB, turns=4) == want[:24]
  first.shutdown()  # the host tier goes to disk
  restarted = build_engine(tiny_dir, EngineConfig.of(**ENGINE, **tiers))
  assert chat(restarted, VOCAB, replay=want[:24]) == want[24:]
  tier = restarted.stats().kv_offload
  assert tier.disk.hits > 0 and tier.pages_reloaded > 0
  restarted.shutdown()


@pytest.mark.slow
def test_default_model_host_tier_outputs_match_tier_off(default_tokenizer):
  from server_procs import DEFAULT_MODEL, DEFAULT_MODEL_TEST_CONFIG

  from checkpoints import presets

  path = presets.resolve_preset(DEFAULT_MODEL)
  base = {**DEFAULT_MODEL_TEST_CONFIG, "num_pages": 40, "page_size": 8, "max_num_seqs": 4}
  vocab = default_tokenizer.vocab_size
  off = build_engine(path, EngineConfig.of(**base))
  want = chat(off, vocab, system=100, user=10)
  on = build_engine(path, EngineConfig.of(**base, kv_offload_host_gb=0.05))
  assert chat(on, vocab, system=100, user=10) == want
  tier = on.stats().kv_offload
  assert tier.pages_reloaded > 0 and tier.host.hits > 0
