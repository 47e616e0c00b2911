"""gRPC end to end on the real server: streaming Generate, Tokenize, health, reflection, cancel."""

import json

import grpc
import pytest
from frontend_procs import metric_value, shared_real_server, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2 as pb
from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # a real server on the default model


@pytest.fixture(scope="module")
def srv(request):
  return shared_real_server(request)


@pytest.fixture(scope="module")
def channel(srv):
  with grpc.insecure_channel(srv.grpc) as ch:
    yield ch


def test_generate_streams_and_matches_the_tokenizer(channel):
  stub = pb_grpc.GenerationStub(channel)
  req = pb.GenerateRequest(text="The capital of France is", return_prompt_token_ids=True,
                           sampling=pb.SamplingParams(max_tokens=3, temperature=0.0, logprobs=1))
  msgs = list(stub.Generate(req, timeout=300))
  ids = [t for m in msgs for t in m.token_ids]
  last = msgs[-1]
  assert last.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
  assert last.usage.completion_tokens == len(ids) and 1 <= len(ids) <= 3
  assert sum(len(m.logprobs) for m in msgs) == len(ids)
  tok = stub.Tokenize(pb.TokenizeRequest(text="The capital of France is",
                                         add_special_tokens=True))
  assert list(msgs[0].prompt_token_ids) == list(tok.token_ids)
  assert last.usage.prompt_tokens == tok.count
  text = stub.Detokenize(pb.DetokenizeRequest(token_ids=ids)).text
  assert "".join(m.text for m in msgs) == text


def test_health_and_reflection(channel):
  resp = health_pb2_grpc.HealthStub(channel).Check(
      health_pb2.HealthCheckRequest(service="xlaserve.v1.Generation"))
  assert resp.status == health_pb2.HealthCheckResponse.SERVING
  refl = reflection_pb2_grpc.ServerReflectionStub(channel)
  req = reflection_pb2.ServerReflectionRequest(list_services="")
  names = {s.name for s in next(iter(refl.ServerReflectionInfo(iter([req]))))
           .list_services_response.service}
  assert "xlaserve.v1.Generation" in names


def test_invalid_argument(channel):
  stub = pb_grpc.GenerationStub(channel)
  with pytest.raises(grpc.RpcError) as e:
    list(stub.Generate(pb.GenerateRequest(text="hi " * 600), timeout=60))
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_cancel_mid_stream_frees_pages_visible_in_metrics(srv, channel):
  url = srv.http
  total = metric_value(url, "xlaserve_kv_cache_pages_total")
  assert wait_until(lambda: metric_value(url, "xlaserve_kv_cache_pages_free") == total, 60)
  aborted = metric_value(url, "xlaserve_request_success_total", finish_reason="abort")
  stub = pb_grpc.GenerationStub(channel)
  call = stub.Generate(pb.GenerateRequest(
      text="Count: 1, 2, 3,", sampling=pb.SamplingParams(max_tokens=200, ignore_eos=True)),
      timeout=300)
  next(iter(call))  # the request is running and holds pages
  assert metric_value(url, "xlaserve_num_requests_running") == 1
  assert metric_value(url, "xlaserve_kv_cache_pages_free") < total
  call.cancel()
  assert wait_until(lambda: metric_value(url, "xlaserve_num_requests_running") == 0
                    and metric_value(url, "xlaserve_kv_cache_pages_free") == total, 60)
  assert metric_value(url, "xlaserve_request_success_total", finish_reason="abort") == aborted + 1
  assert metric_value(url, "xlaserve_generation_tokens_total") > 0


def test_structured_outputs(channel):
  stub = pb_grpc.GenerationStub(channel)
  so = pb.StructuredOutputs(choice=pb.Choices(choices=["left", "right"]))
  for seed in range(3):
    msgs = list(stub.Generate(pb.GenerateRequest(
        text="Which way?", sampling=pb.SamplingParams(
            max_tokens=8, temperature=1.0, seed=seed, structured_outputs=so)), timeout=300))
    assert "".join(m.text for m in msgs) in ("left", "right")
    assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP
  schema = ('{"type": "object", "properties": {"n": {"type": "integer", "maximum": 999}}, '
            '"required": ["n"], "additionalProperties": false}')
  msgs = list(stub.Generate(pb.GenerateRequest(
      text="A number:", sampling=pb.SamplingParams(
          max_tokens=20, temperature=0.0,
          structured_outputs=pb.StructuredOutputs(json=schema))), timeout=300))
  assert isinstance(json.loads("".join(m.text for m in msgs))["n"], int)
  for bad in (pb.StructuredOutputs(regex="a("), pb.StructuredOutputs(json="{"),
              pb.StructuredOutputs(grammar="start: nothing_here"), pb.StructuredOutputs()):
    with pytest.raises(grpc.RpcError) as e:
      list(stub.Generate(pb.GenerateRequest(
          text="hi", sampling=pb.SamplingParams(max_tokens=4, structured_outputs=bad)),
          timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
    assert "structured_outputs" in e.value.details()
