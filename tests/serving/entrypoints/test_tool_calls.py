"""Tool calling (Hermes format): request validation, the decoding grammar (compiled by
llguidance over a byte-level tokenizer built here), message preparation, and the output
parser, streamed in any chunking and read whole agreeing. No model."""

from __future__ import annotations

import json
import re

import llguidance
import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers

from serving.entrypoints.tool_calls import (
    MAX_TOOLS,
    ToolCallStreamParser,
    ToolError,
    ToolSpec,
    parse_tool_calls,
    parse_tool_choice,
    parse_tools,
    prepare_messages,
    render_tools_prompt,
    template_supports_tools,
    tool_grammar,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {
        "type": "object", "properties": {"q": {"$ref": "#/$defs/query"},
                                         "n": {"type": "integer", "minimum": 1}},
        "required": ["q", "n"], "$defs": {"query": {"type": "string", "maxLength": 20}}}}}
NOARGS = {"type": "function", "function": {"name": "now"}}
TOOLS = parse_tools([WEATHER, SEARCH, NOARGS])
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def block(name, args: str) -> str:
  return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer uses)."""
  bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1)]
  cs, n = list(bs), 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


@pytest.fixture(scope="module")
def byte_tok():
  """(LLTokenizer, eos id): one token per byte, plus an end-of-sequence special token."""
  vocab = {ch: b for b, ch in sorted(_bytes_to_unicode().items())}
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(["<|eos|>"])
  eos = tok.token_to_id("<|eos|>")
  return llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=eos), eos


def matcher(byte_tok, grammar_text: str) -> llguidance.LLMatcher:
  m = llguidance.LLMatcher(byte_tok[0], llguidance.LLMatcher.grammar_from_lark(grammar_text),
                           log_level=0)
  assert not m.is_error(), m.get_error()
  return m


def accepts(byte_tok, grammar_text: str, text: str) -> bool:
  """The grammar takes all of `text` and may end there (and then takes end-of-sequence)."""
  tok, eos = byte_tok
  m = matcher(byte_tok, grammar_text)
  ids = tok.tokenize_str(text)
  assert tok.decode_str(ids) == text
  for t in ids:
    if not m.consume_token(t):
      return False
  return m.is_accepting() and m.consume_token(eos)


# ------------------------------------------------------------------ parse_tools


def test_parse_tools_defaults():
  assert [t.name for t in TOOLS] == ["get_weather", "search", "now"]
  assert TOOLS[0] == ToolSpec("get_weather", "Current weather in a city.",
                              WEATHER["function"]["parameters"])
  assert TOOLS[2] == ToolSpec("now", "", {"type": "object", "properties": {}})
  assert parse_tools(None) == [] and parse_tools([]) == []
  strict = {"type": "function", "function": {"name": "a-b_9", "description": None,
                                              "parameters": {}, "strict": True}}
  assert parse_tools([strict]) == [ToolSpec("a-b_9", "", {})]


def test_parse_tools_takes_common_generated_schemas(byte_tok):
  # As pydantic writes them; `uniqueItems` is not implemented by llguidance: not enforced.
  params = {
      "$schema": "http://json-schema.org/draft-07/schema#", "title": "Args", "type": "object",
      "properties": {
          "a": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "A"},
          "b": {"$ref": "#/$defs/B"},
          "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
      "required": ["b"], "additionalProperties": False,
      "$defs": {"B": {"type": "object", "properties": {"x": {"type": "number"}}}}}
  tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": params,
                                                         "strict": False}}])
  g = tool_grammar(tools, "f", parallel=False)
  assert accepts(byte_tok, g, block("f", '{"b": {"x": 1.5}, "tags": ["t", "t"]}'))
  assert accepts(byte_tok, g, block("f", '{"a": null, "b": {}}'))
  assert not accepts(byte_tok, g, block("f", '{"b": {"x": "1"}}'))


def fn(**kw):
  return {"type": "function", "function": {"name": "f", **kw}}


@pytest.mark.parametrize("tools, param", [
    ({"type": "function"}, "tools"),
    ([fn(name=f"f{i}") for i in range(MAX_TOOLS + 1)], "tools"),
    (["get_weather"], "tools[0]"),
    ([{"type": "function", "function": {"name": "f"}, "extra": 1}], "tools[0].extra"),
    ([{"type": "code_interpreter", "function": {"name": "f"}}], "tools[0].type"),
    ([{"function": {"name": "f"}}], "tools[0].type"),
    ([{"type": "function", "function": "f"}], "tools[0].function"),
    ([fn(name="")], "tools[0].function.name"),
    ([fn(name="a b")], "tools[0].function.name"),
    ([fn(name="x" * 65)], "tools[0].function.name"),
    ([fn(name=3)], "tools[0].function.name"),
    ([NOARGS, WEATHER, NOARGS], "tools[2].function.name"),
    ([fn(description=["x"])], "tools[0].function.description"),
    ([fn(strict="yes")], "tools[0].function.strict"),
    ([fn(params={})], "tools[0].function.params"),
    ([WEATHER, fn(parameters="{}")], "tools[1].function.parameters"),
    ([WEATHER, fn(parameters={"type": "string"})], "tools[1].function.parameters"),
    ([WEATHER, fn(parameters={"type": "object", "properties": 3})],
     "tools[1].function.parameters"),
    ([fn(parameters={"type": "object", "properties": {"a": {"type": "foo"}}})],
     "tools[0].function.parameters"),
    ([fn(parameters={"type": "object", "properties": {"a": {"$ref": "#/nope"}}})],
     "tools[0].function.parameters"),
    ([fn(parameters={"type": "object", "properties": {"a": {"type": "string",
                                                            "pattern": "(["}}})],
     "tools[0].function.parameters"),
])
def test_parse_tools_refusals_name_the_field(tools, param):
  with pytest.raises(ToolError) as e:
    parse_tools(tools)
  assert e.value.param == param, str(e.value)
  assert isinstance(e.value, ValueError) and str(e.value)


def test_parse_tools_invalid_schema_message_says_why():
  bad = fn(parameters={"type": "object", "properties": {"a": {"$ref": "#/nope"}}})
  with pytest.raises(ToolError, match="not a valid JSON schema: .*nope"):
    parse_tools([bad])


# ------------------------------------------------------------------ parse_tool_choice


@pytest.mark.parametrize("choice, tools, expected", [
    (None, TOOLS, "auto"),
    (None, [], "none"),
    ("none", TOOLS, "none"),
    ("none", [], "none"),
    ("auto", TOOLS, "auto"),
    ("auto", [], "none"),
    ("required", TOOLS, "required"),
    ({"type": "function", "function": {"name": "search"}}, TOOLS, "search"),
])
def test_parse_tool_choice(choice, tools, expected):
  assert parse_tool_choice(choice, tools) == expected


@pytest.mark.parametrize("choice, tools", [
    ("required", []),
    ({"type": "function", "function": {"name": "search"}}, []),
    ({"type": "function", "function": {"name": "other"}}, TOOLS),
    ({"type": "function", "function": {}}, TOOLS),
    ({"type": "function", "function": "search"}, TOOLS),
    ({"type": "tool", "function": {"name": "search"}}, TOOLS),
    ({"function": {"name": "search"}}, TOOLS),
    ("any", TOOLS),
    ("search", TOOLS),
    (True, TOOLS),
    (["auto"], TOOLS),
])
def test_parse_tool_choice_refusals(choice, tools):
  with pytest.raises(ToolError) as e:
    parse_tool_choice(choice, tools)
  assert e.value.param == "tool_choice"


# ------------------------------------------------------------------ tool_grammar


WEATHER_CALL = block("get_weather", '{"city": "Paris"}')
SEARCH_CALL = block("search", '{"q": "jax \\"xla\\" }", "n": 3}')
NOW_CALL = block("now", "{}")


def test_tool_grammar_is_valid_lark_for_llguidance(byte_tok):
  for choice in ("required", "get_weather", "search", "now"):
    for parallel in (False, True):
      text = tool_grammar(TOOLS, choice, parallel)
      grammar = llguidance.LLMatcher.grammar_from_lark(text)
      assert llguidance.LLMatcher.validate_grammar(grammar, byte_tok[0]) == ""
      matcher(byte_tok, text)


def test_tool_grammar_required_takes_one_call_of_any_tool(byte_tok):
  g = tool_grammar(TOOLS, "required", parallel=False)
  for call in (WEATHER_CALL, SEARCH_CALL, NOW_CALL,
               block("get_weather", '{"city": "Nice", "unit": "c"}'),
               block("now", '{"anything": [1, 2]}')):
    assert accepts(byte_tok, g, call), call
  assert not accepts(byte_tok, g, WEATHER_CALL + "\n" + NOW_CALL)  # one call only
  assert not accepts(byte_tok, g, "")


def test_tool_grammar_parallel_takes_several_calls(byte_tok):
  g = tool_grammar(TOOLS, "required", parallel=True)
  assert accepts(byte_tok, g, WEATHER_CALL)
  assert accepts(byte_tok, g, WEATHER_CALL + "\n" + SEARCH_CALL + "\n" + WEATHER_CALL)
  assert not accepts(byte_tok, g, WEATHER_CALL + SEARCH_CALL)  # blocks are "\n"-separated
  assert not accepts(byte_tok, g, WEATHER_CALL + "\n")


def test_tool_grammar_named_takes_that_tool_only(byte_tok):
  g = tool_grammar(TOOLS, "search", parallel=True)
  assert accepts(byte_tok, g, SEARCH_CALL + "\n" + SEARCH_CALL)
  assert not accepts(byte_tok, g, WEATHER_CALL)
  assert not accepts(byte_tok, g, SEARCH_CALL + "\n" + WEATHER_CALL)
  with pytest.raises(ValueError):
    tool_grammar(TOOLS, "other", parallel=False)


@pytest.mark.parametrize("text", [
    block("get_wether", '{"city": "Paris"}'),                       # unknown name
    block("other", "{}"),
    block("get_weather", '{"city": 3}'),                             # wrong type
    block("get_weather", "{}"),                                      # missing required
    block("get_weather", '{"city": "P", "unit": "k"}'),              # not in the enum
    block("get_weather", '{"city": "P", "x": 1}'),                   # additionalProperties
    block("search", '{"q": "x", "n": 0}'),                           # minimum (via $ref'd)
    block("search", '{"q": "' + "x" * 21 + '", "n": 1}'),            # maxLength of the $def
    block("get_weather", '{"city":"Paris"}'),                        # not compact JSON
    block("get_weather", '{ "city": "Paris"}'),
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',      # no tags
    WEATHER_CALL.removesuffix("</tool_call>"),                       # no closing tag
    "<tool_call>" + WEATHER_CALL.removeprefix("<tool_call>\n"),      # no newline after the tag
    "Sure! " + WEATHER_CALL,                                         # text first
    '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>',
])
def test_tool_grammar_rejects(byte_tok, text):
  assert not accepts(byte_tok, tool_grammar(TOOLS, "required", parallel=True), text)


def test_tool_grammar_keeps_json_options_of_the_schema(byte_tok):
  schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "null"}}}
  compact = tool_grammar([ToolSpec("f", "", schema)], "f", parallel=False)
  assert accepts(byte_tok, compact, block("f", '{"a": 1, "b": null}'))
  assert not accepts(byte_tok, compact, block("f", '{"a":1,"b":null}'))
  schema = {**schema, "x-guidance": {"item_separator": ",", "key_separator": ":"}}
  own = tool_grammar([ToolSpec("f", "", schema)], "f", parallel=False)
  assert accepts(byte_tok, own, block("f", '{"a":1,"b":null}'))
  assert not accepts(byte_tok, own, block("f", '{"a": 1, "b": null}'))


def test_tool_grammar_output_parses_back(byte_tok):
  text = WEATHER_CALL + "\n" + SEARCH_CALL
  assert accepts(byte_tok, tool_grammar(TOOLS, "required", True), text)
  content, calls = parse_tool_calls(text, TOOLS)
  assert content is None
  assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
      ("get_weather", {"city": "Paris"}), ("search", {"q": 'jax "xla" }', "n": 3})]


# ------------------------------------------------------------------ prompts and templates


def test_render_tools_prompt():
  prompt = render_tools_prompt(TOOLS)
  assert "<tools>" in prompt and "</tools>" in prompt and "<tool_call>" in prompt
  lines = prompt.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
  assert [json.loads(line) for line in lines] == [t.to_openai() for t in TOOLS]
  for tool in TOOLS:
    assert tool.name in prompt
    assert json.dumps(tool.parameters) in prompt
  assert '{"name": <function-name>, "arguments": <args-json-object>}' in prompt


SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools' }}{%- for tool in tools %}"
    "{{- tool | tojson }}{%- endfor %}{%- endif %}"
    "{%- for message in messages %}{{ message.content }}{%- endfor %}")


def test_template_supports_tools():
  assert not template_supports_tools(None)
  assert not template_supports_tools("")
  assert not template_supports_tools(SMOLLM2_TEMPLATE)
  assert template_supports_tools(QWEN_LIKE_TEMPLATE)
  assert template_supports_tools("{% for t in tools %}{{ t }}{% endfor %}")
  assert template_supports_tools("{{ tools | tojson }}")
  assert not template_supports_tools("You have tools. {{ 'use the tools' }}{{ my_tools }}")


# ------------------------------------------------------------------ prepare_messages

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Nice?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Nice"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "name": "get_weather", "content": "21C"},
    {"role": "assistant", "content": "Paris 18C, Nice 21C."},
]


def test_prepare_messages_native():
  before = json.dumps(HISTORY)
  out = prepare_messages(HISTORY, TOOLS, native=True)
  assert json.dumps(HISTORY) == before  # not modified
  assert out[0] == HISTORY[0] and out[1] == HISTORY[1] and out[5] == HISTORY[5]
  assert out[2]["role"] == "assistant" and out[2]["content"] is None
  assert out[2]["tool_calls"] == [
      {"id": "call_1", "type": "function",
       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
      {"id": "call_2", "type": "function",
       "function": {"name": "get_weather", "arguments": {"city": "Nice"}}}]
  assert out[3] == {"role": "tool", "tool_call_id": "call_1", "content": "18C"}
  assert out[4] == HISTORY[4]


def test_prepare_messages_native_renders_with_a_tools_template():
  import jinja2
  template = jinja2.Environment().from_string(
      "{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}"
      "{%- for tc in m.tool_calls %}{%- set f = tc.function %}"
      '<tool_call>\n{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}'
      "\n</tool_call>\n{%- endfor %}{%- elif m.role == 'tool' %}"
      "<tool_response>{{ m.content }}</tool_response>\n"
      "{%- else %}{{ m.role }}: {{ m.content }}\n{%- endif %}{%- endfor %}")
  assert template_supports_tools(QWEN_LIKE_TEMPLATE)
  text = template.render(messages=prepare_messages(HISTORY, TOOLS, native=True))
  assert block("get_weather", '{"city": "Paris"}') in text
  assert block("get_weather", '{"city": "Nice"}') in text
  assert "<tool_response>18C</tool_response>" in text


def test_prepare_messages_text_only_template():
  out = prepare_messages(HISTORY, TOOLS, native=False)
  assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant"]
  assert all("tool_calls" not in m and "tool_call_id" not in m for m in out)
  assert out[0]["content"] == render_tools_prompt(TOOLS) + "\n\nBe brief."
  assert out[2]["content"] == (
      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nice"}}\n</tool_call>')
  assert out[3] == {"role": "user", "content": "<tool_response>\n18C\n</tool_response>\n"
                                               "<tool_response>\n21C\n</tool_response>"}
  assert out[4] == HISTORY[5]
  # The calls written into the history parse back as the calls.
  _, calls = parse_tool_calls(out[2]["content"], TOOLS)
  assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"},
                                                                     {"city": "Nice"}]


def test_prepare_messages_text_only_details():
  msgs = [{"role": "user", "content": "hi"},
          {"role": "assistant", "content": "Let me look.", "tool_calls": [
              {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
          {"role": "tool", "tool_call_id": "c", "content": "noon"},
          {"role": "user", "content": "and?"},
          {"role": "tool", "tool_call_id": "d", "content": None}]
  out = prepare_messages(msgs, TOOLS, native=False)
  assert out[0] == {"role": "system", "content": render_tools_prompt(TOOLS)}
  assert out[2]["content"] == ('Let me look.\n<tool_call>\n{"name": "now", "arguments": {}}'
                               "\n</tool_call>")
  assert out[3] == {"role": "user", "content": "<tool_response>\nnoon\n</tool_response>"}
  assert out[4] == {"role": "user", "content": "and?"}
  assert out[5] == {"role": "user", "content": "<tool_response>\n\n</tool_response>"}
  # Without tools no system prompt is added; an empty system message takes the prompt.
  assert prepare_messages(msgs[:2], [], native=False)[0] == msgs[0]
  out = prepare_messages([{"role": "system", "content": ""}, msgs[0]], TOOLS, native=False)
  assert out == [{"role": "system", "content": render_tools_prompt(TOOLS)}, msgs[0]]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("calls, param", [
    ([{"id": "c", "type": "function", "function": {"name": "now", "arguments": "{oops"}}],
     "messages[1].tool_calls[0].function.arguments"),
    ([{"id": "c", "type": "function", "function": {"name": "now", "arguments": "{}"}},
      {"id": "d", "type": "function", "function": {"name": "now", "arguments": "[1]"}}],
     "messages[1].tool_calls[1].function.arguments"),
    ([{"id": "c", "type": "function", "function": {"arguments": "{}"}}],
     "messages[1].tool_calls[0]"),
    ({"id": "c"}, "messages[1].tool_calls"),
])
def test_prepare_messages_bad_tool_calls(native, calls, param):
  msgs = [{"role": "user", "content": "hi"},
          {"role": "assistant", "content": None, "tool_calls": calls}]
  with pytest.raises(ToolError) as e:
    prepare_messages(msgs, TOOLS, native=native)
  assert e.value.param == param


# ------------------------------------------------------------------ parse_tool_calls


def test_parse_plain_text():
  assert parse_tool_calls("  Hello there.\n", TOOLS) == ("Hello there.", [])
  assert parse_tool_calls("", TOOLS) == ("", [])
  assert parse_tool_calls("a < b <tool", TOOLS) == ("a < b <tool", [])


def test_parse_several_calls_after_content():
  text = ("I'll check both.\n" + WEATHER_CALL + "\n" + SEARCH_CALL + "\n"
          + block("now", "{ }") + "\n")
  content, calls = parse_tool_calls(text, TOOLS)
  assert content == "I'll check both."
  assert [c["function"] for c in calls] == [
      {"name": "get_weather", "arguments": '{"city": "Paris"}'},
      {"name": "search", "arguments": '{"q": "jax \\"xla\\" }", "n": 3}'},
      {"name": "now", "arguments": "{ }"}]
  assert all(c["type"] == "function" and CALL_ID.fullmatch(c["id"]) for c in calls)
  assert len({c["id"] for c in calls}) == 3


def test_parse_keeps_the_raw_arguments_text():
  args = '{\n  "q": "</tool_call> {\\"a\\": [1, {}]} \\u00e9 é 😀",\n  "n": -1.5e+3\n}'
  content, calls = parse_tool_calls(block("search", args), TOOLS)
  assert content is None
  assert calls[0]["function"]["arguments"] == args
  assert json.loads(args)["q"] == '</tool_call> {"a": [1, {}]} é é 😀'


@pytest.mark.parametrize("text", [
    "<tool_call>\nnot json\n</tool_call>",
    "<tool_call>\n[1, 2]\n</tool_call>",
    '<tool_call>\n{"arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "name": "now", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "nope", "arguments": {"city": "Paris"}}\n</tool_call>',  # unknown
    '<tool_call>\n{"name": "get_weather", "argu',  # cut before the arguments start
    '<tool_call>\n{"name": "get_weather", "arguments": ]}\n</tool_call>',
])
def test_parse_invalid_blocks_stay_content(text):
  assert parse_tool_calls(text, TOOLS) == (text, [])


def test_parse_unknown_tool_is_a_call_without_a_tool_list():
  text = block("nope", "{}")
  assert parse_tool_calls(text, TOOLS) == (text, [])
  content, calls = parse_tool_calls(text)
  assert content is None and calls[0]["function"] == {"name": "nope", "arguments": "{}"}


def test_parse_invalid_block_then_valid_one():
  bad = '<tool_call>\n{"name": "nope"}\n</tool_call>'
  content, calls = parse_tool_calls(f"x {bad}\n{NOW_CALL} y", TOOLS)
  assert content == f"x {bad}\n y"
  assert [c["function"]["name"] for c in calls] == ["now"]
  # A block that is not JSON, then a real one inside it.
  content, calls = parse_tool_calls("<tool_call>\n" + NOW_CALL, TOOLS)
  assert content == "<tool_call>" and [c["function"]["name"] for c in calls] == ["now"]


def test_parse_unterminated_blocks():
  cut = WEATHER_CALL.removesuffix("\n</tool_call>")
  for text in (cut, cut + "\n", cut + "\n</tool_c"):
    content, calls = parse_tool_calls(text, TOOLS)
    assert content is None, text
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
  # Cut inside the arguments (max_tokens): the call was already streamed, so it stays, with
  # the arguments written so far.
  content, calls = parse_tool_calls(WEATHER_CALL[:WEATHER_CALL.index("ris")], TOOLS)
  assert content is None and calls[0]["function"]["arguments"] == '{"city": "Pa'
  # Cut before the call could start: text.
  assert parse_tool_calls('Hi <tool_call>\n{"name": "get_w', TOOLS) == (
      'Hi <tool_call>\n{"name": "get_w', [])


def test_parse_other_shapes():
  # Arguments first, missing arguments, extra keys, a missing closing tag, text after.
  content, calls = parse_tool_calls(
      '<tool_call>{"arguments": {"city": "X"}, "name": "get_weather"}</tool_call>'
      '<tool_call> {"name": "now", "id": [1, {"a": "}"}]} </tool_call>'
      '<tool_call>\n{"name": "now", "arguments": {}}\nThat is all.', TOOLS)
  assert content == "That is all."
  assert [c["function"] for c in calls] == [
      {"name": "get_weather", "arguments": '{"city": "X"}'},
      {"name": "now", "arguments": "{}"}, {"name": "now", "arguments": "{}"}]
  # Malformed arguments after the call started: the call keeps what was read, the rest of the
  # block is dropped.
  content, calls = parse_tool_calls(
      block("get_weather", '{"city": Paris}') + " done", TOOLS)
  assert content == "done" and calls[0]["function"]["arguments"] == '{"city": '


# ------------------------------------------------------------------ streaming


def stream(text: str, cuts: list[int], tools=TOOLS):
  """Feeds `text` cut at `cuts`; (content, {index: (id, name, arguments)}, parser, deltas)."""
  parser = ToolCallStreamParser(tools)
  bounds = [0, *sorted(set(cuts)), len(text)]
  deltas = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
  deltas.append(parser.finish())
  content, calls = "", {}
  for d in deltas:
    assert set(d) <= {"content", "tool_calls"}
    if "content" in d:
      assert d["content"]
      content += d["content"]
    seen = set()
    for tc in d.get("tool_calls", ()):
      i = tc["index"]
      assert i not in seen
      seen.add(i)
      if "id" in tc:  # the first chunk of a call
        assert i == len(calls) and tc["type"] == "function"
        assert set(tc["function"]) == {"name", "arguments"}
        calls[i] = (tc["id"], tc["function"]["name"], tc["function"]["arguments"])
      else:
        assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
        assert tc["function"]["arguments"]
        cid, name, args = calls[i]
        calls[i] = (cid, name, args + tc["function"]["arguments"])
  return content, calls, parser, deltas


def assert_stream_matches(text: str, cuts: list[int], tools=TOOLS):
  content, calls = parse_tool_calls(text, tools)
  s_content, s_calls, parser, _ = stream(text, cuts, tools)
  assert s_content == (content or "")
  assert [(n, a) for _, n, a in s_calls.values()] == [
      (c["function"]["name"], c["function"]["arguments"]) for c in calls]
  assert [cid for cid, _, _ in s_calls.values()] == [c["id"] for c in parser.calls]
  assert [c["function"] for c in parser.calls] == [c["function"] for c in calls]


def test_stream_deltas_character_by_character():
  text = "Checking.\n" + block("get_weather", '{"city": "P"}') + "\n" + NOW_CALL
  _, _, parser, deltas = stream(text, list(range(len(text))))
  nonempty = [d for d in deltas if d]
  assert "".join(d["content"] for d in nonempty if "content" in d) == "Checking."
  calls = [d["tool_calls"][0] for d in nonempty if "tool_calls" in d]
  ids = [c["id"] for c in parser.calls]
  assert calls[0] == {"index": 0, "id": ids[0], "type": "function",
                      "function": {"name": "get_weather", "arguments": "{"}}
  assert [c["function"]["arguments"] for c in calls[1:13]] == list('"city": "P"}')
  assert calls[13:] == [{"index": 1, "id": ids[1], "type": "function",
                        "function": {"name": "now", "arguments": "{"}},
                       {"index": 1, "function": {"arguments": "}"}}]
  assert all(CALL_ID.fullmatch(i) for i in ids)


def test_stream_holds_back_a_possible_tag():
  p = ToolCallStreamParser(TOOLS)
  assert p.feed("Hello <tool") == {"content": "Hello"}
  assert p.feed("_ca") == {}
  assert p.feed("r is here ") == {"content": " <tool_car is here"}
  assert p.feed("<") == {}
  assert p.feed("b>") == {"content": " <b>"}
  assert p.feed("<tool_c") == {}
  assert p.finish() == {"content": "<tool_c"}


def test_stream_whole_call_in_one_delta():
  p = ToolCallStreamParser(TOOLS)
  d = p.feed("Ok. " + WEATHER_CALL + "\n" + NOW_CALL)
  assert d["content"] == "Ok."
  assert [t["function"] for t in d["tool_calls"]] == [
      {"name": "get_weather", "arguments": '{"city": "Paris"}'},
      {"name": "now", "arguments": "{}"}]
  assert [t["index"] for t in d["tool_calls"]] == [0, 1]
  assert p.finish() == {}


def test_stream_half_finished_call_becomes_content_if_nothing_was_sent():
  p = ToolCallStreamParser(TOOLS)
  assert p.feed('<tool_call>\n{"name": "get_weather", ') == {}
  assert p.finish() == {"content": '<tool_call>\n{"name": "get_weather",'}
  assert p.calls == []


@pytest.mark.parametrize("text", [
    "", "plain", WEATHER_CALL, "a\n" + WEATHER_CALL + "\n" + SEARCH_CALL + "\nb",
    "<tool_call>\nnot json\n</tool_call>", WEATHER_CALL[:-25], WEATHER_CALL[:25],
])
def test_stream_equals_whole_every_single_cut(text):
  for cut in range(len(text) + 1):
    assert_stream_matches(text, [cut])


# Random outputs: text, well-formed calls of any JSON arguments (strings with braces,
# escapes, tags, unicode), malformed blocks; optionally cut short; fed in random chunks.
_TEXT_PIECES = ["<tool_call>", "</tool_call>", "<tool_", "<", ">", "\n", " ", "{", "}", '"',
                "\\", "a", "é", "😀", "tool", "<tool_call", "call>"]
_STRINGS = st.lists(st.sampled_from([*"ab {}[]\"\\/<>:,\n\t", "é", "😀", "\u2028",
                                     "</tool_call>", "<tool_call>", "\x00"]),
                    max_size=8).map("".join)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6)
    | st.floats(allow_nan=False, allow_infinity=False) | _STRINGS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_STRINGS, inner, max_size=3),
    max_leaves=8)


@st.composite
def _call_text(draw) -> str:
  name = draw(st.sampled_from(["get_weather", "search", "now", "nope"]))
  args = draw(st.dictionaries(_STRINGS, _JSON, max_size=3) | _JSON)
  dumped = json.dumps(args, ensure_ascii=draw(st.booleans()),
                      indent=draw(st.sampled_from([None, None, 2])),
                      separators=draw(st.sampled_from([None, (",", ":")])))
  ws = draw(st.sampled_from(["", "\n", " ", "\n\n"]))
  name_json = json.dumps(name)
  body = draw(st.sampled_from([
      f'{{"name": {name_json}, "arguments": {dumped}}}',
      f'{{"arguments": {dumped},{ws}"name": {name_json}}}',
      f'{{"name": {name_json}}}',
      f'{{"name":{name_json},"extra":{dumped},"arguments":{dumped}}}',
  ]))
  end = draw(st.sampled_from(["\n</tool_call>", "</tool_call>", "", "\n</tool_c", "\n"]))
  return f"<tool_call>{ws}{body}{end}"


@st.composite
def _output(draw) -> str:
  parts = draw(st.lists(
      st.one_of(st.lists(st.sampled_from(_TEXT_PIECES), max_size=6).map("".join),
                _call_text(),
                _call_text().map(lambda t: t[:len(t) // 2] + "x" + t[len(t) // 2:])),
      max_size=5))
  text = "".join(parts)
  if draw(st.booleans()):
    text = text[:draw(st.integers(0, len(text)))]
  return text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_stream_equals_whole_any_chunking(data):
  text = data.draw(_output())
  cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
  assert_stream_matches(text, cuts)
  assert_stream_matches(text, cuts, tools=None)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["get_weather", "search", "now"]),
                          st.dictionaries(_STRINGS, _JSON, max_size=3),
                          st.sampled_from([None, 2])), min_size=1, max_size=3),
       st.sampled_from(["", "Let me see. ", "x\n\n"]))
def test_well_formed_calls_parse_exactly(calls, before):
  dumped = [json.dumps(args, indent=indent, ensure_ascii=False) for _, args, indent in calls]
  text = before + "\n".join(block(n, d) for (n, _, _), d in zip(calls, dumped, strict=True))
  content, parsed = parse_tool_calls(text, TOOLS)
  assert content == (before.strip() or None)
  assert [c["function"]["name"] for c in parsed] == [n for n, _, _ in calls]
  assert [c["function"]["arguments"] for c in parsed] == dumped
  assert [json.loads(c["function"]["arguments"]) for c in parsed] == [a for _, a, _ in calls]
