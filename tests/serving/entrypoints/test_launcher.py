"""The absl launcher: flag -> config resolution, subcommand errors, graceful drain, TLS."""

import json
import shutil
import ssl
import subprocess
import threading

import grpc
import httpx
import pytest
from absl import app, flags
from absl.testing import flagsaver
from frontend_fake import InProcessServer
from frontend_procs import (
  FAKE_ENGINE,
  FAKE_ENGINE_FLAGS,
  REPO,
  ServerProcess,
  launcher_cmd,
  subprocess_env,
)

from serving.config import OPTION_GROUPS, EngineConfig
from serving.entrypoints import flags as xlaserve_flags
from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2 as pb
from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2_grpc as pb_grpc


@pytest.fixture(autouse=True)
def parsed_flags():
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(["xlaserve"])
  with flagsaver.flagsaver():
    yield


def test_engine_options_layering():
  # Model preset engine block < --config preset < explicit flags.
  with flagsaver.flagsaver(model="smollm2-135m-instruct"):
    assert xlaserve_flags.engine_config_from_flags().scheduler.max_model_len == 2048  # model preset
  with flagsaver.flagsaver(model="smollm2-135m-instruct", config="cpu-small", max_num_seqs=3,
                           enable_prefix_caching=False, quantization="none"):
    cfg = xlaserve_flags.engine_config_from_flags()
  sched = cfg.scheduler
  assert (sched.max_model_len, cfg.cache.num_pages, sched.max_num_batched_tokens) == (512, 256, 128)
  assert cfg.scheduler.max_num_seqs == 3 and cfg.cache.enable_prefix_caching is False
  assert cfg.model.quantization is None


def test_explicit_dtype_flag_takes_the_weights_too():
  # (A model preset's weight_dtype is dropped by an explicit dtype: test_config.py.)
  with flagsaver.flagsaver(model="smollm2-135m-instruct", dtype="float32"):
    assert xlaserve_flags.engine_config_from_flags().model.weight_dtype == "auto"  # float32 weights


def test_every_engine_option_has_a_flag():
  fields = set(OPTION_GROUPS)
  assert set(xlaserve_flags.ENGINE_FLAGS) == fields, (
      f"add launcher flags for {sorted(fields - set(xlaserve_flags.ENGINE_FLAGS))}, remove "
      f"{sorted(set(xlaserve_flags.ENGINE_FLAGS) - fields)}")


# A non-default value for every engine option (as the flag parses it, as LLM(...) takes it),
# with the options it needs alongside.
OPTION_SAMPLES = {
    "max_num_seqs": (3, {}), "max_model_len": (512, {}), "page_size": (32, {}),
    "num_pages": (77, {}), "kv_cache_memory_fraction": (0.25, {}),
    "max_num_batched_tokens": (256, {}), "enable_prefix_caching": (False, {}),
    "attention_backend": ("xla", {}), "dtype": ("bfloat16", {}),
    "weight_dtype": ("float32", {}), "kv_cache_dtype": ("int8", {}),
    "quantization": ("int8", {}), "quantized_dense_copy": (True, {}),
    "cpu_activation_bits": (8, {}), "cpu_weight_tiles": (False, {}), "tp": (2, {}), "ep": (2, {}),
    "dp": (2, {}), "pp": (2, {}),
    "prefill_workers": (2, {"decode_workers": 1}), "decode_workers": (3, {"prefill_workers": 1}),
    "kv_transfer_pages": (4, {}), "kv_role": ("decode", {}),
    "prefill_buckets": ((64, 256), {"max_num_batched_tokens": 256}),
    "decode_buckets": ((1, 3), {"max_num_seqs": 3}), "attention_block_tokens": (256, {}),
    "unroll_layers": (True, {}), "compilation_cache": (False, {}),
    "compilation_cache_dir": ("/tmp/xlaserve-test-cache", {}), "seed": (1234, {}),
    "step_timeout_s": (9.5, {}), "max_loras": (3, {}), "max_lora_rank": (32, {}),
    "speculative_method": ("ngram", {}), "num_speculative_tokens": (6, {}),
    "speculative_model": ("draft-model", {"speculative_method": "draft"}),
    "prompt_lookup_min": (3, {}), "prompt_lookup_max": (7, {}), "speculative_max_batch": (2, {}),
    "num_decode_steps": (4, {}), "decode_steps_max_batch": (2, {}),
    "kv_events_endpoint": ("tcp://*:5557", {}),
    "kv_events_topic": ("kv@pod@m", {"kv_events_endpoint": "tcp://*:5557"}),
    "kv_events_replay_endpoint": ("tcp://*:5558", {"kv_events_endpoint": "tcp://*:5557"}),
    "kv_events_format": ("map", {"kv_events_endpoint": "tcp://*:5557"}),
    "kv_offload_host_gb": (0.5, {}),
    "kv_offload_disk_dir": ("/tmp/xlaserve-kv", {"kv_offload_host_gb": 0.5,
                                                 "kv_offload_disk_gb": 2.0}),
    "kv_offload_disk_gb": (2.0, {"kv_offload_host_gb": 0.5,
                                 "kv_offload_disk_dir": "/tmp/xlaserve-kv"}),
}


def _grouped(config, name):
  return getattr(getattr(config, OPTION_GROUPS[name]), name)


def test_option_samples_cover_every_option():
  assert set(OPTION_SAMPLES) == set(OPTION_GROUPS)
  for name, (value, _) in OPTION_SAMPLES.items():
    default = _grouped(EngineConfig(), name)
    assert value != default, f"{name}: the sample must differ from the default {default!r}"


@pytest.mark.parametrize("name", sorted(OPTION_SAMPLES))
def test_every_flag_lands_in_its_group(name):
  value, companions = OPTION_SAMPLES[name]
  as_flags = {k: list(map(str, v)) if isinstance(v, tuple) else v
              for k, v in {name: value, **companions}.items()}
  with flagsaver.flagsaver(model="fake", **as_flags):
    config = xlaserve_flags.engine_config_from_flags()
  assert _grouped(config, name) == value


@pytest.mark.parametrize("name", sorted(OPTION_SAMPLES))
def test_every_llm_keyword_lands_in_its_group(name, monkeypatch):
  from serving.entrypoints import llm as llm_module

  built = {}

  def capture(model, config, lora_modules=None):
    built["config"] = config
    return object()

  monkeypatch.setattr(llm_module, "build_engine", capture)
  value, companions = OPTION_SAMPLES[name]
  llm_module.LLM("fake", **{name: value, **companions})
  assert _grouped(built["config"], name) == value


def test_an_unknown_llm_keyword_is_refused(monkeypatch):
  from serving.entrypoints import llm as llm_module

  monkeypatch.setattr(llm_module, "build_engine", lambda *a, **k: object())
  with pytest.raises(TypeError, match="max_num_sequences"):
    llm_module.LLM("fake", max_num_sequences=4)


def test_config_preset_from_path_and_errors(tmp_path):
  path = tmp_path / "mine.json"
  path.write_text(json.dumps({"max_num_seqs": 5, "page_size": 32, "max_model_len": 256}))
  with flagsaver.flagsaver(model="fake", config=str(path)):
    cfg = xlaserve_flags.engine_config_from_flags()
  assert (cfg.scheduler.max_num_seqs, cfg.cache.page_size) == (5, 32)
  with flagsaver.flagsaver(config="no-such-preset"), pytest.raises(app.UsageError):
    xlaserve_flags.engine_config_from_flags()
  path.write_text(json.dumps({"max_num_sequences": 5}))
  with flagsaver.flagsaver(config=str(path)), pytest.raises(app.UsageError, match="unknown"):
    xlaserve_flags.engine_config_from_flags()
  with flagsaver.flagsaver(model="fake", page_size=7), pytest.raises(app.UsageError):
    xlaserve_flags.engine_config_from_flags()


def test_flagfile(tmp_path):
  path = tmp_path / "serve.flags"
  path.write_text("--config=cpu-small\n--max_num_seqs=2\n--model=fake\n")
  flags.FLAGS(["xlaserve", f"--flagfile={path}"])
  cfg = xlaserve_flags.engine_config_from_flags()
  assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_model_len) == (2, 512)


def _run(*args: str, timeout: float = 60, engine: str | None = None
         ) -> subprocess.CompletedProcess:
  return subprocess.run(launcher_cmd(*args, engine=engine), env=subprocess_env(), cwd=REPO,
                        text=True, capture_output=True, timeout=timeout)


def test_usage_errors():
  r = _run("frobnicate")
  assert r.returncode != 0 and "usage: xlaserve" in r.stderr
  r = _run("batch", *FAKE_ENGINE_FLAGS, engine=FAKE_ENGINE)
  assert r.returncode != 0 and "--input" in r.stderr


def test_lora_flags():
  with flagsaver.flagsaver(model="fake", lora_modules=["a=/x/a", "b=/x/b"]):
    assert xlaserve_flags.lora_modules_from_flags() == {"a": "/x/a", "b": "/x/b"}
    assert xlaserve_flags.engine_config_from_flags().lora.max_loras == 2  # one slot per adapter
  with flagsaver.flagsaver(model="fake", lora_modules=["a=/x"], max_loras=3, max_lora_rank=64):
    cfg = xlaserve_flags.engine_config_from_flags()
    assert (cfg.lora.max_loras, cfg.lora.max_lora_rank) == (3, 64)
  for bad in (["a"], ["=p"], ["a=/x", "a=/y"]):
    with flagsaver.flagsaver(lora_modules=bad), pytest.raises(app.UsageError):
      xlaserve_flags.lora_modules_from_flags()


def test_generate_refuses_an_adapter_it_cannot_serve(tmp_path):
  (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 512}')
  r = _run("generate", "--prompt=hi", f"--lora_modules=big={tmp_path}", *FAKE_ENGINE_FLAGS,
           engine=FAKE_ENGINE)
  assert r.returncode != 0 and "--lora_modules big=" in r.stderr and "r=" not in r.stdout
  assert "exceeds the server's max_lora_rank" in r.stderr


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_and_exits_0():
  srv = ServerProcess(*FAKE_ENGINE_FLAGS, env=subprocess_env(XLASERVE_FAKE_STEP_S="0.02"),
                      engine=FAKE_ENGINE)
  try:
    body = {"model": "fake", "prompt": "ab", "max_tokens": 60, "stream": True}  # ~1.2 s
    lines: list[str] = []
    with httpx.Client(timeout=30) as c, c.stream("POST", f"{srv.http}/v1/completions",
                                                 json=body) as r:
      it = r.iter_lines()
      lines.append(next(it))
      srv.proc.send_signal(15)  # SIGTERM while the stream is in flight
      rest = threading.Thread(target=lambda: lines.extend(it))
      rest.start()
      rest.join(30)
    assert srv.proc.wait(30) == 0, srv.output()
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == ("ab" * 30)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert lines[-1] == "data: [DONE]" or "data: [DONE]" in lines
    assert "drained" in srv.output()
    # Readiness is reported once, by the ready line (not also by a log record).
    assert srv.output().count("http_port=") == 1 and "http port" not in srv.output()
  finally:
    srv.kill()


@pytest.mark.slow
def test_drain_deadline_aborts_what_is_left():
  srv = ServerProcess(*FAKE_ENGINE_FLAGS, "--drain_timeout_s=0.5",
                      env=subprocess_env(XLASERVE_FAKE_STEP_S="0.05"), engine=FAKE_ENGINE)
  try:
    body = {"model": "fake", "prompt": "ab", "max_tokens": 200, "stream": True}  # ~10 s
    with httpx.Client(timeout=30) as c, c.stream("POST", f"{srv.http}/v1/completions",
                                                 json=body) as r:
      it = r.iter_lines()
      next(it)
      srv.proc.send_signal(2)  # SIGINT drains too
      events = [json.loads(x[6:]) for x in it if x.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    assert srv.proc.wait(30) == 0, srv.output()
  finally:
    srv.kill()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_tls_on_http_and_grpc(tmp_path):
  cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
  subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                  "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                  "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
  with InProcessServer(tls_cert=str(cert), tls_key=str(key)) as s:
    url = s.http.replace("http://", "https://")
    r = httpx.post(f"{url}/v1/completions", verify=ssl.create_default_context(cafile=str(cert)),
                   json={"model": "fake", "prompt": "ab", "max_tokens": 2})
    assert r.json()["choices"][0]["text"] == "ab"
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    with grpc.secure_channel(s.grpc, creds) as ch:
      r = pb_grpc.GenerationStub(ch).Tokenize(pb.TokenizeRequest(text="ab"))
      assert list(r.token_ids) == [97, 98]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
  tiny_models = pytest.importorskip("tiny_models")
  path = tmp_path_factory.mktemp("tiny") / "llama"
  tiny_models.save_tiny_model("llama", str(path))
  return path


TINY_ENGINE_FLAGS = ("--max_num_seqs=2", "--max_model_len=128", "--num_pages=32",
                     "--max_num_batched_tokens=32", "--dtype=float32")


@pytest.mark.slow
def test_convert_then_generate(tiny_model, tmp_path):
  import numpy as np

  checkpoints = pytest.importorskip("checkpoints")
  out = tmp_path / "orbax"
  r = _run("convert", f"--model={tiny_model}", f"--output={out}", timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  a, b = checkpoints.load_checkpoint(str(tiny_model)), checkpoints.load_checkpoint(str(out))
  np.testing.assert_array_equal(np.asarray(a.params["embed"]), np.asarray(b.params["embed"]))
  r = _run("generate", f"--model={out}", "--prompt=hello", "--max_tokens=4", *TINY_ENGINE_FLAGS,
           timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.endswith("\n")  # the completion (random weights: any text)
  # Each start-up report once, as printed (not also as an absl log record).
  reports = [x for x in r.stderr.splitlines() if "KV cache: " in x or "Weights: " in x]
  assert len(reports) == 2 and all(x.startswith(("KV cache: ", "Weights: ")) for x in reports), (
      r.stderr)
