"""Cross-process KV transfer pieces (serving/engine/kv_transfer.py) over fake engines.

Real `LLMEngine`s on `FakeRunner`s (their KV pool holds token ids, read back
before every token: a page pulled into the wrong place fails the output
check), real `jax.experimental.transfer` servers in this process; the HTTP side
channel is replaced by direct calls to the sender (`side_channel`). Checked:
- an offer pins the prompt's pages; a pull writes them into the decode pool
  under the prompt's hashes, the offer is released after its last chunk, and
  the decode engine then computes only the last partial page and outputs
  what one engine outputs;
- an offer nobody pulls is released after the timeout (a fake clock);
- an offer pinned at the request's output (the prefill leg's hook) outlives
  requests that churn the whole pool right after it;
- exports refuse other tokens' hashes, unknown chunks and chunks pulled twice;
- a pull step that does not finish in the timeout fails the transfer;
- a handshake with another page format, or an unreachable prefill server,
  raises `KVTransferError` with nothing held on the decode side, and the
  connector then hands back no pages (the request is prefilled there).
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
from frontend_fake import VOCAB, ByteTokenizer
from server_procs import free_port

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.engine.fake_runner import FakeRunner
from serving.engine.kv_transfer import (
  KVReceiver,
  KVSender,
  KVTransferError,
  RemotePrefill,
  _bounded,
  page_format,
  prompt_hashes,
)
from serving.entrypoints.kv_connector import KVConnector
from serving.entrypoints.openai_protocol import KVTransferParams
from serving.runner.kv_transport import KVTransport
from serving.types import SamplingParams

PAGE = 4
CONFIG = EngineConfig.of(max_num_seqs=4, max_model_len=128, page_size=PAGE, num_pages=64,
                         max_num_batched_tokens=64, kv_transfer_pages=2)
PROMPT = list(range(3, 3 + 4 * PAGE + 2))  # 4 full pages (2 chunks) and a partial one


def _engine(page_size: int = PAGE) -> LLMEngine:
  config = CONFIG.replace(page_size=page_size)
  runner = FakeRunner(num_pages=config.cache.num_pages, page_size=page_size,
                      max_num_seqs=config.scheduler.max_num_seqs, vocab_size=VOCAB)
  engine = LLMEngine(runner=runner, tokenizer=ByteTokenizer(), config=config, model_name="fake")
  engine.start()
  return engine


def _run(engine: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
  outs = []
  done = threading.Event()

  def on_output(out) -> None:
    outs.append(out)
    if out.finished:
      done.set()

  engine.add_request(f"r{id(outs)}", prompt, SamplingParams(max_tokens=max_tokens,
                                                            ignore_eos=True), on_output)
  assert done.wait(30)
  return [t for o in outs for t in o.token_ids]


def _referenced(engine: LLMEngine) -> list[int]:
  a = engine.allocator
  return engine.call_soon(lambda: [p for p in range(1, a.num_pages) if a.refcount(p)]).result()


def _transport(engine: LLMEngine) -> KVTransport:
  """A real transfer server on loopback for chunks of `engine`'s page format."""
  fmt = page_format(engine)
  return KVTransport("127.0.0.1", fmt.chunk_shape, fmt.kv_dtype)


def side_channel(sender: KVSender, engine_id: str = "p0"):
  """The prefill server's side channel as direct calls (kv_connector.py serves it)."""

  def fetch(method: str, url: str, body, timeout_s: float):
    if url.endswith("/handshake"):
      return {"engine_id": engine_id, "format": sender.format.to_json(),
              "transfer_address": sender.transport.address()}
    if url.endswith("/pull"):
      try:
        return {"uuid": sender.export(body["remote_request_id"], body["chunk"],
                                      [bytes.fromhex(h) for h in body["hashes"]])}
      except (KeyError, ValueError) as e:
        raise KVTransferError(str(e)) from None
    return {"released": sender.release(body["remote_request_id"])}

  return fetch


@pytest.fixture
def engines():
  made = []

  def make(page_size: int = PAGE) -> LLMEngine:
    made.append(_engine(page_size))
    return made[-1]

  yield make
  for e in made:
    e.shutdown()


def _offered(prefill: LLMEngine, **kw) -> tuple[KVSender, object]:
  sender = KVSender(prefill, _transport(prefill), **{"timeout_s": 30.0, **kw})
  _run(prefill, PROMPT, 1)
  offer = prefill.call_soon(lambda: sender.pin(PROMPT)).result()
  assert offer is not None and len(offer.pages) == 4
  return sender, offer


def test_pull_writes_the_offered_pages(engines):
  prefill, decode = engines(), engines()
  sender, offer = _offered(prefill)
  assert sorted(_referenced(prefill)) == sorted(offer.pages)
  receiver = KVReceiver(decode, _transport(decode), side_channel(sender), 10.0)
  held = receiver.pull(RemotePrefill("p0", offer.id, "127.0.0.1", 1, 4), PROMPT)
  assert len(held) == 4 and sorted(_referenced(decode)) == sorted(held)
  assert sender.num_pending == 0 and _referenced(prefill) == []  # released after chunk 2
  hashes = prompt_hashes(PROMPT, PAGE)
  assert decode.call_soon(lambda: [decode.allocator.lookup(h) for h in hashes]).result() == held
  receiver.release(held)
  assert _run(decode, PROMPT, 6) == [PROMPT[i % len(PROMPT)] for i in range(6)]
  stats = decode.stats()
  assert stats.prefix_cache_hits_total == 4 * PAGE  # only the partial page was computed
  assert _referenced(decode) == []
  assert receiver.pulls_total == 1 and receiver.pages_total == 4 and receiver.bytes_total > 0


def test_unpulled_offer_expires(engines):
  prefill = engines()
  now = [0.0]
  sender, offer = _offered(prefill, timeout_s=5.0, clock=lambda: now[0])
  now[0] = 4.0
  assert sender.expire() == 0 and _referenced(prefill)
  now[0] = 5.0
  assert sender.expire() == 1 and sender.expired_total == 1
  assert _referenced(prefill) == []
  with pytest.raises(KeyError):
    sender.export(offer.id, 0, prompt_hashes(PROMPT, PAGE)[:2])


def test_export_checks_tokens_and_chunks(engines):
  prefill = engines()
  sender, offer = _offered(prefill)
  hashes = prompt_hashes(PROMPT, PAGE)
  other = prompt_hashes([t + 1 for t in PROMPT], PAGE)
  with pytest.raises(ValueError, match="tokens differ"):
    sender.export(offer.id, 0, other[:2])
  with pytest.raises(ValueError, match="chunk 2"):
    sender.export(offer.id, 2, [])
  sender.export(offer.id, 0, hashes[:2])
  with pytest.raises(ValueError, match="chunk 0"):
    sender.export(offer.id, 0, hashes[:2])
  assert sender.release(offer.id) and _referenced(prefill) == []


def test_handshake_mismatch_moves_nothing(engines):
  prefill, decode = engines(), engines(page_size=2 * PAGE)
  sender, offer = _offered(prefill)
  receiver = KVReceiver(decode, _transport(decode), side_channel(sender), 10.0)
  with pytest.raises(KVTransferError, match="page_size differs"):
    receiver.pull(RemotePrefill("p0", offer.id, "127.0.0.1", 1, 4), PROMPT)
  assert receiver.failures_total == 1 and _referenced(decode) == []
  assert sender.num_pending == 0 and _referenced(prefill) == []  # told to release


def test_wrong_engine_id_moves_nothing(engines):
  prefill, decode = engines(), engines()
  sender, offer = _offered(prefill)
  receiver = KVReceiver(decode, _transport(decode), side_channel(sender), 10.0)
  with pytest.raises(KVTransferError, match="not p1"):
    receiver.pull(RemotePrefill("p1", offer.id, "127.0.0.1", 1, 4), PROMPT)
  assert _referenced(decode) == []


def test_unreachable_prefill_server_gives_no_pages(engines):
  decode = engines()
  connector = KVConnector(decode, "decode", timeout_s=2.0, host="127.0.0.1")
  params = KVTransferParams(do_remote_prefill=True, remote_engine_id="gone",
                            remote_request_id="x", remote_block_ids=[1, 2, 3, 4],
                            remote_host="127.0.0.1", remote_port=free_port())
  assert connector.pull(params, PROMPT) == []
  assert connector.receiver.failures_total == 1 and _referenced(decode) == []
  assert _run(decode, PROMPT, 3) == PROMPT[:3]


def test_page_format_round_trip(engines):
  engine = engines()
  fmt = KVSender(engine, _transport(engine), 1.0).format
  assert type(fmt).from_json(fmt.to_json()) == fmt
  assert fmt.mismatch(dataclasses.replace(fmt, kv_dtype="bfloat16")) == (
      "kv_dtype differs: 'bfloat16' there, 'int32' here")
  with pytest.raises(ValueError, match="not a KV page format"):
    type(fmt).from_json({"model": "m"})
  with pytest.raises(ValueError, match="must be positive"):
    KVSender(engines(), None, 0.0)


def test_a_step_past_the_timeout_fails_the_transfer():
  # A jax pull of an array the other side never offers does not end by its own timeout:
  # every pull runs under `_bounded`.
  with pytest.raises(KVTransferError, match="did not finish in 0.05 s"):
    _bounded(lambda: threading.Event().wait(2), 0.05)
  with pytest.raises(KVTransferError, match="pull failed: boom"):
    _bounded(lambda: (_ for _ in ()).throw(RuntimeError("boom")), 1.0)
  assert _bounded(lambda: 7, 1.0) == 7


def test_pin_at_output_survives_later_evictions(engines):
  # A prefill leg pins at its output, on the engine thread (openai_serving's hook):
  # requests that churn the whole pool right after it cannot evict the offered pages.
  prefill = engines()
  sender = KVSender(prefill, _transport(prefill), timeout_s=30.0)
  pinned, done = [], threading.Event()

  def on_output(out) -> None:
    if not pinned:
      pinned.append(sender.pin(PROMPT))
    if out.finished:
      done.set()

  prefill.add_request("leg", PROMPT, SamplingParams(max_tokens=1, ignore_eos=True), on_output)
  assert done.wait(30) and pinned[0] is not None and len(pinned[0].pages) == 4
  for i in range(6):  # 6 x 25 pages of other prompts through a 64-page pool
    _run(prefill, [VOCAB - 1 - i] * 100, 1)
  hashes = prompt_hashes(PROMPT, PAGE)
  assert prefill.call_soon(lambda: [prefill.allocator.lookup(h) for h in hashes]
                           ).result() == pinned[0].pages
  assert sorted(_referenced(prefill)) == sorted(pinned[0].pages)
  sender.release(pinned[0].id)
  assert _referenced(prefill) == []
