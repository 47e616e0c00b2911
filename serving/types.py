"""Shared vocabulary of the engine: sampling parameters and request outputs.

Everything a front end, the scheduler and the LLM API exchange lives here, so
that the names (OpenAI / vLLM style) are defined once.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]

# The most top-n logprobs a request may ask for (OpenAI allows 20).
MAX_LOGPROBS = 20


@dataclasses.dataclass
class SamplingParams:
  """Per-request sampling options with the OpenAI / vLLM names.

  `temperature == 0` means greedy. `top_k <= 0` (or -1) disables top-k;
  `top_p == 1` disables nucleus sampling; `min_p == 0` disables min-p.
  `logprobs=None` returns no logprobs; `logprobs=n` returns the sampled
  token's logprob plus the top `n` alternatives (0 <= n <= 20).
  """

  max_tokens: int | None = 16
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = -1
  min_p: float = 0.0
  repetition_penalty: float = 1.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  seed: int | None = None
  stop: str | list[str] | None = None
  stop_token_ids: list[int] | None = None
  ignore_eos: bool = False
  logprobs: int | None = None
  include_stop_str_in_output: bool = False
  skip_special_tokens: bool = True

  def __post_init__(self):
    if isinstance(self.stop, str):
      self.stop = [self.stop]
    self.stop = list(self.stop or [])
    self.stop_token_ids = list(self.stop_token_ids or [])
    self.validate()

  def validate(self) -> None:
    """Raises ValueError naming the first invalid field."""
    if self.max_tokens is not None and self.max_tokens < 1:
      raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
    if not self.temperature >= 0.0:
      raise ValueError(f"temperature must be non-negative, got {self.temperature}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.top_k == 0:
      self.top_k = -1
    if self.top_k < -1:
      raise ValueError(f"top_k must be -1 (disabled) or at least 1, got {self.top_k}")
    if not 0.0 <= self.min_p <= 1.0:
      raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
    if not self.repetition_penalty > 0.0:
      raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
    if not -2.0 <= self.presence_penalty <= 2.0:
      raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
    if not -2.0 <= self.frequency_penalty <= 2.0:
      raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
    if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
      raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
    if self.seed is not None and not 0 <= self.seed < 2**63:
      raise ValueError(f"seed must be a non-negative 63-bit integer, got {self.seed}")
    if any(not isinstance(s, str) or not s for s in self.stop):
      raise ValueError("stop strings must be non-empty strings")
    if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
      raise ValueError("stop_token_ids must be non-negative integers")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


@dataclasses.dataclass
class TokenLogprob:
  """Logprob of one generated token and its top alternatives."""

  token_id: int
  logprob: float
  top: list[tuple[int, float]]  # (token_id, logprob), best first


@dataclasses.dataclass
class RequestOutput:
  """What the engine reports for a request: cumulative, or a delta when streaming.

  `text` / `token_ids` are the generated completion (not the prompt).
  `finish_reason` is None while the request runs.
  """

  request_id: str
  prompt_token_ids: list[int]
  text: str
  token_ids: list[int]
  finish_reason: FinishReason | None = None
  logprobs: list[TokenLogprob] | None = None
  stop_reason: str | int | None = None
  error: str | None = None

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None

  @property
  def num_prompt_tokens(self) -> int:
    return len(self.prompt_token_ids)
