"""Incremental detokenization: a stream of token ids -> text deltas.

vLLM's prefix-offset / read-offset method: only a short window is decoded per
token, and text is held back while it ends in an incomplete UTF-8 character.
Works with any tokenizer exposing `decode(ids, skip_special_tokens)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
  """Turns a token stream into text deltas (vLLM's prefix/read offsets).

  `push(ids)` returns the text that became final; text ending in U+FFFD (an
  incomplete UTF-8 character split across tokens) is held back until the
  next token completes it. Only the tokens since the previous-but-one
  emission are decoded, so the cost per token is O(1) amortized. The
  concatenation of all deltas plus `flush()` equals `decode(pushed_ids)`.

  `prompt_ids` (optional): the last few prompt tokens become decode context,
  so a sentencepiece first token keeps its leading space (" Hello", as the
  text reads after the prompt) instead of being decoded as text start.
  """

  PROMPT_CONTEXT = 5

  def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
               prompt_ids: Sequence[int] = ()):
    self._tok = tokenizer
    self._skip = skip_special_tokens
    context = list(prompt_ids[len(prompt_ids) - self.PROMPT_CONTEXT:] if prompt_ids else [])
    while context and tokenizer.decode(context, skip_special_tokens).endswith(_REPLACEMENT_CHAR):
      context.pop()  # the context must end on a whole character
    self._ids: list[int] = context
    self._num_context = len(context)
    self._prefix_offset = 0
    self._read_offset = len(context)

  @property
  def token_ids(self) -> list[int]:
    """The ids pushed so far (without prompt context)."""
    return self._ids[self._num_context:]

  def push(self, token_ids: Sequence[int]) -> str:
    self._ids.extend(token_ids)
    return self._advance(final=False)

  def flush(self) -> str:
    """Returns any held-back text (e.g. a trailing incomplete character)."""
    return self._advance(final=True)

  def _advance(self, final: bool) -> str:
    ids, p, r = self._ids, self._prefix_offset, self._read_offset
    if r == len(ids):
      return ""
    prefix_text = self._tok.decode(ids[p:r], self._skip)
    new_text = self._tok.decode(ids[p:], self._skip)
    if new_text.endswith(_REPLACEMENT_CHAR) and not final:
      return ""
    self._prefix_offset, self._read_offset = r, len(ids)
    return new_text[len(prefix_text):]
