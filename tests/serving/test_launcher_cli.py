"""The real `xlaserve` entry point (`python -m serving.launcher`, this checkout on
PYTHONPATH) as a new user meets it, each case a fresh subprocess.

- `--help` (overall, per command, `xlaserve help COMMAND`) prints the user help on
  stdout and exits 0: short, no developer notes, no dump of every module's flags.
- No command prints the short usage and exits 2.
- Each input error exits 2 with exactly one line on stderr, `xlaserve: ...`, and
  no traceback: a model path that does not exist, a parallel layout needing more
  devices than are visible, a port in use (HTTP and gRPC), options that do not go
  together, an unknown `--config`, a bad flag value, an unknown flag or command.
  All fail before any weights load: the layout case points at a directory holding
  only a config.json, the port cases are checked before the model is looked at.
- `XLASERVE_DEBUG=1` or `--verbose` prints the traceback before that line.

The cases run at once, a few processes at a time (`outcomes`), since each process
spends its ~3 s importing jax. JAX runs on CPU with two host devices.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import socket
import subprocess
import sys

import pytest
from server_procs import REPO, launcher_cmd, subprocess_env, xla_flags

from serving.entrypoints import cli_help

pytestmark = pytest.mark.slow  # the xlaserve command as ~20 subprocesses

TIMEOUT_S = 120
TINY_LLAMA_CONFIG = {  # a config.json alone: enough for the checks made before loading
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6, "bos_token_id": 256, "eos_token_id": 257,
    "tie_word_embeddings": False}
NO_PORTS = ("--http_port=0", "--grpc_port=0")  # not checked: any free port


@dataclasses.dataclass(frozen=True)
class Case:
  id: str
  args: tuple[str, ...]
  says: str = ""  # in the one line on stderr (errors) or on stdout (help)
  env: tuple[tuple[str, str], ...] = ()


HELP_CASES = [
    Case("help", ("--help",), "Commands:"),
    Case("serve-help", ("serve", "--help"), "usage: xlaserve serve"),
    Case("generate-help", ("generate", "-h"), "usage: xlaserve generate"),
    Case("batch-help", ("help", "batch"), "usage: xlaserve batch"),
    Case("convert-help", ("convert", "--helpshort"), "usage: xlaserve convert"),
    Case("bench-help", ("bench", "--help"), "usage: xlaserve bench"),
]
ERROR_CASES = [
    Case("model-path", ("serve", "--model=/nonexistent", *NO_PORTS), "'/nonexistent'"),
    Case("tp-more-devices-than-visible", ("serve", "--model={tiny}", "--tp=3", *NO_PORTS),
         "needs 3 devices but only 2"),
    Case("http-port-in-use", ("serve", "--http_port={busy}", "--grpc_port=0"),
         "--http_port: cannot listen on 127.0.0.1:{busy}: the port is already in use"),
    Case("grpc-port-in-use", ("serve", "--http_port=0", "--grpc_port={busy}"),
         "--grpc_port: cannot listen on 127.0.0.1:{busy}: the port is already in use"),
    Case("prefill-without-decode-workers", ("serve", "--prefill_workers=1", *NO_PORTS),
         "decode_workers"),
    Case("draft-model-without-method", ("serve", "--speculative_model=x", *NO_PORTS),
         "speculative_method='draft'"),
    Case("page-size-vs-max-model-len", ("serve", "--page_size=64", "--max_model_len=100",
                                        *NO_PORTS), "page_size=64 must divide max_model_len"),
    Case("unknown-config", ("serve", "--config=no-such-preset", *NO_PORTS), "no such preset"),
    Case("bad-flag-value", ("serve", "--page_size=abc"), "--page_size=abc"),
    Case("unknown-flag", ("serve", "--no_such_flag=1"), "no_such_flag"),
    Case("unknown-command", ("frobnicate",), "unknown command 'frobnicate'"),
    Case("convert-model-path", ("convert", "--model=/nonexistent", "--output={tmp}/out"),
         "'/nonexistent'"),
    Case("generate-without-prompt", ("generate",), "--prompt"),
]
DEBUG_CASES = [
    Case("debug-env", ("serve", "--model=/nonexistent", *NO_PORTS), "'/nonexistent'",
         env=(("XLASERVE_DEBUG", "1"),)),
    Case("debug-verbose", ("serve", "--model=/nonexistent", "--verbose", *NO_PORTS),
         "'/nonexistent'"),
]
NO_COMMAND = Case("no-command", ())


@dataclasses.dataclass
class Outcomes:
  values: dict  # what the cases' "{...}" stand for
  runs: dict[str, subprocess.CompletedProcess]  # by case id


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> Outcomes:
  """Every case run (4 processes at a time) while a port is held busy."""
  tmp = tmp_path_factory.mktemp("cli")
  tiny = tmp / "tiny-llama"
  tiny.mkdir()
  (tiny / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    values = {"tiny": str(tiny), "busy": busy.getsockname()[1], "tmp": str(tmp)}
    cases = HELP_CASES + ERROR_CASES + DEBUG_CASES + [NO_COMMAND]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
      futures = {c.id: pool.submit(_run, c, values) for c in cases}
      return Outcomes(values, {i: f.result() for i, f in futures.items()})


def _run(case: Case, values: dict) -> subprocess.CompletedProcess:
  args = [a.format(**values) for a in case.args]
  env = subprocess_env(XLA_FLAGS=xla_flags(2))
  env.pop("XLASERVE_DEBUG", None)
  env.update(case.env)
  cmd = launcher_cmd(*args) if args else [sys.executable, "-m", "serving.launcher"]
  return subprocess.run(cmd, env=env, cwd=REPO, text=True, capture_output=True,
                        timeout=TIMEOUT_S)


@pytest.mark.parametrize("case", HELP_CASES, ids=lambda c: c.id)
def test_help_is_short_and_for_users(outcomes, case):
  r = outcomes.runs[case.id]
  assert r.returncode == 0, r.stderr
  assert case.says in r.stdout, r.stdout
  lines = r.stdout.splitlines()
  assert len(lines) <= 50, f"{len(lines)} lines of help"
  assert "Example" in r.stdout and "--helpfull" in r.stdout
  for developer_note in ("serving/entrypoints/flags.py", "build_engine", "EngineConfig",
                         "(an integer)", "--[no]"):
    assert developer_note not in r.stdout, developer_note
  assert "Traceback" not in r.stderr


@pytest.mark.parametrize("case", ERROR_CASES, ids=lambda c: c.id)
def test_input_error_is_one_line_and_exit_2(outcomes, case):
  r = outcomes.runs[case.id]
  lines = r.stderr.splitlines()
  assert r.returncode == 2, f"exit {r.returncode}\n{r.stderr}"
  assert len(lines) == 1, r.stderr
  assert lines[0].startswith("xlaserve: "), lines[0]
  assert case.says.format(**outcomes.values) in lines[0], lines[0]
  assert "Traceback" not in r.stderr and r.stdout == ""


@pytest.mark.parametrize("case", DEBUG_CASES, ids=lambda c: c.id)
def test_debug_shows_the_traceback(outcomes, case):
  r = outcomes.runs[case.id]
  assert r.returncode == 2, r.stderr
  assert "Traceback (most recent call last)" in r.stderr and "SetupError" in r.stderr
  last = r.stderr.splitlines()[-1]
  assert last.startswith("xlaserve: ") and case.says in last, r.stderr


def test_no_command_prints_the_short_usage(outcomes):
  r = outcomes.runs[NO_COMMAND.id]
  assert r.returncode == 2, r.stderr
  assert r.stderr.startswith("usage: xlaserve COMMAND") and len(r.stderr.splitlines()) <= 3
  assert all(c in r.stderr for c in cli_help.COMMANDS)
  assert "Traceback" not in r.stderr and r.stdout == ""
