"""The real engine with one injected fault, for the fault-isolation tests.

`FaultInjectingEngine` is `serving.engine.LLMEngine` unchanged except that
output processing (detokenization) raises for a request whose prompt token
ids start with `POISON_PREFIX`, the way an undecodable token would. Loaded by
the server with `--engine_class=ops_faults:FaultInjectingEngine`.
"""

from __future__ import annotations

from serving.engine.llm_engine import LLMEngine
from serving.engine.output_processor import OutputProcessor

POISON_PREFIX = [13, 13, 13, 13, 13, 13, 13]


class _FaultyOutputProcessor(OutputProcessor):
  """Fails `on_token` for poisoned prompts only."""

  def on_token(self, seq, token: int, out, row: int) -> bool:
    if seq.prompt_ids[:len(POISON_PREFIX)] == POISON_PREFIX:
      raise UnicodeDecodeError("utf-8", bytes([0xff]), 0, 1, f"injected fault at token {token}")
    return super().on_token(seq, token, out, row)


class FaultInjectingEngine(LLMEngine):
  """LLMEngine whose output processor fails poisoned requests (see module doc)."""

  def __init__(self, model, config=None, **kw):
    super().__init__(model, config, **kw)
    self.outputs = _FaultyOutputProcessor(self.tokenizer)
