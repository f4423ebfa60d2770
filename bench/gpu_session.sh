#!/usr/bin/env bash
# The GPU runs behind docs/performance.md, in parts of under 10 minutes each (one device
# call per part; a fresh machine compiles Triton/FLA kernels first, which the limits allow for).
# Logs and JSON go under $OUT (at most 8 files a part: what a device call brings back).
#
# On the GPU machine, from the repository root, after the wheels are installed:
#   bash bench/gpu_session.sh all     # every GPU test, in four concurrent groups (one call; one GPU suffices)
#   bash bench/gpu_session.sh fp8     # FP8 GPU tests, each FP8 path and tiling on 9B's and 80B's shapes
#   bash bench/gpu_session.sh fp8-decode # FP8 GPU tests, 80B FP8 decode against REV (prepare REV)
#   bash bench/gpu_session.sh fp8-decode-2 # 35B FP8 decode against REV, 80B with DELTASERVE_FP8_DECODE=gemm, 80B profile
#   bash bench/gpu_session.sh moe-prefill # 80B 8k prefill's host syncs, MoE prefill tiles (80B, 35B), 80B decode at 8k context
#   bash bench/gpu_session.sh moe-prefill-ab # MoE + FP8 prefill GPU tests, 80B/35B 8k prefill vs REV, 80B serving with SERVE=1
#   bash bench/gpu_session.sh fused-quant # FP8 rows from norms/SwiGLU, one-launch in_proj: tests, FP8 decode vs REV
#   bash bench/gpu_session.sh skinny-moe # the skinny MoE's tilings on 80B's and 35B's experts
#   bash bench/gpu_session.sh moe-ab  # 80B FP8 batch 1 and 35B FP8 batch 1 / 8 against REV (prepare REV)
#   bash bench/gpu_session.sh moe-crossover # FP8 MoE: skinny vs grouped GEMMs by layer, decode at PAIRS="384 default"
#   bash bench/gpu_session.sh moe-decode # 80B FP8 batch-32 decode's kernels; the grouped MoE GEMMs' tiles at decode's 32 / 64 tokens
#   bash bench/gpu_session.sh skinny-32 # skinny GEMM vs cuBLAS at 16-64 rows (80B, 9B); 80B FP8 decode vs REV
#   bash bench/gpu_session.sh skinny-32-tests # their GPU tests
#   bash bench/gpu_session.sh skinny-32-sweep # the skinny GEMM's tilings at 24 / 32 rows (80B, 9B)
#   bash bench/gpu_session.sh skinny-32-2 # 35B and 9B FP8 decode vs REV
#   bash bench/gpu_session.sh moe-pdl # the grouped MoE with PDL and a Triton top-k sum: 80B / 35B FP8 decode vs REV
#   bash bench/gpu_session.sh moe-pdl-tests # their GPU tests
#   bash bench/gpu_session.sh moe-swap # decode's grouped MoE GEMMs swapped onto wgmma: tilings; 80B / 35B FP8 vs REV
#   bash bench/gpu_session.sh moe-swap-tests # their GPU tests; the bf16 MoE models' engine tests
#   bash bench/gpu_session.sh moe-swap-bf16 # the bf16 grouped MoE's swapped tilings (35B-A3B, Kimi-Linear); their tests
#   bash bench/gpu_session.sh moe-swap-bf16-2 # their tests and Kimi's fused shared expert on CUDA; bf16 sweeps
#   bash bench/gpu_session.sh profiles-fp8 # each kernel's own time (no PDL): 9B / 80B FP8 batch 1, 80B FP8 batch 32
#   bash bench/gpu_session.sh norm-ab # the whole-row RMSNorm: its tests; 80B / 9B FP8 and 9B bf16 decode against REV
#   bash bench/gpu_session.sh align-ab # the grouping's warps on 80B's experts, 80B FP8 decode at the fastest; 9B 8k prefill against REV
#   bash bench/gpu_session.sh align-4 # the grouping in 4 warps: its test, 35B's experts, 80B FP8 decode at 8 and 4 warps
#   bash bench/gpu_session.sh moe-gemm # DELTASERVE_MOE_GEMM: tests, one layer, prefill and a mixed step, triton against auto
#   bash bench/gpu_session.sh features # GPU tests of features built on CPU: images, YaRN, weights updated in place (two GPUs: images and MTP at TP = 2, data parallelism); 80B FP8 decode
#   bash bench/gpu_session.sh budget  # two 8k prompts in one 16k step against two 8k steps (80B FP8, 35B FP8, 9B)
#   bash bench/gpu_session.sh qwen    # Qwen3.5-0.8B / 9B decode + prefill with transformers
#   bash bench/gpu_session.sh defaults # cuBLAS + sync steps against the CUDA defaults; verify graphs in fp32
#   bash bench/gpu_session.sh diagnose # verification graphs in fp32, where batch-256 host time goes (9B, 0.8B)
#   bash bench/gpu_session.sh profiles # GPU idle gaps with overlap at two max_model_len, batch-1 kernels
#   bash bench/gpu_session.sh kimi-prefill # KDA/MLA prefill tests; 4k prefill: FLA public / direct, MLA sdpa
#   bash bench/gpu_session.sh ttft    # prefix-cache TTFT on 9B shapes
#   bash bench/gpu_session.sh spec    # speculative decoding, eager verification, window kernels vs references
#   bash bench/gpu_session.sh sampling # decode with Qwen3.5's sampling defaults against greedy
#   bash bench/gpu_session.sh ab      # before/after decode on one GPU (first, here: bash bench/ab.sh prepare REV; carry .base)
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
run() {  # run SECONDS NAME CMD...: a hard time limit each, so one stuck step leaves the rest
  local limit=$1 name=$2
  shift 2
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $? ($(tail -1 "$out/$name.log"))"
}
# python3 -c "$AT_WARPS" W ARGS...: bench.engine.decode with the MoE grouping's one program in W warps
AT_WARPS='import runpy, sys; import deltaserve.kernels.moe.align as a
a.ONE_PROGRAM_WARPS = int(sys.argv.pop(1)); sys.argv[0] = "decode"; runpy.run_module("bench.engine.decode", run_name="__main__")'
case "${1:-all}" in
  all)  # one pytest per group at once: the suite is bound by Triton/FLA compiling on the CPU, not the GPU
    run 560 engine-hf-tests python3 -m pytest -q -rA -m gpu tests/engine/test_gpu_engine.py &
    run 560 engine-rest-tests python3 -m pytest -q -rA -m gpu tests/engine tests/models \
      --ignore=tests/engine/test_gpu_engine.py &
    run 560 kda-tests python3 -m pytest -q -rA -m gpu tests/kernels/test_kda_cuda.py &
    run 560 kernel-tests python3 -m pytest -q -rA -m gpu tests/kernels --ignore=tests/kernels/test_kda_cuda.py &
    wait
    ;;
  moe-gemm)  # DELTASERVE_MOE_GEMM: its tests; one layer of each MoE model; 8 x 1,024 prefill and a Kimi-Linear mixed step, triton against auto
    run 120 moe-tests python3 -m pytest -q -rA -p no:cacheprovider tests/kernels/moe/test_moe_cuda.py
    run 90 moe-layer python3 -m bench.ops.moe_grouped_mm
    kimi=bench/configs/kimi-linear-48b-a3b-12l moe35=bench/configs/qwen3.5-35b-a3b-20l
    if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 100000 ]; then
      kimi=configs/kimi-linear-48b-a3b moe35=configs/qwen3.5-35b-a3b  # the whole models fit an H200
    fi
    run 150 prefill-kimi python3 -m bench.engine.moe_gemm_ab --model $kimi
    run 150 prefill-35b python3 -m bench.engine.moe_gemm_ab --model $moe35
    for mode in triton auto; do
      DELTASERVE_MOE_GEMM=$mode run 110 "mixed-kimi-$mode" python3 -m bench.engine.profile_prefill --model $kimi \
        --requests 8 --decode-rows 200 --rows 25
    done
    grep -h "^prefill of\|GPU busy\| prefill, ms" "$out"/prefill-*.log "$out"/mixed-kimi-*.log
    ;;
  features)  # the GPU tests of what CPU sessions built (each skips what the machine lacks: two GPUs), then 80B FP8 decode
    run 330 feature-tests python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/models/test_image_input.py \
      tests/models/test_rope_scaling.py tests/engine/test_weight_update.py tests/engine/parallel/test_tensor_parallel_gpu.py \
      tests/server/processes/test_data_parallel_gpu.py
    run 240 decode-80b-fp8 python3 -m bench.engine.decode --model configs/qwen3-next-80b-a3b-fp8 --batch-sizes 1 32 \
      --prompt-len 1024 --new-tokens 128 --prefill-len 0
    ;;
  budget)  # two 8k prompts prefilled in steps of 8,192 then 16,384 tokens: 80B FP8, 35B FP8, 9B (is a larger step budget faster?)
    for model in qwen3-next-80b-a3b-fp8 qwen3.5-35b-a3b-fp8 qwen3.5-9b; do
      for budget in 8192 16384; do
        run 150 "prefill-$model-$budget" python3 -m bench.engine.decode --model "configs/$model" --batch-sizes \
          --prefill-len 8192 --prefill-prompts 2 --step-budget "$budget"
      done
    done
    ;;
  qwen)
    run 170 bench-0.8b python3 -m bench.engine.decode --model configs/qwen3.5-0.8b --batch-sizes 1 8 64 256 \
      --new-tokens 128 --prefill-len 8192 --hf --hf-new-tokens 16 --json "$out/qwen3.5-0.8b.json"
    run 140 bench-9b python3 -m bench.engine.decode --model configs/qwen3.5-9b --batch-sizes 1 8 64 256 \
      --new-tokens 128 --prefill-len 8192 --hf --hf-new-tokens 16 --json "$out/qwen3.5-9b.json"
    run 100 sync-0.8b python3 -m bench.engine.decode --model configs/qwen3.5-0.8b --batch-sizes 64 256 \
      --new-tokens 128 --prefill-len 0 --disable-overlap-schedule --json "$out/qwen3.5-0.8b-sync.json"
    ;;
  defaults)  # before (cuBLAS everywhere, synchronous steps) and after (the CUDA defaults), one run
    run 40 gemv-tests python3 -m pytest -q -m gpu tests/kernels/test_gemv_cuda.py
    DELTASERVE_GEMV=cublas run 80 before-0.8b python3 -m bench.engine.decode --model configs/qwen3.5-0.8b \
      --batch-sizes 1 8 64 256 --new-tokens 128 --prefill-len 0 --disable-overlap-schedule
    run 90 after-0.8b python3 -m bench.engine.decode --model configs/qwen3.5-0.8b --batch-sizes 1 8 64 256 \
      --new-tokens 128 --prefill-len 8192 --json "$out/qwen3.5-0.8b.json"
    DELTASERVE_GEMV=cublas run 80 before-9b python3 -m bench.engine.decode --model configs/qwen3.5-9b \
      --batch-sizes 1 256 --new-tokens 128 --prefill-len 0 --disable-overlap-schedule
    run 100 after-9b python3 -m bench.engine.decode --model configs/qwen3.5-9b --batch-sizes 1 8 64 256 \
      --new-tokens 128 --prefill-len 8192 --json "$out/qwen3.5-9b.json"
    run 100 spec-graphs python3 -m bench.engine.spec_decode --model configs/qwen3.5-0.8b --batch-sizes 1 16 \
      --drafter oracle --oracle-right 3 --verify-graphs --dtype float32
    ;;
  diagnose)  # the open questions of docs/performance.md, one device call
    run 120 spec-fp32 python3 -m bench.engine.spec_decode --model configs/qwen3.5-0.8b --batch-sizes 1 16 \
      --drafter oracle --oracle-right 3 --verify-graphs --dtype float32 --new-tokens 64
    run 120 host-9b-bs256 python3 -m bench.engine.profile_decode --model configs/qwen3.5-9b --batch-size 256 \
      --max-model-len 8208 --rows 25
    run 100 host-0.8b-bs256 python3 -m bench.engine.profile_decode --model configs/qwen3.5-0.8b --batch-size 256 \
      --max-model-len 8208 --rows 25
    run 100 sync-9b-bs256 python3 -m bench.engine.decode --model configs/qwen3.5-9b --batch-sizes 256 \
      --new-tokens 128 --prefill-len 0 --disable-overlap-schedule
    ;;
  profiles)  # GPU busy time and idle gaps with overlap at two max_model_len, and batch 1
    run 100 profile-656 python3 -m bench.engine.profile_decode --model configs/qwen3.5-0.8b --batch-size 256 \
      --max-model-len 656 --rows 10
    run 100 profile-8208 python3 -m bench.engine.profile_decode --model configs/qwen3.5-0.8b --batch-size 256 \
      --max-model-len 8208 --rows 10
    run 80 profile-bs1 python3 -m bench.engine.profile_decode --model configs/qwen3.5-0.8b --batch-size 1 --rows 30
    ;;
  kimi-prefill)  # KDA prefill below FLA's entry and MLA prefill: before/after timings, one call
    run 120 kda-prefill-tests python3 -m pytest -q -m gpu tests/kernels/test_kda_cuda.py -k "prefill or fused" \
      tests/kernels/test_mla_cuda.py
    DELTASERVE_FLA_DIRECT=0 run 150 kimi-prefill-public python3 -m bench.engine.decode \
      --model configs/kimi-linear-48b-a3b --batch-sizes --prefill-len 4096
    run 150 kimi-prefill-direct python3 -m bench.engine.decode --model configs/kimi-linear-48b-a3b \
      --batch-sizes --prefill-len 4096
    DELTASERVE_MLA_PREFILL=sdpa run 170 kimi-prefill-sdpa python3 -m bench.engine.decode \
      --model configs/kimi-linear-48b-a3b --batch-sizes 1 8 --new-tokens 64 --prefill-len 4096
    ;;
  ttft)
    run 100 ttft-9b python3 -m bench.engine.prefix_ttft --model configs/qwen3.5-9b --load-format dummy --device cuda \
      --sessions 16 --turns 4 --system-len 2048 --json "$out/ttft-9b.json"
    ;;
  spec)  # eager verification, window kernels against their torch references, one call
    run 90 spec-oracle python3 -m bench.engine.spec_decode --model configs/qwen3.5-0.8b --batch-sizes 1 16 \
      --drafter oracle --oracle-right 3
    run 90 spec-oracle-ref-windows python3 -m bench.engine.spec_decode --model configs/qwen3.5-0.8b \
      --batch-sizes 1 16 --drafter oracle --oracle-right 3 --reference-windows
    run 60 window-tests python3 -m pytest -q -m gpu tests/kernels/test_window_kernels.py
    ;;
  sampling)  # sampled decode end to end (Qwen3.5's generation defaults) against greedy
    for model in qwen3.5-0.8b qwen3.5-9b; do
      for sampling in greedy qwen; do
        run 130 "$sampling-$model" python3 -m bench.engine.decode --model "configs/$model" --batch-sizes 1 8 64 256 \
          --new-tokens 128 --prefill-len 0 --sampling "$sampling"
      done
    done
    ;;
  ab)  # a performance change against the commit exported by `bench/ab.sh prepare REV`
    for model in qwen3.5-0.8b qwen3.5-9b; do
      run 200 "ab-$model" bash bench/ab.sh run python3 -m bench.engine.decode --model "configs/$model" \
        --batch-sizes 1 8 256 --new-tokens 128 --prefill-len 0
    done
    ;;
  fp8)  # FP8 GPU tests at once; each FP8 path and tiling on 9B's and 80B's dense shapes, 80B's experts
    run 200 fp8-kernel-tests python3 -m pytest -q -rfE -m gpu tests/kernels/fp8/test_fp8_cuda.py tests/kernels/moe/test_moe_cuda.py &
    run 200 fp8-model-tests python3 -m pytest -q -rfE -s -m gpu tests/models/test_fp8_checkpoints.py &
    wait
    run 150 fp8-gemv python3 -m bench.ops.fp8_gemv --model configs/qwen3.5-9b --rows 1 2 8 32 --gemm-tiles 64:4 32:6 \
      --gemv-tiles 4:4 8:4 2:8 4:2 16:2 --moe configs/qwen3-next-80b-a3b-fp8 --tokens 1 8 32
    run 100 fp8-gemv-80b python3 -m bench.ops.fp8_gemv --model configs/qwen3-next-80b-a3b-fp8 --rows 1 8 32 \
      --gemm-tiles 64:4 32:6 --gemv-tiles 4:4 8:4 2:8 16:2
    ;;
  fp8-decode)  # FP8 GPU tests; 80B-A3B FP8 decode against REV (prepare REV)
    run 240 fp8-kernel-tests python3 -m pytest -q -rfE -m gpu tests/kernels/fp8/test_fp8_cuda.py tests/kernels/moe/test_moe_cuda.py &
    run 240 fp8-model-tests python3 -m pytest -q -rfE -s -m gpu tests/models/test_fp8_checkpoints.py &
    wait
    run 300 ab-80b-fp8 bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3-next-80b-a3b-fp8 \
      --batch-sizes 1 8 --prompt-len 1024 --new-tokens 64 --prefill-len 0
    ;;
  fp8-decode-2)  # 35B-A3B FP8 decode against REV; the tree's old decode path; where 80B FP8's batch-1 step goes
    run 200 ab-35b-fp8 bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3.5-35b-a3b-fp8 \
      --batch-sizes 1 8 --new-tokens 64 --prefill-len 0
    DELTASERVE_FP8_DECODE=gemm run 150 gemm-80b-fp8 python3 -m bench.engine.decode \
      --model configs/qwen3-next-80b-a3b-fp8 --batch-sizes 1 8 --prompt-len 1024 --new-tokens 64 --prefill-len 0
    run 150 profile-80b-fp8 python3 -m bench.engine.profile_decode --model configs/qwen3-next-80b-a3b-fp8 \
      --batch-size 1 --prompt-len 1024 --rows 25
    ;;
  moe-prefill)  # 80B FP8 8k prefill's host syncs; the MoE's gate/up and down tiles at 8k tokens (80B, 35B); 80B decode at 8k context
    run 150 prefill-sync-80b python3 -m bench.engine.profile_prefill --model configs/qwen3-next-80b-a3b-fp8 --tokens 8192 \
      --rows 40 --sync-debug
    moe_tiles=(64:128:128:8:3 64:128:128:4:4 64:64:128:4:4 64:64:128:8:3/128:128:4:3 64:64:128:8:3/128:128:8:3
      64:64:128:8:3/128:128:4:4 64:64:128:8:3/256:128:8:3 64:64:128:8:3/64:128:4:4 64:64:128:8:3/128:64:4:4)
    run 150 moe-tiles-80b python3 -m bench.ops.fp8_gemm --moe configs/qwen3-next-80b-a3b-fp8 --tokens 8192 \
      --moe-tiles "${moe_tiles[@]}"
    run 150 moe-tiles-35b python3 -m bench.ops.fp8_gemm --moe configs/qwen3.5-35b-a3b-fp8 --tokens 8192 \
      --moe-tiles "${moe_tiles[@]}" 128:64:128:8:3 128:128:128:8:3
    run 150 decode-8k-80b python3 -m bench.engine.profile_decode --model configs/qwen3-next-80b-a3b-fp8 \
      --batch-size 32 --prompt-len 8192 --rows 30
    ;;
  moe-prefill-ab)  # the MoE's and the FP8 prefill's GPU tests; 80B / 35B FP8 8k prefill against REV; 80B serving ($SERVE)
    run 150 moe-tests python3 -m pytest -q -m gpu tests/kernels/moe/test_moe_align.py tests/kernels/moe/test_moe_cuda.py \
      tests/kernels/fp8/test_fp8_cuda.py -k "align or fused_moe or fp8_moe_matches or skips_masked or unquantized_rows or cublas"
    run 200 prefill-ab-80b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3-next-80b-a3b-fp8 \
      --batch-sizes 1 --new-tokens 8 --prefill-len 8192
    run 130 prefill-ab-35b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3.5-35b-a3b-fp8 \
      --batch-sizes 1 --new-tokens 8 --prefill-len 8192
    if [ -n "${SERVE:-}" ]; then
      bash bench/serve_session.sh 80b-fp8 > /dev/null 2>&1
      tail -16 "$out/serve.log"
    fi
    ;;
  fused-quant)  # FP8 rows from the norms/SwiGLU, one-launch in_proj: tests; 9B / 80B / 35B FP8 decode vs REV
    run 150 quant-tests python3 -m pytest -q -rfE -s -m gpu tests/kernels/fp8/test_fused_quant.py \
      tests/kernels/test_norm_kernels.py tests/kernels/test_router_cuda.py tests/models/test_fp8_checkpoints.py \
      tests/models/test_shared_expert_fusion.py &
    run 150 fp8-tests python3 -m pytest -q -rfE -m gpu tests/kernels/fp8/test_fp8_cuda.py \
      -k "moe_matches or skinny or unquantized_rows" &
    wait
    run 120 ab-9b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3.5-9b-fp8 \
      --batch-sizes 1 8 --prompt-len 512 --new-tokens 128 --prefill-len 0
    run 130 ab-80b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3-next-80b-a3b-fp8 \
      --batch-sizes 1 --prompt-len 1024 --new-tokens 64 --prefill-len 0
    run 110 ab-35b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3.5-35b-a3b-fp8 \
      --batch-sizes 1 8 --new-tokens 64 --prefill-len 0
    ;;
  skinny-moe)  # the skinny MoE's tilings on 80B's and 35B's experts (split, gate/up stages, down tile and stages)
    run 200 skinny-moe-80b python3 -m bench.ops.fp8_gemv --moe configs/qwen3-next-80b-a3b-fp8 --tokens 1 4 8 32 \
      --skinny-moe-tiles 1:3:64:4 2:3:64:4 4:3:64:4 8:3:64:4 16:3:64:4 4:4:64:4 8:2:64:4 8:4:64:4 \
      4:3:32:4 4:3:128:4 4:3:64:2 4:3:128:3
    run 150 skinny-moe-35b python3 -m bench.ops.fp8_gemv --moe configs/qwen3.5-35b-a3b-fp8 --tokens 1 8 16 \
      --skinny-moe-tiles 1:3:64:4 2:3:64:4 4:3:64:4 8:3:64:4 4:4:64:4 8:4:64:4 4:3:32:4 4:3:128:4
    ;;
  moe-ab)  # 80B FP8 batch 1 and 35B FP8 batch 1 / 8 against REV (prepare REV)
    if [ -n "${WITH_TESTS:-}" ]; then
      run 170 fp8-tests python3 -m pytest -q -x tests/kernels/fp8/test_fp8_cuda.py -k "moe_matches or skinny"
    fi
    run 120 ab-80b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3-next-80b-a3b-fp8 \
      --batch-sizes 1 --prompt-len 1024 --new-tokens 64 --prefill-len 0
    run 110 ab-35b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3.5-35b-a3b-fp8 \
      --batch-sizes 1 8 --new-tokens 64 --prefill-len 0
    ;;
  moe-crossover)  # the FP8 MoE's skinny path against its grouped GEMMs: one layer, then 80B / 35B decode at each limit
    run 90 moe-layer python3 -m bench.ops.fp8_gemv --moe configs/qwen3-next-80b-a3b-fp8 --tokens 8 16 24 32 48 64 \
      --json "$out/moe-layer-80b.json"
    run 60 moe-layer-35b python3 -m bench.ops.fp8_gemv --moe configs/qwen3.5-35b-a3b-fp8 --tokens 8 16 24 32 48 64
    for pairs in ${PAIRS:-384 default}; do  # --moe-pairs N (0: the grouped GEMMs throughout), or the default
      flag=""; [ "$pairs" = default ] || flag="--moe-pairs $pairs"
      run 170 decode-80b-$pairs python3 -m bench.engine.decode --model configs/qwen3-next-80b-a3b-fp8 \
        --batch-sizes 8 16 24 32 --prompt-len 1024 --new-tokens 64 --prefill-len 0 $flag
      run 120 decode-35b-$pairs python3 -m bench.engine.decode --model configs/qwen3.5-35b-a3b-fp8 \
        --batch-sizes 8 16 24 32 --new-tokens 64 --prefill-len 0 $flag
    done
    ;;
  moe-decode)  # where 80B FP8's batch-32 decode step goes; the grouped GEMMs' gate/up, then down tiles at decode sizes
    run 200 profile-80b-b32 python3 -m bench.engine.profile_decode --model configs/qwen3-next-80b-a3b-fp8 \
      --batch-size 32 --prompt-len 1024 --rows 30
    gu=(16:64:128:4:4 16:128:128:4:4 16:128:128:8:3 16:256:128:8:3 16:128:64:4:5 16:64:128:2:5 16:64:64:2:6)
    dn=(64:128:4:4 64:128:2:4 256:128:8:3 256:128:4:2 128:64:4:5 32:128:2:4 128:128:8:3 128:128:4:4)
    run 120 moe-tiles-80b python3 -m bench.ops.fp8_gemm --moe configs/qwen3-next-80b-a3b-fp8 --tokens 32 64 \
      --moe-tiles "${gu[@]}" "${dn[@]/#/16:128:128:4:3/}"
    run 100 moe-tiles-35b python3 -m bench.ops.fp8_gemm --moe configs/qwen3.5-35b-a3b-fp8 --tokens 32 64 \
      --moe-tiles "${gu[@]}" "${dn[@]/#/16:128:128:4:3/}"
    ;;
  skinny-32)  # the skinny GEMM against cuBLAS past 16 rows; 80B FP8 decode against REV (prepare REV)
    run 60 rows-80b python3 -m bench.ops.fp8_gemv --model configs/qwen3-next-80b-a3b-fp8 --rows 16 24 32 48 64
    run 60 rows-9b python3 -m bench.ops.fp8_gemv --model configs/qwen3.5-9b-fp8 --rows 16 24 32 48 64
    run 330 ab-80b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3-next-80b-a3b-fp8 \
      --batch-sizes 1 16 24 32 --prompt-len 1024 --new-tokens 64 --prefill-len 0
    ;;
  skinny-32-sweep)  # the skinny GEMM's tilings at 24 and 32 rows on 80B's and 9B's weights
    sk=(--skinny-tiles 64:4:1 64:4:2 64:4:4 64:3:1 64:5:1 128:4:1 128:3:1 128:4:2)
    run 150 sweep-80b python3 -m bench.ops.fp8_gemv --model configs/qwen3-next-80b-a3b-fp8 --rows 24 32 "${sk[@]}"
    run 150 sweep-9b python3 -m bench.ops.fp8_gemv --model configs/qwen3.5-9b-fp8 --rows 24 32 "${sk[@]}"
    ;;
  skinny-32-tests)  # the GPU tests of skinny-32's kernels in three groups at once (compiling bounds them)
    t=(python3 -m pytest -q -rf -m "gpu and not slow")
    run 540 tests-skinny "${t[@]}" tests/kernels/fp8/test_fp8_cuda.py -k skinny_matches_gemm &
    run 540 tests-fp8 "${t[@]}" tests/kernels/fp8/test_fp8_cuda.py -k "not skinny_matches_gemm" &
    run 540 tests-align "${t[@]}" tests/kernels/moe/test_moe_align.py tests/kernels/fp8/test_fused_quant.py \
      tests/models/test_fp8_checkpoints.py &
    wait
    ;;
  skinny-32-2)  # 35B and 9B FP8 decode against REV
    run 150 ab-35b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3.5-35b-a3b-fp8 \
      --batch-sizes 16 24 32 --new-tokens 64 --prefill-len 0
    run 120 ab-9b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3.5-9b-fp8 \
      --batch-sizes 16 24 32 --new-tokens 64 --prefill-len 0
    ;;
  moe-pdl)  # 80B and 35B FP8 decode at the grouped GEMMs' batches against REV (prepare REV)
    run 330 ab-80b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3-next-80b-a3b-fp8 \
      --batch-sizes 24 32 --prompt-len 1024 --new-tokens 64 --prefill-len 0
    run 200 ab-35b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3.5-35b-a3b-fp8 \
      --batch-sizes 24 32 --new-tokens 64 --prefill-len 0
    ;;
  moe-pdl-tests)  # the grouped MoE's GPU tests, in three concurrent groups (compiling is the bound)
    run 400 tests-moe python3 -m pytest -q -rf -m "gpu and not slow" tests/kernels/moe/test_moe_align.py \
      tests/kernels/moe/test_moe_topk_sum.py tests/kernels/moe/test_moe_cuda.py &
    run 400 tests-fp8 python3 -m pytest -q -rf -m "gpu and not slow" tests/kernels/fp8/test_fp8_cuda.py -k "moe or pdl" &
    run 400 tests-engine python3 -m pytest -q -rf -m "gpu and not slow" tests/models/test_fp8_checkpoints.py \
      -k engine_on_cuda &
    wait
    ;;
  moe-swap)  # the grouped MoE GEMMs' swapped tilings at decode's tokens; 80B and 35B FP8 decode against REV
    sw=(16:64:128:4:4:0 16:64:128:4:3:1 16:128:128:4:3:1 16:128:128:8:4:1 16:256:128:8:3:1
      16:64:128:4:4:1/64:128:4:4:1 16:64:128:4:4:1/256:128:8:3:1 16:64:128:4:4:1/128:128:4:4:1
      16:64:128:4:4:1/128:128:4:3:0)
    run 150 moe-swap-80b python3 -m bench.ops.fp8_gemm --moe configs/qwen3-next-80b-a3b-fp8 --tokens 24 32 64 \
      --moe-tiles "${sw[@]}"
    run 200 ab-80b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3-next-80b-a3b-fp8 \
      --batch-sizes 24 32 --prompt-len 1024 --new-tokens 64 --prefill-len 0
    run 160 ab-35b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3.5-35b-a3b-fp8 \
      --batch-sizes 24 32 --new-tokens 64 --prefill-len 0
    ;;
  moe-swap-tests)  # the FP8 MoE's GPU tests; the bf16 MoE models' engine-level GPU tests (three groups at once)
    t=(python3 -m pytest -q -rf -m "gpu and not slow")
    run 300 tests-fp8-moe "${t[@]}" tests/kernels/fp8/test_fp8_cuda.py -k "moe" &
    run 300 tests-fp8-engine "${t[@]}" tests/models/test_fp8_checkpoints.py -k engine_on_cuda &
    run 300 tests-bf16-moe "${t[@]}" tests/engine/test_gpu_engine.py tests/models/test_shared_expert_fusion.py \
      -k "qwen3_next or fused_shared" &
    wait
    ;;
  moe-swap-bf16)  # the bf16 grouped MoE GEMMs' tilings, swapped onto wgmma or not, at decode's tokens; their tests
    sw=(16:64:128:4:3:1 16:64:64:4:3:1 16:64:64:4:4:1 16:128:64:4:3:1 16:128:64:8:3:1 16:64:128:4:2:1)
    run 150 moe-bf16-35b python3 -m bench.ops.fp8_gemm --moe configs/qwen3.5-35b-a3b --bf16 --tokens 24 32 64 \
      --moe-tiles "${sw[@]}"
    run 150 moe-bf16-kimi python3 -m bench.ops.fp8_gemm --moe configs/kimi-linear-48b-a3b --bf16 \
      --tokens 24 32 64 --moe-tiles "${sw[@]}"
    run 200 tests-moe python3 -m pytest -q -rf -m "gpu and not slow" tests/kernels/moe/test_moe_cuda.py
    ;;
  moe-swap-bf16-2)  # the GPU tests not run yet (bf16 swapped tiles; Kimi's fused shared expert on CUDA), at once; the bf16 sweeps
    run 300 tests-moe python3 -m pytest -q -rf -m "gpu and not slow" tests/kernels/moe/test_moe_cuda.py &
    run 300 tests-kimi-shared python3 -m pytest -q -rf -m gpu tests/models/test_shared_expert_fusion.py -k "cuda and kimi" &
    wait
    sw=(16:64:128:4:3:1 16:64:64:4:3:1 16:64:64:4:4:1 16:128:64:4:3:1 16:64:128:4:2:1)
    run 100 moe-bf16-35b python3 -m bench.ops.fp8_gemm --moe configs/qwen3.5-35b-a3b --bf16 --tokens 24 32 64 \
      --moe-tiles "${sw[@]}"
    run 100 moe-bf16-kimi python3 -m bench.ops.fp8_gemm --moe configs/kimi-linear-48b-a3b --bf16 \
      --tokens 24 32 64 --moe-tiles "${sw[@]}"
    ;;
  profiles-fp8)  # without PDL (each kernel's own time): 9B FP8 and 80B FP8 batch 1, 80B FP8 batch 32
    run 150 profile-9b-fp8-b1 env DELTASERVE_PDL=off python3 -m bench.engine.profile_decode \
      --model configs/qwen3.5-9b-fp8 --batch-size 1 --rows 40
    run 150 profile-80b-fp8-b1 env DELTASERVE_PDL=off python3 -m bench.engine.profile_decode \
      --model configs/qwen3-next-80b-a3b-fp8 --batch-size 1 --prompt-len 1024 --rows 40
    run 150 profile-80b-fp8-b32 env DELTASERVE_PDL=off python3 -m bench.engine.profile_decode \
      --model configs/qwen3-next-80b-a3b-fp8 --batch-size 32 --prompt-len 1024 --rows 40
    ;;
  norm-ab)  # the whole-row RMSNorm's GPU tests; 80B FP8 batch 1 / 32, 9B FP8 and bf16 batch 1 / 8 against REV (prepare REV)
    run 150 norm-tests python3 -m pytest -q -rfE -m gpu tests/kernels/test_norm_kernels.py tests/kernels/fp8/test_fused_quant.py
    run 170 ab-80b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3-next-80b-a3b-fp8 \
      --batch-sizes 1 32 --prompt-len 1024 --new-tokens 64 --prefill-len 0
    run 120 ab-9b-fp8 bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3.5-9b-fp8 \
      --batch-sizes 1 8 --prompt-len 512 --new-tokens 128 --prefill-len 0
    run 120 ab-9b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3.5-9b \
      --batch-sizes 1 8 --prompt-len 512 --new-tokens 128 --prefill-len 0
    ;;
  align-ab)  # decode's MoE grouping at 1-16 warps on 80B's experts; 80B FP8 batch 32 at 8 warps and at the fastest; 9B 8k prefill against REV
    run 80 align-513 python3 -m bench.ops.moe_align --experts 513 --top-k 11 --tokens 24 32 64 --warps 1 2 4 8 16
    best=$(python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{\"experts')]
t=[x for x in r if x['tokens']==32][0]; print(min((v,k) for k,v in t.items() if k.endswith('_us'))[1].split('_')[1])" "$out/align-513.log")
    echo "fastest at 32 tokens: $best warps"
    for w in 8 "$best"; do
      run 110 "decode-80b-w$w" python3 -c "$AT_WARPS" "$w" --model configs/qwen3-next-80b-a3b-fp8 --batch-sizes 24 32 \
        --prompt-len 1024 --new-tokens 64 --prefill-len 0
    done
    run 120 ab-9b-prefill bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3.5-9b \
      --batch-sizes 1 --new-tokens 8 --prefill-len 8192
    ;;
  align-4)  # the grouping in 4 warps: its GPU test, 35B's experts at 4 and 8 warps, 80B FP8 decode at 8 then 4 (the first compiles)
    run 120 align-tests python3 -m pytest -q -rfE -m gpu tests/kernels/moe/test_moe_align.py
    run 80 align-257 python3 -m bench.ops.moe_align --experts 257 --top-k 9 --tokens 24 32 64 --warps 4 8
    for w in 8 4; do
      run 200 "decode-80b-w$w" python3 -c "$AT_WARPS" "$w" --model configs/qwen3-next-80b-a3b-fp8 --batch-sizes 24 32 \
        --prompt-len 1024 --new-tokens 64 --prefill-len 0
    done
    ;;
  *)
    echo "usage: $0 all|features|budget|qwen|defaults|diagnose|profiles|kimi-prefill|ttft|spec|sampling|ab|fp8|fp8-decode|fp8-decode-2|moe-prefill|moe-prefill-ab|fused-quant|skinny-moe|moe-ab|moe-crossover|moe-decode|skinny-32|skinny-32-sweep|skinny-32-tests|skinny-32-2|moe-pdl|moe-pdl-tests|moe-swap|moe-swap-tests|moe-swap-bf16|moe-swap-bf16-2|profiles-fp8|norm-ab|align-ab|align-4" >&2
    exit 2
    ;;
esac
