"""Repetition, frequency and presence penalties (vLLM / OpenAI semantics)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from serving.runner.sampling.tensors import SamplingTensors


def penalised_rows(t: SamplingTensors) -> jax.Array:
  """[B] bool: rows with a non-neutral penalty."""
  return ((t.repetition_penalty != 1) | (t.frequency_penalty != 0)
          | (t.presence_penalty != 0))


def penalise(x: jax.Array, t: SamplingTensors, prompt_mask: jax.Array,
              output_counts: jax.Array) -> jax.Array:
  """vLLM / OpenAI penalties on [B, V] f32 logits; neutral rows come back unchanged.

  Repetition: a token seen in the prompt or output has a positive logit divided
  by the penalty and a negative one multiplied. Then
  `logit -= frequency * count + presence * (count > 0)` over output tokens.
  """
  counts = output_counts.astype(jnp.float32)
  in_output = output_counts > 0
  rep = t.repetition_penalty[:, None]
  seen = prompt_mask | in_output
  x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
  x = x - t.frequency_penalty[:, None] * counts
  return x - t.presence_penalty[:, None] * in_output.astype(jnp.float32)
