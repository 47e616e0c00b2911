"""Per-row sampling parameters as fixed-shape arrays, and the sampler's output.

`SamplingTensors.build` turns a batch's `SamplingParams` into `[B]` numpy
arrays on the host; padding rows are neutral (greedy, no logprobs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np

from serving.types import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
  """Per-row sampling parameters of a batch; every field is a `[B]` (or `[B, 2]`) array.

  Neutral values disable a stage: temperature 0 (any value < MIN_TEMPERATURE)
  is greedy, top_k <= 0, top_p 1, min_p 0, repetition_penalty 1,
  presence/frequency penalty 0, num_logprobs -1 (no logprobs wanted; 0 wants
  the sampled token's logprob only).
  """

  temperature: jax.Array  # [B] f32
  top_k: jax.Array  # [B] i32
  top_p: jax.Array  # [B] f32
  min_p: jax.Array  # [B] f32
  repetition_penalty: jax.Array  # [B] f32
  presence_penalty: jax.Array  # [B] f32
  frequency_penalty: jax.Array  # [B] f32
  seed: jax.Array  # [B, 2] u32: (seed >> 32, seed & 0xffffffff), threefry key data
  step: jax.Array  # [B] i32: index of the output token being generated
  num_logprobs: jax.Array  # [B] i32: SamplingParams.logprobs, -1 for None

  @staticmethod
  def build(params: Sequence[SamplingParams | None], seeds: Sequence[int],
            steps: Sequence[int], batch_size: int) -> SamplingTensors:
    """Host-side (numpy) tensors for a batch of `batch_size` rows.

    Row i takes `params[i]`, `seeds[i]` and `steps[i]`; rows past `len(params)`
    and rows whose params are None are padding (greedy, neutral, no logprobs).
    The caller chooses a seed for requests without one.
    """
    if len(params) > batch_size:
      raise ValueError(f"{len(params)=} rows do not fit {batch_size=}")
    if len(seeds) != len(params) or len(steps) != len(params):
      raise ValueError(f"need one seed and step per row: {len(params)=}, "
                       f"{len(seeds)=}, {len(steps)=}")
    rows = [_NEUTRAL if p is None else (
        p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
        p.frequency_penalty, -1 if p.logprobs is None else p.logprobs) for p in params]
    cols = np.array(rows + [_NEUTRAL] * (batch_size - len(params)), np.float64).T  # [8, B]
    seed = np.zeros((batch_size, 2), np.uint32)
    seed64 = np.array(seeds, np.uint64)
    seed[:len(params), 0] = seed64 >> np.uint64(32)
    seed[:len(params), 1] = seed64 & np.uint64(0xFFFFFFFF)
    step = np.zeros(batch_size, np.int32)
    step[:len(params)] = steps
    f32, i32 = lambda c: c.astype(np.float32), lambda c: c.astype(np.int32)
    return SamplingTensors(
        temperature=f32(cols[0]), top_k=i32(cols[1]), top_p=f32(cols[2]), min_p=f32(cols[3]),
        repetition_penalty=f32(cols[4]), presence_penalty=f32(cols[5]),
        frequency_penalty=f32(cols[6]), seed=seed, step=step, num_logprobs=i32(cols[7]))


# A padding row: greedy, neutral, no logprobs (the column order of `build`).
_NEUTRAL = (0.0, -1, 1.0, 0.0, 1.0, 0.0, 0.0, -1)


class SampleOutput(NamedTuple):
  """Result of `sample`; device arrays. Logprobs are zeros when no row asked for them."""

  tokens: jax.Array  # [B] i32
  logprob: jax.Array  # [B] f32: raw log_softmax of the sampled token
  top_ids: jax.Array  # [B, num_top] i32, best first
  top_logprobs: jax.Array  # [B, num_top] f32, descending
