"""Two processes on 127.0.0.1 (gloo) serve one tiny Llama sharded across both: tp=2
(every layer split), and pp=2 (one pipeline stage per process, activations
passed between them by collective permutes over gloo).

Each process has one CPU device; `sharding.distributed.initialize_from`
joins them, `serving.entrypoints.engine_builder.start_multihost` gives process 0
the engine and runs process 1's follower loop. Process 0's greedy output must equal a plain
one-process run without speculation, with n-gram speculative decoding on (the
leader broadcasts each verify call and its drafts), also for a request
constrained by a regex (its sampling waits for the token masks, which the
leader broadcasts). The test starts both
processes itself and kills them if they outlive the timeout.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest
import shard_testutil as stu
from server_procs import xla_flags

pytestmark = pytest.mark.slow  # two processes with jax.distributed

TIMEOUT_S = 240


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _spawn(*args: str) -> subprocess.Popen:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": f"{stu.REPO}:{stu.TESTS}",
         "XLA_FLAGS": xla_flags(1)}
  return subprocess.Popen([sys.executable, __file__, *args], env=env, cwd=stu.REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
  from tiny_models import save_tiny_model

  path = str(tmp_path_factory.mktemp("llama"))
  save_tiny_model("llama", path)
  return path


@pytest.fixture(scope="module")
def single(model_path):
  """The one-process reference run."""
  return _collect([_spawn("ref", model_path)])[0]


def _collect(procs: list[subprocess.Popen]) -> list[dict]:
  import json

  outs = []
  try:
    for p in procs:
      stdout, stderr = p.communicate(timeout=TIMEOUT_S)
      assert p.returncode == 0, stderr[-4000:]
      outs.append(json.loads(stdout.strip().splitlines()[-1]))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return outs


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_two_processes_match_one(model_path, single, layout):
  """tp=2: every layer split across the processes; pp=2: one stage (layer) per process."""
  port = str(_free_port())
  leader, follower = _collect([_spawn("host", str(i), port, model_path, layout)
                               for i in range(2)])
  assert leader["devices"] == 2 and leader["processes"] == 2
  assert follower["follower_returned"]  # after the leader's engine shut down
  assert leader["tokens"] == single["tokens"]
  assert leader["draft_tokens"] > 0
  constrained = bytes(leader["tokens"][-1]).decode()  # byte-level tokenizer: id == byte
  assert re.fullmatch("[a-c]{2,5}!?", constrained[:6]), constrained


def _generate(engine) -> list[list[int]]:
  from serving.types import SamplingParams

  tokens: dict[int, list[int]] = {}
  for i, prompt in enumerate(stu.PROMPTS):
    tokens[i] = []
    engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12, temperature=0.0),
                       lambda out, i=i: tokens[i].extend(out.token_ids))
  tokens[-1] = []
  engine.add_request("constrained", stu.PROMPTS[0], SamplingParams(
      max_tokens=6, temperature=0.0, structured_outputs={"regex": "[a-c]{2,5}!"}),
      lambda out: tokens[-1].extend(out.token_ids))
  engine.run_until_idle()
  return [tokens[i] for i in [*range(len(stu.PROMPTS)), -1]]


def _worker(mode: str, *args: str) -> None:
  if mode == "ref":
    from serving.entrypoints.engine_builder import build_engine

    stu.emit({"tokens": _generate(build_engine(args[0], stu.engine_config(max_num_seqs=1)))})
    return
  pid, port, path, layout = args
  from sharding.distributed import initialize_from

  dist = initialize_from({"coordinator_address": f"127.0.0.1:{port}", "num_processes": 2,
                          "process_id": int(pid)})
  import jax

  from serving.entrypoints.engine_builder import start_multihost

  config = stu.engine_config(**{layout: 2}, max_num_seqs=1, speculative_method="ngram",
                             prompt_lookup_min=1)  # 5 programs
  engine = start_multihost(path, config)
  if not dist.is_leader:
    stu.emit({"follower_returned": engine is None})
    return
  tokens = _generate(engine)
  engine.shutdown()  # releases the follower
  stu.emit({"tokens": tokens, "devices": len(jax.devices()), "processes": jax.process_count(),
            "draft_tokens": engine.stats().spec_decode.num_draft_tokens})


if __name__ == "__main__":
  stu.worker_setup()
  _worker(*sys.argv[1:])
