#!/usr/bin/env bash
# GPU evidence in device-call-sized parts (each well under 10 minutes on an H200).
# Usage (on the GPU machine, repo root): bash benchmarks/gpu_session.sh OUT PART
#   core : GPU tests, the Qwen3-4B sweep (decode + GRPO, HF baseline, plot)
#   ab   : the decode sweep with async decode off / GEMV kernels capped at 16 rows,
#          Llama-3.2-3B decode + prefill
#   lora : LoRA-mode costs (live vs merged, r=16/64), decode-only profiles at batch 1 and 64
#   trl  : the TRL GPU test and the GRPO step-time comparison (needs the trl wheels installed)
#   memory : engine memory beyond weights + KV: prefill MLP chunks of 2048 vs 8192 rows, and the
#            GRPO workload over a PEFT LoRA r=32 model
#   tune : GEMV tilings and PDL (gemv_sweep), flex decode masks and options (attention_sweep),
#          a decode profile at batch 1 (PROFILE_FLAGS=--no-pdl for the A/B)
#   verify : GPU tests, Qwen3-4B decode at 1 / 8 / 64 + GRPO, the engine's GEMV tilings against
#            cuBLAS, the tiling search for down and the LM head
#   fifth : q/k/v epilogue + down tilings: their GPU tests, bs-1 profile, best-of-3 bench, down sweep
#   sixth : cold start-up, fused-kernel + parity tests, bs-1 and bs-64 profiles, best-of-3 bench,
#           flex decode SPLIT_KV at bs 1 and 8
#   seventh : Llama-3.2-3B decode 1 / 8 / 64 + prefill, then every GPU test
#   prefill_ab : Llama-3.2-3B prefill with the q/k/v epilogue on / off / on (64 sequences)
#   moe_tests : every GPU test
#   moe   : Qwen3-30B-A3B and gpt-oss-20b decode 1 / 8 / 64 + GRPO against the MoE roofline and HF
#   final : Qwen3-4B decode at 1 / 8 / 64 + GRPO, then the GPU parity and kernel tests
#   hybrid : (carry .whl with fla + bitsandbytes) the Gemma-4 / Qwen3.5 / 4-bit GPU tests, Qwen3-4B decode
#            1 / 8 / 64 + GRPO (regression check), Gemma-4-E2B and Qwen3.5-4B decode 1 / 8 / 64
#   recheck : (carry .whl) what the 2026-12-04 second session could not re-run: the Qwen3.5 real-width
#             tests after the flex-stage fix, Qwen3.5-4B decode after the KV cap, the 4-bit kernel test
#             and Qwen3-4B NF4 decode, the MoE GPU tests (new LoRA op), Qwen3-4B GRPO best of 2 (512 tokens now)
#   gemma : Gemma-4-E2B decode profile at batch 1, the bf16 graphs-vs-eager test, 26B-A4B / 31B decode
#   unsloth : benchmarks/unsloth_grpo.py (carry .whl-unsloth, made by benchmarks/unsloth_wheels.sh)
#   pending_tests : (carry .whl) every GPU test: first GPU run of the adapter-table graphs, device bad
#                   words, 4-bit graphs + matmul_4bit routing and the fla-free Qwen3.5 reference (2026-12-05)
#   pending_bench : (carry .whl) Qwen3-4B decode 1 / 8 / 64 with and without the processors (bad words too), LoRA modes
#                   and 4 mixed LoRARequest adapters at r = 16 / 32, Qwen3-4B NF4 1 / 8 / 64 against HF
#   recheck_graphs : (carry .whl) the Qwen3.5 graph tests after the warm-up fix, then the GPU tests the
#                    2026-12-05 run did not reach, slow real-width Gemma-4 last (failures summarised)
#   lora_profile : where live LoRA's decode time goes: the shrink at several K splits and the folded
#                  GEMV per projection group, at 64 rows the expand path with its partials at several
#                  splits or summed once (lora_sweep.py), bs-1 and bs-8 profiles of Qwen3-4B with
#                  and without a live r=32 adapter on all seven projections
#   gemma_compile : Inductor compile counts of Gemma-4-E2B against Qwen3-4B (compile_count.py), E2B decode
#                   1 / 8 / 64 from cold compile caches (capture time), the bs-1 decode profile
#   lora_next : the open LoRA questions of 2026-12-05: the GPU test of lora_request_kernels (the
#               adapter table folded into the LoRA kernels), the expand path's partials at 64 rows
#               (lora_sweep.py), LoRARequest mixes unfused vs folded (lora_modes.py, r=32), and where
#               a batch-8 step mixing 4 LoRARequest adapters goes (profile); the GEMV's GPU test
#               (its GELU-tanh gate/up epilogue is new)
#   nf4_next : (carry .whl) Qwen3-4B NF4 decode 1 / 8 / 64 against HF now that 4-bit steps replay
#              graphs, where NF4's batch-1 step goes (profile), and the rewritten 4-bit GEMV: its
#              GPU tests, then against bitsandbytes' ops (gemv_4bit_sweep.py) and in the engine
#              (quant_kernels) at batch 1 / 8 / 64
#   qlora_next: (carry .whl) QLoRA decode, bitsandbytes' ops against quant_kernels
#   nf4_compile: (carry .whl) the 4-bit GPU tests, compile_4bit cases included (4-bit layers compiled
#                around bitsandbytes' gemm_4bit op, CPU-tested only), then NF4 and QLoRA r=32 decode
#                1 / 8 / 64 with and without it
#   designs : (carry .whl) the 4-bit GEMV designs with bitsandbytes' layout (K whole, one kernel;
#             gemv_4bit_designs.py), bitsandbytes' gemm_4bit as dispatched and its fused kernel
#             forced at every row count (gemv_4bit_sweep.py), then the GPU tests not yet seen to pass: the GEMV's GELU-tanh
#             epilogue (test_kernels.py) and the 4-bit kernel's 40-row case after the mul.rn fix
#   eighth : the fused shrink's GEMV and fp32 graph tests, Qwen3-4B decode base / live r=32, live r=32
#            at batch 64 through the GEMV (lora_gemv_max_rows 64), where Gemma-4-E2B's batch-1 step
#            goes, live r=32 with the separate shrink launch
#   ninth : the live-LoRA GEMV at 17-64 rows after launches past shared memory retry shallower (its
#           GPU tests), Qwen3-4B decode at 32 / 64 base and live r=32, live r=32 at 64 through the GEMV
#   models : (carry .whl with fla) where Gemma-4-E2B's batch-1 step goes (profile), Qwen3.5-4B decode
#            1 / 8 / 64 against HF, Gemma-4-26B-A4B decode 1 / 8
#   fused : live LoRA with the shrink fused into the GEMV launch: its GPU tests, Qwen3-4B decode
#           1 / 8 / 64 base, live r=32, and live r=32 with the separate shrink launch, then
#           lora_sweep.py (the fused launch at several K slices, B prefetched or not)
#   tenth : where Gemma-4-E2B's batch-1 step goes now that its full layers' attention splits
#           (profile), Gemma-4-26B-A4B decode 1 / 8
#   eleventh : (carry .ab_old: `mkdir .ab_old && git archive COMMIT flexrollout | tar -x -C .ab_old`)
#              an A/B at prompt 2048 + 256 of the tree in .ab_old against this one, Qwen3-4B and
#              Gemma-4-E2B 1 / 8 (first run: decode masks with full blocks before f9b54ee), then
#              full-block against all-partial masks in flex alone (attention_sweep.py)
#   lut : (carry .whl) the 4-bit GEMV that looks the code up with prmt in registers
#         (gemv_4bit_designs.py) against bitsandbytes at 1 / 4 / 8 rows, then where Gemma-4-E2B's
#         batch-1 step goes (profile)
#   thirteenth : (carry .whl) Qwen3.5's decode through fla's in-place recurrent kernel (`fla_decode`,
#                off by default until this runs): its GPU tests, then Qwen3.5-4B decode 1 / 8 / 64
#                with it off and on (about 6 minutes)
#   fla_lean : thirteenth at batch 8 and 64 only, fla_decode first (about 5 minutes)
#   fla_tests : fla_decode's GPU tests alone (about 2 minutes)
#   e2b_ab : the GPU tests of Gemma-4's q/k/v epilogue kernel (`gemma_qkv_epilogue`, off until they
#            pass), then Gemma-4-E2B decode 1 / 8 from empty compile caches, weight shapes constant
#            everywhere (the old default) against the new default (prefill symbolic) with the
#            epilogue (about 8 minutes)
#   rope_ab : (carry .whl and .ab_old) fla_decode's GPU tests, then E2B and Qwen3-4B decode 1 / 8 before and
#             after RoPE without torch.cat and decode's ints specialised
#   gelu_ab : (carry .whl and .ab_old) Gemma's gate/up in one launch (GELU_TANH a function, 096fb22)
#             and GEMV partials added slice by slice (sum_partials):
#             E2B and 26B-A4B decode 1 / 8 before and after, E2B's batch-1 kernel sequence, the
#             revised bf16 fla_decode test (about 9 minutes)
#   e2b_sequence : the kernels ending E2B's batch-1 step in order, with the gaps between them
#   fourteenth : what live LoRA's fused shrink costs at 2 / 4 / 8 / 16 / 32 K slices per adapter, and with
#                B (s A x) added in the last K slice instead of the first (lora_sweep.py, 1 and 8
#                rows), the 4-bit GEMV designs at one row (carry .whl)
#   gemma_big : Gemma-4-26B-A4B and 31B decode at 1 / 8 / 64 against their rooflines and HF (about 9 minutes)
#   routing_ab : (carry .whl and .ab_old = `git archive 3ca8fb0 flexrollout`) E2B decode 1 / 8 and
#                26B-A4B 1 / 8 / 64 before and after Gemma's gate/up in one launch, sum_partials and
#                GEMV routing per projection (26B-A4B's attention and gate/up now take it) (about 9 minutes)
#   sixteenth : the live-LoRA tests on gpt-oss / 26B-A4B, then 26B-A4B and E2B decode at 1 / 8 on
#               today's tree alone (about 7 minutes; 2026-12-07's H200 figures)
#   seventeenth : MoE routers on the GEMV, 26B-A4B's experts on the grouped GEMV (GELU-tanh): the
#                 real-width fp32 tests of 26B-A4B (grouped GEMV and graphs) and Qwen3-30B-A3B, the
#                 rewritten 26B-A4B live-LoRA test, then 26B-A4B at 1 / 8 / 64 and Qwen3-30B-A3B
#                 at 1 / 8 (about 9 minutes)
#   h200_gemma : Gemma-4-E2B and 31B decode at 1 / 8 / 64 against their rooflines and HF (E2B's batch 64
#                and 31B have no H200 figure yet; 31B at 64 rows fits an H200's memory) (about 8 minutes)
#   ragged : `ragged_gemv` (on since its 2026-12-07 pass), the GEMV over input widths off its 128-wide K step
#            (masked K tails: 26B-A4B's 2,112-wide dense down, gpt-oss's 2,880-wide q/k/v and
#            router): its CUDA tests, the live-LoRA tests on those models against PEFT (adapters
#            folded in), gpt-oss-20b and 26B-A4B decode at 1 / 8 without and with it, then
#            cuBLAS against the engine's tiling at 1 / 8 rows (about 10 minutes)
#   qwen36 : (carry .whl with fla; an H200: ~70 GB of weights) Qwen3.6-35B-A3B, never benchmarked: its
#            real-width fp32 GPU test, then decode at 1 / 8 / 64 against its MoE roofline and HF
#            (#20's target: 50% at batch 8) (about 8 minutes)
#   qwen36_bench : qwen36's decode without its test (about 5 minutes)
#   qwen36_short : (carry .whl; an H200) Qwen3.6-35B-A3B decode at 1 / 8 against its MoE roofline
#                  and HF (about 4 minutes)
#   recheck_31b : Gemma-4-31B's real-width fp32 greedy test against HF alone (about 8 minutes)
#   catchup : (carry .whl) tests only, no timings, so they may share the GPU: recheck_31b in the
#             background while the 4-bit kernel's and fla_decode's GPU tests (never seen to pass since
#             their last changes) run in the foreground (about 9 minutes)
#   h200_targets : (carry .whl; an H200) Qwen3.6-35B-A3B, Gemma-4-E2B and 26B-A4B decode at 1 / 8 / 64
#                  against their rooflines and HF: #19's and #20's H200 figures (about 10 minutes)
#   h200_issue20 : (carry .whl; an H200) Qwen3.6-35B-A3B and Qwen3.5-4B decode at 1 / 8 / 64 against
#                  their rooflines and HF: #20's H200 figures (about 8 minutes)
#   routing_tests : the GPU tests of routing per projection (live LoRA on gpt-oss and 26B-A4B against
#                   PEFT, their fp32 parity with HF), the revised bf16 fla_decode test, then where
#                   Qwen3.5-4B's batch-64 step goes (profile_decode.py; carry .whl) (about 9 minutes)
#   e2b_gemv : the GEMV tilings swept on Gemma-4-E2B's shapes at 1 / 8 rows (about 5 minutes)
#   designs2 : (carry .whl) the 4-bit GEMV designs (code looked up by warp shuffle or prmt) at 1 / 8
#              rows, each best tiling's kernel alone too
#   probe4 : (carry .whl) the engine's 4-bit loop with one suspect changed at a time (code lookup,
#            x load, pipeline depth) against bitsandbytes (about 4 minutes; LIMIT_PROBE, PROBE_STAGES)
#   nf4_lookup : (carry .whl) the 4-bit kernel with the code in registers: its GPU tests, the
#                per-projection sweep, NF4 decode with and without quant_kernels (about 9 minutes)
#   twelfth : (carry .whl with fla) Qwen3.5-4B decode 1 / 8 / 64 against HF, Qwen3-4B's batch-1
#             decode profile without and with a live r=32 adapter on all seven projections
#   gemma_startup : Gemma-4-E2B decode 1 / 8 / 64 from cold compile caches with weight shapes traced
#                   as constants and as symbols (static_weight_shapes False / "never": 20 -> 11
#                   compiles at 10 layers on CPU): start-up against tok/s
out=${1:-/tmp/flexrollout-gpu}
part=${2:-core}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Inductor's four-line note on split softmax reductions (large vocabularies) ends many runs: dropped,
# so a part's `tail` keeps the table.
filter() { grep -v -e DEBUG -e "UserWarning" -e "warn_once" -e "warnings.warn" -e "Online softmax is" \
  -e "split the reduction" -e "important use case" -e "^ *softmax\.$" -e "^ *$"; }
# Every step's whole output also goes to $out/full.log: a filtered tail hides why a step failed.
bench() { timeout "$1" python3 -m flexrollout.cli bench "${@:2}" 2>&1 | tee -a "$out/full.log" | filter; }
# pytest-timeout's session limit stops the run 30 s before `timeout` would, so the failures' summary
# (-rfE, short tracebacks) still prints; a killed pytest prints nothing but its progress dots.
gputest() { timeout "$1" python3 -m pytest -q -m gpu -rfE --tb=short -p no:cacheprovider \
  --session-timeout=$(( $1 - 30 )) "${@:2}" 2>&1 | tee -a "$out/full.log" | filter; }
# decode_vs_hf PRESET LIMIT MEMORY: decode at 1 / 8 / 64 against the roofline and HF, into $out/PRESET.txt.
decode_vs_hf() { bench "$2" --preset "$1" --batch-sizes 1,8,64 --workload decode --compare hf --hf-max-tokens 8 \
  --gpu-memory-utilization "$3" --json "$out/$1.json" | tail -6 > "$out/$1.txt"; }
lora32() { bench 150 --preset qwen3-4b --workload grpo --lora-rank 32 --json "$out/grpo-lora32.json" \
  | tail -2 > "$out/lora32.txt"; }
sweep=1,2,4,8,12,16,24,32,48,64
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt"
case $part in
core)
  timeout 240 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_kernels.py tests/test_async_decode.py \
    2>&1 | filter | tail -6 > "$out/tests.txt"
  bench 260 --preset qwen3-4b --batch-sizes $sweep --workload decode,grpo --compare hf --hf-max-tokens 32 \
    --json "$out/qwen3-4b.json" --plot "$out/qwen3-4b.png" | tail -16 > "$out/qwen3-4b.txt"
  names="gpu tests qwen3-4b" ;;
ab)
  for variant in '{"async_decode": false}' '{"small_batch_max_rows": 16}'; do
    echo "== $variant"
    bench 100 --preset qwen3-4b --batch-sizes 1,8,16,24,32,64 --workload decode,grpo --engine-args "$variant" | tail -8
  done > "$out/ab.txt"
  bench 120 --preset llama-3.2-3b --batch-sizes 1,8,64 --workload decode,prefill \
    --json "$out/llama-3.2-3b.json" | tail -8 > "$out/llama.txt"
  names="gpu ab llama" ;;
lora)
  timeout 240 python3 benchmarks/lora_modes.py --preset qwen3-4b > "$out/lora.log" 2>&1
  { grep -A40 '^{' "$out/lora.log" || tail -25 "$out/lora.log"; } > "$out/lora.txt"
  for b in 1 64; do timeout 90 python3 benchmarks/profile_decode.py --preset qwen3-4b --batch $b 2>&1 \
    | filter | head -24; done > "$out/profile.txt"
  names="gpu lora profile" ;;
trl)
  timeout 200 python3 -m pytest -q tests/test_trl.py -m gpu 2>&1 | filter | tail -4 > "$out/tests.txt"
  for mode in flex hf; do timeout 150 python3 benchmarks/trl_grpo.py $mode 2>&1 | tail -1; done > "$out/trl.txt"
  names="gpu tests trl" ;;
memory)
  for variant in '{}' '{"mlp_chunk_tokens": 8192}'; do
    echo "== $variant"
    bench 110 --preset qwen3-4b --batch-sizes 64 --workload decode,prefill --engine-args "$variant" | tail -3
  done > "$out/memory.txt"
  lora32
  names="gpu memory lora32" ;;
tune)
  timeout 220 python3 benchmarks/gemv_sweep.py "$out/gemv.json" > "$out/gemv.log" 2>&1
  grep -v '^skip' "$out/gemv.log" | cut -c1-400 > "$out/gemv.txt"
  timeout 220 python3 benchmarks/attention_sweep.py "$out/attention.json" 2>&1 | filter > "$out/attention.txt"
  timeout 120 python3 benchmarks/profile_decode.py --preset qwen3-4b --batch 1 ${PROFILE_FLAGS:-} 2>&1 \
    | filter | head -24 > "$out/profile.txt"
  names="gpu gemv attention profile" ;;
verify)
  timeout 230 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_kernels.py tests/test_async_decode.py \
    2>&1 | filter | tail -8 > "$out/tests.txt"
  bench 170 --preset qwen3-4b --batch-sizes 1,8,64 --workload decode,grpo --json "$out/qwen3-4b.json" \
    | tail -8 > "$out/bench.txt"
  timeout 40 python3 benchmarks/gemv_sweep.py "$out/gemv-engine.json" --shapes qkv,o,gate_up,down,lm_head \
    --rows 1,8,32 --engine-only 2>&1 | cut -c1-300 > "$out/gemv.txt"
  timeout 100 python3 benchmarks/gemv_sweep.py "$out/gemv.json" --shapes down,lm_head --rows 1,8,32 \
    2>&1 | grep -v '^skip' | cut -c1-400 >> "$out/gemv.txt"
  names="gpu tests bench gemv" ;;
final)
  bench 170 --preset qwen3-4b --batch-sizes 1,8,64 --workload decode,grpo --json "$out/qwen3-4b.json" \
    | tail -8 > "$out/bench.txt"
  timeout 230 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_async_decode.py \
    "tests/test_kernels.py::test_kernel_on_cuda" 2>&1 | filter | tail -8 > "$out/tests.txt"
  names="gpu bench tests" ;;
fifth)
  # The q/k/v epilogue kernel and the down tilings: their GPU tests and the parity tests first,
  # then the bs-1 profile, best-of-3 decode + GRPO, and the down projection's tilings.
  timeout 200 python3 -m pytest -q -m gpu tests/test_fused_kernels.py "tests/test_kernels.py::test_kernel_on_cuda" \
    "tests/test_gpu.py::test_fp32_greedy_matches_hf_with_graphs" "tests/test_gpu.py::test_bf16_first_logits_close_to_hf" \
    2>&1 | filter | tail -8 > "$out/tests.txt"
  timeout 120 python3 benchmarks/profile_decode.py --preset qwen3-4b --batch 1 2>&1 | filter | head -24 > "$out/profile.txt"
  bench 200 --preset qwen3-4b --batch-sizes 1,8,64 --workload decode,grpo --repeat 3 --json "$out/qwen3-4b.json" \
    | tail -8 > "$out/bench.txt"
  timeout 40 python3 benchmarks/gemv_sweep.py "$out/gemv-engine.json" --shapes down,o --rows 1,2,8,16,32 \
    --engine-only 2>&1 | cut -c1-300 > "$out/gemv.txt"
  names="gpu tests profile bench gemv" ;;
sixth)
  # Start-up first, on empty compile caches (the machine is fresh; the caches are set anyway).
  TORCHINDUCTOR_CACHE_DIR=/tmp/cold-inductor TRITON_CACHE_DIR=/tmp/cold-triton \
    bench 120 --preset qwen3-4b --batch-sizes 1 --max-tokens 64 --json "$out/startup.json" | tail -3 > "$out/startup.txt"
  timeout 200 python3 -m pytest -q -m gpu tests/test_fused_kernels.py \
    "tests/test_gpu.py::test_fp32_greedy_matches_hf_with_graphs" "tests/test_gpu.py::test_bf16_first_logits_close_to_hf" \
    2>&1 | filter | tail -4 > "$out/tests.txt"
  timeout 90 python3 benchmarks/profile_decode.py --preset qwen3-4b --batch 1 2>&1 | filter | head -24 > "$out/profile.txt"
  timeout 90 python3 benchmarks/profile_decode.py --preset qwen3-4b --batch 64 2>&1 | filter | head -24 > "$out/profile64.txt"
  bench 150 --preset qwen3-4b --batch-sizes 1,8,64 --workload decode,grpo --repeat 3 --json "$out/qwen3-4b.json" \
    | tail -5 > "$out/bench.txt"
  timeout 60 python3 benchmarks/attention_sweep.py --batches 1,8 --no-partial "$out/attention.json" --options \
    '[{"num_stages": 3}, {"num_stages": 3, "SPLIT_KV": 1}, {"num_stages": 3, "SPLIT_KV": 2}, {"num_stages": 3, "SPLIT_KV": 4}, {"num_stages": 3, "SPLIT_KV": 8}]' \
    2>&1 | filter > "$out/attention.txt"
  names="gpu startup tests profile profile64 bench attention" ;;
seventh)
  # Llama-3.2-3B decode + prefill (cold caches: start-up), then every GPU test on the final code.
  bench 140 --preset llama-3.2-3b --batch-sizes 1,8,64 --workload decode,prefill --repeat 2 \
    --json "$out/llama.json" | tail -5 > "$out/llama.txt"
  timeout 430 python3 -m pytest -q -m gpu tests/ 2>&1 | filter | tail -12 > "$out/tests.txt"
  names="gpu llama tests" ;;
prefill_ab)
  # Llama-3.2-3B prefill (64 x 512, max_num_seqs 64) with the q/k/v epilogue kernel on and off.
  pre="--preset llama-3.2-3b --workload prefill --batch-sizes 64"
  { for v in ${AB_ORDER:-true false true}; do echo "qkv_epilogue $v"
      bench 80 $pre --engine-args "{\"qkv_epilogue\": $v}" | grep -e "INFO.*prefill tok/s" | cut -c1-200; done; } \
    > "$out/prefill_ab.txt"
  names="gpu prefill_ab" ;;
moe_tests)
  # Every GPU test (the MoE ones at real widths included).
  timeout 560 python3 -m pytest -q -m gpu tests/ 2>&1 | filter | tail -14 > "$out/tests.txt"
  names="gpu tests" ;;
moe)
  # Qwen3-30B-A3B and gpt-oss-20b (random bf16 weights, real sizes): decode at 1 / 8 / 64 against
  # the MoE roofline (only the experts a step's tokens chose are read), GRPO, HF at the same sizes.
  for preset in qwen3-30b-a3b gpt-oss-20b; do
    bench 280 --preset $preset --batch-sizes 1,8,64 --workload decode,grpo --compare hf --hf-max-tokens 32 \
      --gpu-memory-utilization 0.55 --json "$out/$preset.json" | tail -8 > "$out/$preset.txt"
  done
  names="gpu qwen3-30b-a3b gpt-oss-20b" ;;
hybrid)
  timeout 240 python3 -m pytest -q -m gpu tests/test_gemma4.py tests/test_qwen35.py tests/test_quant4bit.py \
    2>&1 | filter | tail -14 > "$out/tests.txt"
  bench 150 --preset qwen3-4b --batch-sizes 1,8,64 --workload decode,grpo --json "$out/qwen3-4b.json" \
    | tail -5 > "$out/qwen3-4b.txt"
  for preset in gemma-4-e2b qwen3.5-4b; do
    bench 90 --preset $preset --batch-sizes 1,8,64 --workload decode --json "$out/$preset.json" | tail -5 > "$out/$preset.txt"
  done
  names="gpu tests qwen3-4b gemma-4-e2b qwen3.5-4b" ;;
recheck)
  gputest 230 tests/test_qwen35.py tests/test_quant4bit.py \
    tests/test_gpu.py -k "qwen35 or quant4bit or moe_graphs or moe_expert_lora" | tail -8 > "$out/tests.txt"
  bench 150 --preset qwen3.5-4b --batch-sizes 1,8,64 --workload decode --compare hf --hf-max-tokens 16 \
    --json "$out/qwen3.5-4b.json" | tail -6 > "$out/qwen3.5-4b.txt"
  bench 110 --preset qwen3-4b --batch-sizes 1,8 --quantization bnb-nf4 --compare hf --hf-max-tokens 16 \
    --json "$out/nf4.json" | tail -5 > "$out/nf4.txt"
  names="gpu tests qwen3.5-4b nf4" ;;
gemma)
  timeout 150 python3 benchmarks/profile_decode.py --preset gemma-4-e2b --batch 1 2>&1 | filter | head -30 \
    > "$out/profile.txt"
  timeout 200 python3 -m pytest -q -m gpu tests/test_gemma4.py -k bf16_graphs 2>&1 | filter | tail -4 > "$out/tests.txt"
  for preset in gemma-4-26b-a4b gemma-4-31b; do
    bench 200 --preset $preset --batch-sizes 1,8 --workload decode --gpu-memory-utilization 0.6 \
      --json "$out/$preset.json" | tail -4 > "$out/$preset.txt"
  done
  names="gpu profile tests gemma-4-26b-a4b gemma-4-31b" ;;
lora32)
  lora32
  names="gpu lora32" ;;
unsloth)
  # The wheel installs flexrollout-unsloth.pth (the activation hook) where python3 reads .pth files.
  install() { python3 -m pip install -q --no-index --no-deps --no-cache-dir "$@"; }
  install --no-compile --upgrade --target /tmp/site .whl-unsloth/*.whl
  install .whl-unsloth/self/flexrollout-*.whl \
    || install --break-system-packages .whl-unsloth/self/flexrollout-*.whl
  PYTHONPATH=$PYTHONPATH:/tmp/site UNSLOTH_FAST_INFERENCE=1 timeout "${UNSLOTH_TIMEOUT:-330}" \
    python3 benchmarks/unsloth_grpo.py --steps 2 > "$out/unsloth.log" 2>&1
  echo "rc=$?" >> "$out/unsloth.log"
  { grep '^{' "$out/unsloth.log" || filter < "$out/unsloth.log" | tail -40; } > "$out/unsloth.txt"
  names="gpu unsloth" ;;
pending_tests)
  gputest 560 tests/ | tail -14 > "$out/tests.txt"
  names="gpu tests" ;;
pending_bench)
  bench 180 --preset qwen3-4b --batch-sizes 1,8,64 --workload decode --sampling-options none,penalties,bad_words \
    --json "$out/qwen3-4b.json" | tail -8 > "$out/qwen3-4b.txt"
  timeout 230 python3 benchmarks/lora_modes.py --preset qwen3-4b --ranks 16,32 --batch-sizes 1,8,64 \
    > "$out/lora.log" 2>&1
  { grep -A60 '^{' "$out/lora.log" || tail -25 "$out/lora.log"; } > "$out/lora.txt"
  bench 150 --preset qwen3-4b --batch-sizes 1,8,64 --quantization bnb-nf4 --compare hf --hf-max-tokens 16 \
    --json "$out/nf4.json" | tail -6 > "$out/nf4.txt"
  names="gpu qwen3-4b lora nf4" ;;
recheck_graphs)
  # The tests of 2026-12-05's warm-up fix (Qwen3.5 states, 4-bit Qwen3.5 graphs) first, then the
  # rest of the GPU tests the first H200 call did not reach; the slow real-width Gemma-4 ones (the
  # near-tie-aware 31B test among them) last.
  gputest 560 tests/test_quant4bit.py tests/test_qwen35.py tests/test_lora_fused_gpu.py tests/test_sleep.py \
    tests/test_gpu.py tests/test_kernels.py tests/test_sampling_vocab.py tests/test_gemma4.py \
    | tail -30 > "$out/tests.txt"
  names="gpu tests" ;;
lora_profile)
  timeout 130 python3 benchmarks/lora_sweep.py --splits 8,32 2>&1 | filter > "$out/lora_sweep.txt"
  for args in "--batch 1" "--batch 1 --lora-rank 32" "--batch 8" "--batch 8 --lora-rank 32"; do
    echo "== $args"
    timeout 75 python3 benchmarks/profile_decode.py --preset qwen3-4b $args 2>&1 | filter | head -22
  done > "$out/lora_profile.txt"
  names="gpu lora_sweep lora_profile" ;;
lora_next)
  gputest 200 tests/test_lora_fused_gpu.py tests/test_kernels.py -k "plain_model or kernel_on_cuda" | tail -4 > "$out/tests.txt"
  timeout 100 python3 benchmarks/lora_sweep.py --rows 1,64 --splits 8,32 2>&1 | filter > "$out/lora_sweep.txt"
  timeout 200 python3 benchmarks/lora_modes.py --preset qwen3-4b --ranks 32 --batch-sizes 8,64 2>&1 \
    | grep '^{"rank"' > "$out/lora_modes.txt"
  timeout 80 python3 benchmarks/profile_decode.py --preset qwen3-4b --batch 8 --lora-requests 4 2>&1 \
    | filter | head -24 > "$out/requests_profile.txt"
  names="gpu tests lora_sweep lora_modes requests_profile" ;;
nf4_next)
  bench 200 --preset qwen3-4b --batch-sizes 1,8,64 --quantization bnb-nf4 --compare hf --hf-max-tokens 16 \
    --json "$out/nf4.json" | tail -6 > "$out/nf4.txt"
  timeout 120 python3 benchmarks/profile_decode.py --preset qwen3-4b --batch 1 --quantization bnb-nf4 2>&1 \
    | filter | head -30 > "$out/nf4_profile.txt"
  gputest 200 tests/test_quant4bit.py -k "kernel_on_cuda or quant_kernels or qlora_decode" | tail -4 > "$out/kernel_test.txt"
  timeout 120 python3 benchmarks/gemv_4bit_sweep.py --rows 1,8,16,32,64 2>&1 | filter | tail -20 > "$out/gemv_4bit.txt"
  bench 180 --preset qwen3-4b --batch-sizes 1,8,64 --quantization bnb-nf4 --engine-args '{"quant_kernels": true}' \
    --json "$out/nf4_triton.json" | tail -4 > "$out/nf4_triton.txt"
  names="gpu nf4 nf4_profile kernel_test gemv_4bit nf4_triton" ;;
qlora_next)
  # QLoRA decode (NF4 base + live r=32 on all seven projections) with bitsandbytes' ops and with
  # quant_kernels (our 4-bit GEMV, layers compiled); the NF4 base alone comes from nf4_next.
  nf4="--preset qwen3-4b --batch-sizes 1,8,64 --quantization bnb-nf4 --lora-rank 32"
  { bench 180 $nf4 | tail -4; bench 180 $nf4 --engine-args '{"quant_kernels": true}' | tail -4; } > "$out/qlora.txt"
  names="gpu qlora" ;;
nf4_compile)
  gputest 200 tests/test_quant4bit.py -k "graphs_match_eager or qlora_decode" \
    | tail -4 > "$out/tests.txt"
  nf4="--preset qwen3-4b --batch-sizes 1,8,64 --quantization bnb-nf4"
  { bench 100 $nf4 | tail -4; bench 120 $nf4 --engine-args '{"compile_4bit": true}' | tail -4
    bench 130 $nf4 --lora-rank 32 --engine-args '{"compile_4bit": true}' | tail -4; } > "$out/nf4.txt"
  names="gpu tests nf4" ;;
designs)
  timeout 250 python3 benchmarks/gemv_4bit_designs.py 2>&1 | tee -a "$out/full.log" | grep -v -e fail -e Warn \
    | tail -16 > "$out/designs.txt"
  timeout 120 python3 benchmarks/gemv_4bit_sweep.py --rows 1,4,8,16,64 2>&1 | tee -a "$out/full.log" \
    | grep -v Warn | tail -22 > "$out/sweep.txt"
  gputest 200 -v tests/test_kernels.py tests/test_quant4bit.py -k "kernel_on_cuda" | grep -E "PASS|FAIL|Error|passed|failed" \
    | tail -30 > "$out/tests.txt"
  names="gpu designs sweep tests" ;;
gemma_startup)
  for a in '{}' '{"static_weight_shapes": false}'; do
    echo "== $a"; rm -rf /tmp/cold-inductor /tmp/cold-triton
    TORCHINDUCTOR_CACHE_DIR=/tmp/cold-inductor TRITON_CACHE_DIR=/tmp/cold-triton \
      bench 260 --preset gemma-4-e2b --batch-sizes 1,8,64 --workload decode --engine-args "$a" | tail -10
  done > "$out/startup.txt"
  names="gpu startup" ;;
gemma_compile)
  for preset in gemma-4-e2b qwen3-4b; do
    timeout 150 python3 benchmarks/compile_count.py --preset $preset --batch-sizes 1,8,64 2>&1 | filter | tail -12
  done > "$out/compiles.txt"
  TORCHINDUCTOR_CACHE_DIR=/tmp/cold-inductor TRITON_CACHE_DIR=/tmp/cold-triton \
    bench 200 --preset gemma-4-e2b --batch-sizes 1,8,64 --workload decode --json "$out/e2b.json" | tail -6 > "$out/e2b.txt"
  timeout 120 python3 benchmarks/profile_decode.py --preset gemma-4-e2b --batch 1 2>&1 | filter | head -30 \
    > "$out/profile.txt"
  names="gpu compiles e2b profile" ;;
fused)
  gputest 180 tests/test_lora_fused_gpu.py | tail -12 > "$out/tests.txt"
  q4b="--preset qwen3-4b --batch-sizes 1,8,64 --workload decode"
  bench 110 $q4b | tail -5 > "$out/base.txt"
  bench 110 $q4b --lora-rank 32 | tail -5 > "$out/live.txt"
  bench 110 $q4b --lora-rank 32 --engine-args '{"lora_fused_shrink": false}' | tail -5 > "$out/separate.txt"
  timeout 150 python3 benchmarks/lora_sweep.py --rows 1,32,64 --splits 32 2>&1 | filter > "$out/lora_sweep.txt"
  names="gpu tests base live separate lora_sweep" ;;
eighth)
  gputest 140 tests/test_lora_fused_gpu.py -k "folded_gemv or fp32_live" | tail -8 > "$out/tests.txt"
  q4b="--preset qwen3-4b --workload decode"
  bench 100 $q4b --batch-sizes 1,8,64 | tail -5 > "$out/base.txt"
  bench 100 $q4b --batch-sizes 1,8,64 --lora-rank 32 | tail -5 > "$out/live.txt"
  bench 70 $q4b --batch-sizes 64 --lora-rank 32 --engine-args '{"lora_gemv_max_rows": 64}' | tail -3 \
    > "$out/gemv64.txt"
  timeout 100 python3 benchmarks/profile_decode.py --preset gemma-4-e2b --batch 1 2>&1 | filter | head -40 \
    > "$out/e2b_profile.txt"
  bench 80 $q4b --batch-sizes 1,8 --lora-rank 32 --engine-args '{"lora_fused_shrink": false}' | tail -4 \
    > "$out/separate.txt"
  names="gpu tests base live gemv64 e2b_profile separate" ;;
ninth)
  gputest 150 tests/test_lora_fused_gpu.py \
    -k "folded_gemv and (32-16 or 32-64 or 33-16 or 33-64 or 64-16 or 64-64) and not 300" | tail -6 > "$out/tests.txt"
  q4b="--preset qwen3-4b --workload decode"
  bench 90 $q4b --batch-sizes 32,64 | tail -4 > "$out/base.txt"
  bench 90 $q4b --batch-sizes 32,64 --lora-rank 32 | tail -4 > "$out/live.txt"
  bench 90 $q4b --batch-sizes 64 --lora-rank 32 --engine-args '{"lora_gemv_max_rows": 64}' | tail -3 \
    > "$out/gemv64.txt"
  names="gpu tests base live gemv64" ;;
models)
  timeout 150 python3 benchmarks/profile_decode.py --preset gemma-4-e2b --batch 1 2>&1 | filter | head -40 \
    > "$out/e2b_profile.txt"
  bench 220 --preset qwen3.5-4b --batch-sizes 1,8,64 --workload decode --compare hf --hf-max-tokens 16 \
    | tail -5 > "$out/qwen35.txt"
  bench 200 --preset gemma-4-26b-a4b --batch-sizes 1,8 --workload decode --gpu-memory-utilization 0.9 \
    | tail -4 > "$out/gemma26b.txt"
  names="gpu e2b_profile qwen35 gemma26b" ;;
tenth)
  timeout 240 python3 benchmarks/profile_decode.py --preset gemma-4-e2b --batch 1 2>&1 | tee -a "$out/full.log" \
    | filter | tail -30 > "$out/e2b_profile.txt"
  bench 300 --preset gemma-4-26b-a4b --batch-sizes 1,8 --workload decode --gpu-memory-utilization 0.9 \
    | tail -4 > "$out/gemma26b.txt"
  names="gpu e2b_profile gemma26b" ;;
eleventh)
  # The tree in .ab_old (run from inside it, so its flexrollout/ is imported) against this one.
  for tree in .ab_old .; do
    echo "== $tree"
    ( cd "$tree" && export PYTHONPATH=$PWD:$PYTHONPATH
      bench 100 --preset qwen3-4b --batch-sizes 1,8 --prompt-len 2048 | tail -4
      bench 130 --preset gemma-4-e2b --batch-sizes 1,8 --prompt-len 2048 | tail -4 )
  done > "$out/masks_ab.txt"
  for shape in "8,1,512" "32,8,128"; do
    echo "== $shape"
    timeout 45 python3 benchmarks/attention_sweep.py --batches 1,8 --cache-pages 4096 --options '[{}]' \
      --context 2048 --shape $shape "$out/attn.json" 2>&1 | filter
  done > "$out/attention.txt"
  names="gpu masks_ab attention" ;;
lut)
  timeout 260 python3 benchmarks/gemv_4bit_designs.py --rows 1,4,8 2>&1 | tee -a "$out/full.log" \
    | grep -v -e fail -e Warn | tail -12 > "$out/lut.txt"
  timeout 240 python3 benchmarks/profile_decode.py --preset gemma-4-e2b --batch 1 2>&1 | tee -a "$out/full.log" \
    | filter | tail -30 > "$out/e2b_profile.txt"
  names="gpu lut e2b_profile" ;;
thirteenth)
  gputest 200 tests/test_qwen35.py -k fla_decode | tail -8 > "$out/tests.txt"
  i=0; for a in '{"fla_decode": false}' '{"fla_decode": true}'; do echo "== $a"; i=$((i + 1))
    bench 130 --preset qwen3.5-4b --batch-sizes 1,8,64 --workload decode --engine-args "$a" \
      --json "$out/qwen35-$i.json" | tail -4; done > "$out/qwen35.txt"
  names="gpu tests qwen35" ;;
fla_lean)
  # thirteenth in what is left of a session's device time: its tests, batch 8 and 64 only.
  gputest 150 tests/test_qwen35.py -k fla_decode | tail -8 > "$out/tests.txt"
  i=0; for a in '{"fla_decode": true}' '{"fla_decode": false}'; do echo "== $a"; i=$((i + 1))
    bench 110 --preset qwen3.5-4b --batch-sizes 8,64 --workload decode --engine-args "$a" \
      --json "$out/qwen35-$i.json" | tail -3; done > "$out/qwen35.txt"
  names="gpu tests qwen35" ;;
fla_tests)
  gputest "${LIMIT_FLA:-280}" tests/test_qwen35.py -k fla_decode | tail -8 > "$out/tests.txt"
  names="gpu tests" ;;
e2b_ab)
  # From empty compile caches each: the old weight-shape default against the new one (prefill
  # symbolic: start-up) with Gemma's q/k/v epilogue (decode; weight shapes constant in both).
  gputest 240 tests/test_fused_kernels.py tests/test_gemma4.py -k "on_cuda or (with_qkv_epilogue and e2b)" \
    | tail -8 > "$out/tests.txt"
  i=0; for a in '{"static_weight_shapes": "always"}' '{"gemma_qkv_epilogue": true}'; do
    echo "== $a"; i=$((i + 1)); rm -rf /tmp/cold-inductor /tmp/cold-triton
    TORCHINDUCTOR_CACHE_DIR=/tmp/cold-inductor TRITON_CACHE_DIR=/tmp/cold-triton \
      bench 170 --preset gemma-4-e2b --batch-sizes 1,8 --workload decode --engine-args "$a" \
      --json "$out/e2b-$i.json" | tail -3; done > "$out/e2b.txt"
  names="gpu tests e2b" ;;
rope_ab)
  # fla_decode's GPU tests, then (carry .ab_old, the tree before: see eleventh) decode at 1 / 8
  # before and after RoPE without torch.cat and decode's ints specialised (Gemma-4-E2B, Qwen3-4B).
  gputest 150 tests/test_qwen35.py -k fla_decode | tail -8 > "$out/tests.txt"
  for tree in .ab_old .; do
    echo "== $tree"
    ( cd "$tree" && export PYTHONPATH=$PWD:$PYTHONPATH
      bench 130 --preset gemma-4-e2b --batch-sizes 1,8 --workload decode | tail -3
      bench 100 --preset qwen3-4b --batch-sizes 1,8 --workload decode | tail -3 )
  done > "$out/rope_ab.txt"
  names="gpu tests rope_ab" ;;
gelu_ab)
  # (carry .whl and .ab_old = `git archive 3ca8fb0 flexrollout`, the tree before GELU_TANH became a
  # function) Gemma's gate/up in one launch: E2B and 26B-A4B decode 1 / 8 before and after, then
  # E2B's batch-1 kernel sequence, then the revised bf16 fla_decode test.
  for tree in .ab_old .; do
    echo "== $tree"
    ( cd "$tree" && export PYTHONPATH=$PWD:$PYTHONPATH
      bench 130 --preset gemma-4-e2b --batch-sizes 1,8 --workload decode | tail -3
      bench 200 --preset gemma-4-26b-a4b --batch-sizes 1,8 --workload decode \
        --gpu-memory-utilization 0.2 | tail -3 )
  done > "$out/gelu_ab.txt"
  timeout 120 python3 benchmarks/profile_decode.py --preset gemma-4-e2b --batch 1 --sequence 40 2>&1 \
    | tee -a "$out/full.log" | filter | tail -42 > "$out/e2b_sequence.txt"
  gputest 100 tests/test_qwen35.py -k bf16_fla_decode | tail -4 > "$out/tests.txt"
  names="gpu gelu_ab e2b_sequence tests" ;;
e2b_sequence)
  timeout 150 python3 benchmarks/profile_decode.py --preset gemma-4-e2b --batch 1 --sequence 90 2>&1 \
    | tee -a "$out/full.log" | filter | tail -95 > "$out/e2b_sequence.txt"
  names="gpu e2b_sequence" ;;
fourteenth)
  timeout 150 python3 benchmarks/lora_sweep.py --rows 1,8 --splits 32 2>&1 | tee -a "$out/full.log" \
    | grep -e "adds" -e "^rows" > "$out/lora_sweep.txt"
  timeout 220 python3 benchmarks/gemv_4bit_designs.py --rows 1 2>&1 | tee -a "$out/full.log" \
    | grep -v -e fail -e Warn | tail -8 > "$out/lut.txt"
  names="gpu lora_sweep lut" ;;
gemma_big)
  # Gemma-4-26B-A4B and 31B (random bf16 weights, real sizes) against their rooflines and HF.
  # On an H100 the 31B's 62 GB of weights leave too little KV cache for 64 rows of 384 tokens.
  for run in gemma-4-26b-a4b:1,8,64 gemma-4-31b:1,8; do preset=${run%%:*}
    bench 280 --preset $preset --batch-sizes ${run#*:} --workload decode --compare hf --hf-max-tokens 8 \
      --gpu-memory-utilization 0.2 --json "$out/$preset.json" | tail -6 > "$out/$preset.txt"
  done
  names="gpu gemma-4-26b-a4b gemma-4-31b" ;;
routing_ab)
  for tree in .ab_old .; do
    echo "== $tree"
    ( cd "$tree" && export PYTHONPATH=$PWD:$PYTHONPATH
      bench 110 --preset gemma-4-e2b --batch-sizes 1,8 --workload decode | tail -3
      bench 150 --preset gemma-4-26b-a4b --batch-sizes 1,8,64 --workload decode \
        --gpu-memory-utilization 0.2 | tail -4 )
  done > "$out/routing_ab.txt"
  names="gpu routing_ab" ;;
sixteenth)
  gputest 160 tests/test_gpu.py -k "off_the_gemv_k_step" | tail -6 > "$out/tests.txt"
  bench 150 --preset gemma-4-26b-a4b --batch-sizes 1,8 --workload decode \
    --gpu-memory-utilization 0.2 --json "$out/gemma-4-26b-a4b.json" | tail -3 > "$out/gemma-4-26b-a4b.txt"
  bench 110 --preset gemma-4-e2b --batch-sizes 1,8 --workload decode \
    --json "$out/gemma-4-e2b.json" | tail -3 > "$out/gemma-4-e2b.txt"
  names="gpu tests gemma-4-26b-a4b gemma-4-e2b" ;;
seventeenth)
  gputest 250 tests/test_gemma4.py tests/test_gpu.py -k \
    "(fp32 and 26b and not epilogue) or (off_the_gemv_k_step and 26b) or (moe_real_widths and qwen3)" \
    | tail -8 > "$out/tests.txt"
  bench 170 --preset gemma-4-26b-a4b --batch-sizes 1,8,64 --workload decode \
    --gpu-memory-utilization 0.2 --json "$out/gemma-4-26b-a4b.json" | tail -4 > "$out/gemma-4-26b-a4b.txt"
  bench 120 --preset qwen3-30b-a3b --batch-sizes 1,8 --workload decode \
    --gpu-memory-utilization 0.55 | tail -3 > "$out/qwen3-30b-a3b.txt"
  names="gpu tests gemma-4-26b-a4b qwen3-30b-a3b" ;;
h200_gemma)
  decode_vs_hf gemma-4-e2b 150 0.5
  decode_vs_hf gemma-4-31b 300 0.2
  names="gpu gemma-4-e2b gemma-4-31b" ;;
recheck_31b)
  # The 31B real-width fp32 test failed once on an H200 (2026-12-05, traceback lost to a time
  # limit) and has not run to its end since; alone, with room for its compiles.
  gputest "${LIMIT_31B:-560}" tests/test_gemma4.py -k "fp32_greedy and 31b" | tail -30 > "$out/tests.txt"
  names="gpu tests" ;;
catchup)
  # The test processes share the GPU (nothing here is timed) and the 16 cores (the 31B test's
  # compiles are most of its minutes); each keeps its own summary (full.log interleaves them).
  gputest "${LIMIT_31B:-560}" tests/test_gemma4.py -k "fp32_greedy and 31b" | tail -30 > "$out/tests.txt" &
  gputest 240 tests/test_quant4bit.py -k "kernel_on_cuda or quant_kernels" | tail -6 > "$out/kernel_test.txt"
  gputest "${LIMIT_FLA:-280}" tests/test_qwen35.py -k fla_decode | tail -8 > "$out/fla.txt"
  wait
  names="gpu tests kernel_test fla" ;;
h200_targets)
  # #19's and #20's H200 decode figures in one call: Qwen3.6-35B-A3B (never measured), E2B at 64
  # rows (no H200 figure) and 26B-A4B (28.5% at batch 1 on the H200 before the MoE-kernel fixes).
  decode_vs_hf qwen3.6-35b-a3b 280 0.65
  decode_vs_hf gemma-4-e2b 150 0.5
  decode_vs_hf gemma-4-26b-a4b 140 0.2
  names="gpu qwen3.6-35b-a3b gemma-4-e2b gemma-4-26b-a4b" ;;
h200_issue20)
  # #20's H200 figures: Qwen3.6-35B-A3B (never measured) and Qwen3.5-4B (H100 figures only).
  decode_vs_hf qwen3.6-35b-a3b 280 0.65
  decode_vs_hf qwen3.5-4b 170 0.5
  names="gpu qwen3.6-35b-a3b qwen3.5-4b" ;;
ragged)
  gputest 330 tests/test_kernels.py tests/test_gpu.py -k "on_cuda or off_the_gemv_k_step" \
    | tail -6 > "$out/tests.txt"
  for p in gpt-oss-20b gemma-4-26b-a4b; do for a in '{"ragged_gemv": false}' '{}'; do echo "== $p $a"
    bench 110 --preset $p --batch-sizes 1,8 --workload decode \
      --gpu-memory-utilization 0.2 --engine-args "$a" | grep -A3 "^workload"; done; done > "$out/ragged_ab.txt"
  timeout 60 python3 benchmarks/gemv_sweep.py "$out/ragged.json" --shapes ragged --rows 1,8 --engine-only 2>&1 \
    | tee -a "$out/full.log" | grep -v -e skip -e Warn > "$out/ragged.txt"
  names="gpu tests ragged_ab ragged" ;;
qwen36)
  gputest 200 tests/test_qwen35.py -k "real_widths and moe" | tail -4 > "$out/tests.txt"
  decode_vs_hf qwen3.6-35b-a3b 330 0.65
  names="gpu tests qwen3.6-35b-a3b" ;;
qwen36_short)
  # #20's key figure (batch 8 against the MoE roofline and HF) in about 4 minutes.
  bench 250 --preset qwen3.6-35b-a3b --batch-sizes 1,8 --workload decode --compare hf --hf-max-tokens 8 \
    --gpu-memory-utilization 0.65 --json "$out/qwen3.6-35b-a3b.json" | tail -5 > "$out/qwen3.6-35b-a3b.txt"
  names="gpu qwen3.6-35b-a3b" ;;
qwen36_bench)
  # qwen36 without its test, for a warm machine's last minutes.
  decode_vs_hf qwen3.6-35b-a3b 290 0.65
  names="gpu qwen3.6-35b-a3b" ;;
routing_tests)
  gputest 280 tests/test_gpu.py tests/test_gemma4.py tests/test_qwen35.py -k \
    "off_the_gemv_k_step or (fp32 and 26b) or gpt-oss-20b-grouped-gemv or bf16_fla_decode" \
    | tail -12 > "$out/tests.txt"
  timeout 270 python3 benchmarks/profile_decode.py --preset qwen3.5-4b --batch 64 2>&1 \
    | tee -a "$out/full.log" | filter | tail -25 > "$out/qwen35-profile64.txt"
  names="gpu tests qwen35-profile64" ;;
e2b_gemv)
  # The GEMV's tilings on Gemma-4-E2B's shapes (the tiling rule came from Qwen3-4B's) at 1 / 8 rows.
  timeout 420 python3 benchmarks/gemv_sweep.py "$out/e2b_gemv.json" --shapes e2b --rows 1,8 2>&1 \
    | tee -a "$out/full.log" | grep -v -e skip -e Warn > "$out/e2b_gemv.txt"
  names="gpu e2b_gemv" ;;
nf4_lookup)
  # The 4-bit kernel with the code in registers, x loaded whole and two NF4 blocks a loop step
  # (2026-12-07): its GPU tests, then per projection against bitsandbytes, then NF4 decode with it
  # against bitsandbytes' ops.
  gputest 200 tests/test_quant4bit.py -k "kernel_on_cuda or quant_kernels" | tail -4 > "$out/kernel_test.txt"
  timeout 120 python3 benchmarks/gemv_4bit_sweep.py --rows 1,8,64 2>&1 | filter | tail -12 > "$out/gemv_4bit.txt"
  for a in '{}' '{"quant_kernels": true}'; do echo "== $a"; bench 120 --preset qwen3-4b --batch-sizes 1,8,64 \
    --quantization bnb-nf4 --engine-args "$a" | tail -6; done > "$out/nf4_ab.txt"   # (memory: #22)
  names="gpu kernel_test gemv_4bit nf4_ab" ;;
probe4)
  # Which stall makes the engine's dot-based 4-bit kernel 15x slower than bitsandbytes (#22):
  # its loop with one suspect removed at a time (code gather, strided x, pipeline depth).
  timeout "${LIMIT_PROBE:-240}" python3 benchmarks/gemv_4bit_probe.py --rows 1,64 --nested 1 \
    --stages "${PROBE_STAGES:-1,2,4}" 2>&1 | tee -a "$out/full.log" \
    | grep "^|" > "$out/probe4.txt"
  names="gpu probe4" ;;
designs2)
  timeout 300 python3 benchmarks/gemv_4bit_designs.py --rows 1,8 2>&1 | tee -a "$out/full.log" \
    | grep -v -e fail -e Warn | tail -14 > "$out/lut.txt"
  names="gpu lut" ;;
twelfth)
  bench 260 --preset qwen3.5-4b --batch-sizes 1,8,64 --workload decode --compare hf --hf-max-tokens 8 \
    | tail -6 > "$out/qwen35.txt"
  for rank in 0 32; do timeout 100 python3 benchmarks/profile_decode.py --preset qwen3-4b --batch 1 \
    --lora-rank $rank 2>&1 | filter | tail -24; done > "$out/lora_profile.txt"
  names="gpu qwen35 lora_profile" ;;
esac
for f in $names; do echo "== $f"; cat "$out/$f.txt"; done
