"""OpenAI-compatible HTTP server over the fake engine (in-process, real sockets)."""

import json

import httpx
import openai
import pytest
from frontend_fake import EOS, InProcessServer, fake_engine, wait_for

from serving.engine.kv_events import wire_hash
from serving.engine.page_allocator import page_hash


@pytest.fixture(scope="module")
def srv():
  engine = fake_engine(max_num_seqs=4, max_model_len=256, num_pages=64, step_s=0.01)
  with InProcessServer(engine) as s:
    yield s


@pytest.fixture(scope="module")
def client(srv):
  with httpx.Client(base_url=srv.http, timeout=20) as c:
    yield c


def _idle(engine) -> bool:
  s = engine.stats()
  return s.num_running == 0 and s.num_waiting == 0 and s.num_pages_free == s.num_pages_total


def test_models_and_health(client):
  models = client.get("/v1/models").json()
  assert [m["id"] for m in models["data"]] == ["fake"]
  assert models["data"][0]["max_model_len"] == 256
  assert client.get("/health").json() == {"status": "ok"}


def test_completion_is_hand_computable(client):
  r = client.post("/v1/completions", json={"model": "fake", "prompt": "abc", "max_tokens": 5})
  assert r.status_code == 200, r.text
  body = r.json()
  assert body["object"] == "text_completion"
  assert body["choices"] == [{"index": 0, "text": "abcab", "logprobs": None,
                              "finish_reason": "length"}]
  assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


def test_a_request_without_model_takes_the_served_model(client):
  """As vLLM and SGLang: `model` may be left out (or null); the response names the base."""
  for model in ({}, {"model": None}):
    r = client.post("/v1/completions", json={**model, "prompt": "abc", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "fake" and r.json()["choices"][0]["text"] == "ab"
  r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                "max_tokens": 2})
  assert r.status_code == 200, r.text
  assert r.json()["model"] == "fake"


def test_completion_many_prompts_and_n(client):
  r = client.post("/v1/completions", json={"model": "fake", "prompt": ["ab", "xyz"], "n": 2,
                                           "max_tokens": 3, "seed": 7})
  body = r.json()
  assert [(c["index"], c["text"]) for c in body["choices"]] == [
      (0, "aba"), (1, "aba"), (2, "xyz"), (3, "xyz")]
  assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}


def test_completion_token_id_prompts(client):
  r = client.post("/v1/completions", json={"model": "fake", "prompt": [104, 105],
                                           "max_tokens": 3})
  assert r.json()["choices"][0]["text"] == "hih"
  r = client.post("/v1/completions", json={"model": "fake", "prompt": [[104], [105]],
                                           "max_tokens": 1})
  assert [c["text"] for c in r.json()["choices"]] == ["h", "i"]


def test_completion_logprobs(client):
  r = client.post("/v1/completions", json={"model": "fake", "prompt": "ab", "max_tokens": 2,
                                           "logprobs": 2})
  lp = r.json()["choices"][0]["logprobs"]
  assert lp["tokens"] == ["a", "b"]
  assert lp["token_logprobs"] == [-0.5, -0.5]
  assert lp["top_logprobs"] == [{"a": -0.5, "b": -1.5}, {"b": -0.5, "c": -1.5}]
  assert lp["text_offset"] == [0, 1]


def test_stop_strings_and_stop_token_ids(client):
  r = client.post("/v1/completions", json={"model": "fake", "prompt": "abcabc", "max_tokens": 6,
                                           "stop": ["c"]})
  c = r.json()["choices"][0]
  assert (c["text"], c["finish_reason"]) == ("ab", "stop")
  r = client.post("/v1/completions", json={"model": "fake", "prompt": "abcd", "max_tokens": 6,
                                           "stop_token_ids": [99]})
  c = r.json()["choices"][0]
  assert (c["text"], c["finish_reason"]) == ("ab", "stop")
  r = client.post("/v1/completions", json={"model": "fake", "prompt": [97, EOS], "max_tokens": 4,
                                           "ignore_eos": True})
  assert r.json()["choices"][0]["finish_reason"] == "length"


def test_vllm_extra_sampling_fields_accepted(client):
  body = {"model": "fake", "prompt": "ab", "max_tokens": 2, "top_k": 5, "min_p": 0.1,
          "repetition_penalty": 1.1, "ignore_eos": True, "stop_token_ids": [1], "seed": 3,
          "temperature": 0.0, "top_p": 0.9, "presence_penalty": 0.5, "frequency_penalty": 0.5}
  assert client.post("/v1/completions", json=body).status_code == 200


def test_chat_applies_template(client):
  r = client.post("/v1/chat/completions", json={
      "model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9})
  body = r.json()
  assert body["object"] == "chat.completion"
  # The fake template renders "<user>hi\n<assistant>", which the engine echoes.
  assert body["choices"][0]["message"] == {"role": "assistant", "content": "<user>hi\n"}
  assert body["usage"]["prompt_tokens"] == len("<user>hi\n<assistant>")


def test_chat_content_parts_logprobs_and_max_completion_tokens(client):
  r = client.post("/v1/chat/completions", json={
      "model": "fake", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
      "max_completion_tokens": 2, "max_tokens": 50, "logprobs": True, "top_logprobs": 1})
  choice = r.json()["choices"][0]
  assert choice["message"]["content"] == "<u"
  content = choice["logprobs"]["content"]
  assert [e["token"] for e in content] == ["<", "u"]
  assert content[0]["top_logprobs"] == [{"token": "<", "logprob": -0.5, "bytes": [60]}]


def _sse(lines) -> list:
  events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
  assert events[-1] == "[DONE]"
  return [json.loads(e) for e in events[:-1]]


def test_chat_stream_with_usage(client):
  body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
          "stream": True, "stream_options": {"include_usage": True}}
  with client.stream("POST", "/v1/chat/completions", json=body) as r:
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = _sse(list(r.iter_lines()))
  assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
  text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
  assert text == "<use"
  assert chunks[-2]["choices"][0]["finish_reason"] == "length"
  assert chunks[-1]["choices"] == []
  assert chunks[-1]["usage"]["completion_tokens"] == 4
  assert all(c["usage"] is None for c in chunks[:-1])


def test_completion_stream_n2(client):
  body = {"model": "fake", "prompt": "ab", "max_tokens": 3, "n": 2, "stream": True}
  with client.stream("POST", "/v1/completions", json=body) as r:
    chunks = _sse(list(r.iter_lines()))
  texts = {0: "", 1: ""}
  for c in chunks:
    texts[c["choices"][0]["index"]] += c["choices"][0]["text"]
    assert "usage" not in c
  assert texts == {0: "aba", 1: "aba"}


def test_openai_client(srv):
  oa = openai.OpenAI(base_url=f"{srv.http}/v1", api_key="unused", max_retries=0)
  comp = oa.completions.create(model="fake", prompt="abc", max_tokens=4)
  assert comp.choices[0].text == "abca"
  chat = oa.chat.completions.create(model="fake", max_tokens=3,
                                    messages=[{"role": "user", "content": "q"}],
                                    extra_body={"top_k": 3})
  assert chat.choices[0].message.content == "<us"
  stream = oa.chat.completions.create(model="fake", max_tokens=3, stream=True,
                                      messages=[{"role": "user", "content": "q"}],
                                      stream_options={"include_usage": True})
  chunks = list(stream)
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "<us"
  assert chunks[-1].usage.completion_tokens == 3
  text = "".join(c.choices[0].text for c in oa.completions.create(
      model="fake", prompt="xy", max_tokens=3, stream=True))
  assert text == "xyx"
  with pytest.raises(openai.NotFoundError):
    oa.completions.create(model="nope", prompt="a", max_tokens=1)
  assert oa.models.retrieve("fake").id == "fake"
  with pytest.raises(openai.NotFoundError):
    oa.models.retrieve("nope")


BAD_REQUESTS = [
    ("malformed json", b'{"model": "fake", ', 400, "invalid_json"),
    ("not an object", b'[1, 2]', 400, "invalid_json"),
    ("invalid utf-8", b'{"model": "fake", "prompt": "\xff\xfe"}', 400, "invalid_encoding"),
    ("lone surrogate", b'{"model": "fake", "prompt": "\\ud800"}', 400, None),
    ("wrong type", {"model": "fake", "prompt": "a", "max_tokens": "5"}, 400, "invalid_value"),
    ("prompt wrong type", {"model": "fake", "prompt": 5}, 400, "invalid_value"),
    ("unknown model", {"model": "gpt-9", "prompt": "a"}, 404, "model_not_found"),
    ("model wrong type", {"model": 5, "prompt": "a"}, 400, "invalid_value"),
    ("empty prompt", {"model": "fake", "prompt": ""}, 400, None),
    ("empty prompt list", {"model": "fake", "prompt": []}, 400, None),
    ("prompt too long", {"model": "fake", "prompt": "a" * 300}, 400, "context_length_exceeded"),
    ("max_tokens zero", {"model": "fake", "prompt": "a", "max_tokens": 0}, 400, "invalid_value"),
    ("max_tokens negative", {"model": "fake", "prompt": "a", "max_tokens": -3}, 400,
     "invalid_value"),
    ("max_tokens too large", {"model": "fake", "prompt": "a", "max_tokens": 256}, 400,
     "context_length_exceeded"),
    ("temperature < 0", {"model": "fake", "prompt": "a", "temperature": -0.1}, 400, None),
    ("top_p zero", {"model": "fake", "prompt": "a", "top_p": 0.0}, 400, None),
    ("top_p > 1", {"model": "fake", "prompt": "a", "top_p": 1.5}, 400, None),
    ("huge n", {"model": "fake", "prompt": "a", "n": 1000}, 400, "limit_exceeded"),
    ("logprobs > 20", {"model": "fake", "prompt": "a", "logprobs": 21}, 400, "invalid_value"),
    ("token id out of vocab", {"model": "fake", "prompt": [1, 99999]}, 400, None),
    ("unknown field", {"model": "fake", "prompt": "a", "frobnicate": 1}, 400,
     "unknown_parameter"),
    ("response_format unknown type", {"model": "fake", "prompt": "a",
                                      "response_format": {"type": "xml"}}, 400, None),
    ("two constraints", {"model": "fake", "prompt": "a", "guided_regex": "a",
                         "structured_outputs": {"choice": ["b"]}}, 400, None),
    ("stream_options without stream", {"model": "fake", "prompt": "a",
                                       "stream_options": {"include_usage": True}}, 400, None),
    ("echo", {"model": "fake", "prompt": "a", "echo": True}, 400, None),
]


@pytest.mark.parametrize("name,body,status,code", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_completion_requests(client, name, body, status, code):
  content = body if isinstance(body, bytes) else json.dumps(body).encode()
  r = client.post("/v1/completions", content=content,
                  headers={"content-type": "application/json"})
  assert r.status_code == status, r.text
  err = r.json()["error"]
  assert set(err) == {"message", "type", "param", "code"}
  assert err["message"] and err["type"]
  if code is not None:
    assert err["code"] == code
  assert client.get("/health").status_code == 200  # still serving


BAD_CHATS = [
    ("no messages", {"model": "fake", "messages": []}),
    ("bad role", {"model": "fake", "messages": [{"role": "wizard", "content": "x"}]}),
    ("image part", {"model": "fake", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
    ("tool_choice required without tools", {"model": "fake", "tool_choice": "required",
                                            "messages": [{"role": "user", "content": "x"}]}),
    ("tool without a name", {"model": "fake", "messages": [{"role": "user", "content": "x"}],
                             "tools": [{"type": "function", "function": {}}]}),
    ("top_logprobs without logprobs", {"model": "fake", "top_logprobs": 2,
                                       "messages": [{"role": "user", "content": "x"}]}),
    ("max_completion_tokens zero", {"model": "fake", "max_completion_tokens": 0,
                                    "messages": [{"role": "user", "content": "x"}]}),
]


@pytest.mark.parametrize("name,body", BAD_CHATS, ids=[b[0] for b in BAD_CHATS])
def test_bad_chat_requests(client, name, body):
  r = client.post("/v1/chat/completions", json=body)
  assert r.status_code == 400, r.text
  assert r.json()["error"]["message"]


def test_unknown_route_and_method(client):
  r = client.get("/v1/nothing")
  assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
  assert client.get("/v1/completions").status_code == 405


def test_body_size_limit():
  with InProcessServer(max_body_bytes=1000) as s:
    r = httpx.post(f"{s.http}/v1/completions", json={"model": "fake", "prompt": "a" * 2000})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_api_key():
  with InProcessServer(api_key="s3cret") as s:
    body = {"model": "fake", "prompt": "ab", "max_tokens": 1}
    assert httpx.post(f"{s.http}/v1/completions", json=body).status_code == 401
    bad = httpx.post(f"{s.http}/v1/completions", json=body,
                     headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    ok = httpx.post(f"{s.http}/v1/completions", json=body,
                    headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    assert httpx.get(f"{s.http}/health").status_code == 200


def test_queue_limit_429():
  engine = fake_engine(max_num_seqs=1, max_model_len=256, num_pages=64, step_s=0.02)
  with InProcessServer(engine, max_queued_requests=1) as s, httpx.Client(timeout=20) as c:
    body = {"model": "fake", "prompt": "ab", "max_tokens": 200, "stream": True}
    streams = [c.stream("POST", f"{s.http}/v1/completions", json=body) for _ in range(2)]
    responses = [st.__enter__() for st in streams]
    assert [r.status_code for r in responses] == [200, 200]
    r = c.post(f"{s.http}/v1/completions", json={**body, "stream": False})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    for st in streams:
      st.__exit__(None, None, None)
    assert wait_for(lambda: _idle(engine), 5)
    assert c.post(f"{s.http}/v1/completions", json={**body, "stream": False,
                                                    "max_tokens": 1}).status_code == 200


def test_stream_disconnect_aborts_and_frees_pages(srv):
  body = {"model": "fake", "prompt": "ab", "max_tokens": 250, "stream": True}  # 2.5 s
  with httpx.Client(timeout=20) as c, c.stream("POST", f"{srv.http}/v1/completions",
                                               json=body) as r:
    lines = r.iter_lines()
    assert next(lines).startswith("data: ")
    assert srv.engine.stats().num_running == 1
  assert wait_for(lambda: _idle(srv.engine), 1.0)


def test_non_stream_disconnect_aborts(srv):
  body = {"model": "fake", "prompt": "ab", "max_tokens": 250}
  with pytest.raises(httpx.ReadTimeout):
    httpx.post(f"{srv.http}/v1/completions", json=body, timeout=0.3)
  assert wait_for(lambda: _idle(srv.engine), 1.0)


def test_stream_logprobs_offsets_are_cumulative(client):
  body = {"model": "fake", "prompt": "abc", "max_tokens": 3, "stream": True, "logprobs": 1}
  with client.stream("POST", "/v1/completions", json=body) as r:
    chunks = _sse(list(r.iter_lines()))
  lps = [c["choices"][0]["logprobs"] for c in chunks]
  assert [lp["text_offset"] for lp in lps] == [[0], [1], [2]]
  assert [lp["tokens"] for lp in lps] == [["a"], ["b"], ["c"]]


def test_engine_error_is_a_500(client):
  r = client.post("/v1/completions", json={"model": "fake", "prompt": [0, 97], "max_tokens": 3})
  assert r.status_code == 500
  error = r.json()["error"]
  assert error["type"] == "server_error" and "injected fault" in error["message"]
  body = {"model": "fake", "prompt": [0, 97], "max_tokens": 3, "stream": True}
  with client.stream("POST", "/v1/completions", json=body) as r:
    chunks = _sse(list(r.iter_lines()))
  assert "injected fault" in chunks[-1]["error"]["message"]


def test_tokenize_detokenize(client):
  r = client.post("/tokenize", json={"model": "fake", "prompt": "hé"})
  assert r.json() == {"tokens": [104, 195, 169], "count": 3, "max_model_len": 256}
  r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]})
  assert r.json()["count"] == len("<user>x\n<assistant>")
  assert client.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
  assert client.post("/tokenize", json={"model": "fake"}).status_code == 400
  assert client.post("/detokenize", json={"tokens": [10**6]}).status_code == 400


def test_prefix_cache_view_and_reset(client):
  assert client.post("/reset_prefix_cache").status_code == 200
  assert client.get("/debug/prefix_cache").json() == {
      "engines": [{"data_parallel_rank": 0, "block_hashes": []}]}
  prompt = "0123456789abcdefghijklmnopqrstuvwxyzABCD"  # 40 byte tokens: two full pages
  r = client.post("/v1/completions", json={"model": "fake", "prompt": prompt, "max_tokens": 1})
  assert r.status_code == 200
  tokens = list(prompt.encode())
  first = page_hash(None, tokens[:16])
  expected = sorted([wire_hash(first), wire_hash(page_hash(first, tokens[16:32]))])
  assert client.get("/debug/prefix_cache").json()["engines"][0]["block_hashes"] == expected
  r = client.post("/reset_prefix_cache")
  assert (r.status_code, r.content) == (200, b"")
  assert client.get("/debug/prefix_cache").json()["engines"][0]["block_hashes"] == []


def test_prefix_cache_routes_need_the_api_key():
  with InProcessServer(api_key="s3cret") as s:
    assert httpx.post(f"{s.http}/reset_prefix_cache").status_code == 401
    assert httpx.get(f"{s.http}/debug/prefix_cache").status_code == 401
    ok = httpx.get(f"{s.http}/debug/prefix_cache", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200


def test_prefix_cache_routes_on_a_dead_engine_are_503():
  engine = fake_engine(max_num_seqs=4, max_model_len=256, num_pages=64)
  with InProcessServer(engine) as s:
    body = {"model": "fake", "prompt": "\x01 lose the device", "max_tokens": 2}
    assert httpx.post(f"{s.http}/v1/completions", json=body, timeout=20).status_code >= 500
    assert wait_for(lambda: engine.health() is not None)
    for r in (httpx.post(f"{s.http}/reset_prefix_cache", timeout=20),
              httpx.get(f"{s.http}/debug/prefix_cache", timeout=20)):
      assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
