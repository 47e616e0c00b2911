"""Front-end test engines: the real `LLMEngine` over a `FakeRunner`, a byte tokenizer.

`fake_engine(...)` is `serving.engine.LLMEngine` with its scheduler, page
allocator and output processing, driving `serving.engine.fake_runner.FakeRunner`
instead of a model:
  * the tokenizer is byte-level: token id == UTF-8 byte, 256 = BOS, 257 = EOS;
  * generated token i is prompt token i (cycling), so "abc" with max_tokens=5
    yields "abcab"; stop strings, stop_token_ids and EOS end a request early;
  * the sampled token's logprob is -0.5; top alternative k is token + k with -0.5 - k;
  * faults through the Runner seam (tests/runner_faults.py), by the prompt's
    first byte: NUL (0) fails its step with a `StepError` naming it (that
    request finishes with "error", the others of the step are recomputed);
    \x01 loses the device (`RunnerDeadError`: the engine dies); \x02 wedges
    the step (its fetch blocks until the engine shuts down).
`fake_engine_factory` is the launcher's `build_engine` for subprocess tests
(`launch_with.py frontend_fake:fake_engine_factory ...`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from runner_faults import FaultyRunner

from checkpoints.lora import adapter_scaling, read_adapter_config
from serving.config import EngineConfig
from serving.engine import EngineClient, LLMEngine
from serving.engine.fake_runner import FakeRunner

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


def _first_byte(value: int):
  return lambda seq: seq.prompt_ids[0] == value


def fake_lora_loader(path: str) -> tuple[int, None]:
  """Reads and validates a PEFT adapter's config (checkpoints.lora); the FakeRunner needs
  no weights. Under adapter id k, the fake engine's tokens are shifted by k."""
  config = read_adapter_config(path)
  rank, _ = adapter_scaling(config, max_rank=64)
  return rank, None


def fake_engine(config: EngineConfig | None = None, step_s: float = 0.002,
                model: str = "fake", **engine_kwargs) -> LLMEngine:
  """The real engine over a FakeRunner (see module doc); not started. With
  `max_loras`, adapters load through `fake_lora_loader`."""
  config = config or EngineConfig.of(**engine_kwargs)
  runner = FakeRunner(num_pages=config.cache.num_pages or 64, page_size=config.cache.page_size,
                      max_num_seqs=config.scheduler.max_num_seqs, vocab_size=VOCAB, step_s=step_s)
  faulty = FaultyRunner(runner, fail_request=_first_byte(0), dead_request=_first_byte(1),
                        block_request=_first_byte(2))
  return LLMEngine(runner=faulty, tokenizer=ByteTokenizer(), config=config, model_name=model,
                   lora_loader=fake_lora_loader if config.lora.max_loras else None)


def fake_engine_factory(model: str, config: EngineConfig) -> LLMEngine:
  """`launcher.run(build_engine=...)` for subprocesses; `XLASERVE_FAKE_STEP_S` slows it."""
  return fake_engine(config, step_s=float(os.environ.get("XLASERVE_FAKE_STEP_S", "0.002")),
                     model=model)


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
  """Polls `cond` until true or `timeout` seconds pass."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if cond():
      return True
    time.sleep(0.01)
  return cond()


class InProcessServer:
  """`api_server.serve` over an engine (any `EngineClient`; default a fake one) in a
  background thread (ports picked free).

  Use as a context manager; `.http` is the base URL, `.grpc` the gRPC target.
  """

  def __init__(self, engine: EngineClient | None = None, **serve_kwargs):
    from serving.entrypoints.api_server import ServeConfig

    self.engine = engine or fake_engine(max_num_seqs=4, max_model_len=256, num_pages=64)
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
    if self._thread.is_alive():  # not when the server stopped itself (engine dead)
      self._loop.call_soon_threadsafe(self._stop.set)
    self._thread.join(timeout=60)

  def __exit__(self, *exc) -> None:
    self.stop()
