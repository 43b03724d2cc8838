#!/bin/bash
# The variants of run.sh timed in one process each, against one plain decode: a pass as one graph
# and 2 or 4 chained (--one_graph=True --passes_per_graph=1,2,4), and passes apart beside 4 chained
# (--passes_per_graph=1,4). From the repo root; each log's first line has the command.
set -e
dir=results/cpu_2026-11-27/compiled_passes
common="--decode_batches=1 --decode_prompt=64 --decode_tokens=60 --bench_steps=10 --compile=True"
run() {     # name, then bench.py's options
  name=$1; shift
  echo "python bench.py $* $common --out=$dir/$name.json" > $dir/$name.log
  python bench.py "$@" $common --out=$dir/$name.json 2>&1 | tee -a $dir/$name.log
}
exit_model="--init_from=out/gpu/spec_exit_w4d2 --draft_layers=2 --speculate=2,4"
mod_model="--init_from=out/gpu/spec_mod --speculate=4,8"
run together_exit_E2_one_graph_chained $exit_model --one_graph=True --passes_per_graph=1,2,4
run together_exit_E2_apart_chained $exit_model --passes_per_graph=1,4
run together_mod_one_graph_chained $mod_model --one_graph=True --passes_per_graph=1,2,4
run together_mod_apart_chained $mod_model --passes_per_graph=1,4
