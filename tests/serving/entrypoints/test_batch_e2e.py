"""`xlaserve batch` with the real model: 200 lines in order, killed halfway, resumed."""

import json
import subprocess
import time

import pytest
from frontend_procs import (
  REAL_ENGINE_FLAGS,
  REAL_START_TIMEOUT_S,
  REPO,
  launcher_cmd,
  real_model_available,
  subprocess_env,
)

pytestmark = pytest.mark.slow  # real batch jobs on the default model

MODEL = "smollm2-135m-instruct"
N = 200


def _write_input(path) -> None:
  rows = []
  for i in range(N):
    if i % 10 == 0:  # chat lines share the template's prefix (prefix cache)
      url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"#{i}"}]}
    else:
      url, body = "/v1/completions", {"prompt": f"Item {i}:"}
    body.update(model=MODEL, max_tokens=1, temperature=0.0)
    rows.append({"custom_id": f"line-{i}", "method": "POST", "url": url, "body": body})
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _lines(path) -> list[str]:
  return path.read_text().splitlines() if path.exists() else []


@pytest.mark.slow
@pytest.mark.skipif(not real_model_available(), reason="real engine or model not available")
def test_batch_killed_halfway_then_resumed(tmp_path):
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  _write_input(inp)
  cmd = launcher_cmd("batch", *REAL_ENGINE_FLAGS, f"--input={inp}", f"--output={out}",
                     "--max_concurrency=16")
  proc = subprocess.Popen(cmd, env=subprocess_env(), cwd=REPO, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + REAL_START_TIMEOUT_S + 300
  try:
    while proc.poll() is None and time.monotonic() < deadline and len(_lines(out)) < N // 4:
      time.sleep(0.05)
  finally:
    proc.kill()
    proc.wait(30)
  first = _lines(out)
  assert N // 4 <= len(first) < N, f"expected a partial output, got {len(first)} lines"
  first_ids = [json.loads(x)["id"] for x in first if x.endswith("}")]

  r = subprocess.run(cmd, env=subprocess_env(), cwd=REPO, capture_output=True, text=True,
                     timeout=REAL_START_TIMEOUT_S + 600)
  assert r.returncode == 0, r.stderr[-3000:]
  summary = json.loads(r.stdout.strip().splitlines()[-1])
  assert summary["total"] == N and summary["skipped"] + summary["processed"] == N
  assert summary["skipped"] >= len(first_ids) - 1  # at most the torn line is redone
  results = [json.loads(x) for x in _lines(out)]
  assert [x["custom_id"] for x in results] == [f"line-{i}" for i in range(N)]
  assert [x["id"] for x in results[:summary["skipped"]]] == first_ids[:summary["skipped"]]
  assert all(x["response"]["status_code"] == 200 for x in results)
  assert all(x["response"]["body"]["usage"]["completion_tokens"] == 1 for x in results)
