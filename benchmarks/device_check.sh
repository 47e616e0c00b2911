#!/usr/bin/env bash
# Device check for the Pallas paged-attention kernels on a CUDA machine.
#
# 1. Runs tests/kernels_pallas with JAX on the GPU: the GPU (Triton) kernels
#    compiled (not interpreted) against the references, including attention
#    sinks, soft caps and traced per-layer windows (a scanned layer stack);
#    TPU cases skip.
# 2. Runs benchmarks/kernel_bench.py: decode (Llama-3-8B-like: 32 q heads,
#    8 kv heads, head dim 128, bf16, batch 64, context 2048) for ref and gpu,
#    decode at batch 4 (split-K), a ragged prefill (8 x 2048 tokens) for the
#    gpu kernel, GPT-OSS-like decode and prefill (64 q heads, 8 kv heads, head
#    dim 64, sinks, a traced window of 128), and a small block-size sweep while
#    time remains; benchmarks/mla_bench.py: the latent (MLA) decode kernel
#    against the XLA loop at a DeepSeek-V3 layer's per-device shape.
# Writes everything and a summary to $OUT (default ./device_check_out); the
# benchmarks' run records go to $OUT/results (copy them into benchmarks/results/).
# Needs a jax with CUDA support (jax[cuda12]) in the active environment.
# Budget: < 8 minutes in all. The tests get at most 300 s; each benchmark gets
# at most 120 s and never more than what is left of a 450 s budget (the rest
# is start-up and the summary), so the whole script stays under 8 minutes.
#
#   bash benchmarks/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-device_check_out}"
mkdir -p "$out"
summary="$out/summary.txt"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"

{
  echo "# xlaserve kernel device check, $(date -u +%FT%TZ)"
  git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -4
} > "$summary"

if ! python -c "import jax; assert jax.default_backend() == 'gpu', jax.default_backend(); \
print('jax', jax.__version__, jax.devices())" >> "$summary" 2>&1; then
  echo "FAIL: jax does not see a CUDA GPU (install jax[cuda12])" | tee -a "$summary"
  exit 2
fi

status=0
timeout 300 python -m pytest tests/kernels_pallas -q -rs \
  --junitxml="$out/kernel_tests.xml" > "$out/kernel_tests.txt" 2>&1 || status=1
{
  echo "## kernel tests (GPU kernels compiled; exit status in the last line)"
  grep -E "passed|failed|error|SKIPPED" "$out/kernel_tests.txt" | tail -20
} >> "$summary"

budget_s=450
bench() {  # name, then kernel_bench.py arguments; skipped when the budget is spent
  local name="$1"; shift
  local left=$((budget_s - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "## $name: skipped (the 8-minute budget is spent)" >> "$summary"
    return
  fi
  [ "$left" -gt 120 ] && left=120
  if ! timeout "$left" python benchmarks/kernel_bench.py --output "$out/$name.json" \
      --results_dir "$out/results" "$@" \
      > "$out/$name.txt" 2>&1; then
    status=1
  fi
  { echo "## $name"; tail -5 "$out/$name.txt"; } >> "$summary"
}
bench bench_decode --op decode --impls ref,gpu --reps 20
bench bench_prefill --op ragged --impls gpu --batch 8 --context 2048 --reps 5
bench bench_decode_b4 --op decode --impls gpu --batch 4 --reps 20  # split-K path
# GPT-OSS-like layers: sinks and a per-layer (traced) window of 128 keys.
oss=(--q_heads 64 --kv_heads 8 --head_dim 64 --sinks --sliding_window 128 --traced_window)
bench bench_decode_oss --op decode --impls ref,gpu --reps 20 "${oss[@]}"
bench bench_prefill_oss --op ragged --impls gpu --batch 8 --context 2048 --reps 5 "${oss[@]}"

# DeepSeek-V3-like latent (MLA) decode: 16 heads (128 / tp 8), latent 512 + rope 64, bf16.
if [ $((budget_s - SECONDS)) -gt 60 ]; then
  timeout 90 python benchmarks/mla_bench.py --impls kernel,xla,ref \
    --output "$out/bench_mla_decode.json" > "$out/bench_mla_decode.txt" 2>&1 || status=1
  { echo "## bench_mla_decode"; tail -4 "$out/bench_mla_decode.txt"; } >> "$summary"
fi

# Block-size sweep for the tuning table, while the 8-minute budget allows.
for ppb in 4 16; do
  [ "$SECONDS" -lt 330 ] && bench "sweep_decode_ppb$ppb" --op decode --impls gpu --reps 10 \
    --pages_per_block "$ppb"
done
for qb in 32 128; do
  [ "$SECONDS" -lt 390 ] && bench "sweep_prefill_qb$qb" --op ragged --impls gpu --batch 8 \
    --context 2048 --reps 3 --pages_per_block 4 --q_block "$qb"
done

echo "exit status $status" >> "$summary"
cat "$summary"
exit "$status"
