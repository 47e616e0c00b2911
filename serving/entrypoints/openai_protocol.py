"""OpenAI-compatible request models and error bodies (pydantic 2).

Requests are validated strictly (`extra="forbid"`, no type coercion), as the
OpenAI API does: an unknown field or a string where a number belongs is a 400
naming the field. vLLM's extra sampling fields (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, ...) are accepted in the
body. Fields we know but do not implement (`logit_bias`, `echo`, `suffix`,
...) are rejected with a message saying so, rather than silently ignored.

Constrained output comes in three spellings, at most one per request (400
otherwise): OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's
`structured_outputs` object (`json`, `regex`, `choice`, `grammar`,
`json_object`) and vLLM's older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` fields. All become one
`StructuredOutputsParams` (`_SamplingRequest.structured_outputs_params`); the
error for a constraint that does not compile names the field it came from.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from serving.types import MAX_LOGPROBS, SEED_MAX, SamplingParams, StructuredOutputsParams

Prompt = str | list[str] | list[int] | list[list[int]]


class APIError(Exception):
  """An error returned to the client as `{"error": {message, type, param, code}}`."""

  def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None,
               headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status, self.message, self.type = status, message, type
    self.param, self.code, self.headers = param, code, headers

  def body(self) -> dict[str, Any]:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


def parse_json_object(text: str, what: str = "request body") -> dict[str, Any]:
  """A JSON object from `text`, or APIError 400: malformed JSON, NaN / Infinity, integers
  past Python's digit limit, nesting deeper than the parser's recursion limit, or a
  string holding a lone surrogate (not encodable as UTF-8) anywhere in it."""
  try:
    obj = json.loads(text, parse_constant=_reject_constant)
  except RecursionError:
    raise APIError(400, f"{what} nests too deeply", code="invalid_json") from None
  except ValueError as e:  # JSONDecodeError, too many digits, NaN / Infinity
    raise APIError(400, f"malformed JSON in the {what}: {_clip(str(e))}",
                   code="invalid_json") from None
  if not isinstance(obj, dict):
    raise APIError(400, f"{what} must be a JSON object", code="invalid_json")
  # Decoded text holds no surrogates but those written as \\u escapes: walk only then.
  bad = _first_unencodable(obj) if _SURROGATE_ESCAPE.search(text) else None
  if bad is not None:
    raise APIError(400, f"{bad or what} holds a string that is not valid Unicode "
                   "(a lone surrogate)", param=bad or None, code="invalid_encoding")
  return obj


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _reject_constant(name: str) -> Any:
  raise ValueError(f"{name} is not a JSON number")


def _first_unencodable(obj: Any) -> str | None:
  """The dotted path of the first string (or key) that UTF-8 cannot encode, else None."""
  stack: list[tuple[Any, str]] = [(obj, "")]
  while stack:
    x, path = stack.pop()
    if isinstance(x, str):
      try:
        x.encode("utf-8")
      except UnicodeEncodeError:
        return path
    elif isinstance(x, dict):
      for k, v in x.items():
        key = str(k).encode("utf-8", "backslashreplace").decode()  # printable even if bad
        stack.append((k, path))
        stack.append((v, f"{path}.{key}" if path else key))
    elif isinstance(x, list):
      stack.extend((v, f"{path}[{i}]") for i, v in enumerate(x))
  return None


def _clip(text: str, n: int = 200) -> str:
  return text if len(text) <= n else text[:n] + "..."


def validation_error(exc: ValidationError) -> APIError:
  """The first pydantic error as a 400 naming the offending field."""
  err = exc.errors()[0]
  loc = [str(x) for x in err["loc"] if not _is_union_tag(x)]
  param = ".".join(loc) or None
  if err["type"] == "json_invalid":
    return APIError(400, f"malformed JSON body: {err['msg']}", code="invalid_json")
  if err["type"] == "extra_forbidden":
    return APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                    code="unknown_parameter")
  msg = err["msg"] if not param else f"{param}: {err['msg']}"
  return APIError(400, msg, param=param, code="invalid_value")


def _is_union_tag(x: Any) -> bool:
  return isinstance(x, str) and ("[" in x or x in ("str", "int", "float", "bool"))


class _Strict(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
  include_usage: bool = False
  continuous_usage_stats: bool = False


class KVTransferParams(BaseModel):
  """vLLM's `kv_transfer_params` (prefill / decode across servers, docs/sharding.md): a
  request to a prefill server sets `do_remote_decode`; the prefill server's response
  carries the `remote_*` fields, which the proxy passes to a decode server with
  `do_remote_prefill`. Other keys (other engines' connectors) are ignored."""

  model_config = ConfigDict(extra="ignore", strict=True)
  do_remote_decode: bool = False
  do_remote_prefill: bool = False
  remote_engine_id: str | None = Field(None, max_length=256)
  remote_request_id: str | None = Field(None, max_length=256)
  remote_block_ids: list[int] | None = Field(None, max_length=1 << 20)
  remote_host: str | None = Field(None, max_length=256)
  remote_port: int | None = Field(None, ge=1, le=65535)

  def check(self) -> None:
    """APIError 400 unless the params describe one of the two legs."""
    if self.do_remote_decode and self.do_remote_prefill:
      raise APIError(400, "do_remote_decode and do_remote_prefill cannot both be true",
                     param="kv_transfer_params")
    if not self.do_remote_prefill:
      return
    if self.remote_block_ids is None:
      raise APIError(400, "do_remote_prefill needs kv_transfer_params.remote_block_ids",
                     param="kv_transfer_params.remote_block_ids")
    if any(b < 0 for b in self.remote_block_ids):
      raise APIError(400, "kv_transfer_params.remote_block_ids must be non-negative page ids",
                     param="kv_transfer_params.remote_block_ids")
    if not self.remote_block_ids:
      return  # nothing was cached there: the decode server prefills
    for name in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port"):
      if getattr(self, name) in (None, ""):
        raise APIError(400, f"do_remote_prefill needs kv_transfer_params.{name}",
                       param=f"kv_transfer_params.{name}")


class _SamplingRequest(_Strict):
  """Fields shared by completions and chat completions."""

  model: str | None = None  # omitted: the served model (as vLLM and SGLang take it)
  max_tokens: int | None = Field(None, ge=1)
  temperature: float | None = None
  top_p: float | None = None
  n: int = Field(1, ge=1)  # at most RequestLimits.max_n
  stream: bool = False
  stream_options: StreamOptions | None = None
  stop: str | list[str] | None = None
  seed: int | None = Field(None, ge=0)
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: dict[str, float] | None = None
  user: str | None = None
  metadata: dict[str, str] | None = None
  store: bool | None = None
  service_tier: str | None = None
  response_format: dict[str, Any] | None = None
  # vLLM extensions.
  structured_outputs: dict[str, Any] | None = None
  guided_json: str | dict[str, Any] | None = None
  guided_regex: str | None = None
  guided_choice: list[str] | None = None
  guided_grammar: str | None = None
  top_k: int | None = None
  min_p: float | None = None
  repetition_penalty: float | None = None
  ignore_eos: bool = False
  stop_token_ids: list[int] | None = None
  include_stop_str_in_output: bool = False
  skip_special_tokens: bool = True
  kv_transfer_params: KVTransferParams | None = None

  def check_supported(self) -> None:
    """Rejects known-but-unimplemented options with a clear message."""
    if self.kv_transfer_params is not None:
      self.kv_transfer_params.check()
    if self.logit_bias:
      raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if self.stream_options is not None and not self.stream:
      raise APIError(400, "stream_options is only allowed when stream is true",
                     param="stream_options")

  def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str]:
    """The request's output constraint and the field it came from (for errors).

    APIError 400 when several spellings are given or one is malformed.
    """
    sources = []
    fmt = self.response_format
    if fmt is not None and fmt.get("type", "text") != "text":
      sources.append(("response_format", _from_response_format(fmt)))
    if self.structured_outputs is not None:
      sources.append(("structured_outputs", self.structured_outputs))
    for kind in ("json", "regex", "choice", "grammar"):
      value = getattr(self, f"guided_{kind}")
      if value is not None:
        sources.append((f"guided_{kind}", {kind: value}))
    if len(sources) > 1:
      raise APIError(400, "give at most one output constraint; got "
                     + ", ".join(name for name, _ in sources), param=sources[1][0])
    if not sources:
      return None, ""
    name, spec = sources[0]
    try:
      params = StructuredOutputsParams.coerce(spec)
      params.validate()
    except (TypeError, ValueError) as e:
      kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object")
               if isinstance(spec, dict) and spec.get(k) not in (None, False)]
      param = constraint_param(name, kinds[0]) if len(kinds) == 1 else name
      message = str(e).replace(f"structured_outputs.{kinds[0]}", param) if kinds else str(e)
      raise APIError(400, message if param in message else f"{param}: {message}", param=param,
                     code="invalid_value") from None
    return params, name

  def include_usage(self) -> bool:
    return bool(self.stream_options and self.stream_options.include_usage)

  def sampling_params(self, max_tokens: int, logprobs: int | None, index: int,
                      structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """SamplingParams for choice `index` (the seed is offset so choices differ; taken modulo
    2^64, the seed range)."""
    try:
      return SamplingParams(
          max_tokens=max_tokens,
          temperature=1.0 if self.temperature is None else self.temperature,
          top_p=1.0 if self.top_p is None else self.top_p,
          top_k=-1 if self.top_k is None else self.top_k,
          min_p=self.min_p or 0.0,
          repetition_penalty=self.repetition_penalty or 1.0,
          presence_penalty=self.presence_penalty,
          frequency_penalty=self.frequency_penalty,
          seed=None if self.seed is None else (self.seed + index) % (SEED_MAX + 1),
          stop=self.stop,
          stop_token_ids=self.stop_token_ids,
          ignore_eos=self.ignore_eos,
          logprobs=logprobs,
          include_stop_str_in_output=self.include_stop_str_in_output,
          skip_special_tokens=self.skip_special_tokens,
          structured_outputs=structured)
    except ValueError as e:
      param = str(e).split()[0]
      raise APIError(400, str(e), param=param, code="invalid_value") from None


def constraint_param(source: str, kind: str) -> str:
  """The request field an output constraint of `kind` came from (what errors name)."""
  if source == "response_format":
    return "response_format.json_schema.schema" if kind == "json" else "response_format"
  if source == "structured_outputs":
    return f"structured_outputs.{kind}"
  return source  # guided_json, guided_regex, ...


def _from_response_format(fmt: dict[str, Any]) -> dict[str, Any]:
  """OpenAI's response_format -> structured_outputs fields (APIError 400 if malformed)."""
  kind = fmt.get("type")
  if kind == "json_object":
    return {"json_object": True}
  if kind != "json_schema":
    raise APIError(400, f"response_format.type must be text, json_object or json_schema, got "
                   f"{_clip(repr(kind))}", param="response_format.type")
  spec = fmt.get("json_schema")
  if not isinstance(spec, dict):
    raise APIError(400, "response_format.json_schema must be an object with a name and a schema",
                   param="response_format.json_schema")
  name = spec.get("name")
  if not isinstance(name, str) or not re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", name):
    raise APIError(400, "response_format.json_schema.name must be 1-64 letters, digits, _ or -",
                   param="response_format.json_schema.name")
  for key, types in (("strict", (bool, type(None))), ("description", (str, type(None)))):
    if not isinstance(spec.get(key), types):
      raise APIError(400, f"response_format.json_schema.{key} has the wrong type",
                     param=f"response_format.json_schema.{key}")
  schema = spec.get("schema", {"type": "object"})
  if not isinstance(schema, (dict, bool)):
    raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                   param="response_format.json_schema.schema")
  return {"json": schema if isinstance(schema, dict) else json.dumps(schema)}


class CompletionRequest(_SamplingRequest):
  """POST /v1/completions."""

  prompt: Prompt
  logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
  echo: bool = False
  suffix: str | None = None
  best_of: int | None = None

  def check_supported(self) -> None:
    super().check_supported()
    if self.echo:
      raise APIError(400, "echo is not supported", param="echo")
    if self.suffix:
      raise APIError(400, "suffix is not supported", param="suffix")
    if self.best_of is not None and self.best_of != self.n:
      raise APIError(400, "best_of other than n is not supported", param="best_of")

  def prompts(self) -> list[str | list[int]]:
    """The prompt(s) as a list of texts or token-id lists."""
    p = self.prompt
    if isinstance(p, str):
      return [p]
    if not p:
      raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(p[0], int):
      return [p]
    return list(p)


class TextPart(BaseModel):
  model_config = ConfigDict(extra="ignore", strict=True)
  type: Literal["text"]
  text: str


class ChatMessage(BaseModel):
  """One chat message; unknown per-message fields are ignored (as OpenAI does)."""

  model_config = ConfigDict(extra="ignore", strict=True)
  role: Literal["system", "developer", "user", "assistant", "tool"]
  content: str | list[dict[str, Any]] | None = None
  name: str | None = None
  tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
  tool_call_id: str | None = None  # a tool result: the call it answers

  def text(self) -> str:
    if self.content is None or isinstance(self.content, str):
      return self.content or ""
    parts = []
    for part in self.content:
      if part.get("type") != "text":
        raise APIError(400, f"content part type {part.get('type')!r} is not supported "
                       "(text only)", param="messages")
      try:
        parts.append(TextPart.model_validate(part).text)
      except ValidationError as e:
        raise validation_error(e) from None
    return "".join(parts)


class ChatCompletionRequest(_SamplingRequest):
  """POST /v1/chat/completions."""

  messages: list[ChatMessage] = Field(min_length=1)
  max_completion_tokens: int | None = Field(None, ge=1)
  logprobs: bool = False
  top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
  tools: list[dict[str, Any]] | None = None
  tool_choice: str | dict[str, Any] | None = None
  parallel_tool_calls: bool | None = None
  add_generation_prompt: bool = True  # vLLM extension
  chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension

  def check_supported(self) -> None:
    super().check_supported()
    if self.top_logprobs is not None and not self.logprobs:
      raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")

  def num_logprobs(self) -> int | None:
    return (self.top_logprobs or 0) if self.logprobs else None

  def requested_max_tokens(self) -> int | None:
    return self.max_completion_tokens or self.max_tokens

  def message_dicts(self) -> list[dict[str, Any]]:
    """The messages as dicts: role, content text, and an assistant's tool_calls / a tool
    result's tool_call_id and name when present."""
    out = []
    for m in self.messages:
      d: dict[str, Any] = {"role": m.role, "content": m.text()}
      for key in ("tool_calls", "tool_call_id", "name"):
        if getattr(m, key) is not None:
          d[key] = getattr(m, key)
      out.append(d)
    return out


class TokenizeRequest(_Strict):
  """POST /tokenize (vLLM): a prompt, or chat messages rendered with the template."""

  model: str | None = None
  prompt: str | None = None
  messages: list[ChatMessage] | None = None
  add_special_tokens: bool = True
  add_generation_prompt: bool = True

  def check(self) -> None:
    if (self.prompt is None) == (self.messages is None):
      raise APIError(400, "exactly one of prompt and messages must be given", param="prompt")


class LoadLoraAdapterRequest(_Strict):
  """vLLM's POST /v1/load_lora_adapter body."""

  lora_name: str = Field(min_length=1, max_length=256)
  lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(_Strict):
  """vLLM's POST /v1/unload_lora_adapter body (`lora_int_id` is accepted and unused)."""

  lora_name: str = Field(min_length=1, max_length=256)
  lora_int_id: int | None = None


class DetokenizeRequest(_Strict):
  """POST /detokenize (vLLM)."""

  model: str | None = None
  tokens: list[int]
