#!/bin/bash
# ffn (its distilled draft) and halt, both sides compiled, passes apart beside 4 chained in one
# process, on four prompts (--seed=0..3: other validation windows), as compiled_passes/ did for
# exit and mod. The compiled code of the first prompt's run is kept in a compile cache the others
# read (timings are of warm steps either way). From the repo root; each log's first line has the
# command.
set -e
dir=results/cpu_2026-11-27/compiled_ffn_halt
common="--decode_batches=1 --decode_prompt=64 --decode_tokens=60 --bench_steps=10 --compile=True"
run() {     # name, then bench.py's options
  name=$1; shift
  echo "python bench.py $* $common --out=$dir/$name.json" > $dir/$name.log
  python bench.py "$@" $common --out=$dir/$name.json 2>&1 | tee -a $dir/$name.log
}
for seed in 0 1 2 3; do
  run prompt${seed}_ffn_apart_chained --init_from=out/gpu/ffn_distilled_drafter_shakespeare \
    --speculate=2,4 --passes_per_graph=1,4 --seed=$seed --compile_cache=out/cpu_compile_ffn.bin
  run prompt${seed}_halt_apart_chained --init_from=out/gpu/spec_halt --speculate=2,4 \
    --passes_per_graph=1,4 --seed=$seed --compile_cache=out/cpu_compile_halt.bin
done
