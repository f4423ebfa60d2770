#!/usr/bin/env bash
# The GPU runs behind docs/performance.md, in parts of under 10 minutes each (one device
# call per part; a fresh machine compiles Triton/FLA kernels first, which the limits allow for).
# Logs and JSON go under $OUT (at most 8 files a part: what a device call brings back).
#
# On the GPU machine, from the repository root, after the wheels are installed:
#   bash bench/gpu_session.sh all     # every GPU test, in four concurrent groups (one call; one GPU suffices)
#   bash bench/gpu_session.sh fp8     # FP8 GPU tests, each FP8 path and tiling on 9B's and 80B's shapes
#   bash bench/gpu_session.sh fp8-ab  # 9B FP8 decode against REV (prepare REV), 80B FP8 decode
#   bash bench/gpu_session.sh fp8-decode # FP8 GPU tests, 80B FP8 decode against REV (prepare REV)
#   bash bench/gpu_session.sh fp8-decode-2 # 35B FP8 decode against REV, 80B with DELTASERVE_FP8_DECODE=gemm, 80B profile
#   bash bench/gpu_session.sh shared-fusion # fused shared experts: GPU tests, 80B FP8 decode against REV and unfused
#   bash bench/gpu_session.sh shared-fusion-2 # 35B FP8 decode + 8k prefill against REV and unfused, Kimi against REV
#   bash bench/gpu_session.sh shared-fusion-bf16 # fused shared experts' GPU tests, 35B bf16 / Kimi decode against REV
#   bash bench/gpu_session.sh pairs-router # fusion/router/FP8 tests, router rounding against REV, MoE pair limit
#   bash bench/gpu_session.sh pairs-2 # router/FP8 MoE tests, the MoE pair limit on 80B FP8, kernels without PDL
#   bash bench/gpu_session.sh pairs-3 # router tests, 80B FP8 batch 1 / 32 against REV, 80B FP8 serving
#   bash bench/gpu_session.sh pairs-4 # FP8 MoE tests, 80B FP8 serving
#   bash bench/gpu_session.sh next-80b # 80B FP8 skinny tilings and MoE paths on its shapes, its 8k prefill's profile
#   bash bench/gpu_session.sh moe-prefill # 80B 8k prefill's host syncs, MoE prefill tiles (80B, 35B), 80B decode at 8k context
#   bash bench/gpu_session.sh moe-prefill-ab # padded router + MoE prefill tiles: tests, 80B/35B 8k prefill vs REV, 80B serving
#   bash bench/gpu_session.sh fused-quant # FP8 rows from norms/SwiGLU, one-launch in_proj: tests, FP8 decode vs REV
#   bash bench/gpu_session.sh skinny-moe # the skinny MoE's tilings on 80B's and 35B's experts
#   bash bench/gpu_session.sh fp8-moe # 80B FP8 batch-1 profile, 35B FP8 8k prefill, Kimi-Linear (bf16 MoE) against REV
#   bash bench/gpu_session.sh qwen    # Qwen3.5-0.8B / 9B decode + prefill with transformers
#   bash bench/gpu_session.sh more    # GEMV microbenchmarks and forced everywhere, Kimi-Linear, verification graphs
#   bash bench/gpu_session.sh defaults # cuBLAS + sync steps against the CUDA defaults; verify graphs in fp32
#   bash bench/gpu_session.sh diagnose # verification graphs in fp32, where batch-256 host time goes (9B, 0.8B)
#   bash bench/gpu_session.sh profiles # GPU idle gaps with overlap at two max_model_len, batch-1 kernels
#   bash bench/gpu_session.sh kimi-prefill # KDA/MLA prefill tests; 4k prefill: FLA public / direct, MLA sdpa
#   bash bench/gpu_session.sh final-qwen # 0.8B / 9B decode table runs, KDA decode + graph tests
#   bash bench/gpu_session.sh final-kimi # KDA prefill tests (direct path), Kimi-Linear decode + 4k prefill
#   bash bench/gpu_session.sh ttft    # prefix-cache TTFT on 9B shapes
#   bash bench/gpu_session.sh spec    # speculative decoding, eager verification, window kernels vs references
#   bash bench/gpu_session.sh sampling # decode with Qwen3.5's sampling defaults against greedy
#   bash bench/gpu_session.sh sampler-graphs # sampler graphs: tests, sampler timings, sampled decode A/B (prepare REV)
#   bash bench/gpu_session.sh prefill-ab # GDN prefill through FLA's internals against its public call
#   bash bench/gpu_session.sh prefill-host # prefill host changes against REV (prepare REV), conv prefill tile sweep
#   bash bench/gpu_session.sh prefill-final # prefill GPU tests, 8k prefill, profile_prefill at 1 / 4 running requests
#   bash bench/gpu_session.sh ab      # before/after decode on one GPU (first, here: bash bench/ab.sh prepare REV; carry .base)
#   bash bench/gpu_session.sh ab-pdl  # REV against the working tree with DELTASERVE_PDL=on, and the tree with it off
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
case "${1:-all}" in
  all)  # one pytest per group at once: the suite is bound by Triton/FLA compiling on the CPU, not the GPU
    run 560 engine-hf-tests python3 -m pytest -q -rA -m gpu tests/engine/test_gpu_engine.py &
    run 560 engine-rest-tests python3 -m pytest -q -rA -m gpu tests/engine tests/models \
      --ignore=tests/engine/test_gpu_engine.py &
    run 560 kda-tests python3 -m pytest -q -rA -m gpu tests/kernels/test_kda_cuda.py &
    run 560 kernel-tests python3 -m pytest -q -rA -m gpu tests/kernels --ignore=tests/kernels/test_kda_cuda.py &
    wait
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
  final-qwen)  # the decode table's commands (no transformers), then the KDA decode / graph tests
    run 130 final-0.8b python3 -m bench.engine.decode --model configs/qwen3.5-0.8b --batch-sizes 1 8 64 256 \
      --new-tokens 128 --prefill-len 8192 --json "$out/qwen3.5-0.8b.json"
    run 150 final-9b python3 -m bench.engine.decode --model configs/qwen3.5-9b --batch-sizes 1 8 64 256 \
      --new-tokens 128 --prefill-len 8192 --json "$out/qwen3.5-9b.json"
    run 150 kda-decode-tests python3 -m pytest -q -m gpu tests/kernels/test_kda_cuda.py -k "decode or graph"
    ;;
  final-kimi)  # KDA prefill below FLA's entry against its public call and the reference, Kimi's table
    run 260 kda-prefill-tests python3 -m pytest -v -m gpu tests/kernels/test_kda_cuda.py::test_kda_prefill_direct_equals_public \
      "tests/kernels/test_kda_cuda.py::test_kda_prefill[4-128-dtype1]" "tests/kernels/test_kda_cuda.py::test_kda_prefill[3-64-dtype0]"
    run 180 final-kimi python3 -m bench.engine.decode --model configs/kimi-linear-48b-a3b --batch-sizes 1 8 64 \
      --new-tokens 64 --prefill-len 4096 --json "$out/kimi.json"
    ;;
  ttft)
    run 100 ttft-9b python3 -m bench.engine.prefix_ttft --model configs/qwen3.5-9b --load-format dummy --device cuda \
      --sessions 16 --turns 4 --system-len 2048 --json "$out/ttft-9b.json"
    ;;
  more)
    run 40 gemv-0.8b python3 -m bench.ops.gemv --model configs/qwen3.5-0.8b --rows 1 2 4 8
    run 40 gemv-9b python3 -m bench.ops.gemv --model configs/qwen3.5-9b --rows 1 2 4 8
    DELTASERVE_GEMV=triton run 60 gemv-all-0.8b python3 -m bench.engine.decode --model configs/qwen3.5-0.8b \
      --batch-sizes 1 8 --new-tokens 128 --prefill-len 0
    DELTASERVE_GEMV=triton run 60 gemv-all-9b python3 -m bench.engine.decode --model configs/qwen3.5-9b \
      --batch-sizes 1 8 --new-tokens 128 --prefill-len 0
    run 180 bench-kimi python3 -m bench.engine.decode --model configs/kimi-linear-48b-a3b --batch-sizes 1 8 64 \
      --new-tokens 64 --prefill-len 4096 --json "$out/kimi.json"
    run 60 spec-verify-graphs python3 -m bench.engine.spec_decode --model configs/qwen3.5-0.8b --batch-sizes 1 16 \
      --drafter oracle --oracle-right 3 --verify-graphs
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
  sampler-graphs)  # sampling by graph replay: its GPU tests, the sampler alone, sampled decode before/after
    run 200 sampler-graph-tests python3 -m pytest -q -rA -m gpu tests/engine/sampling/test_sampler_graphs.py
    run 200 ab-sampled-0.8b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3.5-0.8b \
      --batch-sizes 1 8 32 --new-tokens 128 --prefill-len 0 --sampling qwen
    run 60 sampler-eager python3 -m bench.engine.sampler --batch-sizes 1 2 8 32 --iters 50
    run 60 sampler-graphs python3 -m bench.engine.sampler --batch-sizes 1 2 8 32 --iters 50 --graphs 32
    run 60 sampler-graphs-sort python3 -m bench.engine.sampler --batch-sizes 1 2 8 32 --iters 50 --graphs 32 \
      --graph-topk-min-rows 64
    run 100 prefill-0.8b python3 -m bench.engine.profile_prefill --model configs/qwen3.5-0.8b --tokens 8192
    ;;
  prefill-ab)  # FLA's GDN forward called directly (default) against its public entry (DELTASERVE_FLA_DIRECT=0)
    run 150 gdn-prefill-tests python3 -m pytest -q -rA -m gpu tests/kernels/test_cuda_kernels.py -k gdn_prefill
    for direct in 0 1; do
      DELTASERVE_FLA_DIRECT=$direct run 100 "profile-prefill-direct$direct" python3 -m bench.engine.profile_prefill \
        --model configs/qwen3.5-0.8b --tokens 8192 --rows 25 --cprofile 30
    done
    for model in qwen3.5-0.8b qwen3.5-9b; do
      for direct in 0 1; do
        DELTASERVE_FLA_DIRECT=$direct run 90 "prefill-$model-direct$direct" python3 -m bench.engine.decode \
          --model "configs/$model" --batch-sizes --prefill-len 8192
      done
    done
    ;;
  prefill-host)  # the prefill's host-side changes against REV (bench/ab.sh prepare REV), the conv tile sweep
    run 200 prefill-kernel-tests python3 -m pytest -q -rA -m gpu tests/kernels/test_cuda_kernels.py \
      -k "gdn_prefill or qk_norm or conv_prefill"
    run 100 conv-prefill-sweep python3 -m bench.ops.kernels --only conv_prefill --sweep
    run 160 ab-profile-prefill bash bench/ab.sh run python3 -m bench.engine.profile_prefill \
      --model configs/qwen3.5-0.8b --tokens 8192 --rows 12
    run 60 prefill-0.8b-overlap python3 -m bench.engine.decode --model configs/qwen3.5-0.8b --batch-sizes --prefill-len 8192
    run 60 prefill-0.8b-sync python3 -m bench.engine.decode --model configs/qwen3.5-0.8b --batch-sizes --prefill-len 8192 \
      --disable-overlap-schedule
    ;;
  prefill-final)  # the prefill changes' GPU tests, the 8k prefill figure, profile_prefill at 1 and 4 running requests
    run 200 prefill-kernel-tests python3 -m pytest -q -rA -m gpu tests/kernels/test_cuda_kernels.py \
      -k "gdn_prefill or qk_norm or conv_prefill"
    run 70 prefill-0.8b python3 -m bench.engine.decode --model configs/qwen3.5-0.8b --batch-sizes --prefill-len 8192
    for mr in 1 4; do
      run 70 "profile-prefill-mr$mr" python3 -m bench.engine.profile_prefill --model configs/qwen3.5-0.8b --tokens 8192 \
        --rows 5 --max-running-requests $mr
    done
    run 150 engine-hf-tests python3 -m pytest -q -rA -s -m gpu tests/engine/test_gpu_engine.py -k transformers
    ;;
  ab)  # a performance change against the commit exported by `bench/ab.sh prepare REV`
    for model in qwen3.5-0.8b qwen3.5-9b; do
      run 200 "ab-$model" bash bench/ab.sh run python3 -m bench.engine.decode --model "configs/$model" \
        --batch-sizes 1 8 256 --new-tokens 128 --prefill-len 0
    done
    ;;
  ab-pdl)  # before (REV, no PDL) / after (working tree, DELTASERVE_PDL=on), then the tree with PDL off
    for model in qwen3.5-9b qwen3.5-0.8b; do
      DELTASERVE_PDL=on run 190 "ab-$model" bash bench/ab.sh run python3 -m bench.engine.decode \
        --model "configs/$model" --batch-sizes 1 8 --new-tokens 128 --prefill-len 0
      run 70 "nopdl-$model" python3 -m bench.engine.decode --model "configs/$model" \
        --batch-sizes 1 8 --new-tokens 128 --prefill-len 0
    done
    ;;
  fp8)  # FP8 GPU tests at once; each FP8 path and tiling on 9B's and 80B's dense shapes, 80B's experts
    run 200 fp8-kernel-tests python3 -m pytest -q -rfE -m gpu tests/kernels/test_fp8_cuda.py tests/kernels/test_moe_cuda.py &
    run 200 fp8-model-tests python3 -m pytest -q -rfE -s -m gpu tests/models/test_fp8_checkpoints.py &
    wait
    run 150 fp8-gemv python3 -m bench.ops.fp8_gemv --model configs/qwen3.5-9b --rows 1 2 8 32 --gemm-tiles 64:4 32:6 \
      --gemv-tiles 4:4 8:4 2:8 4:2 16:2 --moe configs/qwen3-next-80b-a3b-fp8 --tokens 1 8 32
    run 100 fp8-gemv-80b python3 -m bench.ops.fp8_gemv --model configs/qwen3-next-80b-a3b-fp8 --rows 1 8 32 \
      --gemm-tiles 64:4 32:6 --gemv-tiles 4:4 8:4 2:8 16:2
    ;;
  fp8-ab)  # 9B FP8 decode against REV (prepare REV), 80B FP8 decode
    run 170 ab-9b-fp8 bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3.5-9b-fp8 \
      --batch-sizes 1 8 --prompt-len 512 --new-tokens 128 --prefill-len 0
    run 120 80b-fp8 python3 -m bench.engine.decode --model configs/qwen3-next-80b-a3b-fp8 --batch-sizes 1 32 \
      --prompt-len 1024 --new-tokens 128 --prefill-len 0
    ;;
  fp8-decode)  # FP8 GPU tests; 80B-A3B FP8 decode against REV (prepare REV)
    run 240 fp8-kernel-tests python3 -m pytest -q -rfE -m gpu tests/kernels/test_fp8_cuda.py tests/kernels/test_moe_cuda.py &
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
  shared-fusion)  # the fused shared expert: GPU tests; 80B-A3B FP8 decode against REV, and with it off
    run 240 fusion-tests python3 -m pytest -q -rfE -s -m gpu tests/models/test_shared_expert_fusion.py \
      tests/kernels/test_router_cuda.py tests/models/test_fp8_checkpoints.py &
    run 240 fp8-kernel-tests python3 -m pytest -q -rfE -m gpu tests/kernels/test_fp8_cuda.py -k "pdl or moe" \
      tests/kernels/test_moe_cuda.py &
    wait
    run 200 ab-80b-fp8 bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3-next-80b-a3b-fp8 \
      --batch-sizes 1 8 --prompt-len 1024 --new-tokens 64 --prefill-len 0
    DELTASERVE_SHARED_EXPERT_TOKENS=0 run 120 apart-80b-fp8 python3 -m bench.engine.decode \
      --model configs/qwen3-next-80b-a3b-fp8 --batch-sizes 1 8 --prompt-len 1024 --new-tokens 64 --prefill-len 0
    ;;
  shared-fusion-2)  # 35B-A3B FP8 decode and 8k prefill against REV and with the fusion off; Kimi-Linear against REV
    run 200 ab-35b-fp8 bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3.5-35b-a3b-fp8 \
      --batch-sizes 1 8 --new-tokens 64 --prefill-len 8192
    DELTASERVE_SHARED_EXPERT_TOKENS=0 run 100 apart-35b-fp8 python3 -m bench.engine.decode \
      --model configs/qwen3.5-35b-a3b-fp8 --batch-sizes 1 8 --new-tokens 64 --prefill-len 8192
    run 250 ab-kimi bash bench/ab.sh run python3 -m bench.engine.decode --model configs/kimi-linear-48b-a3b \
      --batch-sizes 1 8 --new-tokens 64 --prefill-len 0
    ;;
  shared-fusion-bf16)  # the fused shared expert's GPU tests; bf16 MoE decode (35B-A3B, Kimi-Linear) against REV
    run 300 fusion-tests python3 -m pytest -q -rfE -s -m gpu tests/models/test_shared_expert_fusion.py \
      tests/kernels/test_router_cuda.py
    run 200 ab-35b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3.5-35b-a3b --batch-sizes 1 8 16 \
      --new-tokens 64 --prefill-len 0
    run 250 ab-kimi bash bench/ab.sh run python3 -m bench.engine.decode --model configs/kimi-linear-48b-a3b \
      --batch-sizes 1 8 --new-tokens 64 --prefill-len 0
    ;;
  pairs-router)  # fusion, router and FP8 GPU tests; 80B FP8 batch 1 against REV; the per-pair MoE limit on 35B FP8; 80B profile
    run 240 fusion-tests python3 -m pytest -q -rfE -s -m gpu tests/models/test_shared_expert_fusion.py \
      tests/kernels/test_router_cuda.py &
    run 240 fp8-tests python3 -m pytest -q -rfE -s -m gpu tests/models/test_fp8_checkpoints.py \
      tests/kernels/test_fp8_cuda.py -k "moe or pdl or skinny or checkpoint" &
    wait
    run 150 ab-80b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3-next-80b-a3b-fp8 \
      --batch-sizes 1 --prompt-len 1024 --new-tokens 64 --prefill-len 0
    for p in 128 1024; do
      run 90 pairs-35b-$p python3 -m bench.engine.decode --model configs/qwen3.5-35b-a3b-fp8 --batch-sizes 8 16 32 64 \
        --new-tokens 64 --prefill-len 0 --moe-pairs $p
    done
    run 100 profile-80b python3 -m bench.engine.profile_decode --model configs/qwen3-next-80b-a3b-fp8 --batch-size 1 \
      --prompt-len 1024 --rows 30
    ;;
  pairs-2)  # router + FP8 MoE tests; the per-pair MoE limit on 80B FP8; 80B's batch-1 kernels without PDL
    run 150 router-tests python3 -m pytest -q -rfE -m gpu tests/kernels/test_router_cuda.py &
    run 150 moe-tests python3 -m pytest -q -rfE -m gpu tests/kernels/test_fp8_cuda.py -k "moe" &
    wait
    for p in 128 1024; do
      run 120 pairs-80b-$p python3 -m bench.engine.decode --model configs/qwen3-next-80b-a3b-fp8 \
        --batch-sizes 16 32 64 --prompt-len 1024 --new-tokens 64 --prefill-len 0 --moe-pairs $p
    done
    DELTASERVE_PDL=off run 100 profile-80b-nopdl python3 -m bench.engine.profile_decode \
      --model configs/qwen3-next-80b-a3b-fp8 --batch-size 1 --prompt-len 1024 --rows 30
    ;;
  pairs-3)  # router, FP8 MoE and FP8 engine tests; 80B FP8 batch 1 against REV; issue 24's serving row
    run 230 fp8-engine-test python3 -m pytest -q -rfE -s -m gpu tests/models/test_fp8_checkpoints.py &
    run 100 router-tests python3 -m pytest -q -rfE -m gpu tests/kernels/test_router_cuda.py &
    run 150 moe-tests python3 -m pytest -q -rfE -m gpu tests/kernels/test_fp8_cuda.py -k "moe or skinny or gemv" &
    wait
    run 110 ab-80b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3-next-80b-a3b-fp8 \
      --batch-sizes 1 --prompt-len 1024 --new-tokens 64 --prefill-len 0
    run 200 serve-80b bash bench/serve_session.sh 80b-fp8
    ;;
  pairs-4)  # FP8 MoE tests; issue 24's serving row with KV pages planned for each request
    run 120 moe-tests python3 -m pytest -q -rfE -m gpu tests/kernels/test_fp8_cuda.py -k "moe_matches or skinny"
    run 230 serve-80b bash bench/serve_session.sh 80b-fp8
    ;;
  next-80b)  # 80B FP8: the skinny GEMM's tilings and the MoE paths on its own shapes; where an 8k prefill goes
    run 200 skinny-80b python3 -m bench.ops.fp8_gemv --model configs/qwen3-next-80b-a3b-fp8 --rows 1 4 16 \
      --skinny-tiles 64:4:1 64:4:2 64:4:4 64:6:2 128:4:1 128:4:2 128:6:2
    run 120 moe-80b python3 -m bench.ops.fp8_gemv --moe configs/qwen3-next-80b-a3b-fp8 --tokens 1 8 16 32 48 64
    run 150 prefill-80b python3 -m bench.engine.profile_prefill --model configs/qwen3-next-80b-a3b-fp8 --tokens 8192
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
  moe-prefill-ab)  # the padded router and the MoE's prefill tiles: their GPU tests; 80B / 35B FP8 8k prefill against REV; 80B serving
    run 150 moe-tests python3 -m pytest -q -m gpu tests/kernels/test_fp8_cuda.py -k fp8_moe tests/models/test_shared_expert_fusion.py
    run 150 prefill-ab-80b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3-next-80b-a3b-fp8 \
      --batch-sizes 1 --new-tokens 8 --prefill-len 8192
    run 130 prefill-ab-35b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3.5-35b-a3b-fp8 \
      --batch-sizes 1 --new-tokens 8 --prefill-len 8192
    bash bench/serve_session.sh 80b-fp8 > /dev/null 2>&1
    tail -16 "$out/serve.log"
    ;;
  fp8-moe)  # where 80B FP8's batch-1 step goes; 35B-A3B FP8 8k prefill; bf16 MoE decode and 4k prefill (Kimi-Linear) against REV
    run 120 profile-80b-fp8 python3 -m bench.engine.profile_decode --model configs/qwen3-next-80b-a3b-fp8 --batch-size 1 \
      --prompt-len 1024 --rows 25
    run 150 35b-fp8 python3 -m bench.engine.decode --model configs/qwen3.5-35b-a3b-fp8 --batch-sizes 1 \
      --new-tokens 64 --prefill-len 8192
    run 250 ab-kimi bash bench/ab.sh run python3 -m bench.engine.decode --model configs/kimi-linear-48b-a3b \
      --batch-sizes 1 8 --new-tokens 64 --prefill-len 4096
    ;;
  fused-quant)  # FP8 rows from the norms/SwiGLU, one-launch in_proj: tests; 9B / 80B / 35B FP8 decode vs REV
    run 150 quant-tests python3 -m pytest -q -rfE -s -m gpu tests/kernels/test_fused_quant.py \
      tests/kernels/test_norm_kernels.py tests/kernels/test_router_cuda.py tests/models/test_fp8_checkpoints.py \
      tests/models/test_shared_expert_fusion.py &
    run 150 fp8-tests python3 -m pytest -q -rfE -m gpu tests/kernels/test_fp8_cuda.py \
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
    run 120 ab-80b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3-next-80b-a3b-fp8 \
      --batch-sizes 1 --prompt-len 1024 --new-tokens 64 --prefill-len 0
    run 110 ab-35b bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3.5-35b-a3b-fp8 \
      --batch-sizes 1 8 --new-tokens 64 --prefill-len 0
    ;;
  *)
    echo "usage: $0 all|fused-quant|skinny-moe|fp8|fp8-ab|fp8-moe|fp8-decode|fp8-decode-2|shared-fusion|shared-fusion-2|shared-fusion-bf16|pairs-router|pairs-2|pairs-3|pairs-4|next-80b|qwen|more|defaults|diagnose|profiles|kimi-prefill|ttft|spec|sampling|sampler-graphs|prefill-ab|prefill-host|prefill-final|ab|ab-pdl" >&2
    exit 2
    ;;
esac
