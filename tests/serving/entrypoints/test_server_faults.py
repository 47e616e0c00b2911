"""The servers when the engine cannot serve, and the HTTP front end's own limits.

Over the fake engine (tests/frontend_fake.py), whose runner loses the
device on a prompt starting with \\x01 and wedges on \\x02:
  * in process: HTTP /health turns 503 with the reason, gRPC health
    NOT_SERVING, in-flight streams end with an error, new requests get 503 /
    UNAVAILABLE, and `serve()` ends with EngineDeadError;
  * as `xlaserve serve`: the process exits non-zero (EXIT_ENGINE_DEAD) within
    the watchdog timeout, for a dead and for a wedged engine.
Also: a slow request body gets 408, a connection whose headers never finish
is closed, past the connection limit new requests get 503, a non-streaming
request cut off by the drain deadline gets 503 (not 200), and with an API key
/openapi.json and gRPC reflection need it.
"""

from __future__ import annotations

import socket
import threading
import time

import grpc
import httpx
import pytest
from frontend_fake import InProcessServer, fake_engine, wait_for
from frontend_procs import FAKE_ENGINE, FAKE_ENGINE_FLAGS, ServerProcess, subprocess_env
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2 as pb
from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2_grpc as pb_grpc
from serving.launcher import EXIT_ENGINE_DEAD

DEAD, WEDGED = "\x01 lose the device", "\x02 wedge the device"


def _stream(base: str, prompt: str, max_tokens: int, events: list) -> None:
  body = {"model": "fake", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
  with httpx.Client(timeout=30) as c, c.stream("POST", f"{base}/v1/completions", json=body) as r:
    events.extend(line for line in r.iter_lines() if line.startswith("data: "))


def _grpc_health(target: str) -> int:
  with grpc.insecure_channel(target) as ch:
    return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status


@pytest.mark.parametrize("trigger,timeout_s", [(DEAD, 30.0), (WEDGED, 0.5)],
                         ids=["dead", "wedged"])
def test_in_process_server_turns_unhealthy_and_fails_everything(trigger, timeout_s):
  engine = fake_engine(max_num_seqs=4, max_model_len=256, num_pages=64, step_s=0.01,
                       step_timeout_s=timeout_s)
  server = InProcessServer(engine, unhealthy_exit_delay_s=5.0)
  with server:
    assert httpx.get(f"{server.http}/health").status_code == 200
    bystander: list[str] = []
    t = threading.Thread(target=_stream, args=(server.http, "ab", 200, bystander))
    t.start()
    assert wait_for(lambda: len(bystander) > 2, 5)
    r = httpx.post(f"{server.http}/v1/completions",
                   json={"model": "fake", "prompt": trigger, "max_tokens": 3}, timeout=30)
    assert r.status_code == 500 and "engine" in r.json()["error"]["message"]
    t.join(10)
    assert '"error"' in bystander[-2] and "engine" in bystander[-2], bystander[-3:]
    assert wait_for(lambda: httpx.get(f"{server.http}/health").status_code == 503, 2)
    assert httpx.get(f"{server.http}/health").json()["status"] == "unavailable"
    assert _grpc_health(server.grpc) == health_pb2.HealthCheckResponse.NOT_SERVING
    late = httpx.post(f"{server.http}/v1/completions",
                      json={"model": "fake", "prompt": "ab", "max_tokens": 3})
    assert late.status_code == 503 and late.json()["error"]["code"] == "engine_unavailable"
    with grpc.insecure_channel(server.grpc) as ch, pytest.raises(grpc.RpcError) as e:
      list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(text="ab")))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert wait_for(lambda: server.error is not None, 10)
  assert type(server.error).__name__ == "EngineDeadError"


def _exits_non_zero(trigger: str, *flags: str) -> tuple[int, float, list[int]]:
  """Starts `xlaserve serve` on the fake engine, sends `trigger`, watches /health;
  returns (exit status, seconds from the trigger to the exit, health statuses seen)."""
  srv = ServerProcess(*FAKE_ENGINE_FLAGS, *flags, engine=FAKE_ENGINE,
                      env=subprocess_env(XLASERVE_FAKE_STEP_S="0.01"))
  try:
    statuses: list[int] = []

    def poll_health():
      while srv.proc.poll() is None:
        try:
          statuses.append(httpx.get(f"{srv.http}/health", timeout=1).status_code)
        except httpx.HTTPError:
          return
        time.sleep(0.05)

    poller = threading.Thread(target=poll_health)
    poller.start()
    start = time.monotonic()
    r = httpx.post(f"{srv.http}/v1/completions", timeout=30,
                   json={"model": "fake", "prompt": trigger, "max_tokens": 3})
    assert r.status_code == 500, r.text
    code = srv.proc.wait(30)
    poller.join(5)
    return code, time.monotonic() - start, statuses
  finally:
    srv.kill()


@pytest.mark.slow
@pytest.mark.parametrize("trigger,flags", [(DEAD, ()), (WEDGED, ("--step_timeout_s=1",))],
                         ids=["dead", "wedged"])
def test_serve_process_exits_non_zero_when_the_engine_cannot_serve(trigger, flags):
  code, seconds, statuses = _exits_non_zero(trigger, *flags)
  assert code == EXIT_ENGINE_DEAD
  assert seconds < 15  # the watchdog (1 s step timeout) + 2 s of reporting unhealthy + exit
  assert statuses[0] == 200 and 503 in statuses


def test_slow_body_gets_408_and_slow_headers_are_cut_off():
  with InProcessServer(body_timeout_s=0.5, header_timeout_s=0.5) as s:
    host, port = s.http.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
      sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                   b"\r\ncontent-length: 100\r\n\r\n{\"model\"")
      sock.settimeout(5)
      reply = sock.recv(4096)
      assert reply.startswith(b"HTTP/1.1 408"), reply[:100]
    with socket.create_connection((host, int(port))) as sock:
      sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")  # the headers never end
      sock.settimeout(5)
      start = time.monotonic()
      assert sock.recv(4096) == b""  # closed by the server
      assert time.monotonic() - start < 3
    assert httpx.get(f"{s.http}/health").status_code == 200


def test_connection_limit():
  with InProcessServer(max_connections=2) as s:
    host, port = s.http.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(2)]
    try:
      time.sleep(0.2)
      assert httpx.get(f"{s.http}/health").status_code == 503
    finally:
      for sock in idle:
        sock.close()
    assert wait_for(lambda: httpx.get(f"{s.http}/health").status_code == 200, 3)


def test_drain_deadline_is_503_for_a_waiting_client():
  engine = fake_engine(max_num_seqs=4, max_model_len=256, num_pages=64, step_s=0.05)
  server = InProcessServer(engine, drain_timeout_s=0.3)
  result = {}
  with server:
    def call():
      result["r"] = httpx.post(f"{server.http}/v1/completions", timeout=30,
                               json={"model": "fake", "prompt": "ab", "max_tokens": 200})

    t = threading.Thread(target=call)
    t.start()
    assert wait_for(lambda: engine.stats().num_running == 1, 5)
  t.join(10)
  r = result["r"]
  assert r.status_code == 503 and r.json()["error"]["code"] == "server_draining"


def test_api_key_guards_openapi_and_reflection():
  with InProcessServer(api_key="k3y") as s:
    assert httpx.get(f"{s.http}/openapi.json").status_code == 401
    ok = httpx.get(f"{s.http}/openapi.json", headers={"authorization": "Bearer k3y"})
    assert ok.status_code == 200 and "/v1/completions" in ok.json()["paths"]
    with grpc.insecure_channel(s.grpc) as ch:
      refl = reflection_pb2_grpc.ServerReflectionStub(ch)
      req = reflection_pb2.ServerReflectionRequest(list_services="")
      with pytest.raises(grpc.RpcError) as e:
        next(iter(refl.ServerReflectionInfo(iter([req]))))
      assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
      resp = next(iter(refl.ServerReflectionInfo(iter([req]),
                                                 metadata=(("authorization", "Bearer k3y"),))))
      assert any(x.name == "xlaserve.v1.Generation"
                 for x in resp.list_services_response.service)
      assert _grpc_health(s.grpc) == health_pb2.HealthCheckResponse.SERVING
