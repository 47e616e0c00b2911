"""Run records (serving/tools/run_record.py): the file, its keys, no overwrite."""

from __future__ import annotations

import argparse
import json
import re

from serving.tools import run_record


def test_write_record_fills_the_keys(tmp_path):
  path = run_record.write_record(
      "unit_bench", "python benchmarks/unit_bench.py --reps 2", {"model": "tiny", "reps": 2},
      {"decode_b1_tok_s": 101.5, "errors": 0}, results_dir=str(tmp_path), notes="a test")
  assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d{4}-unit_bench\.json", path.rsplit("/", 1)[1])
  record = json.loads(open(path, encoding="utf-8").read())
  assert set(run_record.RECORD_KEYS) <= set(record)
  assert record["name"] == "unit_bench" and record["schema"] == run_record.SCHEMA_VERSION
  assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", record["date"])
  assert record["command"] == "python benchmarks/unit_bench.py --reps 2"
  assert record["setup"] == {"model": "tiny", "reps": 2}
  assert record["figures"] == {"decode_b1_tok_s": 101.5, "errors": 0}
  assert record["notes"] == "a test"
  assert record["machine"]["cores"] >= 1 and record["machine"]["cpu"]
  assert record["versions"]["python"].count(".") == 2
  assert record["commit"] is None or re.fullmatch(r"[0-9a-f]{4,40}(\+dirty)?", record["commit"])


def test_a_second_run_in_the_same_minute_gets_its_own_file(tmp_path):
  first = run_record.write_record("same", "cmd", {}, {"x": 1}, results_dir=str(tmp_path))
  second = run_record.write_record("same", "cmd", {}, {"x": 2}, results_dir=str(tmp_path))
  assert first != second
  assert json.loads(open(first, encoding="utf-8").read())["figures"] == {"x": 1}
  assert json.loads(open(second, encoding="utf-8").read())["figures"] == {"x": 2}


def test_cpu_model_reads_cpuinfo(tmp_path):
  info = tmp_path / "cpuinfo"
  info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\n"
                  "model name\t: Intel(R) Xeon(R) Processor\nflags\t: fpu\n")
  assert run_record.cpu_model(str(info)) == "Intel(R) Xeon(R) Processor"
  assert run_record.cpu_model(str(tmp_path / "missing"))  # falls back to platform


def test_command_line_is_relative_to_the_repository():
  script = f"{run_record.REPO_ROOT}/benchmarks/quant_bench.py"
  assert (run_record.command_line([script, "--formats", "f32,int8", "--note", "a b"])
          == "python benchmarks/quant_bench.py --formats f32,int8 --note 'a b'")
  assert (run_record.command_line(["/venv/bin/xlaserve", "bench", "offline", "--record"])
          == "xlaserve bench offline --record")


def test_record_args_uses_the_parsed_flags_as_setup(tmp_path):
  parser = argparse.ArgumentParser()
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--port", type=int, default=8000)
  run_record.add_flags(parser)
  args = parser.parse_args(["--reps", "2", f"--results_dir={tmp_path}"])
  path = run_record.record_args("flags_bench", args, {"tok_s": 1.0}, skip=("port",))
  record = json.loads(open(path, encoding="utf-8").read())
  assert record["setup"] == {"reps": 2} and record["figures"] == {"tok_s": 1.0}
  assert run_record.record_args("flags_bench", parser.parse_args(["--no-record"]), {}) is None
