"""Run records: one JSON file per benchmark run, under benchmarks/results/.

Every benchmark script (benchmarks/*.py, `xlaserve bench --record`) writes its
figures through `write_record(name, command, setup, figures)`, which adds what
makes a figure comparable later: the UTC date, the machine (CPU model from
/proc/cpuinfo, core count), the git commit and the Python / jax versions. The
format is described in benchmarks/results/README.md. No jax import here: the
versions come from the installed packages' metadata.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

SCHEMA_VERSION = 1
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS_DIR = os.path.join(REPO_ROOT, "benchmarks", "results")
RECORD_KEYS = ("schema", "name", "date", "machine", "commit", "versions", "command", "setup",
               "figures")


def cpu_model(cpuinfo_path: str = "/proc/cpuinfo") -> str:
  """The CPU's model name (Linux's /proc/cpuinfo), else what `platform` knows."""
  try:
    with open(cpuinfo_path, encoding="utf-8", errors="replace") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == "model name":
          return value.strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
  """CPU model, logical cores and the OS of this machine."""
  return {"cpu": cpu_model(), "cores": os.cpu_count(), "system": platform.system(),
          "arch": platform.machine()}


def git_commit(repo: str = REPO_ROOT) -> str | None:
  """The checkout's HEAD (short hash), with `+dirty` when tracked files changed; None
  outside a git checkout."""
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo,
                          capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                           capture_output=True, text=True, timeout=10, check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None
  return head + ("+dirty" if dirty else "")


def versions() -> dict[str, str | None]:
  """Python's version and those of the packages that set the speed."""
  out: dict[str, str | None] = {"python": platform.python_version()}
  for package in ("jax", "jaxlib"):
    try:
      out[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      out[package] = None
  return out


def command_line(argv: Sequence[str] | None = None) -> str:
  """The command as typed (shell-quoted): `python <script> <args>` for a script (its
  path relative to the checkout), `<program> <args>` for a console script (`xlaserve`)."""
  argv = list(sys.argv if argv is None else argv)
  program, rest = argv[0], argv[1:]
  if not program.endswith(".py"):
    return shlex.join([os.path.basename(program), *rest])
  if os.path.isabs(program) and program.startswith(REPO_ROOT + os.sep):
    program = os.path.relpath(program, REPO_ROOT)
  return shlex.join(["python", program, *rest])


def record_path(name: str, when: datetime.datetime, results_dir: str) -> str:
  """`<results_dir>/<YYYY-MM-DDTHHMM>-<name>.json`; `-2`, `-3`... when that file exists."""
  stem = f"{when:%Y-%m-%dT%H%M}-{name}"
  path, n = os.path.join(results_dir, stem + ".json"), 1
  while os.path.exists(path):
    n += 1
    path = os.path.join(results_dir, f"{stem}-{n}.json")
  return path


def write_record(name: str, command: str, setup: Mapping[str, Any], figures: Mapping[str, Any],
                 results_dir: str | None = None, notes: str | None = None) -> str:
  """Writes one run's record -> its path.

  `name`: the benchmark (`compare_peers`, `quant_bench`, ...); `command`: the exact
  command line (`command_line()`); `setup`: what was measured under which options
  (model, workload, flags); `figures`: the results (JSON-serialisable; numbers keep
  their units in their keys, e.g. `ttft_p50_s`).
  """
  when = datetime.datetime.now(datetime.UTC)
  record = {"schema": SCHEMA_VERSION, "name": name,
            "date": when.strftime("%Y-%m-%dT%H:%M:%SZ"), "machine": machine(),
            "commit": git_commit(), "versions": versions(), "command": command,
            "setup": dict(setup), "figures": dict(figures)}
  if notes:
    record["notes"] = notes
  results_dir = results_dir or RESULTS_DIR
  os.makedirs(results_dir, exist_ok=True)
  path = record_path(name, when, results_dir)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(record, f, indent=1, default=str)
    f.write("\n")
  print(f"run record: {path}", flush=True)
  return path


def add_flags(parser: argparse.ArgumentParser, record_by_default: bool = True) -> None:
  """`--record` / `--no-record` and `--results_dir`, for a benchmark script's parser."""
  parser.add_argument("--record", action=argparse.BooleanOptionalAction,
                      default=record_by_default,
                      help="write a run record (JSON) into --results_dir")
  parser.add_argument("--results_dir", default=RESULTS_DIR, help="where run records go")


def record_args(name: str, args: argparse.Namespace, figures: Mapping[str, Any],
                skip: Sequence[str] = ()) -> str | None:
  """`write_record` with a script's parsed arguments as the setup, when `args.record`
  -> the record's path (None when not recording)."""
  if not args.record:
    return None
  setup = {k: v for k, v in vars(args).items() if k not in ("record", "results_dir", *skip)}
  return write_record(name, command_line(), setup, figures, results_dir=args.results_dir)
