"""On-device token sampling: penalties, temperature, top-k, top-p, min-p, logprobs.

Everything here is a pure, jit-friendly function of arrays. Per-request values
travel as `[B]` arrays in `SamplingTensors`, so ONE compiled program serves every
mix of parameters in a batch (no recompiles after warm-up).

Pipeline of `sample` (vLLM order):
  0. structured output: tokens a row's packed bitmask (`allowed`, from the
     host's grammar) does not set become -inf; unconstrained rows are all ones;
  1. penalties on the raw logits: repetition (prompt and output tokens),
     frequency and presence (output tokens only);
  2. greedy rows (temperature < MIN_TEMPERATURE, as vLLM) take the argmax of
     the penalised logits;
  3. random rows divide by their temperature, then keep the tokens that pass
     top-k, then top-p (over the top-k renormalised distribution), then min-p;
  4. a draw by inverse CDF with one uniform per row from the key
     `fold_in(key(seed), step)`, so a request samples the same tokens whatever
     batch or row it lands in;
  5. logprobs of the sampled token and the top `num_top` tokens, taken from the
     log_softmax of the RAW logits (vLLM's default `raw_logprobs`).

Every filter is a per-row threshold on the scaled logits ("keep z >= thr"), so
no `[B, V]` sort is ever done (XLA:CPU sorts 32 x 49152 in ~0.5 s): top-k and
top-p read the top `TOP_K_CAP` values (a two-level `lax.top_k`); a row that
needs more (top_k > cap, or a nucleus wider than the cap: a third of the rows
of SmolLM2 at T=1, p=0.95) gets an exact search over the float order instead,
a few rows at a time. Each optional stage sits behind `lax.cond` on "any row
needs it", so an all-greedy batch pays for an argmax only.

Decisions: the draw is an inverse CDF over the vocabulary with one uniform a
row, not Gumbel-max (B x V random numbers: ~35 ms vs ~2 ms at 32 x 49152 on
CPU), and exactly as deterministic. Min-p comes after top-k / top-p (vLLM v0
order; v1 applies it first); ties at a top-k / top-p boundary are all kept.

The runner keeps per-slot penalty state `prompt_mask [R, V] bool` and
`output_counts [R, V] i32` on device (serving/runner/steps.py updates it).

Modules: tensors.py (per-row parameters), penalties.py, thresholds.py
(top-k / top-p / min-p), reductions.py (two-level argmax / top-n), and
sampler.py (`sample`, the draw and logprobs), speculative.py (`verify`: rejection
sampling of a speculative step's drafts).
"""

from __future__ import annotations

from serving.runner.sampling.sampler import MIN_TEMPERATURE, apply_token_mask, sample
from serving.runner.sampling.speculative import VerifyOutput, verify
from serving.runner.sampling.tensors import SampleOutput, SamplingTensors
from serving.runner.sampling.thresholds import TOP_K_CAP

__all__ = ["MIN_TEMPERATURE", "TOP_K_CAP", "SampleOutput", "SamplingTensors",
           "VerifyOutput", "apply_token_mask", "sample", "verify"]
