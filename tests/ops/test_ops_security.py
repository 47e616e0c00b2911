"""Security defaults on the real server: loopback bind, API key, TLS, size limits, fuzzing.

One server for the module, started the way production would run it: HTTPS
and gRPC over TLS (a self-signed certificate made here with `cryptography`),
an API key, and a small request size limit. The OpenAPI fuzz run
(schemathesis) goes through the same TLS + key path.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import secrets
import ssl

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ops_procs import MODEL, OpsServer

from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2 as pb
from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # fuzzing and real servers

API_KEY = secrets.token_urlsafe(24)
MAX_BODY = 64 * 1024
FUZZ_EXAMPLES = {"POST": 10, "GET": 4}  # per operation and generation mode (positive, negative)
FIGURES: dict[str, object] = {}


def make_self_signed_cert(directory: str) -> tuple[str, str]:
  """A self-signed certificate for localhost / 127.0.0.1; returns (cert path, key path)."""
  from cryptography import x509
  from cryptography.hazmat.primitives import hashes, serialization
  from cryptography.hazmat.primitives.asymmetric import ec
  from cryptography.x509.oid import NameOID

  key = ec.generate_private_key(ec.SECP256R1())
  name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
  now = datetime.datetime.now(datetime.UTC)
  cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
          .public_key(key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.SubjectAlternativeName([
              x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
              critical=False)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(key, hashes.SHA256()))
  cert_path, key_path = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
  with open(cert_path, "wb") as f:
    f.write(cert.public_bytes(serialization.Encoding.PEM))
  with open(key_path, "wb") as f:
    f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))
  return cert_path, key_path


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
  return make_self_signed_cert(str(tmp_path_factory.mktemp("tls")))


@pytest.fixture(scope="module")
def srv(cert):
  s = OpsServer(f"--api_key={API_KEY}", f"--tls_cert={cert[0]}", f"--tls_key={cert[1]}",
                f"--max_body_bytes={MAX_BODY}", scheme="https")
  yield s
  assert s.terminate() == 0
  print(f"\nops security figures: {FIGURES}")


@pytest.fixture(scope="module")
def client(srv, cert):
  ctx = ssl.create_default_context(cafile=cert[0])
  with httpx.Client(base_url=srv.http, verify=ctx, timeout=120) as c:
    yield c


@pytest.fixture(scope="module")
def channel(srv, cert):
  with open(cert[0], "rb") as f:
    creds = grpc.ssl_channel_credentials(root_certificates=f.read())
  with grpc.secure_channel(srv.grpc, creds) as ch:
    yield ch


AUTH = {"Authorization": f"Bearer {API_KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {API_KEY}"),)


def test_binds_loopback_by_default(srv):
  from serving.entrypoints.api_server import ServeConfig
  from serving.launcher import FLAGS

  assert FLAGS["host"].default == "127.0.0.1"
  assert ServeConfig(served_model_name="m").host == "127.0.0.1"
  listening = [c.laddr for c in psutil.Process(srv.pid).net_connections(kind="inet")
               if c.status == psutil.CONN_LISTEN]
  assert {a.port for a in listening} >= {srv.http_port, srv.grpc_port}
  for addr in listening:  # gRPC's socket is dual-stack: 127.0.0.1 shows as ::ffff:127.0.0.1
    ip = ipaddress.ip_address(addr.ip)
    assert (getattr(ip, "ipv4_mapped", None) or ip) == ipaddress.ip_address("127.0.0.1"), addr


def test_http_api_key(client):
  body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
  for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                  {"Authorization": f"Basic {API_KEY}"}):
    r = client.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 401, (headers, r.text)
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models", headers=headers).status_code == 401
  r = client.post("/v1/completions", json=body, headers=AUTH)
  assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
  assert client.get("/health").status_code == 200  # probes and scrapers need no key
  assert "xlaserve_num_requests_running" in client.get("/metrics").text


def test_https_only_on_the_http_port(srv):
  with pytest.raises(httpx.TransportError):
    httpx.get(f"http://127.0.0.1:{srv.http_port}/health", timeout=10)
  with pytest.raises(httpx.TransportError):  # the self-signed cert is not trusted by default
    httpx.get(f"https://127.0.0.1:{srv.http_port}/health", timeout=10)


def test_grpc_api_key_over_tls(srv, channel):
  stub = pb_grpc.GenerationStub(channel)
  req = pb.GenerateRequest(text="Hi", sampling=pb.SamplingParams(max_tokens=2, temperature=0))
  for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", API_KEY),)):
    with pytest.raises(grpc.RpcError) as e:
      list(stub.Generate(req, metadata=metadata, timeout=60))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
      stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=60)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
  msgs = list(stub.Generate(req, metadata=GRPC_AUTH, timeout=120))
  assert msgs[-1].usage.completion_tokens >= 1
  health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
  assert health.status == health_pb2.HealthCheckResponse.SERVING
  with grpc.insecure_channel(srv.grpc) as plain:  # no plaintext gRPC on a TLS port
    with pytest.raises(grpc.RpcError) as e:
      pb_grpc.GenerationStub(plain).GetModelInfo(pb.GetModelInfoRequest(), metadata=GRPC_AUTH,
                                                 timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_request_size_limits(client, channel):
  big = {"model": MODEL, "prompt": "a" * (MAX_BODY + 1), "max_tokens": 1}
  r = client.post("/v1/completions", json=big, headers=AUTH)
  assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

  def chunks():  # no Content-Length: the limit applies while reading
    payload = json.dumps(big).encode()
    for i in range(0, len(payload), 8192):
      yield payload[i:i + 8192]

  r = client.post("/v1/completions", content=chunks(),
                  headers={**AUTH, "content-type": "application/json"})
  assert r.status_code == 413
  stub = pb_grpc.GenerationStub(channel)
  with pytest.raises(grpc.RpcError) as e:
    list(stub.Generate(pb.GenerateRequest(text="a" * (MAX_BODY + 1)), metadata=GRPC_AUTH,
                       timeout=60))
  assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
  assert client.get("/health").status_code == 200


def test_api_keys_compared_in_constant_time():
  import inspect

  from serving.entrypoints import grpc_server, http_server

  for module in (http_server, grpc_server):
    src = inspect.getsource(module)
    assert "hmac.compare_digest" in src and "== api_key" not in src and "== self._key" not in src


def fuzz_schema(served: dict) -> dict:
  """The served /openapi.json with request bodies from the protocol models filled in.

  The routes read raw bodies (for size limits and OpenAI-style errors), so
  FastAPI cannot describe them; the server validates against these models.
  """
  from pydantic.json_schema import models_json_schema

  from serving.entrypoints import openai_protocol as p

  models = {"/v1/completions": p.CompletionRequest, "/v1/chat/completions":
            p.ChatCompletionRequest, "/tokenize": p.TokenizeRequest,
            "/detokenize": p.DetokenizeRequest}
  refs, defs = models_json_schema([(m, "validation") for m in models.values()],
                                  ref_template="#/components/schemas/{model}")
  schema = json.loads(json.dumps(served))
  schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
  for path, model in models.items():
    schema["paths"][path]["post"]["requestBody"] = {
        "required": True, "content": {"application/json": {"schema": refs[(model, "validation")]}}}
  for name in ("CompletionRequest", "ChatCompletionRequest"):  # reach the engine, not just 404
    schema["components"]["schemas"][name]["properties"]["model"] = {"enum": [MODEL]}
  schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
  return schema


def _clamp(body):
  """Keeps generation short: the fuzzer probes validation, not the model's speed."""
  if isinstance(body, dict):
    for key, cap in (("max_tokens", 3), ("max_completion_tokens", 3), ("n", 2), ("best_of", 2)):
      if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > cap:
        body[key] = cap
  return body


def _fuzz_operation(op, mode, srv, cert, stats: dict) -> None:
  """Runs the bounded hypothesis search for one operation and generation mode."""
  import hypothesis

  @hypothesis.settings(max_examples=FUZZ_EXAMPLES.get(op.method.upper(), 6), deadline=None,
                       database=None, derandomize=True, phases=[hypothesis.Phase.generate],
                       suppress_health_check=list(hypothesis.HealthCheck))
  @hypothesis.given(case=op.as_strategy(generation_mode=mode))
  def run(case):
    case.body = _clamp(case.body)
    resp = case.call(base_url=srv.http, headers=AUTH, verify=cert[0], timeout=120)
    stats["cases"] += 1
    stats["statuses"][resp.status_code] = stats["statuses"].get(resp.status_code, 0) + 1
    if resp.status_code >= 500:
      stats["failures"].append((op.method, op.path, mode.value, case.body, resp.text[:300]))

  try:
    run()
  except hypothesis.errors.Unsatisfiable:  # nothing to break: e.g. GET /health has no inputs
    assert mode.value == "negative", (op.method, op.path)


def test_fuzz_openapi_no_server_errors(srv, client, cert):
  import schemathesis

  assert client.get("/openapi.json").status_code == 401  # the schema is behind the key too
  served = client.get("/openapi.json", headers=AUTH).json()
  schema = schemathesis.openapi.from_dict(fuzz_schema(served))
  stats = {"cases": 0, "statuses": {}, "failures": []}
  for op in schema.get_all_operations():
    for mode in schemathesis.GenerationMode:
      _fuzz_operation(op.ok(), mode, srv, cert, stats)
  FIGURES["fuzz"] = {"cases": stats["cases"], "server_errors": len(stats["failures"]),
                     "statuses": stats["statuses"]}
  assert stats["cases"] >= 50
  assert not stats["failures"], stats["failures"][:5]
