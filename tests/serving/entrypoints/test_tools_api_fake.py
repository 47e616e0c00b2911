"""Tool calling through the HTTP API on the fake engine (no model).

The fake engine's output repeats its prompt (frontend_fake.py). Here the chat
template renders only the last message's content, and it "supports tools"
(it mentions them), so a user message holding Hermes `<tool_call>` blocks comes
back as the model's output: `tool_choice="auto"` must turn it into OpenAI
`tool_calls`, streaming and not, with finish_reason "tool_calls". The template
also records what it was given (the tools, the earlier calls and results).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from frontend_fake import ByteTokenizer, InProcessServer

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.engine.fake_runner import FakeRunner

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
         '</tool_call>')


class EchoTemplateTokenizer(ByteTokenizer):
  """Renders the last message's content only; keeps what the template was given."""

  chat_template = "{% if tools %}{{ tools }}{% endif %}{{ messages[-1].content }}"

  def __init__(self):
    self.seen: list[dict] = []

  def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False,
                          tools=None):
    self.seen.append({"messages": messages, "tools": tools})
    text = messages[-1]["content"] or ""
    return self.encode(text) if tokenize else text


@pytest.fixture(scope="module")
def server():
  config = EngineConfig.of(max_num_seqs=4, max_model_len=512, num_pages=128, page_size=16,
                        compilation_cache=False)
  runner = FakeRunner(num_pages=128, page_size=16, max_num_seqs=4, vocab_size=300)
  tok = EchoTemplateTokenizer()
  engine = LLMEngine(runner=runner, tokenizer=tok, config=config, model_name="fake")
  with InProcessServer(engine) as s:
    s.tok = tok
    yield s


@pytest.fixture(scope="module")
def oa(server):
  return openai.OpenAI(base_url=f"{server.http}/v1", api_key="x", max_retries=0)


def ask(oa, content, **kw):
  """The fake model answers `content` (then stops at the "#END" marker)."""
  return oa.chat.completions.create(
      model="fake", messages=[{"role": "user", "content": content + "#END"}],
      max_tokens=len(content.encode()) + 8, stop=["#END"], temperature=0, **kw)


def test_auto_parses_tool_calls(oa):
  out = ask(oa, CALLS, tools=[WEATHER])
  choice = out.choices[0]
  assert choice.finish_reason == "tool_calls"
  assert choice.message.content == "Let me check."
  calls = choice.message.tool_calls
  assert [c.function.name for c in calls] == ["get_weather"] * 2
  assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"},
                                                                 {"city": "Oslo"}]
  assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_auto_streams_the_same_calls(oa):
  whole = ask(oa, CALLS, tools=[WEATHER]).choices[0].message
  content, args, names, ids, finish = "", {}, {}, {}, None
  for chunk in ask(oa, CALLS, tools=[WEATHER], stream=True):
    delta = chunk.choices[0].delta
    content += delta.content or ""
    for tc in delta.tool_calls or []:
      if tc.id:
        ids[tc.index], names[tc.index] = tc.id, tc.function.name
      args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
    finish = chunk.choices[0].finish_reason or finish
  assert finish == "tool_calls" and content == whole.content
  assert [names[i] for i in sorted(names)] == [c.function.name for c in whole.tool_calls]
  assert [args[i] for i in sorted(args)] == [c.function.arguments for c in whole.tool_calls]
  assert len(args) == 2 and all(len(i) > 5 for i in ids.values())


def test_plain_text_stays_content_and_tool_choice_none_parses_nothing(oa):
  out = ask(oa, "No tools needed here.", tools=[WEATHER])
  assert out.choices[0].message.content == "No tools needed here."
  assert not out.choices[0].message.tool_calls and out.choices[0].finish_reason == "stop"
  out = ask(oa, CALLS, tools=[WEATHER], tool_choice="none")
  assert out.choices[0].message.content == CALLS and not out.choices[0].message.tool_calls


def test_tools_and_history_reach_a_template_that_renders_them(server, oa):
  messages = [
      {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": None, "tool_calls": [{
          "id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
  oa.chat.completions.create(model="fake", messages=messages, tools=[WEATHER], max_tokens=3)
  seen = server.tok.seen[-1]
  assert seen["tools"][0]["function"]["name"] == "get_weather"
  assert seen["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
  assert seen["messages"][2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER] * 200}, "tools"),
])
def test_bad_tools_get_400_naming_the_field(server, body, param):
  r = httpx.post(f"{server.http}/v1/chat/completions", timeout=30, json={
      "model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})
  assert r.status_code == 400, r.text
  assert r.json()["error"]["param"] == param, r.json()


def test_bad_history_arguments_get_400(server):
  r = httpx.post(f"{server.http}/v1/chat/completions", timeout=30, json={
      "model": "fake", "tools": [WEATHER], "max_tokens": 2, "messages": [
          {"role": "user", "content": "hi"},
          {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
              "name": "get_weather", "arguments": "{not json"}}]}]})
  assert r.status_code == 400
  assert r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
