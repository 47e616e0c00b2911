"""A hand-computable stand-in for `serving.engine.LLMEngine` for front-end tests.

Same API as the real engine (add_request / abort / start / shutdown / stats,
`tokenizer`, `config`, `model_config`, `model_name`), no model:
  * the tokenizer is byte-level: token id == UTF-8 byte, 256 = BOS, 257 = EOS;
  * generated token i is prompt token i (cycling), so "abc" with max_tokens=5
    yields "abcab"; stop strings, stop_token_ids and EOS end a request early;
  * the sampled token's logprob is -0.5; top alternative k is token + k with -0.5 - k;
  * a prompt starting with token 0 (NUL) finishes with finish_reason "error";
  * a request holds ceil((prompt + max_tokens) / page_size) KV pages from
    admission until it finishes or is aborted.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from collections.abc import Callable

from serving.config import EngineConfig
from serving.types import RequestOutput, SamplingParams, TokenLogprob

BOS, EOS, VOCAB = 256, 257, 300


class ByteTokenizer:
  """Byte-level tokenizer with a tiny chat template."""

  eos_token_ids = [EOS]
  add_bos_token = False
  vocab_size = VOCAB

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    ids = list(text.encode("utf-8"))
    return [BOS, *ids] if add_special_tokens and self.add_bos_token else ids

  def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

  def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
    text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
    text += "<assistant>" if add_generation_prompt else ""
    return self.encode(text) if tokenize else text


@dataclasses.dataclass
class FakeStats:
  num_running: int = 0
  num_waiting: int = 0
  kv_cache_usage: float = 0.0
  num_pages_total: int = 0
  num_pages_free: int = 0
  num_preemptions_total: int = 0
  prompt_tokens_total: int = 0
  generation_tokens_total: int = 0
  prefix_cache_queries_total: int = 0
  prefix_cache_hits_total: int = 0
  prefill_tokens_computed_total: int = 0


@dataclasses.dataclass
class _Req:
  request_id: str
  prompt: list[int]
  params: SamplingParams
  on_output: Callable[[RequestOutput], None]
  pages: int
  out: list[int] = dataclasses.field(default_factory=list)
  text: str = ""


class FakeEngine:
  """Echo engine: one token per running request every `step_s` seconds."""

  def __init__(self, model: str = "fake", config: EngineConfig | None = None,
               step_s: float | None = None, **engine_kwargs):
    self.model_name = model
    self.config = config or EngineConfig(**engine_kwargs)
    self.tokenizer = ByteTokenizer()
    self.model_config = None
    # Subprocess tests (launcher --engine_class) slow the fake down through the environment.
    self.step_s = step_s or float(os.environ.get("XLASERVE_FAKE_STEP_S", "0.002"))
    self._lock = threading.Lock()
    self._waiting: list[_Req] = []
    self._running: list[_Req] = []
    self._aborts: set[str] = set()
    self._ids: set[str] = set()
    self._stats = FakeStats(num_pages_total=self.config.num_pages or 64)
    self._free = self._stats.num_pages_total
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def add_request(self, request_id, prompt, params, on_output) -> None:
    ids = self.tokenizer.encode(prompt, True) if isinstance(prompt, str) else list(prompt)
    max_len = self.config.max_model_len
    if not ids:
      raise ValueError("prompt is empty")
    if len(ids) > max_len:
      raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len={max_len}")
    if len(ids) + (params.max_tokens or 0) > max_len:
      raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                       f"exceeds max_model_len={max_len}")
    if any(not 0 <= t < VOCAB for t in ids):
      raise ValueError("prompt token id outside the vocabulary")
    max_tokens = params.max_tokens or max_len - len(ids)
    pages = math.ceil((len(ids) + max_tokens) / self.config.page_size)
    with self._lock:
      if request_id in self._ids:
        raise ValueError(f"duplicate request id {request_id!r}")
      self._ids.add(request_id)
      self._waiting.append(_Req(request_id, ids, params, on_output, pages))

  def abort(self, request_id: str) -> None:
    with self._lock:
      self._aborts.add(request_id)

  def start(self) -> None:
    self._thread = threading.Thread(target=self._loop, daemon=True)
    self._thread.start()

  def shutdown(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)

  def stats(self) -> FakeStats:
    with self._lock:
      s = dataclasses.replace(self._stats)
      s.num_running, s.num_waiting = len(self._running), len(self._waiting)
      s.num_pages_free = self._free
      s.kv_cache_usage = 1.0 - self._free / s.num_pages_total
      return s

  def _loop(self) -> None:
    while not self._stop.wait(self.step_s):
      with self._lock:
        self._apply_aborts()
        self._admit()
        emitted = [self._step(r) for r in list(self._running)]
        for r, out in emitted:
          if out.finished:
            self._finish(r)
      for r, out in emitted:
        r.on_output(out)

  def _apply_aborts(self) -> None:
    for q in (self._waiting, self._running):
      for r in [r for r in q if r.request_id in self._aborts]:
        q.remove(r)
        if q is self._running:
          self._free += r.pages
        self._ids.discard(r.request_id)
        r.on_output(RequestOutput(r.request_id, r.prompt, "", [], finish_reason="abort"))
    self._aborts.clear()

  def _admit(self) -> None:
    while (self._waiting and len(self._running) < self.config.max_num_seqs
           and self._waiting[0].pages <= self._free):
      r = self._waiting.pop(0)
      self._free -= r.pages
      self._running.append(r)
      self._stats.prompt_tokens_total += len(r.prompt)
      self._stats.prefill_tokens_computed_total += len(r.prompt)

  def _step(self, r: _Req) -> tuple[_Req, RequestOutput]:
    p = r.params
    if r.prompt[0] == 0:  # a prompt starting with NUL fails, like an engine error would
      return r, RequestOutput(r.request_id, r.prompt, "", [], finish_reason="error",
                              error="boom")
    tok = r.prompt[len(r.out) % len(r.prompt)]
    r.out.append(tok)
    self._stats.generation_tokens_total += 1
    delta = self.tokenizer.decode([tok])
    finish, stop_reason = None, None
    if tok in p.stop_token_ids or (tok == EOS and not p.ignore_eos):
      finish, stop_reason, delta = "stop", tok, ""
    else:
      for s in p.stop:
        if s in r.text + delta:
          keep = (r.text + delta).index(s) + (len(s) if p.include_stop_str_in_output else 0)
          delta, finish, stop_reason = (r.text + delta)[len(r.text):keep], "stop", s
          break
    r.text += delta
    limit = p.max_tokens or self.config.max_model_len - len(r.prompt)
    if finish is None and len(r.out) >= limit:
      finish = "length"
    logprobs = None
    if p.logprobs is not None:
      top = [((tok + k) % 256, -0.5 - k) for k in range(p.logprobs)]
      logprobs = [TokenLogprob(tok, -0.5, top)]
    return r, RequestOutput(r.request_id, r.prompt, delta, [tok], finish_reason=finish,
                            logprobs=logprobs, stop_reason=stop_reason)

  def _finish(self, r: _Req) -> None:
    self._running.remove(r)
    self._free += r.pages
    self._ids.discard(r.request_id)


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
  """Polls `cond` until true or `timeout` seconds pass."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if cond():
      return True
    time.sleep(0.01)
  return cond()


class InProcessServer:
  """`serving.api_server.serve` over a FakeEngine in a background thread (ports picked free).

  Use as a context manager; `.http` is the base URL, `.grpc` the gRPC target.
  """

  def __init__(self, engine: FakeEngine | None = None, **serve_kwargs):
    from serving.entrypoints.api_server import ServeConfig

    self.engine = engine or FakeEngine(max_num_seqs=4, max_model_len=256, num_pages=64)
    kwargs = {"served_model_name": "fake", "http_port": 0, "grpc_port": 0, **serve_kwargs}
    self.cfg = ServeConfig(**kwargs)
    self._ready = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self.error: BaseException | None = None

  def _run(self) -> None:
    import asyncio

    from serving.entrypoints.api_server import serve

    async def main() -> None:
      self._loop = asyncio.get_running_loop()
      self._stop = asyncio.Event()
      await serve(self.engine, self.cfg, self._stop, self._on_ready)

    try:
      asyncio.run(main())
    except BaseException as e:  # surfaced to the test through start()
      self.error = e
      self._ready.set()

  def _on_ready(self, http_port: int | None, grpc_port: int | None) -> None:
    self.http = f"http://127.0.0.1:{http_port}"
    self.grpc = f"127.0.0.1:{grpc_port}"
    self._ready.set()

  def __enter__(self) -> InProcessServer:
    self._thread.start()
    if not self._ready.wait(30) or self.error is not None:
      raise RuntimeError(f"server did not start: {self.error!r}")
    return self

  def stop(self) -> None:
    self._loop.call_soon_threadsafe(self._stop.set)
    self._thread.join(timeout=60)

  def __exit__(self, *exc) -> None:
    self.stop()
