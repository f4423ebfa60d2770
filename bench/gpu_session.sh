#!/usr/bin/env bash
# One device call: the engine's GPU tests and the decode/prefill benchmarks, logs under $OUT.
# Run from the repo root after installing the wheels (see docs/performance.md).
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -m gpu tests/engine/test_gpu_engine.py tests/kernels/test_moe_cuda.py 2>&1 | tail -40 > "$out/gpu_tests.log"
timeout 170 python3 -m bench.decode --model configs/qwen3.5-0.8b --batch-sizes 1 8 64 256 --new-tokens 128 \
  --prefill-len 8192 --hf --hf-new-tokens 16 --json "$out/qwen3.5-0.8b.json" > "$out/bench-0.8b.log" 2>&1
timeout 170 python3 -m bench.decode --model configs/qwen3.5-9b --batch-sizes 1 8 64 256 --new-tokens 128 \
  --prefill-len 8192 --hf --hf-new-tokens 16 --json "$out/qwen3.5-9b.json" > "$out/bench-9b.log" 2>&1
tail -5 "$out"/*.log
