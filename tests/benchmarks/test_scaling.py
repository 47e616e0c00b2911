"""benchmarks/scaling.py's setup: both servers hold the same KV capacity, xlaserve runs with
no tuning flag, and the figures and ratio table come out of sweep rows as the docs say."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import scaling  # noqa: E402 (benchmarks/ is not a package)


def _flag(cmd: list[str], name: str) -> str:
  return cmd[cmd.index(name) + 1]


def test_default_run_sizes_both_servers_alike(tmp_path):
  args = scaling.parse_args([])
  assert args.level_list == [1, 8, 16, 32] and args.prompt_len_list == [128, 4096]
  assert scaling.levels_for(args, 128) == [1, 8, 16, 32]
  assert scaling.levels_for(args, 4096) == [1]
  kv = scaling.kv_capacity(args)
  assert kv == 32 * (128 + 128 + 64) == 10240  # 32 short requests > one long one (4288)
  path = str(tmp_path / "model.gguf")
  open(path, "wb").close()
  specs = scaling.server_specs(args, path, "/bin/llama-server")
  ours, peer = specs["xlaserve"]["cmd"], specs["llama-server"]["cmd"]
  flags = [a for a in ours[ours.index("serve") + 1:]]
  assert sorted(f.split("=")[0] for f in flags) == [
      "--grpc_port", "--http_port", "--max_model_len", "--model", "--num_pages"]
  assert f"--num_pages={kv // 16 + 1}" in flags  # the default page size, plus the reserved one
  assert "--max_model_len=4352" in flags  # 4096 + 128, rounded up to 256
  assert _flag(peer, "-c") == str(kv) and _flag(peer, "--parallel") == "32"
  assert _flag(peer, "-t") == "2" and "--kv-unified" in peer
  assert specs["xlaserve"]["url"] != specs["llama-server"]["url"]


def test_short_run_needs_no_max_model_len(tmp_path):
  args = scaling.parse_args(["--levels", "1,8", "--prompt_lens", "128"])
  path = str(tmp_path / "model.gguf")
  open(path, "wb").close()
  ours = scaling.server_specs(args, path, "llama-server")["xlaserve"]["cmd"]
  assert not any(a.startswith("--max_model_len") for a in ours)
  assert scaling.kv_capacity(args) == 2560  # 8 x 320
  assert scaling.requests_per_round(args, 128) == 4 + 8


def test_bad_arguments_are_refused():
  with pytest.raises(SystemExit):
    scaling.parse_args(["--formats", "q3_k"])
  with pytest.raises(SystemExit):
    scaling.parse_args(["--shapes", "7b"])


def _row(c, out_tok_s, ttft, tpot, errors=0):
  return {"concurrency": c, "output_tok_s": out_tok_s, "ttft_p50": ttft, "tpot_p50": tpot,
          "errors": errors}


def test_figures_are_medians_over_rounds_and_ratios_carry_the_targets():
  args = scaling.parse_args(["--levels", "1,16", "--prompt_lens", "128", "--repeats", "3"])
  runs = {128: [[_row(1, 9.0, 0.5, 0.10), _row(16, 100.0, 2.0, 0.2)],
                [_row(1, 9.0, 0.7, 0.05), _row(16, 120.0, 3.0, 0.2, errors=1)],
                [_row(1, 9.0, 0.6, 0.04), _row(16, 110.0, 4.0, 0.2)]]}
  res = {"error": None, "runs": runs, "kv_tokens": 5120, "rss_ready_gb": 2.0,
         "rss_after_gb": 2.2, "weight_bytes": 2**20, "ready_s": 10.0}
  figs = scaling.server_figures(res, args)
  assert figs["p128_decode_b1_tok_s"] == pytest.approx(1 / 0.05)
  assert figs["p128_ttft_b1_s"] == pytest.approx(0.6)
  assert figs["p128_c16_output_tok_s"] == pytest.approx(110.0)
  assert figs["p128_c16_ttft_p50_s"] == pytest.approx(3.0)
  assert figs["failed_requests"] == 1 and figs["weights_mib"] == 1.0
  peer = dict(figs, p128_decode_b1_tok_s=10.0, p128_c16_output_tok_s=100.0, rss_ready_gb=1.0,
              p128_ttft_b1_s=1.2)
  text = scaling.tables({"1b q4_0": {"xlaserve": figs, "llama-server": peer}}, args, "now")
  ratio_row = next(line for line in text.splitlines() if line.startswith("| 1b q4_0 | 2.00×"))
  # decode 20 vs 10 meets >= 1.0; 16 concurrent 110 vs 100 misses >= 1.5; TTFT 0.6 vs 1.2
  # meets <= 1.0; RSS 2.0 vs 1.0 misses <= 1.3.
  assert ratio_row.split(" | ")[1:5] == ["2.00× ✓", "0.50× ✓", "1.10× ✗", "2.00× ✗"]
