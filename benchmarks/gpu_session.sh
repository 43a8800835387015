#!/usr/bin/env bash
# One device call's worth of GPU evidence: profile, benchmarks, GPU tests, sleep/wake.
# Usage (on the GPU machine, repo root): bash benchmarks/gpu_session.sh "$OUT" [extra]
# "extra" also runs the LoRA-mode costs and the TRL GRPO comparison (needs trl wheels carried).
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
timeout 120 python3 benchmarks/sleep_wake.py --cycles 100 --check-every 25 2>&1 | filter | grep -A40 '^{' > "$out/sleep.txt"
names="profile qwen3-4b llama tests sleep"
if [ "${2:-}" = extra ]; then
  timeout 240 python3 benchmarks/lora_modes.py --preset qwen3-4b 2>&1 | filter | grep -A40 '^{' > "$out/lora.txt"
  for mode in flex hf; do timeout 200 python3 benchmarks/trl_grpo.py $mode 2>&1 | tail -1; done > "$out/trl.txt"
  timeout 200 python3 -m pytest -q tests/test_trl.py -m gpu 2>&1 | filter | tail -4 >> "$out/tests.txt"
  names="$names lora trl"
fi
for f in $names; do echo "== $f"; cat "$out/$f.txt"; done
