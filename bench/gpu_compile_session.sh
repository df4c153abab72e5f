#!/usr/bin/env bash
# One call on a lent GPU machine (issue 13, BENCHMARKS.md section 9, run 9): does torch.compile of each layer's
# dense parts (cloud/models/llama.py `compile`) make a tree pass grow less with its tokens? The CUDA tests
# (the compiled layers' greedy parity among them), then bench/gpu_bench.py per shape without and with
# --compile, each in its own process, on the same machine.
#   (device tool) run: bash bench/gpu_compile_session.sh   carry: [".whl", "protos/gen"]
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
PKG=/tmp/pkg/specedge
mkdir -p "$PKG"
for part in __init__.py bench cli cloud common edge netem; do ln -sfn "$PWD/$part" "$PKG/$part"; done
ln -sfn "$PWD/protos/gen" "$PKG/protos"
export PYTHONPATH=/tmp/site:/tmp/pkg
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
[ "${TESTS:-1}" = 1 ] && timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_engine_devices.py \
    tests/test_engine_parity.py > "$OUT/cuda-tests.log" 2>&1
echo "cuda tests: exit $?"; tail -3 "$OUT/cuda-tests.log"
ARGS="--contexts 512 --sessions 1,16 --hints 0 --decode-reps 1 --reps 10"
for shape in ${SHAPES:-smollm2-135m llama-8b}; do
    for mode in ${MODES:-base compiled}; do
        flag=""; [ "$mode" = compiled ] && flag=--compile
        # shellcheck disable=SC2086
        timeout 200 python3 bench/gpu_bench.py --shapes "$shape" $ARGS $flag --out "$OUT/$mode-$shape.json" \
            >> "$OUT/bench.log" 2>&1
        echo "$shape $mode: exit $?"
    done
done
python3 - "$OUT" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    for s in json.loads(f.read_text())["shapes"]:
        one = {r["tokens"]: r["ms"] for r in s["by_tree_tokens"]}
        many = {r["tokens_each"]: r["ms"] for r in s["by_sessions"] if r["sessions"] == 16}
        print(f"{f.stem:28s} warm-up {s.get('warmup_s', 0):5.1f}s decode {s['decode']['engine_tok_s']:.0f} tok/s | "
              + " ".join(f"{t}:{ms:.2f}" for t, ms in one.items()) + " | 16x: "
              + " ".join(f"{t}:{ms:.2f}" for t, ms in many.items()))
PY
