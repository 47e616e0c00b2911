"""The llguidance backend: constraints compile (or are refused naming the field), grammars
follow tokens, masks allow exactly what the grammar allows. Real tokenizer (the default
model's), no model."""

import json
import re

import numpy as np
import pytest

from serving.structured_output import GrammarCompiler, bitmask_width, fill_masks
from serving.types import SamplingParams, StructuredOutputsParams

V = 49152


@pytest.fixture(scope="module")
def tok(default_tokenizer):
  return default_tokenizer


@pytest.fixture(scope="module")
def compiler(tok):
  return GrammarCompiler(tok, V)


def allowed_ids(mask_row):
  return np.flatnonzero(np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:V])


def follow(grammar, tok, text):
  """Feeds `text`'s tokens; False at the first refused one."""
  return all(grammar.accept(t) for t in tok.encode(text))


@pytest.mark.parametrize("spec, good, bad", [
    (dict(json={"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}},
                "required": ["n"], "additionalProperties": False}), '{"n": 7}', '{"n": 70}'),
    (dict(json=json.dumps({"type": "array", "items": {"enum": ["a", "b"]}})), '["a", "b"]',
     '["c"]'),
    (dict(json_object=True), '{"k": [1, 2.5, null]}', '[1]'),
    (dict(regex=r"\d{3}-[a-z]+"), "123-abc", "12-abc"),
    (dict(choice=["red", "green"]), "green", "blue"),
    (dict(grammar='start: "x=" NUM ";"\nNUM: /[0-9]+/'), "x=42;", "x=a;"),
])
def test_constraints_accept_and_refuse(compiler, tok, spec, good, bad):
  params = StructuredOutputsParams(**spec)
  g = compiler.grammar(params)
  assert follow(g, tok, good) and g.terminated or g.matcher.is_accepting()
  assert not follow(compiler.grammar(params), tok, bad)


@pytest.mark.parametrize("spec, field", [
    (dict(json={"type": "nope"}), "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(json=[1, 2]), "structured_outputs.json"),
    (dict(regex="a(b"), "structured_outputs.regex"),
    (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    (dict(grammar="this is not a grammar ::= ["), "structured_outputs.grammar"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(choice=["a", 3]), "structured_outputs.choice"),
    (dict(regex="a", choice=["b"]), "exactly one"),
    (dict(), "exactly one"),
])
def test_bad_constraints_are_refused_naming_the_field(compiler, spec, field):
  with pytest.raises(ValueError, match=re.escape(field)):
    compiler.check(StructuredOutputsParams(**spec))


def test_sampling_params_take_a_dict_and_refuse_unknown_keys():
  p = SamplingParams(structured_outputs={"regex": "a+"})
  assert p.structured_outputs.kind == "regex"
  with pytest.raises(ValueError, match="unknown field"):
    SamplingParams(structured_outputs={"regexp": "a+"})
  with pytest.raises(ValueError, match="exactly one"):
    SamplingParams(structured_outputs={})


def test_masks_allow_exactly_the_grammar(compiler, tok):
  gs = [compiler.grammar(StructuredOutputsParams(choice=["yes", "no"])),
        compiler.grammar(StructuredOutputsParams(regex="[0-9]"))]
  masks, dead = fill_masks(gs, V)
  assert masks.shape == (2, bitmask_width(V)) and dead == []
  for ids in map(allowed_ids, masks):
    assert ids.size > 0
  words = {tok.decode([i]) for i in allowed_ids(masks[0])}
  assert words and all("yes".startswith(w) or "no".startswith(w) for w in words)
  digits = {tok.decode([i]) for i in allowed_ids(masks[1])}
  assert digits == set("0123456789")
  # Once complete, only end-of-sequence remains.
  assert gs[1].accept(tok.encode("7")[0]) and gs[1].terminated
  masks, dead = fill_masks(gs[1:], V)
  assert set(allowed_ids(masks[0])) <= set(tok.eos_token_ids)


def test_a_grammar_in_error_is_reported_dead(compiler, tok):
  g = compiler.grammar(StructuredOutputsParams(regex="abc"))
  assert not g.accept(tok.encode("zzz")[0])
  assert g.error
  masks, dead = fill_masks([g], V)
  assert dead == [0] and not masks.any()


def test_checks_are_cached(compiler):
  spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}})
  first = compiler.check(spec)
  n = len(compiler._templates)
  assert compiler.check(StructuredOutputsParams(json=dict(spec.json))) == first
  assert len(compiler._templates) == n and next(reversed(compiler._templates)) == first


def test_hostile_constraints_are_refused_up_front(compiler):
  """Deep nesting (no recursion anywhere), non-JSON values, and a constraint whose first
  mask (computed by `check`) allows nothing are refused before the engine sees them."""
  nested: dict = {"type": "string"}
  for _ in range(5000):
    nested = {"type": "array", "items": nested}
  with pytest.raises(ValueError, match="nests deeper"):
    compiler.check(StructuredOutputsParams(json=nested))
  with pytest.raises(ValueError, match="structured_outputs.json"):
    compiler.check(StructuredOutputsParams(json="[" * 100_000))
  with pytest.raises(ValueError, match="admits no output"):
    compiler.check(StructuredOutputsParams(regex=r"[^\x00-\x{10FFFF}]"))
  with pytest.raises(ValueError, match="must be JSON"):
    SamplingParams(structured_outputs={"json": {"type": "object", "x": {1, 2}}})
