set -u; export PYTHONUNBUFFERED=1; o=$OUT
timeout 60 python3 -m bench.profile_decode --model configs/qwen3.5-0.8b --batch-size 1 > $o/prof-08-bs1.log 2>&1; echo prof1 $?
timeout 60 python3 -m bench.profile_decode --model configs/qwen3.5-0.8b --batch-size 1 --disable-cuda-graph --rows 40 > $o/prof-08-bs1-eager.log 2>&1; echo prof2 $?
timeout 60 python3 -m bench.profile_decode --model configs/qwen3.5-0.8b --batch-size 256 > $o/prof-08-bs256.log 2>&1; echo prof3 $?
timeout 60 python3 -m bench.profile_decode --model configs/qwen3.5-9b --batch-size 1 > $o/prof-9b-bs1.log 2>&1; echo prof4 $?
timeout 120 python3 -m pytest -q -m gpu tests/engine tests/kernels/test_moe_cuda.py tests/kernels/test_window_kernels.py tests/kernels/test_mla_cuda.py > $o/gpu-tests.log 2>&1; echo tests $?; tail -3 $o/gpu-tests.log
timeout 70 python3 -m bench.spec_decode --model configs/qwen3.5-0.8b --batch-sizes 1 16 --drafter oracle --oracle-right 3 --json $o/spec-oracle.json > $o/spec-oracle.log 2>&1; echo spec $?; tail -2 $o/spec-oracle.log
