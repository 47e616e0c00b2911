"""The installed entry points on the real default model, each in a fresh process.

- The `xlaserve` console script (the one pip put next to this Python) runs
  `generate` and prints the completion.
- `from serving import LLM, SamplingParams` in a plain `python -c` builds an LLM
  and generates.

Both use the default-model test config (tests/server_procs.py) and the tests'
persistent compilation cache (`subprocess_env`).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from server_procs import (
  DEFAULT_MODEL,
  DEFAULT_MODEL_TEST_CONFIG,
  REPO,
  engine_flags,
  require_real_model,
  subprocess_env,
)

pytestmark = pytest.mark.slow  # the console script in fresh processes

TIMEOUT_S = 600
PROMPT = "The capital of France is"
ENGINE_STDERR_LINES = ("KV cache: ", "Weights: ")  # LLMEngine._log_capacity prints these


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
  try:
    return subprocess.run(cmd, env=subprocess_env(), cwd=REPO, text=True, capture_output=True,
                          timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"{cmd[:3]} did not finish in {TIMEOUT_S} s:\n{e.stdout}\n{e.stderr}")


def test_console_script_generate():
  require_real_model()
  script = os.path.join(os.path.dirname(sys.executable), "xlaserve")
  if not os.path.isfile(script):
    pytest.fail(f"the `xlaserve` console script is not installed at {script} "
                "(pip install -e . installs it)")
  r = _run([script, "generate", f"--model={DEFAULT_MODEL}", f"--prompt={PROMPT}",
            "--max_tokens=8", *engine_flags()])
  assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
  # stdout is the completion alone: the engine's capacity lines go to stderr.
  assert not any(x.startswith(ENGINE_STDERR_LINES) for x in r.stdout.splitlines()), r.stdout
  assert any(x.startswith(ENGINE_STDERR_LINES) for x in r.stderr.splitlines()), r.stderr
  completion = r.stdout.strip()
  assert completion, f"no completion on stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
  assert "Paris" in completion, r.stdout  # greedy; test_default_model checks the same prompt


def test_python_api_in_a_fresh_process():
  require_real_model()
  code = textwrap.dedent(f"""
      import json
      from serving import LLM, SamplingParams
      llm = LLM({DEFAULT_MODEL!r}, **{DEFAULT_MODEL_TEST_CONFIG!r})
      out = llm.generate([{PROMPT!r}], SamplingParams(max_tokens=8, temperature=0.0))[0]
      print("COMPLETION " + json.dumps({{"text": out.text, "token_ids": out.token_ids,
                                        "finish_reason": out.finish_reason}}))
  """)
  r = _run([sys.executable, "-c", code])
  assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
  lines = [x for x in r.stdout.splitlines() if x.startswith("COMPLETION ")]
  assert len(lines) == 1, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
  out = json.loads(lines[0][len("COMPLETION "):])
  assert out["text"].strip() and len(out["token_ids"]) >= 1, out
  assert out["finish_reason"] in ("stop", "length"), out
  assert "Paris" in out["text"], out
