#!/usr/bin/env bash
# One device call (about 9 minutes): the engine-level GPU tests, then the end-to-end
# benchmarks, logs and JSON under $OUT. The kernel tests (tests/kernels/test_cuda_kernels.py,
# test_kda_cuda.py: ~8 minutes of Triton/FLA compilation) are left to their own call.
#
# On the GPU machine, from the repository root, after the wheels are installed:
#   bash bench/gpu_session.sh
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
run 110 bench-0.8b python3 -m bench.decode --model configs/qwen3.5-0.8b --batch-sizes 1 8 64 256 \
  --new-tokens 128 --prefill-len 8192 --hf --hf-new-tokens 16 --json "$out/qwen3.5-0.8b.json"
run 150 gpu-tests python3 -m pytest -q -m gpu tests/engine tests/kernels/test_moe_cuda.py tests/kernels/test_window_kernels.py
run 110 bench-9b python3 -m bench.decode --model configs/qwen3.5-9b --batch-sizes 1 8 64 256 \
  --new-tokens 128 --prefill-len 8192 --hf --hf-new-tokens 16 --json "$out/qwen3.5-9b.json"
run 80 ttft-9b python3 -m bench.prefix_ttft --model configs/qwen3.5-9b --load-format dummy --device cuda \
  --sessions 16 --turns 4 --system-len 2048 --json "$out/ttft-9b.json"
run 60 spec-0.8b python3 -m bench.spec_decode --model configs/qwen3.5-0.8b --batch-sizes 1 16 \
  --num-speculative-tokens 3 --json "$out/spec-0.8b.json"
