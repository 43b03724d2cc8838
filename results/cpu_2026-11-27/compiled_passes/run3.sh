#!/bin/bash
# run2.sh's passes apart beside 4 chained, on three more prompts (--seed=1, 2, 3: other validation
# windows), to pool with its own prompt. From the repo root; each log's first line has the command.
set -e
dir=results/cpu_2026-11-27/compiled_passes
common="--decode_batches=1 --decode_prompt=64 --decode_tokens=60 --bench_steps=10 --compile=True"
run() {     # name, then bench.py's options
  name=$1; shift
  echo "python bench.py $* $common --out=$dir/$name.json" > $dir/$name.log
  python bench.py "$@" $common --out=$dir/$name.json 2>&1 | tee -a $dir/$name.log
}
for seed in 1 2 3; do
  run prompt${seed}_exit_E2_apart_chained --init_from=out/gpu/spec_exit_w4d2 --draft_layers=2 \
    --speculate=2,4 --passes_per_graph=1,4 --seed=$seed
  run prompt${seed}_mod_apart_chained --init_from=out/gpu/spec_mod --speculate=4,8 \
    --passes_per_graph=1,4 --seed=$seed
done
