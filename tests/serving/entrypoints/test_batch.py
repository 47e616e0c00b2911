"""Batch jobs over the fake engine (real engine, FakeRunner): order, error lines, resume."""

import asyncio
import json
import subprocess
import time

import pytest
from frontend_fake import fake_engine
from frontend_procs import FAKE_ENGINE, FAKE_ENGINE_FLAGS, REPO, launcher_cmd, subprocess_env

from serving.entrypoints.batch import BatchConfig, resume_point, run_batch


def write_input(path, n: int, max_tokens: int = 3) -> list[dict]:
  rows = []
  for i in range(n):
    if i % 2:
      body = {"model": "fake", "prompt": f"p{i:03d}", "max_tokens": max_tokens}
      url = "/v1/completions"
    else:
      body = {"model": "fake", "messages": [{"role": "user", "content": f"m{i:03d}"}],
              "max_tokens": max_tokens}
      url = "/v1/chat/completions"
    rows.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return rows


def read_output(path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()]


def run(tmp_path, inp, out, **kw) -> dict:
  engine = fake_engine(max_num_seqs=4, max_model_len=256, num_pages=64)
  cfg = BatchConfig(str(inp), str(out), "fake", show_progress=False, **kw)
  return asyncio.run(run_batch(engine, cfg))


def test_results_in_input_order(tmp_path):
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  write_input(inp, 30)
  assert run(tmp_path, inp, out, max_concurrency=8) == {"total": 30, "skipped": 0,
                                                        "processed": 30, "failed": 0}
  results = read_output(out)
  assert [r["custom_id"] for r in results] == [f"req-{i}" for i in range(30)]
  assert results[1]["response"]["body"]["choices"][0]["text"] == "p00"
  assert results[0]["response"]["body"]["choices"][0]["message"]["content"] == "<us"
  assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in results)


def test_error_lines(tmp_path):
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  lines = [
      "this is not json",
      json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": "fake"}}),
      json.dumps({"custom_id": "bad-body", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "fake", "prompt": "a", "max_tokens": 0}}),
      json.dumps({"custom_id": "stream", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "fake", "prompt": "a", "stream": True}}),
      json.dumps({"custom_id": "ok", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "fake", "prompt": "ok", "max_tokens": 2}}),
  ]
  inp.write_text("\n".join(lines) + "\n")
  run(tmp_path, inp, out)
  r = read_output(out)
  assert r[0]["error"]["code"] == "invalid_json" and r[0]["response"] is None
  assert r[1]["error"]["code"] == "invalid_url"
  assert r[2]["response"]["status_code"] == 400
  assert "max_tokens" in r[2]["response"]["body"]["error"]["message"]
  assert r[3]["response"]["status_code"] == 400
  assert r[4]["response"]["body"]["choices"][0]["text"] == "ok"


def test_resume_keeps_done_lines_and_cuts_a_torn_tail(tmp_path):
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  write_input(inp, 20)
  run(tmp_path, inp, out)
  full = out.read_text().splitlines(keepends=True)
  out.write_text("".join(full[:7]) + full[7][:25])  # killed while writing line 8
  assert run(tmp_path, inp, out) == {"total": 20, "skipped": 7, "processed": 13, "failed": 0}
  again = out.read_text().splitlines(keepends=True)
  assert again[:7] == full[:7]  # untouched, not redone (ids are random per run)
  assert [json.loads(x)["custom_id"] for x in again] == [f"req-{i}" for i in range(20)]
  assert run(tmp_path, inp, out)["processed"] == 0


def test_resume_refuses_a_foreign_output(tmp_path):
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  write_input(inp, 3)
  lines = inp.read_text().splitlines()
  out.write_text(json.dumps({"custom_id": "someone-else"}) + "\n")
  with pytest.raises(ValueError, match="fresh output"):
    resume_point(str(out), lines)


def test_killed_halfway_then_rerun_cli(tmp_path):
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  write_input(inp, 200, max_tokens=4)
  cmd = launcher_cmd("batch", *FAKE_ENGINE_FLAGS, f"--input={inp}", f"--output={out}",
                     "--max_concurrency=4", engine=FAKE_ENGINE)
  env = subprocess_env(XLASERVE_FAKE_STEP_S="0.01")
  proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 60
  while time.monotonic() < deadline and proc.poll() is None:
    if out.exists() and out.read_text().count("\n") >= 60:
      break
    time.sleep(0.02)
  proc.kill()
  proc.wait(10)
  first = out.read_text().splitlines()
  assert 60 <= len(first) < 200, "the first run should be killed halfway"
  done = [json.loads(x)["id"] for x in first if x.endswith("}")]
  r = subprocess.run(cmd, env=subprocess_env(), cwd=REPO, capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 0, r.stderr
  summary = json.loads(r.stdout.strip().splitlines()[-1])
  assert summary["total"] == 200 and summary["skipped"] >= len(done) - 1
  assert summary["skipped"] + summary["processed"] == 200
  results = read_output(out)
  assert [x["custom_id"] for x in results] == [f"req-{i}" for i in range(200)]
  assert [x["id"] for x in results[:summary["skipped"]]] == done[:summary["skipped"]]
  assert "batch" in r.stderr  # the tqdm progress bar


def _line(i: int, body: dict | str) -> str:
  text = body if isinstance(body, str) else json.dumps(body)
  return f'{{"custom_id": "c{i}", "method": "POST", "url": "/v1/completions", "body": {text}}}'


def test_bad_lines_get_their_400_and_good_lines_their_completions(tmp_path):
  """The issue's job: six lines, one with a 401-digit top_k, one with temperature
  Infinity (and a few more kinds of bad input)."""
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  good = {"model": "fake", "prompt": "abc", "max_tokens": 4}
  huge = "1" + "0" * 400
  lines = [_line(0, good), _line(1, f'{{"model": "fake", "prompt": "x", "top_k": {huge}}}'),
           _line(2, good), _line(3, '{"model": "fake", "prompt": "x", "temperature": Infinity}'),
           _line(4, good), _line(5, good),
           _line(6, {"model": "fake", "prompt": "x", "stop": ["s"] * 100}),
           "[" * 100_000, _line(8, {"model": "fake", "prompt": "\ud800"})]
  inp.write_text("\n".join(lines) + "\n")
  assert run(tmp_path, inp, out) == {"total": 9, "skipped": 0, "processed": 9, "failed": 0}
  results = read_output(out)
  for i in (0, 2, 4, 5):
    assert results[i]["response"]["status_code"] == 200
    assert results[i]["response"]["body"]["choices"][0]["text"] == "abca"
  for i in (1, 6):
    assert results[i]["response"]["status_code"] == 400, results[i]
    assert results[i]["response"]["body"]["error"]["message"]
  assert results[3]["error"]["code"] == "invalid_json"  # Infinity is not JSON
  assert "Infinity" in results[3]["error"]["message"]
  assert results[7]["error"]["code"] == "invalid_json" and "deep" in results[7]["error"]["message"]
  assert results[8]["error"]["code"] == "invalid_encoding"


def test_lines_the_server_failed_are_redone_by_a_rerun(tmp_path):
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  good = {"model": "fake", "prompt": "abc", "max_tokens": 4}
  failing = {"model": "fake", "prompt": [0, 97, 98], "max_tokens": 4}  # NUL: its step fails
  inp.write_text("\n".join([_line(0, good), _line(1, failing), _line(2, good)]) + "\n")
  summary = run(tmp_path, inp, out)
  assert summary["failed"] == 1 and summary["processed"] == 3
  results = read_output(out)
  assert results[1]["response"]["status_code"] == 500
  assert [r["response"]["status_code"] for r in results[::2]] == [200, 200]
  # A rerun keeps what succeeded before the failed line and redoes the rest.
  inp.write_text("\n".join([_line(0, good), _line(1, good), _line(2, good)]) + "\n")
  assert run(tmp_path, inp, out) == {"total": 3, "skipped": 1, "processed": 2, "failed": 0}
  assert [r["response"]["status_code"] for r in read_output(out)] == [200, 200, 200]


def test_cli_exits_non_zero_when_lines_failed_on_the_server(tmp_path):
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  failing = {"model": "fake", "prompt": [0, 97], "max_tokens": 2}
  inp.write_text(_line(0, failing) + "\n")
  proc = subprocess.run(launcher_cmd("batch", *FAKE_ENGINE_FLAGS, f"--input={inp}",
                                     f"--output={out}", engine=FAKE_ENGINE),
                        env=subprocess_env(), cwd=REPO, text=True, capture_output=True,
                        timeout=120)
  assert proc.returncode == 1 and "rerun" in proc.stderr
  assert json.loads(proc.stdout.strip().splitlines()[-1])["failed"] == 1
