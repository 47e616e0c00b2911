"""Adversarial input against the real server: one tenant's bad request never harms another.

One server for the module (default model, `ops_faults.faulty_engine`, capacity
8 running + 24 queued = 32). Right after it starts, `refs` records the greedy
completions of a shared ~70-token prompt (`P_SHARED`, more than 3 KV pages) and
of the bystander prompts on the fresh server.

`barrage` then starts long greedy streaming bystanders (HTTP and gRPC) and,
once each has produced a token, fires every case of `CASES` at the server
while they run, /health polled all along. Each case is one hostile request of
one tenant: numbers no JSON parser should turn into sampling parameters
(400-digit ints, Infinity/NaN, 1e400, booleans), bodies built to hurt the
parser (100k brackets, 50k-deep nesting, bytes that are not UTF-8, lone
surrogates), out-of-vocabulary token ids, lists and strings past every
`RequestLimits` bound, a client chat template that would run for ever, bodies
over 4 MiB, and the gRPC equivalents (including messages that are not valid
protobuf); two poisoned requests (`ops_faults`) fail their engine step.
`test_case[...]` checks each answer: a 4xx / INVALID_ARGUMENT-like status with
a message saying why, never a 5xx / INTERNAL / UNKNOWN except the poisoned
ones (exactly 500 / INTERNAL "injected fault"). `test_bystanders_unharmed`
checks that the bystanders got exactly their fresh reference text, that every
KV page came back, and that /health stayed up.

`test_failed_prefill_leaves_no_prefix_behind` evicts the prefix cache, fails a
request on P_SHARED in its first prefill step (`seed=POISON_SEED`) and checks
that the next healthy P_SHARED request finds no cached page of it and still
produces the fresh reference (a failed step must not publish the pages it was
to write), then repeats the poisoning concurrently with healthy requests on
the now cached prefix. `test_a_slow_to_parse_body_does_not_stall_health` wants
/health within 1 s while a 4 MiB body of a million token lists is parsed (the
decoding runs in a worker thread, and list sizes are checked before validation).

Figures (counts of cases and statuses, timings) are printed at the end.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import httpx
import pytest
from ops_clients import MODEL, completion_body, grpc_generate, grpc_request
from ops_faults import POISON_PREFIX, POISON_SEED
from ops_procs import OpsServer, assert_pages_free, idle_state, metrics, wait_idle
from server_procs import DEFAULT_MODEL_TEST_CONFIG

from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2 as pb
from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # real servers on the default model, hostile input

QUEUE = 24
CAPACITY = DEFAULT_MODEL_TEST_CONFIG["max_num_seqs"] + QUEUE  # 32 requests in flight at most
VOCAB = 49152  # the default model's vocabulary
PAGE = 16  # KV page size (EngineConfig default)
MAX_BODY = 4 * 2**20  # the HTTP body limit
MAX_INPUT_CHARS = 1_000_000  # RequestLimits.max_input_chars
P_SHARED = ("The quick brown fox jumps over the lazy dog near the quiet river bank. " * 4
            + "Then the fox ran into the forest.")
BYSTANDERS = ["Write a short poem about the sea:", "The history of the Roman Empire begins",
              "List three uses of copper:"]
REF_TOKENS = 12  # P_SHARED's reference length
BYSTANDER_TOKENS = 40
CONCURRENCY = 8  # barrage requests in flight at once
FIGURES: dict[str, object] = {}


# ---- the server and the references ------------------------------------------------------


@pytest.fixture(scope="module")
def srv():
  s = OpsServer(f"--max_queued_requests={QUEUE}", "--drain_timeout_s=30",
                engine="ops_faults:faulty_engine")
  FIGURES["cases"] = len(CASES)
  start = time.monotonic()
  yield s
  s.kill()
  FIGURES["module_s_after_start"] = round(time.monotonic() - start, 1)
  print(f"\nops adversarial figures: {FIGURES}")


@pytest.fixture(autouse=True)
def pages_free_after(srv):
  yield
  assert_pages_free(srv)


@dataclasses.dataclass
class Refs:
  shared_tokens: int  # P_SHARED's prompt length in tokens
  shared: str  # its greedy completion, REF_TOKENS long
  bystanders: list[str]  # greedy, ignore_eos, BYSTANDER_TOKENS long


def _complete(c: httpx.Client, prompt: str | list[int], max_tokens: int, **extra: Any) -> str:
  r = c.post("/v1/completions", json=completion_body(prompt, max_tokens, stream=False, **extra))
  assert r.status_code == 200, r.text
  choice = r.json()["choices"][0]
  assert choice["finish_reason"] == "length", choice
  return choice["text"]


@pytest.fixture(scope="module")
def refs(srv) -> Refs:
  """Greedy completions on the fresh server (before any hostile request)."""
  start = time.monotonic()
  with httpx.Client(base_url=srv.http, timeout=300) as c:
    r = c.post("/tokenize", json={"prompt": P_SHARED})
    assert r.status_code == 200, r.text
    shared_tokens = r.json()["count"]
    assert shared_tokens > 3 * PAGE
    shared = _complete(c, P_SHARED, REF_TOKENS)
    bystanders = [_complete(c, p, BYSTANDER_TOKENS, ignore_eos=True) for p in BYSTANDERS]
  FIGURES["references_s"] = round(time.monotonic() - start, 1)
  FIGURES["p_shared_tokens"] = shared_tokens
  assert shared and all(bystanders)
  return Refs(shared_tokens, shared, bystanders)


def _client(srv, timeout: float = 120) -> httpx.AsyncClient:
  limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
  return httpx.AsyncClient(base_url=srv.http, timeout=timeout, limits=limits)


# ---- the cases ----------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
  """What one case got back: HTTP status or gRPC code, the error message, findings."""

  status: int | grpc.StatusCode | str
  message: str = ""
  body: str = ""  # HTTP: the raw body when it is not an OpenAI error object
  problems: list[str] = dataclasses.field(default_factory=list)
  seconds: float = 0.0
  bystanders_running: int = 0  # bystanders still streaming when the answer came


@dataclasses.dataclass
class Ctx:
  http: httpx.AsyncClient
  health: httpx.AsyncClient  # a client of its own for /health probes
  stub: pb_grpc.GenerationStub
  channel: grpc.aio.Channel


@dataclasses.dataclass(frozen=True)
class Case:
  id: str
  run: Callable[[Ctx], Awaitable[Outcome]] = dataclasses.field(repr=False)
  expect: frozenset  # acceptable statuses (HTTP ints or grpc.StatusCode)
  says: tuple[str, ...] = ()  # the error message names one of these (case-insensitive)
  poison: bool = False  # deliberately fails its engine step: the one 5xx / INTERNAL allowed
  solo: bool = False  # runs alone (its timing is checked), before the concurrent part


INVALID = frozenset({grpc.StatusCode.INVALID_ARGUMENT})
BAD_STATUSES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}

# Bodies are built when the case runs: some are megabytes.
Body = bytes | Callable[[], bytes] | Callable[[], AsyncIterator[bytes]]


def _error_of(r: httpx.Response) -> tuple[str, str]:
  """(error message, raw body if it is not `{"error": {"message": str, ...}}`)."""
  try:
    err = json.loads(r.content)["error"]
    if isinstance(err["message"], str) and isinstance(err.get("type"), str):
      return err["message"], ""
  except (ValueError, KeyError, TypeError):
    pass
  return "", r.text[:500]


def http_case(id: str, path: str, body: Body, status: int = 400, says: str | tuple = (),
              **kw: Any) -> Case:
  async def run(ctx: Ctx) -> Outcome:
    content = body() if callable(body) else body
    r = await ctx.http.post(path, content=content, headers={"content-type": "application/json"})
    message, raw = _error_of(r)
    return Outcome(r.status_code, message, raw)

  says = (says,) if isinstance(says, str) else says
  return Case(id, run, frozenset({status}), says, **kw)


def _members(*members: str) -> bytes:
  return ("{" + ", ".join(m for m in members if m) + "}").encode()


M = f'"model": "{MODEL}"'
HELLO_CMPL = '"prompt": "Hello"'
HELLO_CHAT = '"messages": [{"role": "user", "content": "Hello"}]'


def cmpl(*members: str, prompt: str = HELLO_CMPL) -> bytes:
  mt = "" if any('"max_tokens"' in m for m in members) else '"max_tokens": 2'
  return _members(M, prompt, '"temperature": 0', mt, *members)


def chat(*members: str, messages: str = HELLO_CHAT) -> bytes:
  mt = "" if any('"max_tokens"' in m for m in members) else '"max_tokens": 2'
  return _members(M, messages, '"temperature": 0', mt, *members)


def _deep_object(depth: int) -> str:
  return '{"a": ' * depth + '"x"' + "}" * depth


def _stops(n: int) -> str:
  return json.dumps([f"s{i}" for i in range(n)])


# Fields valid in both completions and chat, written as raw JSON text: (id, member, says).
SAMPLING = [
    ("top_k-1e400", '"top_k": 1' + "0" * 400, "top_k"),
    ("top_k-2pow31", f'"top_k": {2**31}', "top_k"),
    ("top_k-minus5", '"top_k": -5', "top_k"),
    ("top_k-float", '"top_k": 1.5', "top_k"),
    ("max_tokens-5000-digits", '"max_tokens": 1' + "0" * 4999, "digits"),
    ("max_tokens-2pow40", f'"max_tokens": {2**40}', "max_tokens"),
    ("max_tokens-true", '"max_tokens": true', "max_tokens"),
    ("n-4000-digits", '"n": 1' + "0" * 3999, "n="),
    ("temperature-Infinity", '"temperature": Infinity', "not a JSON number"),
    ("temperature-minus-Infinity", '"temperature": -Infinity', "not a JSON number"),
    ("temperature-NaN", '"temperature": NaN', "not a JSON number"),
    ("temperature-1e400", '"temperature": 1e400', "temperature"),
    ("temperature-1e300", '"temperature": 1e300', "temperature"),
    ("temperature-true", '"temperature": true', "temperature"),
    ("temperature-string", '"temperature": "0.5"', "temperature"),
    ("repetition_penalty-Infinity", '"repetition_penalty": Infinity', "not a JSON number"),
    ("repetition_penalty-1e400", '"repetition_penalty": 1e400', "repetition_penalty"),
    ("top_p-NaN", '"top_p": NaN', "not a JSON number"),
    ("top_p-0", '"top_p": 0', "top_p"),
    ("min_p-1e400", '"min_p": 1e400', "min_p"),
    ("presence_penalty-minus-1e400", '"presence_penalty": -1e400', "presence_penalty"),
    ("seed-minus1", '"seed": -1', "seed"),
    ("stop_token_ids-49152", f'"stop_token_ids": [{VOCAB}]', "stop_token_ids"),
    ("stop_token_ids-minus1", '"stop_token_ids": [-1]', "stop_token_ids"),
    ("stop_token_ids-65", f'"stop_token_ids": {list(range(65))}', "stop_token_ids"),
    ("stop-surrogate", '"stop": "\\ud800"', "surrogate"),
    ("stop-17-strings", f'"stop": {_stops(17)}', "stop strings"),
    ("stop-300-chars", f'"stop": "{"x" * 300}"', "stop string"),
    ("stop-empty-string", '"stop": [""]', "stop"),
    ("n-17", '"n": 17', "n=17"),
    ("metadata-50k-deep", '"metadata": ' + _deep_object(50_000), "nests too deeply"),
    ("metadata-surrogate-key", '"metadata": {"\\ud800": "x"}', "surrogate"),
    ("unknown-field", '"frobnicate": 1', "frobnicate"),
]

_big_prompts = lambda: cmpl(prompt='"prompt": ' + json.dumps(["a"] * 300_000))
_token_lists = lambda: cmpl(prompt='"prompt": [' + ",".join(["[0]"] * 1_000_000) + "]")
_token_ids = lambda: cmpl(prompt='"prompt": [' + ",".join(["0"] * 2_000_000) + "]")
_long_prompt = lambda: cmpl(prompt=f'"prompt": "{"a" * (MAX_INPUT_CHARS + 1)}"')
_long_chat = lambda: chat(messages=f'"messages": [{{"role": "user", "content": '
                          f'"{"a" * (MAX_INPUT_CHARS + 1)}"}}]')
_over_4mib = lambda: cmpl(prompt=f'"prompt": "{"a" * (MAX_BODY + 10)}"')
_over_4mib_chat = lambda: chat(messages=f'"messages": [{{"role": "user", "content": '
                               f'"{"a" * (MAX_BODY + 10)}"}}]')


def _chunked_over_4mib() -> AsyncIterator[bytes]:
  async def gen():  # no Content-Length: the server must count while it reads
    yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
    for _ in range(MAX_BODY // 2**16 + 16):
      yield b"a" * 2**16
    yield b'"}'
  return gen()


_RUNAWAY_TEMPLATE = ("{% for a in range(9999) %}{% for b in range(9999) %}{% for c in range(9999)"
                     " %}x{% endfor %}{% endfor %}{% endfor %}")
_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
_BAD_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}]


def _deep_schema(depth: int) -> str:
  return '{"type": "array", "items": ' * depth + '{"type": "string"}' + "}" * depth


def chat_template_case() -> Case:
  """A runaway client template: refused at once, /health answering within 1 s meanwhile."""
  body = chat(f'"chat_template_kwargs": {json.dumps({"chat_template": _RUNAWAY_TEMPLATE})}')

  async def run(ctx: Ctx) -> Outcome:
    start = time.monotonic()
    task = asyncio.ensure_future(
        ctx.http.post("/v1/chat/completions", content=body,
                      headers={"content-type": "application/json"}))
    problems, probes = [], 0
    while not task.done() or probes < 3:
      t = time.monotonic()
      try:
        h = await ctx.health.get("/health", timeout=1.0)
        if h.status_code != 200:
          problems.append(f"/health answered {h.status_code}")
      except httpx.TimeoutException:
        problems.append("/health did not answer within 1 s")
      if time.monotonic() - t > 1.0:
        problems.append(f"/health took {time.monotonic() - t:.2f} s")
      probes += 1
      if time.monotonic() - start > 30:
        break
    r = await asyncio.wait_for(task, 30)
    seconds = time.monotonic() - start
    if seconds > 5.0:
      problems.append(f"the template request took {seconds:.1f} s")
    message, raw = _error_of(r)
    return Outcome(r.status_code, message, raw, problems)

  return Case("chat-runaway-chat_template", run, frozenset({400}), ("chat template",),
              solo=True)


def _http_cases() -> list[Case]:
  cases = [
      # Deliberately poisoned: fails its first engine step; the only 5xx allowed.
      http_case("cmpl-poisoned-prompt", "/v1/completions",
                cmpl(prompt=f'"prompt": {POISON_PREFIX + [504, 1209, 2045]}'),
                status=500, says="injected fault", poison=True),
  ]
  for id_, member, says in SAMPLING:
    cases.append(http_case(f"cmpl-{id_}", "/v1/completions", cmpl(member), says=says))
    cases.append(http_case(f"chat-{id_}", "/v1/chat/completions", chat(member), says=says))
  cases += [
      http_case("cmpl-logprobs-21", "/v1/completions", cmpl('"logprobs": 21'), says="logprobs"),
      http_case("chat-top_logprobs-100", "/v1/chat/completions",
                chat('"logprobs": true', '"top_logprobs": 100'), says="top_logprobs"),
      # Bodies built to hurt the parser.
      http_case("cmpl-100k-brackets", "/v1/completions", b"[" * 100_000, says="nests too deeply"),
      http_case("chat-100k-brackets", "/v1/chat/completions", b"[" * 100_000,
                says="nests too deeply"),
      http_case("tokenize-100k-brackets", "/tokenize", b"[" * 100_000, says="nests too deeply"),
      http_case("cmpl-prompt-50k-deep", "/v1/completions",
                cmpl(prompt='"prompt": ' + "[" * 50_000 + "1" + "]" * 50_000),
                says="nests too deeply"),
      http_case("chat-content-50k-deep", "/v1/chat/completions",
                chat(messages='"messages": [{"role": "user", "content": '
                     + "[" * 50_000 + "]" * 50_000 + "}]"), says="nests too deeply"),
      http_case("cmpl-not-utf8", "/v1/completions", b"\xff\xfe" + cmpl(), says="UTF-8"),
      http_case("cmpl-not-utf8-inside-string", "/v1/completions",
                cmpl(prompt='"prompt": "Hel!o"').replace(b"Hel!o", b"Hel\xc3\x28o"), says="UTF-8"),
      http_case("chat-not-utf8", "/v1/chat/completions", b"\xff\xfe" + chat(), says="UTF-8"),
      http_case("tokenize-not-utf8", "/tokenize", b'{"prompt": "\xff\xfe"}', says="UTF-8"),
      http_case("cmpl-not-an-object", "/v1/completions", b"[1, 2]", says="JSON object"),
      http_case("cmpl-prompt-surrogate", "/v1/completions", cmpl(prompt='"prompt": "\\ud800"'),
                says="surrogate"),
      http_case("cmpl-prompt-list-surrogate", "/v1/completions",
                cmpl(prompt='"prompt": ["ok", "a\\udfffb"]'), says="surrogate"),
      http_case("chat-content-surrogate", "/v1/chat/completions",
                chat(messages='"messages": [{"role": "user", "content": "\\ud800"}]'),
                says="surrogate"),
      http_case("chat-content-part-surrogate", "/v1/chat/completions",
                chat(messages='"messages": [{"role": "user", "content": '
                     '[{"type": "text", "text": "x\\udbff"}]}]'), says="surrogate"),
      http_case("tokenize-prompt-surrogate", "/tokenize", b'{"prompt": "\\ud800"}',
                says="surrogate"),
      http_case("tokenize-messages-surrogate", "/tokenize",
                b'{"messages": [{"role": "user", "content": "\\udc00"}]}', says="surrogate"),
      http_case("tokenize-NaN", "/tokenize", b'{"prompt": "hi", "add_special_tokens": NaN}',
                says="not a JSON number"),
      # Token ids outside the vocabulary.
      http_case("cmpl-token-49152", "/v1/completions", cmpl(prompt=f'"prompt": [{VOCAB}]'),
                says="token ids"),
      http_case("cmpl-token-minus1", "/v1/completions", cmpl(prompt='"prompt": [-1]'),
                says="token ids"),
      http_case("cmpl-token-lists-49152", "/v1/completions",
                cmpl(prompt=f'"prompt": [[1, 2], [{VOCAB}]]'), says="token ids"),
      http_case("cmpl-token-4000-digits", "/v1/completions",
                cmpl(prompt='"prompt": [1' + "0" * 3999 + "]"), says="token ids"),
      http_case("detokenize-49152", "/detokenize", f'{{"tokens": [{VOCAB}]}}'.encode(),
                says="token ids"),
      http_case("detokenize-minus1", "/detokenize", b'{"tokens": [-1]}', says="token ids"),
      # Past the RequestLimits.
      http_case("cmpl-300k-prompts", "/v1/completions", _big_prompts, says="prompts exceed"),
      http_case("cmpl-1M-token-lists", "/v1/completions", _token_lists, says="prompts exceed"),
      http_case("cmpl-2M-token-ids", "/v1/completions", _token_ids, says="context length"),
      http_case("detokenize-2M-tokens", "/detokenize",
                lambda: b'{"tokens": [' + b",".join([b"0"] * 2_000_000) + b"]}",
                says="exceed the limit"),
      http_case("cmpl-65-prompts", "/v1/completions",
                cmpl(prompt=f'"prompt": {json.dumps(["a"] * 65)}'), says="prompts exceed"),
      http_case("cmpl-3-prompts-x-n16-over-capacity", "/v1/completions",
                cmpl('"n": 16', prompt='"prompt": ["a", "b", "c"]'), says="holds at most"),
      http_case("cmpl-5-prompts-x-n16-over-max_choices", "/v1/completions",
                cmpl('"n": 16', prompt=f'"prompt": {json.dumps(["a"] * 5)}'),
                says="completions exceed"),
      http_case("cmpl-prompt-1000001-chars", "/v1/completions", _long_prompt,
                says="characters"),
      http_case("chat-content-1000001-chars", "/v1/chat/completions", _long_chat,
                says="characters"),
      http_case("tokenize-1000001-chars", "/tokenize",
                lambda: f'{{"prompt": "{"a" * (MAX_INPUT_CHARS + 1)}"}}'.encode(),
                says="characters"),
      http_case("cmpl-empty-prompt", "/v1/completions", cmpl(prompt='"prompt": ""'),
                says="empty"),
      http_case("cmpl-empty-prompt-list", "/v1/completions", cmpl(prompt='"prompt": []'),
                says="empty"),
      http_case("chat-no-messages", "/v1/chat/completions", chat(messages='"messages": []'),
                says="messages"),
      http_case("chat-bad-role", "/v1/chat/completions",
                chat(messages='"messages": [{"role": "root", "content": "hi"}]'), says="role"),
      # Templates and tools.
      chat_template_case(),
      http_case("chat-chat_template_kwargs-tools", "/v1/chat/completions",
                chat(f'"chat_template_kwargs": {json.dumps({"tools": _TOOLS})}'), says="tools"),
      http_case("chat-chat_template_kwargs-documents", "/v1/chat/completions",
                chat('"chat_template_kwargs": {"documents": [{"text": "x"}]}'),
                says="documents"),
      http_case("chat-tools-bad-schema", "/v1/chat/completions",
                chat(f'"tools": {json.dumps(_BAD_TOOLS)}'), says="parameters"),
      http_case("chat-tool-choice-unknown", "/v1/chat/completions",
                chat(f'"tools": {json.dumps(_TOOLS)}',
                     '"tool_choice": {"type": "function", "function": {"name": "g"}}'),
                says="tool_choice"),
      # Output constraints: refused before the engine, whatever they hold.
      http_case("chat-schema-70-deep", "/v1/chat/completions",
                chat('"response_format": {"type": "json_schema", "json_schema": '
                     '{"name": "x", "schema": ' + _deep_schema(70) + "}}"),
                says="response_format.json_schema.schema"),
      http_case("cmpl-schema-70-deep", "/v1/completions",
                cmpl('"structured_outputs": {"json": ' + _deep_schema(70) + "}"),
                says="structured_outputs.json"),
      http_case("cmpl-regex-bad", "/v1/completions", cmpl('"guided_regex": "(((["'),
                says="guided_regex"),
      http_case("cmpl-regex-empty-language", "/v1/completions",
                cmpl('"structured_outputs": {"regex": "[^\\\\x00-\\\\x{10FFFF}]"}'),
                says="admits no output"),
      http_case("cmpl-grammar-undefined-rule", "/v1/completions",
                cmpl('"structured_outputs": {"grammar": "start: nowhere"}'),
                says="structured_outputs.grammar"),
      http_case("cmpl-choice-too-many", "/v1/completions",
                cmpl('"guided_choice": ' + json.dumps([f"c{i}" for i in range(2000)])),
                says="choices"),
      # Bodies over the limit.
      http_case("cmpl-body-over-4MiB", "/v1/completions", _over_4mib, status=413,
                says="exceeds"),
      http_case("chat-body-over-4MiB", "/v1/chat/completions", _over_4mib_chat, status=413,
                says="exceeds"),
      http_case("cmpl-chunked-body-over-4MiB", "/v1/completions", _chunked_over_4mib,
                status=413, says="exceeds"),
  ]
  return cases


# gRPC ---------------------------------------------------------------------------------------


async def _grpc_outcome(call) -> Outcome:
  try:
    async for _ in call:
      pass
  except grpc.aio.AioRpcError as e:
    return Outcome(e.code(), e.details() or "")
  return Outcome(await call.code())


def grpc_case(id: str, make: Callable[[], pb.GenerateRequest], expect=INVALID,
              says: str | tuple = (), **kw: Any) -> Case:
  async def run(ctx: Ctx) -> Outcome:
    return await _grpc_outcome(ctx.stub.Generate(make()))

  says = (says,) if isinstance(says, str) else says
  return Case(id, run, frozenset(expect), says, **kw)


def grpc_unary_case(id: str, method: str, request: Callable[[], Any], says: str) -> Case:
  async def run(ctx: Ctx) -> Outcome:
    try:
      await getattr(ctx.stub, method)(request())
    except grpc.aio.AioRpcError as e:
      return Outcome(e.code(), e.details() or "")
    return Outcome(grpc.StatusCode.OK)

  return Case(id, run, INVALID, (says,))


def grpc_raw_case(id: str, payload: bytes, method: str = "Generate") -> Case:
  """A request that is not a valid protobuf message of its type (another language's client
  can send any bytes): a client error, never INTERNAL / UNKNOWN."""
  async def run(ctx: Ctx) -> Outcome:
    path = f"/xlaserve.v1.Generation/{method}"
    if method == "Generate":
      call = ctx.channel.unary_stream(path, request_serializer=lambda b: b,
                                      response_deserializer=pb.GenerateResponse.FromString)
      return await _grpc_outcome(call(payload))
    call = ctx.channel.unary_unary(path, request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
    try:
      await call(payload)
    except grpc.aio.AioRpcError as e:
      return Outcome(e.code(), e.details() or "")
    return Outcome(grpc.StatusCode.OK)

  return Case(id, run, INVALID, ("not a valid message",))


def _sampled(prompt: str | list[int] = "Hello", max_tokens: int = 2, **fields: Any):
  def make() -> pb.GenerateRequest:
    req = grpc_request(prompt, max_tokens)
    for name, value in fields.items():
      if isinstance(value, list):
        getattr(req.sampling, name).extend(value)
      else:
        setattr(req.sampling, name, value)
    return req
  return make


def _with(make: Callable[[], pb.GenerateRequest], **fields: Any):
  def build() -> pb.GenerateRequest:
    req = make()
    for name, value in fields.items():
      setattr(req, name, value)
    return req
  return build


async def _collect(call) -> tuple[grpc.StatusCode, str, set[str]]:
  """(code, text, request ids echoed) of a Generate call."""
  text, ids = "", set()
  try:
    async for msg in call:
      text += msg.text
      ids.add(msg.request_id)
  except grpc.aio.AioRpcError as e:
    return e.code(), e.details() or "", ids
  return await call.code(), text, ids


def dup_request_id_case() -> Case:
  """Two concurrent calls with the same request_id: ids are labels, both are served."""
  async def run(ctx: Ctx) -> Outcome:
    req = grpc_request("Tell me a story about a lighthouse", 4)
    req.request_id = "dup"
    (c1, t1, ids1), (c2, t2, ids2) = await asyncio.gather(_collect(ctx.stub.Generate(req)),
                                                          _collect(ctx.stub.Generate(req)))
    problems = []
    if (c1, c2) != (grpc.StatusCode.OK,) * 2:
      problems.append(f"codes {c1}, {c2}: {t1!r} {t2!r}")
    elif ids1 != {"dup"} or ids2 != {"dup"}:
      problems.append(f"echoed ids {ids1}, {ids2}")
    elif not t1 or t1 != t2:
      problems.append(f"greedy texts differ: {t1!r} vs {t2!r}")
    code = c1 if c1 != grpc.StatusCode.OK else c2
    return Outcome(code, "" if code == grpc.StatusCode.OK else f"{t1} {t2}", problems=problems)

  return Case("grpc-same-request_id-concurrent", run, frozenset({grpc.StatusCode.OK}))


def cancel_reissue_case() -> Case:
  """A call cancelled mid-stream, then re-issued at once with the same request_id."""
  async def run(ctx: Ctx) -> Outcome:
    req = grpc_request("Cancel me: a long story about a dragon", 24)
    req.request_id = "again"
    call = ctx.stub.Generate(req)
    async for _ in call:
      break
    call.cancel()
    first = await call.code()
    req.sampling.max_tokens = 4
    code, text, ids = await _collect(ctx.stub.Generate(req))
    problems = []
    if first != grpc.StatusCode.CANCELLED:
      problems.append(f"the cancelled call ended with {first}")
    if code == grpc.StatusCode.OK and (ids != {"again"} or not text):
      problems.append(f"re-issued call: ids {ids}, text {text!r}")
    return Outcome(code, "" if code == grpc.StatusCode.OK else text, problems=problems)

  return Case("grpc-cancel-then-reissue-same-request_id", run, frozenset({grpc.StatusCode.OK}))


_GOOD_BYTES = lambda: grpc_request("Hello", 2).SerializeToString()

def _grpc_cases() -> list[Case]:
  inf, nan = float("inf"), float("nan")
  return [
      grpc_case("grpc-poisoned-prompt", lambda: grpc_request(POISON_PREFIX + [504, 1209], 2),
                expect={grpc.StatusCode.INTERNAL}, says="injected fault", poison=True),
      grpc_case("grpc-request_id-1M-chars", _with(_sampled(), request_id="r" * 1_000_000),
                says="request_id"),
      grpc_case("grpc-temperature-inf", _sampled(temperature=inf), says="finite"),
      grpc_case("grpc-temperature-nan", _sampled(temperature=nan), says="finite"),
      grpc_case("grpc-temperature-1e30", _sampled(temperature=1e30), says="temperature"),
      grpc_case("grpc-top_p-nan", _sampled(top_p=nan), says="finite"),
      grpc_case("grpc-repetition_penalty-inf", _sampled(repetition_penalty=inf),
                says="finite"),
      grpc_case("grpc-min_p-nan", _sampled(min_p=nan), says="finite"),
      grpc_case("grpc-top_k-minus5", _sampled(top_k=-5), says="top_k"),
      grpc_case("grpc-stop-200k-strings", _sampled(stop=["s"] * 200_000),
                expect={grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED},
                says=("stop", "larger than max")),
      grpc_case("grpc-stop-2M-strings-over-4MiB", _sampled(stop=["s"] * 2_000_000),
                expect={grpc.StatusCode.RESOURCE_EXHAUSTED}, says="larger than max"),
      grpc_case("grpc-stop-300-chars", _sampled(stop=["x" * 300]), says="stop string"),
      grpc_case("grpc-stop_token_ids-49152", _sampled(stop_token_ids=[VOCAB]),
                says="stop_token_ids"),
      grpc_case("grpc-token-49152", lambda: grpc_request([VOCAB], 2), says="token ids"),
      grpc_case("grpc-token-2pow32-1", lambda: grpc_request([2**32 - 1], 2), says="token ids"),
      grpc_case("grpc-max_tokens-2pow31", _sampled(max_tokens=2**31), says="max_tokens"),
      grpc_case("grpc-max_tokens-0", _sampled(max_tokens=0), says="max_tokens"),
      grpc_case("grpc-logprobs-21", _sampled(logprobs=21), says="logprobs"),
      grpc_case("grpc-seed-2pow64-1", _sampled(seed=2**64 - 1),  # the uint64 range: served
                expect=frozenset({grpc.StatusCode.OK})),
      grpc_case("grpc-text-1000001-chars", lambda: grpc_request("a" * (MAX_INPUT_CHARS + 1), 2),
                says="characters"),
      grpc_case("grpc-no-prompt", lambda: pb.GenerateRequest(sampling=pb.SamplingParams()),
                says="one of"),
      grpc_case("grpc-chat-no-messages", lambda: pb.GenerateRequest(chat=pb.ChatMessages()),
                says="messages"),
      grpc_unary_case("grpc-tokenize-1000001-chars", "Tokenize",
                      lambda: pb.TokenizeRequest(text="a" * (MAX_INPUT_CHARS + 1)),
                      says="characters"),
      grpc_unary_case("grpc-detokenize-49152", "Detokenize",
                      lambda: pb.DetokenizeRequest(token_ids=[VOCAB]), says="token ids"),
      grpc_raw_case("grpc-proto-bad-utf8-string",
                    _GOOD_BYTES().replace(b"Hello", b"He\xff\xfeo")),
      grpc_raw_case("grpc-proto-corrupt-wire-format", b"\x12\xff\xff\xff\xff\x0f"),
      grpc_raw_case("grpc-tokenize-proto-bad-utf8", b"\x0a\x02\xff\xfe", method="Tokenize"),
      dup_request_id_case(),
      cancel_reissue_case(),
  ]


CASES: list[Case] = _http_cases() + _grpc_cases()
assert len({c.id for c in CASES}) == len(CASES), "duplicate case ids"


# ---- the barrage --------------------------------------------------------------------------


@dataclasses.dataclass
class Stream:
  text: str = ""
  finish_reason: str | None = None
  error: Any = None
  done: bool = False


async def _http_bystander(c: httpx.AsyncClient, prompt: str, started: asyncio.Event) -> Stream:
  res = Stream()
  body = completion_body(prompt, BYSTANDER_TOKENS, ignore_eos=True)
  async with c.stream("POST", "/v1/completions", json=body) as r:
    if r.status_code != 200:
      res.error = (r.status_code, (await r.aread())[:500])
      started.set()
      return res
    async for line in r.aiter_lines():
      if line == "data: [DONE]":
        res.done = True
      elif line.startswith("data: "):
        event = json.loads(line[len("data: "):])
        if "error" in event:
          res.error = event["error"]
          continue
        choice = event["choices"][0]
        res.text += choice["text"]
        res.finish_reason = choice["finish_reason"] or res.finish_reason
        started.set()
  started.set()
  return res


async def _grpc_bystander(stub: pb_grpc.GenerationStub, prompt: str,
                          started: asyncio.Event) -> Stream:
  req = grpc_request(prompt, BYSTANDER_TOKENS)
  req.sampling.ignore_eos = True
  res = Stream()
  try:
    async for msg in stub.Generate(req):
      res.text += msg.text
      if msg.finish_reason:
        res.finish_reason = pb.FinishReason.Name(msg.finish_reason)
      started.set()
    res.done = True
  except grpc.aio.AioRpcError as e:
    res.error = (e.code(), e.details())
  started.set()
  return res


async def _poll_health(c: httpx.AsyncClient, stop: asyncio.Event) -> list[tuple[Any, float]]:
  seen = []
  while not stop.is_set():
    t = time.monotonic()
    try:
      status = (await c.get("/health", timeout=10)).status_code
    except httpx.TransportError as e:
      status = type(e).__name__
    seen.append((status, time.monotonic() - t))
    await asyncio.sleep(0.1)
  return seen


@dataclasses.dataclass
class Barrage:
  outcomes: dict[str, Outcome]
  bystanders: list[Stream]  # HTTP streams of BYSTANDERS, then one gRPC stream of BYSTANDERS[0]
  health: list[tuple[Any, float]]
  state_after: tuple[float, float, float]


@pytest.fixture(scope="module")
def barrage(srv, refs) -> Barrage:
  async def run_case(ctx: Ctx, sem: asyncio.Semaphore, case: Case, streams) -> Outcome:
    async with sem:
      start = time.monotonic()
      try:
        out = await asyncio.wait_for(case.run(ctx), 120)
      except Exception as e:  # noqa: BLE001 -- a transport failure is an outcome too
        out = Outcome(f"client error: {type(e).__name__}", str(e)[:300])
      out.seconds = time.monotonic() - start
      out.bystanders_running = sum(not t.done() for t in streams)
      return out

  async def run() -> Barrage:
    async with (_client(srv) as http, _client(srv) as health,
                grpc.aio.insecure_channel(srv.grpc) as ch,
                grpc.aio.insecure_channel(srv.grpc) as bystander_ch):
      ctx = Ctx(http, health, pb_grpc.GenerationStub(ch), ch)
      started = [asyncio.Event() for _ in range(len(BYSTANDERS) + 1)]
      streams = [asyncio.create_task(_http_bystander(http, p, ev))
                 for p, ev in zip(BYSTANDERS, started, strict=False)]
      streams.append(asyncio.create_task(_grpc_bystander(
          pb_grpc.GenerationStub(bystander_ch), BYSTANDERS[0], started[-1])))
      await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
      stop = asyncio.Event()
      poller = asyncio.create_task(_poll_health(health, stop))
      sem = asyncio.Semaphore(CONCURRENCY)
      start = time.monotonic()
      # First the poisoned cases, so that they fail their steps while the bystanders decode;
      # then the timed ones alone; then all the others, CONCURRENCY at a time.
      poison = [c for c in CASES if c.poison]
      solo = [c for c in CASES if c.solo and not c.poison]
      rest = [c for c in CASES if not c.solo and not c.poison]
      outs = await asyncio.gather(*(run_case(ctx, sem, c, streams) for c in poison))
      for case in solo:
        outs.append(await run_case(ctx, sem, case, streams))
      outs += await asyncio.gather(*(run_case(ctx, sem, c, streams) for c in rest))
      ordered = poison + solo + rest
      FIGURES["barrage_s"] = round(time.monotonic() - start, 1)
      results = await asyncio.wait_for(asyncio.gather(*streams), 240)
      FIGURES["bystanders_s"] = round(time.monotonic() - start, 1)
      stop.set()
      seen = await poller
      return Barrage({c.id: o for c, o in zip(ordered, outs, strict=True)}, results, seen,
                     wait_idle(srv.http, timeout_s=60))

  b = asyncio.run(run())
  FIGURES["http_statuses"] = dict(sorted(collections.Counter(
      o.status for o in b.outcomes.values() if isinstance(o.status, int)).items()))
  FIGURES["grpc_codes"] = dict(sorted(collections.Counter(
      o.status.name for o in b.outcomes.values() if isinstance(o.status, grpc.StatusCode)
  ).items()))
  FIGURES["other_outcomes"] = sum(isinstance(o.status, str) for o in b.outcomes.values())
  FIGURES["slowest_case_s"] = max((round(o.seconds, 2), i) for i, o in b.outcomes.items())
  FIGURES["health_polls"] = len(b.health)
  FIGURES["health_max_s"] = round(max((s for _, s in b.health), default=0.0), 2)
  return b


def test_bystanders_unharmed(srv, refs, barrage):
  """The bystanders got exactly their fresh text; pages came back; /health stayed up;
  no 5xx / INTERNAL / UNKNOWN but the poisoned requests."""
  expected = refs.bystanders + [refs.bystanders[0]]
  for i, (res, ref) in enumerate(zip(barrage.bystanders, expected, strict=True)):
    assert res.error is None, (i, res)
    assert res.done and res.finish_reason in ("length", "FINISH_REASON_LENGTH"), (i, res)
    assert res.text == ref, f"bystander {i}: {res.text!r} != fresh {ref!r}"
  # The poisoned requests failed while every bystander was still streaming.
  for case in CASES:
    if case.poison:
      out = barrage.outcomes[case.id]
      assert out.bystanders_running == len(barrage.bystanders), (case.id, out)
  server_errors = [(i, o.status, o.message) for i, o in barrage.outcomes.items()
                   if (isinstance(o.status, int) and o.status >= 500 or o.status in BAD_STATUSES)
                   and not _case(i).poison]
  assert not server_errors, server_errors
  assert barrage.health and all(s == 200 for s, _ in barrage.health), barrage.health
  assert barrage.state_after == (0.0, 0.0, 0.0), barrage.state_after
  assert srv.proc.poll() is None


def _case(case_id: str) -> Case:
  return next(c for c in CASES if c.id == case_id)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_case(barrage, case):
  out = barrage.outcomes[case.id]
  assert out.status in case.expect, f"{case.id}: {out}"
  assert not out.problems, f"{case.id}: {out.problems}"
  ok = out.status == grpc.StatusCode.OK or out.status == 200
  if not ok:
    assert out.message.strip(), f"{case.id}: no error message ({out})"
    assert not out.body, f"{case.id}: not an OpenAI error body: {out.body!r}"
    if case.says:
      assert any(s.lower() in out.message.lower() for s in case.says), (
          f"{case.id}: {out.message!r} names none of {case.says}")
  if not case.poison:
    assert not (isinstance(out.status, int) and out.status >= 500), f"{case.id}: {out}"
    assert out.status not in BAD_STATUSES, f"{case.id}: {out}"


# ---- a failed step and the prefix cache ----------------------------------------------------


def _hits(base_url: str) -> float:
  return metrics(base_url)["xlaserve_prefix_cache_hits_total"]


def _evict_prefix_cache(srv) -> None:
  """Fills the KV pool with newer cached pages than any before: every older cached page is
  evicted (LRU). Each flood request commits 15 full pages (it is still running when its last
  prefill chunk lands); together they commit more pages than the pool holds."""
  pages = int(metrics(srv.http)["xlaserve_kv_cache_pages_total"])
  per_request = 15
  n = pages // per_request + 1

  async def flood():
    async with _client(srv, timeout=300) as c:
      rs = await asyncio.gather(*(c.post("/v1/completions", json=completion_body(
          [1000 + 300 * i + j for j in range(per_request * PAGE)], 2, stream=False))
          for i in range(n)))
    return [r.status_code for r in rs]

  assert asyncio.run(flood()) == [200] * n


def test_failed_prefill_leaves_no_prefix_behind(srv, refs, barrage):
  """P_SHARED poisoned (seed) on a cold cache fails in its first prefill step; the next
  healthy P_SHARED finds no page of it cached and produces the fresh reference."""
  start = time.monotonic()
  _evict_prefix_cache(srv)
  FIGURES["evict_prefix_cache_s"] = round(time.monotonic() - start, 1)
  body = completion_body(P_SHARED, REF_TOKENS, stream=False)
  with httpx.Client(base_url=srv.http, timeout=300) as c:
    h0 = _hits(srv.http)
    bad = c.post("/v1/completions", json={**body, "seed": POISON_SEED})
    h1 = _hits(srv.http)
    assert bad.status_code == 500, bad.text
    assert "injected fault" in bad.json()["error"]["message"]
    assert h1 == h0, "P_SHARED was still cached: the eviction did not work"
    assert idle_state(srv.http) == (0.0, 0.0, 0.0)
    good = c.post("/v1/completions", json=body)
    h2 = _hits(srv.http)
    assert good.status_code == 200, good.text
    assert h2 == h1, f"the failed step left {h2 - h1:.0f} tokens of P_SHARED in the prefix cache"
    assert good.json()["choices"][0]["text"] == refs.shared
    again = c.post("/v1/completions", json=body)  # now from the pages the healthy one cached
    h3 = _hits(srv.http)
    assert again.status_code == 200, again.text
    assert h3 - h2 == (refs.shared_tokens - 1) // PAGE * PAGE
    assert again.json()["choices"][0]["text"] == refs.shared


def test_poisoned_requests_beside_healthy_ones_on_a_cached_prefix(srv, refs, barrage):
  """Poisoned P_SHARED requests (HTTP and gRPC, seed) in the same steps as healthy ones
  sharing its cached prefix pages: only the poisoned fail; the others get the reference."""
  body = completion_body(P_SHARED, REF_TOKENS, stream=False)

  async def run():
    async with _client(srv) as c, grpc.aio.insecure_channel(srv.grpc) as ch:
      stub = pb_grpc.GenerationStub(ch)
      bad_grpc = grpc_request(P_SHARED, REF_TOKENS)
      bad_grpc.sampling.seed = POISON_SEED
      return await asyncio.gather(
          c.post("/v1/completions", json={**body, "seed": POISON_SEED}),
          grpc_generate(stub, bad_grpc),
          c.post("/v1/completions", json=body),
          c.post("/v1/completions", json={**body, "stream": False, "n": 2}),
          grpc_generate(stub, grpc_request(P_SHARED, REF_TOKENS)))

  bad_http, bad_grpc, good, good_n2, good_grpc = asyncio.run(run())
  assert bad_http.status_code == 500 and "injected fault" in bad_http.json()["error"]["message"]
  assert bad_grpc[0] == grpc.StatusCode.INTERNAL and "injected fault" in bad_grpc[1]
  assert good.status_code == 200 and good.json()["choices"][0]["text"] == refs.shared
  assert good_n2.status_code == 200
  assert [ch["text"] for ch in good_n2.json()["choices"]] == [refs.shared] * 2
  assert good_grpc[0] == grpc.StatusCode.OK and good_grpc[1] == refs.shared
  assert httpx.get(f"{srv.http}/health", timeout=10).status_code == 200


# ---- a hostile body that parses slowly --------------------------------------------------


def test_a_slow_to_parse_body_does_not_stall_health(srv, refs):
  """/health answers within 1 s while a 4 MiB body of a million token lists is handled."""
  body = _token_lists()
  assert len(body) < MAX_BODY

  async def run():
    async with _client(srv) as c, _client(srv) as hc:
      task = asyncio.ensure_future(
          c.post("/v1/completions", content=body, headers={"content-type": "application/json"}))
      probes = []
      while not task.done() or len(probes) < 3:
        t = time.monotonic()
        status = (await hc.get("/health", timeout=30)).status_code
        probes.append((status, time.monotonic() - t))
        await asyncio.sleep(0.05)
      return await task, probes

  r, probes = asyncio.run(run())
  worst = max(s for _, s in probes)
  FIGURES["health_max_s_during_1M_token_lists"] = round(worst, 2)
  assert r.status_code == 400 and "prompts exceed" in r.json()["error"]["message"]
  assert all(status == 200 for status, _ in probes), probes
  assert worst < 1.0, f"/health took {worst:.2f} s while the body was parsed"
