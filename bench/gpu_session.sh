#!/usr/bin/env bash
# One call on a lent GPU machine (issue 13; BENCHMARKS.md section 9): the CUDA tests, then the pass-cost
# sweep of bench/gpu_bench.py. The machine has torch and transformers but neither this package's layout nor
# its wire libraries, so the call carries the generated stubs and wheels of the pinned gRPC stack:
#
#   (here, once) python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl protobuf==7.36.2 grpcio==1.85.1 grpcio-health-checking==1.85.1 \
#       grpcio-reflection==1.85.1 platformdirs
#   (device tool) run: bash bench/gpu_session.sh   carry: [".whl", "protos/gen"]
#
# `bash bench/gpu_session.sh round-split` (a second call: the first nearly fills one call's 600 s) times a
# served round's legs instead, with the verifier in its own process (bench/round_split.py): SmolLM2's shape
# compiled (and the host's CPU a round and a decoded token), and a bare gRPC server holding each round for as
# long as SmolLM2's pass, the floor beside it; last, the host's CPU per session round with 16 clients at once.
#
# GPU_BENCH_ARGS overrides the sweep's arguments (by default with compiled layers, as `specedge serve` runs on a
# GPU; Gemma 3's shape in place of the 1B's, whose compiled timings run 9 has and Gemma's compiled layers lack);
# results land in $OUT (cuda-tests.log, gpu.json, gpu.log).
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
fi
# The repository's root is the package `specedge`, its stubs under protos/gen (pyproject's package-dir).
PKG=/tmp/pkg/specedge
mkdir -p "$PKG"
for part in __init__.py bench cli cloud common edge netem; do ln -sfn "$PWD/$part" "$PKG/$part"; done
ln -sfn "$PWD/protos/gen" "$PKG/protos"
export PYTHONPATH=/tmp/site:/tmp/pkg
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, grpc; print('torch', torch.__version__, 'transformers', transformers.__version__,
'grpc', grpc.__version__)"

if [ "${1:-}" = round-split ]; then
    timeout 240 python3 bench/round_split.py --shape smollm2-135m --device cuda --dtype bfloat16 --compile on \
        --rounds 200 --reps 3 --generate 2>&1 | tee "$OUT/round-split.log" | grep -v "^W" | tail -4
    timeout 100 python3 bench/round_split.py --floor-ms 3 --rounds 400 --reps 3 2>&1 | tee -a "$OUT/round-split.log" | tail -3
    timeout 200 python3 bench/round_split.py --shape smollm2-135m --device cuda --dtype bfloat16 --compile on \
        --clients 16 --rounds 200 --reps 2 --generate 2>&1 | tee -a "$OUT/round-split.log" | grep "^rep"
    exit 0
fi

timeout "${TEST_TIMEOUT:-180}" python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_engine_parity.py \
    tests/test_engine_devices.py tests/test_engine_sampling.py tests/test_grpc_cuda.py tests/test_prompt_hints.py \
    > "$OUT/cuda-tests.log" 2>&1
echo "cuda tests: exit $?"; tail -3 "$OUT/cuda-tests.log"

# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-330}" python3 bench/gpu_bench.py ${GPU_BENCH_ARGS:---shapes gemma3-270m,smollm2-135m,llama-8b \
    --contexts 512 --sessions 1,16,64 --hints 8 --decode-reps 1 --compile} --out "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu.log" | tail -40
echo "bench: exit ${PIPESTATUS[0]}"
