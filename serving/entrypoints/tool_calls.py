"""OpenAI tool calling for chat completions, in the Hermes / Qwen2.5 format.

The model calls tools by writing one block per call, possibly several in a row,
after optional ordinary text:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Request side: `parse_tools` and `parse_tool_choice` validate the OpenAI `tools`
and `tool_choice` fields (`ToolError` names the field). `prepare_messages`
turns the conversation into what the chat template can render: as
`transformers` expects (`native`, the template handles `tools` itself, see
`template_supports_tools`), or for a template without tool support, where the
tools go into the system message as this section (`render_tools_prompt`):

    # Tools

    You may call one or more functions to assist with the user query.

    You are provided with function signatures within <tools></tools> XML tags:
    <tools>
    {"type": "function", "function": {"name": ..., "description": ..., "parameters": ...}}
    ...one line per tool...
    </tools>

    For each function call, return a json object with function name and arguments within
    <tool_call></tool_call> XML tags:
    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

and earlier calls and their results become text: an assistant's calls are
appended to its content as the blocks above, a tool's result is a user message
`<tool_response>\\n...\\n</tool_response>` (consecutive results in one message).

`tool_choice` "required" or a named function constrains decoding with
`tool_grammar` (a Lark grammar for llguidance, arguments following each tool's
JSON schema, compact JSON as `structured_outputs` makes it).

Response side: `ToolCallStreamParser` reads the output as it streams and gives
the OpenAI delta fields (`content`, `tool_calls`); `parse_tool_calls` is the
same parser run over the whole text, so a stream and a full response always
agree. How the parser reads a block:

* A call is committed (its id and name go out) when the block's JSON object has
  a valid name (a string; one of `tools` when given) and the `arguments` value
  starts, or when the object closes with a name but no arguments (`"{}"`).
  Keys may come in any order; other keys are skipped.
* `arguments` is the raw JSON text of the value as the model wrote it, streamed
  a character at a time as it arrives (never the object's closing brace nor
  the closing tag).
* A block that goes wrong before its call is committed (not JSON, no name, an
  unknown tool, cut off by the end of the output) stays in the content as text.
  One that goes wrong after (malformed arguments, cut off by max_tokens) keeps
  the call with the arguments read so far; the rest of the block up to
  `</tool_call>` is dropped. A missing `</tool_call>` after a complete object
  just ends the call; what follows is text again.
* Content is the text outside the blocks with leading and trailing whitespace
  removed (the stream holds back whitespace until more text follows it), and
  text that may be the start of `<tool_call>` is held back until it is certain.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import Any

import llguidance

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
MAX_TOOLS = 128

# JSON as `serving/structured_output/backend_guidance.py` generates it: compact, canonical.
# Lenient: keywords llguidance does not implement (`uniqueItems`, ...) are not enforced rather
# than refusing the tool (OpenAI takes them outside strict mode).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                 "lenient": True}
_NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


class ToolError(ValueError):
  """A bad `tools` / `tool_choice` / `messages` field; `param` names it."""

  def __init__(self, message: str, param: str | None = None):
    super().__init__(message)
    self.message, self.param = message, param


@dataclasses.dataclass(frozen=True)
class ToolSpec:
  """One function tool. `parameters`: its arguments' JSON schema."""

  name: str
  description: str
  parameters: dict

  def to_openai(self) -> dict[str, Any]:
    """The tool as an OpenAI `tools` item (what chat templates are given)."""
    return {"type": "function", "function": {"name": self.name, "description": self.description,
                                             "parameters": self.parameters}}


# ------------------------------------------------------------------ request side


def parse_tools(tools: Any) -> list[ToolSpec]:
  """Validates the OpenAI `tools` list (see module doc); ToolError naming the field."""
  if tools is None:
    return []
  if not isinstance(tools, list):
    raise ToolError("tools must be a list", "tools")
  if len(tools) > MAX_TOOLS:
    raise ToolError(f"at most {MAX_TOOLS} tools are supported, got {len(tools)}", "tools")
  specs: list[ToolSpec] = []
  seen: set[str] = set()
  for i, tool in enumerate(tools):
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
      raise ToolError(f"{where} must be an object", where)
    for key in tool:
      if key not in _TOOL_KEYS:
        raise ToolError(f"{where}.{key} is not a known field", f"{where}.{key}")
    if tool.get("type") != "function":
      raise ToolError(f"{where}.type must be 'function'", f"{where}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
      raise ToolError(f"{where}.function must be an object", f"{where}.function")
    where += ".function"
    for key in fn:
      if key not in _FUNCTION_KEYS:
        raise ToolError(f"{where}.{key} is not a known field", f"{where}.{key}")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
      raise ToolError(f"{where}.name must be 1 to 64 letters, digits, '_' or '-'",
                      f"{where}.name")
    if name in seen:
      raise ToolError(f"{where}.name: duplicate tool name {name!r}", f"{where}.name")
    seen.add(name)
    description = fn.get("description")
    if description is None:
      description = ""
    elif not isinstance(description, str):
      raise ToolError(f"{where}.description must be a string", f"{where}.description")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
      raise ToolError(f"{where}.strict must be a boolean", f"{where}.strict")
    params = fn.get("parameters")
    if params is None:
      params = {"type": "object", "properties": {}}
    else:
      _check_parameters(params, f"{where}.parameters")
    specs.append(ToolSpec(name, description, params))
  return specs


def _check_parameters(params: Any, where: str) -> None:
  if not isinstance(params, dict):
    raise ToolError(f"{where} must be a JSON schema object", where)
  if "type" in params and params["type"] != "object":
    raise ToolError(f"{where} must be a JSON schema of type 'object', got "
                    f"{json.dumps(params['type'])}", where)
  try:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(params, defaults=_JSON_OPTIONS)
    error = llguidance.LLMatcher.validate_grammar(grammar)
  except (ValueError, TypeError) as e:
    error = str(e)
  if error:
    raise ToolError(f"{where} is not a valid JSON schema: {error.strip()}", where)


def parse_tool_choice(tool_choice: Any, tools: list[ToolSpec]) -> str:
  """`tool_choice` -> "none", "auto", "required" or the name of the function to call.

  Absent (None), it is "auto" when there are tools and "none" when there are
  not, as OpenAI does; "auto" without tools is "none" too.
  """
  if tool_choice is None or tool_choice == "auto":
    return "auto" if tools else "none"
  if tool_choice == "none":
    return "none"
  if tool_choice == "required":
    if not tools:
      raise ToolError("tool_choice 'required' needs tools", "tool_choice")
    return "required"
  if isinstance(tool_choice, dict):
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if (tool_choice.get("type") != "function" or set(tool_choice) != {"type", "function"}
        or not isinstance(name, str) or set(fn) != {"name"}):
      raise ToolError("tool_choice must be 'none', 'auto', 'required' or "
                      '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in {t.name for t in tools}:
      raise ToolError(f"tool_choice names function {name!r}, which is not among the tools",
                      "tool_choice")
    return name
  raise ToolError("tool_choice must be 'none', 'auto', 'required' or "
                  '{"type": "function", "function": {"name": ...}}', "tool_choice")


def tool_grammar(tools: list[ToolSpec], choice: str, parallel: bool) -> str:
  """A Lark grammar (llguidance's dialect) for one (or, `parallel`, one or more) tool-call
  blocks, separated by "\\n": any of `tools` for `choice` "required", else the tool named
  `choice`. Each call is `{"name": "<name>", "arguments": <JSON by its schema>}`; compile
  with `llguidance.LLMatcher.grammar_from_lark`."""
  if choice == "required":
    chosen = list(tools)
  else:
    chosen = [t for t in tools if t.name == choice]
    if not chosen:
      raise ValueError(f"tool_grammar: no tool named {choice!r}")
  if not chosen:
    raise ValueError("tool_grammar: no tools")
  lines = ["start: call" + (' ("\\n" call)*' if parallel else ""),
           "call: " + " | ".join(f"call_{i}" for i in range(len(chosen)))]
  for i, tool in enumerate(chosen):
    head = f'{TOOL_CALL_START}\n{{"name": {json.dumps(tool.name)}, "arguments": '
    schema = dict(tool.parameters)
    xg = schema.get("x-guidance")
    schema["x-guidance"] = {**_JSON_OPTIONS, **(xg if isinstance(xg, dict) else {})}
    lines.append(f"call_{i}: {json.dumps(head)} %json {json.dumps(schema)} "
                 f"{json.dumps('}' + chr(10) + TOOL_CALL_END)}")
  return "\n".join(lines) + "\n"


def render_tools_prompt(tools: list[ToolSpec]) -> str:
  """The system-prompt section describing `tools` (see the module doc)."""
  sigs = "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in tools)
  return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
          "You are provided with function signatures within <tools></tools> XML tags:\n"
          f"<tools>\n{sigs}\n</tools>\n\n"
          "For each function call, return a json object with function name and arguments "
          "within <tool_call></tool_call> XML tags:\n"
          '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
          "</tool_call>")


_JINJA_TAG = re.compile(r"\{[{%](.*?)[}%]\}", re.S)
_JINJA_STRING = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.S)
_TOOLS_WORD = re.compile(r"\btools\b")


def template_supports_tools(chat_template: str | None) -> bool:
  """Whether the jinja chat template uses the `tools` variable (outside string literals)."""
  if not chat_template:
    return False
  return any(_TOOLS_WORD.search(_JINJA_STRING.sub("", m.group(1)))
             for m in _JINJA_TAG.finditer(chat_template))


def prepare_messages(messages: list[dict], tools: list[ToolSpec], native: bool) -> list[dict]:
  """OpenAI chat messages -> messages for the chat template (see the module doc).

  `native`: the template renders tools and tool calls itself (arguments are
  given to it as dicts); else they become text and the tools a system prompt.
  The input is not modified.
  """
  out: list[dict] = []
  responses: dict | None = None  # the user message holding the last tool results
  for i, msg in enumerate(messages):
    msg = dict(msg)
    calls = msg.pop("tool_calls", None)
    if calls is not None and msg.get("role") == "assistant":
      parsed = _parse_history_calls(calls, i)
      if native:
        msg["tool_calls"] = [{**c, "function": {**c["function"], "arguments": args}}
                             for c, args in parsed]
      else:
        blocks = "\n".join(
            f"{TOOL_CALL_START}\n"
            f"{json.dumps({'name': c['function']['name'], 'arguments': args}, ensure_ascii=False)}"
            f"\n{TOOL_CALL_END}" for c, args in parsed)
        text = _text_of(msg.get("content"))
        msg["content"] = f"{text}\n{blocks}" if text and blocks else text or blocks
    elif calls is not None:
      raise ToolError("only assistant messages may have tool_calls", f"messages[{i}].tool_calls")
    if msg.get("role") == "tool" and not native:
      response = f"<tool_response>\n{_text_of(msg.get('content'))}\n</tool_response>"
      if responses is not None and out and out[-1] is responses:
        responses["content"] += "\n" + response
      else:
        responses = {"role": "user", "content": response}
        out.append(responses)
      continue
    out.append(msg)
  if tools and not native:
    prompt = render_tools_prompt(tools)
    if out and out[0].get("role") == "system":
      content = out[0].get("content")
      if isinstance(content, list):
        out[0]["content"] = [{"type": "text", "text": prompt + "\n\n"}, *content]
      else:
        out[0]["content"] = f"{prompt}\n\n{content}" if content else prompt
    else:
      out.insert(0, {"role": "system", "content": prompt})
  return out


def _parse_history_calls(calls: Any, i: int) -> list[tuple[dict, Any]]:
  """An assistant message's `tool_calls` -> [(call, arguments parsed)]."""
  where = f"messages[{i}].tool_calls"
  if not isinstance(calls, list):
    raise ToolError(f"{where} must be a list", where)
  parsed = []
  for j, call in enumerate(calls):
    at = f"{where}[{j}]"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
      raise ToolError(f"{at} must be {{\"type\": \"function\", \"function\": "
                      "{\"name\": ..., \"arguments\": ...}}", at)
    args = fn.get("arguments")
    if isinstance(args, str):
      try:
        args = json.loads(args)
      except ValueError as e:
        raise ToolError(f"{at}.function.arguments is not valid JSON: {e}",
                        f"{at}.function.arguments") from None
    if not isinstance(args, dict):
      raise ToolError(f"{at}.function.arguments must be a JSON object",
                      f"{at}.function.arguments")
    parsed.append((call, args))
  return parsed


def _text_of(content: Any) -> str:
  """A message's content as text (None -> "", text parts joined)."""
  if content is None:
    return ""
  if isinstance(content, list):
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))
  return str(content)


# ------------------------------------------------------------------ response side


def parse_tool_calls(text: str, tools: list[ToolSpec] | None = None
                     ) -> tuple[str | None, list[dict]]:
  """A whole output -> (content, OpenAI tool_calls); content is None when empty and there
  are calls. Read exactly as `ToolCallStreamParser` reads a stream (module doc)."""
  parser = ToolCallStreamParser(tools)
  first, last = parser.feed(text), parser.finish()
  content = (first.get("content", "") + last.get("content", "")).strip()
  calls = parser.calls
  return (content or None) if calls else content, calls


_WS = " \t\n\r"
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
_NUMBER_ENDS = ("zero", "int", "frac", "exp")


class _JsonScanner:
  """Recognises one JSON value a character at a time (strictly, as `json.loads` does).

  `feed(ch)`: 1 consumed (part of the value), 0 the value ended before `ch` (a
  number; `ch` not consumed), -1 not JSON. `done` once the value is complete.
  """

  __slots__ = ("stack", "state", "literal", "hex_left", "in_key", "done")

  def __init__(self):
    self.stack: list[str] = []
    self.state = "value"
    self.literal = ""
    self.hex_left = 0
    self.in_key = False
    self.done = False

  @property
  def is_string(self) -> bool:
    return self.state in ("str", "esc", "hex") and not self.stack

  def feed(self, ch: str) -> int:
    while True:
      if self.done:
        return 0
      st = self.state
      if st == "str":
        if ch == '"':
          if self.in_key:
            self.in_key, self.state = False, "colon"
          else:
            self._value_end()
          return 1
        if ch == "\\":
          self.state = "esc"
          return 1
        return 1 if ch >= " " else -1
      if st == "esc":
        if ch == "u":
          self.state, self.hex_left = "hex", 4
          return 1
        if ch in '"\\/bfnrt':
          self.state = "str"
          return 1
        return -1
      if st == "hex":
        if ch not in _HEX:
          return -1
        self.hex_left -= 1
        if not self.hex_left:
          self.state = "str"
        return 1
      if st in ("value", "value_or_close"):
        if ch in _WS and self.stack:
          return 1
        if ch == "]" and st == "value_or_close":
          return self._close()
        return self._start_value(ch)
      if st in ("key", "key_or_close"):
        if ch in _WS:
          return 1
        if ch == '"':
          self.state, self.in_key = "str", True
          return 1
        if ch == "}" and st == "key_or_close":
          return self._close()
        return -1
      if st == "colon":
        if ch in _WS:
          return 1
        if ch == ":":
          self.state = "value"
          return 1
        return -1
      if st == "after":
        if ch in _WS:
          return 1
        if ch == ",":
          self.state = "key" if self.stack[-1] == "{" else "value"
          return 1
        if ch == ("}" if self.stack[-1] == "{" else "]"):
          return self._close()
        return -1
      if st == "literal":
        if ch != self.literal[0]:
          return -1
        self.literal = self.literal[1:]
        if not self.literal:
          self._value_end()
        return 1
      nxt = self._number(st, ch)
      if nxt:
        self.state = nxt
        return 1
      if st not in _NUMBER_ENDS:
        return -1
      self._value_end()  # the number ended before `ch`: read `ch` after it

  @staticmethod
  def _number(st: str, ch: str) -> str | None:
    """The number state after `ch`, or None if `ch` does not continue the number."""
    if st == "minus":
      return "zero" if ch == "0" else "int" if ch in _DIGITS else None
    if st in ("int", "frac", "exp", "dot", "esign") and ch in _DIGITS:
      return {"dot": "frac", "esign": "exp"}.get(st, st)
    if st in ("zero", "int") and ch == ".":
      return "dot"
    if st in ("zero", "int", "frac") and ch in "eE":
      return "e"
    if st == "e":
      return "esign" if ch in "+-" else "exp" if ch in _DIGITS else None
    return None

  def _start_value(self, ch: str) -> int:
    if ch == "{":
      self.stack.append("{")
      self.state = "key_or_close"
    elif ch == "[":
      self.stack.append("[")
      self.state = "value_or_close"
    elif ch == '"':
      self.state = "str"
    elif ch == "-":
      self.state = "minus"
    elif ch in _DIGITS:
      self.state = "zero" if ch == "0" else "int"
    elif ch in "tfn":
      self.state, self.literal = "literal", {"t": "rue", "f": "alse", "n": "ull"}[ch]
    else:
      return -1
    return 1

  def _close(self) -> int:
    self.stack.pop()
    self._value_end()
    return 1

  def _value_end(self) -> None:
    if self.stack:
      self.state = "after"
    else:
      self.done = True


class ToolCallStreamParser:
  """Splits a streamed output into content and tool calls (see the module doc).

  `feed` each text delta, then `finish` once; each returns the OpenAI chat delta
  fields for it (`{}` when there is nothing to send yet).
  """

  def __init__(self, tools: list[ToolSpec] | None = None):
    self._tools = None if tools is None else {t.name for t in tools}
    self._mode = "text"        # "text", "block" (inside <tool_call>) or "skip" (to </tool_call>)
    self._hold = ""            # text mode: a possible start of <tool_call>
    self._ws = ""              # whitespace held until more content follows
    self._started = False      # some content was sent
    self._calls: list[dict] = []
    self._args: list[list[str]] = []
    self._out_content: list[str] = []
    self._out_calls: dict[int, dict] = {}
    self._out_args: dict[int, list[str]] = {}
    self._skip_tail = ""
    self._reset_block()

  @property
  def calls(self) -> list[dict]:
    """The tool calls so far, in their final (non-streaming) OpenAI form."""
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["function"]["name"], "arguments": "".join(args)}}
            for c, args in zip(self._calls, self._args, strict=True)]

  def feed(self, delta: str) -> dict:
    """The delta fields (`content`, `tool_calls`) for the next piece of output text."""
    self._run(delta)
    return self._take()

  def finish(self) -> dict:
    """The delta fields for the end of the output: what was held back, or a cut-off block."""
    if self._mode == "text":
      self._text(self._hold)
    elif self._mode == "block" and not self._committed:
      self._text("".join(self._raw))
    self._mode, self._hold, self._ws, self._skip_tail = "text", "", "", ""
    self._reset_block()
    return self._take()

  # ---- driving

  def _run(self, s: str) -> None:
    while s:
      if self._mode == "text":
        buf, self._hold = self._hold + s, ""
        j = buf.find(TOOL_CALL_START)
        if j < 0:
          k = _partial_start(buf)
          self._text(buf[:k])
          self._hold = buf[k:]
          return
        self._text(buf[:j])
        self._mode = "block"
        self._reset_block()
        s = buf[j + len(TOOL_CALL_START):]
        continue
      for n, ch in enumerate(s):
        if self._mode == "block":
          if not self._committed:
            self._raw.append(ch)
          replay = self._block_char(ch)
        else:
          self._skip_tail = (self._skip_tail + ch)[-len(TOOL_CALL_END):]
          replay = "" if self._skip_tail == TOOL_CALL_END else None
          if replay is not None:
            self._mode, self._skip_tail = "text", ""
        if replay is not None:  # the mode changed: read `replay`, then the rest, in the new one
          s = replay + s[n + 1:]
          break
      else:
        return

  def _take(self) -> dict:
    out: dict[str, Any] = {}
    if self._out_content:
      out["content"] = "".join(self._out_content)
    if self._out_calls or self._out_args:
      deltas = []
      for index in sorted(set(self._out_calls) | set(self._out_args)):
        piece = "".join(self._out_args.get(index, ()))
        if index in self._out_calls:
          head = self._out_calls[index]
          deltas.append({**head, "function": {**head["function"], "arguments": piece}})
        else:
          deltas.append({"index": index, "function": {"arguments": piece}})
      out["tool_calls"] = deltas
    self._out_content, self._out_calls, self._out_args = [], {}, {}
    return out

  def _text(self, s: str) -> None:
    """Content out, without leading or (until more follows) trailing whitespace."""
    if not self._started:
      s = s.lstrip()
    body = s.rstrip()
    if not body:
      self._ws += s
      return
    self._out_content.append(self._ws + body)
    self._ws, self._started = s[len(body):], True

  # ---- calls

  def _commit(self) -> None:
    index = len(self._calls)
    call = {"id": "call_" + secrets.token_hex(12), "type": "function",
            "function": {"name": self._name, "arguments": ""}}
    self._calls.append(call)
    self._args.append([])
    self._out_calls[index] = {"index": index, **call, "function": dict(call["function"])}
    self._committed = True

  def _emit_args(self, piece: str) -> None:
    if piece:
      index = len(self._calls) - 1
      self._args[index].append(piece)
      self._out_args.setdefault(index, []).append(piece)

  # ---- inside a block

  def _reset_block(self) -> None:
    self._raw = [TOOL_CALL_START]  # the block's text while its call is not committed
    self._state = "open"
    self._committed = False
    self._pairs = 0
    self._key: str | None = None
    self._scan = _JsonScanner()
    self._target = ""              # what the value being read is: "name", "arguments", "other"
    self._value: list[str] = []
    self._name: str | None = None
    self._args_text: str | None = None  # arguments read before the name
    self._end: list[str] = []      # whitespace and the part of </tool_call> read
    self._end_at = 0               # how much of </tool_call> was read

  def _fail(self, ch: str, consumed: bool) -> str:
    """The block went wrong at `ch`: returns the text to read next, in the new mode."""
    if not self._committed:  # it was never a call: its text is content
      self._mode = "text"
      self._text("".join(self._raw if consumed else self._raw[:-1]))
    else:  # a call already sent: drop the rest of the block
      self._mode, self._skip_tail = "skip", ""
    self._reset_block()
    return "" if consumed else ch

  def _block_char(self, ch: str) -> str | None:
    """Reads one character of a block; a string (to read next) when the mode changes."""
    st = self._state
    if st in ("open", "key", "colon", "after", "value0") and ch in _WS:
      return None
    if st == "open":
      if ch != "{":
        return self._fail(ch, False)
      self._state = "key"
      return None
    if st == "key":
      if ch == "}" and not self._pairs:
        return self._close_object(ch)
      if ch != '"':
        return self._fail(ch, False)
      self._scan, self._value, self._state = _JsonScanner(), [], "key_str"
    if st in ("key", "key_str"):
      if self._scan.feed(ch) != 1:
        return self._fail(ch, False)
      self._value.append(ch)
      if self._scan.done:
        self._key, self._state = json.loads("".join(self._value)), "colon"
      return None
    if st == "colon":
      if ch != ":":
        return self._fail(ch, False)
      self._state = "value0"
      return None
    if st == "value0":
      self._scan, self._value = _JsonScanner(), []
      if self._scan.feed(ch) != 1:
        return self._fail(ch, False)
      self._pairs += 1
      self._state = "value"
      if self._key == "name" and self._name is None and not self._committed:
        self._target = "name"
        if not self._scan.is_string:
          return self._fail(ch, False)
      elif self._key == "arguments" and self._args_text is None and not self._committed:
        self._target = "arguments"
        if self._name is not None:
          self._commit()
      elif self._key in ("name", "arguments") and not self._committed:
        return self._fail(ch, False)  # a second name or arguments
      else:
        self._target = "other"
      self._take_value_char(ch)
      return None
    if st == "value":
      r = self._scan.feed(ch)
      if r < 0:
        return self._fail(ch, False)
      if r > 0:
        self._take_value_char(ch)
        if not self._scan.done:
          return None
      replay = self._value_done(ch, consumed=r > 0)
      if replay is not None or r > 0:
        return replay
      return self._block_char(ch)  # `ch` came after a number: read it in the new state
    if st == "after":
      if ch == ",":
        self._state = "key"
        return None
      if ch == "}":
        return self._close_object(ch)
      return self._fail(ch, False)
    # st == "end": whitespace, then </tool_call>
    if self._end_at == 0 and ch in _WS:
      self._end.append(ch)
      return None
    if ch == TOOL_CALL_END[self._end_at]:
      self._end.append(ch)
      self._end_at += 1
      if self._end_at < len(TOOL_CALL_END):
        return None
      self._mode = "text"
      self._reset_block()
      return ""
    replay = "".join(self._end) + ch  # no closing tag: the call ends, this is text again
    self._mode = "text"
    self._reset_block()
    return replay

  def _take_value_char(self, ch: str) -> None:
    if self._target == "arguments" and self._committed:
      self._emit_args(ch)
    elif self._target != "other":
      self._value.append(ch)

  def _value_done(self, ch: str, consumed: bool) -> str | None:
    self._state = "after"
    if self._target == "name":
      name = json.loads("".join(self._value))
      if not name or (self._tools is not None and name not in self._tools):
        return self._fail(ch, consumed)
      self._name = name
      if self._args_text is not None:  # arguments came first: the whole call goes out now
        self._commit()
        self._emit_args(self._args_text)
    elif self._target == "arguments" and not self._committed:
      self._args_text = "".join(self._value)
    return None

  def _close_object(self, ch: str) -> str | None:
    if not self._committed:
      if self._name is None:
        return self._fail(ch, True)
      self._commit()
      self._emit_args("{}")
    self._state, self._end, self._end_at = "end", [], 0
    return None


def _partial_start(text: str) -> int:
  """Where a suffix of `text` that may begin `<tool_call>` starts (len(text) if none)."""
  for k in range(max(0, len(text) - len(TOOL_CALL_START) + 1), len(text)):
    if text[k] == "<" and TOOL_CALL_START.startswith(text[k:]):
      return k
  return len(text)
