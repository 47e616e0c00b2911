"""gRPC front end over the fake engine: Generate, Tokenize, health, reflection, errors, aborts."""

import pathlib
import re

import grpc
import pytest
from frontend_fake import InProcessServer, fake_engine, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from serving.entrypoints.proto import generate as proto_gen
from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2 as pb
from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def srv():
  engine = fake_engine(max_num_seqs=4, max_model_len=256, num_pages=64, step_s=0.01)
  with InProcessServer(engine) as s:
    yield s


@pytest.fixture(scope="module")
def stub(srv):
  with grpc.insecure_channel(srv.grpc) as channel:
    yield pb_grpc.GenerationStub(channel)


def _idle(engine) -> bool:
  s = engine.stats()
  return s.num_running == 0 and s.num_waiting == 0 and s.num_pages_free == s.num_pages_total


def test_generate_streams_tokens_text_and_usage(stub):
  req = pb.GenerateRequest(text="abc", sampling=pb.SamplingParams(max_tokens=4, logprobs=1),
                           return_prompt_token_ids=True)
  msgs = list(stub.Generate(req))
  assert [list(m.token_ids) for m in msgs] == [[97], [98], [99], [97]]
  assert "".join(m.text for m in msgs) == "abca"
  assert list(msgs[0].prompt_token_ids) == [97, 98, 99]
  assert not msgs[1].prompt_token_ids
  assert msgs[0].logprobs[0].logprob == pytest.approx(-0.5)
  assert msgs[0].logprobs[0].top[0].token_id == 97
  assert [m.finish_reason for m in msgs[:-1]] == [pb.FINISH_REASON_UNSPECIFIED] * 3
  last = msgs[-1]
  assert last.finish_reason == pb.FINISH_REASON_LENGTH
  assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
      3, 4, 7)
  assert len({m.request_id for m in msgs}) == 1


def test_generate_token_ids_chat_and_stop(stub):
  msgs = list(stub.Generate(pb.GenerateRequest(
      token_ids=pb.TokenIds(ids=[104, 105]), sampling=pb.SamplingParams(max_tokens=3))))
  assert "".join(m.text for m in msgs) == "hih"
  chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
  msgs = list(stub.Generate(pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(
      max_tokens=20, stop=["\n"]))))
  assert "".join(m.text for m in msgs) == "<user>hi"
  assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP
  assert msgs[-1].stop_reason == "\n"


def test_every_sampling_parameter_is_accepted(stub):
  s = pb.SamplingParams(max_tokens=2, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05,
                        repetition_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.1,
                        seed=1, stop=["zz"], stop_token_ids=[1], ignore_eos=True, logprobs=2,
                        include_stop_str_in_output=True, skip_special_tokens=False)
  msgs = list(stub.Generate(pb.GenerateRequest(request_id="my-id", text="ab", sampling=s)))
  assert msgs[-1].request_id == "my-id"
  assert len(msgs[0].logprobs[0].top) == 2


@pytest.mark.parametrize("req", [
    pb.GenerateRequest(text="", sampling=pb.SamplingParams(max_tokens=1)),
    pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=1)),
    pb.GenerateRequest(text="a" * 300),
    pb.GenerateRequest(text="a", sampling=pb.SamplingParams(max_tokens=0)),
    pb.GenerateRequest(text="a", sampling=pb.SamplingParams(max_tokens=1000)),
    pb.GenerateRequest(text="a", sampling=pb.SamplingParams(top_p=1.5)),
    pb.GenerateRequest(text="a", sampling=pb.SamplingParams(temperature=-1)),
    pb.GenerateRequest(text="a", sampling=pb.SamplingParams(logprobs=50)),
    pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 100000])),
    pb.GenerateRequest(chat=pb.ChatMessages()),
], ids=["empty", "no prompt", "too long", "max_tokens 0", "max_tokens big", "top_p",
        "temperature", "logprobs", "vocab", "empty chat"])
def test_invalid_argument(stub, req):
  with pytest.raises(grpc.RpcError) as e:
    list(stub.Generate(req))
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert e.value.details()


def test_engine_error_is_internal(stub):
  with pytest.raises(grpc.RpcError) as e:
    list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[0, 97]))))
  assert e.value.code() == grpc.StatusCode.INTERNAL and "injected fault" in e.value.details()


def test_tokenize_detokenize_model_info(stub):
  r = stub.Tokenize(pb.TokenizeRequest(text="hé"))
  assert list(r.token_ids) == list("hé".encode()) and r.count == 3
  assert stub.Detokenize(pb.DetokenizeRequest(token_ids=r.token_ids)).text == "hé"
  info = stub.GetModelInfo(pb.GetModelInfoRequest())
  assert (info.model, info.max_model_len, info.max_num_seqs) == ("fake", 256, 4)


def test_health_and_reflection(srv):
  with grpc.insecure_channel(srv.grpc) as ch:
    health = health_pb2_grpc.HealthStub(ch)
    for service in ("", "xlaserve.v1.Generation"):
      resp = health.Check(health_pb2.HealthCheckRequest(service=service))
      assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    req = reflection_pb2.ServerReflectionRequest(list_services="")
    resp = next(iter(refl.ServerReflectionInfo(iter([req]))))
    names = {s.name for s in resp.list_services_response.service}
    assert {"xlaserve.v1.Generation", "grpc.health.v1.Health"} <= names


def test_cancel_mid_stream_frees_pages(srv, stub):
  call = stub.Generate(pb.GenerateRequest(text="ab", sampling=pb.SamplingParams(max_tokens=250)))
  it = iter(call)
  next(it)
  assert srv.engine.stats().num_pages_free < srv.engine.stats().num_pages_total
  call.cancel()
  assert wait_for(lambda: _idle(srv.engine), 1.0)  # long before the 2.5 s generation ends


def test_deadline_aborts(srv, stub):
  with pytest.raises(grpc.RpcError) as e:
    list(stub.Generate(pb.GenerateRequest(text="ab", sampling=pb.SamplingParams(max_tokens=250)),
                       timeout=0.3))
  assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
  assert wait_for(lambda: _idle(srv.engine), 1.0)


def test_resource_exhausted_with_retry_after():
  engine = fake_engine(max_num_seqs=1, max_model_len=256, num_pages=64, step_s=0.02)
  with InProcessServer(engine, max_queued_requests=0) as s, grpc.insecure_channel(s.grpc) as ch:
    stub = pb_grpc.GenerationStub(ch)
    busy = stub.Generate(pb.GenerateRequest(text="ab",
                                            sampling=pb.SamplingParams(max_tokens=200)))
    next(iter(busy))
    with pytest.raises(grpc.RpcError) as e:
      list(stub.Generate(pb.GenerateRequest(text="ab")))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(e.value.trailing_metadata())["retry-after"] == "1"
    busy.cancel()


def test_api_key_metadata():
  with InProcessServer(api_key="k3y") as s, grpc.insecure_channel(s.grpc) as ch:
    stub = pb_grpc.GenerationStub(ch)
    req = pb.GenerateRequest(text="ab", sampling=pb.SamplingParams(max_tokens=1))
    for metadata in [None, (("authorization", "Bearer wrong"),)]:
      with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, metadata=metadata))
      assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
      with pytest.raises(grpc.RpcError) as e:
        stub.Tokenize(pb.TokenizeRequest(text="a"), metadata=metadata)
      assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    msgs = list(stub.Generate(req, metadata=(("authorization", "Bearer k3y"),)))
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def _without_version_stamps(stub: str) -> str:
  """The generated code minus the generator's version stamps, which move with each
  grpcio-tools release on PyPI while the code they stamp stays the same."""
  stub = re.sub(r"# Protobuf Python Version: .*", "", stub)
  stub = re.sub(r"ValidateProtobufRuntimeVersion\([^)]*\)", "", stub)
  return re.sub(r"GRPC_GENERATED_VERSION = .*", "", stub)


def test_checked_in_stubs_are_fresh(tmp_path):
  proto_gen.generate(tmp_path)
  for name in ("xlaserve_pb2.py", "xlaserve_pb2_grpc.py"):
    rel = pathlib.Path("serving/entrypoints/proto/xlaserve/v1") / name
    fresh = _without_version_stamps((tmp_path / rel).read_text())
    assert _without_version_stamps((proto_gen.ROOT / rel).read_text()) == fresh, (
        f"{rel} is stale: run `python -m serving.entrypoints.proto.generate`")


def test_requirements_cover_the_stubs_version_stamps():
  """The checked-in stubs refuse older runtimes: pyproject must not admit them."""
  stub_dir = proto_gen.ROOT / "serving/entrypoints/proto/xlaserve/v1"
  grpc_stamp = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'",
                         (stub_dir / "xlaserve_pb2_grpc.py").read_text()).group(1)
  pb_stamp = re.search(r"# Protobuf Python Version: ([\d.]+)",
                       (stub_dir / "xlaserve_pb2.py").read_text()).group(1)
  pyproject = (proto_gen.ROOT / "pyproject.toml").read_text()
  assert f'"grpcio>={grpc_stamp}"' in pyproject
  assert f'"protobuf>={pb_stamp}' in pyproject


def test_message_size_limit():
  with InProcessServer(max_body_bytes=1000) as s, grpc.insecure_channel(s.grpc) as ch:
    with pytest.raises(grpc.RpcError) as e:
      pb_grpc.GenerationStub(ch).Tokenize(pb.TokenizeRequest(text="a" * 2000))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_request_ids_are_labels(srv, stub):
  """Two clients may pick the same id, an id may be reused right after a cancel, and an
  id is echoed back; the engine never sees them (no collision, no cross-abort)."""
  sampling = pb.SamplingParams(max_tokens=30)
  first = stub.Generate(pb.GenerateRequest(text="ab", request_id="dup", sampling=sampling))
  second = stub.Generate(pb.GenerateRequest(text="cd", request_id="dup", sampling=sampling))
  a, b = list(first), list(second)
  assert {m.request_id for m in a + b} == {"dup"}
  assert "".join(m.text for m in a) == "ab" * 15 and "".join(m.text for m in b) == "cd" * 15
  cancelled = stub.Generate(pb.GenerateRequest(text="ab", request_id="again",
                                               sampling=pb.SamplingParams(max_tokens=250)))
  next(iter(cancelled))
  cancelled.cancel()
  again = list(stub.Generate(pb.GenerateRequest(text="ab", request_id="again",
                                                sampling=pb.SamplingParams(max_tokens=4))))
  assert again[-1].finish_reason == pb.FINISH_REASON_LENGTH


BAD_GENERATE = [
    ("request id of 1 MB", pb.GenerateRequest(text="ab", request_id="x" * 1_000_000)),
    ("temperature inf", pb.GenerateRequest(text="ab", sampling=pb.SamplingParams(
        temperature=float("inf")))),
    ("top_p nan", pb.GenerateRequest(text="ab", sampling=pb.SamplingParams(top_p=float("nan")))),
    ("200k stop strings", pb.GenerateRequest(text="ab", sampling=pb.SamplingParams(
        stop=["s"] * 200_000))),
    ("token id out of vocabulary", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[300]))),
    ("stop token id out of vocabulary", pb.GenerateRequest(text="ab", sampling=pb.SamplingParams(
        stop_token_ids=[300]))),
]


@pytest.mark.parametrize("name,req", BAD_GENERATE, ids=[c[0] for c in BAD_GENERATE])
def test_bad_generate_requests_are_invalid_argument(stub, name, req):
  with pytest.raises(grpc.RpcError) as e:
    list(stub.Generate(req))
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
  assert e.value.details()


def test_malformed_messages_are_invalid_argument(srv):
  """Bytes that are not a valid request (bad UTF-8 in a string field, corrupt wire format)
  get INVALID_ARGUMENT with a message, not UNKNOWN with protobuf's exception."""
  good = pb.GenerateRequest(text="Hello", sampling=pb.SamplingParams(max_tokens=2))
  bad_utf8 = good.SerializeToString().replace(b"Hello", b"He\xff\xfeo")
  with grpc.insecure_channel(srv.grpc) as ch:
    generate = ch.unary_stream("/xlaserve.v1.Generation/Generate",
                               request_serializer=lambda b: b,
                               response_deserializer=pb.GenerateResponse.FromString)
    tokenize = ch.unary_unary("/xlaserve.v1.Generation/Tokenize",
                              request_serializer=lambda b: b,
                              response_deserializer=pb.TokenizeResponse.FromString)
    for call, raw in ((generate, bad_utf8), (generate, b"\x12\xff\xff\xff\xff\x0f"),
                      (tokenize, b"\x0a\x02\xff\xfe")):
      with pytest.raises(grpc.RpcError) as e:
        result = call(raw)
        list(result) if call is generate else result
      assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
      assert "not a valid message" in e.value.details()
    assert [m.text for m in generate(good.SerializeToString())]  # a valid one still works
