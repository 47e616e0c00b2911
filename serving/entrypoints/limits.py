"""Per-request limits of the API front ends (operator flags with safe defaults).

A request beyond a limit can never be served as asked, so it is refused with
400 / INVALID_ARGUMENT naming the field before any work is done for it; 429
is kept for requests that would fit later (a full queue). `SamplingParams`
itself checks types, ranges and finiteness (serving/types.py); these are the
sizes an operator may want to tune. docs/reliability.md lists them.
"""

from __future__ import annotations

import dataclasses

from serving.types import MAX_LOGPROBS, SamplingParams


class LimitError(ValueError):
  """A request exceeds a limit; `param` names the field."""

  def __init__(self, message: str, param: str):
    super().__init__(message)
    self.param = param


@dataclasses.dataclass(frozen=True)
class RequestLimits:
  """See module doc. Every count is per API request."""

  max_prompts: int = 64  # prompts in one completions request
  max_n: int = 16  # choices per prompt (`n`)
  max_choices: int = 64  # engine requests one API request becomes: prompts x n
  max_stop: int = 16  # stop strings
  max_stop_chars: int = 256  # characters of one stop string
  max_stop_token_ids: int = 64
  max_logprobs: int = MAX_LOGPROBS  # top alternatives per token
  max_input_chars: int = 1_000_000  # text handed to the tokenizer or the chat template
  max_request_id_chars: int = 256  # a client-chosen request id (gRPC), a label only
  allow_request_chat_template: bool = False  # a Jinja template sent by the client

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if f.type == "int" and value < 1:
        raise ValueError(f"{f.name}={value} must be at least 1")
    if self.max_logprobs > MAX_LOGPROBS:
      raise ValueError(f"max_logprobs={self.max_logprobs} must be at most {MAX_LOGPROBS}")

  def check_counts(self, num_prompts: int, n: int) -> None:
    if num_prompts > self.max_prompts:
      raise LimitError(f"{num_prompts} prompts exceed the limit of {self.max_prompts} "
                       "per request", "prompt")
    if n > self.max_n:
      raise LimitError(f"n={n} exceeds the limit of {self.max_n}", "n")
    if num_prompts * n > self.max_choices:
      raise LimitError(f"{num_prompts} prompts x n={n} = {num_prompts * n} completions exceed "
                       f"the limit of {self.max_choices} per request", "n")

  def check_text(self, text: str, param: str) -> None:
    if len(text) > self.max_input_chars:
      raise LimitError(f"{param} has {len(text)} characters; the limit is "
                       f"{self.max_input_chars}", param)

  def check_sampling(self, params: SamplingParams) -> None:
    if len(params.stop) > self.max_stop:
      raise LimitError(f"{len(params.stop)} stop strings exceed the limit of {self.max_stop}",
                       "stop")
    if any(len(s) > self.max_stop_chars for s in params.stop):
      raise LimitError(f"a stop string exceeds {self.max_stop_chars} characters", "stop")
    if len(params.stop_token_ids) > self.max_stop_token_ids:
      raise LimitError(f"{len(params.stop_token_ids)} stop_token_ids exceed the limit of "
                       f"{self.max_stop_token_ids}", "stop_token_ids")
    if params.logprobs is not None and params.logprobs > self.max_logprobs:
      raise LimitError(f"logprobs={params.logprobs} exceeds the limit of {self.max_logprobs}",
                       "logprobs")
