#!/usr/bin/env bash
# Every benchmark behind BENCHMARKS.md sections 2, 3, 5 (TLS), 6, 7, 8 and 9 (its CPU side), one after another
# (run nothing else meanwhile: the machine has 2 cores). About 4.5 hours on a 2-core CPU. Outputs go to bench-out/.
#   bash bench/run_all.sh [STEP...]     steps: past spec-main serving shared-doc spec-other drafting
#                                               model-drafting model-mix model-replay hints-cost hints-main
#                                               hints-other hints-replay edge-network gpu-refs gpu-projection
#                                               gpu-projection-hints host-cpu
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
OUT=bench-out
mkdir -p "$OUT"
OTHER=writing,roleplay,reasoning,math,coding,extraction,stem,humanities,translation,qa,math_reasoning
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(past spec-main serving shared-doc spec-other drafting model-drafting model-mix \
  model-replay hints-cost hints-main hints-other hints-replay edge-network gpu-refs gpu-projection \
  gpu-projection-hints host-cpu)

for step in "${steps[@]}"; do
  echo "=== $step $(date -u +%H:%M:%S)"
  case $step in
    past)  # sampled earlier answers to the rag prompts: the long-term datastore of the RAG comparison
      $BIN/python bench/past_outputs.py --category rag --per-category 6 --samples 2 -o $OUT/rag-past.jsonl ;;
    spec-main)
      $BIN/specedge bench --workload specbench:summarization,rag --per-category 6 --max-new-tokens 128 \
        --reps 3 --chat --baselines ar,hf-pld,suffix,oracle --corpus $OUT/rag-past.jsonl --out $OUT/spec-main ;;
    serving)
      $BIN/specedge bench --workload specbench:summarization,rag --per-category 4 --max-new-tokens 128 \
        --reps 2 --chat --concurrency 1,4,16 --baselines server-ar --out $OUT/serving ;;
    shared-doc)
      $BIN/specedge bench --workload shared-doc:16 --max-new-tokens 64 --reps 1 --chat \
        --concurrency 1,16 --baselines server-ar --out $OUT/shared-doc ;;
    spec-other)
      $BIN/specedge bench --workload specbench:$OTHER --per-category 2 --max-new-tokens 128 \
        --reps 2 --chat --baselines ar,suffix --out $OUT/spec-other ;;
    drafting)
      $BIN/python bench/drafting_bench.py --out $OUT/drafting ;;
    model-drafting)  # section 6: edge and verifier on one core each, at 0 and 80 ms
      $BIN/specedge bench --model gemma3-270m --workload specbench:all --per-category 1 --pin-cores 0,1 \
        --drafters retrieval,model:smollm2-135m,hybrid --baselines ar,hf-ar,hf-uag --max-new-tokens 96 \
        --reps 2 --rtt-ms 0,80 --out $OUT/model-drafting ;;
    model-mix)  # section 6: four clients with different drafters on one verifier
      $BIN/specedge bench --model gemma3-270m --workload specbench:all --per-category 1 --concurrency 4 \
        --drafters mix:retrieval+model:smollm2-135m+model:gemma3-270m+hybrid --baselines server-ar \
        --max-new-tokens 96 --reps 2 --out $OUT/model-mix ;;
    model-replay)  # sections 6 and 8: hybrid against retrieval on separate machines, by timed replay of the
      # committed greedy outputs (docs/benchmarks/model-drafting/README.md): a half of the prompts per core,
      # at 80 ms and 0 ms round trips, per-category intervals. About 35 minutes. MODEL_REPLAY_COST: replay.py's
      # --cost (cpu:docs/benchmarks/model-drafting/engine-gemma3-270m.json:gemma3-270m: Gemma's own steps).
      R=docs/benchmarks/model-drafting
      for rtt in ${MODEL_REPLAY_RTTS:-80 0}; do
        pids=()
        for half in a b; do
          core=$([ $half = a ] && echo 0 || echo 1)
          taskset -c $core $BIN/python bench/replay.py $R/refs-gemma3-270m-$half.jsonl --model gemma3-270m \
            --drafters ${MODEL_REPLAY_DRAFTERS:-retrieval,hybrid} --timed --base-ms 89 --cost ${MODEL_REPLAY_COST:-cpu} --rtt-ms $rtt \
            --out $OUT/model-replay-$rtt-$half.jsonl > $OUT/model-replay-$rtt-$half.log 2>&1 &
          pids+=($!)
        done
        for pid in "${pids[@]}"; do wait "$pid"; done  # (a failed half stops the step)
        $BIN/python -m specedge.bench.category_intervals $OUT/model-replay-$rtt-{a,b}.jsonl --method hybrid \
          --against retrieval --baseline ar | tee $OUT/model-replay-$rtt.txt
      done ;;
    hints-cost)  # section 7: what hints add to a verifier pass and a verdict, one thread as a pinned verifier
      $BIN/python bench/hints_cost.py --threads 1 --out $OUT/hints-cost ;;
    hints-main)  # section 7: retrieval with and without the verifier's hints, against the peers
      $BIN/specedge bench --workload specbench:summarization,rag --per-category 6 --max-new-tokens 128 \
        --reps 3 --chat --drafters retrieval:no-hints,retrieval --baselines ar,hf-pld,suffix --out $OUT/hints-main ;;
    hints-other)
      $BIN/specedge bench --workload specbench:$OTHER --per-category 2 --max-new-tokens 128 \
        --reps 2 --chat --drafters retrieval:no-hints,retrieval --baselines ar,suffix --out $OUT/hints-other ;;
    edge-network)  # section 8: round trips through the network proxy, tree sizes, trees sent ahead; report + plots
      $BIN/specedge bench --workload specbench:summarization,rag --per-category 3 --max-new-tokens 96 --reps 2 \
        --chat --rtt-ms 0,80,150 --tree-size adaptive,8,32 --overlap on,off --fill on,off --baselines server-ar,remote-ar \
        --out $OUT/edge-network ;;
    gpu-refs)  # section 9: the greedy outputs whose acceptance the GPU projection replays (committed as refs-*.jsonl)
      $BIN/specedge bench --workload specbench:summarization,rag --per-category 6 --max-new-tokens 128 --reps 1 \
        --chat --drafters retrieval --baselines ar --out $OUT/gpu-refs-smollm2
      $BIN/specedge bench --model gemma3-270m --workload specbench:summarization,rag --per-category 6 \
        --max-new-tokens 128 --reps 1 --drafters retrieval --baselines ar --out $OUT/gpu-refs-gemma3 ;;
    gpu-projection)  # section 9: GPU pass costs (measured on an H200) x acceptance replayed from the refs
      G=docs/benchmarks/gpu
      $BIN/python bench/gpu_projection.py $G/h200-hints.json $G/refs-smollm2-135m.jsonl --model smollm2-135m --chat \
        --shapes smollm2-135m,llama-1b,llama-8b --out $OUT/projection-smollm2-135m.json
      $BIN/python bench/gpu_projection.py $G/h200-hints.json $G/refs-smollm2-135m.jsonl --model smollm2-135m --chat \
        --shapes smollm2-135m,llama-1b,llama-8b --hints on-path --out $OUT/projection-smollm2-135m-hints.json
      $BIN/python bench/gpu_projection.py $G/h200-hints.json $G/refs-gemma3-270m.jsonl --model gemma3-270m \
        --shapes gemma3-270m --out $OUT/projection-gemma3-270m.json ;;
    gpu-projection-hints)  # section 9: every node's hints from the model (bench/model_hints.py, cached beside the
      # refs: ~20 min the first time, ~1 min a line after), on run 6's costs with and without the hints' measured
      # cost, and on run 9a's compiled costs without it (a bound: run 9a did not measure hints)
      G=docs/benchmarks/gpu
      P="$BIN/python bench/gpu_projection.py"
      R="$G/refs-smollm2-135m.jsonl --model smollm2-135m --chat --shapes smollm2-135m"
      for rep in 1 2 3; do
        $P $G/h200-run6.json $R --out $OUT/projection-run6-$rep.json
        $P $G/h200-run6.json $R --hints model --out $OUT/projection-run6-model-hints-$rep.json
        $P $G/h200-run6.json $R --hints model --free-hints --out $OUT/projection-run6-free-hints-$rep.json
        $P $G/h200-run9a-compiled-smollm2-135m.json $R --out $OUT/projection-run9a-$rep.json
        $P $G/h200-run9a-compiled-smollm2-135m.json $R --hints model --free-hints \
          --out $OUT/projection-run9a-free-hints-$rep.json
      done ;;
    hints-replay)  # section 7: tokens per pass with every node's hints from the model, CPU and free passes
      for cost in ${HINTS_REPLAY_COSTS:-cpu flat}; do
        $BIN/python bench/replay.py $OUT/hints-main/runs.jsonl --chat --hints model --cost $cost --by-source \
          --drafters retrieval:no-hints,retrieval
      done ;;
    host-cpu)  # sections 5 and 9: a served round's cost to the verifier's host: TLS against plaintext; 1 and 16
      # clients, SmolLM2 and the tiny stand-in for a GPU's short step (bench/round_split.py)
      for tls in plain tls mutual; do
        $BIN/python bench/round_split.py --rounds 150 --reps 3 --pin 0,1 --generate --tls $tls \
          | tee $OUT/host-cpu-$tls.txt
      done
      for shape in "" "--shape tiny"; do
        $BIN/python bench/round_split.py --clients 16 --rounds 200 --reps 2 --pin 0,1 --generate $shape \
          | tee -a $OUT/host-cpu-16.txt
      done ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
