"""The llguidance backend: request constraints -> grammars -> token bitmasks.

`GrammarCompiler` (one per engine/tokenizer) turns a `StructuredOutputsParams`
into llguidance's grammar text, checks it once (the result is cached by the
constraint's text, so repeated schemas cost nothing) and makes a `Grammar` per
request. Refusals are `ValueError`s naming the field (`structured_outputs.json`,
...), raised before the engine takes the request.

A constraint's cost shows at its first token mask, when llguidance builds the
lexer states lazily (a regex like `(a{1000}){1000}` takes a second there).
`check` therefore computes that first mask in the front end's worker thread,
refuses a constraint that is in error or allows nothing by then, and keeps the
warmed matcher: each request gets a copy of it (`deep_copy`), so the engine
thread does not pay the first mask. Later masks are bounded by llguidance's
per-step limits (`LIMITS`); a grammar that exceeds them mid-generation fails
its own request only (the engine's `fill_masks` reports it).

JSON is generated compact and canonical: `", "` between items, `": "` after
keys, no other whitespace (a free-whitespace grammar lets small models emit
newlines until max_tokens). A schema that does not set `additionalProperties`
allows other properties, as JSON Schema says.
"""

from __future__ import annotations

import collections
import json
import threading
from typing import Any

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from serving.types import StructuredOutputsParams

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 256
# llguidance's default resource limits, without the parser state in error messages.
LIMITS = llguidance.LLParserLimits(verbose_errors=False)


def bitmask_width(vocab_size: int) -> int:
  """int32 words per mask row: one bit per token id."""
  return (vocab_size + 31) // 32


class Grammar:
  """One request's constraint state: follows its tokens, gives the next token mask.

  Not thread-safe: the engine thread owns it.
  """

  def __init__(self, matcher: llguidance.LLMatcher, kind: str):
    self.matcher, self.kind = matcher, kind

  def accept(self, token_id: int) -> bool:
    """Advances by a sampled token; False if the grammar does not allow it."""
    return bool(self.matcher.consume_token(token_id))

  def valid_prefix(self, tokens: list[int]) -> int:
    """How many of `tokens`, in order, the grammar would accept from here (state unchanged):
    speculative drafts are cut to that before they are verified."""
    return int(self.matcher.validate_tokens(list(tokens))) if tokens else 0

  @property
  def terminated(self) -> bool:
    """The grammar is complete and admits nothing more (only end-of-sequence)."""
    return self.matcher.is_stopped()

  @property
  def error(self) -> str | None:
    """Why the grammar cannot go on (it then refuses everything), or None: the first line
    of llguidance's message (the rest dumps the parser state and the grammar)."""
    if not self.matcher.is_error():
      return None
    return _first_line(self.matcher.get_error() or "grammar error")


class GrammarCompiler:
  """Compiles and checks constraints for one tokenizer (see module doc)."""

  def __init__(self, tokenizer: Any, vocab_size: int):
    """`tokenizer`: checkpoints.tokenizer.Tokenizer (its `backend` is a `tokenizers.Tokenizer`);
    `vocab_size`: the model's vocabulary (mask width; ids past the tokenizer's are refused)."""
    self.tokenizer, self.vocab_size = tokenizer, vocab_size
    self._ll_tokenizer: llguidance.LLTokenizer | None = None
    self._lock = threading.Lock()
    # grammar text -> a matcher that has computed its first mask (copied per request)
    self._templates: collections.OrderedDict[str, llguidance.LLMatcher] = (
        collections.OrderedDict())

  @property
  def ll_tokenizer(self) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary (built once, ~0.3 s)."""
    with self._lock:
      if self._ll_tokenizer is None:
        backend = getattr(self.tokenizer, "backend", None)
        if backend is None or not hasattr(backend, "to_str"):
          raise ValueError("structured output needs a Hugging Face `tokenizers` tokenizer; "
                           "this model's tokenizer has none")
        eos = sorted(getattr(self.tokenizer, "eos_token_ids", ()) or ())
        self._ll_tokenizer = llguidance.LLTokenizer(
            backend.to_str(), n_vocab=self.vocab_size, eos_token=eos or None)
      return self._ll_tokenizer

  def check(self, spec: StructuredOutputsParams) -> str:
    """The constraint's grammar text, checked; ValueError naming the field if it is bad.

    CPU work that can take up to a second for a huge schema: front ends call it
    in a worker thread, so the engine's own call hits the cache.
    """
    return self._template(spec)[0]

  def grammar(self, spec: StructuredOutputsParams) -> Grammar:
    """A fresh `Grammar` for one request (checks the constraint first)."""
    _, template = self._template(spec)
    with self._lock:
      return Grammar(template.deep_copy(), spec.kind)

  def _template(self, spec: StructuredOutputsParams) -> tuple[str, llguidance.LLMatcher]:
    spec.validate()
    kind = spec.kind
    field = f"structured_outputs.{kind}"
    text = grammar_text(spec)
    with self._lock:
      template = self._templates.get(text)
      if template is not None:
        self._templates.move_to_end(text)
        return text, template
    error = llguidance.LLMatcher.validate_grammar(text, self.ll_tokenizer, limits=LIMITS)
    if error:
      raise ValueError(f"{field} is not a valid {_WHAT[kind]}: {_first_line(error)}")
    template = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0, limits=LIMITS)
    scratch = np.zeros((1, bitmask_width(self.vocab_size)), np.int32)
    if not template.is_error():
      llg_numpy.fill_next_token_bitmask(template, scratch)
    if template.is_error() or not scratch.any():
      why = _first_line(template.get_error() or "no output can satisfy it")
      raise ValueError(f"{field} is too complex to enforce or admits no output: {why}")
    with self._lock:
      self._templates[text] = template
      while len(self._templates) > _CACHE_SIZE:
        self._templates.popitem(last=False)
    return text, template


def _first_line(message: str) -> str:
  return message.strip().splitlines()[0] if message.strip() else message


_WHAT = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
         "choice": "list of choices", "grammar": "Lark grammar"}


def grammar_text(spec: StructuredOutputsParams) -> str:
  """llguidance's grammar text for a constraint (not yet checked)."""
  kind = spec.kind
  field = f"structured_outputs.{kind}"
  if kind in ("json", "json_object"):
    schema: Any = {"type": "object"} if kind == "json_object" else spec.json
    if isinstance(schema, str):
      try:
        schema = json.loads(schema)
      except (ValueError, RecursionError) as e:
        raise ValueError(f"{field} is not valid JSON: {e}") from None
      if isinstance(schema, dict):
        StructuredOutputsParams(json=schema).validate()  # depth and size, as for a dict
    if not isinstance(schema, (dict, bool)):
      raise ValueError(f"{field} must be a JSON schema object")
    try:
      return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
      raise ValueError(f"{field} is not a valid JSON schema: {e}") from None
  if kind == "regex":
    return llguidance.LLMatcher.grammar_from_regex(spec.regex)
  if kind == "choice":
    return llguidance.LLMatcher.grammar_from_lark(
        "start: " + " | ".join(json.dumps(c) for c in spec.choice))
  try:  # Lark, or GBNF (llama.cpp's), converted to Lark
    return llguidance.grammar_from("grammar", spec.grammar)
  except ValueError as e:
    raise ValueError(f"{field} is not a valid grammar: {e}") from None


_executor: llguidance.LLExecutor | None = None


def fill_masks(grammars: list[Grammar], vocab_size: int) -> tuple[np.ndarray, list[int]]:
  """Next-token masks of `grammars` -> ([n, bitmask_width] int32, rows that cannot go on).

  The rows are computed in parallel by llguidance's thread pool (the GIL is
  released). A row is refused (listed, left all zero) when its grammar is in
  error or allows no token at all.
  """
  global _executor
  if _executor is None:
    _executor = llguidance.LLExecutor()
  masks = np.zeros((len(grammars), bitmask_width(vocab_size)), np.int32)
  live = [(g.matcher, i) for i, g in enumerate(grammars) if not g.matcher.is_error()]
  if live:
    llg_numpy.fill_next_token_bitmask_par(_executor, live, masks)
  dead = [i for i, g in enumerate(grammars) if g.matcher.is_error() or not masks[i].any()]
  masks[dead] = 0
  return masks, dead


def fill_draft_masks(grammars: list[Grammar], drafts: list[list[int]], positions: int,
                     vocab_size: int) -> tuple[np.ndarray, list[int]]:
  """Token masks of a speculative step's constrained rows -> ([n, positions, bitmask_width]
  int32, rows that cannot go on).

  Row i's mask at position 0 is its grammar's next-token mask now; at position j
  the mask after its drafts 1..j (which must be valid: `Grammar.valid_prefix`),
  computed in parallel with the grammar rolled back after. Positions past a row's
  drafts are all ones (unconstrained: the verifier ignores them).
  """
  global _executor
  if _executor is None:
    _executor = llguidance.LLExecutor()
  width = bitmask_width(vocab_size)
  masks = np.full((len(grammars), positions, width), -1, np.int32)
  flat = masks.reshape(len(grammars) * positions, width)
  live = [i for i, g in enumerate(grammars) if not g.matcher.is_error()]
  for i in live:
    flat[i * positions:i * positions + len(drafts[i]) + 1] = 0
  with_drafts = [(grammars[i].matcher, i * positions, list(drafts[i])) for i in live if drafts[i]]
  if with_drafts:
    llg_numpy.fill_next_token_bitmask_par_with_draft_tokens(_executor, with_drafts, flat)
  without = [(grammars[i].matcher, i * positions) for i in live if not drafts[i]]
  if without:  # llguidance's draft variant refuses an empty draft list
    llg_numpy.fill_next_token_bitmask_par(_executor, without, flat)
  dead = [i for i, g in enumerate(grammars) if g.matcher.is_error() or not masks[i, 0].any()]
  masks[dead] = 0
  return masks, dead
