"""Structured output end to end: the real server (default model) through the `openai` client.

- `chat.completions.parse(response_format=<pydantic model>)` returns a parsed object for
  nested objects, arrays, enums, bounded numbers and optional fields, streaming and not,
  and every output validates against the schema that was sent (jsonschema).
- regex, choice and a Lark grammar hold on 50 sampled outputs each at temperature 1.0
  (vLLM's `structured_outputs` object and its older `guided_*` fields).
- Bad schemas / regexes / grammars get 400 naming the field; a grammar that cannot finish
  within max_tokens ends with finish_reason "length".
"""

from __future__ import annotations

import concurrent.futures
import enum
import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest
from frontend_procs import shared_real_server
from openai.lib._pydantic import to_strict_json_schema

pytestmark = pytest.mark.slow  # a real server on the default model

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def srv(request):
  return shared_real_server(request)


@pytest.fixture(scope="module")
def oa(srv):
  return openai.OpenAI(base_url=f"{srv.http}/v1", api_key="unused", max_retries=0, timeout=600)


class Color(enum.StrEnum):
  red = "red"
  green = "green"
  blue = "blue"


class Address(pydantic.BaseModel):
  city: str = pydantic.Field(max_length=20)
  zip_code: int = pydantic.Field(ge=10000, le=99999)


class Person(pydantic.BaseModel):
  name: str = pydantic.Field(max_length=20)
  age: int = pydantic.Field(ge=0, le=120)
  favourite: Color
  address: Address


class Inventory(pydantic.BaseModel):
  items: list[str] = pydantic.Field(max_length=3)
  count: int = pydantic.Field(ge=0, le=1000)
  price: float = pydantic.Field(ge=0, le=100)
  note: str | None = pydantic.Field(max_length=30)


class Verdict(pydantic.BaseModel):
  label: Color
  confident: bool
  reasons: list[Color] = pydantic.Field(max_length=2)


CASES = [(Person, "Describe a person who lives in Paris, as JSON."),
         (Inventory, "List a small shop inventory as JSON."),
         (Verdict, "Which color is the sky? Answer as JSON.")]


@pytest.mark.parametrize("model, prompt", CASES, ids=[c[0].__name__ for c in CASES])
def test_parse_returns_objects_that_validate(oa, model, prompt):
  schema = to_strict_json_schema(model)
  kw = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=200,
            temperature=0.0, response_format=model)
  done = oa.chat.completions.parse(**kw)
  msg = done.choices[0].message
  assert done.choices[0].finish_reason == "stop"
  assert isinstance(msg.parsed, model)
  jsonschema.validate(json.loads(msg.content), schema)
  with oa.chat.completions.stream(**kw) as stream:
    for _ in stream:
      pass
    final = stream.get_final_completion()
  assert isinstance(final.choices[0].message.parsed, model)
  assert final.choices[0].message.content == msg.content  # greedy: same tokens


def test_json_object_mode(oa):
  out = oa.chat.completions.create(
      model=MODEL, messages=[{"role": "user", "content": "Give a JSON object about cats."}],
      max_tokens=120, temperature=0.0, response_format={"type": "json_object"})
  text = out.choices[0].message.content
  if out.choices[0].finish_reason == "stop":
    assert isinstance(json.loads(text), dict)
  else:
    assert text.startswith("{")


def _sample(oa, n, extra_body, prompt, max_tokens=24):
  """`n` completions at temperature 1.0, 10 concurrent calls of n/10 choices."""
  def one(i):
    out = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                temperature=1.0, seed=i, n=n // 10, extra_body=extra_body)
    return [(c.text, c.finish_reason) for c in out.choices]

  with concurrent.futures.ThreadPoolExecutor(10) as pool:
    return [x for chunk in pool.map(one, range(10)) for x in chunk]


REGEX = r"(Yes|No), [a-z]{2,8}( [a-z]{2,8}){0,3}\."
GRAMMAR = r'''
start: sentence
sentence: subject " " verb " " NUMBER " " noun "."
subject: "The cat" | "A dog" | "My friend"
verb: "ate" | "saw"
noun: "apples" | "birds"
NUMBER: /[1-9][0-9]?/
'''


@pytest.mark.parametrize("extra_body, check", [
    ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    ({"structured_outputs": {"choice": ["sunny", "rainy", "cloudy day"]}},
     lambda t: t in ("sunny", "rainy", "cloudy day")),
    ({"guided_choice": ["sunny", "rainy"]}, lambda t: t in ("sunny", "rainy")),
    ({"structured_outputs": {"grammar": GRAMMAR}},
     lambda t: re.fullmatch(r"(The cat|A dog|My friend) (ate|saw) [1-9][0-9]? (apples|birds)\.",
                            t)),
    ({"guided_grammar": GRAMMAR},
     lambda t: re.fullmatch(r"(The cat|A dog|My friend) (ate|saw) [1-9][0-9]? (apples|birds)\.",
                            t)),
], ids=["regex", "guided_regex", "choice", "guided_choice", "grammar", "guided_grammar"])
def test_fifty_sampled_outputs_hold(oa, extra_body, check):
  outs = _sample(oa, 50, extra_body, "The weather today? Answer:", max_tokens=40)
  assert len(outs) == 50
  for text, reason in outs:
    assert reason == "stop" and check(text), (text, reason)
  if "choice" not in str(extra_body):
    assert len({t for t, _ in outs}) > 5  # sampled, not one answer repeated


def test_a_grammar_that_cannot_finish_ends_with_length(oa):
  out = oa.completions.create(model=MODEL, prompt="Count:", max_tokens=8, temperature=1.0,
                              extra_body={"structured_outputs": {"regex": "[a-z]{50,60}"}})
  c = out.choices[0]
  assert c.finish_reason == "length" and re.fullmatch("[a-z]+", c.text)
  assert out.usage.completion_tokens == 8


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs"),
    ({"guided_regex": "(", }, "guided_regex"),
    ({"guided_json": {"type": 7}}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
])
def test_bad_constraints_get_400_naming_the_field(srv, body, param):
  r = httpx.post(f"{srv.http}/v1/chat/completions", timeout=60, json={
      "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
  assert r.status_code == 400, r.text
  assert r.json()["error"]["param"] == param, r.json()
  # The server still serves.
  ok = httpx.post(f"{srv.http}/v1/completions", timeout=60, json={
      "model": MODEL, "prompt": "hi", "max_tokens": 2,
      "structured_outputs": {"choice": ["fine"]}})
  assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "fine"


WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.mark.parametrize("tool_choice, extra", [
    ("required", {"parallel_tool_calls": False}),
    ({"type": "function", "function": {"name": "get_weather"}}, {}),
], ids=["required", "named"])
def test_forced_tool_calls_always_validate(oa, tool_choice, extra):
  schema = WEATHER["function"]["parameters"]
  messages = [{"role": "user", "content": "What is the weather in Paris?"}]

  def one(seed):
    out = oa.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                     tool_choice=tool_choice, max_tokens=45, temperature=1.0,
                                     seed=seed, **extra)
    return out.choices[0]

  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    choices = list(pool.map(one, range(16)))
  for c in choices:
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
    call = c.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schema)
  # Streaming: the same call, its arguments in pieces.
  args, name, finish = "", None, None
  for chunk in oa.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                          tool_choice=tool_choice, max_tokens=45,
                                          temperature=0.0, stream=True, **extra):
    for tc in chunk.choices[0].delta.tool_calls or []:
      name = tc.function.name or name
      args += tc.function.arguments or ""
    finish = chunk.choices[0].finish_reason or finish
  assert name == "get_weather" and finish == "tool_calls"
  jsonschema.validate(json.loads(args), schema)
