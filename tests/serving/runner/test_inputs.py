"""A step plan's prefill chunks -> packed prefill calls (serving/runner/inputs.py)."""

import numpy as np
import pytest

from serving.config import EngineConfig
from serving.runner.inputs import build_prefill_input, pack_prefill_chunks, prefill_bucket
from serving.types import PrefillChunk, SamplingParams, Sequence

CONFIG = EngineConfig.of(max_num_seqs=8, max_model_len=128, page_size=4, max_num_batched_tokens=64)


def chunk(i: int, start: int, end: int, *, sample: bool = True, prompt: int | None = None,
          lora_slot: int | None = None) -> PrefillChunk:
  prompt = end if prompt is None else prompt
  seq = Sequence(request_id=f"r{i}", prompt_ids=[7 + i] * prompt,
                 params=SamplingParams(temperature=0.0, logprobs=i), seed=i,
                 output_ids=[3] * max(0, end - prompt), pages=list(range(1 + 8 * i, 9 + 8 * i)),
                 decode_slot=i, lora_slot=lora_slot)
  return PrefillChunk(seq, start, end, sample=sample)


def test_chunk_rows_per_bucket():
  # One chunk row per 16 tokens, as a decode batch bucket, up to max_num_seqs.
  sched = CONFIG.scheduler
  assert [sched.prefill_chunk_rows(t) for t in sched.prefill_token_buckets] == [1, 2, 4]
  assert EngineConfig.of(max_num_seqs=6).scheduler.prefill_chunk_rows(512) == 6


def test_packing_splits_only_past_the_largest_bucket():
  small = [chunk(i, 0, 10) for i in range(6)]
  assert [len(g) for g in pack_prefill_chunks(small, CONFIG)] == [4, 2]  # 4 chunk rows at 64
  big = [chunk(i, 0, 30) for i in range(3)]
  assert [len(g) for g in pack_prefill_chunks(big, CONFIG)] == [2, 1]  # 90 tokens > 64
  # The bucket grows with the chunk count, not only the tokens.
  assert prefill_bucket([3, 3], CONFIG) == 32 and prefill_bucket([3, 3, 3], CONFIG) == 64
  with pytest.raises(ValueError, match="exceed"):
    prefill_bucket([65], CONFIG)


def test_call_layout():
  chunks = [chunk(0, 0, 5, sample=False, prompt=12), chunk(1, 4, 9, prompt=7, lora_slot=2),
            chunk(2, 0, 3)]
  inp, ids = build_prefill_input(chunks, CONFIG)
  assert ids == ["r1", "r2"]  # the chunk that stops mid-prompt samples nothing
  assert inp.tokens.shape == (64,) and inp.cu_q_lens.tolist()[:4] == [0, 5, 10, 13]
  dummy = CONFIG.scheduler.max_num_seqs
  np.testing.assert_array_equal(inp.positions[:13], [0, 1, 2, 3, 4, 4, 5, 6, 7, 8, 0, 1, 2])
  np.testing.assert_array_equal(inp.token_slots, [0] * 5 + [1] * 5 + [2] * 3 + [dummy] * 51)
  np.testing.assert_array_equal(inp.lora_rows, [-1] * 5 + [2] * 5 + [-1] * 54)
  np.testing.assert_array_equal(inp.is_output[:13], [0] * 8 + [1, 1] + [0] * 3)
  # kv index: the chunk's pages (sequence 1 holds pages 9..16, 4 tokens a page).
  assert inp.kv_index[5] == 10 * 4 + 0 and inp.kv_index[9] == 11 * 4 + 0
  assert inp.kv_lens.tolist()[:3] == [5, 9, 3] and inp.reset.tolist()[:3] == [True, False, True]
  # Sampler rows: the sampling chunks' last rows, then padding to the dummy slot.
  assert inp.sample_rows.tolist()[:2] == [9, 12]
  assert inp.sample_slots.tolist() == [1, 2] + [dummy] * (len(inp.sample_slots) - 2)
  assert inp.sampling.step.tolist()[:2] == [9 - 7, 0] and inp.sampling.num_logprobs[0] == 1
  # Query blocks: one per chunk here; each packed row finds itself through `unblock`.
  b = inp.blocks
  assert int(b.count) == 3 and b.chunk.tolist()[:3] == [0, 1, 2]
  flat_rows = b.rows.reshape(-1)
  np.testing.assert_array_equal(flat_rows[b.unblock[:13]], np.arange(13))
  np.testing.assert_array_equal(b.q_lens.reshape(-1)[b.unblock[:13]], inp.positions[:13] + 1)


def test_padding_only_call():
  inp, ids = build_prefill_input([], CONFIG, bucket=64)
  assert ids == [] and int(inp.blocks.count) == 0 and inp.cu_q_lens[-1] == 0
  assert inp.block_tables.shape == (4, CONFIG.block_table_width)
