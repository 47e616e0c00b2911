"""OpenAI-compatible HTTP end to end: the real server subprocess with the default model."""

import httpx
import openai
import pytest
from frontend_procs import shared_real_server

pytestmark = pytest.mark.slow  # a real server on the default model

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def srv(request):
  return shared_real_server(request)


@pytest.fixture(scope="module")
def oa(srv):
  return openai.OpenAI(base_url=f"{srv.http}/v1", api_key="unused", max_retries=0, timeout=300)


def test_models(oa):
  assert [m.id for m in oa.models.list().data] == [MODEL]


def test_completion_stream_matches_non_stream(oa):
  kw = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
        "temperature": 0.0}
  comp = oa.completions.create(**kw)
  choice = comp.choices[0]
  assert choice.text and choice.finish_reason in ("length", "stop")
  assert comp.usage.prompt_tokens > 0 and 1 <= comp.usage.completion_tokens <= 4
  streamed = "".join(c.choices[0].text for c in oa.completions.create(**kw, stream=True))
  assert streamed == choice.text  # greedy: same tokens either way


def test_chat_stream_and_not(oa):
  kw = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3,
        "temperature": 0.0}
  chat = oa.chat.completions.create(**kw, logprobs=True, top_logprobs=2)
  msg = chat.choices[0].message
  assert msg.role == "assistant" and msg.content
  content = chat.choices[0].logprobs.content
  assert len(content) == chat.usage.completion_tokens
  assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
  chunks = list(oa.chat.completions.create(**kw, stream=True,
                                           stream_options={"include_usage": True}))
  assert chunks[0].choices[0].delta.role == "assistant"
  text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  assert text == msg.content
  assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_bad_requests_get_4xx_and_the_server_keeps_serving(srv):
  long_prompt = "hello " * 600  # > max_model_len=512 tokens
  cases = [
      (b'{"model": "smollm2', 400),
      (b'{"model": "smollm2-135m-instruct", "prompt": "\xc3\x28"}', 400),
      ({"model": "nope", "prompt": "a"}, 404),
      ({"model": MODEL, "prompt": ""}, 400),
      ({"model": MODEL, "prompt": long_prompt}, 400),
      ({"model": MODEL, "prompt": "a", "max_tokens": 0}, 400),
      ({"model": MODEL, "prompt": "a", "max_tokens": 100000}, 400),
      ({"model": MODEL, "prompt": "a", "temperature": -1}, 400),
      ({"model": MODEL, "prompt": "a", "top_p": 0}, 400),
      ({"model": MODEL, "prompt": "a", "n": 17}, 400),
      ({"model": MODEL, "prompt": "a", "max_tokens": "3"}, 400),
      ({"model": MODEL, "prompt": "a", "bogus": True}, 400),
      ({"model": MODEL, "prompt": [0, 10**9]}, 400),
  ]
  with httpx.Client(base_url=srv.http, timeout=60) as c:
    for body, status in cases:
      kw = {"content": body} if isinstance(body, bytes) else {"json": body}
      r = c.post("/v1/completions", headers={"content-type": "application/json"}, **kw)
      assert r.status_code == status, (body, r.text)
      assert r.json()["error"]["message"]
    r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": "hi"}], "response_format": {"type": "xml"}})
    assert r.status_code == 400 and "response_format" in r.json()["error"]["message"]
    assert c.get("/health").status_code == 200
    ok = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert ok.status_code == 200
