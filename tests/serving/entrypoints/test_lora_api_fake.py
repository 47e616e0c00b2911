"""LoRA through the front ends, on the fake engine (FakeRunner; milliseconds a request).

Under adapter id k the fake engine's tokens are the prompt's bytes shifted by
k, so a response shows which adapter served it. Covered, over HTTP and gRPC:
selecting an adapter by `model` / `lora`, unknown names (404 / NOT_FOUND),
/v1/models listing adapters with their base, run-time load and unload
(refused with 403 / PERMISSION_DENIED unless allowed; bad adapters 400 /
INVALID_ARGUMENT naming the reason), and the LoRA metrics.
"""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from frontend_fake import InProcessServer, fake_engine

from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2 as pb
from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2_grpc as pb_grpc


def write_adapter_config(path, **overrides) -> str:
  path.mkdir(parents=True, exist_ok=True)
  config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
            **overrides}
  (path / "adapter_config.json").write_text(json.dumps(config))
  return str(path)


def shifted(text: str, k: int, n: int) -> str:
  data = text.encode()
  return bytes((data[i % len(data)] + k) % 256 for i in range(n)).decode("latin-1")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
  root = tmp_path_factory.mktemp("adapters")
  return {name: write_adapter_config(root / name) for name in ("sql", "poem", "extra")}


def serve(adapters, allow: bool):
  engine = fake_engine(max_num_seqs=4, max_model_len=256, num_pages=64, max_loras=2)
  engine.load_lora("sql", adapters["sql"])
  engine.load_lora("poem", adapters["poem"])
  return InProcessServer(engine, allow_runtime_lora=allow)


@pytest.fixture(scope="module")
def srv(adapters):
  with serve(adapters, allow=True) as s:
    yield s


def complete(srv, model: str, prompt: str = "abc", n: int = 6) -> httpx.Response:
  return httpx.post(f"{srv.http}/v1/completions", timeout=30, json={
      "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True})


def test_model_selects_the_adapter(srv):
  ids = {a.name: a.lora_id for a in srv.engine.list_loras()}
  assert complete(srv, "fake").json()["choices"][0]["text"] == "abcabc"
  for name in ("sql", "poem"):
    body = complete(srv, name).json()
    assert body["model"] == name
    assert body["choices"][0]["text"] == shifted("abc", ids[name], 6)


def test_unknown_model_is_404(srv):
  r = complete(srv, "nope")
  assert r.status_code == 404
  assert r.json()["error"]["code"] == "model_not_found"


def test_models_lists_adapters_with_their_base(srv):
  data = httpx.get(f"{srv.http}/v1/models").json()["data"]
  by_id = {m["id"]: m for m in data}
  assert by_id["fake"]["parent"] is None
  for name in ("sql", "poem"):
    assert by_id[name]["parent"] == "fake"
    assert by_id[name]["root"].endswith(name)
  assert httpx.get(f"{srv.http}/v1/models/sql").json()["parent"] == "fake"


def test_load_use_unload_at_run_time(srv, adapters, tmp_path):
  url = srv.http
  r = httpx.post(f"{url}/v1/load_lora_adapter",
                 json={"lora_name": "extra", "lora_path": adapters["extra"]})
  assert r.status_code == 200, r.text
  assert "extra" in r.text
  extra = next(a for a in srv.engine.list_loras() if a.name == "extra")
  assert complete(srv, "extra").json()["choices"][0]["text"] == shifted("abc", extra.lora_id, 6)
  again = httpx.post(f"{url}/v1/load_lora_adapter",
                     json={"lora_name": "extra", "lora_path": adapters["extra"]})
  assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
  assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "extra"}).status_code == 200
  assert complete(srv, "extra").status_code == 404
  gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "extra"})
  assert gone.status_code == 404


@pytest.mark.parametrize("body,why", [
    ({"lora_name": "x", "lora_path": "/no/such/dir"}, "no adapter_config.json"),
    ({"lora_name": "fake", "lora_path": "/tmp"}, "base model"),
    ({"lora_name": "", "lora_path": "/tmp"}, "lora_name"),
    ({"lora_name": "x"}, "lora_path"),
    ({"lora_name": "x", "lora_path": 3}, "lora_path"),
    ({"lora_name": "x", "lora_path": "/tmp", "extra": 1}, "extra"),
])
def test_bad_load_requests_are_400(srv, body, why):
  r = httpx.post(f"{srv.http}/v1/load_lora_adapter", json=body)
  assert r.status_code == 400, r.text
  assert why in r.text


@pytest.mark.parametrize("overrides,why", [
    ({"r": 128}, "exceeds the server's max_lora_rank"),
    ({"use_dora": True}, "use_dora"),
    ({"peft_type": "IA3"}, "not LORA"),
    ({"r": "8"}, "positive integer"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
])
def test_adapters_that_cannot_be_served_are_400(srv, tmp_path, overrides, why):
  path = write_adapter_config(tmp_path / "bad", **overrides)
  r = httpx.post(f"{srv.http}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path})
  assert r.status_code == 400, r.text
  assert why in r.json()["error"]["message"]
  assert "bad" not in {a.name for a in srv.engine.list_loras()}


def test_runtime_updates_refused_unless_allowed(adapters):
  with serve(adapters, allow=False) as s:
    r = httpx.post(f"{s.http}/v1/load_lora_adapter",
                   json={"lora_name": "extra", "lora_path": adapters["extra"]})
    assert r.status_code == 403 and "--allow_runtime_lora" in r.text
    r = httpx.post(f"{s.http}/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert r.status_code == 403
    assert complete(s, "sql").status_code == 200  # serving adapters is not an update
    with grpc.insecure_channel(s.grpc) as channel:
      stub = pb_grpc.GenerationStub(channel)
      with pytest.raises(grpc.RpcError) as e:
        stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="extra",
                                                       lora_path=adapters["extra"]))
      assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_grpc_lora(srv, adapters):
  ids = {a.name: a.lora_id for a in srv.engine.list_loras()}
  with grpc.insecure_channel(srv.grpc) as channel:
    stub = pb_grpc.GenerationStub(channel)

    def generate(lora: str) -> str:
      req = pb.GenerateRequest(text="abc", lora=lora, sampling=pb.SamplingParams(
          max_tokens=6, temperature=0.0, ignore_eos=True))
      return "".join(r.text for r in stub.Generate(req))

    assert generate("") == "abcabc"
    assert generate("poem") == shifted("abc", ids["poem"], 6)
    with pytest.raises(grpc.RpcError) as e:
      generate("nope")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert {a.name for a in info.lora_adapters} >= {"sql", "poem"}
    with pytest.raises(grpc.RpcError) as e:
      stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="x", lora_path="/no/such"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    resp = stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="g",
                                                          lora_path=adapters["extra"]))
    assert "g" in resp.message
    stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="g"))
    with pytest.raises(grpc.RpcError) as e:
      stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="g"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_lora_metrics(srv):
  complete(srv, "sql")
  text = httpx.get(f"{srv.http}/metrics").text
  swaps = [line for line in text.splitlines() if line.startswith("xlaserve_lora_swaps_total")]
  assert swaps and float(swaps[0].split()[-1]) >= 1
  assert "# TYPE xlaserve_lora_requests_running gauge" in text
