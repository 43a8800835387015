#!/usr/bin/env bash
# One device call's worth of GPU evidence: profile, benchmarks, GPU tests, sleep/wake.
# Usage (on the GPU machine, repo root): bash benchmarks/gpu_session.sh "$OUT"
out=${1:-/tmp/flexrollout-gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
filter() { grep -v -e DEBUG -e "UserWarning" -e "warn_once"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
timeout 120 python3 benchmarks/profile_decode.py --preset qwen3-4b --batch 8 2>&1 | filter | head -26 > "$out/profile.txt"
timeout 200 python3 -m flexrollout.cli bench --preset qwen3-4b --batch-sizes 1,2,4,8,12,16,24,32,48,64 \
  --workload decode,grpo --compare hf --hf-max-tokens 32 --json "$out/qwen3-4b.json" 2>&1 | filter | tail -14 > "$out/qwen3-4b.txt"
timeout 120 python3 -m flexrollout.cli bench --preset llama-3.2-3b --batch-sizes 1,8,64 \
  --workload decode,prefill --json "$out/llama-3.2-3b.json" 2>&1 | filter | tail -6 > "$out/llama.txt"
timeout 150 python3 -m pytest -q tests/test_gpu.py 2>&1 | filter | tail -4 > "$out/tests.txt"
timeout 100 python3 benchmarks/sleep_wake.py --cycles 30 --check-every 10 2>&1 | filter | tail -14 > "$out/sleep.txt"
for f in profile qwen3-4b llama tests sleep; do echo "== $f"; cat "$out/$f.txt"; done
