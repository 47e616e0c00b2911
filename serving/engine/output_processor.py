"""Per-request output state: incremental detokenization, stop strings, deltas.

The engine feeds every sampled token through `on_token` and then calls
`emit`, which sends the request's callback a delta `RequestOutput` (new token
ids, new text, new logprobs; `finish_reason` on the last). While a request
has stop strings, the last `max(len(stop)) - 1` characters are held back so
that a stop string is never streamed before it is recognised.
"""

from __future__ import annotations

import dataclasses
import logging

from serving.engine.detokenizer import IncrementalDetokenizer
from serving.types import RequestOutput, SampledToken

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _State:
  callback: object
  detok: IncrementalDetokenizer
  text: str = ""
  sent_chars: int = 0
  new_ids: list = dataclasses.field(default_factory=list)
  new_logprobs: list = dataclasses.field(default_factory=list)
  stopped: bool = False


class OutputProcessor:
  """Owns detokenizers and callbacks of the live requests (engine thread only)."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self._states: dict[str, _State] = {}
    self.generation_tokens_total = 0

  def add(self, seq, callback) -> None:
    detok = IncrementalDetokenizer(self.tokenizer,
                                   skip_special_tokens=seq.params.skip_special_tokens)
    self._states[seq.request_id] = _State(callback=callback, detok=detok)

  def on_token(self, seq, sampled: SampledToken) -> bool:
    """Records a sampled token; returns True if it completed a stop string."""
    st = self._states[seq.request_id]
    self.generation_tokens_total += 1
    if st.stopped:
      return True
    token = sampled.token_id
    st.new_ids.append(token)
    if seq.params.logprobs is not None and sampled.logprob is not None:
      st.new_logprobs.append(sampled.logprob)
    if token in seq.eos_ids and not seq.params.ignore_eos:
      return False  # the EOS text is never shown
    if token in seq.params.stop_token_ids:
      return False
    st.text += st.detok.push([token])
    return self._check_stop(seq, st)

  def _check_stop(self, seq, st: _State) -> bool:
    stops = seq.params.stop
    if not stops:
      return False
    window = max(len(s) for s in stops) + 8
    tail_start = max(0, st.sent_chars - window)
    best = None
    for s in stops:
      i = st.text.find(s, tail_start)
      if i >= 0 and (best is None or i < best[0]):
        best = (i, s)
    if best is None:
      return False
    i, s = best
    st.text = st.text[:i + len(s)] if seq.params.include_stop_str_in_output else st.text[:i]
    st.stopped = True
    seq.stop_reason = s
    return True

  def emit(self, seq, finish_reason=None, error: str | None = None) -> None:
    """Sends the delta accumulated since the last emit."""
    st = self._states.get(seq.request_id)
    if st is None:
      return
    if finish_reason is not None and not st.stopped:
      st.text += st.detok.flush()
    hold = 0
    if finish_reason is None and seq.params.stop:
      hold = max(len(s) for s in seq.params.stop) - 1
    upto = max(st.sent_chars, len(st.text) - hold)
    delta = st.text[st.sent_chars:upto]
    st.sent_chars = upto
    if not delta and not st.new_ids and finish_reason is None:
      return
    out = RequestOutput(
        request_id=seq.request_id, prompt_token_ids=seq.prompt_ids, text=delta,
        token_ids=st.new_ids, finish_reason=finish_reason,
        logprobs=st.new_logprobs if seq.params.logprobs is not None else None,
        stop_reason=seq.stop_reason, error=error)
    st.new_ids, st.new_logprobs = [], []
    if finish_reason is not None:
      del self._states[seq.request_id]
    try:
      st.callback(out)
    except Exception:  # a broken consumer must not stop the engine
      log.exception("output callback of request %s failed", seq.request_id)
